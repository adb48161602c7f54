"""Stalled clients cannot hold connections: the request-header deadline (serving/frontend/http_protocol.py) and
the body deadline (serving/frontend/app.py RequestGuard), over real sockets through uvicorn.

python -m pytest tests/serving/frontend/test_http_protocol.py -q
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from shardserve.serving.frontend.app import build_app
from shardserve.serving.frontend.http_protocol import header_deadline_protocol
from shardserve.serving.frontend.settings import ServeSettings
from tests.serving.fakes import FakeFactory
from tests.serving.live import live_server

TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    settings = ServeSettings(model="tiny-bert", replicas=1, client_timeout_s=TIMEOUT_S)
    app = build_app(settings, backend_factory=FakeFactory())
    with live_server(app, ready_timeout_s=30, http=header_deadline_protocol(TIMEOUT_S)) as base:
        yield int(base.rsplit(":", 1)[1])


def _answer_then_eof(port: int, sent: bytes) -> tuple[float, bytes]:
    """Send ``sent`` and nothing more; (seconds until the server closed, everything it wrote)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(20 * TIMEOUT_S)
        t0 = time.monotonic()
        sock.sendall(sent)
        got = b""
        while chunk := sock.recv(4096):  # a socket.timeout here: the server held the connection
            got += chunk
        return time.monotonic() - t0, got


def _status_and_body(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower()
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize(
    "sent",
    [b"", b"POST /v1/qa HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"],
    ids=["silent", "half-headers"],
)
def test_headers_that_do_not_arrive_get_408_and_the_connection_closes(port: int, sent: bytes) -> None:
    elapsed, raw = _answer_then_eof(port, sent)
    status, body = _status_and_body(raw)
    assert status == 408 and body["error"] == "request_timeout" and "headers" in body["detail"]
    assert TIMEOUT_S * 0.9 <= elapsed < 10 * TIMEOUT_S


@pytest.mark.parametrize(
    "framing",
    [b"Content-Length: 100\r\n\r\n", b"Transfer-Encoding: chunked\r\n\r\n3\r\n"],
    ids=["content-length", "chunked"],
)
def test_a_body_that_does_not_arrive_gets_408_and_the_connection_closes(port: int, framing: bytes) -> None:
    head = b"POST /v1/qa HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    elapsed, raw = _answer_then_eof(port, head + framing + b'{"q')
    status, body = _status_and_body(raw)
    assert status == 408 and body["error"] == "request_timeout" and "body" in body["detail"]
    assert TIMEOUT_S * 0.9 <= elapsed < 10 * TIMEOUT_S


def test_prompt_clients_keep_their_kept_alive_connection(port: int) -> None:
    """The deadline restarts with every answer: requests sent in time on ONE connection all pass,
    although together they take longer than the deadline."""
    body = json.dumps({"question": "Who won?", "context": "Bob won the game."}).encode()
    request = (
        b"POST /v1/qa HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
    )
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(10)
        reader = sock.makefile("rb")
        t0 = time.monotonic()
        for _ in range(4):
            sock.sendall(request % (len(body), body))
            assert reader.readline().split()[1] == b"200"
            length = 0
            while (line := reader.readline()) != b"\r\n":
                name, _, value = line.partition(b":")
                length = int(value) if name.lower() == b"content-length" else length
            assert json.loads(reader.read(length))["answers"]
            time.sleep(TIMEOUT_S * 0.6)  # idle, but less than the deadline, between requests
        assert time.monotonic() - t0 > 2 * TIMEOUT_S
