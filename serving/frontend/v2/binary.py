"""The Open Inference Protocol's binary tensor data extension: what Triton's clients send by default.

Spec: kserve.github.io (data plane v2, "Binary Tensor Data Extension"); Triton's
``extension_binary_data.md``. Tensor data travels after the JSON object in the HTTP body:

    request    Inference-Header-Content-Length: L     body = L bytes of JSON + the inputs' data
               an input with parameters.binary_data_size = n takes the next n bytes (in input order)
    response   outputs asked for with parameters.binary_data true (or all: the request parameter
               binary_data_output true) carry parameters.binary_data_size and no data; their bytes
               follow the JSON, whose length is the response's Inference-Header-Content-Length

Little-endian, row-major, no padding. BYTES: per element a 4-byte unsigned length, then the bytes
(UTF-8 text here); BOOL one byte 0/1; FP32 4 bytes; INT64 8 bytes. ``BinaryTensorRoute`` splits a
request's body so that the route parses its JSON as usual and finds the tensor bytes in
``request.state.v2_binary``; the codec functions raise ``ValueError`` saying what is wrong (the
routes answer it 400).

    curl: printf '%s' "$json" > b; printf '\\x05\\x00\\x00\\x00hello' >> b
          curl -H "Inference-Header-Content-Length: ${#json}" --data-binary @b .../infer
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from starlette.exceptions import HTTPException

from shardserve.serving.frontend.http.json_body import JsonBodyRoute

HEADER = "Inference-Header-Content-Length"
BINARY_MEDIA_TYPE = "application/octet-stream"
_FORMATS = {"FP32": "f", "INT64": "q", "BOOL": "?"}  # struct codes (little-endian with "<")
_LENGTH = struct.Struct("<I")


def split_body(raw: bytes, header_length: str) -> tuple[bytes, bytes]:
    """(JSON part, tensor data) of a body whose JSON is ``header_length`` bytes long."""
    try:
        length = int(header_length)
    except ValueError:
        raise ValueError(f"{HEADER} is {header_length[:40]!r}, not a number of bytes") from None
    if not 0 < length <= len(raw):
        raise ValueError(f"{HEADER} is {length}; the body has {len(raw)} bytes")
    return raw[:length], raw[length:]


def decode_bytes(data: bytes) -> list[str]:
    """The elements of a BYTES tensor's binary data (length-prefixed), as UTF-8 text."""
    out: list[str] = []
    at = 0
    while at < len(data):
        if at + _LENGTH.size > len(data):
            raise ValueError(f"element {len(out)}: its 4-byte length is cut off at byte {at}")
        (size,) = _LENGTH.unpack_from(data, at)
        at += _LENGTH.size
        if at + size > len(data):
            raise ValueError(f"element {len(out)} has length {size}; {len(data) - at} bytes are left")
        try:
            out.append(data[at : at + size].decode("utf-8"))
        except UnicodeDecodeError:
            raise ValueError(f"element {len(out)} is not UTF-8 text") from None
        at += size
    return out


def encode(datatype: str, values: list[Any]) -> bytes:
    """The binary data of a flat tensor of ``datatype`` (BYTES: ``str`` elements)."""
    if datatype == "BYTES":
        return b"".join(_LENGTH.pack(len(b)) + b for b in (v.encode("utf-8") for v in values))
    return struct.pack(f"<{len(values)}{_FORMATS[datatype]}", *values)


def binary_response(header: dict[str, Any], data: list[bytes]) -> Response:
    """The JSON ``header`` followed by the outputs' ``data``, its length in ``HEADER``."""
    head = json.dumps(header, separators=(",", ":")).encode()
    return Response(head + b"".join(data), media_type=BINARY_MEDIA_TYPE, headers={HEADER: str(len(head))})


def utf8_problem(err: UnicodeDecodeError) -> str:
    """The reason of a 400 for a body (or a body's JSON part) that is not UTF-8."""
    return f"body is not valid UTF-8: {err.reason} at byte {err.start}"


def _without_content_type(request: Request, body: bytes) -> Request:
    """``request`` whose body is ``body`` (read as JSON: no Content-Type); its state is shared."""
    scope = dict(request.scope)
    scope["headers"] = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
    out = Request(scope, request.receive)
    out._body = body  # the pattern of FastAPI's custom Request docs (a body already read)
    return out


class BinaryTensorRoute(JsonBodyRoute):
    """A route whose body may be JSON followed by tensor data (``HEADER`` set): the JSON goes on to
    the usual parsing, the data to ``request.state.v2_binary``. Such a body may come with no
    Content-Type, JSON's or ``application/octet-stream``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def split(request: Request) -> Response:
            request.state.v2_binary = None
            header_length = request.headers.get(HEADER)
            if header_length is None:
                return await handler(request)
            media = (request.headers.get("content-type") or "").split(";")[0].strip().lower()
            if media not in ("", BINARY_MEDIA_TYPE, "application/json"):
                problem = f"a body with {HEADER} must be {BINARY_MEDIA_TYPE}, got Content-Type: {media[:100]}"
                raise HTTPException(415, {"error": "unsupported_media_type", "detail": problem})
            try:
                head, request.state.v2_binary = split_body(await request.body(), header_length)
                head.decode("utf-8")
            except UnicodeDecodeError as err:
                raise HTTPException(400, {"error": "invalid_utf8", "detail": utf8_problem(err)}) from None
            except ValueError as err:
                raise HTTPException(400, {"error": "invalid_request", "detail": str(err)}) from None
            return await handler(_without_content_type(request, head))

        return split
