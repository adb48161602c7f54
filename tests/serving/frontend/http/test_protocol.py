"""Stalled clients cannot hold connections: the request-header deadline (serving/frontend/http/protocol.py) and
the body deadline (serving/frontend/app.py RequestGuard), over real sockets through uvicorn; and a drain
answers every request that reaches the server, on kept-alive connections too, over raw sockets.

python -m pytest tests/serving/frontend/http/test_protocol.py -q
"""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from shardserve.partitioner.runtime.fake_gang import FakeFactory
from shardserve.serving.frontend.app import build_app
from shardserve.serving.frontend.http.protocol import DRAIN_IDLE_S, header_deadline_protocol
from shardserve.serving.frontend.settings import ServeSettings
from tests.serving.frontend.api_helpers import wait_until
from tests.serving.live import draining_server, free_port, live_server

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
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(10)
        reader = sock.makefile("rb")
        t0 = time.monotonic()
        for _ in range(4):
            sock.sendall(REQUEST)
            status, _, answer = _read_answer(reader)
            assert status == 200 and answer["answers"]
            time.sleep(TIMEOUT_S * 0.6)  # idle, but less than the deadline, between requests
        assert time.monotonic() - t0 > 2 * TIMEOUT_S


BODY = json.dumps({"question": "Who won?", "context": "Bob won the game."}).encode()
HEAD = b"POST /v1/qa HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % len(
    BODY
)
REQUEST = HEAD + b"\r\n" + BODY


def _read_answer(reader: Any) -> tuple[int, dict[str, str], dict]:
    """One HTTP/1.1 answer from a socket's reader: (status, lower-case headers, JSON body)."""
    status_line = reader.readline()
    assert status_line, "the server closed the connection without an answer"
    headers = {}
    while (line := reader.readline()) != b"\r\n":
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, json.loads(reader.read(int(headers["content-length"])))


def test_a_drain_answers_every_request_that_reached_the_server_and_closes_connections_between_requests() -> (
    None
):
    """SIGTERM with four connections open: one with an answer under way, two kept alive and idle, one
    with half a request's headers sent. The first gets its answer; the second and the half one get
    the drain's 503 (with Retry-After) for the requests they send after the signal: no connection is
    closed under a request, each answer says Connection: close; a new connection is refused; the
    fourth, silent since, is closed ``DRAIN_IDLE_S`` after the signal and the server stops. (uvicorn's own stop closed the idle ones at
    once: a request sent on them then got no answer.)"""
    factory = FakeFactory()
    settings = ServeSettings(
        model="tiny-bert", replicas=1, host="127.0.0.1", port=free_port(), drain_timeout_s=10.0
    )
    with draining_server(settings, factory) as (server, app, thread):
        conns = [socket.create_connection((settings.host, settings.port)) for _ in range(4)]
        busy, idle, partial, quiet = conns
        readers = [c.makefile("rb") for c in conns]
        for c in conns:
            c.settimeout(10)
        for c, r in ((idle, readers[1]), (quiet, readers[3])):
            c.sendall(REQUEST)
            assert _read_answer(r)[0] == 200  # kept alive: idle from now on
        factory.gate.clear()  # the gang holds the next request
        busy.sendall(REQUEST)
        wait_until(lambda: app.state.engine.ongoing == 1, what="the request under way")
        partial.sendall(HEAD)  # its blank line and body come after the signal
        time.sleep(0.1)
        t0 = time.monotonic()
        server.handle_exit(signal.SIGTERM, None)
        time.sleep(0.5)  # uvicorn's own stop has closed the idle connections by now
        idle.sendall(REQUEST)
        partial.sendall(b"\r\n" + BODY)
        factory.gate.set()
        answers = [_read_answer(r) for r in readers[:3]]
        assert answers[0][0] == 200 and answers[0][2]["answers"]  # admitted before the signal
        for status, headers, body in answers[1:]:
            assert (status, body["error"]) == (503, "shutting_down") and int(headers["retry-after"]) > 0
        assert all(headers["connection"] == "close" for _, headers, _ in answers)
        assert all(r.read() == b"" for r in readers[:3])  # then closed by the server
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((settings.host, settings.port), timeout=5)
        assert readers[3].read() == b""  # no request on it since the signal: closed, idle
        assert DRAIN_IDLE_S <= time.monotonic() - t0 < DRAIN_IDLE_S + 5
        thread.join(timeout=10)
        assert not thread.is_alive()
        for c in conns:
            c.close()
