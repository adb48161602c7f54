"""Acceptance: 256 concurrent clients with long contexts against a 1-replica server (issue 11).

Past capacity the server must say no at once and keep its promises: every request is answered
200 or 429 (never 5xx, never a hang, no 504 storm: admission knows the work queued ahead, the
tokenizer's backlog and the measured rate, so what it admits finishes in time), each 429 carries
``Retry-After``, and the server's memory stays bounded. Before the capacity-aware admission all
256 were admitted and 252 answered 504 after a minute (docs/benchmarks.md).

The median 429 must take under 100 ms inside the server (its access log: a refusal is decided
before tokenizing). The client-side bound has headroom for a busy CI machine: the load generator shares the 2 CPU
cores with the server and its rank, and the 256 first requests arrive at once. The measured
figures (429 latency server- and client-side, RSS growth) are in docs/benchmarks.md
(``benchmarks/bench_overload.py``).

Run: python -m pytest tests/serving/test_overload.py -q     (~40 s on 2 cores)
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.local_server import LocalServer, local_server
from loadtest.overload import QUESTION, OverloadConfig, access_log_latencies, long_context, run_overload

CLIENTS = 256
CONTEXT_CHARS = 20_000
# measured (docs/benchmarks.md): 429 p50 < 1 ms inside the server, 0.04-0.3 s at the clients (the
# load generator and the 256 first requests share the 2 cores); RSS growth 60-90 MB (was 226-321)
P50_429_SERVER_BOUND_MS = 100.0
P50_429_CLIENT_BOUND_MS = 2000.0
RSS_GROWTH_BOUND_MB = 150.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalServer, Path]]:
    log_path = tmp_path_factory.mktemp("overload") / "server.log"
    serve_args = ["--model", "tiny-bert", "--replicas", "1", "--dtype", "float32"]
    with (
        open(log_path, "w") as log,
        # --log-level INFO: the access log gives the server-side latencies
        local_server(serve_args, global_args=["--log-level", "INFO"], log=log, ready_timeout_s=120) as srv,
    ):
        body = {"question": QUESTION, "context": long_context(CONTEXT_CHARS)}
        httpx.post(f"{srv.url}/v1/qa", json=body, timeout=120).raise_for_status()  # the rate is measured
        yield srv, log_path


def test_256_clients_with_long_contexts_get_fast_429s_and_memory_stays_bounded(
    server: tuple[LocalServer, Path],
) -> None:
    srv, log_path = server
    cfg = OverloadConfig(
        url=srv.url, pid=srv.pid, clients=CLIENTS, duration_s=10, context_chars=CONTEXT_CHARS
    )
    report = asyncio.run(run_overload(cfg))
    report.server_latencies_ms = access_log_latencies(log_path.read_text())
    summary = report.summary()
    assert srv.proc.poll() is None, "the server died under overload"
    assert not report.transport_errors, summary
    assert set(report.latencies_ms) <= {200, 429, 504}, summary  # no 5xx, no 4xx other than shedding
    # it served, and every client it did not serve was told to come back (at least once)
    assert report.count(200) >= 1 and report.count(429) >= CLIENTS - report.count(200), summary
    assert report.missing_retry_after == 0, summary
    # "no" comes at once, decided before tokenizing: the median inside the server (the tail is the
    # work refused after tokenizing because the rate dropped meanwhile: docs/benchmarks.md)
    assert report.latency_ms(429, 50, server=True) < P50_429_SERVER_BOUND_MS, summary
    assert report.latency_ms(429, 50) < P50_429_CLIENT_BOUND_MS, summary
    # admitted work meets its deadline: a few 504s may come from a rate estimate that moved
    assert report.count(504) <= max(2, report.count(200) // 10), summary
    assert report.rss_growth_mb is not None and report.rss_growth_mb < RSS_GROWTH_BOUND_MB, summary
