"""Serving benchmark: raw forward vs naive servers vs ONNX Runtime vs LitServe vs Mosec vs shardserve,
one run, same cores.

One run, same machine, same model, same cores, same SQuAD questions, and the CPU with its
bf16 / AMX / int8 units printed above the figures:

(a) raw: the unpartitioned model at the chosen precision (--dtype, ``auto`` as ``shardserve serve``
    resolves it), no HTTP, windows sorted by length into batches of --max-batch-size (the best case
    for padding), measured two ways on the same cores: one process with --cores torch threads, and
    (a') --cores single-thread processes at once (data parallel), (a2) batch 1 data parallel
    (what batching itself buys on this model) and (a3) batches of SMALL_BATCH data parallel, the size
    of shardserve's micro-batches under load. Each row times whole passes over every window (a pass
    cut off would time only the shorter ones). The limit is the best of them: batch 1 beats batches
    of 32 in fp32 on an AVX2-only CPU, and batches of 4-8 beat 32 by 4-7 % in int8 on an AVX512 Zen 4;
(b) naive: a FastAPI server (subprocess) that tokenizes, runs the model and decodes one request
    at a time (a lock around the whole request), torch using every core, in fp32 (what a user
    writes); (b2) the same server with the model in bf16;
(d) ONNX Runtime: the same plain model exported with torch.onnx.export, raw batched forward (no
    HTTP) in fp32 and after onnxruntime.quantization.quantize_dynamic (int8 weights), at batch
    --max-batch-size and batch 1, one process with --cores threads. Needs the optional ``bench``
    extra (``pip install -e '.[bench]'``); skipped with one line when it is not installed;
(e) LitServe and (f) Mosec, the Python servers a user would pick instead, each a subprocess
    (``servers/litserve_qa.py``, ``servers/mosec_qa.py``; their docstrings say how each works) with
    the naive server's model work (``servers/qa_model.py``: same model, precision, windows and
    decoder) and its framework's dynamic batching: up to --max-batch-size REQUESTS per forward (all
    their windows padded together; shardserve counts windows), waiting --max-queue-delay-ms for a
    batch to fill (LitServe's batch_timeout, Mosec's max_wait_time), in --model-workers processes of
    --cores / --model-workers torch threads (default: one single-thread worker per core), LitServe
    with one API process, both with a 120-s request limit; fp32, and (e2) / (f2) bf16 unless
    --skip naive-bf16 (the naive rows' precisions). Both serve /v1/qa as the naive server does;
    ready when LitServe's /health answers 200, when Mosec (no readiness route) answers a question.
    Each needs its package (the ``bench`` extra); skipped with one line when it is not installed;
(c) shardserve: ``shardserve serve`` (subprocess) with its default flags (only model/host/port:
    precision and replicas x threads picked by the server), and with explicit flags (--pp, --tp,
    --replicas, --threads-per-rank, batching flags, --dtype; plus every --extra-config); the best
    explicit row is "best flags".

On --device cuda, (a) and the naive servers first run every batch / request shape of the questions once,
untimed (a shape new to the GPU's kernels would measure their warm-up); the CPU path warms with one batch.

(b), (b2), (e), (f) and (c) are driven by --clients concurrent keep-alive HTTP clients (a minimal
asyncio client, so the load generator costs little CPU) posting /v1/qa for --duration-s after
--warmup-s; it prints throughput (questions/s), p50/p99 latency, the CPU each server's process
(HTTP, tokenizing, scheduling, decoding), its front-end processes (shardserve's API workers;
LitServe's and Mosec's processes holding the listening socket: LitServe's uvicorn process and its
queue Manager, Mosec's Rust server) and its workers spent per answer, and the ratios of shardserve
to (a), (b), (b2), (e), (e2), (f), (f2) and ONNX Runtime's best raw forward, with the issue-9
targets (default flags >= 4x (b), >= 2x ONNX Runtime best, >= 0.9x (a)) and the ceiling that the
server process's own CPU puts on the ratio to (a) on these cores; targets are figures for the docs,
not assertions. A server's processes still alive 10 s after it stopped are killed (and logged).

    python benchmarks/bench_serving.py                                  # default model, 32 clients
    python benchmarks/bench_serving.py --model tiny-bert --duration-s 10 --replicas 2
    python benchmarks/bench_serving.py --duration-s 3 --warmup-s 2 --skip best   # smoke
    python benchmarks/bench_serving.py --skip raw --skip ort --skip best --skip naive-bf16   # vs LitServe, Mosec
    python benchmarks/bench_serving.py --device cuda --dtype bfloat16   # on a GPU (see --device)
    python benchmarks/bench_serving.py --help                           # every flag

Questions come from ../shared/data/squad/squad-v1.1-train-pool.json when present (--squad), else
a small built-in set.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import json
import logging
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from http_load import closed_loop

from shardserve.loadtest.local_server import ServerNotReady, free_port, stop, wait_ready
from shardserve.loadtest.overload import process_tree

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
DEFAULT_EXTRA_CONFIGS = (
    "--replicas 1 --threads-per-rank {cores}",
    "--pp 2 --replicas 1 --threads-per-rank {half}",
)
DEFAULT_EXTRA_CONFIGS_CUDA = (  # several ranks sharing each GPU
    "--replicas 2 --ranks-per-gpu 2",
    "--replicas 4 --ranks-per-gpu 4",
    "--pp 2 --replicas 2 --ranks-per-gpu 4",
)
SMALL_BATCH = 8  # (a3): shardserve's CPU micro-batches average 4-6 windows at 32 clients
SKIPPABLE = ("raw", "naive", "naive-bf16", "ort", "litserve", "mosec", "shardserve", "default", "best")
FRAMEWORKS = (  # (e), (f): --skip part, row letter, name, server script in servers/
    ("litserve", "e", "LitServe", "litserve_qa.py"),
    ("mosec", "f", "Mosec", "mosec_qa.py"),
)
FRAMEWORK_TIMEOUT_S = 120  # LitServe's, Mosec's request limit (their defaults: 30 s, 3 s); naive: none
DEFAULT_SQUAD = REPO.parent / "shared" / "data" / "squad" / "squad-v1.1-train-pool.json"
BUILTIN = [
    (
        "Which team won Super Bowl 50?",
        "Super Bowl 50 was an American football game. The Denver Broncos "
        "defeated the Carolina Panthers 24–10 to earn their third Super Bowl title.",
    ),
    (
        "Where was the game played?",
        "The game was played on February 7, 2016, at Levi's Stadium in the San "
        "Francisco Bay Area at Santa Clara, California.",
    ),
    (
        "What boils at 100 degrees?",
        "At sea level, water boils at 100 degrees Celsius; at altitude it boils "
        "at lower temperatures because the air pressure is lower.",
    ),
    (
        "Who wrote Hamlet?",
        "Hamlet is a tragedy written by William Shakespeare sometime between 1599 and 1601.",
    ),
]

logger = logging.getLogger("bench_serving")


@dataclass
class Result:
    name: str
    questions_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    completed: int
    errors: int
    note: str = ""
    server_cpu_ms: float | None = None  # server-process CPU per answer (HTTP, tokenizing, decoding)


# ------------------------------------------------------------------------------------------ data


def load_pairs(path: Path, n: int) -> list[tuple[str, str]]:
    if not path.is_file():
        logger.warning("%s not found: using %d built-in questions", path, len(BUILTIN))
        return list(BUILTIN)
    data = json.loads(path.read_text())
    pairs = [(qa["question"], p["context"]) for a in data["data"] for p in a["paragraphs"] for qa in p["qas"]]
    step = max(1, len(pairs) // n)  # spread over articles
    return pairs[::step][:n]


# ------------------------------------------------------------------------------------------ (a) raw


def bench_raw(
    args: argparse.Namespace,
    pairs: list[tuple[str, str]],
    *,
    threads: int,
    duration_s: float,
    batch_size: int,
    name: str,
    dtype: str = "float32",
    engine: str = "torch",
    onnx_dir: str | None = None,
    device: str = "cpu",
) -> Result:
    """Raw forward over the questions' windows, in whole passes over all of them for at least
    ``duration_s``; ``engine``: torch (at ``dtype``, on ``device``), ort-fp32 or ort-int8 (cpu)."""
    import torch

    from shardserve.models.build import build_model
    from shardserve.models.qa_windows import WindowConfig, encode_qa, pad_windows
    from shardserve.models.registry import resolve_model

    torch.set_num_threads(threads)
    source = resolve_model(args.model)
    tok = source.tokenizer()
    enc = encode_qa(
        tok,
        [q for q, _ in pairs],
        [c for _, c in pairs],
        window=WindowConfig(max_seq_len=args.max_seq_len, doc_stride=128, max_question_len=64),
    )
    # batch 1 keeps arrival order (what a one-at-a-time server computes); batches are length-sorted
    windows = enc.windows if batch_size == 1 else sorted(enc.windows, key=lambda w: w.num_tokens)
    types = source.config.uses_token_types
    batches = []  # (input ids, attention mask, token types or None), each (B, S), on the device
    for i in range(0, len(windows), batch_size):
        b = pad_windows(windows[i : i + batch_size], pad_token_id=enc.pad_token_id)
        tt = b.token_type_ids.to(device) if types else None
        batches.append((b.input_ids.to(device), b.attention_mask.to(device), tt))
    if engine == "torch":
        from shardserve.partitioner.int8 import model_calibration, quantize_linears
        from shardserve.partitioner.precision import compute_dtype

        net = build_model(source, dtype=compute_dtype(dtype), device=device).eval()
        if dtype == "int8":  # the served int8 path, from the model's calibration (`shardserve quantize`)
            quantize_linears(net, model_calibration(source))
        label = f"{dtype} on {device}"

        def model(ids, mask, tt):
            out = net(ids, mask, tt)
            if device != "cpu":
                torch.cuda.synchronize()  # kernels are asynchronous: time their completion
            return out

    else:
        sys.path.insert(0, str(HERE))
        from bench_kernels import ort_forward, ort_session

        session = ort_session(source, Path(onnx_dir or "."), int8=engine == "ort-int8", threads=threads)

        def model(ids, mask, tt):
            return ort_forward(session, ids, mask, tt)

        label = engine
    per_question = len(pairs) / len(windows)
    lat: list[float] = []
    done = 0
    with torch.inference_mode():
        if device == "cuda":  # every shape once, untimed: a first-seen shape measures the GPU's warm-up
            firsts = first_of_each_shape([b[0] for b in batches])
            for i in firsts:
                model(*batches[i])
            label += f" (warmed over its {len(firsts)} batch shapes first)"
        else:
            model(*batches[0])
        # whole passes over every window until duration_s has passed: the batches are in length
        # order, and a run cut off mid-pass would time only the shorter windows (a faster "limit")
        start = time.perf_counter()
        stop_at = start + duration_s
        while time.perf_counter() < stop_at:
            for b in batches:
                t0 = time.perf_counter()
                model(*b)
                lat.append(time.perf_counter() - t0)
                done += int(b[0].shape[0])
        elapsed = time.perf_counter() - start
    del model, batches
    gc.collect()
    qps = done * per_question / elapsed
    q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [lat[0]] * 99
    return Result(
        name,
        qps,
        1000 * q[49],
        1000 * q[98],
        int(done * per_question),
        0,
        f"{done / elapsed:.1f} windows/s, batches of {batch_size} windows, "
        f"{threads} threads, {label}; latency = per batch",
    )


def first_of_each_shape(tensors: list[Any]) -> list[int]:
    """Indices of the first tensor of each distinct shape, in order (the warm-up set on a GPU)."""
    firsts: dict[tuple[int, ...], int] = {}
    for i, t in enumerate(tensors):
        firsts.setdefault(tuple(t.shape), i)
    return list(firsts.values())


def raw_in_subprocess(
    args: argparse.Namespace,
    *,
    procs: int,
    threads: int,
    batch_size: int,
    duration_s: float,
    name: str,
    dtype: str = "float32",
    engine: str = "torch",
    onnx_dir: str | None = None,
    device: str = "cpu",
) -> Result:
    """bench_raw in ``procs`` fresh interpreters running at the same time (data parallel when > 1);
    throughputs add up. Fresh processes also keep torch thread pools from distorting each other."""
    spec = json.dumps(
        {
            "threads": threads,
            "batch_size": batch_size,
            "duration_s": duration_s,
            "name": name,
            "dtype": dtype,
            "engine": engine,
            "onnx_dir": onnx_dir,
            "device": device,
        }
    )
    cmd = [sys.executable, __file__, "--raw-run", spec, "--model", args.model, "--questions", str(args.questions),
           "--squad", str(args.squad), "--max-seq-len", str(args.max_seq_len), "--cores", str(args.cores)]  # fmt: skip
    running = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    parts = []
    for proc in running:
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"raw measurement failed with exit code {proc.returncode}")
        parts.append(Result(**json.loads(out.strip().splitlines()[-1])))
    first = parts[0]
    return Result(
        name,
        sum(p.questions_per_s for p in parts),
        first.p50_ms,
        first.p99_ms,
        sum(p.completed for p in parts),
        0,
        f"{procs} process(es) x {threads} thread(s), batches of {batch_size} windows; "
        + first.note.split(", ", 1)[0]
        + (" each" if procs > 1 else "")
        + f", {first.note.split(', ')[-1].split(';')[0]}",
    )


# ------------------------------------------------------------------------------------------ (b) naive server


def run_naive_server(args: argparse.Namespace) -> None:
    """The naive server (run in a subprocess by --naive-server PORT); its model work is
    ``servers/qa_model.py``'s, which the LitServe and Mosec servers run too."""
    import torch
    import uvicorn
    from fastapi import FastAPI

    sys.path.insert(0, str(HERE / "servers"))
    from qa_model import QAModel

    qa = QAModel(args.model, dtype=args.naive_dtype, device=args.device, max_seq_len=args.max_seq_len,
                 threads=args.cores)  # fmt: skip
    lock = threading.Lock()
    app = FastAPI()

    if args.device == "cuda":  # before serving: every request shape the clients will send, once
        batches = [qa.pad([qa.encode(q, c)]) for q, c in load_pairs(args.squad, args.questions)]
        firsts = first_of_each_shape([b.input_ids for b in batches])
        with torch.inference_mode():
            for i in firsts:
                qa.forward(batches[i])
        logger.info("naive server warmed over %d request shapes", len(firsts))

    @app.get("/readyz")
    def readyz() -> dict[str, str]:
        return {"status": "ready"}

    @app.post("/v1/qa")
    def answer(body: dict[str, Any]) -> dict[str, Any]:
        with lock:  # one request at a time, end to end
            return qa.answer(body["question"], body["context"])

    uvicorn.run(app, host="127.0.0.1", port=args.naive_server, log_level="warning")


