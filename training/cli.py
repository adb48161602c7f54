"""``shardserve train``, ``eval`` and ``export-overlay``: fine-tune on the serving partitions, score
SQuAD EM/F1, ship a run as the default model's overlay.

The commands as data (``TRAIN``, ``EVAL``, ``EXPORT_OVERLAY``); the console script generates their
flags from the settings models (``shardserve.training.config.TrainSettings``, ``EvalSettings``,
``ExportOverlaySettings``).

    shardserve train --model tiny-bert --train-file ../shared/data/squad/squad-v1.1-train-pool.json \\
        --holdout-articles 6 --pp 2 --tp 1 --schedule 1f1b --output /tmp/run --max-steps 50
    shardserve eval --model /tmp/run/final --data ../shared/data/squad/squad-v2.0-half.json --json
    shardserve export-overlay --checkpoint /tmp/run/final --base minilm --fp16
    shardserve train --help       # every flag explained
    # stage 1 on another host (docs: guides/deployment): there, `MASTER_ADDR=10.0.0.1
    # MASTER_PORT=29500 RANK=1 shardserve worker` with the same SHARDSERVE_GANG_KEY
    shardserve train ... --pp 2 --external-ranks 1 --gang-host 10.0.0.1 --gang-port 29500
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, field_validator

from shardserve.partitioner.command import Command, Settings
from shardserve.partitioner.layout_flags import DtypeFlag
from shardserve.partitioner.precision import PrecisionError
from shardserve.training.config import TRAIN_GROUPS, TrainSettings, WindowSettings, dataclass_values
from shardserve.training.export_overlay import LARGE_MAX_BYTES, MAX_BYTES, export_overlay

if TYPE_CHECKING:
    from shardserve.partitioner.runtime.remote import GangNetwork

logger = logging.getLogger(__name__)


class EvalSettings(DtypeFlag, WindowSettings):
    """``shardserve eval``: what to score and how (``shardserve.training.evaluate.EvalConfig`` checks the
    numbers). ``dtype`` is ``DtypeFlag``'s, shared with serve, plan and verify
    (``partitioner/layout_flags.py``); ``pp`` and ``tp`` are eval's own: a fixed gang on cpu, no ``auto``
    (there is no memory limit to fit)."""

    model: str = Field(description="registry name (default, ...) or HF model dir (e.g. RUN/final)")
    data: str = Field(description="SQuAD v1.1/v2.0 JSON to score")
    holdout_articles: int = Field(
        0,
        description="score only the articles `train --holdout-articles N` held out of this file (same "
        "--split-seed)",
    )
    split_seed: int = Field(0, description="seed of that by-article split")
    pp: int = Field(1, description="pipeline stages of the evaluation gang")
    tp: int = Field(1, description="tensor-parallel ranks per stage")
    batch_size: int = Field(32, description="windows per forward micro-batch")
    max_answer_length: int = Field(30, description="longest answer span in tokens (1..512)")
    null_threshold: float | None = Field(None, description="v2.0: answer '' when null - best > this")
    max_examples: int | None = Field(None, description="score only the first N (>= 1) questions")
    as_json: bool = Field(False, alias="json", description="print the metrics as one JSON object")


class ExportOverlaySettings(Settings):
    """``shardserve export-overlay`` (``shardserve.training.export_overlay``)."""

    checkpoint: list[str] = Field(
        description="a run's checkpoint dir (e.g. RUN/final); repeat for runs stacked on each other, in order",
        json_schema_extra={"action": "append"},
    )
    dest: str = Field("models/default", description="where the overlay goes")
    fp16: bool = Field(False, description="store the overlay in float16 (half the size)")
    base: str | None = Field(
        None,
        description="for a fully fine-tuned checkpoint: the model it started from (e.g. minilm); its changes "
        "are stored as low-rank factors within the 8 MB budget",
    )
    max_bytes: int = Field(
        MAX_BYTES,
        description=f"size budget of the overlay file (at most {LARGE_MAX_BYTES:,}: ship more than "
        f"{MAX_BYTES:,} only where it measurably buys >= 0.5 development F1)",
    )
    metrics: list[str] | None = Field(
        None,
        description="record the JSON of a `shardserve eval --json` run under NAME (repeat; e.g. dev=pool.json)",
        json_schema_extra={"action": "append", "metavar": "NAME=FILE"},
    )
    command: list[str] | None = Field(
        None, description="a training command, recorded verbatim", json_schema_extra={"action": "append"}
    )

    @field_validator("metrics")
    @classmethod
    def _name_equals_file(cls, items: list[str] | None) -> list[str] | None:
        for item in items or []:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"{item!r}: expected NAME=FILE")
        return items


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


def flag_conflict(args: TrainSettings) -> str | None:
    """Flags that contradict each other (or mean nothing without another), or None."""
    if args.resume and args.overwrite:
        return (
            "--resume and --overwrite contradict each other: --resume continues the run in --output, "
            "--overwrite starts it again from scratch; pass one"
        )
    if args.elastic and not args.resume:
        return "--elastic only applies with --resume (it re-shards a checkpoint to another --pp/--tp)"
    return None


def gang_error_line(exc: Exception) -> str:
    """A ``GangError`` in one line: its first (naming the rank), plus the failing rank's own last
    traceback line when the first ends at "failed:"."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    if first.endswith(":") and len(lines) > 1:
        cause = next((line for line in reversed(lines) if not line.startswith("(then also down")), "")
        first = f"{first} {cause}"
    return first


