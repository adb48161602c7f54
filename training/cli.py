"""``shardserve train`` and ``shardserve eval``: fine-tune on the serving partitions, score SQuAD EM/F1.

    shardserve train --model tiny-bert --train-file ../shared/data/squad/squad-v1.1-train-pool.json \\
        --holdout-articles 6 --pp 2 --tp 1 --schedule 1f1b --output /tmp/run --max-steps 50
    shardserve eval --model /tmp/run/final --data ../shared/data/squad/squad-v2.0-half.json --json
    shardserve train --help       # every flag explained
    # stage 1 on another host (README "Gangs across hosts"): there, `MASTER_ADDR=10.0.0.1
    # MASTER_PORT=29500 RANK=1 shardserve worker` with the same SHARDSERVE_GANG_KEY
    shardserve train ... --pp 2 --external-ranks 1 --gang-host 10.0.0.1 --gang-port 29500
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from partitioner.precision import DTYPE_CHOICES, PRECISION_CHOICES, PrecisionError
from partitioner.runtime.gang_flags import add_gang_arguments, gang_flags_from_args
from partitioner.schedules import SCHEDULES
from shardserve.flags import DefaultsHelpFormatter

if TYPE_CHECKING:
    from models.qa_processing import WindowConfig
    from partitioner.runtime.remote import GangNetwork

logger = logging.getLogger(__name__)


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="fine-tune a QA model over the serving partitions (pipeline + tensor parallel)",
        description=(
            "Fine-tune an extractive-QA model on SQuAD-format data with the same PartitionPlan and "
            "gang of worker processes that serve it. Writes Hugging Face-format checkpoints "
            "(OUTPUT/checkpoint-STEP, OUTPUT/final) that transformers and `shardserve serve` load."
        ),
        formatter_class=DefaultsHelpFormatter,
    )
    g = p.add_argument_group("model and data")
    g.add_argument(
        "--model", required=True, help="registry name (default, minilm, tiny-bert, ...) or HF model dir"
    )
    g.add_argument("--train-file", required=True, help="SQuAD v1.1/v2.0 JSON to train on")
    g.add_argument("--eval-file", default=None, help="SQuAD JSON to evaluate on (else the held-out articles)")
    g.add_argument(
        "--holdout-articles",
        type=int,
        default=0,
        help="hold out this many whole articles of --train-file for eval",
    )
    g.add_argument("--split-seed", type=int, default=0, help="seed of the by-article train/eval split")
    g.add_argument(
        "--max-train-examples",
        type=int,
        default=None,
        help="use only the first N (>= 1) training questions",
    )
    g.add_argument(
        "--max-eval-examples", type=int, default=None, help="evaluate only the first N (>= 1) questions"
    )
    g.add_argument(
        "--max-seq-len", type=int, default=256, help="window length in tokens (at most the model's positions)"
    )
    g.add_argument("--doc-stride", type=int, default=128, help="overlap between consecutive windows (tokens)")
    g.add_argument(
        "--max-question-len", type=int, default=64, help="questions are truncated to this many tokens"
    )
    g.add_argument(
        "--output",
        required=True,
        help="run directory for checkpoints, features cache and eval results (created once the data "
        "has been read and checked)",
    )
    g = p.add_argument_group("parallelism")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage")
    g.add_argument(
        "--dp",
        type=int,
        default=1,
        help="data-parallel copies of the pp x tp pipeline (dp*pp*tp ranks); each runs batch/micro/dp "
        "micro-batches of every global batch, gradients are all-reduced (AdamW state replicated)",
    )
    g.add_argument(
        "--bucket-mb", type=float, default=25.0, help="dp > 1: gradient all-reduce bucket size in MiB"
    )
    g.add_argument(
        "--boundaries", type=int, nargs="*", default=None, help="manual split: first layer of stages 1..pp-1"
    )
    g.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu ranks, or one GPU per rank")
    g.add_argument(
        "--precision",
        choices=PRECISION_CHOICES,
        default="auto",
        help="compute precision: fp32, or bf16/fp16 autocast over fp32 master weights and optimizer "
        "state (fp16 with dynamic loss scaling; refused on a CPU without fp16 units); auto: bf16 on "
        "GPUs and CPUs with bf16 units (AMX / AVX512-BF16), else fp32",
    )
    g.add_argument(
        "--threads-per-rank", type=int, default=None, help="torch threads per rank (default: cores/world)"
    )
    add_gang_arguments(
        p.add_argument_group(
            "a gang across hosts (the same flags as serve's; each external rank runs `shardserve worker` "
            "on its host; rank 0 stays here)"
        )
    )
    g = p.add_argument_group("optimisation")
    g.add_argument("--batch-size", type=int, default=32, help="global batch: examples per optimizer step")
    g.add_argument(
        "--micro-batch-size",
        type=int,
        default=8,
        help="examples per pipeline micro-batch (gradient accumulation)",
    )
    g.add_argument("--epochs", type=float, default=1.0, help="passes over the training features")
    g.add_argument("--max-steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    g.add_argument("--lr", type=float, default=5e-5, help="peak learning rate (AdamW)")
    g.add_argument(
        "--weight-decay", type=float, default=0.01, help="AdamW decay (not on biases / LayerNorms)"
    )
    g.add_argument("--warmup-ratio", type=float, default=0.1, help="share of steps of linear LR warm-up")
    g.add_argument(
        "--max-grad-norm", type=float, default=1.0, help="global gradient-norm clip over all ranks (0: off)"
    )
    g.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon")
    g.add_argument("--seed", type=int, default=0, help="seed of the data order, dropout and LoRA init")
    g.add_argument(
        "--dropout", type=float, default=None, help="override the model's dropout (0: deterministic)"
    )
    g.add_argument(
        "--group-by-length", action="store_true", help="batch windows of similar length (less padding)"
    )
    g.add_argument(
        "--answer-occurrences",
        choices=("first", "all"),
        default="all",
        help="first: learn the labelled occurrence of the answer only; all: every occurrence of the "
        "answer text in the window (marginal likelihood; SQuAD labels one of several at random)",
    )
    g = p.add_argument_group("parameter-efficient fine-tuning")
    g.add_argument("--lora-rank", type=int, default=0, help="LoRA rank on attention/MLP projections (0: off)")
    g.add_argument(
        "--lora-alpha", type=float, default=16.0, help="LoRA scale numerator (update = alpha/rank * B A)"
    )
    g.add_argument(
        "--freeze-layers", type=int, default=0, help="freeze the embeddings and the lowest N layers"
    )
    g.add_argument(
        "--freeze-embeddings",
        action="store_true",
        help="freeze the embeddings only (full fine-tuning of every layer; export_overlay --base compresses it)",
    )
    g = p.add_argument_group("evaluation, checkpoints, logs")
    g.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: at the end only)")
    g.add_argument("--eval-batch-size", type=int, default=32, help="windows per evaluation micro-batch")
    g.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: final only)")
    g.add_argument("--keep-checkpoints", type=int, default=2, help="newest checkpoint-* directories kept")
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest OUTPUT/checkpoint-* with the settings that shape the training "
        "unchanged (steps, --seed, data, split, windows, batch, optimizer, model; without --elastic also "
        "--pp/--tp); how it runs, logs and saves may change; not with --overwrite. A damaged checkpoint "
        "(a rank file missing or cut short) is skipped with a warning for the newest intact one",
    )
    g.add_argument(
        "--elastic",
        action="store_true",
        help="with --resume: allow another --pp/--tp than the checkpoint's (weights and AdamW state are "
        "re-sharded); --dp may always change",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="train from scratch into an OUTPUT that already holds a run: its checkpoints, final model, "
        "curve and eval results are removed first (other files stay); not with --resume",
    )
    g.add_argument("--log-every", type=int, default=10, help="log a line every N steps (0: never)")
    g.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    g.add_argument(
        "--fail-at-step",
        type=int,
        default=None,
        help="testing only: the last rank crashes when it reaches step N",
    )
    p.set_defaults(func=cmd_train)


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="SQuAD exact match / F1 of a model (HasAns/NoAns for v2.0)",
        description="Score a QA model on a SQuAD-format file with the official answer normalisation.",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument(
        "--model", required=True, help="registry name (default, ...) or HF model dir (e.g. RUN/final)"
    )
    p.add_argument("--data", required=True, help="SQuAD v1.1/v2.0 JSON to score")
    p.add_argument(
        "--holdout-articles",
        type=int,
        default=0,
        help="score only the articles `train --holdout-articles N` held out of this file (same --split-seed)",
    )
    p.add_argument("--split-seed", type=int, default=0, help="seed of that by-article split")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages of the evaluation gang")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage")
    p.add_argument(
        "--max-seq-len", type=int, default=256, help="window length in tokens (at most the model's positions)"
    )
    p.add_argument("--doc-stride", type=int, default=128, help="overlap between consecutive windows")
    p.add_argument("--max-question-len", type=int, default=64, help="question truncation in tokens")
    p.add_argument("--batch-size", type=int, default=32, help="windows per forward micro-batch")
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="compute dtype: auto picks bfloat16 on CPUs with bf16 units (AMX, AVX512-BF16), else "
        "float32; logits and span decoding stay float32",
    )
    p.add_argument("--max-answer-length", type=int, default=30, help="longest answer span in tokens (1..512)")
    p.add_argument(
        "--null-threshold", type=float, default=None, help="v2.0: answer '' when null - best > this"
    )
    p.add_argument(
        "--max-examples",
        type=int,
        default=None,
        help="score only the first N (>= 1) questions",
    )
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    p.set_defaults(func=cmd_eval)


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Register this package's ``shardserve`` subcommands."""
    _add_train(sub)
    _add_eval(sub)


