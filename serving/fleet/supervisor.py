"""Periodic control of the replica set: health checks, busy-time sampling, autoscaling.

One asyncio task ticks every ``TICK_S``: it fails replicas whose gang went unhealthy while idle
(``ReplicaManager.check_health``; a gang with work in flight fails through its futures first),
every ``BUSY_EVERY_S`` samples per-stage busy time for the metrics, and every
``autoscale_interval_s`` feeds the pure ``Autoscaler`` (ongoing requests = queued + in flight, read
from the scheduler, the one in-flight ledger) and applies its target by starting or draining whole
gangs. Every applied decision is logged and counted
(``shardserve_autoscale_decisions_total{direction}``). ``pin(n)`` (POST /admin/replicas) fixes the
count and pauses autoscaling; ``set_bounds(lo, hi)`` resumes it with new bounds. ``history`` keeps the
last applied target changes (the status page shows them).

    sup = Supervisor(ledger=scheduler, manager=manager, metrics=metrics,
                     config=settings.autoscaling_config())
    await sup.start(); ...; await sup.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from shardserve.serving.config import AutoscalingConfig
from shardserve.serving.fleet.autoscaler import Autoscaler
from shardserve.serving.fleet.replicas import InflightLedger, ReplicaManager
from shardserve.serving.metrics import ModelMetrics

logger = logging.getLogger(__name__)

TICK_S = 0.1  # health checks; a 20-ms tick cost an idle server 22 ms of CPU per s
BUSY_EVERY_S = 0.5  # busy-time sampling: the ranks' heartbeats bring new busy times this often


class Supervisor:
    """Health + autoscaling loop over a ReplicaManager (see module doc)."""

    def __init__(
        self,
        *,
        ledger: InflightLedger,
        manager: ReplicaManager,
        metrics: ModelMetrics,
        config: AutoscalingConfig,
        interval_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ledger = ledger
        self.manager = manager
        self.metrics = metrics
        self.interval_s = interval_s
        self.clock = clock
        self.autoscaler = Autoscaler(config)
        self.pinned: int | None = None if config.max_replicas > config.min_replicas else config.min_replicas
        self.last_decision: str = "none yet"
        # the last applied target changes, oldest first (the status page): time, source, before, after, reason
        self.history: deque[dict[str, Any]] = deque(maxlen=20)
        self._task: asyncio.Task | None = None

    @property
    def config(self) -> AutoscalingConfig:
        return self.autoscaler.config

    @property
    def autoscaling(self) -> bool:
        return self.pinned is None

    async def start(self) -> None:
        first = self.pinned if self.pinned is not None else self.config.min_replicas
        self.metrics.autoscale_target.set(self.manager.set_target(first))
        self._task = asyncio.get_running_loop().create_task(self._run(), name="shardserve-supervisor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def pin(self, n: int, *, source: str = "admin", reason: str | None = None) -> int:
        """Run exactly ``n`` gangs; autoscaling pauses. Over the device pool's cap: ValueError naming the cap.
        ``source`` / ``reason``: who asked and why, for the history (default: POST /admin/replicas)."""
        self._check_cap("replicas", n)
        self.pinned = n
        before = self.manager.target
        applied = self.manager.set_target(n)
        self._record(source, before, applied, reason or f"pinned to {n} replica(s)")
        self.metrics.autoscale_target.set(applied)
        logger.info("replicas pinned to %d (asked %d)", applied, n)
        return applied

    def set_bounds(self, lo: int, hi: int) -> None:
        """New autoscaling bounds (validated by AutoscalingConfig); autoscaling resumes. A bound
        over the device pool's cap is a ValueError naming the cap."""
        self._check_cap("min_replicas", lo)
        self._check_cap("max_replicas", hi)
        config = dataclasses.replace(self.config, min_replicas=lo, max_replicas=hi)
        counts = self.autoscaler.counts
        self.autoscaler = Autoscaler(config)
        self.autoscaler.counts = counts
        self.pinned = None
        logger.info("autoscaling bounds set to [%d, %d]", lo, hi)

    def _check_cap(self, name: str, value: int) -> None:
        """ValueError naming the cap when ``value`` gangs exceed what the device pool holds."""
        cap = self.manager.pool_limit()
        if value > cap:
            raise ValueError(
                f"{name}={value} exceeds the cap of {cap} replica gang(s): the device pool has "
                f"{self.manager.gangs.capacity} slot(s) and a gang takes {self.manager.model.dims.world_size}"
            )

    def describe(self) -> dict[str, Any]:
        lo, hi = self.config.min_replicas, self.config.max_replicas
        return {
            "target": self.manager.target,
            "ready": self.manager.ready,
            "starting": self.manager.starting,
            "autoscaling": self.autoscaling,
            "pinned": self.pinned,
            "min_replicas": lo,
            "max_replicas": hi,
            "pool_limit": self.manager.pool_limit(),
            "decisions": dict(self.autoscaler.counts),
            "last_decision": self.last_decision,
            "replicas": self.manager.describe(),
        }

    def _record(self, source: str, before: int, after: int, reason: str) -> None:
        self.history.append(
            {"time": time.time(), "source": source, "before": before, "after": after, "reason": reason}
        )

    async def _run(self) -> None:
        next_scale = next_busy = self.clock()
        while True:
            await asyncio.sleep(TICK_S)
            now = self.clock()
            try:
                if now >= next_busy:
                    next_busy = now + BUSY_EVERY_S
                    self.manager.sample_busy()
                self.manager.check_health()
                if self.autoscaling and now >= next_scale:
                    next_scale = now + self.interval_s
                    self.scale_step(now)
            except Exception:  # never let the control loop die
                logger.exception("supervisor tick failed")

    def scale_step(self, now: float) -> None:
        """One autoscaler observation + decision, applied to the manager."""
        m = self.manager
        self.autoscaler.observe(
            now,
            ongoing_requests=self.ledger.ongoing,
            current_replicas=m.ready,
            pending_replicas=m.starting,
            max_replicas_allowed_by_device_pool=m.pool_limit(),
        )
        before = dict(self.autoscaler.counts)
        decision = self.autoscaler.decide(now)
        if decision.target == m.target:
            # what the manager already does (e.g. "up" to the lower bound while a failed gang waits out
            # its restart back-off, neither ready nor starting) is no scaling: not counted anywhere
            self.autoscaler.counts = before
        else:
            for direction, n in self.autoscaler.counts.items():
                if n > before.get(direction, 0):
                    self.metrics.autoscale.labels(direction=direction).inc(n - before.get(direction, 0))
            self.last_decision = decision.reason
            old_target = m.target
            logger.info("autoscaler: target %d -> %d (%s)", m.target, decision.target, decision.reason)
            self.metrics.autoscale_target.set(m.set_target(decision.target))
            self._record("autoscaler", old_target, m.target, decision.reason)