def network_problem(args: TrainSettings) -> tuple[str | None, GangNetwork | None]:
    """(why the gang flags cannot be used, None) or (None, the ``GangNetwork`` they describe)."""
    flags = args.gang
    layout = f"dp={args.dp} x pp={args.pp} x tp={args.tp}"
    problems = flags.gang_problems(world_size=args.dp * args.pp * args.tp, layout=layout)
    if problems:
        return "invalid gang settings: " + "; ".join(problems), None
    from shardserve.training.rank import TRAIN_PROGRAM  # what the ranks on other hosts run

    return None, dataclasses.replace(flags.network(), program=TRAIN_PROGRAM)


def fit_train_layout(args: TrainSettings) -> TrainSettings:
    """``args`` with ``--pp``/``--tp auto`` replaced by the fewest ranks whose every rank fits
    ``--max-memory-per-rank`` by the training estimate (``partitioner/fit.py``: weights, gradients and
    AdamW state + 1F1B's activations of ``--micro-batch-size x --max-seq-len`` in the compute
    precision); an explicit layout is only checked. ``LayoutDoesNotFit`` with the numbers otherwise."""
    from shardserve.models.registry import resolve_model
    from shardserve.partitioner.precision import resolve_dtype

    choice = args.choose_layout(
        {args.model: resolve_model(args.model).config},
        batch_size=args.micro_batch_size,
        seq_len=args.max_seq_len,
        dtype=resolve_dtype(args.precision, args.device),
        training=True,
        boundaries=args.boundaries,
        remedy="raise --max-memory-per-rank, or lower --micro-batch-size / --max-seq-len",
    )
    if choice.auto:
        print(f"train: {choice.line()}", flush=True)
    return args.model_copy(update={"pp": choice.dims.pp, "tp": choice.dims.tp})


def stopped_run_hint(output: Path) -> str:
    """Where a run stopped early (Ctrl-C, SIGTERM) stands: the checkpoint ``--resume`` continues
    from, or how to start again when none was written."""
    from shardserve.training.checkpoint import latest_checkpoint, run_artifacts

    latest = latest_checkpoint(output)
    if latest is not None:
        return f"the newest checkpoint is {latest}; the same command with --resume continues from it"
    if run_artifacts(output):  # a curve, a temporary checkpoint: a new run needs --overwrite
        return "no checkpoint was written yet; the same command with --overwrite starts again"
    return "no checkpoint was written yet"


def cmd_train(args: TrainSettings) -> int:
    """``shardserve train``; a SIGTERM stops it like Ctrl-C (the ranks killed), in one line, exit 143."""
    from shardserve.training.sigterm import Terminated, raise_on_sigterm

    try:
        with raise_on_sigterm():
            return _train(args)
    except Terminated as exc:  # the ranks were killed on the way out (trainer.train)
        print(f"terminated (SIGTERM): {stopped_run_hint(Path(args.output))}", file=sys.stderr)
        return exc.exit_code


