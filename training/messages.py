"""Training's messages from its ranks to the driver, registered with the gang runtime's wire.

last stage, tp rank 0 of replica 0 -> driver:   StepReport | EvalLogits
rank 0 -> driver:   CheckpointSaved
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardserve.partitioner.runtime.wire import register_messages


@dataclass(frozen=True)
class StepReport:
    """One optimizer step done (sent by the last stage's tp rank 0 of replica 0)."""

    rank: int
    step: int  # steps done so far
    loss: float  # of the global batch, unscaled
    lr: float
    grad_norm: float  # before clipping
    examples: int  # in the global batch
    allreduce: dict[str, int] | None = None  # dp > 1: the gradient reducer's statistics


@dataclass(frozen=True)
class EvalLogits:
    """Span logits of every evaluation window after ``step`` steps."""

    rank: int
    step: int
    logits: np.ndarray  # (N, S, 2) float32


@dataclass(frozen=True)
class CheckpointSaved:
    """Every rank's part of the checkpoint of ``step`` is written (sent by rank 0)."""

    rank: int
    step: int
    final: bool


register_messages(StepReport, EvalLogits, CheckpointSaved)
