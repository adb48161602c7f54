"""A model larger than one rank should hold: a 1.7 B-parameter Llama-shaped QA model served at pp = 1, 2, 4.

Writes (once) a random-weight ``LlamaForQuestionAnswering`` checkpoint of Llama-3.2 width and 24
layers (hidden 2048, 32 query / 8 key-value heads, SwiGLU 8192, a 128 256-token table: 1.72 B
parameters, 3.4 GB of bf16 safetensors in 1 GB shards) into ``--dir`` (local disk; not committed),
then for each pipeline degree starts ``shardserve serve`` on it (bf16, one replica) and measures:

- time to ready (process start to ``/readyz`` 200);
- each rank's peak RSS (``VmHWM`` of the pids ``/status`` lists) beside the plan's estimate for
  that stage (``shardserve plan``'s serving bytes at the server's largest micro-batch); with
  ``--device cuda`` (the pp ranks of a gang share one GPU: ``--ranks-per-gpu pp``) also each rank's
  GPU memory after the questions (``nvidia-smi``'s per-process used memory: CUDA context plus what
  torch's caching allocator holds) beside the same estimate;
- answers per second over ``--questions`` SQuAD-like questions (``--concurrency`` at a time);
- and that a layout over ``--max-memory-per-rank`` is refused before any weight loads, with the
  numbers (``shardserve serve --pp 1 --max-memory-per-rank`` a little under its estimate).

    python benchmarks/bench_big_model.py                      # pp 1, 2, 4; ~10 min on 2 cores
    python benchmarks/bench_big_model.py --pp 2 --json big.json
    python benchmarks/bench_big_model.py --device cuda --questions 8   # a pp=4 gang on one GPU
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving_report import machine_info

logger = logging.getLogger("bench_big_model")

SHAPE: dict[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 8192,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}
SHARD_BYTES = 1 << 30
CONTEXT = (
    "The Normans were the people who in the 10th and 11th centuries gave their name to Normandy, a "
    "region in France. They were descended from Norse raiders and pirates from Denmark, Iceland and "
    "Norway who, under their leader Rollo, agreed to swear fealty to King Charles III of West Francia."
)
QUESTIONS = ("In what country is Normandy located?", "Who was the Norse leader?", "When did they live?")


def write_checkpoint(out: Path) -> Path:
    """The random bf16 checkpoint (seeded, tensor by tensor: never the whole model in memory)."""
    import transformers
    from safetensors.torch import save_file

    from shardserve.models.presets import tiny_bpe_tokenizer

    if (out / "model.safetensors.index.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(**SHAPE, architectures=["LlamaForQuestionAnswering"])
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in transformers.LlamaForQuestionAnswering(config).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}

    def flush() -> None:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif name.endswith(".bias"):
            t = torch.zeros(shape)
        else:
            t = torch.empty(shape).normal_(0.0, 0.02, generator=gen)
        shard[name] = t.to(torch.bfloat16)
        if sum(v.numel() * 2 for v in shard.values()) >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    total = sum(torch.Size(s).numel() for s in shapes.values())
    index = {"metadata": {"total_size": total * 2}, "weight_map": weight_map}
    config.save_pretrained(out)
    tiny_bpe_tokenizer("llama").save_pretrained(out)
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))  # last: marks it whole
    logger.info("wrote %.2f B parameters to %s", total / 1e9, out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss(pid: int) -> int:
    """A process's peak resident set (``VmHWM``), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def gpu_memory(pids: list[int], smi_csv: str | None = None) -> list[int | None]:
    """Each pid's GPU memory in bytes from ``nvidia-smi --query-compute-apps`` (``smi_csv``: its output,
    read here when None), summed over GPUs; None for a pid it does not list (e.g. another pid namespace)."""
    if smi_csv is None:
        try:
            smi_csv = subprocess.run(
                ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, check=True, timeout=60,
            ).stdout  # fmt: skip
        except (OSError, subprocess.SubprocessError) as err:  # no nvidia-smi: the other figures stand
            logger.warning("nvidia-smi failed: %s", err)
            smi_csv = ""
    used: dict[int, int] = {}
    for line in smi_csv.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():  # "[N/A]" memory: skipped
            used[int(fields[0])] = used.get(int(fields[0]), 0) + int(fields[1]) * 2**20  # MiB
    if not any(pid in used for pid in pids):
        logger.warning("nvidia-smi lists none of the rank pids %s: %r", pids, smi_csv.strip())
    return [used.get(pid) for pid in pids]


def ask(client: httpx.Client, body: dict[str, Any]) -> httpx.Response:
    """POST a question, waiting out 429s as their Retry-After says (a polite client)."""
    while (r := client.post("/v1/qa", json=body)).status_code == 429:
        time.sleep(float(r.headers.get("retry-after", 1)))
    return r