def input_file_error(path: str | None, flag: str) -> str | None:
    """Why ``path`` (given to ``flag``) cannot be read as an input file, or None when it can."""
    if path is None:
        return None
    p = Path(path)
    if not p.exists():
        return f"{flag} {path}: no such file"
    if not p.is_file():
        return f"{flag} {path}: not a file"
    if not os.access(p, os.R_OK):
        return f"{flag} {path}: not readable"
    return None


def flag_conflict(args: argparse.Namespace) -> str | None:
    """Flags that contradict each other (or mean nothing without another), or None."""
    if args.resume and args.overwrite:
        return (
            "--resume and --overwrite contradict each other: --resume continues the run in --output, "
            "--overwrite starts it again from scratch; pass one"
        )
    if args.elastic and not args.resume:
        return "--elastic only applies with --resume (it re-shards a checkpoint to another --pp/--tp)"
    return None


def window_config(args: argparse.Namespace) -> WindowConfig:
    """The ``--max-seq-len`` / ``--doc-stride`` / ``--max-question-len`` flags as one window (ValueError if bad)."""
    from models.qa_processing import WindowConfig

    return WindowConfig(
        max_seq_len=args.max_seq_len, doc_stride=args.doc_stride, max_question_len=args.max_question_len
    )


def gang_error_line(exc: Exception) -> str:
    """A ``GangError`` in one line: its first (naming the rank), plus the failing rank's own last
    traceback line when the first ends at "failed:"."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    if first.endswith(":") and len(lines) > 1:
        cause = next((line for line in reversed(lines) if not line.startswith("(then also down")), "")
        first = f"{first} {cause}"
    return first


def network_problem(args: argparse.Namespace) -> tuple[str | None, GangNetwork | None]:
    """(why the gang flags cannot be used, None) or (None, the ``GangNetwork`` they describe)."""
    try:
        flags = gang_flags_from_args(args)
    except ValueError as exc:
        return f"invalid gang settings: {exc}", None
    layout = f"dp={args.dp} x pp={args.pp} x tp={args.tp}"
    problems = flags.gang_problems(world_size=args.dp * args.pp * args.tp, layout=layout)
    if problems:
        return "invalid gang settings: " + "; ".join(problems), None
    from training.remote_program import REMOTE_PROGRAM  # what the ranks on other hosts run

    return None, dataclasses.replace(flags.network(), program=REMOTE_PROGRAM)


def stopped_run_hint(output: Path) -> str:
    """Where a run stopped early (Ctrl-C, SIGTERM) stands: the checkpoint ``--resume`` continues
    from, or how to start again when none was written."""
    from training.checkpoint import latest_checkpoint, run_artifacts

    latest = latest_checkpoint(output)
    if latest is not None:
        return f"the newest checkpoint is {latest}; the same command with --resume continues from it"
    if run_artifacts(output):  # a curve, a temporary checkpoint: a new run needs --overwrite
        return "no checkpoint was written yet; the same command with --overwrite starts again"
    return "no checkpoint was written yet"


def cmd_train(args: argparse.Namespace) -> int:
    """``shardserve train``; a SIGTERM stops it like Ctrl-C (the ranks killed), in one line, exit 143."""
    from training.sigterm import Terminated, raise_on_sigterm

    try:
        with raise_on_sigterm():
            return _train(args)
    except Terminated as exc:  # the ranks were killed on the way out (trainer.train)
        print(f"terminated (SIGTERM): {stopped_run_hint(Path(args.output))}", file=sys.stderr)
        return exc.exit_code


def _train(args: argparse.Namespace) -> int:
    from partitioner.runtime.gang import GangError
    from training.checkpoint import ResumeError
    from training.squad_data import SquadFormatError
    from training.trainer import TrainConfig, TrainConfigError, train

    problem, network = network_problem(args)
    problem = (
        problem
        or flag_conflict(args)
        or input_file_error(args.train_file, "--train-file")
        or input_file_error(args.eval_file, "--eval-file")
    )
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        window = window_config(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        cfg = TrainConfig(
            model=args.model,
            train_file=args.train_file,
            output=args.output,
            eval_file=args.eval_file,
            holdout_articles=args.holdout_articles,
            split_seed=args.split_seed,
            max_train_examples=args.max_train_examples,
            max_eval_examples=args.max_eval_examples,
            pp=args.pp,
            tp=args.tp,
            dp=args.dp,
            bucket_mb=args.bucket_mb,
            boundaries=tuple(args.boundaries) if args.boundaries else None,
            schedule=args.schedule,
            batch_size=args.batch_size,
            micro_batch_size=args.micro_batch_size,
            epochs=args.epochs,
            max_steps=args.max_steps,
            lr=args.lr,
            weight_decay=args.weight_decay,
            warmup_ratio=args.warmup_ratio,
            max_grad_norm=args.max_grad_norm,
            adam_eps=args.adam_eps,
            seed=args.seed,
            dropout=args.dropout,
            window=window,
            lora_rank=args.lora_rank,
            lora_alpha=args.lora_alpha,
            freeze_layers=args.freeze_layers,
            freeze_embeddings=args.freeze_embeddings,
            eval_every=args.eval_every,
            eval_batch_size=args.eval_batch_size,
            save_every=args.save_every,
            keep_checkpoints=args.keep_checkpoints,
            resume=args.resume,
            elastic=args.elastic,
            device=args.device,
            precision=args.precision,
            threads_per_rank=args.threads_per_rank,
            log_every=args.log_every,
            group_by_length=args.group_by_length,
            answer_occurrences=args.answer_occurrences,
            fail_at_step=args.fail_at_step,
        )
        result = train(cfg, show_progress=not args.no_progress, network=network, overwrite=args.overwrite)
    except (TrainConfigError, PrecisionError, SquadFormatError, ResumeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except GangError as exc:  # a rank failed or was lost: one line; the whole story at INFO
        logger.info("%s", exc)
        print(f"error: {gang_error_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the ranks were killed on the way out (trainer.train)
        print(f"interrupted: {stopped_run_hint(Path(args.output))}", file=sys.stderr)
        return 130
    if result.steps_run == 0:
        print(
            f"nothing to train: the run finished at step {result.steps}; checkpoint: {result.final_checkpoint}"
        )
        return 0
    last = max(result.losses) if result.losses else None
    steps = f"{result.steps_run} step{'s' if result.steps_run != 1 else ''}"
    if result.start_step:
        steps += f" (resumed at step {result.start_step} of {result.steps})"
    print(
        f"trained {steps} in {result.train_seconds:.0f}s "
        f"({result.examples_per_s:.1f} examples/s), final loss "
        f"{result.losses[last] if last else float('nan'):.4f}; checkpoint: {result.final_checkpoint}"
    )
    if result.evals:
        step = max(result.evals)
        m = result.evals[step]
        print(f"eval at step {step}: exact {m['exact']:.2f} f1 {m['f1']:.2f} ({int(m['total'])} questions)")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """``shardserve eval``; a SIGTERM stops it like Ctrl-C (the ranks killed), in one line, exit 143."""
    from training.sigterm import Terminated, raise_on_sigterm

    try:
        with raise_on_sigterm():
            return _eval(args)
    except Terminated as exc:  # the evaluation gang was killed on the way out (Gang.__exit__)
        print("terminated (SIGTERM): the evaluation was stopped before it finished", file=sys.stderr)
        return exc.exit_code


def _eval(args: argparse.Namespace) -> int:
    from partitioner.runtime.gang import GangError
    from training.evaluate import EvalConfig, EvalConfigError, evaluate_model
    from training.squad_data import SquadFormatError

    problem = input_file_error(args.data, "--data")
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        window = window_config(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        cfg = EvalConfig(
            model=args.model,
            data=args.data,
            holdout_articles=args.holdout_articles,
            split_seed=args.split_seed,
            pp=args.pp,
            tp=args.tp,
            window=window,
            batch_size=args.batch_size,
            max_answer_length=args.max_answer_length,
            null_threshold=args.null_threshold,
            max_examples=args.max_examples,
            dtype=args.dtype,
        )
        metrics = evaluate_model(cfg)
    except (EvalConfigError, SquadFormatError, PrecisionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except GangError as exc:  # a rank failed or was lost (--pp / --tp): one line; the whole story at INFO
        logger.info("%s", exc)
        print(f"error: {gang_error_line(exc)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(metrics, sort_keys=True))
    else:
        for k in sorted(metrics):
            v = metrics[k]
            print(f"{k:>14}: {v:.2f}" if isinstance(v, float) else f"{k:>14}: {v}")
    return 0
