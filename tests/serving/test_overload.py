"""Acceptance: 256 concurrent clients with long contexts against a 1-replica server (issue 11).

Past capacity the server must say no at once and keep its promises: every request is answered
200 or 429 (never 5xx, never a hang, no 504 storm: admission knows the work queued ahead, the
tokenizer's backlog and the measured rate, so what it admits finishes in time), each 429 carries
``Retry-After``, and the server's memory stays bounded. Before the capacity-aware admission all
256 were admitted and 252 answered 504 after a minute (docs/benchmarks.md).

The 99th percentile of the 429s must take under 100 ms inside the server, measured by its access
log (``serving/frontend/http/access.py``: from the request entering the app, before its body is read, to the
response; ``--log-level INFO``). A refusal is decided before tokenizing. The start-up tail it used
to have (p99 1.5-3.7 s in this 10 s run on a quiet machine) came from requests admitted on their
reservation and refused only after waiting for the tokenizer behind the burst (fixed: the check
after tokenizing no longer counts later reservations, and reservations must fit 35 % of the time
left, ``serving/engine/scheduler.py``), and from a ~200-300 ms full garbage collection of the start-up
heap that the first burst triggered on the event loop (``gc.freeze()`` after start-up,
``serving/frontend/app.py``). The client-side figures are reported, with a median bound that has headroom
for a busy CI machine: the load generator shares the 2 CPU cores with the server and its rank, and
the 256 first requests arrive at once (the event loop's accept backlog is not in the server's
figure). The measured figures (429 latency server- and client-side, RSS growth) are in
docs/benchmarks.md (``benchmarks/bench_overload.py``).

Run: python -m pytest tests/serving/test_overload.py -q     (~40 s on 2 cores)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shardserve.loadtest.local_server import LocalServer, local_server
from shardserve.loadtest.overload import (
    QUESTION,
    OverloadConfig,
    access_log_latencies,
    long_context,
    run_overload,
)

logger = logging.getLogger(__name__)

CLIENTS = 256
CONTEXT_CHARS = 20_000
# measured (docs/benchmarks.md): 429 p50 < 1 ms and p99 6-9 ms inside the server, p50 0.06-0.11 s
# and p99 0.2 s at the clients (the load generator and the 256 first requests share the 2 cores);
# RSS growth 25-90 MB (was 226-321 before the compact windows)
P99_429_SERVER_BOUND_MS = 100.0  # the acceptance bound of issue 11
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
    # "no" comes at once, decided before tokenizing: the p99 inside the server (module doc)
    logger.info("429 latencies (server = access log, client = load generator) and RSS: %s", summary)
    assert report.latency_ms(429, 99, server=True) < P99_429_SERVER_BOUND_MS, summary
    assert report.latency_ms(429, 50) < P50_429_CLIENT_BOUND_MS, summary
    # admitted work meets its deadline: a few 504s may come from a rate estimate that moved
    assert report.count(504) <= max(2, report.count(200) // 10), summary
    assert report.rss_growth_mb is not None and report.rss_growth_mb < RSS_GROWTH_BOUND_MB, summary
