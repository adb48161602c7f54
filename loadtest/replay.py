"""Open-loop trace replay: send each request of a ``(time_s, model)`` trace at its time, whatever the
server's answers so far, and record what came back.

A closed-loop client waits for its answer before it asks again, so a slow server gets fewer
requests: the load it measures is not the load it was given. Bursty arrivals (a Gamma process
with a large coefficient of variation, ``partitioner/placement/workload.py``) only stress a server
open-loop: a burst of 16 requests in the same millisecond arrives as 16 concurrent requests. Each
request goes on a connection of its own (reused once idle: ``loadtest/http11.py``), carries its
model's name and, when ``timeout_s`` is given, its deadline (the server refuses with 429, or
answers 504, what it cannot finish in time).

    trace = Workload((ArrivalSpec("a", 5.0, cv=4.0), ArrivalSpec("b", 5.0, cv=4.0)), 60.0).trace()
    sent = asyncio.run(replay("http://127.0.0.1:8000", trace, question=Q, context=C, timeout_s=0.2))
    attainment(sent, slo_s=0.2)      # share answered 200 within the SLO (by model: per_model=True)

Used by ``benchmarks/bench_multimodel.py``; tested in ``tests/loadtest/test_replay.py``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from shardserve.loadtest.http11 import KEEPALIVE_EXPIRY_S, post_request, read_response
from shardserve.partitioner.placement.workload import Trace


@dataclass(frozen=True)
class Sent:
    """One replayed request: its model, when it was due (s from the start), how late the client sent
    it, the status (0: no answer: a transport error) and the latency from due time to answer."""

    model: str
    due_s: float
    send_lag_s: float
    status: int
    latency_s: float


class _Connections:
    """Idle keep-alive connections to one server, reused newest first."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.idle: list[tuple[float, asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def take(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        now = time.monotonic()
        while self.idle:
            used, reader, writer = self.idle.pop()
            if now - used < KEEPALIVE_EXPIRY_S and not writer.is_closing():
                return reader, writer
            writer.close()
        return await asyncio.open_connection(self.host, self.port)

    def give(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.idle.append((time.monotonic(), reader, writer))

    def close(self) -> None:
        for _, _, writer in self.idle:
            writer.close()
        self.idle.clear()


async def replay(
    url: str,
    trace: Trace,
    *,
    question: str,
    context: str,
    timeout_s: float | None = None,
    client_timeout_s: float = 60.0,
    path: str = "/v1/qa",
) -> list[Sent]:
    """Send every request of ``trace`` to ``url`` at its time (open loop); one ``Sent`` per request,
    in trace order."""
    conns = _Connections(url)
    bodies = {
        m: json.dumps(
            {"question": question, "context": context, "model": m}
            | ({"timeout_s": timeout_s} if timeout_s is not None else {})
        ).encode()
        for m in trace.models
    }
    requests = {m: post_request(url, path, body) for m, body in bodies.items()}
    start = time.monotonic() + 0.05

    async def one(due: float, model: str) -> Sent:
        await asyncio.sleep(max(0.0, start + due - time.monotonic()))
        sent_at = time.monotonic()
        try:
            reader, writer = await conns.take()
            writer.write(requests[model])
            await writer.drain()
            status, headers, _ = await asyncio.wait_for(read_response(reader), client_timeout_s)
            if headers.get("connection") == "close":
                writer.close()
            else:
                conns.give(reader, writer)
        except (OSError, EOFError, TimeoutError, asyncio.IncompleteReadError, ValueError):
            status = 0
        return Sent(model, due, sent_at - (start + due), status, time.monotonic() - (start + due))

    try:
        return list(await asyncio.gather(*(one(t, m) for t, m in trace.requests)))
    finally:
        conns.close()


def attainment(sent: Sequence[Sent], *, slo_s: float) -> float:
    """Share of the requests answered 200 within ``slo_s`` of their due time (1.0 when none)."""
    if not sent:
        return 1.0
    return sum(1 for s in sent if s.status == 200 and s.latency_s <= slo_s) / len(sent)


def summary(sent: Sequence[Sent], *, slo_s: float) -> dict[str, object]:
    """Counts by status, attainment, and the client's own lag (how late it sent: its time on the cores)."""
    statuses: dict[str, int] = {}
    for s in sent:
        statuses[str(s.status)] = statuses.get(str(s.status), 0) + 1
    lags = sorted(s.send_lag_s for s in sent)
    return {
        "requests": len(sent),
        "attainment": round(attainment(sent, slo_s=slo_s), 6),
        "statuses": statuses,
        "send_lag_p99_ms": round(1000 * lags[int(0.99 * (len(lags) - 1))], 3) if lags else None,
    }
