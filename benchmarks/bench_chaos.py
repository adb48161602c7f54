"""Faults in the box: ``shardserve serve`` started as a user starts it, closed-loop load, one fault per
run; per fault what the clients saw, when the server saw the fault and when it was whole again.

    python benchmarks/bench_chaos.py                                   # every fault, the default model
    python benchmarks/bench_chaos.py --model tiny-bert --fault sigterm --fault kill9-api --json out.json

Each run starts a fresh server (``--replicas 2``; ``--api-workers 2`` for the API-process faults; two
models a and b for the repository faults), drives it with ``--clients`` keep-alive HTTP/1.1 clients
(each sends its next question when its answer is back) for ``--duration-s``, and injects the fault
``--fault-at-s`` in:

- ``kill9-rank`` / ``sigstop-rank``: SIGKILL / SIGSTOP of the last rank of one replica gang;
- ``oom-rank``: that rank moved into a memory cgroup of its own whose limit (``OOM_LIMIT_BYTES`` of
  new memory) its next micro-batch exceeds: the kernel's OOM killer ends it;
- ``sigterm`` / ``sigterm-twice``: the server's drain, and a second signal 0.5 s later (stop now);
- ``sigterm-api``: the drain through two API processes (``--api-workers 2``);
- ``kill9-api``: SIGKILL of one of two API processes;
- ``unload-load``: under load of model a, unload model b, then load it again by its name alone;
- ``reload``: model a reloaded under its own load (new gangs ready before the old ones drain);
- ``bad-load``: under load of model a, load a model whose folder is broken.

Every request ends as one kind: ``answered`` (200); ``turned away`` (429 or 503: an answer that says
to come back, with Retry-After); ``refused`` (the connection was refused: nothing was sent, the client
may go elsewhere); or lost: ``dropped`` (sent, and the connection ended without an answer), ``5xx``
(another error status), ``timeout`` (no answer within ``--timeout-s``). A client closes its
connection when an answer says ``Connection: close`` and, as httpx does, does not reuse one the
server has closed. Detection and recovery come from the status JSON polled every 50 ms: the victim
seen failed, and every replica (or API process) ready again; p99 is of the answers sent from the
fault until the recovery (at least 5 s).

The remote faults ``kill9-remote`` / ``sigstop-remote`` / ``netcut-remote`` (left out of the default
run where network namespaces cannot be made: root and iproute2) put the server on one host (a
network namespace, ``loadtest/netns.py``) with stage 1 of its one replica (``--external-ranks``) on
another as ``shardserve worker``: SIGKILL or SIGSTOP of that worker, or its host's link down; once
the server sees the replica failed, the worker is replaced by a new one (as Kubernetes replaces a
pod) and the link comes back. The load runs inside the server's host.

Tests: ``tests/benchmarks/test_bench_chaos.py`` (the pure parts).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from serving_report import machine_info  # noqa: E402

from shardserve.loadtest.data import load_qa_items  # noqa: E402
from shardserve.loadtest.http11 import post_request, read_response  # noqa: E402
from shardserve.loadtest.local_server import local_server  # noqa: E402
from shardserve.loadtest.netns import VirtualHost, netns_available, virtual_hosts  # noqa: E402

logger = logging.getLogger("bench_chaos")
TOKEN = "chaos-admin-token"
POLL_S = 0.05
REFUSED_PAUSE_S = 0.05  # a refused client tries its next question after this
MIN_FAULT_WINDOW_S = 5.0
OOM_LIMIT_BYTES = 1 << 20  # new memory a rank may take in its cgroup: less than one micro-batch's
LOST = ("dropped", "5xx", "timeout")
KINDS = ("answered", "turned_away", "refused", *LOST)
REMOTE_FAULTS = ("kill9-remote", "sigstop-remote", "netcut-remote")
GANG_PORT = 29500  # every port is free in a fresh namespace
FAULTS = (
    "kill9-rank",
    "sigstop-rank",
    "oom-rank",
    "sigterm",
    "sigterm-twice",
    "sigterm-api",
    "kill9-api",
    "unload-load",
    "reload",
    "bad-load",
    *REMOTE_FAULTS,
)


@dataclass(frozen=True)
class Request:
    """One request as its client saw it."""

    sent: float  # time.monotonic()
    done: float
    kind: str  # one of KINDS
    status: int | None = None


def kind_of(status: int) -> str:
    """The kind of a request answered with ``status``."""
    if status == 200:
        return "answered"
    if status in (429, 503):
        return "turned_away"
    return "5xx" if status >= 500 else f"{status}"


def counts(requests: Sequence[Request]) -> dict[str, int]:
    """Requests per kind (every kind of ``KINDS`` present, others as they come: a 4xx by its status)."""
    out = dict.fromkeys(KINDS, 0)
    for r in requests:
        out[r.kind] = out.get(r.kind, 0) + 1
    return out


def p99_ms(requests: Sequence[Request], *, start: float, end: float) -> float | None:
    """p99 latency (ms) of the answers to requests sent in [start, end); None without any."""
    lat = sorted(1000 * (r.done - r.sent) for r in requests if r.kind == "answered" and start <= r.sent < end)
    if not lat:
        return None
    return lat[min(len(lat) - 1, int(0.99 * len(lat)))]


# ------------------------------------------------------------------------------------------ the load


async def _client(
    url: str, bodies: Sequence[bytes], offset: int, until: float, timeout_s: float, out: list[Request]
) -> None:
    host, port = urlsplit(url).hostname, urlsplit(url).port
    reader: asyncio.StreamReader | None = None
    writer: asyncio.StreamWriter | None = None
    i = offset
    while (t0 := time.monotonic()) < until:
        request = post_request(url, "/v1/qa", bodies[i % len(bodies)])
        i += 1
        if writer is not None and (reader is None or reader.at_eof() or writer.is_closing()):
            writer.close()  # the server closed it while idle: not reused (httpx does the same)
            reader = writer = None
        if writer is None:
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
            except (OSError, TimeoutError):
                out.append(Request(t0, time.monotonic(), "refused"))
                await asyncio.sleep(REFUSED_PAUSE_S)
                continue
        assert reader is not None
        try:
            writer.write(request)
            await writer.drain()
            status, headers, _ = await asyncio.wait_for(read_response(reader), timeout_s)
        except TimeoutError:
            out.append(Request(t0, time.monotonic(), "timeout"))
        except (OSError, EOFError, asyncio.IncompleteReadError, ValueError, IndexError):
            out.append(Request(t0, time.monotonic(), "dropped"))
        else:
            out.append(Request(t0, time.monotonic(), kind_of(status), status))
            if headers.get("connection", "").lower() != "close":
                continue
        writer.close()
        reader = writer = None
    if writer is not None:
        writer.close()


def run_load(
    url: str, bodies: Sequence[bytes], *, clients: int, until: float, timeout_s: float
) -> list[Request]:
    """``clients`` closed-loop clients until ``until`` (time.monotonic()): every request they sent."""
    out: list[Request] = []

    async def main() -> None:
        await asyncio.gather(*(_client(url, bodies, 7 * c, until, timeout_s, out) for c in range(clients)))

    asyncio.run(main())
    return out


# ------------------------------------------------------------------------------------------ the server's view


def http_json(
    url: str, *, method: str = "GET", body: Any = None, token: str | None = None, timeout_s: float = 5.0
) -> tuple[int, Any]:
    """(status, JSON body) of one request (a POST sends ``body`` as JSON, ``{}`` by default); (0,
    error text) when there is no answer."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = json.dumps({} if body is None else body).encode() if method == "POST" else None
    req = urllib.request.Request(
        url, data=data, method=method, headers={**headers, "Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        try:
            return err.code, json.loads(err.read() or b"null")
        except ValueError:
            return err.code, None
    except (OSError, ValueError) as err:
        return 0, str(err)


@dataclass
class Monitor:
    """The status JSON every ``POLL_S`` in a thread: (time, status) samples; the server's exit time."""

    url: str
    proc: Any
    samples: list[tuple[float, dict]] = field(default_factory=list)
    exited_at: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            if self.proc.poll() is not None:
                self.exited_at = self.exited_at or time.monotonic()
                return
            status, body = http_json(f"{self.url}/ui/status", timeout_s=2.0)
            if status == 200 and isinstance(body, dict):
                self.samples.append((time.monotonic(), body))
            time.sleep(POLL_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def ready_replicas(status: dict) -> set[str]:
    return {r["id"] for r in status.get("replicas", []) if r["state"] == "ready"}


def live_api(status: dict) -> set[int]:
    return {w["pid"] for w in status.get("api_workers", []) if w["alive"] and w["connected"]}


def detect_and_recover(
    samples: Sequence[tuple[float, dict]],
    *,
    after: float,
    failed: Callable[[dict], bool],
    whole: Callable[[dict], bool],
) -> tuple[float | None, float | None]:
    """Seconds from ``after`` until a sample shows the fault (``failed``), and until a later one shows
    the server whole again (``whole``); None where no sample did."""
    seen = back = None
    for t, status in samples:
        if t < after:
            continue
        if seen is None and failed(status):
            seen = t - after
        elif seen is not None and whole(status):
            back = t - after
            break
    return seen, back


# ------------------------------------------------------------------------------------------ the faults


@dataclass
class Run:
    fault: str
    kinds: dict[str, int]
    lost: int
    detected_s: float | None = None
    recovered_s: float | None = None
    p99_before_ms: float | None = None
    p99_fault_ms: float | None = None
    exit_code: int | None = None
    note: str = ""


def serve_args(fault: str, args: argparse.Namespace, tmp: Path) -> list[str]:
    common = ["--admin-token", TOKEN, "--drain-timeout-s", str(args.drain_timeout_s), *args.serve_arg]
    if fault in ("unload-load", "reload", "bad-load"):
        return ["--model", f"a={args.model}", "--model", f"b={args.model}", "--replicas", "1", *common]
    if fault in REMOTE_FAULTS:  # one replica, stage 1 on another host (server_for adds where)
        return ["--model", args.model, "--pp", "2", "--replicas", "1", "--external-ranks", "1", *common]
    extra = ["--api-workers", "2"] if fault.endswith("-api") else []
    return ["--model", args.model, "--replicas", str(args.replicas), *extra, *common]


def inject(
    fault: str, url: str, proc: Any, first: dict, tmp: Path, remote: RemoteWorker | None = None
) -> tuple[Callable, Callable, str]:
    """Inject ``fault``; (failed, whole) tests of a status sample for detection and recovery, and a note."""
    if fault in REMOTE_FAULTS:
        assert remote is not None
        victim = next(r for r in first["replicas"] if r["state"] == "ready")
        pid = remote.procs[-1].pid
        if fault == "netcut-remote":
            remote.cut()
        else:
            os.killpg(pid, signal.SIGKILL if fault == "kill9-remote" else signal.SIGSTOP)
        threading.Thread(target=remote.replace_when_failed, args=(url, victim["id"]), daemon=True).start()
        return (
            lambda s: victim["id"] not in ready_replicas(s),
            lambda s: bool(ready_replicas(s)),
            f"remote stage 1 of {victim['id']} (worker pid {pid}), replaced once seen failed",
        )
    if fault in ("kill9-rank", "sigstop-rank", "oom-rank"):
        victim = next(r for r in first["replicas"] if r["state"] == "ready")
        pid = victim["ranks"][-1]["pid"]
        if fault == "oom-rank":
            memory_cgroup(pid, tmp, limit_bytes=OOM_LIMIT_BYTES)
        else:
            os.kill(pid, signal.SIGKILL if fault == "kill9-rank" else signal.SIGSTOP)
        n = len(ready_replicas(first))
        return (
            lambda s: victim["id"] not in ready_replicas(s),
            lambda s: len(ready_replicas(s)) >= n,
            f"rank {victim['ranks'][-1]['rank']} of {victim['id']} (pid {pid})",
        )
    if fault.startswith("sigterm"):
        proc.send_signal(signal.SIGTERM)
        if fault == "sigterm-twice":
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
        return (lambda s: False, lambda s: False, "")
    if fault == "kill9-api":
        victim_pid = min(live_api(first))
        os.kill(victim_pid, signal.SIGKILL)
        return (
            lambda s: victim_pid not in live_api(s),
            lambda s: len(live_api(s)) >= 2 and victim_pid not in live_api(s),
            f"API process pid {victim_pid}",
        )
    base = f"{url}/v2/repository/models"
    if fault == "unload-load":
        t0 = time.monotonic()
        unloaded, _ = http_json(f"{base}/b/unload", method="POST", token=TOKEN, timeout_s=120)
        index = {e["name"]: e["state"] for e in http_json(f"{url}/v2/repository/index", token=TOKEN)[1]}
        loaded, _ = http_json(f"{base}/b/load", method="POST", token=TOKEN, timeout_s=300)
        asked = ask(url, "b")
        note = (
            f"unload {unloaded}, b then {index.get('b', 'not in the index')}, load by name {loaded} "
            f"in {time.monotonic() - t0:.1f} s, b answers {asked}"
        )
        return (lambda s: False, lambda s: False, note)
    if fault == "reload":
        t0 = time.monotonic()
        reloaded, _ = http_json(f"{base}/a/load", method="POST", token=TOKEN, timeout_s=300)
        version = next((e["version"] for e in http_json(f"{url}/v2/repository/index", token=TOKEN)[1]), "?")
        note = f"reload of a {reloaded} in {time.monotonic() - t0:.1f} s, a now version {version}"
        return (lambda s: False, lambda s: False, note)
    broken = tmp / "broken"
    broken.mkdir(exist_ok=True)
    (broken / "config.json").write_text("{}")
    load = {"parameters": {"path": str(broken)}}
    code, _ = http_json(f"{base}/c/load", method="POST", body=load, token=TOKEN, timeout_s=120)
    return (lambda s: False, lambda s: False, f"load of a broken folder: {code}")


def memory_cgroup(pid: int, tmp: Path, *, limit_bytes: int) -> Path:
    """Move ``pid`` into a new memory cgroup (v1, or v2) beside this process's, limited to
    ``limit_bytes``; its path (``tmp/cgroup`` names it for the clean-up). Memory the process already
    holds stays charged where it was: only what it allocates from now on counts."""
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    if v2.is_file() and "memory" in v2.read_text().split():
        own = Path("/sys/fs/cgroup") / Path(
            Path("/proc/self/cgroup").read_text().split("::", 1)[1].strip()
        ).relative_to("/")
        group, limit_file = own.parent / f"bench-chaos-{os.getpid()}", "memory.max"
    else:
        line = next(ln for ln in Path("/proc/self/cgroup").read_text().splitlines() if ":memory:" in ln)
        own = Path("/sys/fs/cgroup/memory") / Path(line.split(":", 2)[2]).relative_to("/")
        group, limit_file = own / f"bench-chaos-{os.getpid()}", "memory.limit_in_bytes"
    group.mkdir(exist_ok=True)
    (group / limit_file).write_text(str(limit_bytes))
    (group / "cgroup.procs").write_text(str(pid))
    (tmp / "cgroup").write_text(str(group))
    return group


def remove_cgroup(tmp: Path) -> None:
    """Remove the cgroup ``memory_cgroup`` made, once its process is gone (a few tries)."""
    marker = tmp / "cgroup"
    if not marker.is_file():
        return
    group = Path(marker.read_text())
    for _ in range(50):
        try:
            group.rmdir()
            break
        except FileNotFoundError:
            break
        except OSError:
            time.sleep(0.1)
    marker.unlink()


def ask(url: str, model: str) -> int:
    """The status of one question to ``model`` (0: no answer)."""
    body = {"model": model, "question": "Who won?", "context": "Bob won the game."}
    return http_json(f"{url}/v1/qa", method="POST", body=body, timeout_s=60)[0]


@dataclass
class RemoteWorker:
    """Stage 1 of the server's one replica: ``shardserve worker`` on host ``host``, replaced (as a
    pod is) once the server sees its replica failed."""

    host: VirtualHost
    env: dict[str, str]
    log: Any
    procs: list[subprocess.Popen] = field(default_factory=list)
    cut_off: bool = False

    def start(self) -> None:
        argv = [sys.executable, "-m", "shardserve", "worker"]
        self.procs.append(self.host.popen(argv, env=self.env, stdout=self.log, stderr=subprocess.STDOUT))

    def cut(self) -> None:
        """The host's only link down: it neither sends nor receives."""
        subprocess.run(["ip", "-n", self.host.name, "link", "set", self.host.ifname, "down"], check=True)
        self.cut_off = True

    def replace_when_failed(self, url: str, replica: str, *, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status, body = http_json(f"{url}/ui/status", timeout_s=2.0)
            if status == 200 and isinstance(body, dict) and replica not in ready_replicas(body):
                break
            time.sleep(POLL_S)
        if self.cut_off:
            subprocess.run(["ip", "-n", self.host.name, "link", "set", self.host.ifname, "up"], check=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[-1].pid, signal.SIGKILL)
        self.start()


@contextlib.contextmanager
def server_for(fault: str, args: argparse.Namespace, tmp: Path, log: Any) -> Any:
    """(the server, its remote worker or None), ready. A remote fault puts the server on host a and
    stage 1 of its one replica on host b (network namespaces, ``loadtest/netns.py``), and runs this
    thread (and what it starts: the load, the monitor) inside a."""
    if fault not in REMOTE_FAULTS:
        serve = serve_args(fault, args, tmp)
        with local_server(serve, all_replicas=True, log=log, ready_timeout_s=300) as srv:
            yield srv, None
        return
    if reason := netns_available():
        raise SystemExit(f"error: {fault} needs network namespaces: {reason}")
    key = secrets.token_hex(32)
    with virtual_hosts(2, prefix="sschaos-") as (a, b):
        env = {"GLOO_SOCKET_IFNAME": a.ifname, "SHARDSERVE_GANG_KEY": key}
        worker_env = {**os.environ, "HF_HUB_OFFLINE": "1", **env, "GLOO_SOCKET_IFNAME": b.ifname}
        worker_env.update(MASTER_ADDR=a.addr, MASTER_PORT=str(GANG_PORT), RANK="1")
        remote = RemoteWorker(b, worker_env, log)
        remote.start()
        serve = [*serve_args(fault, args, tmp), "--gang-host", a.addr, "--gang-port", str(GANG_PORT)]
        with a.inside(), local_server(serve, log=log, env=env, ready_timeout_s=300) as srv:
            yield srv, remote


def run_fault(fault: str, args: argparse.Namespace, bodies: Sequence[bytes], tmp: Path) -> Run:
    with open(tmp / f"{fault}.log", "w") as log, server_for(fault, args, tmp, log) as (srv, remote):
        monitor = Monitor(srv.url, srv.proc)
        t_start = time.monotonic()
        until = t_start + args.duration_s
        box: list[list[Request]] = []
        load = threading.Thread(
            target=lambda: box.append(
                run_load(srv.url, bodies, clients=args.clients, until=until, timeout_s=args.timeout_s)
            )
        )
        load.start()
        time.sleep(args.fault_at_s)
        while not monitor.samples:
            time.sleep(POLL_S)
        first = monitor.samples[-1][1]
        t_fault = time.monotonic()
        failed, whole, note = inject(fault, srv.url, srv.proc, first, tmp, remote)
        load.join()
        monitor.stop()
        remove_cgroup(tmp)
        exit_code = srv.proc.poll()
    requests = box[0]
    seen, back = detect_and_recover(monitor.samples, after=t_fault, failed=failed, whole=whole)
    if fault.startswith("sigterm") and monitor.exited_at is not None:
        back = monitor.exited_at - t_fault
    window_end = t_fault + max(back or 0.0, MIN_FAULT_WINDOW_S)
    kinds = counts(requests)
    return Run(
        fault=fault,
        kinds=kinds,
        lost=sum(kinds[k] for k in LOST),
        detected_s=seen,
        recovered_s=back,
        p99_before_ms=p99_ms(requests, start=t_start, end=t_fault),
        p99_fault_ms=p99_ms(requests, start=t_fault, end=window_end),
        exit_code=exit_code,
        note=note,
    )


def table(runs: Sequence[Run]) -> str:
    """The markdown table of the runs."""

    def s(x: float | None, unit: str = "s") -> str:
        return "-" if x is None else f"{x:.2f} {unit}" if unit == "s" else f"{x:.0f}"

    lines = [
        "| fault | answered | turned away | refused | dropped | 5xx | timeout | seen | whole / exit | p99 before / during (ms) | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        k = r.kinds
        end = s(r.recovered_s) + (f" (exit {r.exit_code})" if r.exit_code is not None else "")
        lines.append(
            f"| {r.fault} | {k['answered']} | {k['turned_away']} | {k['refused']} | {k['dropped']} | {k['5xx']} "
            f"| {k['timeout']} | {s(r.detected_s)} | {end} | {s(r.p99_before_ms, 'ms')} / "
            f"{s(r.p99_fault_ms, 'ms')} | {r.note} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--fault", action="append", choices=FAULTS, help="a fault to run (repeat; default: all)")
    p.add_argument("--model", default="default", help="the model served (default: %(default)s)")
    p.add_argument("--replicas", type=int, default=2, help="replica gangs (default: %(default)s)")
    p.add_argument("--clients", type=int, default=16, help="closed-loop clients (default: %(default)s)")
    p.add_argument("--duration-s", type=float, default=15.0, help="load per run (default: %(default)s)")
    p.add_argument(
        "--fault-at-s", type=float, default=4.0, help="the fault this far in (default: %(default)s)"
    )
    p.add_argument("--timeout-s", type=float, default=30.0, help="a request unanswered this long is lost")
    p.add_argument("--drain-timeout-s", type=float, default=30.0, help="the server's --drain-timeout-s")
    p.add_argument("--serve-arg", action="append", default=[], help="one more `shardserve serve` argument")
    p.add_argument(
        "--squad", type=Path, default=None, help="SQuAD JSON (default: the shared pool if present)"
    )
    p.add_argument("--json", type=Path, help="also write the runs and the machine here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    items = load_qa_items(args.squad, limit=600)
    bodies = [json.dumps({"question": it.question, "context": it.context}).encode() for it in items]
    faults = args.fault or list(FAULTS)
    if not args.fault and (reason := netns_available()):
        logger.info("not running %s: %s", ", ".join(REMOTE_FAULTS), reason)
        faults = [f for f in faults if f not in REMOTE_FAULTS]
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-chaos-") as tmp:
        for fault in faults:
            logger.info("fault %s: starting a server", fault)
            runs.append(run_fault(fault, args, bodies, Path(tmp)))
            logger.info("fault %s: %s", fault, runs[-1])
    info = machine_info("auto", model=args.model)
    print(f"\n{info}\n\n{table(runs)}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "machine": info,
                    "args": vars(args) | {"squad": str(args.squad), "json": str(args.json)},
                    "runs": [asdict(r) for r in runs],
                },
                indent=1,
            )
        )
    return 0 if all(r.lost == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
