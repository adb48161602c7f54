"""The engine: the async front of QA serving (vLLM's AsyncLLM), composed of three parts.

Each concept has one home; the engine only wires them and runs the loop:

- ``serving.engine.input_processor``  tokenizing and windowing (off the event loop);
- ``serving.engine.scheduler``        admission, batching, replica choice, and THE in-flight ledger
                               (``ongoing`` requests, batches in flight per replica);
- ``serving.engine.dispatcher``       sending micro-batches to gangs, results back, fail-over;
- ``serving.engine.output_processor`` the job table: logits per window, span decoding, answers.

The engine owns admission order (a queue place is reserved BEFORE tokenizing), the request
lifecycle (deadline 504, client disconnect, drain on stop) and one asyncio task on the server's
event loop that owns the scheduler (no locks): it expires overdue requests (504), asks
``next_batch`` for micro-batches and hands them to the dispatcher, and sleeps until
``next_wakeup`` or an event (a submit, a finished batch, a replica change). It is the manager's
``ReplicaListener``: whoever builds both wires them explicitly (``manager.attach(engine)``).

    scheduler = Scheduler(settings.scheduler_config())
    manager = ReplicaManager(..., ledger=scheduler)
    engine = Engine(scheduler=scheduler, manager=manager, metrics=metrics)
    manager.attach(engine)
    await engine.start()
    job = await engine.submit_async([QAPair("Who?", "Ann met Bob.")])  # raises EngineError (429...)
    results = await engine.wait(job, disconnected=watch_disconnect)    # list[PairResult]
    await engine.stop(timeout_s=30)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from models.qa_processing import EncodedBatch, WindowConfig
from serving.engine.dispatcher import Dispatcher
from serving.engine.input_processor import InputProcessor
from serving.engine.output_processor import Job, OutputProcessor
from serving.engine.qa_types import ClientGone, EngineError, PairResult, QAPair
from serving.engine.scheduler import ReplicaView, Scheduler
from serving.fleet.replicas import Replica, ReplicaManager, ReplicaState
from serving.metrics import ServingMetrics

logger = logging.getLogger(__name__)

SAFETY_MARGIN_S = 5.0  # wait() gives up this long after deadline + stall timeout (a last resort)
MAX_IDLE_S = 0.25  # the loop re-checks the scheduler at least this often


class Engine:
    """Input processor + scheduler + dispatcher + output processor on one event loop (module doc)."""

    def __init__(
        self,
        *,
        scheduler: Scheduler,
        manager: ReplicaManager,
        metrics: ServingMetrics,
        window: WindowConfig | None = None,
        null_threshold: float | None = None,
        max_request_timeout_s: float = 300.0,
        stall_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler = scheduler
        self.manager = manager
        self.metrics = metrics
        self.max_request_timeout_s = max_request_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.clock = clock
        self.inputs = InputProcessor(
            tokenizer=lambda: manager.model.tokenizer, window=window or WindowConfig()
        )
        self.outputs = OutputProcessor(metrics=metrics, null_threshold=null_threshold)
        self.dispatcher = Dispatcher(
            scheduler=scheduler,
            manager=manager,
            outputs=self.outputs,
            metrics=metrics,
            wake=self.wake,
            clock=clock,
        )
        self.accepting = True
        self.aborting = False  # a second signal: answer every admitted request 503 now
        self._drain_deadline: float | None = None  # begin_drain(within_s=...): then 503 for the rest
        self._closing = False
        self._ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self.manager.listener is not self:
            raise RuntimeError("wire the engine to its replica manager first: manager.attach(engine)")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="shardserve-engine")

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
        # admitted requests: queued or in flight, being tokenized (reserved), being decoded
        while (self.ongoing or self.scheduler.reserved or self.outputs.decoding) and not self._stopped():
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
        self.inputs.shutdown()
        self.outputs.shutdown()

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

    # ------------------------------------------------------------------ requests
    def submit(self, pairs: list[QAPair], *, timeout_s: float | None = None) -> Job:
        """Tokenize (on the calling thread) and admit one call; raises EngineError (429 / 503 / 413 /
        422), ``QAInputError`` / ``ValueError`` for text the tokenizer refuses."""
        self._check_admissible(timeout_s)
        return self._admit(pairs, self.inputs.encode(pairs), timeout_s=timeout_s)

    async def submit_async(self, pairs: list[QAPair], *, timeout_s: float | None = None) -> Job:
        """``submit`` with the tokenization on the input processor's thread, so that long contexts
        never stall the event loop (the HTTP server, the scheduler loop, other requests).

        Admission comes first: a queue place is reserved BEFORE tokenizing (requests waiting for the
        tokenizer count against max_queue_size), so a full server answers 429 at once and the work
        (and memory) waiting for the tokenizer is bounded by the queue size.
        """
        self._check_admissible(timeout_s)
        arrived_at = self.clock()
        # a request that cannot fit max_windows_per_request however it tokenizes: 413 before the work
        floor = self.inputs.min_windows(pairs, above=self.scheduler.config.max_windows_per_request)
        if too_many := self.scheduler.too_many_windows(floor, at_least=True):
            raise EngineError(413, too_many.reason, too_many.detail)
        hint = max(floor, self.inputs.estimate_windows(pairs))
        # the time it will wait for the tokenizer is spent from its deadline before it can be queued
        budget_end = arrived_at + self._timeout(timeout_s) - self.inputs.expected_wait_s(pairs)
        adm = self.scheduler.reserve(now=arrived_at, deadline=budget_end, windows_hint=hint)
        if not adm.accepted:
            raise EngineError(429, adm.reason, adm.detail, retry_after_s=adm.retry_after_s)
        self._update_gauges()
        try:
            encoded = await self.inputs.encode_async(pairs)
        except BaseException:  # the tokenizer refused the text, or the client went away
            self.scheduler.unreserve(hint)
            raise
        return self._admit(pairs, encoded, timeout_s=timeout_s, reserved_hint=hint, arrived_at=arrived_at)

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

    def _admit(
        self,
        pairs: list[QAPair],
        encoded: EncodedBatch,
        *,
        timeout_s: float | None,
        reserved_hint: int | None = None,
        arrived_at: float | None = None,
    ) -> Job:
        """Queue tokenized pairs with the scheduler (event-loop thread only); ``reserved_hint``: a
        queue place was taken by ``Scheduler.reserve(windows_hint=...)`` before tokenizing (used or
        given back here);
        the deadline runs from ``arrived_at`` (before tokenizing), else from now."""
        try:
            if reserved_hint is None:
                self._check_admissible(timeout_s)
            elif self._stopped():  # admitted before tokenizing: only stopping refuses it
                raise EngineError(503, "shutting_down", "the server shut down before this request was queued")
        except EngineError:
            if reserved_hint is not None:
                self.scheduler.unreserve(reserved_hint)
            raise
        model = self.manager.model
        now = self.clock()
        rid = f"req-{next(self._ids)}"
        start = now if arrived_at is None else arrived_at
        deadline = start + self._timeout(timeout_s)
        adm = self.scheduler.submit(
            rid,
            [w.num_tokens for w in encoded.windows],
            now=now,
            deadline=deadline,
            reserved=reserved_hint is not None,
            windows_hint=reserved_hint or 1,
        )
        if not adm.accepted:
            if adm.reason in ("queue_full", "overloaded"):
                raise EngineError(429, adm.reason, adm.detail, retry_after_s=adm.retry_after_s)
            raise EngineError(413, adm.reason, adm.detail)
        assert adm.deadline is not None
        job = Job(
            request_id=rid,
            pairs=pairs,
            encoded=encoded,
            future=asyncio.get_running_loop().create_future(),
            submitted_at=now,
            deadline=adm.deadline,
            model_name=model.source.name,
            logits=[None] * len(encoded.windows),
        )
        self.outputs.add(job)
        self._update_gauges()
        self.wake()
        return job

    async def wait(
        self, job: Job, *, disconnected: Callable[[], Awaitable[Any]] | None = None
    ) -> list[PairResult]:
        """The job's answers; EngineError for 503/504; ClientGone when ``disconnected`` fires first."""
        watch = asyncio.ensure_future(disconnected()) if disconnected is not None else None
        bound = max(0.0, job.deadline - self.clock()) + self.stall_timeout_s + SAFETY_MARGIN_S
        try:
            waiting = {job.future} if watch is None else {job.future, watch}
            done, _ = await asyncio.wait(waiting, timeout=bound, return_when=asyncio.FIRST_COMPLETED)
            if job.future in done:
                return job.future.result()
            if watch is not None and watch in done:
                self.cancel(job.request_id)
                raise ClientGone(job.request_id)
            logger.error("request %s not answered %.1f s past its deadline", job.request_id, bound)
            self.cancel(job.request_id)
            raise EngineError(504, "deadline_exceeded", f"not answered within {bound:.1f} s")
        finally:
            if watch is not None and not watch.done():
                watch.cancel()
            if not job.future.done():
                job.future.cancel()

    def cancel(self, request_id: str) -> None:
        """Drop a request's queued windows; in-flight results of it are ignored."""
        if self.outputs.pop(request_id) is not None:
            self.scheduler.cancel(request_id)
            self._update_gauges()
            logger.info("request %s cancelled", request_id)
            self.wake()

    def _fail(self, rid: str, err: EngineError) -> None:
        self.outputs.fail(rid, err)
        self._update_gauges()

    def _fail_outstanding(self, detail: str) -> None:
        """Answer every admitted request 503 (queued windows dropped, late results ignored)."""
        for rid in self.outputs.request_ids():
            self.scheduler.cancel(rid)
            self._fail(rid, EngineError(503, "shutting_down", detail))

    # ------------------------------------------------------------------ the loop
    async def _run(self) -> None:
        while not self._closing:
            self._wake.clear()
            if self.aborting and self.outputs.request_ids():
                self._fail_outstanding(
                    "the server was stopped (a second signal) before this request was answered"
                )
            elif self.drain_left_s() == 0.0 and self.outputs.request_ids():
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
        st = self.scheduler.stats()
        self.metrics.queue_depth.set(st.queued_requests)
        self.metrics.queue_windows.set(st.queued_windows)
        self.metrics.padding_ratio.set(st.padding_ratio)
        self.metrics.inflight_requests.set(self.scheduler.ongoing)