# ------------------------------------------------------------------------------------------ load generator


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


# ------------------------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Throughput / latency of raw forward vs naive servers vs ONNX Runtime vs shardserve "
        "(see module doc)."
    )
    p.add_argument("--model", default="default", help="model name or HF directory (default: %(default)s)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16", "int8"],
        help="precision of (a) and of shardserve's explicit-flag rows; auto resolves as `shardserve serve` "
        "does (int8 for a model calibrated with `shardserve quantize` on x86 CPUs with AVX2 or better and no AMX, else bf16 on "
        "CPUs with AMX / AVX512-BF16, else fp32); int8 needs that calibration (default: %(default)s)",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where (a), (b), (b2) and shardserve compute: cpu, or cuda (the raw rows run as one process on "
        "the first GPU; (d), ONNX Runtime on the CPU, is skipped; every shardserve row gets --device cuda and "
        "the default --extra-config rows share the GPUs, e.g. --ranks-per-gpu 4) (default: %(default)s)",
    )
    p.add_argument("--clients", type=int, default=32, help="concurrent HTTP clients (default: %(default)s)")
    p.add_argument(
        "--duration-s", type=float, default=30.0, help="measured seconds per server (default: %(default)s)"
    )
    p.add_argument(
        "--warmup-s", type=float, default=5.0, help="unmeasured seconds of load first (default: %(default)s)"
    )
    p.add_argument(
        "--questions", type=int, default=512, help="distinct SQuAD questions cycled (default: %(default)s)"
    )
    p.add_argument("--squad", type=Path, default=DEFAULT_SQUAD, help="SQuAD v1.1 JSON (default: %(default)s)")
    p.add_argument(
        "--context-cache-mb",
        type=float,
        default=0.0,
        help="shardserve's tokenized-context cache (`--context-cache-mb`); 0 here by default: the questions "
        "repeat, so a cache would skip tokenizing every context seen before, which unseen text never "
        "does; the server's own default is 32 (default: %(default)s)",
    )
    p.add_argument(
        "--cores",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads of (a), (b), (b2) and ONNX Runtime (default: %(default)s)",
    )
    p.add_argument(
        "--max-seq-len", type=int, default=384, help="window length, every part (default: %(default)s)"
    )
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=32,
        help="windows per batch, (a), (d) and shardserve's explicit rows (default: %(default)s)",
    )
    p.add_argument(
        "--pp", type=int, default=1, help="shardserve pipeline stages per replica (default: %(default)s)"
    )
    p.add_argument(
        "--tp", type=int, default=1, help="shardserve tensor-parallel ranks per stage (default: %(default)s)"
    )
    p.add_argument("--replicas", type=int, default=2, help="shardserve replica gangs (default: %(default)s)")
    p.add_argument(
        "--threads-per-rank",
        type=int,
        default=1,
        help="shardserve torch threads per rank (default: %(default)s)",
    )
    p.add_argument(
        "--max-queue-delay-ms",
        type=float,
        default=10.0,
        help="shardserve batching delay (default: %(default)s)",
    )
    p.add_argument(
        "--length-buckets",
        default="",
        help="shardserve buckets of the explicit configs (default: the server's own choice)",
    )
    p.add_argument(
        "--model-workers",
        type=int,
        default=None,
        help="model worker processes of the LitServe (e) and Mosec (f) rows, each with --cores / this many "
        "torch threads (default: --cores on cpu, one single-thread worker per core; 1 on cuda)",
    )
    p.add_argument(
        "--extra-config",
        action="append",
        default=None,
        metavar="FLAGS",
        help="another explicit shardserve configuration, as `shardserve serve` flags replacing --pp/--tp/"
        "--replicas/--threads-per-rank (repeatable; {cores} and {half} expand to --cores and --cores/2). "
        f"Default: {' | '.join(DEFAULT_EXTRA_CONFIGS)} (on cuda: {' | '.join(DEFAULT_EXTRA_CONFIGS_CUDA)}); "
        "--extra-config '' measures none",
    )
    p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="extra `shardserve serve` argument for the explicit rows (repeatable)",
    )
    p.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=SKIPPABLE,
        help="skip a part: raw (a), naive (b), naive-bf16 (b2; also the bf16 rows (e2) and (f2)), ort (d), "
        "litserve (e, e2), mosec (f, f2), default / best (the shardserve rows with default / explicit flags), "
        "shardserve (both)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    p.add_argument(
        "--raw-run", default=None, metavar="JSON", help="internal: run one raw measurement, print JSON"
    )
    p.add_argument(
        "--naive-server", type=int, default=None, metavar="PORT", help="internal: run server (b) on PORT"
    )
    p.add_argument("--naive-dtype", default="float32", help="internal: dtype of the naive server")
    return p


