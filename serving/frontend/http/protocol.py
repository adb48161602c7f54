"""The server's HTTP/1.1 connections: uvicorn's httptools protocol with a request-header deadline, and
a server whose stop drains the connections instead of cutting idle ones.

uvicorn arms no timer while a request's headers arrive: a client that opens a connection and sends
nothing, or half a header block ("slowloris"), held it for ever. Here a request's headers must arrive
within ``timeout_s`` of the connection opening, or of the previous answer on a kept-alive connection
(uvicorn's own keep-alive timer still closes idle connections sooner); else the server answers
``408`` and closes the connection. The body has its own deadline (``shardserve.serving.frontend.app.RequestGuard``).

A drain (``DrainingHttpServer``, the first SIGTERM) never closes a connection a request may be on:
uvicorn's own stop closes every connection that has no answer under way, racing a client that sends
its next request on it just then (a kept-alive connection of a closed-loop client: the request is
lost without an answer). Here the listener closes (new connections are refused), every answer from
then on carries ``Connection: close`` (a request arriving on a kept-alive connection gets its answer,
or the engine's 503 with ``Retry-After``, then the connection closes), and uvicorn's stop begins only
once no connection has a request under way, not even its first bytes, and each has been idle for
``DRAIN_IDLE_S`` since the drain began, or at the drain's deadline. What remains is HTTP/1.1's own
race: a client that sends on a connection idle that long at the very moment it closes.

    config = uvicorn.Config(app, http=header_deadline_protocol(30.0))
    config = uvicorn_config(settings, app)       # the server's: address, shutdown, this protocol
    server = DrainingHttpServer(config, drain_timeout_s=30.0)   # server.begin_drain(): signal-safe

``uvicorn_config`` is every server process's uvicorn settings (the server, each ``--api-workers``
process).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # C parser: 0.35 ms/answer less than h11

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  # after --drain-timeout-s: time to write the 503s before uvicorn cancels requests
DRAIN_IDLE_S = 1.0  # a drain closes a connection once it has been this long without a request


class _HeaderDeadlineHttpTools(HttpToolsProtocol):
    timeout_s: float = 30.0  # set by header_deadline_protocol
    _header_timer: asyncio.TimerHandle | None = None
    _partial = False  # a request's first bytes arrived, its headers are not complete yet
    _idle_since = 0.0  # time.monotonic() of the connection's last answer (or its opening)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._idle_since = time.monotonic()
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._partial = True

    def on_headers_complete(self) -> None:
        self._partial = False
        super().on_headers_complete()
        if getattr(self.server_state, "draining", False) and self.cycle is not None:
            self.cycle.keep_alive = False  # its answer says Connection: close

    def idle_since(self) -> float | None:
        """When the connection's last answer went out (or it opened); None while a request is on it."""
        return None if self._partial or not self._waiting_for_headers() else self._idle_since

    def shutdown(self) -> None:
        """uvicorn's stop: as uvicorn's, except that a request whose first bytes arrived is answered
        (with Connection: close) rather than cut off with its connection."""
        if self._partial:
            self.server_state.draining = True  # type: ignore[attr-defined]
            return
        super().shutdown()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._waiting_for_headers():
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._idle_since = time.monotonic()
        if self._waiting_for_headers():  # a pipelined request may have started already
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _waiting_for_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        if not self._waiting_for_headers() or self.transport.is_closing():
            return
        logger.info(
            "%s: no complete request headers within %.0f s: 408, connection closed",
            self.client,
            self.timeout_s,
        )
        body = json.dumps(
            {
                "error": "request_timeout",
                "detail": f"request headers not received within {self.timeout_s:g} s",
            }
        ).encode()
        self.transport.write(
            b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        self.transport.close()


def header_deadline_protocol(timeout_s: float) -> Any:
    """uvicorn's ``http=`` protocol class whose request headers must arrive within ``timeout_s``."""
    return type("HeaderDeadlineHttpToolsProtocol", (_HeaderDeadlineHttpTools,), {"timeout_s": timeout_s})


def uvicorn_config(settings: Any, app: Any) -> uvicorn.Config:
    """uvicorn's settings for the app: the address, the shutdown's time, httptools with header
    deadlines, uvloop where installed."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower(),
        # the engine answers what is left 503 once the drain's time is out; uvicorn cancels the
        # requests' tasks (a bare 500) only after a grace for writing those answers
        timeout_graceful_shutdown=settings.drain_timeout_s + SHUTDOWN_GRACE_S,
        lifespan="on",
        loop="auto",  # uvloop when installed (a dependency where it builds): less CPU per request
        http=header_deadline_protocol(settings.client_timeout_s),
        access_log=False,  # serving/frontend/http/access.py writes one line per request (logger shardserve.access)
    )


class DrainingHttpServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM (``begin_drain``) drains its HTTP connections before
    uvicorn's stop (the module doc); a second signal is uvicorn's own stop."""

    def __init__(self, config: uvicorn.Config, *, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.drain_timeout_s = drain_timeout_s
        self._drain_from: float | None = None  # time.monotonic() of the drain's start

    def begin_drain(self) -> None:
        """Drain, from the next tick on (signal-safe: only a time is set here)."""
        if self._drain_from is None:
            self._drain_from = time.monotonic()

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drain_from is None and self.started:
            self.begin_drain()
        else:
            super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self._drain_from is not None and not self.should_exit:
            self.should_exit = self._drained()
        return await super().on_tick(counter)

    def _drained(self) -> bool:
        """Close the listener and mark the connections on the drain's first tick; then whether every
        connection has been idle ``DRAIN_IDLE_S`` since the drain began (or its time is out)."""
        assert self._drain_from is not None
        state = self.server_state
        if not getattr(state, "draining", False):
            state.draining = True  # type: ignore[attr-defined]
            for server in getattr(self, "servers", []):
                server.close()  # new connections are refused; the open ones stay
            for conn in list(state.connections):
                cycle = getattr(conn, "cycle", None)
                if cycle is not None and not cycle.response_complete:
                    cycle.keep_alive = False  # the answer under way closes its connection
        now = time.monotonic()
        if now - self._drain_from >= self.drain_timeout_s:
            return True
        for conn in list(state.connections):
            since = conn.idle_since() if hasattr(conn, "idle_since") else self._drain_from
            if since is None or now - max(since, self._drain_from) < DRAIN_IDLE_S:
                return False
        return True
