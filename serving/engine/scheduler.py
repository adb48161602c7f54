"""Serving scheduler: admission, the batcher and the in-flight ledger composed into one object.

The engine drives it from one event loop (it holds no lock); its three parts each own one concept:

- ``serving/engine/admission.py``: reservations before tokenizing, queue / size / capacity checks,
  ``Retry-After`` (429 ``queue_full`` / ``overloaded``, 413 ``too_large``);
- ``serving/engine/batcher.py``: length-bucketed lanes, fair order, batch release, replica choice;
- ``serving/engine/ledger.py``: THE ledger of in-flight work (``ongoing`` requests, micro-batches in
  flight per replica), the service rate, how requests ended.

``Scheduler`` runs the request lifecycle across them (submit, cancel, expire, results, fail-over).
PURE LOGIC: no threads, no asyncio, no clock reads: every time-dependent method takes ``now``
(seconds, one monotonic clock for all calls), so the whole policy is unit-tested with a fake clock
(``pytest tests/serving/engine/test_scheduler_*.py``).

Work items are *windows* (token sequences of one question, ``n_tokens <= max(length_buckets)``).
A request completes when all its windows completed; a window that fails is retried once.

How a driver (the engine, ``serving/engine/core.py``) uses it::

    adm = sched.submit(rid, [len(w) for w in windows], now=clock())
    if not adm.accepted: answer 429 + Retry-After (adm.retry_after_s) or 413 (too_large)
    # on every wake-up:
    for rid in sched.expire(now): answer 504
    while (d := sched.next_batch(now, replicas)) is not None: send d.items to d.replica_id
    sleep until sched.next_wakeup(now), or earlier on a submit / completion / replica change
    # on results:   out = sched.batch_done(d.batch_id, now=now, ok=True); answer out.completed
    # on gang death: out = sched.replica_failed(replica_id); answer 503 for out.failed
    # ledger reads:  sched.ongoing, sched.inflight(replica_id), sched.is_inflight(batch_id)
    # client gone:  sched.cancel(rid)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from shardserve.serving.config import SchedulerConfig
from shardserve.serving.engine.admission import Admission, AdmissionControl
from shardserve.serving.engine.batcher import Batcher, Dispatch, ReplicaView
from shardserve.serving.engine.ledger import Ending, Ledger, Request, Window

logger = logging.getLogger(__name__)

MAX_WINDOW_ATTEMPTS = 2  # a window is dispatched at most twice: first try + one retry


@dataclass(frozen=True)
class Outcome:
    """Requests finished by batch_done() / replica_failed(): completed (200) and failed (503)."""

    completed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    retried_windows: int = 0  # windows re-queued (at the front) for their one retry
    # requests with a window re-queued (alive, waiting for their retry); detail, not compared
    retried_requests: list[str] = field(default_factory=list, compare=False)


@dataclass(frozen=True)
class SchedulerStats:
    """Observability snapshot (copied; safe to export as metrics)."""

    queued_requests: int
    queued_windows: int
    inflight_batches: dict[str, int]  # replica_id -> batches in flight (replicas with > 0)
    batches_by_reason: dict[str, int]  # full / deadline / timeout / idle
    padding_ratio: float  # padding tokens / padded tokens over all dispatched batches
    service_rate: float | None  # EWMA of completed windows per busy second; None before any
    completed: int
    expired: int
    cancelled: int
    failed: int
    rejected: dict[str, int]  # queue_full / overloaded / too_large
    retried_windows: int


class Scheduler:
    """Admission + batcher + ledger behind one object (see module doc)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.ledger = Ledger()
        self.batcher = Batcher(config, self.ledger)
        self.admission = AdmissionControl(config, self.batcher, self.ledger)
        self._expired_outbox: list[str] = []
        self._retried = 0

    # ------------------------------------------------------------------ admission
    def reserve(
        self, *, now: float | None = None, deadline: float | None = None, windows_hint: int = 1
    ) -> Admission:
        """Hold a queue place for a request about to be tokenized: 429 at once when the queue is
        full, or when (given ``now`` and ``deadline``, on the scheduler's clock) a request of about
        ``windows_hint`` windows (an estimate before tokenizing) could not finish in time.

        Follow with ``submit(..., reserved=True, windows_hint=...)`` (which uses the place) or
        ``unreserve(windows_hint)``, with the same hint.
        """
        return self.admission.reserve(now=now, deadline=deadline, windows_hint=windows_hint)

    def unreserve(self, windows_hint: int = 1) -> None:
        """Give back a place taken by ``reserve()`` (tokenization failed, client gone)."""
        self.admission.unreserve(windows_hint)

    def too_many_windows(self, n_windows: int, *, at_least: bool = False) -> Admission | None:
        """413 when a request of ``n_windows`` windows (``at_least``: a lower bound known before
        tokenizing) is over ``max_windows_per_request``; None when it is not."""
        return self.admission.too_many_windows(n_windows, at_least=at_least)

    def windows_ahead(self, n_windows: int, *, with_reserved: bool = True) -> int:
        """Queued windows that fair order puts before a request of ``n_windows`` admitted now."""
        return self.admission.windows_ahead(n_windows, with_reserved=with_reserved)

    def submit(
        self,
        request_id: str,
        windows_token_counts: Sequence[int],
        *,
        now: float,
        deadline: float | None = None,
        reserved: bool = False,
        windows_hint: int = 1,
    ) -> Admission:
        """Queue a request's windows, or reject it (too_large before queue_full).

        ``deadline`` is absolute (same clock as ``now``); default ``now + default_deadline_s``.
        ``reserved``: a place was taken by ``reserve(windows_hint=...)``; it is used (or, on
        rejection, given back).
        Raises ValueError for caller bugs: no windows, a window < 1 token, a duplicate live id.
        """
        adm = self.admission.check(
            request_id,
            windows_token_counts,
            now=now,
            deadline=deadline,
            reserved=reserved,
            windows_hint=windows_hint,
        )
        if not adm.accepted:
            return adm
        assert adm.deadline is not None
        n = len(windows_token_counts)
        req = Request(request_id, n, adm.deadline, remaining=n, first_tag=self.batcher.vtime)
        self.ledger.add(req)
        self.batcher.enqueue(req, windows_token_counts, now=now)
        return adm

    def service_rate(self) -> float | None:
        """EWMA of completed windows per busy second (idle time excluded); None before any."""
        return self.ledger.service_rate()

    # ------------------------------------------------------------------ removal
    def cancel(self, request_id: str) -> bool:
        """Client went away: drop its queued windows; its in-flight results will be ignored."""
        req = self.ledger.requests.get(request_id)
        if req is None:
            return False
        self._drop(req, "cancelled")
        return True

    def expire(self, now: float) -> list[str]:
        """Requests whose deadline passed (<= now) with windows still undispatched (answer 504).

        Also returns those that next_batch() expired since the previous call. A request whose
        windows are all in flight is not expired here: its results are awaited.
        """
        self._expire(now)
        out, self._expired_outbox = self._expired_outbox, []
        return out

    def _expire(self, now: float) -> None:
        for req in self.batcher.overdue(now):
            logger.info(
                "request %s expired: deadline %.3f <= now %.3f with %d of %d windows undispatched",
                req.request_id,
                req.deadline,
                now,
                req.queued,
                req.n_windows,
            )
            self._drop(req, "expired")
            self._expired_outbox.append(req.request_id)

    def _drop(self, req: Request, ending: Ending) -> None:
        """Forget a request and remove its queued windows from every bucket."""
        self.ledger.forget(req, ending)
        self.batcher.remove(req)

    # ------------------------------------------------------------------ dispatch
    def next_batch(self, now: float, replicas: Sequence[ReplicaView]) -> Dispatch | None:
        """Form and assign one releasable micro-batch, or None (nothing due / no replica free).

        Expires overdue requests first (fetch them with expire()), so an expired window is never
        dispatched. Replica load = the batches this scheduler has in flight there.
        """
        self._expire(now)
        return self.batcher.next_batch(now, replicas)

    def next_wakeup(self, now: float) -> float | None:
        """Earliest time a timer can change anything: a batch's delay/deadline release or a
        request expiry; None when nothing is queued. Call it after next_batch() returned None:
        batches already releasable are then waiting for replica capacity, which arrives as an
        event (batch_done / replica change), not a timer, so they are not counted. A value
        <= now means "poll now".
        """
        return self.batcher.next_wakeup(now)

    # ------------------------------------------------------------------ results
    def batch_done(self, batch_id: int, *, now: float, ok: bool) -> Outcome:
        """A batch came back. ok: its windows complete; not ok: they fail (retried once).

        Unknown ids (already failed with their replica) are ignored; windows of dead requests
        (cancelled / expired / failed) are ignored.
        """
        windows = self.ledger.end_batch(batch_id, now=now, ok=ok)
        if windows is None:
            return Outcome()
        if not ok:
            return self._fail_windows(windows)
        completed = []
        for w in windows:
            req = w.req
            if not req.alive:
                continue
            req.remaining -= 1
            if req.remaining == 0:
                self._drop(req, "completed")
                completed.append(req.request_id)
        return Outcome(completed=completed)

    def replica_failed(self, replica_id: str) -> Outcome:
        """A gang died: its in-flight windows are re-queued at the front once, else fail."""
        return self._fail_windows(self.ledger.end_replica(replica_id))

    def _fail_windows(self, windows: list[Window]) -> Outcome:
        failed = []
        retry = []
        for w in windows:
            req = w.req
            if not req.alive:
                continue
            req.failures[w.index] = req.failures.get(w.index, 0) + 1
            if req.failures[w.index] >= MAX_WINDOW_ATTEMPTS:
                logger.warning("request %s failed: window %d failed twice", req.request_id, w.index)
                self._drop(req, "failed")
                failed.append(req.request_id)
            else:
                retry.append(w)
        retry = [w for w in retry if w.req.alive]  # a sibling window may have failed the request
        self.batcher.requeue_front(retry)
        self._retried += len(retry)
        retried_requests = list(dict.fromkeys(w.req.request_id for w in retry))
        return Outcome(failed=failed, retried_windows=len(retry), retried_requests=retried_requests)

    # ------------------------------------------------------------------ the in-flight ledger
    @property
    def ongoing(self) -> int:
        """Requests admitted and not yet answered: queued, in flight, or both (not reservations)."""
        return self.ledger.ongoing

    @property
    def reserved(self) -> int:
        """Admissions reserved before tokenizing and not yet submitted (or given back)."""
        return self.admission.reserved

    def inflight(self, replica_id: str) -> int:
        """Micro-batches in flight on ``replica_id`` (dispatched, not yet done or failed over)."""
        return self.ledger.inflight(replica_id)

    def is_inflight(self, batch_id: int) -> bool:
        """Whether ``batch_id`` is still awaited (False once done, or failed over with its replica)."""
        return self.ledger.is_inflight(batch_id)

    # ------------------------------------------------------------------ observability
    def stats(self) -> SchedulerStats:
        """A copy of the counters."""
        b, ended = self.batcher, self.ledger.endings
        return SchedulerStats(
            queued_requests=b.queued_requests,
            queued_windows=b.queued_windows,
            inflight_batches=self.ledger.inflight_batches(),
            batches_by_reason=dict(b.batches_by_reason),
            padding_ratio=b.padding_ratio,
            service_rate=self.service_rate(),
            completed=ended["completed"],
            expired=ended["expired"],
            cancelled=ended["cancelled"],
            failed=ended["failed"],
            rejected=dict(self.admission.rejected),
            retried_windows=self._retried,
        )
