"""Serving benchmark: (a) raw batched forward, (b) a naive one-at-a-time FastAPI server, (c) shardserve.

One run, same machine, same model, same cores, same SQuAD questions:

(a) raw: the unpartitioned model, no HTTP, windows sorted by length into batches of
    --max-batch-size (the best case for padding), measured two ways on the same cores: one process
    with --cores torch threads, and (a') --cores single-thread processes at once (data parallel);
    the limit is the better of the two. Row (a2) (batch 1, data parallel) shows what batching
    itself buys on this model;
(b) naive: a FastAPI server (subprocess) that tokenizes, runs the model and decodes one request
    at a time (a lock around the whole request), torch using every core;
(c) shardserve: ``shardserve serve`` (subprocess) with the given partition / replicas / batching.

(b) and (c) are driven by --clients concurrent keep-alive HTTP clients (a minimal asyncio client,
so the load generator costs little CPU) posting /v1/qa for --duration-s after --warmup-s; it
prints throughput (questions/s), p50/p99 latency and the ratios shardserve/(a), shardserve/(b).

    python benchmarks/bench_serving.py                                  # default model, 32 clients
    python benchmarks/bench_serving.py --model tiny-bert --duration-s 10 --replicas 2
    python benchmarks/bench_serving.py --help                           # every flag

Questions come from ../shared/data/squad/squad-v1.1-train-pool.json when present (--squad), else
a small built-in set.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
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
) -> Result:
    import torch
    from transformers import AutoTokenizer

    from models.build import build_model
    from models.registry import resolve_model
    from serving.qa_processing import encode_qa, pad_windows

    torch.set_num_threads(threads)
    source = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(source.tokenizer_dir))
    enc = encode_qa(
        tok,
        [q for q, _ in pairs],
        [c for _, c in pairs],
        max_seq_len=args.max_seq_len,
        doc_stride=128,
        max_question_len=64,
    )
    # batch 1 keeps arrival order (what a one-at-a-time server computes); batches are length-sorted
    windows = enc.windows if batch_size == 1 else sorted(enc.windows, key=lambda w: w.num_tokens)
    batches = [
        pad_windows(windows[i : i + batch_size], pad_token_id=enc.pad_token_id)
        for i in range(0, len(windows), batch_size)
    ]
    types = source.config.type_vocab_size >= 2
    model = build_model(source)
    per_question = len(pairs) / len(windows)
    lat: list[float] = []
    done = 0
    with torch.inference_mode():
        model(batches[0].input_ids, batches[0].attention_mask, batches[0].token_type_ids if types else None)
        start = time.perf_counter()
        stop_at = start + duration_s
        for b in itertools.cycle(batches):
            t0 = time.perf_counter()
            model(b.input_ids, b.attention_mask, b.token_type_ids if types else None)
            lat.append(time.perf_counter() - t0)
            done += int(b.input_ids.shape[0])
            if time.perf_counter() >= stop_at:
                break
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
        f"{threads} threads; latency = per batch",
    )


def raw_in_subprocess(
    args: argparse.Namespace, *, procs: int, threads: int, batch_size: int, duration_s: float, name: str
) -> Result:
    """bench_raw in ``procs`` fresh interpreters running at the same time (data parallel when > 1);
    throughputs add up. Fresh processes also keep torch thread pools from distorting each other."""
    spec = json.dumps({"threads": threads, "batch_size": batch_size, "duration_s": duration_s, "name": name})
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
        + (" each" if procs > 1 else ""),
    )


# ------------------------------------------------------------------------------------------ (b) naive server


def run_naive_server(args: argparse.Namespace) -> None:
    """The naive server (run in a subprocess by --naive-server PORT)."""
    import torch
    import uvicorn
    from fastapi import FastAPI
    from transformers import AutoTokenizer

    from models.build import build_model
    from models.registry import resolve_model
    from serving.qa_processing import decode_spans, encode_qa, pad_windows

    torch.set_num_threads(args.cores)
    source = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(source.tokenizer_dir))
    model = build_model(source)
    types = source.config.type_vocab_size >= 2
    lock = threading.Lock()
    app = FastAPI()

    @app.get("/readyz")
    def readyz() -> dict[str, str]:
        return {"status": "ready"}

    @app.post("/v1/qa")
    def qa(body: dict[str, Any]) -> dict[str, Any]:
        with lock, torch.inference_mode():  # one request at a time, end to end
            enc = encode_qa(
                tok,
                [body["question"]],
                [body["context"]],
                max_seq_len=args.max_seq_len,
                doc_stride=128,
                max_question_len=64,
            )
            b = pad_windows(enc.windows, pad_token_id=enc.pad_token_id)
            out = model(b.input_ids, b.attention_mask, b.token_type_ids if types else None)  # (W, S, 2)
            pred = decode_spans(enc.windows, out[..., 0], out[..., 1], body["context"], top_k=1)
        return {
            "answers": [
                {"text": a.text, "score": a.score, "start": a.start, "end": a.end} for a in pred.answers
            ]
        }

    uvicorn.run(app, host="127.0.0.1", port=args.naive_server, log_level="warning")


# ------------------------------------------------------------------------------------------ load generator


async def _client(
    port: int, bodies: list[bytes], counter: Any, t_measure: float, t_stop: float, out: list
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while True:
            t0 = time.perf_counter()
            if t0 >= t_stop:
                return
            body = bodies[next(counter) % len(bodies)]
            writer.write(
                b"POST /v1/qa HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
            status = int((await reader.readline()).split()[1])
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            t1 = time.perf_counter()
            if t0 >= t_measure and t1 <= t_stop:
                out.append((t1 - t0, status))
    finally:
        writer.close()


def drive(port: int, pairs: list[tuple[str, str]], args: argparse.Namespace, name: str, note: str) -> Result:
    bodies = [json.dumps({"question": q, "context": c}).encode() for q, c in pairs]
    out: list[tuple[float, int]] = []

    async def main() -> None:
        now = time.perf_counter()
        t_measure, t_stop = now + args.warmup_s, now + args.warmup_s + args.duration_s
        counter = itertools.count()
        await asyncio.gather(
            *(_client(port, bodies, counter, t_measure, t_stop, out) for _ in range(args.clients))
        )

    asyncio.run(main())
    ok = sorted(lat for lat, status in out if status == 200)
    errors = sum(1 for _, status in out if status != 200)
    if len(ok) < 2:
        return Result(name, len(ok) / args.duration_s, None, None, len(ok), errors, note)
    q = statistics.quantiles(ok, n=100)
    return Result(name, len(ok) / args.duration_s, 1000 * q[49], 1000 * q[98], len(ok), errors, note)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before becoming ready")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server on port {port} not ready after {timeout_s} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bench_server(
    cmd: list[str], port: int, pairs: list, args: argparse.Namespace, name: str, note: str
) -> Result:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env)
    try:
        _wait_ready(port, proc, timeout_s=300)
        result = drive(port, pairs, args, name, note)
        stats = _batch_stats(port)
        if stats:
            result.note += f"; {stats}"
        return result
    finally:
        _stop(proc)


def _batch_stats(port: int) -> str:
    """Mean micro-batch size and padding ratio from shardserve's /metrics ('' for other servers)."""
    import httpx

    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return ""
    values = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key in (
            "shardserve_batch_size_windows_sum",
            "shardserve_batch_size_windows_count",
            "shardserve_padding_ratio",
        ):
            values[key] = float(value)
    n = values.get("shardserve_batch_size_windows_count", 0.0)
    if not n:
        return ""
    mean = values["shardserve_batch_size_windows_sum"] / n
    return f"mean batch {mean:.1f} windows, padding {100 * values.get('shardserve_padding_ratio', 0.0):.0f}%"


