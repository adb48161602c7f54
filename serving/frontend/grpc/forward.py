"""gRPC in an API process (``--api-workers N`` with ``--grpc-port``): Triton's service, its cold RPCs the core's.

Each API process serves ``inference.GRPCInferenceService`` on the gRPC port (``SO_REUSEPORT``: the
kernel spreads the clients' HTTP/2 connections over the processes) with the REST app's own service
(``serving/frontend/grpc/service.py``): health, metadata, configuration and ``ModelInfer`` run here,
on the ``RemoteRepository``. The RPCs that need the core's own state, ``ModelStatistics`` (the one
registry) and the repository's (``RepositoryIndex``, ``RepositoryModelLoad`` / ``Unload``, behind
the admin token the API processes do not hold), go whole to the core's gRPC server, which listens on
a unix socket in its private directory only; the caller's metadata (its key or token, its request
id) goes with them, and the core's status and details come back.

    add_forwarding_service(server, app, core_address="unix:/tmp/shardserve-core-x/grpc")

Tests: ``pytest tests/serving/engine/test_core_server.py``.
"""

from __future__ import annotations

from typing import Any

import grpc
from fastapi import FastAPI
from tritonclient.grpc import service_pb2_grpc

from shardserve.serving.frontend.grpc.service import InferenceService

FORWARDED_RPCS = ("ModelStatistics", "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload")


class ForwardingService(InferenceService):
    """``InferenceService`` with ``FORWARDED_RPCS`` answered by the core (module doc)."""

    def __init__(self, app: FastAPI, core_address: str) -> None:
        super().__init__(app)
        self._channel = grpc.aio.insecure_channel(core_address)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    async def _forward(self, method: str, request: Any, context: Any) -> Any:
        self.app.state.core_client.flush()  # this process's counts first (ModelStatistics)
        metadata = [
            (m.key, m.value)
            for m in context.invocation_metadata() or ()
            if not m.key.startswith((":", "grpc-"))
        ]
        try:
            return await getattr(self._stub, method)(
                request, metadata=metadata, timeout=context.time_remaining()
            )
        except grpc.aio.AioRpcError as err:
            context.set_trailing_metadata(err.trailing_metadata() or ())
            await context.abort(err.code(), err.details() or "")

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        return await self._forward("ModelStatistics", request, context)

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        return await self._forward("RepositoryIndex", request, context)

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        return await self._forward("RepositoryModelLoad", request, context)

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        return await self._forward("RepositoryModelUnload", request, context)

    async def close(self) -> None:
        await self._channel.close()
