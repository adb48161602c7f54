"""The one request path of a QA call (vLLM v1's shape): input processor -> engine core -> output processor.

``EngineClient`` (vLLM's AsyncLLM) is the front end's way to one model, the same class in
the server's own process and in each ``--api-workers`` API process. ``submit_async`` asks the core
for a queue place BEFORE tokenizing (the admission numbers come from the text:
``InputProcessor.admission``; requests waiting for the tokenizer count against max_queue_size, so a
full server answers 429 at once and the work waiting for the tokenizer is bounded), tokenizes and
windows on the input processor's thread, and queues the windows. ``wait`` awaits the core's
``CoreAnswer`` (or the client's departure: its work cancelled, ``ClientGone``; or 504 past the
deadline + stall timeout + a margin), decodes it (``OutputProcessor``) and writes the request's end
in the metrics.

The core is reached through a ``CoreLink`` (vLLM's EngineCoreClient), in one of two ways:
``LocalCore`` calls the engines of this process (``Engine.reserve`` / ``admit_encoded`` /
``cancel``); ``CoreClient`` (``serving/engine/core_client.py``) sends the same three calls over
ZeroMQ to the core process, where ``CoreServer`` answers them with a ``LocalCore`` of its own.
``LocalClients`` keeps this process's ``EngineClient`` per served model; an API process's are its
``RemoteRepository``'s (``serving/engine/remote_engine.py``).

    clients = LocalClients(models, limits=ClientLimits(...))
    qa = clients.client("b")                                  # EngineError 404 / 503
    request = await qa.submit_async([QAPair("Who?", "Ann met Bob.")])  # EngineError 429 / 413 / 503
    results = await qa.wait(request, disconnected=watch)      # list[PairResult]; 504, ClientGone

Tests: ``pytest tests/serving/engine/test_engine.py tests/serving/engine/test_core_server.py``.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from shardserve.models.qa_windows import EncodedBatch, WindowConfig
from shardserve.serving.engine.core import Engine, Ticket
from shardserve.serving.engine.input_processor import AdmissionAsk, InputProcessor, record_context_cache
from shardserve.serving.engine.jobs import Job
from shardserve.serving.engine.output_processor import EndRecorder, OutputProcessor, await_answer, record_end
from shardserve.serving.engine.qa_types import CoreAnswer, EngineError, PairResult, QAPair

logger = logging.getLogger(__name__)

SAFETY_MARGIN_S = 5.0  # wait() gives up this long after deadline + stall timeout (a last resort)


@dataclass(frozen=True)
class ClientLimits:
    """The server's numbers a client needs (one set for every model: the serve settings)."""

    window: WindowConfig
    context_cache_bytes: int
    null_threshold: float | None
    max_windows_per_request: int
    default_deadline_s: float
    stall_timeout_s: float


class CoreLink(Protocol):
    """The three calls of the engine core a request makes (module doc)."""

    def new_rid(self) -> str: ...

    async def reserve(self, rid: str, model: str, ask: AdmissionAsk, *, timeout_s: float | None) -> None:
        """A queue place for ``rid`` (EngineError 429 / 413 / 422 / 503 / 404 as the core refuses)."""

    def submit(self, rid: str, encoded: EncodedBatch, *, input_s: float) -> asyncio.Future:
        """Queue a reserved request's windows; the future: its ``CoreAnswer``, or an EngineError."""

    def cancel(self, rid: str) -> Any:
        """Give ``rid``'s place back, or drop its queued work (no answer comes)."""


@dataclass(eq=False)
class Request:
    """One request submitted to the core."""

    request_id: str
    pairs: list[QAPair]
    encoded: EncodedBatch
    future: asyncio.Future  # the core's CoreAnswer, or an EngineError
    started: float  # time.perf_counter() at arrival
    give_up_at: float  # time.monotonic(): deadline + stall timeout + margin
    phases: dict[str, float]


class EngineClient:
    """The client of one model: the front end's only way to the engine core (module doc)."""

    def __init__(
        self,
        *,
        name: str,
        core: CoreLink,
        tokenizer: Callable[[], Any],
        limits: ClientLimits,
        on_end: EndRecorder,
        on_lookups: Callable[[int, int], None] | None = None,
    ) -> None:
        self.name, self.core, self.limits = name, core, limits
        self.inputs = InputProcessor(
            tokenizer=tokenizer,
            window=limits.window,
            context_cache_bytes=limits.context_cache_bytes,
            on_lookups=on_lookups,
        )
        self.outputs = OutputProcessor(null_threshold=limits.null_threshold, on_end=on_end)

    async def submit_async(self, pairs: list[QAPair], *, timeout_s: float | None = None) -> Request:
        """A queue place, then the tokenized windows queued; EngineError as the core refuses,
        ``QAInputError`` / ``ValueError`` for text the tokenizer refuses."""
        started = time.perf_counter()
        ask = self.inputs.admission(pairs, above=self.limits.max_windows_per_request)
        rid = self.core.new_rid()
        await self.core.reserve(rid, self.name, ask, timeout_s=timeout_s)
        try:
            encoded, input_s = await self.inputs.encode_async(pairs)
        except BaseException:  # the tokenizer refused the text, or the client went away
            self.core.cancel(rid)
            raise
        future = self.core.submit(rid, encoded, input_s=input_s)
        deadline_s = self.limits.default_deadline_s if timeout_s is None else timeout_s
        give_up_at = time.monotonic() + deadline_s + self.limits.stall_timeout_s + SAFETY_MARGIN_S
        return Request(rid, list(pairs), encoded, future, started, give_up_at, {"compute_input": input_s})

    async def wait(
        self, request: Request, *, disconnected: Callable[[], Awaitable[Any]] | None = None
    ) -> list[PairResult]:
        """The request's answers; EngineError (503 / 504 / 500), ClientGone when ``disconnected``
        fires first (its work cancelled in the core). Its end goes to the metrics either way."""
        results: list[PairResult] | None = None
        try:
            answer: CoreAnswer = await await_answer(
                request.future,
                request_id=request.request_id,
                bound_s=max(0.0, request.give_up_at - time.monotonic()),
                disconnected=disconnected,
                cancel=lambda: self.core.cancel(request.request_id),
            )
            request.phases.update(queue=answer.queue_s, compute_infer=answer.infer_s)
            results = await self.outputs.decode(
                request.request_id, request.encoded, answer.logits, request.pairs, request.phases
            )
            return results
        finally:
            answered = None if results is None else len(request.pairs)
            self.outputs.end(answered=answered, started=request.started, phases=request.phases)

    def shutdown(self) -> None:
        self.inputs.shutdown()
        self.outputs.shutdown()


