"""The server rows of ``bench_serving.py`` as processes: start a server (a subprocess), wait until it
is ready (shardserve's /readyz with every replica, or a first 200 from servers without it), drive it
with the closed-loop clients, count the CPU its server process, its front-end / API processes and
its workers spend per answer, read shardserve's batch statistics, stop it and kill whatever of its
process tree outlives it; and the LitServe (e) and Mosec (f) servers' commands.

    python -m pytest tests/benchmarks/test_bench_helpers.py -q -k "cpu or listener or reap"
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from http_load import closed_loop
from serving_report import Result

from shardserve.loadtest.local_server import ServerNotReady, stop, wait_ready
from shardserve.loadtest.overload import process_tree

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
FRAMEWORK_TIMEOUT_S = 120  # LitServe's, Mosec's request limit (their defaults: 30 s, 3 s); naive: none

logger = logging.getLogger("bench_serving")  # the script's: its log lines name it


def drive(port: int, pairs: list[tuple[str, str]], args: argparse.Namespace, name: str, note: str) -> Result:
    bodies = [json.dumps({"question": q, "context": c}).encode() for q, c in pairs]
    out = closed_loop(port, bodies, clients=args.clients, warmup_s=args.warmup_s, duration_s=args.duration_s)
    ok = sorted(lat for lat, status in out if status == 200)
    errors = sum(1 for _, status in out if status != 200)
    if len(ok) < 2:
        return Result(name, len(ok) / args.duration_s, None, None, len(ok), errors, note)
    q = statistics.quantiles(ok, n=100)
    return Result(name, len(ok) / args.duration_s, 1000 * q[49], 1000 * q[98], len(ok), errors, note)


def bench_server(
    cmd: list[str],
    port: int,
    pairs: list,
    args: argparse.Namespace,
    name: str,
    note: str,
    *,
    ready: Callable[[subprocess.Popen], None] | None = None,
    front_end: bool = False,
) -> Result:
    """Start ``cmd`` (a server on ``port``), wait until it is ready (``ready(proc)``; by default its
    /readyz with every replica started), drive it, and stop it (and whatever of its process tree
    outlives it). ``front_end``: its descendants holding the listening socket are its front end
    (LitServe, Mosec), counted with the server process's CPU as shardserve's API processes are."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env)
    try:
        if ready is not None:
            ready(proc)
        else:  # shardserve turns ready with its first gang: wait for every replica (none starting)
            wait_ready(f"http://127.0.0.1:{port}", timeout_s=300, proc=proc, all_replicas=True)
        # --api-workers: shardserve's API processes (HTTP, tokenizing, decoding)
        api = listener_pids(process_tree(proc.pid)[1:], port) if front_end else api_pids(port)
        marks: list[tuple[float, float, float]] = []  # CPU seconds: server process, API processes, workers
        # at the measured window's two ends, as the answers counted are those that end inside it (not
        # after drive returns: the answers still in flight at the end are not counted)
        timers = [
            threading.Timer(at, lambda: marks.append(cpu_seconds(proc.pid, api=api)))
            for at in (args.warmup_s, args.warmup_s + args.duration_s)
        ]
        for timer in timers:
            timer.start()
        result = drive(port, pairs, args, name, note)
        for timer in timers:
            timer.join()
        if len(marks) == 2 and result.completed:
            (own0, api0, kids0), (own1, api1, kids1) = marks
            per_q = 1000 / result.completed
            result.server_cpu_ms = (own1 - own0 + api1 - api0) * per_q
            result.note += f"; CPU per answer: server process {(own1 - own0) * per_q:.1f} ms"
            if api:
                what = "front-end" if front_end else "API"
                result.note += f", its {len(api)} {what} processes {(api1 - api0) * per_q:.1f} ms"
            if kids1 > kids0:
                result.note += f", workers {(kids1 - kids0) * per_q:.1f} ms"
        stats = batch_stats(port)
        if stats:
            result.note += f"; {stats}"
        return result
    finally:
        tree = process_tree(proc.pid)[1:]
        stop(proc)
        reap(tree)


