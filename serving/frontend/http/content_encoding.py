"""Compressed request bodies (``Content-Encoding: gzip`` or ``deflate``), as Triton's clients send
them with ``request_compression_algorithm``: ``RequestGuard`` (serving/frontend/app.py) inflates a body
before any parsing, never past ``max_body_bytes`` (a small body that inflates to gigabytes is a 413,
not an allocation).

    inflate(body, "gzip", limit=1 << 20)  -> the body; BodyEncodingError(status, code, detail)
"""

from __future__ import annotations

import zlib

SUPPORTED = ("gzip", "deflate", "identity")
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}  # deflate: the zlib format (RFC 9110)


class BodyEncodingError(ValueError):
    """A body that cannot be inflated: ``status`` (413, 415 or 400), the error ``code``, ``detail``."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail = status, code, detail


def inflate(body: bytes, encoding: str, *, limit: int) -> bytes:
    """``body`` decoded from ``encoding`` (a Content-Encoding value), at most ``limit`` bytes."""
    codings = [c.strip().lower() for c in encoding.split(",") if c.strip()]
    for coding in reversed(codings):  # applied in order: undo the last one first
        if coding == "identity":
            continue
        if coding not in _WBITS:
            raise BodyEncodingError(
                415,
                "unsupported_content_encoding",
                f"Content-Encoding {coding[:40]!r}: supported {SUPPORTED}",
            )
        inflater = zlib.decompressobj(_WBITS[coding])
        try:
            out = inflater.decompress(body, limit + 1)
        except zlib.error as err:
            raise BodyEncodingError(
                400, "invalid_content_encoding", f"body is not valid {coding}: {err}"
            ) from None
        if len(out) > limit:
            detail = f"body inflates ({coding}) to over {limit} bytes (max_body_bytes)"
            raise BodyEncodingError(413, "body_too_large", detail)
        if not inflater.eof:
            raise BodyEncodingError(
                400, "invalid_content_encoding", f"body is not valid {coding}: it is cut off"
            )
        body = out
    return body
