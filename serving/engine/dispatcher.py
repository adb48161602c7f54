"""Dispatch: the engine's client of the replica gangs (vLLM's engine-core client).

Owns the path of a micro-batch after the scheduler formed it: pad its windows, submit it to the
chosen gang, hand the gang's future back to the event loop (gang futures complete on the gang's
monitor thread: ``call_soon_threadsafe``), and report the result to the scheduler (the in-flight
ledger) and the job table. Also owns fail-over: when a batch's future fails, its gang
failed as a whole: the dispatcher hands the replica's in-flight windows straight back to the
scheduler (re-queued at the front for one retry on another replica; 503 when no replica is left)
and reports the failure to the fleet, which alone decides the replica's fate
(``ReplicaManager.mark_failed``). A failure the fleet finds itself (a lost rank while idle, a
stall) comes back through the engine as ``fail_over``.

Each micro-batch that comes back with logits is one model execution: its time from dispatch to
result goes to the ``executions`` metric (by windows in the batch: Triton's batch statistics).

It keeps no table and no count of its own: a batch's items and replica travel with its future's
callback, and whether the batch is still awaited is the ledger's answer (``is_inflight``).

    dispatcher = Dispatcher(scheduler=scheduler, manager=manager, jobs=jobs, metrics=metrics,
                            wake=engine.wake)
    dispatcher.dispatch(scheduler.next_batch(now, views))   # on the event loop
    dispatcher.fail_over(replica)                           # the manager saw a replica fail
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

from shardserve.models.qa_windows import pad_windows
from shardserve.serving.engine.batcher import Dispatch
from shardserve.serving.engine.jobs import JobTable
from shardserve.serving.engine.qa_types import EngineError
from shardserve.serving.engine.scheduler import Outcome, Scheduler
from shardserve.serving.fleet.replicas import Replica, ReplicaManager
from shardserve.serving.metrics import ModelMetrics

logger = logging.getLogger(__name__)


class Dispatcher:
    """Scheduler batches -> gangs -> results / fail-over, on one event loop (see module doc)."""

    def __init__(
        self,
        *,
        scheduler: Scheduler,
        manager: ReplicaManager,
        jobs: JobTable,
        metrics: ModelMetrics,
        wake: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler = scheduler
        self.manager = manager
        self.jobs = jobs
        self.metrics = metrics
        self.wake = wake  # the engine loop re-checks the scheduler (capacity freed, work re-queued)
        self.clock = clock  # the scheduler's clock (``now`` of every scheduler call)

    def dispatch(self, d: Dispatch) -> None:
        """Send one micro-batch (already counted in flight by ``next_batch``) to its gang."""
        loop = asyncio.get_running_loop()
        replica = self.manager.replicas[d.replica_id]
        sent = time.perf_counter()
        windows, pad_id = self.jobs.take_windows(d.items, now=self.clock())
        batch = pad_windows(windows, pad_token_id=pad_id)
        types = batch.token_type_ids if replica.model.source.config.uses_token_types else None
        self.metrics.batch_size.observe(len(windows))
        self.metrics.batch_tokens.observe(len(windows) * d.padded_len)
        self.metrics.batches.labels(reason=d.reason).inc()
        replica.batch_sent()
        assert replica.backend is not None
        try:
            fut = replica.backend.submit(batch.input_ids, batch.attention_mask, types)
        except Exception as err:  # the gang died between routable() and submit()
            self.fail_over(replica)
            self.manager.mark_failed(replica, f"submit failed: {err}", work_returned=True)
            return
        fut.add_done_callback(lambda f: self._from_gang_thread(loop, d, replica, f, sent))

    def _from_gang_thread(
        self, loop: asyncio.AbstractEventLoop, d: Dispatch, replica: Replica, fut: Future, sent: float
    ) -> None:
        """Runs on the gang's monitor thread: hand the result to the event loop."""
        if loop.is_closed():
            return  # the server is gone; nobody waits for this batch
        try:
            loop.call_soon_threadsafe(self._on_done, d, replica, fut, sent)
        except RuntimeError:  # the loop closed in between
            logger.debug("result of batch %d arrived after the event loop closed", d.batch_id)

    def _on_done(self, d: Dispatch, replica: Replica, fut: Future, sent: float) -> None:
        """A batch's result (``sent``: its dispatch, perf_counter), on the event loop."""
        sched = self.scheduler
        if not sched.is_inflight(d.batch_id):  # its replica already failed over
            return
        err = fut.exception()
        if err is not None:
            # a gang fails as a whole: every batch of the replica goes back, this one included
            self.fail_over(replica)
            self.manager.mark_failed(replica, f"{type(err).__name__}: {err}", work_returned=True)
            return
        self.metrics.executions.labels(batch_size=str(len(d.items))).observe(time.perf_counter() - sent)
        self.jobs.add_logits(d.items, fut.result())  # (B, S, 2)
        outcome = sched.batch_done(d.batch_id, now=self.clock(), ok=True)
        replica.batch_returned()
        for rid in outcome.completed:
            self.jobs.complete(rid)
        self.wake()

    def fail_over(self, replica: Replica) -> None:
        """The replica failed: retry its in-flight work elsewhere."""
        self._apply_failure(self.scheduler.replica_failed(replica.replica_id))
        self.wake()

    def _apply_failure(self, outcome: Outcome) -> None:
        self.metrics.retried_windows.inc(outcome.retried_windows)
        for rid in outcome.failed:
            self.jobs.fail(rid, EngineError(503, "replica_failed", "the request failed on two replicas"))
        if outcome.retried_requests and not self.manager.routable():
            # nowhere to retry now: a clean 503 instead of waiting for a restart
            for rid in outcome.retried_requests:
                if rid in self.jobs:
                    self.scheduler.cancel(rid)
                    self.jobs.fail(
                        rid,
                        EngineError(
                            503, "replica_failed", "its replica failed and no other replica is available"
                        ),
                    )
