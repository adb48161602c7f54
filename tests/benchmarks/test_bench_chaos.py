"""bench_chaos's own honesty, without a server: each way a request can end is counted as its kind
(against a loopback server that answers, turns away, closes mid-request, says Connection: close, or is
not there), and detection, recovery, p99 and the table read the samples right."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_chaos
from bench_chaos import Request


def _server(behaviour: list[bytes | None]) -> tuple[str, threading.Event]:
    """A loopback server answering the n-th request of any connection with ``behaviour[n % len]``: the
    bytes of an answer, or None to close the connection without one. Returns its URL and a stop event."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    sock.settimeout(0.1)
    stop = threading.Event()
    served = [0]

    def handle(conn: socket.socket) -> None:
        with conn:
            reader = conn.makefile("rb")
            while not stop.is_set():
                length = 0
                line = reader.readline()
                if not line:
                    return
                while (line := reader.readline()) not in (b"\r\n", b""):
                    name, _, value = line.partition(b":")
                    length = int(value) if name.lower() == b"content-length" else length
                reader.read(length)
                answer = behaviour[served[0] % len(behaviour)]
                served[0] += 1
                if answer is None:
                    return
                conn.sendall(answer)
                if b"connection: close" in answer:
                    return

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            threading.Thread(target=handle, args=(conn,), daemon=True).start()
        sock.close()

    threading.Thread(target=accept, daemon=True).start()
    return f"http://127.0.0.1:{sock.getsockname()[1]}", stop


def _answer(status: int, *, close: bool = False) -> bytes:
    body = b"{}"
    extra = b"connection: close\r\n" if close else b""
    return b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n%s\r\n%s" % (status, len(body), extra, body)


def test_every_ending_of_a_request_is_counted_as_its_kind() -> None:
    behaviour = [_answer(200), _answer(503, close=True), _answer(200), None, _answer(500), _answer(429)]
    url, stop = _server(behaviour)
    try:
        out = bench_chaos.run_load(url, [b"{}"], clients=1, until=time.monotonic() + 0.5, timeout_s=5)
    finally:
        stop.set()
    kinds = [r.kind for r in out]
    assert kinds[:6] == ["answered", "turned_away", "answered", "dropped", "5xx", "turned_away"]
    assert set(kinds) <= {"answered", "turned_away", "dropped", "5xx"}


def test_a_server_that_is_not_there_is_refused_and_a_silent_one_times_out() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    out = bench_chaos.run_load(
        f"http://127.0.0.1:{port}", [b"{}"], clients=2, until=time.monotonic() + 0.3, timeout_s=5
    )
    assert out and {r.kind for r in out} == {"refused"}
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts (the kernel does), never answers
    try:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        out = bench_chaos.run_load(url, [b"{}"], clients=1, until=time.monotonic() + 0.1, timeout_s=0.3)
    finally:
        silent.close()
    assert [r.kind for r in out] == ["timeout"]


def test_counts_p99_detection_recovery_and_the_table() -> None:
    reqs = [Request(float(i), i + 0.010 * (i + 1), "answered", 200) for i in range(100)]
    reqs += [Request(50.0, 50.0, "dropped"), Request(51.0, 51.0, "refused")]
    kinds = bench_chaos.counts(reqs)
    assert (kinds["answered"], kinds["dropped"], kinds["refused"], kinds["5xx"]) == (100, 1, 1, 0)
    assert bench_chaos.p99_ms(reqs, start=0, end=100) == pytest.approx(1000.0)  # the slowest of 100
    assert bench_chaos.p99_ms(reqs, start=0, end=10) == pytest.approx(100.0)
    assert bench_chaos.p99_ms(reqs, start=200, end=300) is None

    def status(ready: list[str]) -> dict:
        return {"replicas": [{"id": r, "state": "ready"} for r in ready] + [{"id": "x", "state": "starting"}]}

    samples = [
        (0.0, status(["a", "b"])),
        (1.0, status(["a", "b"])),
        (1.5, status(["b"])),
        (3.0, status(["b", "c"])),
    ]
    seen, back = bench_chaos.detect_and_recover(
        samples,
        after=0.5,
        failed=lambda s: "a" not in bench_chaos.ready_replicas(s),
        whole=lambda s: len(bench_chaos.ready_replicas(s)) >= 2,
    )
    assert (seen, back) == (1.0, 2.5)
    run = bench_chaos.Run("kill9-rank", kinds, lost=1, detected_s=seen, recovered_s=back, note="rank 1")
    line = bench_chaos.table([run]).splitlines()[-1]
    assert line.startswith("| kill9-rank | 100 | 0 | 1 | 1 | 0 | 0 | 1.00 s | 2.50 s |")


def test_serve_args_give_each_fault_its_server() -> None:
    args = bench_chaos.build_parser().parse_args(["--model", "tiny-bert", "--serve-arg=--rank-threads=1"])
    assert "--api-workers" in bench_chaos.serve_args("kill9-api", args, Path("."))
    two = bench_chaos.serve_args("unload-load", args, Path("."))
    assert two[:4] == ["--model", "a=tiny-bert", "--model", "b=tiny-bert"] and two[-1] == "--rank-threads=1"
    remote = bench_chaos.serve_args("netcut-remote", args, Path("."))
    assert remote[:8] == ["--model", "tiny-bert", "--pp", "2", "--replicas", "1", "--external-ranks", "1"]
    assert set(bench_chaos.REMOTE_FAULTS) <= set(bench_chaos.FAULTS)
