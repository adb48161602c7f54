"""The API role of the server's app (``shardserve serve --api-workers N``): what an API process's app has
instead of models and gangs (``build_app(settings, core=link)``; ``serving/frontend/api_workers.py``
starts the processes, each on its own ``SO_REUSEPORT`` socket of the server's port).

``api_lifespan`` replaces the core's lifespan: no models, no gangs, a link to the core. The app's
repository is a ``RemoteRepository`` and its metrics a ``MetricsRelay``
(``serving/engine/remote_engine.py``, ``serving/engine/core_client.py``), so every QA route of every
protocol runs unchanged (gRPC too: ``serving/frontend/grpc/forward.py``).
``ForwardToCore`` sends the routes off the hot path (admin, /metrics, the status JSON, /v1/models,
Triton's statistics, config and repository) whole to the core, which answers them in its app: auth,
counts and the status have one home. The core's ``State`` says when the server stops (readiness 503,
new QA 503); a core that is gone stops this process.

    app = build_app(settings, core=CoreLink(endpoint, key, "w0.0", parent_pid=os.getppid()))
    sock = reuseport_socket("0.0.0.0", 8000, listen=True)

Tests: ``pytest tests/serving/engine/test_core_server.py tests/serving/frontend/test_api_workers.py``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import FastAPI

from shardserve.serving.engine import core_wire as cw
from shardserve.serving.engine.core_client import CoreClient
from shardserve.serving.engine.remote_engine import RemoteRepository
from shardserve.serving.frontend.qa_call import client_limits

logger = logging.getLogger(__name__)

# the paths the core answers (everything else runs here); versions as Triton spells them
FORWARDED = re.compile(
    r"/metrics|/admin/.*|/ui/status|/v1/models|/v2/repository/.*|/v2/models/stats"
    r"|/v2/models/[^/]+(/versions/[^/]+)?/(stats|config)"
)


@dataclass(frozen=True)
class CoreLink:
    """How an API process reaches its core."""

    endpoint: str  # ipc://
    key: bytes  # the wire key (HMAC), never on a command line or in the environment
    identity: str  # w<index>.<incarnation>
    parent_pid: int | None  # None: not watched (tests run both ends in one process)
    grpc_address: str | None = None  # the core's gRPC (``--grpc-port``): its RPCs forwarded there


@asynccontextmanager
async def api_lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Connect to the core, take its first ``State``, serve; the repository follows each new ``State``."""
    settings, link = app.state.settings, app.state.core_link
    limits = client_limits(settings)
    newest = asyncio.Event()

    def on_state(digest: dict[str, Any]) -> None:
        if digest.get("stopping"):
            app.state.shutting_down = True
        newest.set()

    def on_core_lost() -> None:
        app.state.shutting_down = True
        os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful stop: the answers in flight go out as 503

    client = CoreClient(
        endpoint=link.endpoint,
        key=link.key,
        identity=link.identity,
        parent_pid=link.parent_pid,
        on_state=on_state,
        on_core_lost=on_core_lost,
    )
    app.state.metrics.client = app.state.core_client = client
    repo = RemoteRepository(client=client, limits=limits, metrics=app.state.metrics)
    await client.start()
    assert client.state is not None
    await repo.apply(client.state)
    app.state.models = app.state.clients = repo

    async def follow() -> None:
        while True:
            await newest.wait()
            newest.clear()
            if client.state is not None:
                await repo.apply(client.state)

    following = asyncio.get_running_loop().create_task(follow())
    grpc_front = None
    try:
        if settings.grpc_port is not None and link.grpc_address is not None:
            from shardserve.serving.frontend.grpc.server import GrpcFront

            grpc_front = await GrpcFront.start(
                app, host=settings.host, port=settings.grpc_port, core_address=link.grpc_address
            )
            app.state.grpc_port = grpc_front.port
        yield
    finally:
        app.state.shutting_down = True
        if grpc_front is not None:  # the core drained the admitted calls before it stopped this process
            await grpc_front.stop(grace_s=settings.drain_timeout_s)
        following.cancel()
        await client.stop()
        repo.shutdown()


class ForwardToCore:
    """Send the requests of ``FORWARDED`` paths to the core whole (module doc); inside the access log
    and the body guard, so both run once, here."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not FORWARDED.fullmatch(scope["path"]):
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        rid = scope.get("state", {}).get("request_id", "")
        headers = [
            [k.decode("latin-1"), v.decode("latin-1")] for k, v in scope["headers"] if k != b"x-request-id"
        ]
        if rid:
            headers.append(["x-request-id", rid])
        state = scope["app"].state
        call = cw.HttpCall(
            cid=state.core_client.new_cid(),
            method=scope["method"],
            path=scope["path"],
            query=scope.get("query_string", b"").decode("latin-1"),
            headers=headers,
            client=list(scope["client"]) if scope.get("client") else None,
            body=np.frombuffer(b"".join(chunks), dtype=np.uint8),
        )
        reply = await state.core_client.http(call)
        await send(
            {
                "type": "http.response.start",
                "status": reply.status,
                "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers],
            }
        )
        await send({"type": "http.response.body", "body": reply.body.tobytes()})


def reuseport_socket(host: str, port: int, *, listen: bool) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT`` (listening if ``listen``)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    if listen:
        sock.listen(2048)
        sock.setblocking(False)
    return sock