# ------------------------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Throughput / latency of raw batched forward vs a naive server vs shardserve (see module doc)."
    )
    p.add_argument("--model", default="default", help="model name or HF directory (default: %(default)s)")
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
        "--cores",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads of (a) and (b) (default: %(default)s)",
    )
    p.add_argument(
        "--max-seq-len", type=int, default=384, help="window length, all three (default: %(default)s)"
    )
    p.add_argument(
        "--max-batch-size", type=int, default=32, help="windows per batch, (a) and (c) (default: %(default)s)"
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
        default="64,96,128,160,192,256,320,384",
        help="shardserve buckets (default: %(default)s)",
    )
    p.add_argument(
        "--serve-arg", action="append", default=[], help="extra `shardserve serve` argument (repeatable)"
    )
    p.add_argument(
        "--skip", action="append", default=[], choices=["raw", "naive", "shardserve"], help="skip a part"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    p.add_argument(
        "--raw-run", default=None, metavar="JSON", help="internal: run one raw measurement, print JSON"
    )
    p.add_argument(
        "--naive-server", type=int, default=None, metavar="PORT", help="internal: run server (b) on PORT"
    )
    return p


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
    results: list[Result] = []
    if "raw" not in args.skip:
        logger.info("(a) raw batched forward, %.0f s", args.duration_s)
        bs, d = args.max_batch_size, args.duration_s
        cores = args.cores
        runs = [(1, cores, bs, d, "(a) raw batched, 1 process")]
        if cores > 1:  # the same cores used data-parallel, as shardserve's single-thread replicas do
            runs.append((cores, 1, bs, d, f"(a') raw batched, {cores} procs"))
        runs.append((cores, 1, 1, d / 3, f"(a2) raw batch 1, {cores} procs"))  # what batching buys
        for procs, threads, batch, duration, name in runs:
            logger.info("%s: %d x %d threads, batch %d, %.0f s", name, procs, threads, batch, duration)
            results.append(
                raw_in_subprocess(
                    args, procs=procs, threads=threads, batch_size=batch, duration_s=duration, name=name
                )
            )
    if "naive" not in args.skip:
        port = _free_port()
        cmd = [
            sys.executable,
            __file__,
            "--naive-server",
            str(port),
            "--model",
            args.model,
            "--cores",
            str(args.cores),
            "--max-seq-len",
            str(args.max_seq_len),
        ]
        logger.info("(b) naive server, %d clients", args.clients)
        results.append(
            bench_server(cmd, port, pairs, args, "(b) naive FastAPI, 1 at a time", f"{args.cores} threads")
        )
    if "shardserve" not in args.skip:
        port = _free_port()
        serve = [
            "--model",
            args.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--pp",
            str(args.pp),
            "--tp",
            str(args.tp),
            "--replicas",
            str(args.replicas),
            "--threads-per-rank",
            str(args.threads_per_rank),
            "--max-batch-size",
            str(args.max_batch_size),
            "--max-queue-delay-ms",
            str(args.max_queue_delay_ms),
            "--max-seq-len",
            str(args.max_seq_len),
            "--length-buckets",
            args.length_buckets,
            "--max-queue-size",
            str(max(256, 4 * args.clients)),
            *args.serve_arg,
        ]
        cmd = [sys.executable, "-m", "serving.cli", "--log-level", "WARNING", "serve", *serve]
        note = (
            f"pp={args.pp} tp={args.tp} replicas={args.replicas} threads/rank={args.threads_per_rank} "
            f"batch<={args.max_batch_size} delay={args.max_queue_delay_ms}ms"
        )
        logger.info("(c) shardserve: %s", note)
        results.append(bench_server(cmd, port, pairs, args, "(c) shardserve", note))
    print_table(results, args)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


def print_table(results: list[Result], args: argparse.Namespace) -> None:
    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    print(
        f"\nmodel={args.model} clients={args.clients} duration={args.duration_s:.0f}s cores={os.cpu_count()} "
        f"questions={args.questions}"
    )
    print(f"{'':34} {'q/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'ok':>6} {'err':>5}  note")
    for r in results:
        print(
            f"{r.name:34} {r.questions_per_s:8.1f} {fmt(r.p50_ms):>8} {fmt(r.p99_ms):>8} {r.completed:6d} "
            f"{r.errors:5d}  {r.note}"
        )
    c = next((r for r in results if r.name.startswith("(c)")), None)
    raw = [r for r in results if r.name.startswith(("(a)", "(a')"))]
    naive = next((r for r in results if r.name.startswith("(b)")), None)
    if c is None:
        return
    if raw:
        limit = max(raw, key=lambda r: r.questions_per_s)
        print(f"shardserve / raw forward limit (a) = best of (a), (a') [{limit.name}]: "
              f"{c.questions_per_s / limit.questions_per_s:.2f}x")  # fmt: skip
    if naive is not None and naive.questions_per_s > 0:
        print(f"shardserve / naive server (b): {c.questions_per_s / naive.questions_per_s:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
