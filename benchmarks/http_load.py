"""The HTTP load generators of the serving benchmarks: keep-alive ``POST /v1/qa`` clients on asyncio
over ``shardserve.loadtest.http11`` (no httpx: the load generator must take little of the cores the
server under test uses).

- ``closed_loop``: N clients, each posting its next question as soon as its answer is back
  (``bench_serving.py``);
- ``OpenLoopClient``: queries handed in from other threads (MLPerf's load generator,
  ``bench_mlperf.py``), answered through a callback, at most ``max_connections`` in flight.

    python -m pytest tests/benchmarks/test_bench_helpers.py
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable

from shardserve.loadtest.http11 import post_request, read_response

logger = logging.getLogger("http_load")

IDLE_S = 2.0  # a kept-alive connection idle for longer is not reused (uvicorn closes them after 5 s)


async def post_qa(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes
) -> tuple[int, bytes]:
    """One ``POST /v1/qa`` with a JSON ``body`` on a kept-alive connection: (status, response body);
    the bytes on the wire are ``shardserve.loadtest.http11``'s (EOFError: the server had closed it)."""
    writer.write(post_request("http://bench", "/v1/qa", body))
    await writer.drain()
    status, _, payload = await read_response(reader)
    return status, payload


def closed_loop(
    port: int, bodies: list[bytes], *, clients: int, warmup_s: float, duration_s: float
) -> list[tuple[float, int]]:
    """``clients`` connections posting ``bodies`` in turn for ``warmup_s + duration_s``: the (latency
    s, status) of each answer that ended within the measured window, so ``len / duration_s`` is the
    completion rate, as the raw rows count whole passes. Counting only answers that also started in
    the window left out one answer per client (those in flight at its start): ``clients / rate``
    seconds' worth, 5 % of a 20-s window at 32 clients and 1 s latency."""
    out: list[tuple[float, int]] = []

    async def client(counter: itertools.count, t_measure: float, t_stop: float) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while (t0 := time.perf_counter()) < t_stop:
                status, _ = await post_qa(reader, writer, bodies[next(counter) % len(bodies)])
                t1 = time.perf_counter()
                if t_measure <= t1 <= t_stop:
                    out.append((t1 - t0, status))
        finally:
            writer.close()

    async def main() -> None:
        now = time.perf_counter()
        counter = itertools.count()
        await asyncio.gather(
            *(client(counter, now + warmup_s, now + warmup_s + duration_s) for _ in range(clients))
        )

    asyncio.run(main())
    return out


class OpenLoopClient:
    """Keep-alive HTTP/1.1 connections to one server, driven by an asyncio loop on its own thread:
    loadgen's threads hand it queries (``post``), the loop answers through a callback. A minimal
    client (no httpx) so the load generator takes little of the cores the server uses."""

    def __init__(self, port: int, *, max_connections: int) -> None:
        self.port = port
        self.loop = asyncio.new_event_loop()
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = []  # + idle since
        self.tasks: set[asyncio.Task] = set()  # the loop holds tasks weakly: these keep them alive
        self.thread = threading.Thread(target=self.loop.run_forever, name="http-client", daemon=True)
        self.thread.start()
        self.slots = asyncio.run_coroutine_threadsafe(self._semaphore(max_connections), self.loop).result()

    @staticmethod
    async def _semaphore(n: int) -> asyncio.Semaphore:
        return asyncio.Semaphore(n)

    def post(self, body: bytes, done: Callable[[int, bytes], None]) -> None:
        """POST ``body`` to /v1/qa; ``done(status, response body)`` on the loop's thread."""
        self.loop.call_soon_threadsafe(self._start, body, done)

    def _start(self, body: bytes, done: Callable[[int, bytes], None]) -> None:
        task = self.loop.create_task(self._post(body, done))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _post(self, body: bytes, done: Callable[[int, bytes], None]) -> None:
        async with self.slots:
            status, payload = 599, b""
            for attempt in range(2):  # a kept-alive connection the server closed meanwhile: again, fresh
                conn = self._idle_connection() if attempt == 0 else None
                fresh = conn is None
                if conn is None:
                    conn = await asyncio.open_connection("127.0.0.1", self.port)
                try:
                    status, payload = await post_qa(*conn, body)
                    self.idle.append((*conn, time.monotonic()))
                    break
                except (OSError, EOFError, asyncio.IncompleteReadError, IndexError, ValueError) as e:
                    conn[1].close()
                    status, payload = 599, repr(e).encode()
                    if fresh:
                        logger.warning("no answer on a fresh connection: %r", e)
                        break
        done(status, payload)

    def _idle_connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """The most recently used idle connection; those idle for over ``IDLE_S`` are closed (servers
        close kept-alive connections after a few seconds: uvicorn's default is 5)."""
        now = time.monotonic()
        while self.idle:
            reader, writer, since = self.idle.pop()
            if now - since <= IDLE_S:
                return reader, writer
            writer.close()
        return None

    def close(self) -> None:
        for _, writer, _ in self.idle:
            self.loop.call_soon_threadsafe(writer.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
