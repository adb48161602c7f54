"""A real uvicorn server for tests that need a socket (schemathesis, a browser): one helper, one place.

with live_server(build_app(settings), ready_timeout_s=30) as base:   # "http://127.0.0.1:PORT"
    httpx.get(f"{base}/readyz")
with draining_server(settings, factory) as (server, app, thread):    # the CLI's server, SIGTERM and all
    server.handle_exit(signal.SIGTERM, None)
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from shardserve.partitioner.runtime.fake_gang import FakeFactory
from shardserve.serving.frontend.app import build_app
from shardserve.serving.frontend.cli import DrainingServer
from shardserve.serving.frontend.http.protocol import uvicorn_config
from shardserve.serving.frontend.settings import ServeSettings
from tests.serving.frontend.api_helpers import wait_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_server(
    app: FastAPI,
    *,
    ready_timeout_s: float,
    join_timeout_s: float = 30.0,
    before_exit: Callable[[], object] | None = None,
    **config: Any,
) -> Iterator[str]:
    """uvicorn on 127.0.0.1 and a free port, in a thread; yields the base URL once /readyz is 200.

    ``before_exit`` runs before the server is told to stop (e.g. open a fake backend's gate so
    that no request holds the shutdown); ``config``: more ``uvicorn.Config`` settings (``http=``)."""
    # bound here and handed over: uvicorn binds only after the app's start-up (gangs, seconds of
    # ports being taken), so a port chosen free beforehand could be gone by then
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{base}/readyz").status_code == 200
        except httpx.TransportError:
            return False

    def detail() -> str:
        try:
            why = httpx.get(f"{base}/readyz").text
        except httpx.TransportError as err:
            why = f"/readyz unreachable ({err!r})"
        return f"{why} (server thread {'alive' if thread.is_alive() else 'ended'})"

    try:
        wait_until(ready, timeout=ready_timeout_s, what="a ready server", detail=detail)
        yield base
    finally:
        if before_exit is not None:
            before_exit()
        server.should_exit = True
        thread.join(timeout=join_timeout_s)
        sock.close()


@contextlib.contextmanager
def draining_server(
    settings: ServeSettings, factory: FakeFactory
) -> Iterator[tuple[DrainingServer, FastAPI, threading.Thread]]:
    """``shardserve serve``'s own server (``DrainingServer``, its signal handling) on fake gangs, in a
    thread; yields it, its app and its thread once a gang is ready, and stops it (gate opened) on exit."""
    app = build_app(settings, backend_factory=factory)
    server = DrainingServer(uvicorn_config(settings, app), app)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started and app.state.manager.ready == 1, what="a ready server")
        yield server, app, thread
    finally:
        factory.gate.set()
        server.should_exit = True
        thread.join(timeout=30)
