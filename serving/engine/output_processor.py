"""Output processing: per-request state, logits collected per window, span decoding, answers.

Owns the job table (vLLM's request states): one ``Job`` per admitted call, holding its pairs,
its tokenized windows, the logits of each window as they come back, and the future its HTTP
handler awaits. When the scheduler says a request completed, ``complete`` decodes every pair
(``decode_spans``; ``null_threshold`` decides no-answer) and resolves the future; ``fail`` resolves
it with an ``EngineError``. It does NOT count in-flight work: ``Scheduler.ongoing`` does.

Decoding is vectorised but not free: ~0.1-0.2 s for a 128-window request on a loaded 2-core CPU.
On the event loop that stalled every other request (and every 429) that long, so a request of more
than ``DECODE_INLINE_MAX_WINDOWS`` windows is decoded on the one decode thread (torch releases the
GIL; the loop keeps answering) and answered from there; small ones stay inline (no thread hop).
``decoding`` counts the requests on the decode thread (a drain waits for them). A ``remote`` job (an
API process's, ``serving/engine/core_server.py``) is answered with its windows' logits instead: its
API process decodes it (``decode_pairs``) and reports its end (``record_end``).

Times three phases of a request in ``Job.phases`` (``queue``: until its last window is dispatched;
``compute_infer``: that dispatch until all its logits are back; ``compute_output``: its span decoding;
the engine adds ``compute_input``), ``await_answer`` waits for a request's answer (or its client's
departure, or its bound), and ``observe_end`` (``record_end``) writes a request's outcome and
phases to the metrics when the engine is done with it (``serving/metrics.py``; Triton's statistics read them).

    outputs = OutputProcessor(metrics=metrics, null_threshold=None)
    outputs.add(job)
    windows, pad_id = outputs.take_windows(dispatch.items, now=now)   # to build a micro-batch
    outputs.add_logits(dispatch.items, logits)                        # (B, S, 2), rows as items
    outputs.complete(rid)  /  outputs.fail(rid, EngineError(503, ...))
    outputs.shutdown()
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from shardserve.models.qa_decoding import decode_spans
from shardserve.models.qa_windows import EncodedBatch, QAWindow
from shardserve.serving.engine.qa_types import ClientGone, EngineError, PairResult, QAPair
from shardserve.serving.metrics import ModelMetrics

logger = logging.getLogger(__name__)

DECODE_INLINE_MAX_WINDOWS = 8  # requests with more windows are decoded off the event loop


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
    dispatched: int = 0  # windows handed to a gang (for the queue-wait metric)
    started: float = field(default_factory=time.perf_counter)  # arrival, before tokenizing (perf_counter)
    dispatched_pc: float = 0.0  # perf_counter when its last window was dispatched (compute_infer)
    phases: dict[str, float] = field(default_factory=dict)  # seconds of each phase so far (module doc)
    remote: bool = False  # an API process decodes it: the future's result is ``logits`` (module doc)


class OutputProcessor:
    """The job table: collects logits, decodes answers, resolves futures (see module doc)."""

    def __init__(self, *, metrics: ModelMetrics, null_threshold: float | None = None) -> None:
        self.metrics = metrics
        self.null_threshold = null_threshold  # the server's default; None: the decoder's own
        self._jobs: dict[str, Job] = {}
        self._decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardserve-decode")
        self.decoding = 0  # requests being decoded on the decode thread (complete, not yet answered)

    def add(self, job: Job) -> None:
        self._jobs[job.request_id] = job

    def pop(self, request_id: str) -> Job | None:
        """Forget a job (cancelled); its future is left as it is."""
        return self._jobs.pop(request_id, None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._jobs

    def request_ids(self) -> list[str]:
        return list(self._jobs)

    def take_windows(self, items: list[tuple[str, int]], *, now: float) -> tuple[list[QAWindow], int]:
        """The windows of a micro-batch's ``(request_id, window_index)`` items and the pad id;
        observes the queue wait of requests whose last window leaves the queue."""
        windows = []
        for rid, idx in items:
            job = self._jobs[rid]
            windows.append(job.encoded.windows[idx])
            job.dispatched += 1
            if job.dispatched == len(job.encoded.windows):
                self.metrics.queue_wait.observe(now - job.submitted_at)
                job.dispatched_pc = time.perf_counter()
                job.phases["queue"] = now - job.submitted_at
        return windows, self._jobs[items[0][0]].encoded.pad_token_id

    def add_logits(self, items: list[tuple[str, int]], logits: torch.Tensor) -> None:
        """Keep each item's row of ``logits`` (B, S, 2), cut to its window's real tokens."""
        for i, (rid, idx) in enumerate(items):
            job = self._jobs.get(rid)
            if job is not None:  # else: cancelled / expired / failed meanwhile
                n = job.encoded.windows[idx].num_tokens
                job.logits[idx] = logits[i, :n]

    def complete(self, request_id: str) -> None:
        """All windows have logits: decode every pair and answer (500 if decoding fails); on the
        event loop, large requests on the decode thread (module doc)."""
        job = self._jobs.pop(request_id, None)
        if job is None or job.future.done():
            return
        job.phases["compute_infer"] = time.perf_counter() - job.dispatched_pc
        if job.remote:
            job.future.set_result(job.logits)
            return
        if len(job.encoded.windows) <= DECODE_INLINE_MAX_WINDOWS:
            self._resolve(job, lambda: self._decode_all(job))
            return
        self.decoding += 1
        decoded = asyncio.get_running_loop().run_in_executor(self._decoder, self._decode_all, job)
        decoded.add_done_callback(lambda f: self._decoded(job, f))

    def observe_end(self, job: Job, results: list[PairResult] | None) -> None:
        """A request's end in the metrics (``record_end``)."""
        answered = None if results is None else len(job.pairs)
        record_end(
            self.metrics, answered=answered, seconds=time.perf_counter() - job.started, phases=job.phases
        )

    def _decode_all(self, job: Job) -> list[PairResult]:
        t0 = time.perf_counter()
        results = decode_pairs(job.encoded, job.logits, job.pairs, null_threshold=self.null_threshold)
        job.phases["compute_output"] = time.perf_counter() - t0
        return results

    def _decoded(self, job: Job, decoded: asyncio.Future) -> None:
        """The decode thread finished ``job`` (on the event loop)."""
        self.decoding -= 1
        if not decoded.cancelled():  # cancelled: the server is shutting down
            self._resolve(job, decoded.result)

    def _resolve(self, job: Job, answers: Callable[[], list[PairResult]]) -> None:
        """Answer ``job`` with ``answers()``, or 500 when decoding failed."""
        try:
            results = answers()
        except Exception as err:
            logger.exception("decoding request %s failed", job.request_id)
            if not job.future.done():
                job.future.set_exception(EngineError(500, "decode_failed", f"{type(err).__name__}: {err}"))
            return
        if not job.future.done():  # the client may have gone meanwhile
            job.future.set_result(results)

    def shutdown(self) -> None:
        """Stop the decode thread (after a drain: nothing is left on it)."""
        self._decoder.shutdown(wait=False, cancel_futures=True)

    def fail(self, request_id: str, err: EngineError) -> None:
        """Answer a request with ``err`` (503 / 504 ...) and forget it."""
        job = self._jobs.pop(request_id, None)
        if job is not None and not job.future.done():
            job.future.set_exception(err)


