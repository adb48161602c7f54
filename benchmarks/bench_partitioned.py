"""Forward throughput, side by side in one run: unpartitioned vs pipeline/tensor parallel vs transformers.

Measures examples/s for the same model, batch shape and cores:

  unpartitioned-1t   this project's EncoderForQA in-process, 1 torch thread (the baseline)
  unpartitioned-Nt   the same with N threads (intra-op parallelism on all cores)
  transformers-1t    AutoModelForQuestionAnswering, 1 thread (the reference implementation)
  gang pp=P tp=T     worker processes, 1 thread per rank, micro-batches streamed through the stages

and prints every figure with its ratio to the 1-thread unpartitioned model. The target on 2 CPU
cores is pp=2 >= 1.8x unpartitioned-1t. Every row runs at --dtype (auto: bf16 on CPUs with AMX /
AVX512-BF16, as ``shardserve serve`` picks; the CPU and its units are printed with the figures).

    python benchmarks/bench_partitioned.py                       # MiniLM, batch 8 x 256 tokens
    python benchmarks/bench_partitioned.py --dtype float32 --configs 2x1
    python benchmarks/bench_partitioned.py --model tiny-bert --batches 8 --configs 2x1,1x2
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from shardserve.models.build import build_model
from shardserve.models.cpu import cpu_capabilities
from shardserve.models.registry import MODEL_NAMES, resolve_model
from shardserve.partitioner.plan import ParallelDims, make_plan
from shardserve.partitioner.precision import DTYPE_CHOICES, resolve_dtype
from shardserve.partitioner.stream.driver import StreamGang
from shardserve.partitioner.stream.program import stream_spec


def _inputs(vocab: int, *, batch_size: int, seq_len: int, n: int, seed: int = 0) -> list[tuple]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1000, min(vocab, 20000), (batch_size, seq_len), generator=gen)  # (B, S)
        ids[:, 0] = 101
        out.append((ids, torch.ones(batch_size, seq_len, dtype=torch.long), None))
    return out


@torch.inference_mode()
def bench_in_process(model, batches: list[tuple], *, threads: int, hf: bool = False) -> float:
    """Examples/s of one process running the batches back to back (after one warm-up batch)."""
    torch.set_num_threads(threads)

    def run(b):
        return model(input_ids=b[0], attention_mask=b[1]) if hf else model(b[0], b[1])

    run(batches[0])
    t0 = time.perf_counter()
    for b in batches:
        run(b)
    return sum(b[0].shape[0] for b in batches) / (time.perf_counter() - t0)


def bench_gang(
    source,
    dims: ParallelDims,
    batches: list[tuple],
    *,
    threads_per_rank: int,
    dtype: str = "float32",
) -> float:
    """Examples/s of a gang with every micro-batch submitted at once (streamed through the stages)."""
    seq_len = batches[0][0].shape[1]
    plan = make_plan(source.config, dims, seq_len=seq_len)
    spec = stream_spec(source, plan, threads_per_rank=threads_per_rank, dtype=dtype)
    with StreamGang(spec, name=f"bench-pp{dims.pp}-tp{dims.tp}", start_timeout_s=900) as gang:
        gang.run(batches[:2], timeout_s=600)  # warm-up: every stage has seen the shapes
        t0 = time.perf_counter()
        gang.run(batches, timeout_s=600)
        return sum(b[0].shape[0] for b in batches) / (time.perf_counter() - t0)


def _parse_configs(text: str) -> list[ParallelDims]:
    dims = []
    for item in text.split(","):
        pp, _, tp = item.strip().partition("x")
        dims.append(ParallelDims(pp=int(pp), tp=int(tp or 1)))
    return dims


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="minilm", help=f"model name {MODEL_NAMES} or HF directory (default: %(default)s)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=8, help="examples per micro-batch (default: %(default)s)"
    )
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per example (default: %(default)s)")
    parser.add_argument(
        "--batches", type=int, default=24, help="micro-batches per measurement (default: %(default)s)"
    )
    parser.add_argument(
        "--configs",
        default="2x1,1x2,2x2",
        help="gang layouts to measure as PPxTP, comma-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="threads for the multi-threaded unpartitioned run (default: all cores, %(default)s)",
    )
    parser.add_argument(
        "--skip-transformers", action="store_true", help="do not measure the transformers reference"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="compute dtype of every row (auto: bf16 on CPUs with bf16 units, else fp32; span logits "
        "fp32) (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    choice = resolve_dtype(args.dtype, "cpu")

    source = resolve_model(args.model)
    batches = _inputs(
        source.config.vocab_size, batch_size=args.batch_size, seq_len=args.seq_len, n=args.batches
    )
    model = build_model(source, dtype=choice.dtype)
    rows: list[tuple[str, float]] = [("unpartitioned-1t", bench_in_process(model, batches, threads=1))]
    if args.threads > 1:
        rows.append(
            (f"unpartitioned-{args.threads}t", bench_in_process(model, batches, threads=args.threads))
        )
    if not args.skip_transformers:
        import tempfile
        from pathlib import Path

        from transformers import AutoModelForQuestionAnswering

        from shardserve.partitioner.stream.verify import reference_dir

        with tempfile.TemporaryDirectory() as tmp:
            ref = AutoModelForQuestionAnswering.from_pretrained(reference_dir(source, Path(tmp))).eval()
        rows.append(("transformers-1t", bench_in_process(ref.to(choice.dtype), batches, threads=1, hf=True)))
    torch.set_num_threads(1)
    for dims in _parse_configs(args.configs):
        rows.append(
            (
                f"gang pp={dims.pp} tp={dims.tp} (1 thread/rank)",
                bench_gang(source, dims, batches, threads_per_rank=1, dtype=choice.name),
            )
        )

    base = rows[0][1]
    print(
        f"\nmodel={source.name} batch={args.batch_size}x{args.seq_len} micro-batches={args.batches} "
        f"cores={os.cpu_count()} torch={torch.__version__}"
    )
    print(f"cpu: {cpu_capabilities().describe()}; --dtype {args.dtype} -> {choice.name} ({choice.reason})")
    print(f"{'configuration':<34} {'examples/s':>11} {'vs unpartitioned-1t':>20}")
    for name, value in rows:
        print(f"{name:<34} {value:>11.2f} {value / base:>19.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
