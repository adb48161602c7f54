"""The async driver between HTTP requests and replica gangs, built on the pure ``Scheduler``.

One asyncio task on the server's event loop owns the scheduler (no locks): it expires overdue
requests (504), asks ``next_batch`` for micro-batches, pads their windows and submits them to
the chosen gang, and sleeps until ``next_wakeup`` or an event (a submit, a finished batch, a
replica change). Gang futures complete on the gang's monitor thread and are handed back to the
loop with ``call_soon_threadsafe``. A request completes when all its windows have logits; its
answers are decoded per pair (``decode_spans``) and its future resolved.

Failures: a batch whose future fails means its gang failed: the replica is marked failed at
once (``ReplicaManager.mark_failed``), the scheduler re-queues the in-flight windows at the front
for one retry on another replica, and when no replica is left to retry on, the affected requests
get 503 instead of waiting. A client that disconnects cancels its queued work (``Engine.wait``).

    engine = Engine(settings=settings, manager=manager, metrics=metrics)
    await engine.start()
    job = await engine.submit_async([QAPair("Who?", "Ann met Bob.")])  # raises EngineError (429...)
    results = await engine.wait(job, disconnected=watch_disconnect)           # list[PairResult]
    await engine.stop(timeout_s=30)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from models.qa_processing import (
    EncodedBatch,
    QAPrediction,
    WindowConfig,
    decode_spans,
    encode_qa,
    pad_windows,
)
from serving.metrics import ServingMetrics
from serving.replicas import Replica, ReplicaManager, ReplicaState
from serving.scheduler import Dispatch, ReplicaView, Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)

SAFETY_MARGIN_S = 5.0  # wait() gives up this long after deadline + stall timeout (a last resort)
MAX_IDLE_S = 0.25  # the loop re-checks the scheduler at least this often


class EngineError(Exception):
    """A request cannot be answered: HTTP ``status``, machine ``code``, human ``detail``."""

    def __init__(self, status: int, code: str, detail: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail
        self.retry_after_s = retry_after_s


class ClientGone(Exception):
    """The client disconnected; its work was cancelled."""


@dataclass(frozen=True)
class QAPair:
    question: str
    context: str
    top_k: int = 1
    max_answer_length: int = 30


@dataclass(frozen=True)
class PairResult:
    prediction: QAPrediction
    windows: int


@dataclass(eq=False)
class Job:
    """One admitted HTTP call (one scheduler request, possibly several pairs and windows)."""

    request_id: str
    pairs: list[QAPair]
    encoded: EncodedBatch
    future: asyncio.Future
    submitted_at: float
    deadline: float
    model_name: str
    logits: list[torch.Tensor | None] = field(default_factory=list)  # per window: (n_tokens, 2)
    dispatched: int = 0


@dataclass(eq=False)
class _InFlight:
    dispatch: Dispatch
    replica: Replica


class Engine:
    """Scheduler + replicas + QA pre/post-processing on one event loop (see module doc)."""

    def __init__(
        self,
        *,
        scheduler_config: SchedulerConfig,
        manager: ReplicaManager,
        metrics: ServingMetrics,
        max_seq_len: int = 384,
        doc_stride: int = 128,
        max_question_len: int = 64,
        null_threshold: float | None = None,
        max_request_timeout_s: float = 300.0,
        stall_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler = Scheduler(scheduler_config)
        self.manager = manager
        self.metrics = metrics
        self.max_seq_len = max_seq_len
        self.doc_stride = doc_stride
        self.max_question_len = max_question_len
        self.null_threshold = null_threshold
        self.max_request_timeout_s = max_request_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.clock = clock
        self.accepting = True
        self._closing = False
        self._jobs: dict[str, Job] = {}
        self._inflight: dict[int, _InFlight] = {}
        self._ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # One thread: a fast tokenizer is not safe to call from several threads at once
        # ("Already borrowed"); one is enough to keep tokenization off the event loop.
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardserve-tokenize")
        manager.on_change = self.wake
        manager.on_failed = self._on_replica_failed

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run(), name="shardserve-engine")

    def begin_drain(self) -> None:
        """Refuse new requests (503) from now on; admitted ones still complete."""
        if self.accepting:
            logger.info("draining: %d requests admitted", len(self._jobs))
        self.accepting = False

    async def stop(self, *, timeout_s: float) -> None:
        """Drain admitted requests (bounded by timeout_s), fail the rest with 503, stop the loop."""
        self.begin_drain()
        deadline = self.clock() + timeout_s
        while self._jobs and self.clock() < deadline:
            await asyncio.sleep(0.02)
        for rid in list(self._jobs):
            self.scheduler.cancel(rid)
            self._fail(
                rid,
                EngineError(503, "shutting_down", "the server shut down before this request was answered"),
            )
        if self._task is not None:
            # a flag, not task.cancel(): asyncio.wait_for (3.11) can swallow a cancellation
            self._closing = True
            self.wake()
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 5.0)
            except TimeoutError:
                self._task.cancel()
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    def wake(self) -> None:
        self._wake.set()

    @property
    def ongoing(self) -> int:
        """Admitted requests not yet answered (queued or in flight)."""
        return len(self._jobs)

    # ------------------------------------------------------------------ requests
    def submit(self, pairs: list[QAPair], *, timeout_s: float | None = None) -> Job:
        """Tokenize (on the calling thread) and admit one call; raises EngineError (429 / 503 / 413 /
        422), ``QAInputError`` / ``ValueError`` for text the tokenizer refuses."""
        self._check_admissible(timeout_s)
        return self._admit(pairs, self._encode(pairs), timeout_s=timeout_s)

    async def submit_async(self, pairs: list[QAPair], *, timeout_s: float | None = None) -> Job:
        """``submit`` with the tokenization on the engine's tokenizer thread, so that long contexts
        never stall the event loop (the HTTP server, the scheduler loop, other requests).

        Admission comes first: a queue place is reserved BEFORE tokenizing (requests waiting for the
        tokenizer count against max_queue_size), so a full server answers 429 at once and the work
        (and memory) waiting for the tokenizer is bounded by the queue size.
        """
        self._check_admissible(timeout_s)
        arrived_at = self.clock()
        adm = self.scheduler.reserve()
        if not adm.accepted:
            raise EngineError(429, "queue_full", adm.detail, retry_after_s=adm.retry_after_s)
        self._update_gauges()
        try:
            encoded = await asyncio.get_running_loop().run_in_executor(
                self._tokenizer_thread, self._encode, pairs
            )
        except BaseException:  # the tokenizer refused the text, or the client went away
            self.scheduler.unreserve()
            raise
        return self._admit(pairs, encoded, timeout_s=timeout_s, reserved=True, arrived_at=arrived_at)

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

    def _encode(self, pairs: list[QAPair]) -> EncodedBatch:
        return encode_qa(
            self.manager.model.tokenizer,
            [p.question for p in pairs],
            [p.context for p in pairs],
            window=WindowConfig(
                max_seq_len=self.max_seq_len,
                doc_stride=self.doc_stride,
                max_question_len=self.max_question_len,
            ),
        )

    def _admit(
        self,
        pairs: list[QAPair],
        encoded: EncodedBatch,
        *,
        timeout_s: float | None,
        reserved: bool = False,
        arrived_at: float | None = None,
    ) -> Job:
        """Queue tokenized pairs with the scheduler (event-loop thread only); ``reserved``: a queue
        place was taken by ``Scheduler.reserve()`` before tokenizing (used or given back here);
        the deadline runs from ``arrived_at`` (before tokenizing), else from now."""
        try:
            self._check_admissible(timeout_s)  # again: a drain may have begun while tokenizing
        except EngineError:
            if reserved:
                self.scheduler.unreserve()
            raise
        model = self.manager.model
        now = self.clock()
        rid = f"req-{next(self._ids)}"
        start = now if arrived_at is None else arrived_at
        deadline = start + (self.scheduler.config.default_deadline_s if timeout_s is None else timeout_s)
        adm = self.scheduler.submit(
            rid, [w.num_tokens for w in encoded.windows], now=now, deadline=deadline, reserved=reserved
        )
        if not adm.accepted:
            if adm.reason == "queue_full":
                raise EngineError(429, "queue_full", adm.detail, retry_after_s=adm.retry_after_s)
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
        self._jobs[rid] = job
        self.metrics.inflight_requests.set(len(self._jobs))
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
        if self._jobs.pop(request_id, None) is not None:
            self.scheduler.cancel(request_id)
            self.metrics.inflight_requests.set(len(self._jobs))
            logger.info("request %s cancelled", request_id)
            self.wake()

    def _fail(self, rid: str, err: EngineError) -> None:
        job = self._jobs.pop(rid, None)
        self.metrics.inflight_requests.set(len(self._jobs))
        if job is not None and not job.future.done():
            job.future.set_exception(err)

    # ------------------------------------------------------------------ the loop
    async def _run(self) -> None:
        while not self._closing:
            self._wake.clear()
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
            views = [ReplicaView(r.replica_id, r.inflight_batches) for r in self.manager.routable()]
            if not views:
                break
            d = sched.next_batch(now, views)
            if d is None:
                break
            self._dispatch(d)
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

    def _dispatch(self, d: Dispatch) -> None:
        replica = self.manager.replicas[d.replica_id]
        now = self.clock()
        windows = []
        for rid, idx in d.items:
            job = self._jobs[rid]
            windows.append(job.encoded.windows[idx])
            job.dispatched += 1
            if job.dispatched == len(job.encoded.windows):
                self.metrics.queue_wait.observe(now - job.submitted_at)
        pad_id = self._jobs[d.items[0][0]].encoded.pad_token_id
        batch = pad_windows(windows, pad_token_id=pad_id)
        types = batch.token_type_ids if replica.model.pass_token_types else None
        self.metrics.batch_size.observe(len(windows))
        self.metrics.batch_tokens.observe(len(windows) * d.padded_len)
        self.metrics.batches.labels(reason=d.reason).inc()
        self._inflight[d.batch_id] = _InFlight(d, replica)
        if replica.inflight_batches == 0:
            replica.last_progress = time.monotonic()  # an idle gang starts its progress clock now
        replica.inflight_batches += 1
        assert replica.backend is not None
        try:
            fut = replica.backend.submit(batch.input_ids, batch.attention_mask, types)
        except Exception as err:  # the gang died between routable() and submit()
            self.manager.mark_failed(replica, f"submit failed: {err}")
            return
        fut.add_done_callback(lambda f, bid=d.batch_id: self._from_gang_thread(bid, f))

    def _from_gang_thread(self, batch_id: int, fut: Future) -> None:
        """Runs on the gang's monitor thread: hand the result to the event loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # the server is gone; nobody waits for this batch
        try:
            loop.call_soon_threadsafe(self._on_done, batch_id, fut)
        except RuntimeError:  # the loop closed in between
            logger.debug("result of batch %d arrived after the event loop closed", batch_id)

    def _on_done(self, batch_id: int, fut: Future) -> None:
        entry = self._inflight.get(batch_id)
        if entry is None:  # its replica already failed over
            return
        replica, d = entry.replica, entry.dispatch
        err = fut.exception()
        if err is not None:
            # a gang fails as a whole: fail over every batch of the replica, this one included
            self.manager.mark_failed(replica, f"{type(err).__name__}: {err}")
            if self._inflight.pop(batch_id, None) is not None:  # the replica was not routable any more
                replica.inflight_batches = max(0, replica.inflight_batches - 1)
                self._apply_failure(self.scheduler.batch_done(batch_id, now=self.clock(), ok=False), [d])
            self.wake()
            return
        del self._inflight[batch_id]
        replica.inflight_batches = max(0, replica.inflight_batches - 1)
        replica.last_progress = time.monotonic()
        logits = fut.result()  # (B, S, 2)
        for i, (rid, idx) in enumerate(d.items):
            job = self._jobs.get(rid)
            if job is not None:
                n = job.encoded.windows[idx].num_tokens
                job.logits[idx] = logits[i, :n]
        outcome = self.scheduler.batch_done(batch_id, now=self.clock(), ok=True)
        for rid in outcome.completed:
            self._complete(rid)
        self.wake()

    def _complete(self, rid: str) -> None:
        job = self._jobs.pop(rid, None)
        self.metrics.inflight_requests.set(len(self._jobs))
        if job is None or job.future.done():
            return
        try:
            results = []
            for ex, pair in enumerate(job.pairs):
                idx = [i for i, w in enumerate(job.encoded.windows) if w.example_index == ex]
                rows = [job.logits[i] for i in idx]
                pred = decode_spans(
                    [job.encoded.windows[i] for i in idx],
                    [r[:, 0] for r in rows],  # type: ignore[index]
                    [r[:, 1] for r in rows],  # type: ignore[index]
                    pair.context,
                    top_k=pair.top_k,
                    max_answer_length=pair.max_answer_length,
                    null_threshold=self.null_threshold,
                )
                results.append(PairResult(pred, len(idx)))
        except Exception as err:
            logger.exception("decoding request %s failed", rid)
            job.future.set_exception(EngineError(500, "decode_failed", f"{type(err).__name__}: {err}"))
            return
        job.future.set_result(results)

    # ------------------------------------------------------------------ replica failures
    def _on_replica_failed(self, replica: Replica) -> None:
        """Called by the manager the moment a replica fails: retry its in-flight work elsewhere."""
        lost = [bid for bid, e in self._inflight.items() if e.replica is replica]
        batches = [self._inflight.pop(bid).dispatch for bid in lost]
        replica.inflight_batches = 0
        outcome = self.scheduler.replica_failed(replica.replica_id)
        self._apply_failure(outcome, batches)
        self.wake()

    def _apply_failure(self, outcome: Any, batches: list[Dispatch]) -> None:
        self.metrics.retried_windows.inc(outcome.retried_windows)
        for rid in outcome.failed:
            self._fail(rid, EngineError(503, "replica_failed", "the request failed on two replicas"))
        if outcome.retried_windows and not self.manager.routable():
            # nowhere to retry now: a clean 503 instead of waiting for a restart
            for rid in {rid for d in batches for rid, _ in d.items}:
                if rid in self._jobs:
                    self.scheduler.cancel(rid)
                    self._fail(
                        rid,
                        EngineError(
                            503, "replica_failed", "its replica failed and no other replica is available"
                        ),
                    )