def decode_pairs(
    encoded: EncodedBatch,
    logits: Sequence[torch.Tensor | None],
    pairs: Sequence[QAPair],
    *,
    null_threshold: float | None,
) -> list[PairResult]:
    """Span decoding of every pair over the logits of its windows (``logits[i]``: window ``i``'s
    ``(n_tokens, 2)``); ``null_threshold``: the server's default, a pair's own wins."""
    by_pair: list[list[int]] = [[] for _ in pairs]
    for i, w in enumerate(encoded.windows):
        by_pair[w.example_index].append(i)
    results = []
    for pair, idx in zip(pairs, by_pair, strict=True):
        rows = [logits[i] for i in idx]
        prediction = decode_spans(
            [encoded.windows[i] for i in idx],
            [r[:, 0] for r in rows],  # type: ignore[index]
            [r[:, 1] for r in rows],  # type: ignore[index]
            pair.context,
            top_k=pair.top_k,
            max_answer_length=pair.max_answer_length,
            null_threshold=null_threshold if pair.null_threshold is None else pair.null_threshold,
        )
        results.append(PairResult(prediction, len(idx)))
    return results


def record_end(
    metrics: ModelMetrics, *, answered: int | None, seconds: float, phases: dict[str, float]
) -> None:
    """A request's end in the metrics (``answered``: its pairs, None when it failed, however): its
    outcome and time since arrival; answered, its pairs as inferences and each of its phases (Triton's
    statistics: every phase counts the same requests). API processes' requests end here too, in the
    core (``serving/engine/core_server.py``)."""
    outcome = "fail" if answered is None else "success"
    metrics.request_duration.labels(outcome=outcome).observe(seconds)
    if answered is not None:
        metrics.inferences.inc(answered)
        for phase, s in phases.items():
            metrics.request_phase.labels(phase=phase).observe(s)
    metrics.last_inference.set_to_current_time()


async def await_answer(
    future: asyncio.Future,
    *,
    request_id: str,
    bound_s: float,
    disconnected: Callable[[], Awaitable[Any]] | None,
    cancel: Callable[[], None],
) -> Any:
    """``future``'s result (its exception raised), else ``cancel()`` the request's work and raise:
    ClientGone when ``disconnected`` fires first, EngineError 504 after ``bound_s``, the caller's own
    cancellation (a gRPC client that went away). ``Engine.wait`` and an API process's
    ``RemoteEngine.wait`` (``serving/engine/remote_engine.py``) both wait this way."""
    watch = asyncio.ensure_future(disconnected()) if disconnected is not None else None
    try:
        waiting = {future} if watch is None else {future, watch}
        done, _ = await asyncio.wait(waiting, timeout=bound_s, return_when=asyncio.FIRST_COMPLETED)
        if future in done:
            return future.result()
        cancel()
        if watch is not None and watch in done:
            raise ClientGone(request_id)
        logger.error("request %s not answered %.1f s past its deadline", request_id, bound_s)
        raise EngineError(504, "deadline_exceeded", f"not answered within {bound_s:.1f} s")
    except asyncio.CancelledError:
        cancel()
        raise
    finally:
        if watch is not None and not watch.done():
            watch.cancel()
        if not future.done():
            future.cancel()
