"""The engine core's job table (vLLM's request states): logits collected per window, answers as logits.

Owns one ``Job`` per admitted request: its tokenized windows, the logits of each window as they
come back, and the future its client awaits. When the scheduler says a request completed,
``complete`` answers the future with a ``CoreAnswer`` (its windows' logits and the seconds of its
``queue`` and ``compute_infer`` phases); ``fail`` answers it with an ``EngineError``. Span decoding
is not here: the client that asked decodes (``serving/engine/output_processor.py``), in this process
or in an API process alike. It does NOT count in-flight work: ``Scheduler.ongoing`` does.

Times two phases of a request (``queue``: until its last window is dispatched; ``compute_infer``:
that dispatch until all its logits are back) and observes the queue wait in the metrics.

    jobs = JobTable(metrics=metrics)
    jobs.add(job)
    windows, pad_id = jobs.take_windows(dispatch.items, now=now)   # to build a micro-batch
    jobs.add_logits(dispatch.items, logits)                        # (B, S, 2), rows as items
    jobs.complete(rid)  /  jobs.fail(rid, EngineError(503, ...))
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import torch

from shardserve.models.qa_windows import EncodedBatch, QAWindow
from shardserve.serving.engine.qa_types import CoreAnswer, EngineError
from shardserve.serving.metrics import ModelMetrics

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Job:
    """One admitted request (one scheduler request, possibly several pairs and windows)."""

    request_id: str
    encoded: EncodedBatch
    future: asyncio.Future  # its CoreAnswer, or an EngineError
    submitted_at: float
    logits: list[torch.Tensor | None] = field(default_factory=list)  # per window: (n_tokens, 2)
    dispatched: int = 0  # windows handed to a gang (for the queue-wait metric)
    started: float = field(default_factory=time.perf_counter)  # arrival, before tokenizing (perf_counter)
    dispatched_pc: float = 0.0  # perf_counter when its last window was dispatched (compute_infer)
    phases: dict[str, float] = field(default_factory=dict)  # seconds of each phase so far (module doc)


class JobTable:
    """See module doc."""

    def __init__(self, *, metrics: ModelMetrics) -> None:
        self.metrics = metrics
        self._jobs: dict[str, Job] = {}

    def add(self, job: Job) -> None:
        self._jobs[job.request_id] = job

    def get(self, request_id: str) -> Job | None:
        return self._jobs.get(request_id)

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
        """All windows have logits: answer them (as the job's ``CoreAnswer``)."""
        job = self._jobs.pop(request_id, None)
        if job is None or job.future.done():
            return
        job.phases["compute_infer"] = time.perf_counter() - job.dispatched_pc
        logits = [r for r in job.logits if r is not None]
        job.future.set_result(CoreAnswer(logits, job.phases.get("queue", 0.0), job.phases["compute_infer"]))

    def fail(self, request_id: str, err: EngineError) -> None:
        """Answer a request with ``err`` (503 / 504 ...) and forget it."""
        job = self._jobs.pop(request_id, None)
        if job is not None and not job.future.done():
            job.future.set_exception(err)
