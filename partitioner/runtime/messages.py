"""The runtime's own messages between a gang's driver and its ranks: lifecycle and liveness.

A program (serving's forward stream, training) defines its own message types beside its rank
function and registers them with ``partitioner/runtime/wire.py``; the runtime carries them without
knowing them. Stage-to-stage traffic (activations, gradients) is ``partitioner/p2p.py``'s
``Message`` and never passes through the driver. Arrays are numpy (the wire writes their bytes).

    every rank -> driver:   RankReady | RankStopped | RankFailed   (lifecycle, consumed by ``Gang``)
    both ways, every ``heartbeat_s``:   Heartbeat   (liveness; a rank's carries its progress)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    steps: int = 0  # layers this rank has finished: progress inside a micro-batch (the stall verdict)


DRIVER = -1  # Heartbeat.rank of the driver's heartbeats

LIFECYCLE = (
    RankReady,
    RankStopped,
    RankFailed,
)  # consumed by the Gang itself; every other message is the program's
