"""The OpenAPI document of the server, kept equal to what the routes really answer.

It owns three things, so that a schema-driven client (or schemathesis ``--checks all``) finds no
gap between the document and the server:

- ``responses(...)``: the documented error statuses of a route, each with its real body model
  (``ErrorResponse``; every 422 is ``ValidationErrorResponse``) and the headers it always carries
  (``Retry-After`` on 429 / 503, ``WWW-Authenticate`` on 401);
- ``install_openapi(app, settings)``: the generated document with the limits that depend on the
  settings filled in (``maxLength`` of question / context, ``maxItems`` of a batch, the largest
  ``timeout_s``, the replica cap of the device pool), so schema-valid input is accepted;
- ``allowed_methods(request)``: the methods a path really serves, for the ``Allow`` header of a 405
  (Starlette names only the first route of a path, e.g. ``GET`` for GET + POST /admin/replicas),
  HEAD included wherever GET is.

    app.openapi()["paths"]["/admin/replicas"]["post"]["responses"]["422"]
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel
from starlette.routing import Match

from shardserve.serving.engine.builder import replica_cap as pool_replica_cap
from shardserve.serving.frontend.schemas import ErrorResponse, ValidationErrorResponse
from shardserve.serving.frontend.settings import ServeSettings

logger = logging.getLogger(__name__)

RETRY_AFTER_503_S = 1  # what a 503 (starting, restarting, draining) without a better estimate says

_RETRY_AFTER = {
    "Retry-After": {
        "description": "seconds to wait before trying again",
        "required": True,
        "schema": {"type": "integer", "minimum": 0},
    }
}
_CHALLENGE = {
    "WWW-Authenticate": {
        "description": "always `Bearer`",
        "required": True,
        "schema": {"type": "string"},
    }
}

_STATUS: dict[int, tuple[str, dict[str, Any]]] = {
    400: ("body is not valid UTF-8, or Content-Length is not a number", {}),
    401: ("admin: no admin token is configured, or the bearer token is missing or wrong", _CHALLENGE),
    404: ("no model of that name (GET /v1/models lists them)", {}),
    408: ("the request body did not arrive within client_timeout_s (the connection is closed)", {}),
    409: ("another reload is running, or the model has another tokenizer", {}),
    413: (
        "body larger than max_body_bytes, or more windows than max_windows_per_request / than the "
        "deadline allows",
        {},
    ),
    415: (
        "a Content-Type other than JSON (none is read as JSON), or a Content-Encoding other than gzip / deflate",
        {},
    ),
    422: ("invalid input: a type, a missing or unknown field, a limit, a range", {}),
    429: ("queue full (see Retry-After)", _RETRY_AFTER),
    500: ("span decoding failed (a server bug; the log has it)", {}),
    503: (
        "not ready, starting, shutting down, replica failed, or the model not served now (see Retry-After)",
        _RETRY_AFTER,
    ),
    504: ("deadline passed before the request was computed", {}),
}


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` of a route: each status with its body model, description and headers."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        description, headers = _STATUS[status]
        entry: dict[str, Any] = {
            "model": ValidationErrorResponse if status == 422 else ErrorResponse,
            "description": description,
        }
        if headers:
            entry["headers"] = headers
        out[status] = entry
    return out


def unauthorized(
    description: str, *, model: type[BaseModel] = ErrorResponse
) -> dict[int | str, dict[str, Any]]:
    """A 401 entry for ``responses=`` with its own description, body model and ``WWW-Authenticate``."""
    return {401: {"model": model, "description": description, "headers": _CHALLENGE}}


def drop_default_422(document: dict[str, Any]) -> None:
    """Remove the 422 FastAPI adds by itself to routes with parameters (its ``HTTPValidationError``)
    where the route never answers it: every route that answers 422 documents its own
    (``ValidationErrorResponse``); the /v2 routes answer request validation with 400 instead."""
    default = "#/components/schemas/HTTPValidationError"
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            if not isinstance(operation, dict):
                continue
            r422 = operation.get("responses", {}).get("422", {})
            if r422.get("content", {}).get("application/json", {}).get("schema", {}).get("$ref") == default:
                del operation["responses"]["422"]
    text = repr(document.get("paths", {}))
    schemas = document.get("components", {}).get("schemas", {})
    if default not in text:
        schemas.pop("HTTPValidationError", None)
        if "#/components/schemas/ValidationError'" not in repr(schemas):
            schemas.pop("ValidationError", None)


def replica_cap(settings: ServeSettings) -> int:
    """Replica gangs the device pool of ``settings`` holds (the autoscaler's hard upper bound)."""
    return pool_replica_cap(settings.fleet_config())


def _set_limit(prop: dict[str, Any], key: str, value: float) -> None:
    """Set ``key`` on a property schema, or on each non-null branch of its ``anyOf``."""
    branches = [b for b in prop.get("anyOf", []) if b.get("type") != "null"] or [prop]
    for branch in branches:
        branch[key] = value


def settings_limits(document: dict[str, Any], settings: ServeSettings, cap: int | None) -> None:
    """Write the settings-dependent limits into a generated document (in place)."""
    schemas = document.get("components", {}).get("schemas", {})
    for name in ("QAItem", "QARequest"):
        props = schemas.get(name, {}).get("properties", {})
        if "question" in props:
            _set_limit(props["question"], "maxLength", settings.max_question_chars)
        if "context" in props:
            _set_limit(props["context"], "maxLength", settings.max_context_chars)
    batch = schemas.get("QABatchRequest", {}).get("properties", {})
    if "items" in batch:
        _set_limit(batch["items"], "maxItems", settings.max_batch_items)
    for name in ("QARequest", "QABatchRequest"):
        props = schemas.get(name, {}).get("properties", {})
        if "timeout_s" in props:
            _set_limit(props["timeout_s"], "maximum", settings.max_request_timeout_s)
    if cap is not None:
        replicas = schemas.get("ReplicasRequest", {})
        for props in [replicas.get("properties", {})] + [
            b.get("properties", {}) for b in replicas.get("anyOf", [])
        ]:
            for field in ("replicas", "min_replicas", "max_replicas"):
                if field in props and props[field].get("type") != "null":
                    _set_limit(props[field], "maximum", cap)


def install_openapi(app: FastAPI, settings: ServeSettings) -> None:
    """Replace ``app.openapi`` by the generated document with the settings' limits filled in."""

    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = generate()  # FastAPI's own document (it caches it in app.openapi_schema)
            try:
                cap: int | None = replica_cap(settings)
            except ValueError as err:  # e.g. device=cuda without GPUs: the server cannot start anyway
                logger.warning("replica cap left out of the OpenAPI document: %s", err)
                cap = None
            settings_limits(document, settings, cap)
            drop_default_422(document)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def allowed_methods(request: Request) -> list[str]:
    """Every method some route fully matches at the request's path (sorted), for a 405's ``Allow``;
    HEAD wherever GET is (``AccessMiddleware`` answers HEAD as GET; the routes declare GET only).

    Each method is probed through ``route.matches`` (routers included with ``include_router`` are
    routes of their own in recent FastAPI, so the routes' ``methods`` are not listed flat)."""
    routes = request.app.router.routes
    served = {
        method
        for method in _METHODS
        if any(route.matches({**request.scope, "method": method})[0] is Match.FULL for route in routes)
    }
    if "GET" in served:
        served.add("HEAD")
    return sorted(served)
