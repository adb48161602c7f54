"""JSON bodies the parser gives up on, reported like every other JSON decode error of the route.

FastAPI turns a ``json.JSONDecodeError`` into request validation (``json_invalid``: the native 422
``invalid_request``, the v2 400), but any other failure of ``json.loads`` into a bare 400 "There was
an error parsing the body". Two such failures are ordinary client input: nesting deeper than the
parser's stack (~950 levels: ``RecursionError``) and an integer literal over Python's digit limit
(4300: ``ValueError``). ``JsonBodyRoute`` (the base route class of every route with a body) reports
them as ``json_invalid`` too, with the reason:

    POST /v1/qa [[[...]]]           -> 422 invalid_request "body: JSON decode error: nesting too deep"
    POST /v2/models/m/infer [[...]] -> 400 {"error": "body: JSON decode error: nesting too deep"}

A body without Content-Type is read as JSON; one of another media type (``text/plain``, a form) is
a 415 that says so.
"""

from __future__ import annotations

import email.message
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException


def unparsable_reason(exc: HTTPException) -> str | None:
    """Why FastAPI could not parse a JSON body, when ``exc`` is its 400 for a parser failure."""
    cause = exc.__cause__
    if exc.status_code != 400 or not isinstance(cause, RecursionError | ValueError):
        return None
    if isinstance(cause, RecursionError):
        return "nesting too deep"
    if "integer string conversion" in str(cause):  # int(): "Exceeds the limit (4300 digits) for ..."
        return f"an integer literal has more than {sys.get_int_max_str_digits()} digits"
    return "the body cannot be decoded"


def media_type_problem(content_type: str | None) -> str | None:
    """Why a body of this Content-Type is not read as JSON (None: it is; a missing one is JSON)."""
    if not content_type:
        return None
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    if message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json")):
        return None
    return f"the body must be JSON (Content-Type: application/json), got Content-Type: {content_type[:100]}"


class JsonBodyRoute(APIRoute):
    """A route whose unparsable JSON bodies are request validation errors (``json_invalid``), whose
    body is read as JSON when no Content-Type is given (Open Inference Protocol clients send none),
    and which answers 415 for a body of another media type (FastAPI would report its text as "not a
    valid dictionary")."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        kwargs["strict_content_type"] = False  # no Content-Type: JSON
        super().__init__(path, endpoint, **kwargs)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        has_body = self.body_field is not None

        async def parsed(request: Request) -> Response:
            if has_body and (problem := media_type_problem(request.headers.get("content-type"))):
                raise HTTPException(415, {"error": "unsupported_media_type", "detail": problem})
            try:
                return await handler(request)
            except HTTPException as exc:
                reason = unparsable_reason(exc)
                if reason is None:
                    raise
                error = {
                    "type": "json_invalid",
                    "loc": ("body",),
                    "msg": f"JSON decode error: {reason}",
                    "input": {},
                    "ctx": {"error": reason},
                }
                raise RequestValidationError([error]) from exc

        return parsed
