"""The envelope of one gRPC call: what every RPC of ``serving/frontend/grpc/service.py`` shares.

``run_rpc`` wraps an RPC's handler (the server itself: ``serving/frontend/grpc/server.py``):

- **Identity**: the ``x-request-id`` metadata when it is a valid id (``access.valid_request_id``),
  else a generated one; it goes back in the trailing metadata of every answer, errors too.
- **Keys**: ``authorization: Bearer <token>`` metadata. Model RPCs need the API key when one is
  set (model readiness, server health and metadata stay open, as on REST), repository RPCs the admin
  token. Compared in constant time; a missing or wrong one is UNAUTHENTICATED.
- **Errors**: a refusal is ``GrpcError`` with the HTTP status REST would answer and a gRPC code:
  400/413/422 INVALID_ARGUMENT, 401 UNAUTHENTICATED, 404 NOT_FOUND, 409 ABORTED, 429
  RESOURCE_EXHAUSTED, 499 CANCELLED, 503 UNAVAILABLE, 504 DEADLINE_EXCEEDED, else INTERNAL. 429 and
  503 carry ``retry-after`` (seconds) in the trailing metadata, as REST's ``Retry-After``.
- **Access log and metrics**: one ``shardserve.access`` line per RPC (``method=GRPC
  path=/inference.GRPCInferenceService/ModelInfer status=200 ...``: the status is REST's equivalent,
  so one query covers both protocols), and ``requests_total`` / the latency histogram with
  ``endpoint="grpc_infer"`` for inference.

    async def ModelInfer(self, request, context):                       # in the servicer
        return await run_rpc(app, context, "ModelInfer", handler, request, access=Access.API_KEY,
                             endpoint="grpc_infer")                     # handler(request, call, context)

Tests: ``pytest tests/serving/frontend/grpc/test_grpc.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

import grpc
from fastapi import FastAPI

from shardserve.serving.engine.qa_types import EngineError
from shardserve.serving.frontend.http.access import (
    API_KEY_401,
    new_request_id,
    record_access,
    token_matches,
    valid_request_id,
)
from shardserve.serving.frontend.http.openapi import RETRY_AFTER_503_S

logger = logging.getLogger(__name__)

SERVICE = "inference.GRPCInferenceService"
REQUEST_ID_KEY = "x-request-id"

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.ABORTED,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


class Access(Enum):
    """Who may call an RPC."""

    OPEN = "open"
    API_KEY = "api key"
    ADMIN = "admin token"


class GrpcError(Exception):
    """A refusal: REST's HTTP ``status`` and ``message``; its gRPC code follows from the status."""

    def __init__(self, status: int, message: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s

    @property
    def code(self) -> grpc.StatusCode:
        return _CODES.get(self.status, grpc.StatusCode.INTERNAL)

    @classmethod
    def of(cls, err: EngineError) -> GrpcError:
        """An engine's refusal, worded as REST words it (``code: detail``)."""
        return cls(err.status, f"{err.code}: {err.detail}", retry_after_s=err.retry_after_s)

    def trailing_metadata(self, request_id: str) -> tuple[tuple[str, str], ...]:
        meta = [(REQUEST_ID_KEY, request_id)]
        if self.status in (429, 503):
            meta.append(("retry-after", str(self.retry_after_s or RETRY_AFTER_503_S)))
        return tuple(meta)


@dataclass
class Call:
    """What one RPC learns about itself on its way: the access log's and the metrics' fields."""

    request_id: str
    model: str = ""
    windows: int | None = None


def _metadata(context: grpc.aio.ServicerContext, key: str) -> str:
    for item in context.invocation_metadata() or ():
        if item.key == key:
            value = item.value
            return value.decode("latin-1") if isinstance(value, bytes) else value
    return ""


def _bearer(context: grpc.aio.ServicerContext) -> str | None:
    value = _metadata(context, "authorization").strip()
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def authorize(context: grpc.aio.ServicerContext, access: Access, settings: Any) -> None:
    """Raise ``GrpcError`` 401 unless the RPC's ``authorization`` metadata carries the key it needs."""
    if access is Access.OPEN:
        return
    expected = settings.api_key if access is Access.API_KEY else settings.admin_token
    if not expected:
        if access is Access.API_KEY:
            return
        raise GrpcError(401, "admin_disabled: no admin token is configured")
    if not token_matches(_bearer(context), expected):
        detail = API_KEY_401 if access is Access.API_KEY else "missing or wrong bearer token"
        raise GrpcError(401, f"unauthorized: {detail} (gRPC: the authorization metadata)")


R = TypeVar("R")
Handler = Callable[[Any, Call, grpc.aio.ServicerContext], Awaitable[R]]


async def run_rpc(
    app: FastAPI,
    context: grpc.aio.ServicerContext,
    method: str,
    handler: Handler[R],
    request: Any,
    *,
    access: Access,
    endpoint: str | None = None,
) -> R:
    """Run one RPC's ``handler`` inside the envelope (module doc): request id, key, errors as gRPC
    status codes, the access log line and, for an ``endpoint``, the request metrics."""
    t0 = time.perf_counter()
    given = _metadata(context, REQUEST_ID_KEY)
    call = Call(request_id=given if valid_request_id(given) else new_request_id())
    status = 200
    try:
        authorize(context, access, app.state.settings)
        response = await handler(request, call, context)
        context.set_trailing_metadata(((REQUEST_ID_KEY, call.request_id),))
        return response
    except GrpcError as err:
        status = err.status
        await context.abort(err.code, err.message, trailing_metadata=err.trailing_metadata(call.request_id))
        raise  # (abort raises)
    except asyncio.CancelledError:
        status = 499  # the client cancelled, or its deadline passed: nobody reads the answer
        raise
    except Exception:
        status = 500
        logger.exception("gRPC %s failed (request %s)", method, call.request_id)
        meta = ((REQUEST_ID_KEY, call.request_id),)
        await context.abort(grpc.StatusCode.INTERNAL, "internal error (the server log has it)", meta)
        raise
    finally:
        record_access(
            app.state.metrics if endpoint is not None else None,
            method="GRPC",
            path=f"/{SERVICE}/{method}",
            status=status,
            latency_s=time.perf_counter() - t0,
            endpoint=endpoint,
            model=call.model,
            windows=call.windows,
            request_id=call.request_id,
        )