def _train(args: TrainSettings) -> int:
    from shardserve.partitioner.runtime.gang import GangError
    from shardserve.training.checkpoint import ResumeError
    from shardserve.training.config import TrainConfigError
    from shardserve.training.driver import train
    from shardserve.training.squad_data import SquadFormatError

    problem = (
        flag_conflict(args)
        or input_file_error(args.train_file, "--train-file")
        or input_file_error(args.eval_file, "--eval-file")
    )
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    args = fit_train_layout(args)  # LayoutDoesNotFit: one line, exit 2 (shardserve/errors.py), no weights yet
    problem, network = network_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        cfg = args.train_config()
    except ValueError as exc:  # TrainConfigError, or windowing flags that make no window
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
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


def cmd_eval(args: EvalSettings) -> int:
    """``shardserve eval``; a SIGTERM stops it like Ctrl-C (the ranks killed), in one line, exit 143."""
    from shardserve.training.sigterm import Terminated, raise_on_sigterm

    try:
        with raise_on_sigterm():
            return _eval(args)
    except Terminated as exc:  # the evaluation gang was killed on the way out (Gang.__exit__)
        print("terminated (SIGTERM): the evaluation was stopped before it finished", file=sys.stderr)
        return exc.exit_code


def _eval(args: EvalSettings) -> int:
    from shardserve.partitioner.int8 import CalibrationMissing
    from shardserve.partitioner.runtime.gang import GangError
    from shardserve.training.evaluate import EvalConfig, EvalConfigError, evaluate_model
    from shardserve.training.squad_data import SquadFormatError

    problem = input_file_error(args.data, "--data")
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        window = args.window()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        cfg = EvalConfig(**dataclass_values(args, EvalConfig), window=window)
        metrics = evaluate_model(cfg)
    except (EvalConfigError, SquadFormatError, PrecisionError, CalibrationMissing) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except GangError as exc:  # a rank failed or was lost (--pp / --tp): one line; the whole story at INFO
        logger.info("%s", exc)
        print(f"error: {gang_error_line(exc)}", file=sys.stderr)
        return 1
    if args.as_json:
        print(json.dumps(metrics, sort_keys=True))
    else:
        for k in sorted(metrics):
            v = metrics[k]
            print(f"{k:>14}: {v:.2f}" if isinstance(v, float) else f"{k:>14}: {v}")
    return 0


def cmd_export_overlay(args: ExportOverlaySettings) -> int:
    """``shardserve export-overlay``: write the overlay (and its ``default-model.json``) into ``--dest``."""
    import torch

    info: dict[str, Any] = {}
    for item in args.metrics or []:
        name, _, path = item.partition("=")
        info.setdefault("metrics", {})[name] = json.loads(Path(path).read_text())
    if args.command:
        info["commands"] = args.command
    dtype = torch.float16 if args.fp16 else torch.float32
    checkpoints = [Path(c) for c in args.checkpoint]
    export_overlay(
        checkpoints, Path(args.dest), dtype=dtype, info=info, base=args.base, max_bytes=args.max_bytes
    )
    return 0


TRAIN = Command(
    "train",
    help="fine-tune a QA model over the serving partitions (pipeline + tensor parallel)",
    description="Fine-tune an extractive-QA model on SQuAD-format data with the same PartitionPlan and "
    "gang of worker processes that serve it. Writes Hugging Face-format checkpoints "
    "(OUTPUT/checkpoint-STEP, OUTPUT/final) that transformers and `shardserve serve` load.",
    settings=TrainSettings,
    run=cmd_train,
    groups=TRAIN_GROUPS,
    invalid="invalid train settings",
)
EVAL = Command(
    "eval",
    help="SQuAD exact match / F1 of a model (HasAns/NoAns for v2.0)",
    description="Score a QA model on a SQuAD-format file with the official answer normalisation.",
    settings=EvalSettings,
    run=cmd_eval,
)
EXPORT_OVERLAY = Command(
    "export-overlay",
    help="export a fine-tuning run as a small overlay for the embedded default model",
    description="Copy a parameter-efficient run's overlay (LoRA factors, trained biases / LayerNorms, QA "
    "head), or a fully fine-tuned run's changes as low-rank factors within a size budget (--base), into "
    "--dest with a default-model.json describing the run (command, data hash, steps, seed, metrics).",
    settings=ExportOverlaySettings,
    run=cmd_export_overlay,
)
COMMANDS: tuple[Command, ...] = (TRAIN, EVAL, EXPORT_OVERLAY)
