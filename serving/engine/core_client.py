"""An API process's end of ``--api-workers``: its link to the engine core, and its metrics relay.

``CoreClient`` is one ZeroMQ DEALER (identity ``w<index>.<incarnation>``) on the core's ``ipc://``
socket (``serving/engine/core_server.py``), read by one task on the API process's event loop. Each
request id starts with the identity; a call is a future keyed by it: ``reserve`` (-> ``Reserved`` or
an ``EngineError``), ``submit`` (-> the ``Answer``'s ``CoreAnswer``), ``http`` (a whole forwarded HTTP request ->
``HttpReply``). What one event-loop turn sends leaves as one bundle (``wire.encode_many``) at the
turn's end; a bundle that cannot be sent fails its calls with 503. ``State`` messages update
``state`` and call ``on_state``; when none came for ``CORE_TIMEOUT_S`` (or this process's parent
changed) the core is gone: every open call fails 503 and ``on_core_lost`` runs (the API process
exits).

``MetricsRelay`` stands where the app's ``ServingMetrics`` stands in one process: it queues the
requests counted (``count_request``) and the ends of admitted requests (``record_end``) and sends
them to the core every ``FLUSH_S`` (before any forwarded call too: /metrics then counts all of this
process's requests).

    client = CoreClient(endpoint=..., key=..., identity="w1.0")
    await client.start()
    await client.reserve(rid, "b", ask, timeout_s=None)        # the CoreLink of serving/engine/client.py
    answer = await client.submit(rid, encoded, input_s=t)      # CoreAnswer, or EngineError
    reply = await client.http(HttpCall(...))

Tests: ``pytest tests/serving/engine/test_core_server.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from shardserve.models.qa_windows import EncodedBatch
from shardserve.partitioner.runtime.wire import WireError, decode_many, encode_many
from shardserve.serving.engine import core_wire as cw
from shardserve.serving.engine.input_processor import AdmissionAsk
from shardserve.serving.engine.qa_types import CoreAnswer, EngineError

logger = logging.getLogger(__name__)

CORE_TIMEOUT_S = 5.0  # no State from the core this long: it is gone (it sends one at least every 1 s)
FLUSH_S = 0.02  # metric events wait at most this long


class CoreLost(EngineError):
    def __init__(self) -> None:
        super().__init__(503, "core_lost", "the server's engine core stopped; retry shortly")


class CoreClient:
    """See module doc."""

    def __init__(
        self,
        *,
        endpoint: str,
        key: bytes,
        identity: str,
        parent_pid: int | None = None,
        on_state: Callable[[dict[str, Any]], Any] | None = None,
        on_core_lost: Callable[[], None] | None = None,
    ) -> None:
        self.endpoint, self.key, self.identity = endpoint, key, identity
        self.parent_pid = parent_pid
        self.on_state, self.on_core_lost = on_state, on_core_lost
        self.state: dict[str, Any] | None = None
        self.lost = False
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, identity.encode())
        self._sock.setsockopt(zmq.LINGER, 500)
        self._calls: dict[str | int, asyncio.Future] = {}
        self._seq = itertools.count(1)
        self._events: list[list[Any]] = []
        self._state_at = time.monotonic()
        self._first_state = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._outbox: list[Any] = []  # the messages of this loop turn

    async def start(self, *, timeout_s: float = 60.0) -> None:
        """Connect, say hello, wait for the core's first ``State``."""
        self._sock.connect(self.endpoint)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read()), loop.create_task(self._watch())]
        self._send(cw.Hello(os.getpid()))
        await asyncio.wait_for(self._first_state.wait(), timeout_s)

    async def stop(self) -> None:
        self.flush()
        self._send_outbox()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._sock.close()
        self._ctx.term()

    def new_rid(self) -> str:
        return f"{self.identity}-{next(self._seq)}"

    # ------------------------------------------------------------------ calls
    def _send(self, msg: Any) -> None:
        if self.lost:
            raise CoreLost()
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._send_outbox)
        self._outbox.append(msg)

    def _send_outbox(self) -> None:
        msgs, self._outbox = self._outbox, []
        if not msgs or self.lost:
            return
        try:
            sent = self._sock.send_multipart(encode_many(msgs, self.key), flags=zmq.NOBLOCK)
        except zmq.ZMQError as err:  # the socket is closed
            self._not_sent(msgs, err)
            return
        sent.add_done_callback(lambda fut: fut.cancelled() or self._not_sent(msgs, fut.exception()))

    def _not_sent(self, msgs: list[Any], err: BaseException | None) -> None:
        """A bundle the socket refused (its queue to the core full): its calls fail with 503."""
        if err is None:
            return
        logger.warning("%d message(s) not sent to the engine core: %s", len(msgs), err)
        for msg in msgs:
            fut = self._calls.pop(_call_key(msg), None)
            if fut is not None and not fut.done():
                fut.set_exception(
                    EngineError(503, "core_unreachable", f"the engine core is unreachable: {err}")
                )

    def _call(self, key: str | int, msg: Any) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._calls[key] = fut
        try:
            self._send(msg)
        except BaseException:
            self._calls.pop(key, None)
            raise
        return fut

    async def reserve(self, rid: str, model: str, ask: AdmissionAsk, *, timeout_s: float | None) -> None:
        """A queue place for ``rid``; EngineError as the core's engine refused it."""
        await self._call(rid, cw.Reserve(rid, model, ask.floor, ask.hint, ask.tokenize_wait_s, timeout_s))

    def submit(self, rid: str, encoded: EncodedBatch, *, input_s: float) -> asyncio.Future:
        """Queue a reserved request; the future: its ``CoreAnswer``, or an ``EngineError``."""
        return self._call(rid, cw.submit_of(rid, encoded, input_s=input_s))

    def cancel(self, rid: str) -> None:
        """Give ``rid``'s place or queued work back (no answer comes)."""
        self._calls.pop(rid, None)
        if not self.lost:
            self._send(cw.Cancel(rid))

    async def http(self, msg: cw.HttpCall) -> cw.HttpReply:
        self.flush()  # this process's counts reach the core before a /metrics it forwards
        return await self._call(msg.cid, msg)

    def new_cid(self) -> int:
        return next(self._seq)

    # ------------------------------------------------------------------ metrics
    def observe(self, event: list[Any]) -> None:
        self._events.append(event)

    def flush(self) -> None:
        if self._events and not self.lost:
            events, self._events = self._events, []
            self._send(cw.Observed(events))

    # ------------------------------------------------------------------ reading
    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=True)
            try:
                msgs = decode_many(frames, self.key)
            except WireError as err:
                logger.warning("dropped a message that is not the core's: %s", err)
                continue
            for msg in msgs:
                self._on(msg)

    def _on(self, msg: Any) -> None:
        if isinstance(msg, cw.State):
            self._state_at = time.monotonic()
            self.state = msg.digest
            if self.on_state is not None:
                self.on_state(msg.digest)
            self._first_state.set()
            return
        fut = self._calls.pop(_call_key(msg), None)
        if fut is None or fut.done():
            return  # cancelled meanwhile
        if isinstance(msg, cw.Failed):
            fut.set_exception(EngineError(msg.status, msg.code, msg.detail, retry_after_s=msg.retry_after_s))
        elif isinstance(msg, cw.Answer):
            fut.set_result(CoreAnswer(cw.logits_of(msg), msg.queue_s, msg.infer_s))
        else:
            fut.set_result(msg)

    async def _watch(self) -> None:
        """Flush metric events; notice a core that is gone (no State, or a new parent process)."""
        while True:
            await asyncio.sleep(FLUSH_S)
            self.flush()
            if not self._first_state.is_set():
                continue
            silent = time.monotonic() - self._state_at > CORE_TIMEOUT_S
            orphaned = self.parent_pid is not None and os.getppid() != self.parent_pid
            if silent or orphaned:
                logger.error(
                    "the engine core is gone (%s): stopping", "silent" if silent else "parent exited"
                )
                self.lost = True
                for fut in self._calls.values():
                    if not fut.done():
                        fut.set_exception(CoreLost())
                self._calls.clear()
                if self.on_core_lost is not None:
                    self.on_core_lost()
                return


def _call_key(msg: Any) -> str | int | None:
    """The call a message belongs to: an HTTP call's number, else its request id (None: no call)."""
    return msg.cid if isinstance(msg, cw.HttpCall | cw.HttpReply) else getattr(msg, "rid", None)


class MetricsRelay:
    """The API process's stand-in for ``ServingMetrics`` (module doc)."""

    def __init__(self, client: CoreClient) -> None:
        self.client = client

    def count_request(self, *, model: str, endpoint: str, status: int, seconds: float) -> None:
        self.client.observe(["request", model, endpoint, status, seconds])

    def record_end(
        self, model: str, *, answered: int | None, seconds: float, phases: dict[str, float]
    ) -> None:
        self.client.observe(["end", model, answered, seconds, phases])

    def context_cache(self, model: str, hits: int, misses: int) -> None:
        self.client.observe(["cache", model, hits, misses])
