"""The messages between a gang's driver and its ranks: one frozen dataclass per message kind.

Everything that crosses the driver/rank boundary is defined here, so a new transport (queues on
one host today, a network transport for gangs that span hosts) carries exactly these types.
Stage-to-stage traffic (activations, gradients) is ``partitioner/p2p.py``'s ``Message`` and
never passes through the driver. All fields are picklable (numpy arrays, not tensors).

    driver -> stage-0 ranks (input queue):   Batch | Stop
    last stage (tp rank 0) -> driver (output queue):   Result
    every rank -> driver (control queue):   RankReady | RankStopped | RankFailed   (lifecycle)
    training ranks -> driver (control queue):   StepReport | EvalLogits | CheckpointSaved
    both ways, every ``heartbeat_s``:   Heartbeat   (liveness; a rank's carries its progress)

``Gang`` consumes the lifecycle messages itself; every other control message is handed, as the
object, to ``Gang.join(on_message=...)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# ------------------------------------------------------------------ driver -> stage 0


@dataclass(frozen=True)
class Batch:
    """One micro-batch for the pipeline; ``mb_id`` comes back on its ``Result``."""

    mb_id: int
    input_ids: np.ndarray  # (B, S) int64
    attention_mask: np.ndarray  # (B, S)
    token_type_ids: np.ndarray | None = None  # (B, S)


@dataclass(frozen=True)
class Stop:
    """The stream is over: stage 0 passes it down the pipeline behind the last micro-batch."""


# ------------------------------------------------------------------ last stage -> driver


@dataclass(frozen=True)
class Result:
    """Span logits of micro-batch ``mb_id``."""

    mb_id: int
    logits: np.ndarray  # (B, S, 2) float32


# ------------------------------------------------------------------ ranks -> driver: lifecycle


@dataclass(frozen=True)
class RankReady:
    """The rank has built its stage; ``info`` is the program's (sizes, load time, ...)."""

    rank: int
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RankStopped:
    """The rank's program returned; the process exits cleanly."""

    rank: int


@dataclass(frozen=True)
class RankFailed:
    """The rank raised; the process exits with code 1."""

    rank: int
    traceback: str


# ------------------------------------------------------------------ training ranks -> driver


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


# ------------------------------------------------------------------ both ways: liveness


@dataclass(frozen=True)
class Heartbeat:
    """Alive: sent every ``heartbeat_s`` by every rank (with its progress) and by the driver."""

    rank: int  # the sender; DRIVER for the driver
    progress: int = 0  # micro-batches this rank has finished
    busy_since: float = 0.0  # wall time its current micro-batch started (0: idle or waiting)
    busy_s: float = 0.0  # seconds spent inside micro-batches so far (per-stage busy time, bubbles)
    host: str = ""  # the sender's host name and process id: where the rank really runs ("" / 0:
    pid: int = 0  # the driver's beats), shown by the status page even for ranks on other hosts


DRIVER = -1  # Heartbeat.rank of the driver's heartbeats

ControlMessage = RankReady | RankStopped | RankFailed | StepReport | EvalLogits | CheckpointSaved
