"""The gRPC server: one ``grpc.aio`` server on ``--grpc-port``, beside uvicorn, serving Triton's service.

The server runs on the app's own event loop (the lifespan starts it once the models are started and
stops it with the drain), so its RPCs reach the same ``ModelRepository``, admission and metrics as
REST. The RPCs are Triton's ``inference.GRPCInferenceService`` (``serving/frontend/grpc/service.py``),
each inside the envelope of ``serving/frontend/grpc/call.py``.

- **Limits**: messages over ``max_body_bytes`` are refused by gRPC itself (RESOURCE_EXHAUSTED);
  ``SO_REUSEPORT`` is off, so a port in use is an error, not a second server sharing it (but in the
  API processes of ``--api-workers``, which share it: ``serving/frontend/grpc/forward.py``).
- **Drain**: ``stop(grace_s)`` refuses new RPCs and lets those in flight finish (the lifespan runs it
  beside the models' drain; meanwhile inference answers UNAVAILABLE, as REST answers 503).

    front = await GrpcFront.start(app, host="0.0.0.0", port=8001)   # the lifespan does this
    front.port                                                      # the bound port (port 0: any)
    await front.stop(grace_s=30)

Tests: ``pytest tests/serving/frontend/grpc/test_grpc.py``.
"""

from __future__ import annotations

import logging

import grpc
from fastapi import FastAPI
from tritonclient.grpc import service_pb2_grpc

from shardserve.serving.frontend.grpc.call import SERVICE
from shardserve.serving.frontend.grpc.forward import ForwardingService
from shardserve.serving.frontend.grpc.service import add_service

logger = logging.getLogger(__name__)


class GrpcFront:
    """The running gRPC server of an app (module doc)."""

    def __init__(
        self, server: grpc.aio.Server, port: int, forwarding: ForwardingService | None = None
    ) -> None:
        self.server = server
        self.port = port
        self.forwarding = forwarding  # an API process's link to the core's gRPC

    @classmethod
    async def start(
        cls,
        app: FastAPI,
        *,
        host: str,
        port: int,
        address: str | None = None,
        core_address: str | None = None,
    ) -> GrpcFront:
        """Bind ``host:port`` (OSError naming the flags when it cannot) and serve Triton's service;
        ``address``: bind that instead (the core of ``--api-workers``: a unix socket); ``core_address``:
        an API process, sharing the port (``SO_REUSEPORT``) and forwarding the core's RPCs there."""
        settings = app.state.settings
        server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", int(core_address is not None)),
                ("grpc.max_receive_message_length", settings.max_body_bytes),
                ("grpc.max_send_message_length", -1),
            ]
        )
        forwarding = None
        if core_address is None:
            add_service(server, app)
        else:
            forwarding = ForwardingService(app, core_address)
            service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(forwarding, server)
        address = address or (f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        try:
            bound = server.add_insecure_port(address)
        except RuntimeError as err:
            bound, reason = 0, err
        else:
            reason = None
        if not bound:
            await server.stop(None)
            raise OSError(
                f"--host {host} --grpc-port {port}: cannot listen there ({reason or 'bind failed'})"
            )
        await server.start()
        logger.info("gRPC (%s) listening on %s", SERVICE, f"{host}:{bound}")
        return cls(server, bound, forwarding)

    async def stop(self, *, grace_s: float | None) -> None:
        """Refuse new RPCs; those in flight get ``grace_s`` to finish (None: cancel them now)."""
        await self.server.stop(grace_s)
        if self.forwarding is not None:
            await self.forwarding.close()