def framework_server(
    part: str, args: argparse.Namespace, pairs: list[tuple[str, str]], dtype: str, port: int
) -> tuple[list[str], Callable[[subprocess.Popen], None], str]:
    """Row (e) / (f)'s server: its command (``servers/litserve_qa.py`` or ``servers/mosec_qa.py`` on
    ``port``), how to wait until it is ready, and the row's note. Same batching bounds as shardserve's
    explicit rows (--max-batch-size, here requests; --max-queue-delay-ms) and --model-workers x
    (--cores / --model-workers) torch threads."""
    workers = args.model_workers or (1 if args.device == "cuda" else args.cores)
    threads = max(1, args.cores // workers)
    bs, delay_ms = args.max_batch_size, args.max_queue_delay_ms
    common = ["--model", args.model, "--dtype", dtype, "--device", args.device, "--max-seq-len",
              str(args.max_seq_len), "--workers", str(workers), "--threads", str(threads),
              "--max-batch-size", str(bs)]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    note = f"{workers} worker(s) x {threads} thread(s), {dtype} on {args.device}, batches of <= {bs} requests"
    if part == "litserve":
        cmd = [sys.executable, str(HERE / "servers" / "litserve_qa.py"), "--port", str(port), *common,
               "--batch-timeout-ms", str(delay_ms), "--timeout-s", str(FRAMEWORK_TIMEOUT_S)]  # fmt: skip
        note += f" within {delay_ms:g} ms, 1 API process"

        def ready(proc: subprocess.Popen) -> None:
            wait_answering(url + "/health", proc=proc)

    else:
        wait_ms = max(1, round(delay_ms))  # Mosec's max_wait_time: whole milliseconds, >= 1
        cmd = [sys.executable, str(HERE / "servers" / "mosec_qa.py"), "--port", str(port), "--address",
               "127.0.0.1", "--timeout", str(FRAMEWORK_TIMEOUT_S * 1000), "--log-level", "warning", *common,
               "--max-wait-ms", str(wait_ms)]  # fmt: skip
        note += f" within {wait_ms} ms"
        probe = json.dumps({"question": pairs[0][0], "context": pairs[0][1]}).encode()

        def ready(proc: subprocess.Popen) -> None:
            wait_answering(url + "/v1/qa", proc=proc, body=probe)

    if args.device == "cuda":
        note += ", warmed only by --warmup-s of load"
    return cmd, ready, note


def reap(pids: Sequence[int], *, timeout_s: float = 10.0) -> None:
    """Wait up to ``timeout_s`` for the processes ``pids`` (a stopped server's workers) to exit,
    then SIGKILL those left: a worker outliving its server would take the cores of the next row."""
    deadline = time.monotonic() + timeout_s
    left = list(pids)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if _alive(p)]
    for p in left:
        logger.warning("process %d outlived its server: killed", p)
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_answering(
    url: str, *, proc: subprocess.Popen, timeout_s: float = 300.0, body: bytes | None = None
) -> None:
    """Poll ``url`` (GET, or POST the JSON ``body``) until it answers 200: the readiness of servers
    without shardserve's /readyz (LitServe's /health; Mosec's first answer to a question).
    ``ServerNotReady`` after ``timeout_s``, or at once if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerNotReady(f"the server exited with {proc.returncode} before it was ready")
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                if resp.status == 200:
                    return
                last = f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.3)
    raise ServerNotReady(f"{url} did not answer 200 after {timeout_s:g} s (last: {last})")


def listener_pids(pids: Sequence[int], port: int) -> list[int]:
    """Those of ``pids`` holding a TCP socket listening on ``port`` (Linux /proc; [] elsewhere): the
    front end of a server whose processes do not say which does what (LitServe's uvicorn process and
    the Manager forked after it bound the port; Mosec's Rust server)."""
    sockets = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:  # sl local_address rem_address st ... inode
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                sockets.add(f"socket:[{fields[9]}]")

    def holds(pid: int) -> bool:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or not ours
            return False
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in sockets:
                    return True
            except OSError:  # closed meanwhile
                continue
        return False

    return [pid for pid in pids if sockets and holds(pid)]


def process_cpu_s(path: str) -> float:
    """CPU seconds (user + system) of a process or thread, ``/proc/<pid>`` or ``/proc/<pid>/task/<tid>``
    (Linux; 0 where it is gone or there is no /proc)."""
    try:
        fields = Path(path, "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def cpu_seconds(pid: int, *, api: Sequence[int] = ()) -> tuple[float, float, float]:
    """CPU seconds (user + system) of process ``pid``, of its ``api`` processes and of its other live
    descendants (Linux /proc; zeros elsewhere): what the HTTP front end and the workers spend per answer."""

    def used(p: int) -> float:
        return process_cpu_s(f"/proc/{p}")

    own, *descendants = process_tree(pid)
    return used(own), sum(used(p) for p in api), sum(used(p) for p in descendants if p not in api)


def api_pids(port: int) -> list[int]:
    """The API processes of a shardserve server (its status JSON; [] for other servers or none)."""
    import httpx

    try:
        workers = httpx.get(f"http://127.0.0.1:{port}/ui/status", timeout=5).json().get("api_workers", [])
    except (httpx.HTTPError, ValueError):
        return []
    return [w["pid"] for w in workers if w.get("pid")]


def batch_stats(port: int) -> str:
    """Mean micro-batch size and padding ratio from shardserve's /metrics ('' for other servers)."""
    import httpx

    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return ""
    values: dict[str, float] = {}
    for line in text.splitlines():  # summed over the model label (one model here)
        key, _, value = line.rpartition(" ")
        name = key.split("{", 1)[0]
        if name in (
            "shardserve_batch_size_windows_sum",
            "shardserve_batch_size_windows_count",
            "shardserve_padding_ratio",
        ):
            values[name] = values.get(name, 0.0) + float(value)
    n = values.get("shardserve_batch_size_windows_count", 0.0)
    if not n:
        return ""
    mean = values["shardserve_batch_size_windows_sum"] / n
    return f"mean batch {mean:.1f} windows, padding {100 * values.get('shardserve_padding_ratio', 0.0):.0f}%"
