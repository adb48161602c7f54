"""The engine core of one model (vLLM's EngineCore), and the front end's one way to its fleet.

Each concept has one home; the engine only wires them and runs the loop:

- ``shardserve.serving.engine.scheduler``  admission, batching, replica choice, and THE in-flight ledger
                                (``ongoing`` requests, batches in flight per replica);
- ``shardserve.serving.engine.dispatcher`` sending micro-batches to gangs, results back, fail-over;
- ``shardserve.serving.engine.jobs``       the job table: logits per window, answered as ``CoreAnswer``.

Tokenizing and span decoding are the client's (``serving/engine/client.py``: input processor,
``CoreLink``, output processor), in this process or in an API process alike; the engine sees a
request as three calls: ``reserve`` (a queue place BEFORE tokenizing: 429 / 413 / 503 at once),
``admit_encoded`` (its windows queued; the job's future is its logits) and ``cancel``. It owns the
request lifecycle in the core (deadline 504, drain on stop) and one asyncio task on the server's
event loop that owns the scheduler (no locks): it expires overdue requests (504), asks
``next_batch`` for micro-batches and hands them to the dispatcher, and sleeps until
``next_wakeup`` or an event (a submit, a finished batch, a replica change). It is the manager's
``ReplicaListener``: whoever builds both wires them explicitly (``manager.attach(engine)``;
``serving/engine/builder.py`` does, for the server).

The front end never touches the fleet: the engine's facade (the last section of ``Engine``)
delegates to the replica manager and the supervisor: the model and its public description,
replicas and health, scaling (pin, bounds), reload, shutdown.

    engine = build_engine(model=model, fleet=fleet, scheduler=..., autoscaling=..., metrics=metrics)
    await engine.start()
    ticket = engine.reserve(ask, timeout_s=None, started=t0)     # EngineError 429 / 413 / 503 / 422
    job = engine.admit_encoded(ticket, encoded, input_s=s, request_id="req-1")  # future: CoreAnswer
    engine.cancel(job.request_id)
    engine.pin(2); await engine.reload("tiny-roberta")            # EngineError: 409 / 422
    await engine.shutdown(timeout_s=30)                           # drain, stop the gangs

Tests: ``pytest tests/serving/engine/test_engine.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from shardserve.models.config import ModelConfigError
from shardserve.models.hf_weights import CheckpointError
from shardserve.models.qa_windows import EncodedBatch
from shardserve.partitioner.placement.latency import PlacementError
from shardserve.serving.config import AutoscalingConfig, FleetConfig
from shardserve.serving.engine.batcher import ReplicaView
from shardserve.serving.engine.dispatcher import Dispatcher
from shardserve.serving.engine.input_processor import AdmissionAsk
from shardserve.serving.engine.jobs import Job, JobTable
from shardserve.serving.engine.qa_types import EngineError
from shardserve.serving.engine.replica_detail import ReplicaDetail
from shardserve.serving.engine.scheduler import Scheduler
from shardserve.serving.fleet import model_loader
from shardserve.serving.fleet.backend import ModelGeneration
from shardserve.serving.fleet.replicas import (
    ReloadError,
    ReloadInProgress,
    Replica,
    ReplicaManager,
    ReplicaState,
)
from shardserve.serving.fleet.supervisor import Supervisor
from shardserve.serving.metrics import ModelMetrics
from shardserve.serving.redact import one_line

logger = logging.getLogger(__name__)

MAX_IDLE_S = 0.25  # the loop re-checks the scheduler at least this often
ARRIVALS_KEPT = 100_000  # arrival times kept for the observed workload


@dataclass(frozen=True)
class Ticket:
    """A queue place reserved before tokenizing (``Engine.reserve``), redeemed by ``admit_encoded``."""

    hint: int  # windows reserved
    arrived_at: float  # the engine's clock at admission: the deadline runs from here
    started: float  # time.perf_counter() at arrival: the request's duration in the metrics
    timeout_s: float | None


class Engine:
    """Scheduler + dispatcher + job table on one event loop, and the fleet's facade (module doc)."""

    def __init__(
        self,
        *,
        scheduler: Scheduler,
        manager: ReplicaManager,
        metrics: ModelMetrics,
        supervisor: Supervisor | None = None,
        fleet: FleetConfig | None = None,
        name: str | None = None,
        max_request_timeout_s: float = 300.0,
        roll: Callable[[ModelGeneration], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler = scheduler
        self.manager = manager
        self.supervisor = supervisor  # health + autoscaling loop (None: the replica count is set by hand)
        self.fleet = fleet or FleetConfig()  # how models load on reload, the ranks' dtype (model info)
        # the model's name for clients (and its metrics label): fixed for the engine's life, reloads too
        self.name = name or manager.model.source.name
        self.metrics = metrics
        self.max_request_timeout_s = max_request_timeout_s
        # how a reload's new generation reaches the gangs: the manager's own roll, or (``roll``) the
        # placement's, which rolls every model sharing its device groups too
        self._roll = roll or manager.reload
        self.clock = clock
        # when requests arrived (admitted or not): the observed workload auto placement re-plans for
        self.arrivals: deque[float] = deque(maxlen=ARRIVALS_KEPT)
        self.jobs = JobTable(metrics=metrics)
        self.dispatcher = Dispatcher(
            scheduler=scheduler,
            manager=manager,
            jobs=self.jobs,
            metrics=metrics,
            wake=self.wake,
            clock=clock,
        )
        self.accepting = True
        self.aborting = False  # a second signal: answer every admitted request 503 now
        self._drain_deadline: float | None = None  # begin_drain(within_s=...): then 503 for the rest
        self._closing = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the loop, and the supervisor (which sets the first replica target)."""
        if self.manager.listener is not self:
            raise RuntimeError("wire the engine to its replica manager first: manager.attach(engine)")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="shardserve-engine")
        self._publish_model_info()
        if self.supervisor is not None:
            await self.supervisor.start()

    def begin_drain(self, *, within_s: float | None = None) -> None:
        """Refuse new requests (503) from now on; admitted ones (those being tokenized too) still
        complete, within ``within_s`` if given: then the loop answers what is left 503 (the first
        deadline set holds). Only sets flags: safe from a signal handler."""
        if self.accepting:
            logger.info("draining: %d requests admitted", self.ongoing)
        self.accepting = False
        if within_s is not None and self._drain_deadline is None:
            self._drain_deadline = self.clock() + within_s

    def drain_left_s(self) -> float | None:
        """Seconds left of the drain's time (>= 0); None when no drain time was set."""
        return None if self._drain_deadline is None else max(0.0, self._drain_deadline - self.clock())

    def _stopped(self) -> bool:
        """Stopping: a second signal, stop() done, or the drain's time ran out."""
        return self.aborting or self._closing or self.drain_left_s() == 0.0

    def abort(self) -> None:
        """Stop now (a second signal): refuse new requests and answer every admitted one 503 at the
        loop's next pass, within MAX_IDLE_S. Only sets flags: safe from a signal handler."""
        self.begin_drain()
        self.aborting = True

    async def stop(self, *, timeout_s: float) -> None:
        """Drain admitted requests (bounded by timeout_s, cut short by ``abort``), fail the rest
        with 503, stop the loop."""
        self.begin_drain(within_s=timeout_s)
        # admitted requests: queued or in flight, being tokenized (reserved)
        while (self.ongoing or self.scheduler.reserved) and not self._stopped():
            await asyncio.sleep(0.02)
        self._fail_outstanding("the server shut down before this request was answered")
        # a flag, not task.cancel() (asyncio.wait_for (3.11) can swallow a cancellation); from here a
        # request still being tokenized is refused too
        self._closing = True
        if self._task is not None:
            self.wake()
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 5.0)
            except TimeoutError:
                self._task.cancel()

    def wake(self) -> None:
        self._wake.set()

    @property
    def ongoing(self) -> int:
        """Admitted requests not yet answered (queued or in flight): the scheduler's count."""
        return self.scheduler.ongoing

    # ------------------------------------------------------------------ ReplicaListener
    def replicas_changed(self) -> None:
        """The manager's replica set changed: re-check the scheduler (capacity may have come)."""
        self.wake()

    def replica_failed(self, replica: Replica) -> None:
        """The manager marked a replica failed: retry its in-flight work elsewhere at once."""
        self.dispatcher.fail_over(replica)

    # ------------------------------------------------------------------ requests (the CoreLink's calls)
    def reserve(self, ask: AdmissionAsk, *, timeout_s: float | None, started: float) -> Ticket:
        """A queue place for a request not yet tokenized (``ask``: its window numbers, from
        ``InputProcessor.admission`` wherever it runs); EngineError 503 / 422 / 413 (it cannot fit
        max_windows_per_request however it tokenizes) / 429, before any tokenizing."""
        self.arrivals.append(self.clock())
        self._check_admissible(timeout_s)
        arrived_at = self.clock()
        if too_many := self.scheduler.too_many_windows(ask.floor, at_least=True):
            raise EngineError(413, too_many.reason, too_many.detail)
        hint = max(ask.floor, ask.hint)
        # the time it will wait for the tokenizer is spent from its deadline before it can be queued
        budget_end = arrived_at + self._timeout(timeout_s) - ask.tokenize_wait_s
        adm = self.scheduler.reserve(now=arrived_at, deadline=budget_end, windows_hint=hint)
        if not adm.accepted:
            raise EngineError(429, adm.reason, adm.detail, retry_after_s=adm.retry_after_s)
        self._update_gauges()
        return Ticket(hint=hint, arrived_at=arrived_at, started=started, timeout_s=timeout_s)

    def unreserve(self, ticket: Ticket) -> None:
        """Give a reserved place back (the request was never admitted: its text was refused, or it left)."""
        self.scheduler.unreserve(ticket.hint)
        self._update_gauges()

    def admit_encoded(self, ticket: Ticket, encoded: EncodedBatch, *, input_s: float, request_id: str) -> Job:
        """Queue a reserved request's windows (event-loop thread only): its job, whose future is its
        ``CoreAnswer``; the deadline runs from the reservation. ``input_s``: the seconds its tokenizing
        took (``compute_input``). EngineError 503 / 429 / 413 (the place given back)."""
        if self._stopped():  # admitted before tokenizing: only stopping refuses it
            self.unreserve(ticket)
            raise EngineError(503, "shutting_down", "the server shut down before this request was queued")
        now = self.clock()
        adm = self.scheduler.submit(
            request_id,
            [w.num_tokens for w in encoded.windows],
            now=now,
            deadline=ticket.arrived_at + self._timeout(ticket.timeout_s),
            reserved=True,
            windows_hint=ticket.hint,
        )
        if not adm.accepted:
            if adm.reason in ("queue_full", "overloaded"):
                raise EngineError(429, adm.reason, adm.detail, retry_after_s=adm.retry_after_s)
            raise EngineError(413, adm.reason, adm.detail)
        job = Job(
            request_id=request_id,
            encoded=encoded,
            future=asyncio.get_running_loop().create_future(),
            submitted_at=now,
            logits=[None] * len(encoded.windows),
            started=ticket.started,
            phases={"compute_input": input_s},
        )
        self.jobs.add(job)
        self._update_gauges()
        self.wake()
        return job

    def _check_admissible(self, timeout_s: float | None) -> None:
        if not self.accepting:
            raise EngineError(503, "shutting_down", "the server is shutting down")
        if self.manager.count(ReplicaState.READY) == 0 and self.manager.starting == 0:
            raise EngineError(503, "no_replica", "no replica gang is running; retry shortly")
        if timeout_s is not None and timeout_s > self.max_request_timeout_s:
            raise EngineError(
                422,
                "invalid_timeout",
                f"timeout_s={timeout_s} exceeds max_request_timeout_s={self.max_request_timeout_s}",
            )

    def _timeout(self, timeout_s: float | None) -> float:
        return self.scheduler.config.default_deadline_s if timeout_s is None else timeout_s

    def cancel(self, request_id: str) -> None:
        """Drop a request's queued windows; in-flight results of it are ignored."""
        if self.jobs.pop(request_id) is not None:
            self.scheduler.cancel(request_id)
            self._update_gauges()
            logger.info("request %s cancelled", request_id)
            self.wake()

    def _fail(self, rid: str, err: EngineError) -> None:
        self.jobs.fail(rid, err)
        self._update_gauges()

    def _fail_outstanding(self, detail: str) -> None:
        """Answer every admitted request 503 (queued windows dropped, late results ignored)."""
        for rid in self.jobs.request_ids():
            self.scheduler.cancel(rid)
            self._fail(rid, EngineError(503, "shutting_down", detail))

    # ------------------------------------------------------------------ the loop
    async def _run(self) -> None:
        while not self._closing:
            self._wake.clear()
            if self.aborting and self.jobs.request_ids():
                self._fail_outstanding(
                    "the server was stopped (a second signal) before this request was answered"
                )
            elif self.drain_left_s() == 0.0 and self.jobs.request_ids():
                self._fail_outstanding("the server's drain time ran out before this request was answered")
            try:
                wake = self._step()
            except Exception:  # a bug must not kill the loop (and hang every request)
                logger.exception("engine loop iteration failed")
                wake = None
            # sleep until the scheduler's next timer or an event (submit, result, replica change);
            # never longer than MAX_IDLE_S, so no missed event can wedge the queue for long
            timeout = MAX_IDLE_S if wake is None else min(MAX_IDLE_S, max(0.0, wake - self.clock()))
            if timeout == 0.0:
                await asyncio.sleep(0)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _step(self) -> float | None:
        """One pass: expire (504), dispatch every releasable micro-batch, update gauges.

        Returns the scheduler's next timer wake-up. ``next_wakeup`` must see the SAME ``now`` as
        ``next_batch``: with a later reading, a batch that became releasable in between is
        neither dispatched nor counted as a timer, and the loop would sleep past it.
        """
        sched = self.scheduler
        now = self.clock()
        for rid in sched.expire(now):
            self._expired(rid)
        while True:
            views = [ReplicaView(r.replica_id) for r in self.manager.routable()]
            if not views:
                break
            d = sched.next_batch(now, views)
            if d is None:
                break
            self.dispatcher.dispatch(d)
        for rid in sched.expire(now):
            self._expired(rid)
        self._update_gauges()
        return sched.next_wakeup(now)

    def _expired(self, rid: str) -> None:
        self._fail(
            rid, EngineError(504, "deadline_exceeded", "the deadline passed before the request was computed")
        )

    def _update_gauges(self) -> None:
        b, m = self.scheduler.batcher, self.metrics  # read directly: this runs several times per request
        m.queue_depth.set(b.queued_requests)
        m.queue_windows.set(b.queued_windows)
        m.padding_ratio.set(b.padding_ratio)
        m.inflight_requests.set(self.scheduler.ongoing)

    # ------------------------------------------------------------------ the front end's facade
    async def shutdown(self, *, timeout_s: float) -> None:
        """``stop`` (drain within ``timeout_s``), stop the supervisor, then stop the gangs with what
        is left of the drain's time; none, their ranks killed, when stopping now (a second signal) or
        when no gang was ever ready (nothing needs it any more, and its start could take minutes)."""
        await self.stop(timeout_s=timeout_s)
        if self.supervisor is not None:
            await self.supervisor.stop()
        stop_now = self.aborting or not self.manager.ever_ready
        await self.manager.close(timeout_s=0.0 if stop_now else self.drain_left_s() or 0.0)

    @property
    def model(self) -> ModelGeneration:
        """The model generation being served (the newest after a reload)."""
        return self.manager.model

    @property
    def generation(self) -> int:
        return self.manager.model.generation

    def public_checkpoint(self) -> dict[str, Any]:
        """The model's ``ModelSource.describe()`` for unauthenticated clients: file names, never
        absolute paths."""
        described = self.manager.model.source.describe()
        out = dict(described)
        out["checkpoint"] = PurePath(str(described.get("checkpoint", ""))).name
        out["overlays"] = [PurePath(str(p)).name for p in described.get("overlays", [])]
        return out

    @property
    def pool_slots(self) -> int:
        """Rank slots of the device pool."""
        return self.manager.gangs.capacity

    def health(self) -> dict[str, Any]:
        """Readiness detail: ``ready_replicas``, ``starting_replicas``; ``fatal`` when the first gang
        could not start; start failures (safe for unauthenticated clients: counts, one path-free line)."""
        return self.manager.health()

    def replicas(self) -> list[dict[str, Any]]:
        """Each replica gang's description."""
        return self.manager.describe()

    def replica_details(self) -> list[ReplicaDetail]:
        """Each replica gang as the status page shows it (state, ranks' devices and processes)."""
        m = self.manager
        return [
            ReplicaDetail.of(r, m.gangs.devices(r.slots) if r.slots else ())
            for r in list(m.replicas.values())
        ]

    def scaling(self) -> dict[str, Any]:
        """Target, ready / starting counts, autoscaling bounds and decisions, replicas."""
        return self._supervisor().describe()

    @property
    def scaling_config(self) -> AutoscalingConfig:
        """The autoscaling knobs in effect (bounds as last set)."""
        return self._supervisor().config

    def scaling_history(self) -> list[dict[str, Any]]:
        """The last applied target changes, oldest first: time, source, before, after, reason."""
        return list(self._supervisor().history)

    def pin(self, n: int) -> int:
        """Run exactly ``n`` gangs (autoscaling pauses); ValueError over the device pool's cap."""
        return self._supervisor().pin(n)

    def set_bounds(self, *, min_replicas: int | None = None, max_replicas: int | None = None) -> None:
        """Resume autoscaling within new bounds (an unset one: the current minimum, or at least the
        current maximum); ValueError for bounds out of order or over the device pool's cap."""
        sup = self._supervisor()
        lo = min_replicas if min_replicas is not None else sup.config.min_replicas
        hi = max_replicas if max_replicas is not None else max(lo, sup.config.max_replicas)
        sup.set_bounds(lo, hi)

    async def reload(self, name: str) -> ModelGeneration:
        """Load ``name`` into fresh gangs, switch traffic to them, drain the old ones. EngineError: 422
        ``invalid_model`` (not loadable, or not fitting the config) / ``reload_failed``, 409
        ``tokenizer_mismatch`` / ``reload_in_progress``. Replies name no server paths."""
        current = self.manager.model
        try:
            model = await asyncio.to_thread(
                model_loader.load_generation, self.fleet, name, generation=current.generation + 1
            )
        except (ModelConfigError, CheckpointError, OSError) as err:
            # one answer whatever the reason (missing, a directory without a model, unreadable weights):
            # the reply must not map the server's file system; the log has the reason
            # the warning reaches the open status page: the model's base name only; the reason at INFO
            logger.warning("reload to model %r refused (the reason is logged at INFO)", PurePath(name).name)
            logger.info("reload to %r refused: %s", name, err)
            raise EngineError(
                422,
                "invalid_model",
                f"{name!r} is not a loadable model (a registry name, or a model directory with "
                "config.json and weights the server can read); the server log has the reason",
            ) from err
        except ValueError as err:  # the model loads but does not fit the config (numbers, no paths)
            raise EngineError(422, "invalid_model", f"{name!r}: {one_line(err)}") from err
        if model.tokenizer.get_vocab() != current.tokenizer.get_vocab():
            raise EngineError(
                409,
                "tokenizer_mismatch",
                f"{name!r} has another tokenizer than {current.source.name!r}; restart instead",
            )
        try:
            await self._roll(model)
        except PlacementError as err:  # the new generation does not fit the devices beside the others
            raise EngineError(422, "invalid_model", f"{name!r}: {one_line(err)}") from err
        except ReloadInProgress as err:
            raise EngineError(409, "reload_in_progress", str(err)) from err
        except ReloadError as err:
            logger.error("reload to %r failed: %s", name, err)
            raise EngineError(422, "reload_failed", one_line(err)) from err
        self._publish_model_info()
        return model

    def _supervisor(self) -> Supervisor:
        if self.supervisor is None:
            raise RuntimeError("this engine was built without a supervisor (see serving/engine/builder.py)")
        return self.supervisor

    def _publish_model_info(self) -> None:
        """``shardserve_model_info`` of this model (its public name, kept across reloads): the compute
        dtype and the partition of the generation being served."""
        dims = self.manager.model.dims
        self.metrics.set_model_info(precision=self.fleet.dtype, pp=dims.pp, tp=dims.tp)
