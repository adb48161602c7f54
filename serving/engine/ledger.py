"""The in-flight ledger: THE count of admitted, unanswered requests and of micro-batches in flight.

DESIGN.md principle 10: routing, draining, stall detection, autoscaling and the metrics all read
these counts (``ongoing``, ``inflight(replica_id)``, ``is_inflight(batch_id)``); nothing else in
``serving/`` counts in-flight work. It also measures the service rate (an EWMA of completed windows
per busy second, idle time excluded) and counts how requests ended.

PURE LOGIC: no threads, no clock reads (``now`` is passed in). ``Scheduler``
(``serving/engine/scheduler.py``) composes it with admission and the batcher; tested through it:
``pytest tests/serving/engine/test_scheduler_lifecycle.py``.

    ledger.add(request)                       # admitted
    batch_id = ledger.start_batch("r0", windows, now=now)
    windows = ledger.end_batch(batch_id, now=now, ok=True)    # None: unknown or failed over
    ledger.forget(request, "completed")       # answered (completed / expired / cancelled / failed)
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field
from typing import Literal

logger = logging.getLogger(__name__)

RATE_EWMA_TAU_S = 10.0  # time constant of the service-rate EWMA (busy seconds)

Ending = Literal["completed", "expired", "cancelled", "failed"]


@dataclass(eq=False)
class Request:
    """An admitted request (the engine room's record; clients never see it)."""

    request_id: str
    n_windows: int
    deadline: float
    queued: int = 0  # windows waiting in a bucket
    remaining: int = 0  # windows not yet completed
    failures: dict[int, int] = field(default_factory=dict)  # window index -> failed attempts
    alive: bool = True  # False once completed / expired / cancelled / failed
    buckets: set[int] = field(default_factory=set)  # buckets holding a lane of its queued windows
    first_tag: int = 0  # fair-queuing tag of its window 0 (window k has first_tag + k)


@dataclass(eq=False)
class Window:
    """One window (token sequence) of a request: the unit the batcher queues and dispatches."""

    req: Request
    index: int
    n_tokens: int
    bucket: int  # index into length_buckets
    enqueued_at: float  # first submission time (kept on retry, so retries go out first)
    tag: int = 0  # fair-queuing start tag: the request's admission virtual time + its index
    seq: int = 0  # admission order (ties)

    @property
    def key(self) -> tuple[int, float, int]:
        """Fair dispatch order: tag, then arrival."""
        return (self.tag, self.enqueued_at, self.seq)


@dataclass(eq=False)
class _Batch:
    replica_id: str
    windows: list[Window]


class Ledger:
    """Live requests, batches in flight per replica, the service rate (see module doc)."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}  # live requests (queued or in flight)
        self._batch_ids = itertools.count(1)
        self._batches: dict[int, _Batch] = {}
        self._per_replica: dict[str, int] = {}
        # service rate: ratio of decayed completed windows to decayed busy seconds
        self._rate_windows = 0.0
        self._rate_seconds = 0.0
        self._busy_mark: float | None = None  # last rate update while batches are in flight
        self.endings: dict[Ending, int] = {"completed": 0, "expired": 0, "cancelled": 0, "failed": 0}

    # ------------------------------------------------------------------ requests
    @property
    def ongoing(self) -> int:
        """Requests admitted and not yet answered: queued, in flight, or both (not reservations)."""
        return len(self.requests)

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req

    def forget(self, req: Request, ending: Ending) -> None:
        """The request is answered (or given up): it leaves the ledger; late results are ignored."""
        req.alive = False
        del self.requests[req.request_id]
        self.endings[ending] += 1

    # ------------------------------------------------------------------ batches
    def inflight(self, replica_id: str) -> int:
        """Micro-batches in flight on ``replica_id`` (dispatched, not yet done or failed over)."""
        return self._per_replica.get(replica_id, 0)

    def is_inflight(self, batch_id: int) -> bool:
        """Whether ``batch_id`` is still awaited (False once done, or failed over with its replica)."""
        return batch_id in self._batches

    def inflight_batches(self) -> dict[str, int]:
        """replica_id -> batches in flight (replicas with > 0), copied."""
        return dict(self._per_replica)

    def start_batch(self, replica_id: str, windows: list[Window], *, now: float) -> int:
        """Count a dispatched micro-batch in flight on ``replica_id``; returns its batch id."""
        batch_id = next(self._batch_ids)
        if not self._batches:
            self._busy_mark = now
        self._batches[batch_id] = _Batch(replica_id, windows)
        self._per_replica[replica_id] = self._per_replica.get(replica_id, 0) + 1
        return batch_id

    def end_batch(self, batch_id: int, *, now: float, ok: bool) -> list[Window] | None:
        """A batch came back (``ok``: its windows were computed): its windows, or None when the id
        is unknown (already failed over with its replica)."""
        batch = self._batches.pop(batch_id, None)
        if batch is None:
            logger.debug("ignoring result of unknown or already failed batch %d", batch_id)
            return None
        left = self._per_replica.get(batch.replica_id, 0) - 1
        if left > 0:
            self._per_replica[batch.replica_id] = left
        else:
            self._per_replica.pop(batch.replica_id, None)
        self._account_service(now, len(batch.windows) if ok else 0)
        return batch.windows

    def end_replica(self, replica_id: str) -> list[Window]:
        """A gang died: the windows of all its batches in flight (in dispatch order), forgotten here."""
        batch_ids = sorted(bid for bid, batch in self._batches.items() if batch.replica_id == replica_id)
        windows = [w for bid in batch_ids for w in self._batches.pop(bid).windows]
        self._per_replica.pop(replica_id, None)
        if not self._batches:
            self._busy_mark = None
        if batch_ids:
            logger.warning("replica %s failed with %d batches in flight", replica_id, len(batch_ids))
        return windows

    # ------------------------------------------------------------------ service rate
    @property
    def inflight_windows(self) -> int:
        """Windows of the batches in flight (admission counts them as ahead of a new request)."""
        return sum(len(b.windows) for b in self._batches.values())

    def service_rate(self) -> float | None:
        """EWMA of completed windows per busy second (idle time excluded); None before any."""
        return self._rate_windows / self._rate_seconds if self._rate_seconds > 0 else None

    def _account_service(self, now: float, windows_done: int) -> None:
        """Fold one completion into the rate EWMA over busy time since the previous event."""
        if self._busy_mark is not None:
            dt = max(0.0, now - self._busy_mark)
            decay = math.exp(-dt / RATE_EWMA_TAU_S)
            self._rate_windows = self._rate_windows * decay + windows_done
            self._rate_seconds = self._rate_seconds * decay + dt
        self._busy_mark = now if self._batches else None
