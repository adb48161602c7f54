"""Replicas: a manager that starts, warms, routes, drains, fails and restarts whole gangs.

A replica is ONE gang of ``pp * tp`` worker processes (``serving/fleet/backend.py``) holding one model
generation. Its life: STARTING (processes spawn, weights load, then one warm-up micro-batch) ->
READY (routable) -> DRAINING (no new work; in-flight micro-batches finish) -> STOPPED; or FAILED
when the manager judges it so (``check_health``, the one owner of replica health: a rank its gang
reports lost, or a stall; the engine then retries its in-flight work elsewhere)
and, after a back-off, a fresh gang replaces it (``Replica.replaces``; it carries on the failed
gang's ``restarts`` + 1, so the status page shows each gang's own restart count).

The manager does not count in-flight work: it reads the one ledger (``InflightLedger``, which
``shardserve.serving.engine.scheduler.Scheduler`` satisfies) for ``Replica.inflight_batches`` (least-loaded drain
choice, drain completion, stall detection, busy sampling). It tells one ``ReplicaListener`` (the
engine, attached explicitly by whoever builds both: the app lifespan, or a test) when the replica
set changed and the moment a replica failed, so that its in-flight work is retried elsewhere.

The manager runs on the server's event loop; blocking gang calls (start, warm-up, stop) run in
threads. ``reconcile()`` moves the set of gangs toward ``target`` (set by ``--replicas``, the
autoscaler, POST /admin/replicas or the placement); ``reload()`` rolls every gang onto another
checkpoint (or another placement). Its ``GangSource`` (``serving/fleet/backend.py``) bounds how many
gangs fit and makes them: gangs of its own on the device pool (CPU slots, one per rank,
``--cpu-slots``, or CUDA devices), or places on the device groups of a placement, each shared with
the other models of its group (``serving/fleet/groups.py``).

    gangs = OwnGangs(DevicePool.for_device("cpu", cpu_slots=4), gang_factory(...))
    scheduler = Scheduler(settings.scheduler_config())  # the in-flight ledger
    manager = ReplicaManager(gangs=gangs, model=generation, ledger=scheduler, ...)
    manager.attach(engine)         # the engine hears of replica changes and failures
    manager.set_target(2)          # starts gangs in the background; manager.routable() lists READY ones
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from shardserve.partitioner.runtime.gang import GangError
from shardserve.serving.fleet.backend import (
    Backend,
    GangSource,
    ModelGeneration,
    busy_seconds,
    layer_steps,
    warm_up,
)
from shardserve.serving.metrics import ModelMetrics
from shardserve.serving.redact import one_line, scrub_paths

logger = logging.getLogger(__name__)

MAX_RESTART_BACKOFF_S = 30.0


class InflightLedger(Protocol):
    """The one count of in-flight work (the engine's scheduler satisfies it): micro-batches per
    replica, and requests queued or in flight (the autoscaler's load)."""

    def inflight(self, replica_id: str) -> int: ...

    @property
    def ongoing(self) -> int: ...


class ReplicaListener(Protocol):
    """What the manager tells its user (the engine): the replica set changed; a replica failed."""

    def replicas_changed(self) -> None: ...
    def replica_failed(self, replica: Replica) -> None: ...


class ReplicaState(str, enum.Enum):  # noqa: UP042 (str() and format() as before)
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(eq=False)
class Replica:
    """One gang and what the server tracks about it."""

    replica_id: str
    model: ModelGeneration
    slots: list[int]
    ledger: InflightLedger = field(repr=False)  # where its in-flight micro-batches are counted
    state: ReplicaState = ReplicaState.STARTING
    backend: Backend | None = None
    error: str | None = None
    created_at: float = field(default_factory=time.monotonic)
    stage_busy_s: list[float] = field(default_factory=list)
    busy_seen: list[float] = field(default_factory=list)  # each stage's busy seconds at the last sample
    # seconds with work in flight (the bubble fraction's denominator): closed intervals, and the
    # start of the open one (``batch_sent`` / ``batch_returned``)
    active_s: float = 0.0
    active_since: float = 0.0
    start_task: asyncio.Task | None = None
    # restarts of its line: a gang that replaces a failed one (or one whose start failed) carries
    # on its count, +1 per restart after a failure; ``replaces``: the gang it took over from
    restarts: int = 0
    replaces: str | None = None
    # monotonic time of the last sign of progress: a batch completed, or the first batch was sent
    # to an idle gang (``batch_sent`` / ``batch_returned``), or a layer finished on a rank
    # (``steps_seen``: the ranks' layer counts at the last health check, which notes it)
    last_progress: float = field(default_factory=time.monotonic)
    steps_seen: int = 0

    @property
    def inflight_batches(self) -> int:
        """Micro-batches in flight on this gang, as the ledger counts them (a view, not a count)."""
        return self.ledger.inflight(self.replica_id)

    def batch_sent(self) -> None:
        """A micro-batch left for this gang (counted in the ledger already): an idle gang's clocks start."""
        if self.inflight_batches == 1:
            self.last_progress = self.active_since = time.monotonic()

    def batch_returned(self) -> None:
        """A micro-batch came back with its logits (its ledger entry closed already): progress, and
        the time with work in flight grows when the gang is idle again."""
        self.last_progress = time.monotonic()
        if self.inflight_batches == 0:
            self.active_s += self.last_progress - self.active_since

    def stalled_for(self, now: float) -> float:
        """Seconds with work in flight and no batch completed (0 when idle)."""
        return max(0.0, now - self.last_progress) if self.inflight_batches > 0 else 0.0

    @property
    def routable(self) -> bool:
        return self.state is ReplicaState.READY and self.backend is not None and self.backend.healthy

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.replica_id,
            "state": self.state.value,
            "model": self.model.source.name,
            "generation": self.model.generation,
            "inflight_batches": self.inflight_batches,
            "restarts": self.restarts,
            "pids": self.backend.pids()
            if self.backend is not None and self.state is not ReplicaState.STOPPED
            else [],
            "error": self.error,
        }


class ReloadError(RuntimeError):
    """The new checkpoint's gangs could not be started; the old ones keep serving."""


class ReloadInProgress(ReloadError):
    """Another reload is running (HTTP 409)."""


class ReplicaManager:
    """Keeps ``target`` READY gangs of the current model generation (see module doc)."""

    def __init__(
        self,
        *,
        gangs: GangSource,
        model: ModelGeneration,
        metrics: ModelMetrics,
        ledger: InflightLedger,
        drain_timeout_s: float = 30.0,
        restart_backoff_s: float = 1.0,
        warmup_timeout_s: float = 120.0,
        fail_fast: bool = False,
        stall_timeout_s: float | None = None,
    ) -> None:
        self.gangs = gangs
        self.model = model
        self.metrics = metrics
        self.ledger = ledger
        self.drain_timeout_s = drain_timeout_s
        self.restart_backoff_s = restart_backoff_s
        self.warmup_timeout_s = warmup_timeout_s
        # fail_fast: when the very first gang cannot start (nothing was ever ready), give up instead
        # of retrying forever: ``fatal_error`` says why (one line) and the CLI exits non-zero
        self.fail_fast = fail_fast
        # stall_timeout_s: a replica with work in flight and no progress for half of it leaves
        # readiness and routing (suspect); for all of it, it is failed and its work retried elsewhere
        self.stall_timeout_s = stall_timeout_s
        self.fatal_error: str | None = None
        self.ever_ready = False
        self.start_failures = 0  # gangs that failed to start, in all
        self.last_failure: str | None = None  # one line, no paths (shown by /readyz)
        self.next_retry_at: float | None = None  # monotonic time of the next restart after a back-off
        self.target = 0
        self.replicas: dict[str, Replica] = {}
        self.listener: ReplicaListener | None = None  # set once by attach()
        self._ids = itertools.count()
        self._tasks: set[asyncio.Task] = set()
        self._reloading = False
        self._closed = False
        self._consecutive_failures = 0
        self.restarts = 0
        self._heirs: list[tuple[str, int]] = []  # (failed gang, restarts) the next launches take over

    def attach(self, listener: ReplicaListener) -> None:
        """Tell ``listener`` (the engine) of replica changes and failures from now on (once)."""
        if self.listener is not None and self.listener is not listener:
            raise RuntimeError("the replica manager already has a listener")
        self.listener = listener

    # ------------------------------------------------------------------ views
    def routable(self) -> list[Replica]:
        """READY, healthy gangs that are not suspected of a stall (see ``stall_timeout_s``)."""
        now = time.monotonic()
        return [r for r in self.replicas.values() if r.routable and not self.suspect(r, now)]

    def suspect(self, replica: Replica, now: float) -> bool:
        """Work in flight and no progress for half the stall timeout: not counted as ready."""
        return self.stall_timeout_s is not None and replica.stalled_for(now) > self.stall_timeout_s / 2

    def count(self, *states: ReplicaState) -> int:
        return sum(1 for r in self.replicas.values() if r.state in states)

    @property
    def ready(self) -> int:
        return len(self.routable())

    @property
    def starting(self) -> int:
        return self.count(ReplicaState.STARTING)

    def pool_limit(self) -> int:
        return self.gangs.cap(self.model.dims.world_size)

    def describe(self) -> list[dict[str, Any]]:
        return [r.describe() for r in self.replicas.values()]

    def health(self) -> dict[str, Any]:
        """Readiness detail (safe for unauthenticated clients: counts and one path-free line)."""
        out: dict[str, Any] = {"ready_replicas": self.ready, "starting_replicas": self.starting}
        if self.start_failures or self.last_failure is not None:
            out["failed_starts"] = self.start_failures
            out["consecutive_failures"] = self._consecutive_failures
            out["last_failure"] = self.last_failure
        if self.next_retry_at is not None:
            out["retry_in_s"] = round(max(0.0, self.next_retry_at - time.monotonic()), 2)
        if self.fatal_error is not None:
            out["fatal"] = scrub_paths(self.fatal_error)
        return out

    def _changed(self) -> None:
        for state in ReplicaState:
            self.metrics.replicas.labels(state=state.value).set(self.count(state))
        if self.listener is not None:
            self.listener.replicas_changed()

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ------------------------------------------------------------------ control
    def set_target(self, n: int) -> int:
        """Ask for ``n`` gangs (clamped to the device pool); returns the target applied."""
        limit = self.pool_limit()
        if n > limit:
            logger.warning("asked for %d replicas, the device pool fits %d: using %d", n, limit, limit)
        self.target = max(0, min(n, limit))
        self.reconcile()
        return self.target

    def reconcile(self) -> None:
        """Start or drain gangs of the current generation until target are live (non-blocking)."""
        if self._reloading or self._closed or self.fatal_error is not None:
            return
        live = [
            r
            for r in self.replicas.values()
            if r.state in (ReplicaState.STARTING, ReplicaState.READY) and r.model is self.model
        ]
        missing = self.target - len(live)
        heirs, self._heirs = self._heirs, []  # a replacement not launched now is a fresh gang later
        for _ in range(missing):
            if self._launch(self.model, heir=heirs.pop(0) if heirs else None) is None:
                break
        for r in list(self.replicas.values()):  # gangs of an older generation (after a reload)
            if r.model is not self.model and r.state is ReplicaState.READY:
                self._spawn(self.drain(r))
        if missing < 0:
            ready = sorted(
                (r for r in live if r.state is ReplicaState.READY),
                key=lambda r: (r.inflight_batches, -r.created_at),
            )
            for r in ready[:-missing]:
                self._spawn(self.drain(r))

    def _launch(self, model: ModelGeneration, *, heir: tuple[str, int] | None = None) -> Replica | None:
        """Take pool slots and start a gang in the background; None when the pool is full.
        ``heir``: (id, restarts) of the failed gang this one replaces."""
        slots = self.gangs.acquire(model.dims.world_size)
        if slots is None:
            logger.warning(
                "device pool full: %d of %d slots free, a gang needs %d",
                self.gangs.free,
                self.gangs.capacity,
                model.dims.world_size,
            )
            return None
        replica = Replica(f"r{next(self._ids)}", model, slots, self.ledger)
        if heir is not None:
            replica.replaces, replica.restarts = heir
        self.replicas[replica.replica_id] = replica
        self._changed()
        replica.start_task = self._spawn(self._start(replica))
        return replica

    async def _start(self, replica: Replica) -> bool:
        if self._closed or replica.state is not ReplicaState.STARTING:  # closing, or drained: never start it
            await self._retire(replica, ReplicaState.STOPPED)
            return False
        model = replica.model
        t0 = time.monotonic()
        try:
            replica.backend = self.gangs.make(
                model, replica.slots, f"{model.source.name}-{replica.replica_id}"
            )
            replica.stage_busy_s = [0.0] * model.dims.pp
            replica.busy_seen = [0.0] * model.dims.pp
            await asyncio.to_thread(replica.backend.start)
            await asyncio.to_thread(warm_up, replica.backend, model, timeout_s=self.warmup_timeout_s)
        except Exception as err:  # a start failure: retried after a back-off by reconcile()
            if self._closed or replica.state is not ReplicaState.STARTING:  # killed on purpose: not a failure
                logger.info("replica %s: start ended (%s)", replica.replica_id, one_line(err, scrub=False))
                await self._retire(replica, ReplicaState.STOPPED)
                return False
            self._consecutive_failures += 1
            self.start_failures += 1
            self.metrics.replica_failures.inc()
            self.last_failure = one_line(err)
            replica.error = f"start failed: {err}"
            logger.error("replica %s failed to start: %s", replica.replica_id, one_line(err, scrub=False))
            logger.debug("replica %s start failure in full: %s", replica.replica_id, err)
            await self._retire(replica, ReplicaState.FAILED)
            if replica.replaces is not None:  # a replacement that could not start: its line goes on
                self._heirs.append((replica.replica_id, replica.restarts))
            if self.fail_fast and not self.ever_ready and not self._closed:
                self.fatal_error = f"the first replica gang could not start: {one_line(err, scrub=False)}"
                if self.listener is not None:
                    self.listener.replicas_changed()
                return False
            backoff = self._backoff()
            self.next_retry_at = time.monotonic() + backoff
            await asyncio.sleep(backoff)
            self.next_retry_at = None
            self.reconcile()
            return False
        if self._closed or replica.state is not ReplicaState.STARTING:
            await self._retire(replica, ReplicaState.STOPPED)
            return False
        self._consecutive_failures = 0
        self.ever_ready = True
        replica.state = ReplicaState.READY
        logger.info(
            "replica %s ready (%s, generation %d, %.1f s, pids %s)",
            replica.replica_id,
            model.source.name,
            model.generation,
            time.monotonic() - t0,
            replica.backend.pids(),
        )
        self._changed()
        self.reconcile()
        return True

    def _backoff(self) -> float:
        n = max(0, self._consecutive_failures - 1)
        return min(MAX_RESTART_BACKOFF_S, self.restart_backoff_s * (2**n))

    async def drain(self, replica: Replica, *, timeout_s: float | None = None) -> None:
        """Stop routing to the replica, wait for its in-flight micro-batches, stop the gang."""
        if replica.state is ReplicaState.STARTING:  # _start() stops it once its start returns
            replica.state = ReplicaState.DRAINING
            self._changed()
            return
        if replica.state is not ReplicaState.READY:
            return
        replica.state = ReplicaState.DRAINING
        self._changed()
        timeout_s = self.drain_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while replica.inflight_batches > 0 and time.monotonic() < deadline:
            if replica.state is not ReplicaState.DRAINING:  # it failed meanwhile
                return
            await asyncio.sleep(0.02)
        if replica.state is not ReplicaState.DRAINING:
            return
        logger.info("replica %s drained (%d batches left)", replica.replica_id, replica.inflight_batches)
        await self._retire(replica, ReplicaState.STOPPED)

    async def _retire(self, replica: Replica, state: ReplicaState, *, timeout_s: float | None = None) -> None:
        """Stop the gang (drains what is left in it, up to ``timeout_s``), free its slots, forget it."""
        replica.state = state
        self._changed()
        if replica.backend is not None:
            wait_s = self.drain_timeout_s if timeout_s is None else timeout_s
            try:
                await asyncio.to_thread(replica.backend.stop, timeout_s=wait_s)
            except Exception as err:
                logger.warning("stopping replica %s: %s", replica.replica_id, err)
        self.gangs.release(replica.slots)
        replica.slots = []
        self.replicas.pop(replica.replica_id, None)
        self.metrics.forget_replica(replica.replica_id)  # ids are never reused: its series would stay
        self._changed()

    def mark_failed(self, replica: Replica, reason: str, *, work_returned: bool = False) -> None:
        """Fail the replica (the fleet's decision): unroutable at once, its gang ended, restarted
        after a back-off. The listener (the engine) is told so that its in-flight work is retried
        elsewhere, unless ``work_returned``: the caller (the dispatcher) has handed it back already."""
        if replica.state not in (ReplicaState.READY, ReplicaState.DRAINING):
            return
        was_draining = replica.state is ReplicaState.DRAINING
        replica.state = ReplicaState.FAILED
        replica.error = reason
        self.last_failure = one_line(reason)
        logger.error("replica %s failed: %s", replica.replica_id, reason)
        self.metrics.replica_failures.inc()
        if replica.backend is not None and replica.backend.healthy:  # alive but judged failed (a stall)
            replica.backend.fail(GangError(reason))
        self._changed()
        if self.listener is not None and not work_returned:
            self.listener.replica_failed(replica)
        self._spawn(self._restart(replica, replace=not was_draining))

    async def _restart(self, replica: Replica, *, replace: bool) -> None:
        # nothing of a failed gang is worth draining: its work was already retried elsewhere
        await self._retire(replica, ReplicaState.FAILED, timeout_s=0.0)
        if not replace or self._closed:
            return
        self._consecutive_failures += 1
        backoff = self._backoff()
        self.next_retry_at = time.monotonic() + backoff
        await asyncio.sleep(backoff)
        self.next_retry_at = None
        self.restarts += 1
        self.metrics.replica_restarts.inc()
        self._heirs.append((replica.replica_id, replica.restarts + 1))
        self.reconcile()

    def check_health(self) -> None:
        """The one place a replica is judged failed: its gang reports a lost rank (it died, raised,
        or stopped beating for ``heartbeat_timeout_s``: ``Backend.healthy``), or it stalled: work in
        flight and neither a micro-batch completed nor a layer finished on any rank for
        ``stall_timeout_s`` (alive but hung; a micro-batch slower than that is still progress),
        named by the ranks' own progress (``stuck_ranks``, when the gang can tell)."""
        now = time.monotonic()
        for r in list(self.replicas.values()):
            if r.state not in (ReplicaState.READY, ReplicaState.DRAINING) or r.backend is None:
                continue
            steps = sum(layer_steps(r.backend) or [])
            if steps != r.steps_seen:
                r.steps_seen, r.last_progress = steps, now
            if not r.backend.healthy:
                err = getattr(r.backend, "error", None)
                self.mark_failed(r, str(err) if err else "gang unhealthy")
            elif self.stall_timeout_s is not None and r.stalled_for(now) > self.stall_timeout_s:
                stuck = getattr(r.backend, "stuck_ranks", None)
                why = f"; {stuck(after_s=self.stall_timeout_s / 2)[1]}" if stuck is not None else ""
                self.mark_failed(
                    r,
                    f"stalled: no micro-batch completed for {r.stalled_for(now):.1f} s with "
                    f"{r.inflight_batches} in flight (stall_timeout_s={self.stall_timeout_s:g}){why}",
                )

    def sample_busy(self) -> None:
        """Per-stage busy time from the ranks' own counters, against the time each replica had work
        in flight: the bubble fraction (see shardserve.serving.metrics); called every supervisor tick."""
        now = time.monotonic()
        for r in self.replicas.values():
            if r.backend is None or r.state is not ReplicaState.READY:
                continue
            active_s = r.active_s + (now - r.active_since if r.inflight_batches > 0 else 0.0)
            busy = busy_seconds(r.backend)
            if busy is None:
                continue
            tp, pp = r.model.dims.tp, r.model.dims.pp
            for stage in range(pp):
                delta = busy[stage * tp] - r.busy_seen[stage]
                r.busy_seen[stage] = busy[stage * tp]
                if delta > 0:
                    r.stage_busy_s[stage] += delta
                    self.metrics.stage_busy.labels(replica=r.replica_id, stage=str(stage)).inc(delta)
            if active_s > 0:
                frac = 1.0 - sum(r.stage_busy_s) / (pp * active_s)
                self.metrics.bubble.labels(replica=r.replica_id).set(min(1.0, max(0.0, frac)))

    # ------------------------------------------------------------------ reload / shutdown
    async def reload(self, model: ModelGeneration, *, replicas: int | None = None) -> None:
        """Roll onto ``model`` and the places the gang source offers now: start a new gang, route to
        it, drain an outgoing one; repeat. Outgoing: a gang of another generation, or on a place of an
        older placement (``GangSource.current``); the others stay. ``replicas``: the target from now
        on (default: the current one, at least 1). Gangs still starting (a scale-up, a restart) are
        ended first: they would hold slots.

        Raises ReloadError (old gangs keep serving) when a new gang fails to start.
        """
        if self._reloading:
            raise ReloadInProgress("a reload is already in progress")
        self._reloading = True
        started: list[Replica] = []
        try:
            await self._end_starts()  # gangs of the outgoing generation still starting would hold slots
            ready = [r for r in self.replicas.values() if r.state is ReplicaState.READY]
            old = [r for r in ready if r.model is not model or not self.gangs.current(r.slots)]
            want = max(1, self.target) if replicas is None else replicas
            for i in range(max(0, want - (len(ready) - len(old)))):
                if self.gangs.free < model.dims.world_size and old:
                    # no room for a new gang next to the old ones: give one old gang back first
                    await self.drain(old.pop(0))
                replica = self._launch(model)
                if replica is None:
                    raise ReloadError(
                        f"device pool has {self.gangs.free} free slots, a gang of {model.source.name} needs "
                        f"{model.dims.world_size}"
                    )
                started.append(replica)
                if replica.start_task is None or not await replica.start_task:
                    raise ReloadError(f"gang {i} of {model.source.name} failed to start: {replica.error}")
                if old:
                    await self.drain(old.pop(0))
            for r in old:
                await self.drain(r)
            self.model, self.target = model, want
            logger.info("reloaded: %s generation %d on %d gangs", model.source.name, model.generation, want)
        except BaseException:
            for r in started:
                if r.state in (ReplicaState.READY, ReplicaState.STARTING):
                    await self.drain(r, timeout_s=self.drain_timeout_s)
            raise
        finally:
            self._reloading = False
            self.reconcile()

    async def _end_starts(self) -> None:
        """Kill the gangs being started (``_start`` then retires them) and wait until their slots are free."""
        starting = [r for r in self.replicas.values() if r.state is ReplicaState.STARTING]
        for r in starting:
            await self.drain(r)  # a starting gang is only marked: its start stops it
            if r.backend is not None:
                await asyncio.to_thread(r.backend.kill)
        deadline = time.monotonic() + self.drain_timeout_s
        while any(r.replica_id in self.replicas for r in starting) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def close(self, *, timeout_s: float) -> None:
        """Drain and stop every gang (server shutdown)."""
        self._closed = True
        starts = {r.start_task for r in self.replicas.values() if r.start_task is not None}
        for task in list(self._tasks):
            if task not in starts and not task.done():
                task.cancel()  # restart back-offs, drains (redone below)
        pending = [t for t in starts if not t.done()]
        if pending and timeout_s <= 0:  # stop now: a gang being started is killed, not waited for
            for r in list(self.replicas.values()):
                if r.start_task in pending and r.backend is not None:
                    await asyncio.to_thread(r.backend.kill)
        if pending:  # a gang being started finishes (or fails), then stops itself
            await asyncio.wait(pending, timeout=timeout_s + (10 if timeout_s <= 0 else 60))
        await asyncio.gather(
            *(self.drain(r, timeout_s=timeout_s) for r in list(self.replicas.values())),
            return_exceptions=True,
        )
        for r in list(self.replicas.values()):  # failed / starting ones
            await self._retire(r, ReplicaState.STOPPED)
