"""``shardserve verify``: partitioned logits against the transformers reference, as a command.

``VERIFY`` is the command as data (the console script generates its flags from ``VerifySettings``);
the check itself is ``partitioner/stream/verify.py``.

    shardserve verify --model tiny-roberta --pp 2 --tp 2
    shardserve verify --model default --pp 2 --dtype bfloat16
    shardserve verify --model default --tp auto --max-memory-per-rank 450MiB  # the fewest ranks that fit
"""

from __future__ import annotations

import logging
from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from shardserve.models.registry import resolve_model
from shardserve.partitioner.cli import PartitionSettings
from shardserve.partitioner.command import Command, at_least, positive_number
from shardserve.partitioner.compiled import COMPILE_CHOICES, resolve_compile
from shardserve.partitioner.int8 import model_calibration
from shardserve.partitioner.layout_flags import LAYOUT_FIELDS, LAYOUT_SECTION
from shardserve.partitioner.plan import ParallelDims
from shardserve.partitioner.precision import resolve_dtype
from shardserve.partitioner.stream.verify import SAMPLE_SEQ_LEN, SAMPLES, TOLERANCES, verify_partitioned

logger = logging.getLogger(__name__)


class VerifySettings(PartitionSettings):
    """``shardserve verify``."""

    tolerance: Annotated[float, AfterValidator(positive_number)] | None = Field(
        None,
        description="max allowed |logit difference| against the fp32 reference, > 0 (default: per dtype, "
        + ", ".join(f"{k} {v:g}" for k, v in TOLERANCES.items())
        + ")",
    )
    threads_per_rank: Annotated[int, AfterValidator(at_least(1))] = Field(
        1, description="torch threads per worker rank, >= 1"
    )
    compile: Literal[COMPILE_CHOICES] = Field(  # type: ignore[valid-type]
        "off",
        description="on: torch.compile the ranks' stages as `shardserve serve --compile on` does and check "
        "the compiled gang",
    )


def cmd_verify(args: VerifySettings) -> int:
    """``shardserve verify``: the partitioned logits against the reference; exit 1 above the tolerance."""
    source = resolve_model(args.model)
    choice = resolve_dtype(args.dtype, args.device)
    if choice.int8:  # before any rank starts: CalibrationMissing names `shardserve quantize`
        model_calibration(source)
    # the layout, checked against --max-memory-per-rank at verify's largest batch before a rank starts
    cfg = source.config
    seq_len = min(SAMPLE_SEQ_LEN, cfg.max_seq_len)
    layout = args.layout(
        source.name,
        cfg,
        batch_size=len(SAMPLES),
        seq_len=seq_len,
        dtype=choice,
        remedy="raise --max-memory-per-rank (verify's sample batch is fixed)",
    )
    if layout.auto or args.max_memory_per_rank is not None:
        print(layout.line(), flush=True)
    dims = layout.dims
    compiled = resolve_compile(args.compile, device=args.device, tp=dims.tp)
    logger.info("dtype %s (%s), compile %s", choice.name, choice.reason, args.compile)
    result = verify_partitioned(
        source,
        ParallelDims(pp=dims.pp, tp=dims.tp),
        tolerance=args.tolerance,
        threads_per_rank=args.threads_per_rank,
        boundaries=args.boundaries,
        device=args.device,
        dtype=choice.name,
        compile=compiled,
    )
    verdict = "PASS" if result.passed else "FAIL"
    print(
        f"{verdict} model={source.name} pp={dims.pp} tp={dims.tp} dtype={result.dtype}"
        f"{' compiled' if compiled else ''} "
        f"batches={result.batch_shapes} max|d start|={result.max_abs_start:.3g} "
        f"max|d end|={result.max_abs_end:.3g} tolerance={result.tolerance:g} "
        f"best span changed in {result.span_changes}/{result.windows} windows "
        f"({result.span_change_fraction:.1%}) vs the fp32 reference"
    )
    return 0 if result.passed else 1


VERIFY = Command(
    "verify",
    help="check partitioned logits against the transformers reference",
    description="Run sample inputs (several lengths, padded batches) through a gang of pp x tp "
    "worker processes and through transformers' unpartitioned model; print the max "
    "absolute difference of start/end logits; exit 1 above the tolerance.",
    settings=VerifySettings,
    run=cmd_verify,
    groups={LAYOUT_SECTION: LAYOUT_FIELDS},
)
