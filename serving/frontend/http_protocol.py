"""The server's HTTP/1.1 connection protocol: uvicorn's httptools protocol with a request-header deadline.

uvicorn arms no timer while a request's headers arrive: a client that opens a connection and sends
nothing, or half a header block ("slowloris"), held it for ever. Here a request's headers must arrive
within ``timeout_s`` of the connection opening, or of the previous answer on a kept-alive connection
(uvicorn's own keep-alive timer still closes idle connections sooner); else the server answers
``408`` and closes the connection. The body has its own deadline (``shardserve.serving.frontend.app.RequestGuard``).

    config = uvicorn.Config(app, http=header_deadline_protocol(30.0))
    config = uvicorn_config(settings, app)       # the server's: address, shutdown, this protocol

``uvicorn_config`` is every server process's uvicorn settings (the server, each ``--api-workers``
process).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # C parser: 0.35 ms/answer less than h11

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  # after --drain-timeout-s: time to write the 503s before uvicorn cancels requests


class _HeaderDeadlineHttpTools(HttpToolsProtocol):
    timeout_s: float = 30.0  # set by header_deadline_protocol
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._waiting_for_headers():
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
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
        access_log=False,  # serving/frontend/access.py writes one line per request (logger shardserve.access)
    )
