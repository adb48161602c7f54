"""A minimal HTTP/1.1 client on asyncio streams: one POST's bytes, one response's status and headers.

The load generators share the cores with the server they measure, so their own CPU per request
must stay small: httpx clients, 256 at once, delayed sending the bodies by seconds and the
latencies were their own (docs/benchmarks.md). Used by ``loadtest/overload.py`` (closed-loop
clients) and ``loadtest/replay.py`` (open-loop trace replay).

    request = post_request("http://127.0.0.1:8000", "/v1/qa", body)
    writer.write(request); status, headers, body = await read_response(reader)
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

KEEPALIVE_EXPIRY_S = 2.0  # idle connections are closed first, before uvicorn's 5 s keep-alive timeout


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-case names) and body of one HTTP/1.1 response (Content-Length framed)."""
    status_line = await reader.readline()
    if not status_line:
        raise EOFError("the server closed the connection")
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


def post_request(url: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    """The bytes of ``POST path`` with a JSON ``body`` to the server at ``url``."""
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {urlsplit(url).netloc}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        *(f"{k}: {v}" for k, v in (headers or {}).items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
