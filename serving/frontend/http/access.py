"""Access and identity of HTTP requests: request ids, the access log line, request metrics, the API key.

- ``AccessMiddleware`` (pure ASGI, the outermost middleware) gives every request an id: the client's
  ``X-Request-ID`` when it is 1..128 characters of ``[A-Za-z0-9._:+=/-]``, else a generated one
  (32 hex digits; a rejected client id is replaced, never echoed). The id is ``request.state.request_id``,
  the ``X-Request-ID`` header of every response, the ``request_id`` of native JSON error bodies
  (``{"error", "detail", "request_id"}``; the Open Inference Protocol error object under /v2 stays
  exactly ``{"error": message}``) and the last field of one access-log line per request, written at
  INFO to the logger ``shardserve.access`` (``--log-level INFO`` shows it), logfmt style:

      method=POST path=/v1/qa status=200 latency_ms=12.3 windows=1 request_id=4bf92f3577b34da6

  ``path`` has no query string and is quoted when it holds spaces, quotes or control characters;
  ``windows`` is ``-`` unless the request reached the engine (``note_windows``); ``latency_ms`` runs
  from the first byte the middleware sees to the end of the response body.
  The same place counts every question-answering request in ``shardserve_requests_total{endpoint,
  status}`` and its latency histogram (``metrics_endpoint``: /v1/qa, /v1/qa/batch, /v2/.../infer),
  whatever answered it: the routes, request validation (422), the body guard (413, 408) or the key (401).
  A HEAD request is answered as its GET without the body (same status and headers, Content-Length
  included): HTTP requires HEAD wherever GET is served and load balancers probe with it; the routes
  declare GET only, so the OpenAPI document has no HEAD operations (``allowed_methods`` names HEAD).
- ``include_protected(app, router, settings=...)`` includes a router; with ``settings.api_key`` set,
  each of its routes needs ``Authorization: Bearer <api_key>`` (compared with ``hmac.compare_digest``)
  and answers 401 with ``WWW-Authenticate: Bearer`` otherwise; the OpenAPI document then declares the
  ``ApiKey`` bearer scheme and the 401 on exactly those routes (and on none while no key is set).
  Such a router's routes are ``ApiKeyRoute``s: the key is checked BEFORE FastAPI reads, parses and
  validates the body (a dependency runs after that), so a caller without the key learns nothing
  from a 422; ``check_first`` does the same for the admin token (``serving/frontend/rest/routes.py``).

    app.add_middleware(AccessMiddleware)                       # last added: outermost
    include_protected(app, api_router, settings=settings)
    note_windows(request, 3)                                   # in a route: windows of the request
    await client.wait(request_, disconnected=disconnect_watcher(request))  # cancels when the client goes
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request, Response, Security
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel

from shardserve.serving.frontend.http.json_body import JsonBodyRoute
from shardserve.serving.frontend.http.openapi import unauthorized
from shardserve.serving.frontend.schemas import ErrorResponse
from shardserve.serving.frontend.settings import ServeSettings
from shardserve.serving.metrics import RequestCounter

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("shardserve.access")

REQUEST_ID_HEADER = "X-Request-ID"
_VALID_ID = re.compile(r"[A-Za-z0-9._:+=/-]{1,128}")
_PLAIN = re.compile(r"[!#-~]*")  # printable ASCII without space and '"': written unquoted


def valid_request_id(value: str) -> bool:
    """A client request id we echo: 1..128 characters of ``[A-Za-z0-9._:+=/-]``."""
    return _VALID_ID.fullmatch(value) is not None


def new_request_id() -> str:
    return uuid.uuid4().hex


def request_id_of(request: Request) -> str | None:
    """The id ``AccessMiddleware`` gave this request (None outside the middleware)."""
    return getattr(request.state, "request_id", None)


def note_windows(request: Request, windows: int) -> None:
    """Record the windows a request needed (the access log's ``windows`` field)."""
    request.state.windows = windows


def disconnect_watcher(request: Request) -> Callable[[], Awaitable[None]]:
    """A coroutine function that returns once the client disconnects (the engine then cancels the
    request's queued work)."""

    async def disconnected() -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return
            await asyncio.sleep(0.05)  # a server that keeps sending empty chunks: do not spin

    return disconnected


def _field(value: str) -> str:
    return value if _PLAIN.fullmatch(value) and value else json.dumps(value)


class AccessMiddleware:
    """Request id in and out, request id in native error bodies, one access-log line per request."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        rid = given if valid_request_id(given) else new_request_id()
        if given and rid != given:
            logger.debug("client X-Request-ID %r is not 1..128 of [A-Za-z0-9._:+=/-]: replaced", given[:64])
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        enrich = not scope["path"].startswith("/v2")  # the v2 error object is exactly {"error": ...}
        head = scope["method"] == "HEAD"  # answered as GET, without the body
        status = 0
        held: dict | None = None  # an error response start, held until its body is rewritten
        chunks: list[bytes] = []

        async def send_with_id(message: dict) -> None:
            nonlocal status, held
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", rid.encode())]}
                ctype = dict(message["headers"]).get(b"content-type", b"")
                if enrich and status >= 400 and ctype.startswith(b"application/json"):
                    held = message
                    return
            elif message["type"] == "http.response.body" and held is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                start, held = held, None
                body = _with_request_id(b"".join(chunks), rid)
                headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
                await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
                message = {"type": "http.response.body", "body": body}
            if head and message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        inner = {**scope, "method": "GET"} if head else scope
        try:
            await self.app(inner, receive, send_with_id)
        except BaseException:
            status = status or 500
            raise
        finally:
            latency_s = time.perf_counter() - t0
            endpoint = metrics_endpoint(scope["method"], scope["path"])
            app = scope.get("app")
            if not scope.get("shardserve.forwarded"):  # an API process's: it wrote the line, counted it
                record_access(
                    app.state.metrics if endpoint is not None and app is not None else None,
                    method=scope["method"],
                    path=scope["path"],
                    status=status or 499,  # no response started: the client went away first
                    latency_s=latency_s,
                    endpoint=endpoint,
                    model=state.get("model", ""),  # set by the routes of a model (qa_call.client_for)
                    windows=state.get("windows"),
                    request_id=rid,
                )


def record_access(
    metrics: RequestCounter | None,
    *,
    method: str,
    path: str,
    status: int,
    latency_s: float,
    endpoint: str | None,
    model: str,
    windows: int | None,
    request_id: str,
) -> None:
    """One answered request of any protocol: its access-log line and, for a question-answering
    ``endpoint`` (``metrics`` given), ``requests_total`` and the latency histogram. Every answer
    counts: the 4xx of the body guard, of validation and of the key too."""
    if metrics is not None and endpoint is not None:
        metrics.count_request(model=model, endpoint=endpoint, status=status, seconds=latency_s)
    access_logger.info(
        "method=%s path=%s status=%d latency_ms=%.1f windows=%s request_id=%s",
        method,
        _field(path),
        status,
        1000 * latency_s,
        "-" if windows is None else windows,
        request_id,
    )


def metrics_endpoint(method: str, path: str) -> str | None:
    """The ``endpoint`` label of a question-answering request in the metrics; None for other requests."""
    if method != "POST":
        return None
    if path in ("/v1/qa", "/v1/qa/batch"):
        return "qa" if path == "/v1/qa" else "batch"
    return "v2_infer" if path.startswith("/v2/models/") and path.endswith("/infer") else None


def _with_request_id(body: bytes, rid: str) -> bytes:
    """A native error body ``{"error", "detail"}`` with ``request_id`` added (other bodies unchanged)."""
    try:
        payload = json.loads(body)
    except ValueError:
        return body
    if not isinstance(payload, dict) or "error" not in payload or "request_id" in payload:
        return body
    return json.dumps({**payload, "request_id": rid}).encode()


# ------------------------------------------------------------------------------------------ tokens

Handler = Callable[[Request], Coroutine[Any, Any, Response]]
BearerCheck = Callable[[Request, HTTPAuthorizationCredentials | None], None]


def check_first(handler: Handler, check: BearerCheck, scheme: HTTPBearer) -> Handler:
    """``handler`` (a route's) behind ``check`` (a bearer-token dependency raising the 401), run before
    the handler reads the body: FastAPI parses and validates a body before any dependency runs."""

    async def checked(request: Request) -> Response:
        check(request, await scheme(request))
        return await handler(request)

    return checked


# ------------------------------------------------------------------------------------------ API key

_api_key_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="ApiKey",
    description="the server's api_key (--api-key): `Authorization: Bearer <api_key>`, 401 when missing or wrong",
)
API_KEY_401 = "the API key (Authorization: Bearer <api_key>) is missing or wrong"


def token_matches(given: str | None, expected: str) -> bool:
    """Whether a bearer token (None: none was sent) is ``expected``, compared in constant time: the
    one check of the API key and the admin token, over every protocol."""
    return given is not None and hmac.compare_digest(given.strip().encode(), expected.encode())


def require_api_key(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_api_key_bearer)]
) -> None:
    """401 unless the request carries ``Authorization: Bearer <api_key>`` (constant-time compare)."""
    key = request.app.state.settings.api_key
    if not key:
        return
    if not token_matches(credentials.credentials if credentials is not None else None, key):
        raise HTTPException(
            401,
            {"error": "unauthorized", "detail": API_KEY_401},
            {"WWW-Authenticate": "Bearer"},
        )


class ApiKeyRoute(JsonBodyRoute):
    """The route class of routers given to ``include_protected``: the API key first (no-op without one)."""

    def get_route_handler(self) -> Handler:
        return check_first(super().get_route_handler(), require_api_key, _api_key_bearer)


def include_protected(
    app: FastAPI,
    router: APIRouter,
    *,
    settings: ServeSettings,
    error_model: type[BaseModel] = ErrorResponse,
) -> None:
    """Include ``router``; behind the API key (and documented so) when ``settings.api_key`` is set.

    Its routes must be ``ApiKeyRoute``s (checked): the key before the body. The dependency added here
    documents the scheme in the OpenAPI document (and checks again, after the body: cheap)."""
    late = [r.path for r in router.routes if isinstance(r, APIRoute) and not isinstance(r, ApiKeyRoute)]
    if late:
        raise TypeError(f"routes {late} would read the body before the API key: give them ApiKeyRoute")
    if not settings.api_key:
        app.include_router(router)
        return
    app.include_router(
        router,
        dependencies=[Depends(require_api_key)],
        responses=unauthorized(API_KEY_401, model=error_model),
    )
