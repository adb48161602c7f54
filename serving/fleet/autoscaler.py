"""Autoscaling policy for replica gangs, as PURE LOGIC (no threads, no clock reads), plus the
AlpaServe pipeline-capacity helper used for admission.

Knob names follow Ray Serve (``min_replicas``, ``max_replicas``, ``target_ongoing_requests``,
``upscale_delay_s``, ``downscale_delay_s``, ``look_back_period_s``). A control loop (written
elsewhere) feeds it and applies the target by starting or draining whole gangs::

    scaler = Autoscaler(AutoscalingConfig(min_replicas=1, max_replicas=4))
    every tick:
        scaler.observe(now, ongoing_requests=queued + in_flight, current_replicas=ready,
                       pending_replicas=starting, max_replicas_allowed_by_device_pool=pool_cap)
        decision = scaler.decide(now)   # Decision(target, reason); target counts starting ones

Policy: avg = mean of the ongoing-request samples of the last ``look_back_period_s``.
Provisioned = current + pending replicas. Bounds: [lo, hi] with hi = min(max_replicas, pool
limit) and lo = min(min_replicas, hi); a provisioned count outside them is corrected at once.
Otherwise, with a dead-band against flapping:
  - want up   when ceil(avg / target_ongoing_requests) > provisioned, to that count;
  - want down when ceil(avg / (target_ongoing_requests * downscale_margin)) < provisioned, to
    that count: after scaling down, each replica would sit at <= margin * target (0.8 by
    default), so a load hovering at a boundary does not bounce between two counts;
  - otherwise hold.
A wish is applied only once it has persisted for upscale_delay_s / downscale_delay_s across
decide() calls; any other answer in between (hold or the opposite wish) restarts the wait, and
applying a change restarts it too, so there is at most one change per delay window. Decisions are
logged and counted in ``Autoscaler.counts`` ({"up": n, "down": n}).

Tests: ``tests/serving/fleet/test_autoscaler.py``.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from shardserve.serving.config import AutoscalingConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    """Desired total replicas (ready + starting) and why."""

    target: int
    reason: str


class Autoscaler:
    """Hysteresis policy over observed ongoing requests (see module doc)."""

    def __init__(self, config: AutoscalingConfig) -> None:
        self.config = config
        self.counts: dict[str, int] = {"up": 0, "down": 0}
        self._samples: deque[tuple[float, float]] = deque()  # (time, ongoing requests)
        self._provisioned: int | None = None
        self._pool_limit: int = config.max_replicas
        self._wish: str | None = None  # "up" / "down" while a wish waits out its delay
        self._wish_since = 0.0

    def observe(
        self,
        now: float,
        *,
        ongoing_requests: float,
        current_replicas: int,
        pending_replicas: int = 0,
        max_replicas_allowed_by_device_pool: int | None = None,
    ) -> None:
        """Record one sample; the pool limit (None: unlimited) counts the replicas it can host."""
        if ongoing_requests < 0 or current_replicas < 0 or pending_replicas < 0:
            raise ValueError(
                f"negative observation: ongoing_requests={ongoing_requests}, "
                f"current_replicas={current_replicas}, pending_replicas={pending_replicas}"
            )
        pool = max_replicas_allowed_by_device_pool
        if pool is not None and pool < 0:
            raise ValueError(f"max_replicas_allowed_by_device_pool={pool} must be >= 0")
        self._samples.append((now, float(ongoing_requests)))
        while self._samples[0][0] < now - self.config.look_back_period_s:
            self._samples.popleft()
        self._provisioned = current_replicas + pending_replicas
        self._pool_limit = self.config.max_replicas if pool is None else pool

    def decide(self, now: float) -> Decision:
        """The replica count to run now (see the module doc for the rules)."""
        cfg = self.config
        hi = min(cfg.max_replicas, self._pool_limit)
        lo = min(cfg.min_replicas, hi)
        if self._provisioned is None:
            return Decision(lo, "no observations yet")
        have = self._provisioned
        if have < lo:
            return self._apply("up", lo, f"{have} replicas below the lower bound {lo}")
        if have > hi:
            return self._apply(
                "down",
                hi,
                f"{have} replicas above max_replicas={cfg.max_replicas} / pool limit={self._pool_limit}",
            )
        recent = [v for t, v in self._samples if t >= now - cfg.look_back_period_s]
        if not recent:
            self._wish = None
            return Decision(have, f"hold at {have}: no samples in the last {cfg.look_back_period_s} s")
        avg = sum(recent) / len(recent)
        up_to = min(hi, max(lo, math.ceil(avg / cfg.target_ongoing_requests)))
        down_to = min(hi, max(lo, math.ceil(avg / (cfg.target_ongoing_requests * cfg.downscale_margin))))
        if up_to > have:
            wish, to, delay = "up", up_to, cfg.upscale_delay_s
        elif down_to < have:
            wish, to, delay = "down", down_to, cfg.downscale_delay_s
        else:
            self._wish = None
            return Decision(have, f"hold at {have}: avg ongoing {avg:.2f} within the dead-band")
        if self._wish != wish:
            self._wish, self._wish_since = wish, now
        waited = now - self._wish_since
        why = f"avg ongoing {avg:.2f} over {len(recent)} samples, target {cfg.target_ongoing_requests} per replica"
        if waited < delay:
            return Decision(
                have, f"hold at {have}: scale {wish} to {to} pending ({waited:.1f} of {delay} s); {why}"
            )
        return self._apply(wish, to, f"{have} -> {to} after {waited:.1f} s; {why}")

    def _apply(self, direction: str, target: int, reason: str) -> Decision:
        self._wish = None
        self.counts[direction] += 1
        logger.info("autoscale %s: %s", direction, reason)
        return Decision(target, f"scale {direction}: {reason}")


def pipeline_capacity(stage_latencies_s: Sequence[float], slo_s: float) -> int:
    """AlpaServe: the most requests n a pipeline finishes within the SLO when sent together.

    n requests through stages of latency l_i finish after sum(l_i) + (n - 1) * max(l_i), so
    n = floor((slo - sum) / max) + 1, and 0 when even one request misses the SLO.
    """
    if not stage_latencies_s or min(stage_latencies_s) < 0 or max(stage_latencies_s) <= 0:
        raise ValueError(f"stage latencies {list(stage_latencies_s)} must be non-empty, >= 0, not all 0")
    if slo_s <= 0:
        raise ValueError(f"slo_s={slo_s} must be > 0")
    total, slowest = sum(stage_latencies_s), max(stage_latencies_s)
    if total > slo_s * (1 + 1e-9):
        return 0
    return math.floor((slo_s - total) / slowest + 1e-9) + 1
