"""An API process's view of the engines in the core: the same calls the QA routes make of an ``Engine``
and of the ``ModelRepository``, answered over ``serving/engine/core_client.py``.

``RemoteEngine`` does here what needs no queue: the admission numbers before tokenizing
(``InputProcessor.admission``), tokenizing and windowing, span decoding (``decode_pairs``, large
requests on a decode thread) and the request's end in the metrics; the core does admission (one
queue for every API process), batching and the gangs. Its ``wait`` ends as ``Engine.wait`` does:
answers, ``ClientGone`` (the work cancelled in the core), or 504 past the deadline and the stall
timeout.

``RemoteRepository`` answers from the core's ``State`` digest (``CoreServer.digest``): which models
are served (``engine(name)``: the core's own 404 / 503), readiness, health. A model's engine exists
here once its tokenizer, saved by the core per generation, is loaded (off the event loop).

    repo = RemoteRepository(client=client, settings=settings, metrics=relay)
    await repo.apply(client.state)
    engine = repo.engine("b")                          # RemoteEngine, or EngineError 404 / 503
    job = await engine.submit_async(pairs); results = await engine.wait(job)

Tests: ``pytest tests/serving/engine/test_core_server.py``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from shardserve.models.qa_windows import EncodedBatch, WindowConfig
from shardserve.serving.engine import core_wire as cw
from shardserve.serving.engine.core import SAFETY_MARGIN_S
from shardserve.serving.engine.core_client import CoreClient, MetricsRelay
from shardserve.serving.engine.input_processor import InputProcessor
from shardserve.serving.engine.output_processor import DECODE_INLINE_MAX_WINDOWS, await_answer, decode_pairs
from shardserve.serving.engine.qa_types import EngineError, PairResult, QAPair
from shardserve.serving.fleet.repository import model_not_found

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemoteLimits:
    """The core's numbers an API process needs (from the same settings)."""

    window: WindowConfig
    context_cache_bytes: int
    null_threshold: float | None
    max_windows_per_request: int
    default_deadline_s: float
    stall_timeout_s: float


@dataclass(eq=False)
class RemoteJob:
    """One request submitted to the core."""

    request_id: str
    pairs: list[QAPair]
    encoded: EncodedBatch
    future: asyncio.Future  # the core's Answer, or an EngineError
    started: float  # time.perf_counter() at arrival
    give_up_at: float  # time.monotonic(): deadline + stall timeout + margin
    phases: dict[str, float] = field(default_factory=dict)


