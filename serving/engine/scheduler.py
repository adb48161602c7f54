"""Serving scheduler: bounded admission, length-bucketed dynamic batching and replica dispatch.

Owns the request queue of the HTTP process as PURE LOGIC: no threads, no asyncio, no clock reads.
It is also THE ledger of in-flight work (DESIGN.md principle 10): requests admitted and not yet
answered (``ongoing``), and micro-batches in flight per replica (``inflight(replica_id)``,
``is_inflight(batch_id)``). Routing, draining, stall detection, autoscaling and the metrics all
read these counts; nothing else in ``serving/`` counts in-flight work.
Every time-dependent method takes ``now`` (seconds, one monotonic clock for all calls), so the
whole policy is unit-tested with a fake clock (``tests/serving/engine/test_scheduler.py``).

Work items are *windows* (token sequences of one question, ``n_tokens <= max(length_buckets)``).
A request completes when all its windows completed. Windows are batched only with windows of the
same length bucket; a micro-batch goes to the least-loaded accepting replica that has fewer than
``max_inflight_per_replica`` batches in flight (load = batches this scheduler has in flight there).

How a driver (asyncio/thread code, written elsewhere; one thread or event loop at a time,
the scheduler holds no lock) uses it::

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

Fair order (start-time fair queuing over windows): the scheduler counts dispatched windows
(its virtual time ``V``); a request admitted at ``V`` gives its k-th window the tag ``V + k``.
Windows go out in (tag, arrival) order, within a bucket and across buckets. Requests of one
window each keep their arrival order (FIFO); a request of 700 windows is interleaved with later
small ones instead of holding every replica until it is done: a small request admitted while
it runs waits for at most about one batch of it. ``max_windows_per_request`` bounds one
request (413 with the numbers above it). Admission can be reserved before the (slow) tokenization
(``reserve()`` / ``submit(..., reserved=True)`` / ``unreserve()``): a full queue then answers 429
at once, and requests being tokenized count against ``max_queue_size``.

Capacity (AlpaServe's view: a request meets its SLO only if the work ahead of it fits): once a
service rate has been measured, a request is refused with 429 ``overloaded`` when the queued
windows that fair order puts before it (``windows_ahead``), plus its own, cannot be computed before
its deadline at that rate. ``reserve()`` checks with an estimate of its windows (before tokenizing,
so an overloaded server says no at once) inside 35 % of the time left (``RESERVE_MARGIN``: the
estimates move while it waits for the tokenizer, and a burst's tokenizing slows the replicas that
share its cores); ``submit()`` checks again with the real count and the time really left, against
what is queued (not the reservations taken after its own), so work that became late is refused
(late, but before any compute) rather than admitted to time out. Admitted work then finishes in time instead of every request
sharing the replicas until all of them answer 504.

Release rule for a bucket's candidate batch (its first windows in fair order, greedily up to
``max_batch_size`` windows and ``max_batch_tokens`` padded tokens = size * longest window):
``full`` (a limit stopped it) > ``deadline`` (earliest request deadline in it is within
``deadline_margin_ms``) > ``timeout`` (its oldest window waited ``max_queue_delay_ms``).
Among releasable buckets the one whose first window comes first in fair order goes first (a busy
bucket cannot starve a quiet one).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

logger = logging.getLogger(__name__)

# reserve() admits when the estimated work fits this share of the time left: at 0.5, 5-8 % of a
# 256-client burst was still refused late, after seconds at the tokenizer (docs/benchmarks.md)
RESERVE_MARGIN = 0.35
RETRY_AFTER_MIN_S = 1  # Retry-After floor (integer seconds, as the HTTP header wants)
RETRY_AFTER_MAX_S = 60  # Retry-After ceiling
RATE_EWMA_TAU_S = 10.0  # time constant of the service-rate EWMA (busy seconds)
MAX_WINDOW_ATTEMPTS = 2  # a window is dispatched at most twice: first try + one retry

AdmissionReason = Literal["accepted", "queue_full", "overloaded", "too_large"]
ReleaseReason = Literal["full", "deadline", "timeout"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Batcher and queue knobs (Triton names); validated once, errors print the numbers."""

    max_queue_size: int = 256  # requests with windows still waiting for dispatch
    max_batch_size: int = 32  # windows per micro-batch
    max_batch_tokens: int = 8192  # padded tokens per micro-batch: batch_size * longest window
    max_queue_delay_ms: float = 5.0  # oldest window may wait this long for a fuller batch
    length_buckets: tuple[int, ...] = (64, 128, 256, 384)  # sorted bucket upper bounds (tokens)
    max_inflight_per_replica: int = 2  # micro-batches in flight per replica
    default_deadline_s: float = 30.0  # request deadline when submit() gets none
    deadline_margin_ms: float = 50.0  # release a partial batch once a deadline is this near
    max_windows_per_request: int = 1024  # windows one request (all its pairs) may need; beyond: 413

    def __post_init__(self) -> None:
        problems = []
        for name in (
            "max_queue_size",
            "max_batch_size",
            "max_batch_tokens",
            "max_inflight_per_replica",
            "max_windows_per_request",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r} must be an integer >= 1")
        for name in ("max_queue_delay_ms", "deadline_margin_ms"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)!r} must be >= 0")
        if self.default_deadline_s <= 0:
            problems.append(f"default_deadline_s={self.default_deadline_s!r} must be > 0")
        buckets = tuple(self.length_buckets)
        object.__setattr__(self, "length_buckets", buckets)
        if not buckets or buckets[0] < 1 or any(a >= b for a, b in itertools.pairwise(buckets)):
            problems.append(f"length_buckets={buckets} must be non-empty, >= 1 and strictly increasing")
        elif isinstance(self.max_batch_tokens, int) and self.max_batch_tokens < buckets[-1]:
            problems.append(
                f"max_batch_tokens={self.max_batch_tokens} is below the largest length bucket "
                f"{buckets[-1]}: windows of that bucket could never be batched"
            )
        if problems:
            raise ValueError("invalid SchedulerConfig: " + "; ".join(problems))


