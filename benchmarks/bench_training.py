"""Training throughput: pipeline-parallel (pp=2, 1F1B), data-parallel (--dp D) and single-process
training on the same cores.

Runs the real trainer (``shardserve.training.driver.train``) on the shared SQuAD pool for a few optimizer
steps in each layout and prints training examples/s side by side with the ratio (target >= 0.9x).
The first step of each run (start-up, allocator warm-up) is excluded from the rate. Single-process
means one rank holding the whole model with all the cores as torch threads, either on the whole
batch at once or on the same micro-batches as the pipeline (gradient accumulation; every
micro-batch is trimmed to its longest window, so smaller micro-batches carry less padding);
pp=2 means two ranks with cores/2 threads each, micro-batched with 1F1B; ``--dp D`` (D >= 2) adds
a run of D data-parallel copies of the whole model (D ranks, cores/D threads each, each running
1/D of the micro-batches, gradients all-reduced in buckets).

    python benchmarks/bench_training.py                     # MiniLM, seq 256, 8 steps of 32
    python benchmarks/bench_training.py --steps 4 --seq-len 128 --model tiny-bert
    python benchmarks/bench_training.py --precision fp32          # the fp32 baseline of docs/benchmarks.md
    python benchmarks/bench_training.py --dp 2                    # + dp=2 (two copies, no pipeline)

--precision (fp32, bf16, fp16 or auto, as ``shardserve train``) sets every layout's autocast dtype
(master weights and optimizer state stay fp32); the resolved precision and the CPU are printed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

from shardserve.models.cpu import cpu_capabilities
from shardserve.models.qa_windows import WindowConfig
from shardserve.partitioner.precision import PRECISION_CHOICES, resolve_dtype
from shardserve.training.config import TrainConfig
from shardserve.training.driver import train

logger = logging.getLogger(__name__)

DEFAULT_DATA = (
    Path(__file__).resolve().parents[2] / "shared" / "data" / "squad" / "squad-v1.1-train-pool.json"
)


def run_one(args: argparse.Namespace, *, pp: int, micro: int, out: Path, dp: int = 1) -> float:
    """Examples/s of one short training run (``dp * pp`` ranks sharing the cores)."""
    cfg = TrainConfig(
        model=args.model,
        train_file=str(args.data),
        output=str(out),
        max_train_examples=args.examples,
        pp=pp,
        tp=1,
        dp=dp,
        schedule="1f1b",
        batch_size=args.batch_size,
        micro_batch_size=micro,
        max_steps=args.steps,
        lr=1e-4,
        dropout=0.0,
        window=WindowConfig(
            max_seq_len=args.seq_len,
            doc_stride=args.seq_len // 2,
            max_question_len=min(64, args.seq_len // 4),
        ),
        seed=0,
        log_every=0,
        threads_per_rank=max(1, (os.cpu_count() or 1) // (pp * dp)),
        precision=args.precision,
    )
    return train(cfg, show_progress=False).examples_per_s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="minilm", help="registry name or HF model dir")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="SQuAD JSON to train on")
    p.add_argument("--examples", type=int, default=600, help="training questions to tokenize")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per run (the first is not timed)")
    p.add_argument("--batch-size", type=int, default=32, help="global batch")
    p.add_argument("--micro-batch-size", type=int, default=4, help="pp=2 micro-batch (n_micro = batch/micro)")
    p.add_argument("--seq-len", type=int, default=256, help="window length")
    p.add_argument(
        "--dp",
        type=int,
        default=0,
        help="also time D data-parallel copies (pp=1, same micro-batches; 0: skip) (default: %(default)s)",
    )
    p.add_argument(
        "--precision",
        default="auto",
        choices=PRECISION_CHOICES,
        help="autocast precision over fp32 master weights, as `shardserve train` (auto: bf16 on CPUs "
        "with bf16 units, else fp32) (default: %(default)s)",
    )
    args = p.parse_args(argv)
    choice = resolve_dtype(args.precision, "cpu")
    logging.basicConfig(level=logging.WARNING)
    if not args.data.is_file():
        print(f"data file {args.data} not found", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        single = run_one(args, pp=1, micro=args.batch_size, out=Path(tmp) / "pp1")
        accum = run_one(args, pp=1, micro=args.micro_batch_size, out=Path(tmp) / "pp1-accum")
        piped = run_one(args, pp=2, micro=args.micro_batch_size, out=Path(tmp) / "pp2")
        data_par = (
            run_one(args, pp=1, dp=args.dp, micro=args.micro_batch_size, out=Path(tmp) / "dp")
            if args.dp >= 2
            else None
        )
    cores = os.cpu_count()
    n_micro = args.batch_size // args.micro_batch_size
    print(
        f"model={args.model} seq_len={args.seq_len} batch={args.batch_size} steps={args.steps} cores={cores}"
    )
    print(
        f"cpu: {cpu_capabilities().describe()}; --precision {args.precision} -> {choice.name} ({choice.reason})"
    )
    print(f"{'layout':<34} {'examples/s':>10}")
    print(f"{'single process (pp=1, ' + str(cores) + ' threads)':<34} {single:>10.2f}")
    print(f"{'single process, ' + str(n_micro) + ' micro-batches':<34} {accum:>10.2f}")
    print(f"{'pp=2 tp=1 1F1B (' + str(n_micro) + ' micro-batches)':<34} {piped:>10.2f}")
    print(f"ratio pp=2 / single (one batch): {piped / single:.2f}x (target >= 0.9x)")
    print(f"ratio pp=2 / single (same micro-batches): {piped / accum:.2f}x")
    if data_par is not None:
        print(f"{'dp=' + str(args.dp) + ' pp=1 (' + str(n_micro) + ' micro-batches)':<34} {data_par:>10.2f}")
        print(f"ratio dp={args.dp} / single (same micro-batches): {data_par / accum:.2f}x")
        print(f"ratio dp={args.dp} / pp=2: {data_par / piped:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