class RemoteEngine:
    """See module doc."""

    def __init__(
        self,
        *,
        name: str,
        generation: int,
        client: CoreClient,
        tokenizer: Any,
        limits: RemoteLimits,
        metrics: MetricsRelay,
    ) -> None:
        self.name, self.generation, self.client = name, generation, client  # generation: the core's
        self.limits, self.metrics = limits, metrics
        self.inputs = InputProcessor(
            tokenizer=lambda: tokenizer,
            window=limits.window,
            context_cache_bytes=limits.context_cache_bytes,
            on_lookups=functools.partial(metrics.context_cache, name),
        )
        self._decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardserve-decode")

    async def submit_async(self, pairs: list[QAPair], *, timeout_s: float | None = None) -> RemoteJob:
        """A queue place in the core, then the tokenized windows; EngineError as the core refuses."""
        started = time.perf_counter()
        ask = self.inputs.admission(pairs, above=self.limits.max_windows_per_request)
        rid = self.client.new_rid()
        await self.client.reserve(
            cw.Reserve(rid, self.name, ask.floor, ask.hint, ask.tokenize_wait_s, timeout_s)
        )
        try:
            encoded, input_s = await self.inputs.encode_async(pairs)
        except BaseException:
            self.client.cancel(rid)
            raise
        future = self.client.submit(cw.submit_of(rid, encoded, input_s=input_s))
        deadline_s = self.limits.default_deadline_s if timeout_s is None else timeout_s
        give_up_at = time.monotonic() + deadline_s + self.limits.stall_timeout_s + SAFETY_MARGIN_S
        return RemoteJob(rid, pairs, encoded, future, started, give_up_at, {"compute_input": input_s})

    async def wait(
        self, job: RemoteJob, *, disconnected: Callable[[], Awaitable[Any]] | None = None
    ) -> list[PairResult]:
        """The job's answers (``Engine.wait``'s contract, ``await_answer``); decoded here."""
        results: list[PairResult] | None = None
        try:
            answer: cw.Answer = await await_answer(  # raises the core's EngineError
                job.future,
                request_id=job.request_id,
                bound_s=max(0.0, job.give_up_at - time.monotonic()),
                disconnected=disconnected,
                cancel=lambda: self.client.cancel(job.request_id),
            )
            job.phases.update(queue=answer.queue_s, compute_infer=answer.infer_s)
            results = await self._decode(job, answer)
            return results
        finally:
            answered = None if results is None else len(job.pairs)
            seconds = time.perf_counter() - job.started
            self.metrics.record_end(self.name, answered=answered, seconds=seconds, phases=job.phases)

    async def _decode(self, job: RemoteJob, answer: cw.Answer) -> list[PairResult]:
        """Span decoding, on the decode thread for large requests (as ``OutputProcessor``)."""

        def decode() -> list[PairResult]:
            t0 = time.perf_counter()
            rows = cw.logits_of(answer)
            out = decode_pairs(job.encoded, rows, job.pairs, null_threshold=self.limits.null_threshold)
            job.phases["compute_output"] = time.perf_counter() - t0
            return out

        try:
            if len(job.encoded.windows) <= DECODE_INLINE_MAX_WINDOWS:
                return decode()
            return await asyncio.get_running_loop().run_in_executor(self._decoder, decode)
        except Exception as err:
            logger.exception("decoding request %s failed", job.request_id)
            raise EngineError(500, "decode_failed", f"{type(err).__name__}: {err}") from err

    def shutdown(self) -> None:
        self.inputs.shutdown()
        self._decoder.shutdown(wait=False, cancel_futures=True)


class RemoteRepository:
    """See module doc."""

    def __init__(self, *, client: CoreClient, limits: RemoteLimits, metrics: MetricsRelay) -> None:
        self.client, self.limits, self.metrics = client, limits, metrics
        self.digest: dict[str, Any] = {"models": {}, "ready": False, "health": {}, "fatal": None}
        self._engines: dict[str, tuple[str, RemoteEngine]] = {}  # name -> (tokenizer path, engine)

    async def apply(self, digest: dict[str, Any]) -> None:
        """Take the core's newest digest: engines for new models (or new tokenizers), none for gone ones."""
        for name, model in digest["models"].items():
            path = model["tokenizer"]
            if path is not None and self._engines.get(name, ("",))[0] != path:
                tokenizer = await asyncio.to_thread(_load_tokenizer, path)
                engine = RemoteEngine(
                    name=name,
                    generation=model["generation"],
                    client=self.client,
                    tokenizer=tokenizer,
                    limits=self.limits,
                    metrics=self.metrics,
                )
                self._engines[name] = (path, engine)
        for name in set(self._engines) - set(digest["models"]):
            self._engines.pop(name)[1].shutdown()
        self.digest = digest

    @property
    def default_name(self) -> str | None:
        return self.digest.get("default")

    def engine(self, name: str | None = None) -> RemoteEngine:
        """``ModelRepository.engine`` as the core answers it: 404 unknown, 503 not served now."""
        key = self.default_name if name is None else name
        models = self.digest["models"]
        if key not in models:
            raise model_not_found(name, served=list(models))
        if (error := models[key]["error"]) is not None:
            raise EngineError(*error)
        if key not in self._engines:  # its tokenizer is being loaded here
            raise EngineError(503, "model_unavailable", f"model {key!r} is not served now: loading")
        return self._engines[key][1]

    def engines(self) -> list[RemoteEngine]:
        return [engine for _, engine in self._engines.values()]

    def model_ready(self, name: str) -> bool:
        if name not in self.digest["models"]:
            raise model_not_found(name)
        return bool(self.digest["models"][name]["ready"])

    def ready(self) -> bool:
        return bool(self.digest["ready"])

    def health(self) -> dict[str, Any]:
        return dict(self.digest["health"])

    def fatal_error(self) -> str | None:
        return self.digest["fatal"]

    def shutdown(self) -> None:
        for _, engine in self._engines.values():
            engine.shutdown()


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
