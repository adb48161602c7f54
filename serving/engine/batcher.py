"""The batcher: queued windows -> length-bucketed micro-batches in fair order -> least-loaded replica.

Owns the queue of windows waiting for dispatch (one lane per request and length bucket), the
fair-queuing virtual time, request expiry order (a deadline heap) and the batch counters. PURE
LOGIC: no threads, no clock reads (``now`` is passed in). Replica load is the in-flight ledger's
count (``serving/engine/ledger.py``); ``Scheduler`` (``serving/engine/scheduler.py``) composes the
two with admission. Tested through it: ``pytest tests/serving/engine/test_scheduler_batching.py``.

Fair order (start-time fair queuing over windows): the batcher counts dispatched windows (its
virtual time ``V``); a request admitted at ``V`` gives its k-th window the tag ``V + k``. Windows go
out in (tag, arrival) order, within a bucket and across buckets. Requests of one window each keep
their arrival order (FIFO); a request of 700 windows is interleaved with later small ones instead
of holding every replica until it is done: a small request admitted while it runs waits for at
most about one batch of it.

Release rule for a bucket's candidate batch (its first windows in fair order, greedily up to
``max_batch_size`` windows and ``max_batch_tokens`` padded tokens = size * longest window):
``full`` (a limit stopped it) > ``deadline`` (earliest request deadline in it is within
``deadline_margin_ms``) > ``timeout`` (its oldest window waited ``max_queue_delay_ms``) > ``idle``
(the replica it would go to has nothing in flight: waiting for a fuller batch would leave it idle;
``wait_when_idle`` turns this off, as Triton's dynamic batcher waits). The delay is for busy
replicas: a batch sent to one that is still computing waits there anyway, so it may as well grow.
A batch for an idle replica takes at most an equal share of its bucket's queue per idle replica
(a 4-window request and two idle replicas: 2 + 2), so a long context computes on every idle
replica instead of one; batches for busy replicas are not split.
Among releasable buckets the one whose first window comes first in fair order goes first (a busy
bucket cannot starve a quiet one). A micro-batch goes to the least-loaded accepting replica that
has fewer than ``max_inflight_per_replica`` batches in flight.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from shardserve.serving.config import SchedulerConfig
from shardserve.serving.engine.ledger import Ledger, Request, Window

logger = logging.getLogger(__name__)

ReleaseReason = Literal["full", "deadline", "timeout", "idle"]


@dataclass(frozen=True)
class ReplicaView:
    """A replica the driver offers for a batch (its load is the ledger's own count)."""

    replica_id: str
    accepting: bool = True  # healthy, ready and not draining


@dataclass(frozen=True)
class Dispatch:
    """One micro-batch to send: windows as (request_id, window_index), padded to padded_len."""

    batch_id: int
    replica_id: str
    items: list[tuple[str, int]]
    padded_len: int  # longest window in the batch (tokens)
    bucket: int  # the length bucket's upper bound (tokens)
    reason: ReleaseReason


@dataclass(eq=False)
class _Candidate:
    bucket: int
    windows: list[Window]
    padded_len: int
    oldest: float
    first: tuple[int, float, int]  # fair-order key of its first window (buckets compete on it)
    reason: ReleaseReason | None  # None: not releasable yet
    release_at: float  # when it becomes releasable by timeout or deadline

    def share(self, keep: int) -> _Candidate:
        """Its first ``keep`` windows (itself when it has no more), released for an idle replica."""
        if keep >= len(self.windows):
            return self
        windows = self.windows[:keep]
        return replace(
            self,
            reason="idle",
            windows=windows,
            padded_len=max(w.n_tokens for w in windows),
            oldest=min(w.enqueued_at for w in windows),
        )


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


class Batcher:
    """Bucketed lanes of queued windows -> releasable micro-batches (see module doc)."""

    def __init__(self, config: SchedulerConfig, ledger: Ledger) -> None:
        self.config = config
        self.ledger = ledger
        self._delay_s = config.max_queue_delay_ms / 1000.0
        self._margin_s = config.deadline_margin_ms / 1000.0
        # per bucket: request id -> its queued windows there (a "lane", in tag order)
        self._buckets: list[dict[str, deque[Window]]] = [{} for _ in config.length_buckets]
        self.vtime = 0  # virtual time: windows dispatched so far (fair-queuing tags start here)
        self._deadlines: list[tuple[float, int, Request]] = []  # heap; lazily deleted
        self._seq = itertools.count()
        self.queued_requests = 0
        self.queued_windows = 0
        self.batches_by_reason = {"full": 0, "deadline": 0, "timeout": 0, "idle": 0}
        self.padded_tokens = 0
        self.real_tokens = 0

    # ------------------------------------------------------------------ the queue
    def enqueue(self, req: Request, windows_token_counts: Sequence[int], *, now: float) -> None:
        """Queue every window of an admitted request, tagged from its ``first_tag``."""
        seq = next(self._seq)
        for index, n_tokens in enumerate(windows_token_counts):
            bucket = bisect.bisect_left(self.config.length_buckets, n_tokens)
            w = Window(req, index, n_tokens, bucket, now, tag=req.first_tag + index, seq=seq)
            self._buckets[bucket].setdefault(req.request_id, deque()).append(w)
            req.buckets.add(bucket)
        req.queued = req.n_windows
        self.queued_requests += 1
        self.queued_windows += req.n_windows
        heapq.heappush(self._deadlines, (req.deadline, next(self._seq), req))

    def requeue_front(self, retry: list[Window]) -> None:
        """Put failed windows back at their lanes' fronts, in tag order (their one retry)."""
        for w in sorted(retry, key=lambda w: w.key, reverse=True):
            self._buckets[w.bucket].setdefault(w.req.request_id, deque()).appendleft(w)
            w.req.buckets.add(w.bucket)
            req = w.req
            req.queued += 1
            if req.queued == 1:
                self.queued_requests += 1
                heapq.heappush(self._deadlines, (req.deadline, next(self._seq), req))
        self.queued_windows += len(retry)

    def remove(self, req: Request) -> None:
        """Remove a request's queued windows (its lanes) from every bucket."""
        for b in req.buckets:
            self._buckets[b].pop(req.request_id, None)
        req.buckets.clear()
        if req.queued:
            self.queued_requests -= 1
            self.queued_windows -= req.queued
            req.queued = 0

    def overdue(self, now: float) -> Iterator[Request]:
        """Live requests whose deadline passed (<= now) with windows still queued, earliest first.

        A generator: the caller removes each before the next is looked at."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, req = heapq.heappop(self._deadlines)
            if req.alive and req.queued > 0:
                yield req

    # ------------------------------------------------------------------ dispatch
    def next_batch(self, now: float, replicas: Sequence[ReplicaView]) -> Dispatch | None:
        """Form one releasable micro-batch, count it in flight with the ledger and assign it to the
        least-loaded replica; None when nothing is due or no replica is free."""
        replica = self._pick_replica(replicas)
        if replica is None:
            return None
        idle = not self.config.wait_when_idle and self.ledger.inflight(replica.replica_id) == 0
        best: _Candidate | None = None
        for b in range(len(self._buckets)):
            cand = self._candidate(b, now, idle=idle)
            if cand is not None and cand.reason is not None and (best is None or cand.first < best.first):
                best = cand
        if best is None or best.reason is None:
            return None
        idle_replicas = (
            sum(1 for r in replicas if r.accepting and self.ledger.inflight(r.replica_id) == 0)
            if idle
            else 0
        )
        if idle_replicas > 1:  # the bucket's queue is shared with the other idle replicas
            queued = sum(len(lane) for lane in self._buckets[best.bucket].values())
            best = best.share(-(-queued // idle_replicas))
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
                self.queued_requests -= 1
        self.queued_windows -= len(best.windows)
        self.vtime = _advance_vtime(self.vtime, [w.tag for w in best.windows])

        batch_id = self.ledger.start_batch(replica.replica_id, best.windows, now=now)
        self.batches_by_reason[best.reason] += 1
        self.padded_tokens += len(best.windows) * best.padded_len
        self.real_tokens += sum(w.n_tokens for w in best.windows)
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
        request expiry; None when nothing is queued (see ``Scheduler.next_wakeup``)."""
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
            load = self.ledger.inflight(r.replica_id)
            if (
                r.accepting
                and load < self.config.max_inflight_per_replica
                and (best is None or load < best_load)
            ):
                best, best_load = r, load
        return best

    def _candidate(self, b: int, now: float, *, idle: bool = False) -> _Candidate | None:
        """The batch bucket b would release now (fair order, greedy under both limits), and when;
        ``idle``: the replica it would go to has nothing in flight."""
        cfg = self.config
        lanes = self._buckets[b]
        if not lanes:
            return None
        ordered = (
            iter(next(iter(lanes.values())))
            if len(lanes) == 1
            else heapq.merge(*lanes.values(), key=lambda w: w.key)
        )
        taken: list[Window] = []
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
        elif idle:
            reason = "idle"
        return _Candidate(b, taken, longest, oldest, taken[0].key, reason, min(deadline_at, timeout_at))

    @property
    def padding_ratio(self) -> float:
        """Padding tokens / padded tokens over all dispatched batches."""
        padded = self.padded_tokens
        return (padded - self.real_tokens) / padded if padded else 0.0
