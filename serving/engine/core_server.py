"""The engine core's end of ``--api-workers``: API processes' requests to this process's engines.

One ZeroMQ ROUTER on ``ipc://`` in a private (0700) directory, read by one task on the server's
event loop (the engines' loop: no locks). Each API process is a DEALER whose identity names it
(``w<index>.<incarnation>``); its request ids start with that identity, so a dead process's requests
are found and given back (``forget_worker``). Messages travel in bundles (``wire.encode_many``):
what is sent to one API process in one event-loop turn goes out as one signed send, at the turn's
end. What it does for each message (``core_wire.py``):

- ``Reserve``, ``Submit``, ``Cancel``: the ``CoreLink`` calls, answered by a ``LocalCore``
  (``serving/engine/client.py``), as the server's own process answers its own requests:
  ``Reserve`` (429 / 413 / 503 / 404 before tokenizing) -> ``Reserved`` / ``Failed``; ``Submit``:
  the windows queued, the job's future (its ``CoreAnswer``, or an ``EngineError``) becomes
  ``Answer`` / ``Failed``, sent from a done-callback (no task per request); ``Cancel``: the place or
  the queued request given back;
- ``HttpCall``: the request runs through the core's own app (``call_asgi``; auth, admin, metrics,
  status and the repository have one home) -> ``HttpReply``;
- ``Observed``: the API processes' metric events into the one registry (``ServingMetrics``);
- ``State``: what the repository serves (``digest``), to every API process on change, at least every
  ``STATE_EVERY_S`` (the API processes' sign that the core lives), and to a new one at ``Hello``. Each
  model's tokenizer is saved once per generation in the directory, for the API processes to load.

    core = CoreServer(models=repo, metrics=metrics, app=app, stopping=lambda: app.state.shutting_down)
    await core.start(); core.endpoint, core.key     # for the API processes
    core.forget_worker("w1.0"); await core.stop()

Tests: ``pytest tests/serving/engine/test_core_server.py``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from shardserve.partitioner.runtime.wire import WireError, decode_many, encode_many, new_key
from shardserve.serving.engine import core_wire as cw
from shardserve.serving.engine.client import LocalCore
from shardserve.serving.engine.core import Engine
from shardserve.serving.engine.input_processor import AdmissionAsk, record_context_cache
from shardserve.serving.engine.output_processor import record_end
from shardserve.serving.engine.qa_types import EngineError
from shardserve.serving.fleet.repository import ModelRepository
from shardserve.serving.metrics import ServingMetrics

logger = logging.getLogger(__name__)

STATE_POLL_S = 0.05  # the digest is compared this often
STATE_EVERY_S = 1.0  # and sent at least this often (the API processes' heartbeat of the core)


class CoreServer:
    """See module doc."""

    def __init__(
        self, *, models: ModelRepository, metrics: ServingMetrics, app: Any, stopping: Callable[[], bool]
    ) -> None:
        self.models, self.metrics, self.app, self.stopping = models, metrics, app, stopping
        self.key = new_key()
        self.directory = Path(tempfile.mkdtemp(prefix="shardserve-core-"))  # 0700: this user only
        self.endpoint = f"ipc://{self.directory / 'core'}"
        self.grpc_address = f"unix:{self.directory / 'grpc'}"  # the core's gRPC, for its API processes
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._workers: dict[bytes, set[str]] = {}  # identity -> its open request ids
        self.core = LocalCore(models.engine)
        self._tokenizers: dict[tuple[str, int], str] = {}  # (model, generation) -> saved directory
        self._digest: dict[str, Any] | None = None
        self._tasks: set[asyncio.Task] = set()
        self._outbox: dict[bytes, list[Any]] = {}  # identity -> messages of this loop turn

    async def start(self) -> None:
        self._sock.bind(self.endpoint)
        loop = asyncio.get_running_loop()
        for coro in (self._read(), self._publish()):
            self._spawn(loop, coro)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._sock.close()
        self._ctx.term()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _spawn(self, loop: asyncio.AbstractEventLoop, coro: Any) -> None:
        task = loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ API processes
    @property
    def workers(self) -> list[str]:
        return [w.decode() for w in self._workers]

    def forget_worker(self, identity: str) -> int:
        """An API process died: give back its places, drop its queued work (its requests end as
        ``fail`` in the metrics); other processes' requests are untouched. Returns how many."""
        rids = self._workers.pop(identity.encode(), set())
        for rid in rids:
            if (dropped := self.core.cancel(rid)) is not None:  # admitted: it ends failed
                engine, job = dropped
                record_end(
                    engine.metrics, answered=None, seconds=time.perf_counter() - job.started, phases={}
                )
        if rids:
            logger.warning("API process %s gone: %d of its requests dropped", identity, len(rids))
        return len(rids)

    def _send(self, identity: bytes, msg: Any) -> None:
        """Queue ``msg`` for ``identity``: this loop turn's messages to it leave as one bundle."""
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.setdefault(identity, []).append(msg)

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, {}
        for identity, msgs in outbox.items():
            try:
                sent = self._sock.send_multipart([identity, *encode_many(msgs, self.key)], flags=zmq.NOBLOCK)
            except zmq.ZMQError as err:  # the socket is closed: stopping
                logger.debug("to %s: %d message(s) not sent: %s", identity, len(msgs), err)
                continue
            # a future, done unless earlier sends wait: a refused send's error is set on it, not raised
            sent.add_done_callback(functools.partial(_not_sent, identity, len(msgs)))

    def _fail(self, identity: bytes, rid: str, err: EngineError) -> None:
        self._workers.get(identity, set()).discard(rid)
        self._send(identity, cw.Failed(rid, err.status, err.code, err.detail, err.retry_after_s))

    # ------------------------------------------------------------------ reading
    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=True)
            identity, body = frames[0], frames[1:]
            try:
                msgs = decode_many(body, self.key)
            except WireError as err:
                logger.warning("dropped a message that is not an API process's: %s", err)
                continue
            for msg in msgs:
                try:
                    self._on(identity, msg)
                except Exception:  # a bug must not stop the reader (and every API process with it)
                    logger.exception("core: handling %s failed", type(msg).__name__)

    def _on(self, identity: bytes, msg: Any) -> None:
        if isinstance(msg, cw.Reserve):
            self._on_reserve(identity, msg)
        elif isinstance(msg, cw.Submit):
            self._on_submit(identity, msg)
        elif isinstance(msg, cw.Cancel):
            self._on_cancel(identity, msg.rid)
        elif isinstance(msg, cw.Observed):
            self._on_observed(msg.events)
        elif isinstance(msg, cw.HttpCall):
            self._spawn(asyncio.get_running_loop(), self._on_http(identity, msg))
        elif isinstance(msg, cw.Hello):
            self._workers.setdefault(identity, set())
            logger.info("API process %s (pid %d) connected", identity.decode(), msg.pid)
            if self._digest is not None:
                self._send(identity, cw.State(self._digest))

    def _on_reserve(self, identity: bytes, msg: cw.Reserve) -> None:
        self._workers.setdefault(identity, set()).add(msg.rid)
        try:
            ask = AdmissionAsk(msg.floor, msg.hint, msg.tokenize_wait_s)
            self.core.reserve_now(msg.rid, msg.model, ask, timeout_s=msg.timeout_s)
        except EngineError as err:
            self._fail(identity, msg.rid, err)
            return
        self._send(identity, cw.Reserved(msg.rid))

    def _on_submit(self, identity: bytes, msg: cw.Submit) -> None:
        try:
            encoded = cw.encoded_of(msg)
        except ValueError as err:
            self.core.cancel(msg.rid)
            self._fail(identity, msg.rid, EngineError(400, "invalid_windows", str(err)))
            return
        try:
            job = self.core.admit(msg.rid, encoded, input_s=msg.input_s)
        except EngineError as err:
            self._fail(identity, msg.rid, err)
            return
        if job is not None:  # else: cancelled meanwhile
            job.future.add_done_callback(lambda fut, rid=msg.rid: self._done(identity, rid, fut))

    def _done(self, identity: bytes, rid: str, fut: asyncio.Future) -> None:
        if fut.cancelled():
            return  # cancelled by its API process, or the process is gone
        err = fut.exception()
        if err is None:
            self._workers.get(identity, set()).discard(rid)
            self._send(identity, cw.answer_of(rid, fut.result()))
        elif isinstance(err, EngineError):
            self._fail(identity, rid, err)
        else:
            self._fail(identity, rid, EngineError(500, "internal", f"{type(err).__name__}: {err}"))

    def _on_cancel(self, identity: bytes, rid: str) -> None:
        self._workers.get(identity, set()).discard(rid)
        self.core.cancel(rid)

    def _on_observed(self, events: list[list[Any]]) -> None:
        served = self.models.entries
        for kind, model, *rest in events:
            if kind == "request":
                endpoint, status, seconds = rest
                self.metrics.count_request(model=model, endpoint=endpoint, status=status, seconds=seconds)
            elif kind == "end" and model in served:  # an unloaded model's series are gone
                answered, seconds, phases = rest
                record_end(self.metrics.for_model(model), answered=answered, seconds=seconds, phases=phases)
            elif kind == "cache" and model in served:
                record_context_cache(self.metrics.for_model(model), *rest)

    async def _on_http(self, identity: bytes, msg: cw.HttpCall) -> None:
        status, headers, body = await call_asgi(self.app, msg)
        self._send(identity, cw.HttpReply(msg.cid, status, headers, np.frombuffer(body, dtype=np.uint8)))

    # ------------------------------------------------------------------ the state
    async def _publish(self) -> None:
        sent_at = 0.0
        while True:
            digest = await self.digest()
            now = time.monotonic()
            if digest != self._digest or now - sent_at >= STATE_EVERY_S:
                self._digest, sent_at = digest, now
                for identity in list(self._workers):
                    self._send(identity, cw.State(digest))
            await asyncio.sleep(STATE_POLL_S)

    async def digest(self) -> dict[str, Any]:
        """The repository as API processes see it: each model's ``engine()`` outcome (an error as
        ``[status, code, detail]``), readiness and saved tokenizer; the server's readiness, health,
        fatal error, whether it stops. A model appears once its tokenizer is saved."""
        m = self.models
        models: dict[str, Any] = {}
        for name in list(m.entries):
            try:
                engine, error = m.engine(name), None
            except EngineError as err:
                engine, error = None, [err.status, err.code, err.detail]
            tokenizer = None if engine is None else await self._tokenizer(engine)
            generation = None if engine is None else engine.generation
            models[name] = {
                "error": error,
                "ready": m.model_ready(name),
                "tokenizer": tokenizer,
                "generation": generation,
            }
        return {
            "default": m.default_name,
            "ready": m.ready(),
            "health": m.health(),
            "fatal": m.fatal_error(),
            "stopping": self.stopping(),
            "models": models,
        }

    async def _tokenizer(self, engine: Engine) -> str:
        key = (engine.name, engine.model.generation)
        if (path := self._tokenizers.get(key)) is None:
            path = str(self.directory / f"tokenizer-{len(self._tokenizers)}")
            await asyncio.to_thread(engine.model.tokenizer.save_pretrained, path)
            self._tokenizers[key] = path
        return path


