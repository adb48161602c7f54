"""Admission: whether a request may join the queue (bounded queue, size limits, capacity), and why not.

Owns the reservations taken before tokenizing, the rejection counters and ``Retry-After``. PURE
LOGIC: no threads, no clock reads (``now`` is passed in). It reads the queue (the batcher,
``serving/engine/batcher.py``) and the service rate (the ledger, ``serving/engine/ledger.py``);
``Scheduler`` (``serving/engine/scheduler.py``) composes the three. Tested through it:
``pytest tests/serving/engine/test_scheduler_admission.py``.

Admission can be reserved before the (slow) tokenization (``reserve()`` / ``check(...,
reserved=True)`` / ``unreserve()``): a full queue then answers 429 at once, and requests being
tokenized count against ``max_queue_size``. ``max_windows_per_request`` bounds one request (413
with the numbers above it).

Capacity (AlpaServe's view: a request meets its SLO only if the work ahead of it fits): once a
service rate has been measured, a request is refused with 429 ``overloaded`` when the queued
windows that fair order puts before it (``windows_ahead``) and the windows in flight, plus its
own, cannot be computed before its deadline at that rate. ``reserve()`` checks with an estimate of
its windows (before tokenizing, so an overloaded server says no at once) inside a share of the time
left (``SchedulerConfig.admission_margin``, by default ``RESERVE_MARGIN``, 35 %: the estimates
move while it waits for the tokenizer, and a burst's tokenizing slows the replicas that share its
cores); ``check()`` checks again with the real count and the time really left, against what is
queued (not the reservations taken after its own), so work that became late is refused (late, but
before any compute) rather than admitted to time out. Admitted work then finishes in time instead
of every request sharing the replicas until all of them answer 504.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from shardserve.serving.config import SchedulerConfig
from shardserve.serving.engine.batcher import Batcher
from shardserve.serving.engine.ledger import Ledger

# reserve() admits when the estimated work fits this share of the time left (the default of
# SchedulerConfig.admission_margin): at 0.5, 5-8 % of a 256-client burst was still refused late, after
# seconds at the tokenizer (docs/benchmarks.md)
RESERVE_MARGIN = 0.35
RETRY_AFTER_MIN_S = 1  # Retry-After floor (integer seconds, as the HTTP header wants)
RETRY_AFTER_MAX_S = 60  # Retry-After ceiling

AdmissionReason = Literal["accepted", "queue_full", "overloaded", "too_large"]


@dataclass(frozen=True)
class Admission:
    """Result of reserve()/submit(): accepted, or rejected with a reason (429 queue_full or
    overloaded / 413 too_large)."""

    accepted: bool
    reason: AdmissionReason
    retry_after_s: int | None = None  # set for 429s: the Retry-After header value
    deadline: float | None = None  # absolute deadline of an accepted request
    detail: str = ""


class AdmissionControl:
    """Reservations, queue / size / capacity checks and their counters (see module doc)."""

    def __init__(self, config: SchedulerConfig, batcher: Batcher, ledger: Ledger) -> None:
        self.config = config
        self.batcher = batcher
        self.ledger = ledger
        self.reserved = 0  # admissions reserved before tokenization (count as queued requests)
        self._reserved_windows = 0  # their estimated windows (count as queued work)
        self.rejected = {"queue_full": 0, "overloaded": 0, "too_large": 0}

    def reserve(
        self, *, now: float | None = None, deadline: float | None = None, windows_hint: int = 1
    ) -> Admission:
        """Hold a queue place for a request about to be tokenized (see ``Scheduler.reserve``)."""
        if self.batcher.queued_requests + self.reserved >= self.config.max_queue_size:
            return self._queue_full()
        if now is not None and deadline is not None:
            # before tokenizing the work must fit a margin inside the deadline: the estimates (windows,
            # tokenizer wait, rate) move, and a request refused only after tokenizing waited for nothing
            late = self._overloaded(windows_hint, now, deadline, margin=self.config.admission_margin)
            if late:
                return late
        self.reserved += 1
        self._reserved_windows += windows_hint
        return Admission(accepted=True, reason="accepted")

    def unreserve(self, windows_hint: int = 1) -> None:
        """Give back a place taken by ``reserve()`` (tokenization failed, client gone)."""
        if self.reserved <= 0:
            raise ValueError("unreserve() without a reserve()")
        self.reserved -= 1
        self._reserved_windows = max(0, self._reserved_windows - windows_hint) if self.reserved else 0

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

    def windows_ahead(self, n_windows: int, *, with_reserved: bool = True) -> int:
        """Queued windows that fair order puts before a request of ``n_windows`` admitted now.

        Its windows get the tags ``V .. V+n-1``; a queued request's windows still waiting are (about)
        its last ones, tags ``first_tag + done .. first_tag + n - 1``: those at or below ``V+n-1`` go
        first. Requests reserved before tokenizing count with their estimated windows (as if admitted
        now) unless ``with_reserved`` is False. One pass over the live requests (at most
        max_queue_size + in flight).
        """
        last = self.batcher.vtime + n_windows - 1
        ahead = 0
        for r in self.ledger.requests.values():
            if r.queued:
                first_waiting = r.first_tag + r.n_windows - r.queued
                ahead += min(r.queued, max(0, last - first_waiting + 1))
        return ahead + (min(self._reserved_windows, self.reserved * n_windows) if with_reserved else 0)

    def check(
        self,
        request_id: str,
        windows_token_counts: Sequence[int],
        *,
        now: float,
        deadline: float | None = None,
        reserved: bool = False,
        windows_hint: int = 1,
    ) -> Admission:
        """Whether a tokenized request may be queued (see ``Scheduler.submit``); an accepted one
        carries its absolute deadline. Uses (or gives back) a reserved place."""
        if reserved:
            self.unreserve(windows_hint)  # the place becomes this request's queue entry (or is freed)
        cfg = self.config
        if not windows_token_counts:
            raise ValueError(f"request {request_id!r} has no windows")
        if min(windows_token_counts) < 1:
            raise ValueError(f"request {request_id!r} has a window of {min(windows_token_counts)} tokens")
        if request_id in self.ledger.requests:
            raise ValueError(f"request {request_id!r} is already queued or in flight")
        longest = max(windows_token_counts)
        if longest > cfg.length_buckets[-1]:
            return self._too_large(
                f"window of {longest} tokens exceeds the largest length bucket "
                f"{cfg.length_buckets[-1]} (max_batch_tokens={cfg.max_batch_tokens})"
            )
        if too_many := self.too_many_windows(len(windows_token_counts)):
            return too_many
        if self.batcher.queued_requests + self.reserved >= cfg.max_queue_size:
            return self._queue_full()
        deadline = now + cfg.default_deadline_s if deadline is None else deadline
        rate = self.ledger.service_rate()
        n = len(windows_token_counts)
        if rate and n > 1 and n / rate > deadline - now:
            # it could not finish in time even with the replicas to itself: refuse now rather than
            # compute part of it and answer 504 (wasted work)
            return self._too_large(
                f"the request needs {n} windows: about {n / rate:.1f} s at the measured {rate:.1f} "
                f"windows/s, more than the {max(0.0, deadline - now):.1f} s left before its deadline; "
                "send less text or a longer timeout_s"
            )
        # a request that reserved its place is checked against what is really queued, not against the
        # reservations taken after its own: those were admitted knowing of it, inside the margin,
        # and counting them again refused it late, after tokenizing (the 429 tail of the overload test)
        if late := self._overloaded(n, now, deadline, with_reserved=not reserved):
            return late
        return Admission(accepted=True, reason="accepted", deadline=deadline)

    def retry_after_s(self) -> int:
        """Seconds until the queue should have drained: queued windows / service rate, clamped.

        Before any batch completed there is no rate: answer the floor. A rate of 0 (only
        failures seen) answers the ceiling.
        """
        rate = self.ledger.service_rate()
        if rate is None:
            return RETRY_AFTER_MIN_S
        if rate <= 0:
            return RETRY_AFTER_MAX_S
        return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, math.ceil(self.batcher.queued_windows / rate)))

    def _too_large(self, detail: str) -> Admission:
        """A request that can never be served as sent (HTTP 413): counted, with the numbers."""
        self.rejected["too_large"] += 1
        return Admission(accepted=False, reason="too_large", detail=detail)

    def _overloaded(
        self, n_windows: int, now: float, deadline: float, *, with_reserved: bool = True, margin: float = 1.0
    ) -> Admission | None:
        """429 when the windows ahead of a request of ``n_windows`` (those fair order puts before it
        in the queue, and those in flight: they hold the gangs first), plus its own, cannot be done
        within ``margin`` of the time left before ``deadline`` at the measured rate. None: they can,
        or no rate was measured yet, or less than one batch is ahead (it rides the next batch).
        ``with_reserved``: count the requests still being tokenized (``windows_ahead``)."""
        rate = self.ledger.service_rate()
        if not rate:
            return None
        ahead = self.windows_ahead(n_windows, with_reserved=with_reserved) + self.ledger.inflight_windows
        if ahead <= self.config.max_batch_size:
            return None
        needed_s = (ahead + n_windows) / rate
        left = max(0.0, deadline - now)
        if needed_s <= margin * left:
            return None
        self.rejected["overloaded"] += 1
        retry_after = self.retry_after_s()
        return Admission(
            accepted=False,
            reason="overloaded",
            retry_after_s=retry_after,
            detail=(
                f"{ahead} windows (queued or in flight) go before this request's {n_windows}"
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
        self.rejected["queue_full"] += 1
        retry_after = self.retry_after_s()
        pending = f" + {self.reserved} being tokenized" if self.reserved else ""
        queued = self.batcher
        return Admission(
            accepted=False,
            reason="queue_full",
            retry_after_s=retry_after,
            detail=(
                f"{queued.queued_requests} requests ({queued.queued_windows} windows) queued{pending}, "
                f"max_queue_size={cfg.max_queue_size}; retry in {retry_after} s"
            ),
        )