def machine_info(dtype: str, device: str = "cpu", *, model: str | None = None) -> dict[str, Any]:
    """CPU, its reduced-precision units, the GPU on cuda, and the dtype ``dtype`` resolves to on ``device``
    (for ``model``: auto picks int8 where it is calibrated, as the server does; printed with the table)."""
    import torch

    from shardserve.models.cpu import cpu_capabilities
    from shardserve.partitioner.precision import resolve_dtype

    caps = cpu_capabilities()
    calibrated = False
    if model is not None:
        from shardserve.models.registry import resolve_model
        from shardserve.partitioner.int8 import calibration_path

        calibrated = calibration_path(resolve_model(model)).is_file()
    choice = resolve_dtype(dtype, device, int8_calibrated=calibrated)
    try:
        import onnxruntime

        ort_version = onnxruntime.__version__
    except ImportError:
        ort_version = None
    return {
        "cpu": caps.describe(),
        "bf16_units": caps.bf16,
        "amx": caps.amx,
        "int8_kernels": caps.int8_unit or None,
        "dtype_requested": dtype,
        "dtype": choice.name,
        "dtype_reason": choice.reason,
        "torch": torch.__version__,
        "onnxruntime": ort_version,
        **{part: _version(part) for part, *_ in FRAMEWORKS},  # litserve, mosec: None when not installed
        "cores": os.cpu_count(),
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
    }


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def explicit_configs(args: argparse.Namespace) -> list[list[str]]:
    """The explicit-flag shardserve configurations: the --pp/--tp/--replicas/--threads-per-rank one,
    then each --extra-config (placement flags only; batching flags and --dtype are added to all)."""
    half = max(1, args.cores // 2)
    first = ["--pp", str(args.pp), "--tp", str(args.tp), "--replicas", str(args.replicas)]
    first += ["--threads-per-rank", str(args.threads_per_rank)]
    extra = args.extra_config
    if extra is None:
        extra = DEFAULT_EXTRA_CONFIGS_CUDA if args.device == "cuda" else DEFAULT_EXTRA_CONFIGS
    configs = [first]
    for text in extra:
        flags = shlex.split(text.format(cores=args.cores, half=half))
        if flags and flags not in configs:
            configs.append(flags)
    return configs


def ratio_lines(results: list[Result], *, cores: int | None = None) -> list[str]:
    """The ratios of the shardserve rows to the other parts, with the issue-9 targets; with
    ``cores``, also the ceiling its server process's own CPU per answer puts on the default row."""

    def best(prefix: tuple[str, ...]) -> Result | None:
        rows = [r for r in results if r.name.startswith(prefix) and r.questions_per_s > 0]
        return max(rows, key=lambda r: r.questions_per_s) if rows else None

    default = best(("(c) shardserve default",))
    explicit = best(("(c) shardserve flags",))
    limit = best(("(a) ", "(a') ", "(a2) ", "(a3) "))
    naive = best(("(b) ",))
    naive16 = best(("(b2) ",))
    frameworks = [  # (e), (e2), (f), (f2)
        (best((f"({letter}{suffix}) ",)), f"{title} {short} server ({letter}{suffix})")
        for _, letter, title, _ in FRAMEWORKS
        for suffix, short in (("", "fp32"), ("2", "bf16"))
    ]
    ort = best(("(d) ",))
    ort_fp32 = best(("(d) ONNX Runtime fp32",))  # int8 is faster but breaks the accuracy bound
    lines = []
    for label, c in (("default flags", default), ("best flags", explicit)):
        if c is None:
            continue
        lines.append(f"shardserve {label} [{c.name}]: {c.questions_per_s:.1f} q/s")
        for other, what, target in (
            (limit, "raw forward limit (a)", 0.9),
            (naive, "naive fp32 server (b)", 4.0),
            (naive16, "naive bf16 server (b2)", None),
            *((row, what, None) for row, what in frameworks),
            (ort, "ONNX Runtime best raw (d)", 2.0),
            (ort_fp32, "ONNX Runtime best accurate raw (d, fp32)", None),
        ):
            if other is None or (other is ort_fp32 and ort is ort_fp32):
                continue
            ratio = c.questions_per_s / other.questions_per_s
            goal = (
                ""
                if target is None or label != "default flags"
                else (f"  (target >= {target:g}x: {'met' if ratio >= target else 'NOT met'})")
            )
            lines.append(f"  / {what} [{other.name}]: {ratio:.2f}x{goal}")
    if default is not None and default.server_cpu_ms and limit is not None and cores:
        # the server process shares the cores: at q answers/s it leaves cores - q * f to the model,
        # which at best computes limit/cores answers per core-second: q = L / (1 + f * L / cores)
        ceiling = limit.questions_per_s / (1 + default.server_cpu_ms / 1000 * limit.questions_per_s / cores)
        lines.append(
            f"  ceiling from the server process's {default.server_cpu_ms:.1f} ms CPU per answer on {cores} "
            f"cores, batching as good as the limit's: {ceiling:.1f} q/s = "
            f"{ceiling / limit.questions_per_s:.2f}x the limit"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    if args.naive_server is not None:
        run_naive_server(args)
        return 0
    pairs = load_pairs(args.squad, args.questions)
    if args.raw_run is not None:
        spec = json.loads(args.raw_run)
        print(json.dumps(asdict(bench_raw(args, pairs, **spec))))
        return 0
    info = machine_info(args.dtype, args.device, model=args.model)
    dtype = info["dtype"]
    logger.info("cpu %s; --dtype %s -> %s (%s)", info["cpu"], args.dtype, dtype, info["dtype_reason"])
    skip = set(args.skip)
    on_gpu = args.device == "cuda"
    if on_gpu:
        skip.add("ort")
        print("skipping (d) ONNX Runtime: it runs on the CPU here, the other rows on the GPU")
    if "shardserve" in skip:
        skip |= {"default", "best"}
    results: list[Result] = []
    bs, d, cores = args.max_batch_size, args.duration_s, args.cores
    if "raw" not in skip:
        logger.info("(a) raw batched forward, %.0f s, %s", args.duration_s, dtype)
        runs = [(1, cores, bs, d, f"(a) raw batched {dtype}, 1 proc")]
        if on_gpu:
            runs.append((1, cores, 1, d / 3, f"(a2) raw batch 1 {dtype}, 1 proc"))  # what batching buys
        else:
            if cores > 1:  # the same cores used data-parallel, as shardserve's single-thread replicas do
                runs.append((cores, 1, bs, d, f"(a') raw batched {dtype}, {cores} procs"))
            runs.append((cores, 1, 1, d / 3, f"(a2) raw batch 1 {dtype}, {cores} procs"))
            if bs > SMALL_BATCH:
                name = f"(a3) raw batch {SMALL_BATCH} {dtype}, {cores} procs"
                runs.append((cores, 1, SMALL_BATCH, d / 2, name))
        for procs, threads, batch, duration, name in runs:
            logger.info("%s: %d x %d threads, batch %d, %.0f s", name, procs, threads, batch, duration)
            results.append(
                raw_in_subprocess(
                    args,
                    procs=procs,
                    threads=threads,
                    batch_size=batch,
                    duration_s=duration,
                    name=name,
                    dtype=dtype,
                    device=args.device,
                )
            )
    if "ort" not in skip:
        if info["onnxruntime"] is None:
            print("skipping (d) ONNX Runtime: onnxruntime not installed (pip install -e '.[bench]')")
        else:
            with tempfile.TemporaryDirectory(prefix="bench-onnx-") as onnx_dir:
                for engine in ("ort-fp32", "ort-int8"):
                    for batch in (bs, 1):
                        name = f"(d) ONNX Runtime {engine[4:]}, batch {batch}"
                        logger.info("%s, %d threads, %.0f s", name, cores, d / 2)
                        results.append(
                            raw_in_subprocess(
                                args,
                                procs=1,
                                threads=cores,
                                batch_size=batch,
                                duration_s=d / 2,
                                name=name,
                                engine=engine,
                                onnx_dir=onnx_dir,
                            )
                        )
    for part, naive_dtype, name in (
        ("naive", "float32", "(b) naive FastAPI fp32"),
        ("naive-bf16", "bfloat16", "(b2) naive FastAPI bf16"),
    ):
        if part in skip:
            continue
        port = free_port()
        cmd = [sys.executable, __file__, "--naive-server", str(port), "--model", args.model,
               "--cores", str(cores), "--max-seq-len", str(args.max_seq_len), "--naive-dtype", naive_dtype,
               "--device", args.device]  # fmt: skip
        note = f"{cores} threads, {naive_dtype} on {args.device}"
        if on_gpu:  # the server warms itself over the questions' request shapes before it turns ready
            cmd += ["--squad", str(args.squad), "--questions", str(args.questions)]
            note += ", warmed over every request shape"
        logger.info("%s, 1 request at a time, %d clients", name, args.clients)
        results.append(bench_server(cmd, port, pairs, args, name, note))
    precisions = [("float32", "fp32", "")] + ([] if "naive-bf16" in skip else [("bfloat16", "bf16", "2")])
    for part, letter, title, _ in FRAMEWORKS:
        if part in skip:
            continue
        if info[part] is None or importlib.util.find_spec(part) is None:
            print(f"skipping ({letter}) {title}: {part} not installed (pip install -e '.[bench]')")
            continue
        for dtype_name, short, suffix in precisions:
            name = f"({letter}{suffix}) {title} {short}"
            cmd, ready, note = framework_server(part, args, pairs, dtype_name, port := free_port())
            logger.info("%s: %s, %d clients", name, note, args.clients)
            results.append(bench_server(cmd, port, pairs, args, name, note, ready=ready, front_end=True))
    base = [sys.executable, "-m", "shardserve.cli", "--log-level", "WARNING", "serve", "--model", args.model,
            "--host", "127.0.0.1", "--max-seq-len", str(args.max_seq_len),
            "--max-queue-size", str(max(256, 4 * args.clients)), "--device", args.device,
            "--context-cache-mb", str(args.context_cache_mb)]  # fmt: skip
    if "default" not in skip:
        port = free_port()
        logger.info("(c) shardserve, default flags")
        results.append(
            bench_server(
                [*base, "--port", str(port)],
                port,
                pairs,
                args,
                "(c) shardserve default flags",
                "no placement/precision flags: " + _default_placement(args.device, args.model),
            )
        )
    if "best" not in skip:
        batching = ["--max-batch-size", str(bs), "--max-queue-delay-ms", str(args.max_queue_delay_ms),
                    "--dtype", args.dtype]  # fmt: skip
        batching += ["--length-buckets", args.length_buckets] if args.length_buckets else []
        for i, flags in enumerate(explicit_configs(args), start=1):
            port = free_port()
            cmd = [*base, "--port", str(port), *batching, *flags, *args.serve_arg]  # a config's --dtype wins
            note = " ".join(flags + batching[:4]) + ("" if "--dtype" in flags else f" --dtype {args.dtype}")
            logger.info("(c) shardserve flags #%d: %s", i, note)
            results.append(bench_server(cmd, port, pairs, args, f"(c) shardserve flags #{i}", note))
    print_table(results, args, info)
    if args.json is not None:
        payload = {"machine": info, "args": {k: str(v) for k, v in vars(args).items()},
                   "results": [asdict(r) for r in results], "ratios": ratio_lines(results, cores=_shared_cores(args))}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


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


def _default_placement(device: str, model: str) -> str:
    """What `shardserve serve --model MODEL --device DEVICE` with no other flags picks on this machine
    (its own settings)."""
    try:
        from shardserve.serving.frontend.layout import serve_precision
        from shardserve.serving.frontend.settings import ServeSettings

        s = ServeSettings(model=[model], device=device)
        lo, _ = s.replica_bounds
        dtype = serve_precision(s).name  # int8 where the model is calibrated and the CPU has int8 kernels
        return f"{lo} replica(s) x pp={s.pp} tp={s.tp} x {s.rank_threads} thread(s)/rank, {dtype}"
    except Exception as err:  # the settings API moved: the row is still measured
        return f"(placement unknown: {err})"


def _shared_cores(args: argparse.Namespace) -> int | None:
    """The cores the front end shares with the model (None on cuda: the model computes on the GPU)."""
    return None if args.device == "cuda" else args.cores


def print_table(results: list[Result], args: argparse.Namespace, info: dict[str, Any]) -> None:
    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    print(
        f"\nmodel={args.model} clients={args.clients} duration={args.duration_s:g}s cores={info['cores']} "
        f"questions={args.questions} torch={info['torch']} onnxruntime={info['onnxruntime'] or 'not installed'} "
        + " ".join(f"{part}={info.get(part) or 'not installed'}" for part, *_ in FRAMEWORKS)
    )
    print(
        f"cpu: {info['cpu']}; bf16 units: {info['bf16_units']}, AMX: {info['amx']}, "
        f"int8 kernels: {info['int8_kernels'] or 'none'}"
    )
    if info["gpu"]:
        print(f"gpu: {info['gpu']} (the raw rows, the naive servers and shardserve compute on it)")
    print(f"--dtype {info['dtype_requested']} -> {info['dtype']} ({info['dtype_reason']})")
    print(f"{'':36} {'q/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'ok':>6} {'err':>5}  note")
    for r in results:
        print(
            f"{r.name:36} {r.questions_per_s:8.1f} {fmt(r.p50_ms):>8} {fmt(r.p99_ms):>8} {r.completed:6d} "
            f"{r.errors:5d}  {r.note}"
        )
    for line in ratio_lines(results, cores=_shared_cores(args)):
        print(line)


if __name__ == "__main__":
    sys.exit(main())