def serve_flags(model: Path, pp: int, args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "shardserve", "serve", "--model", str(model), "--pp", str(pp),
            "--replicas", "1", "--dtype", "bfloat16", "--max-seq-len", str(args.seq_len),
            "--doc-stride", str(args.seq_len // 4), "--max-question-len", str(args.seq_len // 4),
            "--max-batch-size", str(args.batch), "--gang-start-timeout-s", "1200",
            *(["--device", "cuda", "--ranks-per-gpu", str(pp)] if args.device == "cuda" else [])]  # fmt: skip


def estimates(model: Path, pp: int, args: argparse.Namespace) -> list[int]:
    """The plan's serving bytes per stage (bf16, at the server's largest micro-batch)."""
    from shardserve.models.registry import resolve_model
    from shardserve.partitioner.plan import ParallelDims, make_plan

    config = resolve_model(model).config
    plan = make_plan(config, ParallelDims(pp=pp), seq_len=args.seq_len)
    rows = plan.memory_estimates(config, batch_size=args.batch, seq_len=args.seq_len, dtype_bytes=2)
    return [r["serving_bytes"] for r in rows]


def run_pp(model: Path, pp: int, args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = subprocess.Popen([*serve_flags(model, pp, args), "--port", str(port)], env=os.environ | {"PYTHONUNBUFFERED": "1"})  # fmt: skip
    try:
        with httpx.Client(base_url=base, timeout=600) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server at pp={pp} exited with {proc.returncode}")
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            ready_s = time.perf_counter() - t0
            status = client.get("/ui/status").json()
            pids = [r["pid"] for r in status["replicas"][0]["ranks"]]
            body = [
                {"question": QUESTIONS[i % len(QUESTIONS)], "context": CONTEXT} for i in range(args.questions)
            ]
            client.post("/v1/qa", json=body[0]).raise_for_status()  # warm-up
            t1 = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as pool:
                for r in pool.map(lambda b: ask(client, b), body):
                    r.raise_for_status()
            qps = args.questions / (time.perf_counter() - t1)
            peaks = [peak_rss(p) for p in pids]
            gpu = gpu_memory(pids) if args.device == "cuda" else None
    finally:
        proc.terminate()
        proc.wait(120)
    est = estimates(model, pp, args)
    row = {"pp": pp, "ready_s": round(ready_s, 1), "answers_per_s": round(qps, 3),
           "peak_rss_bytes": peaks, "estimate_bytes": est,
           "rss_over_estimate": [round(p / e, 3) for p, e in zip(peaks, est, strict=True)]}  # fmt: skip
    if gpu is not None:
        row["gpu_bytes"] = gpu
        row["gpu_over_estimate"] = [
            None if g is None else round(g / e, 3) for g, e in zip(gpu, est, strict=True)
        ]
    logger.info("pp=%d: ready in %.0f s, %.2f answers/s, peak RSS / estimate %s%s", pp, ready_s, qps,
                row["rss_over_estimate"], f", GPU / estimate {row['gpu_over_estimate']}" if gpu else "")  # fmt: skip
    return row


def refusal(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``serve --pp 1`` with a limit 10 % under its estimate: refused before loading, with the numbers."""
    limit_mib = int(estimates(model, 1, args)[0] * 0.9 / 2**20)
    t0 = time.perf_counter()
    done = subprocess.run(
        [*serve_flags(model, 1, args), "--max-memory-per-rank", f"{limit_mib}MiB", "--port", str(free_port())],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    line = (done.stderr.strip().splitlines() or [""])[-1]
    return {"returncode": done.returncode, "seconds": round(time.perf_counter() - t0, 1), "line": line}


def per_rank(measured: list[int | None], estimates: list[int]) -> str:
    """``measured/estimate (ratio)`` in GiB for each rank; ``-`` where nothing was measured."""
    return "  ".join("-" if m is None else f"{m / 2**30:.2f}/{e / 2**30:.2f} ({m / e:.2f})"
                     for m, e in zip(measured, estimates, strict=True))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=Path("/tmp/shardserve-big"), help="where the checkpoint goes")
    p.add_argument("--pp", default="1,2,4", help="pipeline degrees to serve at, comma-separated")
    p.add_argument("--questions", type=int, default=12, help="questions timed per layout")
    p.add_argument("--concurrency", type=int, default=4, help="questions in flight")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per window")
    p.add_argument("--batch", type=int, default=4, help="windows per micro-batch (the estimate's batch)")
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu",
        help="where the ranks compute; cuda: each gang's pp ranks share one GPU (--ranks-per-gpu pp)",
    )  # fmt: skip
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    model = write_checkpoint(args.dir)
    info = machine_info("bfloat16", args.device)
    rows = [run_pp(model, int(pp), args) for pp in args.pp.split(",")]
    refused = refusal(model, args)
    print(f"\n{info['cpu']}; {SHAPE['num_hidden_layers']} x {SHAPE['hidden_size']} Llama, bf16, "
          f"batch {args.batch} x {args.seq_len}" + (f"; {info['gpu']}, --ranks-per-gpu pp" if info["gpu"] else ""))  # fmt: skip
    columns = [("peak RSS", "peak_rss_bytes")] + (
        [("GPU memory", "gpu_bytes")] if args.device == "cuda" else []
    )
    for label, key in columns:
        print(f"{'pp':>3} {'ready s':>8} {'answers/s':>10}  {label} / plan estimate per rank (GiB)")
        for r in rows:
            print(f"{r['pp']:>3} {r['ready_s']:>8.1f} {r['answers_per_s']:>10.3f}  "
                  f"{per_rank(r[key], r['estimate_bytes'])}")  # fmt: skip
    print(f"refused (exit {refused['returncode']} in {refused['seconds']} s): {refused['line']}")
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": info, "rows": rows, "refusal": refused}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
