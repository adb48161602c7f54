"""The raw rows of ``bench_serving.py``, no HTTP: (a) the model's forward over the questions' windows
in batches (torch, at a precision, on the CPU or a GPU) and (d) ONNX Runtime's, each measured in
whole passes over every window in fresh ``bench_serving.py --raw-run`` processes (several at once
for the data-parallel rows), and the set of batch shapes a GPU is warmed over before timing.

    python -m pytest tests/benchmarks/test_bench_helpers.py -q -k first_of_each_shape
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from serving_report import Result

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "bench_serving.py"  # its --raw-run runs one measurement (bench_raw) and prints it as JSON


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
    cmd = [sys.executable, str(SCRIPT), "--raw-run", spec, "--model", args.model, "--questions", str(args.questions),
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