@dataclass(frozen=True)
class ReplicaView:
    """A replica the driver offers for a batch (its load is the scheduler's own count)."""

    replica_id: str
    accepting: bool = True  # healthy, ready and not draining


@dataclass(frozen=True)
class Admission:
    """Result of reserve()/submit(): accepted, or rejected with a reason (429 queue_full or
    overloaded / 413 too_large)."""

    accepted: bool
    reason: AdmissionReason
    retry_after_s: int | None = None  # set for 429s: the Retry-After header value
    deadline: float | None = None  # absolute deadline of an accepted request
    detail: str = ""


@dataclass(frozen=True)
class Dispatch:
    """One micro-batch to send: windows as (request_id, window_index), padded to padded_len."""

    batch_id: int
    replica_id: str
    items: list[tuple[str, int]]
    padded_len: int  # longest window in the batch (tokens)
    bucket: int  # the length bucket's upper bound (tokens)
    reason: ReleaseReason


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
    batches_by_reason: dict[str, int]  # full / deadline / timeout
    padding_ratio: float  # padding tokens / padded tokens over all dispatched batches
    service_rate: float | None  # EWMA of completed windows per busy second; None before any
    completed: int
    expired: int
    cancelled: int
    failed: int
    rejected: dict[str, int]  # queue_full / too_large
    retried_windows: int


@dataclass(eq=False)
class _Request:
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
class _Window:
    req: _Request
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
    windows: list[_Window]


@dataclass(eq=False)
class _Candidate:
    bucket: int
    windows: list[_Window]
    padded_len: int
    oldest: float
    first: tuple[int, float, int]  # fair-order key of its first window (buckets compete on it)
    reason: ReleaseReason | None  # None: not releasable yet
    release_at: float  # when it becomes releasable by timeout or deadline


def _advance_vtime(vtime: int, tags: Sequence[int]) -> int:
    """Virtual time after dispatching windows with fair-queuing ``tags``: past the batch, but never
    further than its first tag plus the windows it served.

    A bucket's batch is filled greedily with what that bucket holds, so it can take a window far
    ahead in fair order (a request's short last window, alone in a smaller bucket). Moving V past
    that window's tag (``max(tags) + 1``) would tag every later arrival behind the rest of the
    request: a 128-window request in two items made small requests wait 6-8 batches instead of 4.
    ``min(tags) + len(tags)`` bounds the jump by the work served; V still grows by at least one per
    batch of windows tagged >= V, so no queued window waits forever.
    """
    return max(vtime, min(max(tags) + 1, min(tags) + len(tags)))