class LocalCore:
    """The ``CoreLink`` to the engines of this process; the core process's ``CoreServer`` answers
    API processes with one too. ``engine_of(model)``: the engine serving a model (EngineError 404 /
    503: ``ModelRepository.engine``)."""

    def __init__(self, engine_of: Callable[[str], Engine]) -> None:
        self.engine_of = engine_of
        self._reserved: dict[str, tuple[Engine, Ticket]] = {}
        self._jobs: dict[str, tuple[Engine, Job]] = {}
        self._ids = itertools.count(1)

    def new_rid(self) -> str:
        return f"req-{next(self._ids)}"

    def reserve_now(self, rid: str, model: str, ask: AdmissionAsk, *, timeout_s: float | None) -> None:
        """``reserve``, on the event-loop thread without awaiting (EngineError as the engine refuses)."""
        engine = self.engine_of(model)
        ticket = engine.reserve(ask, timeout_s=timeout_s, started=time.perf_counter())
        self._reserved[rid] = (engine, ticket)

    async def reserve(self, rid: str, model: str, ask: AdmissionAsk, *, timeout_s: float | None) -> None:
        self.reserve_now(rid, model, ask, timeout_s=timeout_s)

    def admit(self, rid: str, encoded: EncodedBatch, *, input_s: float) -> Job | None:
        """Queue a reserved request's windows: its job, None when it was cancelled meanwhile;
        EngineError as the engine refuses (its place given back)."""
        reserved = self._reserved.pop(rid, None)
        if reserved is None:
            return None
        engine, ticket = reserved
        job = engine.admit_encoded(ticket, encoded, input_s=input_s, request_id=rid)
        self._jobs[rid] = (engine, job)
        job.future.add_done_callback(lambda _, rid=rid: self._jobs.pop(rid, None))
        return job

    def submit(self, rid: str, encoded: EncodedBatch, *, input_s: float) -> asyncio.Future:
        try:
            job = self.admit(rid, encoded, input_s=input_s)
        except EngineError as err:
            refused = asyncio.get_running_loop().create_future()
            refused.set_exception(err)
            return refused
        if job is None:  # cancelled meanwhile: nobody waits for it
            gone = asyncio.get_running_loop().create_future()
            gone.cancel()
            return gone
        return job.future

    def cancel(self, rid: str) -> tuple[Engine, Job] | None:
        """Give ``rid``'s place back, or drop its queued work; the (engine, job) of an admitted
        request, else None."""
        if (reserved := self._reserved.pop(rid, None)) is not None:
            reserved[0].unreserve(reserved[1])
            return None
        if (job_of := self._jobs.pop(rid, None)) is not None:
            job_of[0].cancel(rid)
            job_of[1].future.cancel()
        return job_of


class EngineSource(Protocol):
    """The served models' engines (``ModelRepository``)."""

    @property
    def default_name(self) -> str | None: ...

    def engine(self, name: str | None = None) -> Engine: ...


class LocalClients:
    """This process's ``EngineClient`` per served model, over one ``LocalCore`` (module doc)."""

    def __init__(self, models: EngineSource, *, limits: ClientLimits) -> None:
        self.models, self.limits = models, limits
        self.core = LocalCore(models.engine)
        self._clients: dict[str, tuple[Engine, EngineClient]] = {}

    @property
    def default_name(self) -> str | None:
        return self.models.default_name

    def client(self, name: str | None = None) -> EngineClient:
        """The client of ``name``'s engine (None: the default model); EngineError 404 / 503."""
        engine = self.models.engine(name)
        held = self._clients.get(engine.name)
        if held is not None and held[0] is engine:
            return held[1]
        if held is not None:  # the model was unloaded and loaded again: a new engine
            held[1].shutdown()
        qa = EngineClient(
            name=engine.name,
            core=self.core,
            tokenizer=lambda: engine.manager.model.tokenizer,  # a reload swaps it
            limits=self.limits,
            on_end=functools.partial(record_end, engine.metrics),
            on_lookups=functools.partial(record_context_cache, engine.metrics),
        )
        self._clients[engine.name] = (engine, qa)
        return qa

    def shutdown(self) -> None:
        for _, qa in self._clients.values():
            qa.shutdown()
