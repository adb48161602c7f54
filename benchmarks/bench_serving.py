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
import importlib.util
import json
import logging
import os
import shlex
import sys
import tempfile
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

from serving_procs import bench_server, framework_server
from serving_raw import bench_raw, first_of_each_shape, raw_in_subprocess
from serving_report import FRAMEWORKS, Result, machine_info, print_table, ratio_lines, shared_cores

from shardserve.loadtest.local_server import free_port

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


# ------------------------------------------------------------------------------------------ data


def load_pairs(path: Path, n: int) -> list[tuple[str, str]]:
    if not path.is_file():
        logger.warning("%s not found: using %d built-in questions", path, len(BUILTIN))
        return list(BUILTIN)
    data = json.loads(path.read_text())
    pairs = [(qa["question"], p["context"]) for a in data["data"] for p in a["paragraphs"] for qa in p["qas"]]
    step = max(1, len(pairs) // n)  # spread over articles
    return pairs[::step][:n]


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
                   "results": [asdict(r) for r in results], "ratios": ratio_lines(results, cores=shared_cores(args))}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


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


if __name__ == "__main__":
    sys.exit(main())