class Scheduler:
    """Bounded queue -> length-bucketed micro-batches -> least-loaded replica (see module doc)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._delay_s = config.max_queue_delay_ms / 1000.0
        self._margin_s = config.deadline_margin_ms / 1000.0
        # per bucket: request id -> its queued windows there (a "lane", in tag order)
        self._buckets: list[dict[str, deque[_Window]]] = [{} for _ in config.length_buckets]
        self._vtime = 0  # virtual time: windows dispatched so far (fair-queuing tags start here)
        self._reserved = 0  # admissions reserved before tokenization (count as queued requests)
        self._reserved_windows = 0  # their estimated windows (count as queued work)
        self._requests: dict[str, _Request] = {}  # live requests (queued or in flight)
        self._deadlines: list[tuple[float, int, _Request]] = []  # heap; lazily deleted
        self._seq = itertools.count()
        self._batch_ids = itertools.count(1)
        self._inflight: dict[int, _Batch] = {}
        self._inflight_per_replica: dict[str, int] = {}
        self._expired_outbox: list[str] = []
        self._queued_requests = 0
        self._queued_windows = 0
        # service rate: ratio of decayed completed windows to decayed busy seconds
        self._rate_windows = 0.0
        self._rate_seconds = 0.0
        self._busy_mark: float | None = None  # last rate update while batches are in flight
        # counters
        self._batches_by_reason = {"full": 0, "deadline": 0, "timeout": 0}
        self._rejected = {"queue_full": 0, "overloaded": 0, "too_large": 0}
        self._padded_tokens = 0
        self._real_tokens = 0
        self._completed = self._expired = self._cancelled = self._failed = self._retried = 0

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
        if self._queued_requests + self._reserved >= self.config.max_queue_size:
            return self._queue_full()
        if now is not None and deadline is not None:
            # before tokenizing the work must fit a margin inside the deadline: the estimates (windows,
            # tokenizer wait, rate) move, and a request refused only after tokenizing waited for nothing
            late = self._overloaded(windows_hint, now, deadline, margin=RESERVE_MARGIN)
            if late:
                return late
        self._reserved += 1
        self._reserved_windows += windows_hint
        return Admission(accepted=True, reason="accepted")

    def unreserve(self, windows_hint: int = 1) -> None:
        """Give back a place taken by ``reserve()`` (tokenization failed, client gone)."""
        if self._reserved <= 0:
            raise ValueError("unreserve() without a reserve()")
        self._reserved -= 1
        self._reserved_windows = max(0, self._reserved_windows - windows_hint) if self._reserved else 0

    def too_many_windows(self, n_windows: int, *, at_least: bool = False) -> Admission | None:
        """413 when a request of ``n_windows`` windows (``at_least``: a lower bound known before
        tokenizing) is over ``max_windows_per_request``; None when it is not."""
        limit = self.config.max_windows_per_request
        if n_windows <= limit:
            return None
        return self._too_large(
            f"the request needs {'at least ' if at_least else ''}{n_windows} windows, "
            f"max_windows_per_request={limit}: send shorter contexts or fewer items per call"
        )

    def _too_large(self, detail: str) -> Admission:
        """A request that can never be served as sent (HTTP 413): counted, with the numbers."""
        self._rejected["too_large"] += 1
        return Admission(accepted=False, reason="too_large", detail=detail)

    def windows_ahead(self, n_windows: int, *, with_reserved: bool = True) -> int:
        """Queued windows that fair order puts before a request of ``n_windows`` admitted now.

        Its windows get the tags ``V .. V+n-1``; a queued request's windows still waiting are (about)
        its last ones, tags ``first_tag + done .. first_tag + n - 1``: those at or below ``V+n-1`` go
        first. Requests reserved before tokenizing count with their estimated windows (as if admitted
        now) unless ``with_reserved`` is False. One pass over the live requests (at most
        max_queue_size + in flight).
        """
        last = self._vtime + n_windows - 1
        ahead = 0
        for r in self._requests.values():
            if r.queued:
                first_waiting = r.first_tag + r.n_windows - r.queued
                ahead += min(r.queued, max(0, last - first_waiting + 1))
        return ahead + (min(self._reserved_windows, self._reserved * n_windows) if with_reserved else 0)

    def _overloaded(
        self, n_windows: int, now: float, deadline: float, *, with_reserved: bool = True, margin: float = 1.0
    ) -> Admission | None:
        """429 when the windows fair order puts before a request of ``n_windows``, plus its own,
        cannot be done within ``margin`` of the time left before ``deadline`` at the measured rate.
        None: they can, or no rate was measured yet, or less than one batch is ahead (it rides the
        next batch). ``with_reserved``: count the requests still being tokenized (``windows_ahead``)."""
        rate = self.service_rate()
        if not rate:
            return None
        ahead = self.windows_ahead(n_windows, with_reserved=with_reserved)
        if ahead <= self.config.max_batch_size:
            return None
        needed_s = (ahead + n_windows) / rate
        left = max(0.0, deadline - now)
        if needed_s <= margin * left:
            return None
        self._rejected["overloaded"] += 1
        retry_after = self._retry_after_s()
        return Admission(
            accepted=False,
            reason="overloaded",
            retry_after_s=retry_after,
            detail=(
                f"{ahead} queued windows go before this request's {n_windows}"
                f"{' (estimated before tokenizing)' if margin < 1 else ''}: about {needed_s:.1f} s at the "
                f"measured {rate:.1f} windows/s, more than "
                + (
                    f"the {margin * left:.1f} s admission allows before tokenizing ({margin:.0%} of the "
                    f"{left:.1f} s left before its deadline, as the estimates may move)"
                    if margin < 1
                    else f"the {left:.1f} s left before its deadline"
                )
                + f"; retry in {retry_after} s"
            ),
        )

    def _queue_full(self) -> Admission:
        cfg = self.config
        self._rejected["queue_full"] += 1
        retry_after = self._retry_after_s()
        pending = f" + {self._reserved} being tokenized" if self._reserved else ""
        return Admission(
            accepted=False,
            reason="queue_full",
            retry_after_s=retry_after,
            detail=(
                f"{self._queued_requests} requests ({self._queued_windows} windows) queued{pending}, "
                f"max_queue_size={cfg.max_queue_size}; retry in {retry_after} s"
            ),
        )

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
        if reserved:
            self.unreserve(windows_hint)  # the place becomes this request's queue entry (or is freed)
        cfg = self.config
        if not windows_token_counts:
            raise ValueError(f"request {request_id!r} has no windows")
        if min(windows_token_counts) < 1:
            raise ValueError(f"request {request_id!r} has a window of {min(windows_token_counts)} tokens")
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already queued or in flight")
        longest = max(windows_token_counts)
        if longest > cfg.length_buckets[-1]:
            return self._too_large(
                f"window of {longest} tokens exceeds the largest length bucket "
                f"{cfg.length_buckets[-1]} (max_batch_tokens={cfg.max_batch_tokens})"
            )
        if too_many := self.too_many_windows(len(windows_token_counts)):
            return too_many
        if self._queued_requests + self._reserved >= cfg.max_queue_size:
            return self._queue_full()
        deadline = now + cfg.default_deadline_s if deadline is None else deadline
        rate = self.service_rate()
        if rate and len(windows_token_counts) > 1 and len(windows_token_counts) / rate > deadline - now:
            # it could not finish in time even with the replicas to itself: refuse now rather than
            # compute part of it and answer 504 (wasted work)
            return self._too_large(
                f"the request needs {len(windows_token_counts)} windows: about "
                f"{len(windows_token_counts) / rate:.1f} s at the measured {rate:.1f} windows/s, more "
                f"than the {max(0.0, deadline - now):.1f} s left before its deadline; send less text or a "
                "longer timeout_s"
            )
        # a request that reserved its place is checked against what is really queued, not against the
        # reservations taken after its own: those were admitted knowing of it, inside RESERVE_MARGIN,
        # and counting them again refused it late, after tokenizing (the 429 tail of the overload test)
        if late := self._overloaded(len(windows_token_counts), now, deadline, with_reserved=not reserved):
            return late
        req = _Request(
            request_id,
            len(windows_token_counts),
            deadline,
            remaining=len(windows_token_counts),
            first_tag=self._vtime,
        )
        seq = next(self._seq)
        for index, n_tokens in enumerate(windows_token_counts):
            bucket = bisect.bisect_left(cfg.length_buckets, n_tokens)
            w = _Window(req, index, n_tokens, bucket, now, tag=self._vtime + index, seq=seq)
            self._buckets[bucket].setdefault(request_id, deque()).append(w)
            req.buckets.add(bucket)
        self._requests[request_id] = req
        req.queued = req.n_windows
        self._queued_requests += 1
        self._queued_windows += req.n_windows
        heapq.heappush(self._deadlines, (deadline, next(self._seq), req))
        return Admission(accepted=True, reason="accepted", deadline=deadline)

    def _retry_after_s(self) -> int:
        """Seconds until the queue should have drained: queued windows / service rate, clamped.

        Before any batch completed there is no rate: answer the floor. A rate of 0 (only
        failures seen) answers the ceiling.
        """
        rate = self.service_rate()
        if rate is None:
            return RETRY_AFTER_MIN_S
        if rate <= 0:
            return RETRY_AFTER_MAX_S
        return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, math.ceil(self._queued_windows / rate)))

    def service_rate(self) -> float | None:
        """EWMA of completed windows per busy second (idle time excluded); None before any."""
        return self._rate_windows / self._rate_seconds if self._rate_seconds > 0 else None

    # ------------------------------------------------------------------ removal
    def cancel(self, request_id: str) -> bool:
        """Client went away: drop its queued windows; its in-flight results will be ignored."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._drop(req)
        self._cancelled += 1
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
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, req = heapq.heappop(self._deadlines)
            if req.alive and req.queued > 0:
                logger.info(
                    "request %s expired: deadline %.3f <= now %.3f with %d of %d windows undispatched",
                    req.request_id,
                    req.deadline,
                    now,
                    req.queued,
                    req.n_windows,
                )
                self._drop(req)
                self._expired += 1
                self._expired_outbox.append(req.request_id)

    def _drop(self, req: _Request) -> None:
        """Forget a request and remove its queued windows (its lanes) from every bucket."""
        req.alive = False
        del self._requests[req.request_id]
        for b in req.buckets:
            self._buckets[b].pop(req.request_id, None)
        req.buckets.clear()
        if req.queued:
            self._queued_requests -= 1
            self._queued_windows -= req.queued
            req.queued = 0

    # ------------------------------------------------------------------ dispatch
    def next_batch(self, now: float, replicas: Sequence[ReplicaView]) -> Dispatch | None:
        """Form and assign one releasable micro-batch, or None (nothing due / no replica free).

        Expires overdue requests first (fetch them with expire()), so an expired window is never
        dispatched. Replica load = the batches this scheduler has in flight there.
        """
        self._expire(now)
        replica = self._pick_replica(replicas)
        if replica is None:
            return None
        best: _Candidate | None = None
        for b in range(len(self._buckets)):
            cand = self._candidate(b, now)
            if cand is not None and cand.reason is not None and (best is None or cand.first < best.first):
                best = cand
        if best is None or best.reason is None:
            return None
        # pop the candidate's windows: each is at the front of its request's lane
        lanes = self._buckets[best.bucket]
        for w in best.windows:
            lane = lanes[w.req.request_id]
            assert lane[0] is w, "candidate windows must be lane prefixes"
            lane.popleft()
            if not lane:
                del lanes[w.req.request_id]
                w.req.buckets.discard(best.bucket)
            w.req.queued -= 1
            if w.req.queued == 0:
                self._queued_requests -= 1
        self._queued_windows -= len(best.windows)
        self._vtime = _advance_vtime(self._vtime, [w.tag for w in best.windows])

        batch_id = next(self._batch_ids)
        if not self._inflight:
            self._busy_mark = now
        self._inflight[batch_id] = _Batch(replica.replica_id, best.windows)
        self._inflight_per_replica[replica.replica_id] = (
            self._inflight_per_replica.get(replica.replica_id, 0) + 1
        )
        self._batches_by_reason[best.reason] += 1
        self._padded_tokens += len(best.windows) * best.padded_len
        self._real_tokens += sum(w.n_tokens for w in best.windows)
        logger.debug(
            "batch %d -> replica %s: %d windows x %d tokens (bucket %d, %s)",
            batch_id,
            replica.replica_id,
            len(best.windows),
            best.padded_len,
            self.config.length_buckets[best.bucket],
            best.reason,
        )
        return Dispatch(
            batch_id=batch_id,
            replica_id=replica.replica_id,
            items=[(w.req.request_id, w.index) for w in best.windows],
            padded_len=best.padded_len,
            bucket=self.config.length_buckets[best.bucket],
            reason=best.reason,
        )

    def next_wakeup(self, now: float) -> float | None:
        """Earliest time a timer can change anything: a batch's delay/deadline release or a
        request expiry; None when nothing is queued. Call it after next_batch() returned None:
        batches already releasable are then waiting for replica capacity, which arrives as an
        event (batch_done / replica change), not a timer, so they are not counted. A value
        <= now means "poll now".
        """
        while self._deadlines and not (self._deadlines[0][2].alive and self._deadlines[0][2].queued > 0):
            heapq.heappop(self._deadlines)  # stale entry; a retry pushes a fresh one
        times = [self._deadlines[0][0]] if self._deadlines else []
        for b in range(len(self._buckets)):
            cand = self._candidate(b, now)
            if cand is not None and cand.reason is None:
                times.append(cand.release_at)
        return min(times) if times else None

    def _pick_replica(self, replicas: Sequence[ReplicaView]) -> ReplicaView | None:
        """Least-loaded accepting replica below max_inflight_per_replica; ties: first listed."""
        best, best_load = None, 0
        for r in replicas:
            load = self.inflight(r.replica_id)
            if (
                r.accepting
                and load < self.config.max_inflight_per_replica
                and (best is None or load < best_load)
            ):
                best, best_load = r, load
        return best

    def _candidate(self, b: int, now: float) -> _Candidate | None:
        """The batch bucket b would release now (fair order, greedy under both limits), and when."""
        cfg = self.config
        lanes = self._buckets[b]
        if not lanes:
            return None
        ordered = (
            iter(next(iter(lanes.values())))
            if len(lanes) == 1
            else heapq.merge(*lanes.values(), key=lambda w: w.key)
        )
        taken: list[_Window] = []
        longest = 0
        full = False
        for w in ordered:
            grown = max(longest, w.n_tokens)
            if (len(taken) + 1) * grown > cfg.max_batch_tokens:
                full = True
                break
            taken.append(w)
            longest = grown
            if len(taken) == cfg.max_batch_size:
                full = True
                break
        oldest = min(w.enqueued_at for w in taken)
        deadline_at = min(w.req.deadline for w in taken) - self._margin_s
        timeout_at = oldest + self._delay_s
        reason: ReleaseReason | None = None
        if full:
            reason = "full"
        elif now >= deadline_at:
            reason = "deadline"
        elif now >= timeout_at:
            reason = "timeout"
        return _Candidate(b, taken, longest, oldest, taken[0].key, reason, min(deadline_at, timeout_at))

    # ------------------------------------------------------------------ results
    def batch_done(self, batch_id: int, *, now: float, ok: bool) -> Outcome:
        """A batch came back. ok: its windows complete; not ok: they fail (retried once).

        Unknown ids (already failed with their replica) are ignored; windows of dead requests
        (cancelled / expired / failed) are ignored.
        """
        batch = self._inflight.pop(batch_id, None)
        if batch is None:
            logger.debug("ignoring result of unknown or already failed batch %d", batch_id)
            return Outcome()
        self._release_slot(batch.replica_id)
        self._account_service(now, len(batch.windows) if ok else 0)
        if not ok:
            return self._fail_windows(batch.windows)
        completed = []
        for w in batch.windows:
            req = w.req
            if not req.alive:
                continue
            req.remaining -= 1
            if req.remaining == 0:
                self._drop(req)
                self._completed += 1
                completed.append(req.request_id)
        return Outcome(completed=completed)

    def replica_failed(self, replica_id: str) -> Outcome:
        """A gang died: its in-flight windows are re-queued at the front once, else fail."""
        batch_ids = sorted(bid for bid, batch in self._inflight.items() if batch.replica_id == replica_id)
        windows = [w for bid in batch_ids for w in self._inflight.pop(bid).windows]
        self._inflight_per_replica.pop(replica_id, None)
        if not self._inflight:
            self._busy_mark = None
        if batch_ids:
            logger.warning("replica %s failed with %d batches in flight", replica_id, len(batch_ids))
        return self._fail_windows(windows)

    def _fail_windows(self, windows: list[_Window]) -> Outcome:
        failed = []
        retry = []
        for w in windows:
            req = w.req
            if not req.alive:
                continue
            req.failures[w.index] = req.failures.get(w.index, 0) + 1
            if req.failures[w.index] >= MAX_WINDOW_ATTEMPTS:
                logger.warning("request %s failed: window %d failed twice", req.request_id, w.index)
                self._drop(req)
                self._failed += 1
                failed.append(req.request_id)
            else:
                retry.append(w)
        retry = [w for w in retry if w.req.alive]  # a sibling window may have failed the request
        for w in sorted(retry, key=lambda w: w.key, reverse=True):  # their lanes' fronts, in tag order
            self._buckets[w.bucket].setdefault(w.req.request_id, deque()).appendleft(w)
            w.req.buckets.add(w.bucket)
            req = w.req
            req.queued += 1
            if req.queued == 1:
                self._queued_requests += 1
                heapq.heappush(self._deadlines, (req.deadline, next(self._seq), req))
        self._queued_windows += len(retry)
        self._retried += len(retry)
        retried_requests = list(dict.fromkeys(w.req.request_id for w in retry))
        return Outcome(failed=failed, retried_windows=len(retry), retried_requests=retried_requests)

    def _release_slot(self, replica_id: str) -> None:
        left = self._inflight_per_replica.get(replica_id, 0) - 1
        if left > 0:
            self._inflight_per_replica[replica_id] = left
        else:
            self._inflight_per_replica.pop(replica_id, None)

    def _account_service(self, now: float, windows_done: int) -> None:
        """Fold one completion into the rate EWMA over busy time since the previous event."""
        if self._busy_mark is not None:
            dt = max(0.0, now - self._busy_mark)
            decay = math.exp(-dt / RATE_EWMA_TAU_S)
            self._rate_windows = self._rate_windows * decay + windows_done
            self._rate_seconds = self._rate_seconds * decay + dt
        self._busy_mark = now if self._inflight else None

    # ------------------------------------------------------------------ the in-flight ledger
    @property
    def ongoing(self) -> int:
        """Requests admitted and not yet answered: queued, in flight, or both (not reservations)."""
        return len(self._requests)

    @property
    def reserved(self) -> int:
        """Admissions reserved before tokenizing and not yet submitted (or given back)."""
        return self._reserved

    def inflight(self, replica_id: str) -> int:
        """Micro-batches in flight on ``replica_id`` (dispatched, not yet done or failed over)."""
        return self._inflight_per_replica.get(replica_id, 0)

    def is_inflight(self, batch_id: int) -> bool:
        """Whether ``batch_id`` is still awaited (False once done, or failed over with its replica)."""
        return batch_id in self._inflight

    # ------------------------------------------------------------------ observability
    def stats(self) -> SchedulerStats:
        """A copy of the counters."""
        padded = self._padded_tokens
        return SchedulerStats(
            queued_requests=self._queued_requests,
            queued_windows=self._queued_windows,
            inflight_batches=dict(self._inflight_per_replica),
            batches_by_reason=dict(self._batches_by_reason),
            padding_ratio=(padded - self._real_tokens) / padded if padded else 0.0,
            service_rate=self.service_rate(),
            completed=self._completed,
            expired=self._expired,
            cancelled=self._cancelled,
            failed=self._failed,
            rejected=dict(self._rejected),
            retried_windows=self._retried,
        )