def _not_sent(identity: bytes, n: int, sent: asyncio.Future) -> None:
    if not sent.cancelled() and (err := sent.exception()) is not None:
        # gone (ROUTER_MANDATORY) or full: its pool forgets it, or its calls time out there
        logger.debug("to %s: %d message(s) not sent: %s", identity, n, err)


async def call_asgi(app: Any, msg: cw.HttpCall) -> tuple[int, list[list[str]], bytes]:
    """Run one forwarded HTTP request through ``app`` in this process: (status, headers, body). The
    scope is marked ``shardserve.forwarded`` (the API process already wrote its access log line)."""
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in msg.headers]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": msg.method,
        "scheme": "http",
        "path": msg.path,
        "raw_path": msg.path.encode(),
        "query_string": msg.query.encode("latin-1"),
        "root_path": "",
        "headers": headers,
        "client": tuple(msg.client) if msg.client else None,
        "server": None,
        "shardserve.forwarded": True,
    }
    sent = False
    finished = asyncio.Event()
    reply: dict[str, Any] = {"status": 500, "headers": [], "body": []}

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": msg.body.tobytes(), "more_body": False}
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            reply["status"] = message["status"]
            reply["headers"] = [
                [k.decode("latin-1"), v.decode("latin-1")] for k, v in message.get("headers", [])
            ]
        elif message["type"] == "http.response.body":
            reply["body"].append(message.get("body", b""))
            if not message.get("more_body", False):
                finished.set()

    try:
        await app(scope, receive, send)
    except Exception:
        logger.exception("forwarded %s %s failed", msg.method, msg.path)
        body = b'{"error":"internal","detail":"the request failed in the server core"}'
        return 500, [["content-type", "application/json"]], body
    finally:
        finished.set()
    return reply["status"], reply["headers"], b"".join(reply["body"])
