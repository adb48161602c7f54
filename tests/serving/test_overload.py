"""Acceptance: 256 concurrent clients with long contexts against a 1-replica server (issue 11).

Past capacity the server must say no at once and keep its promises: every request is answered
200 or 429 (never 5xx, never a hang, no 504 storm: admission knows the work queued ahead, the
tokenizer's backlog and the measured rate, so what it admits finishes in time), each 429 carries
``Retry-After``, and the server's memory stays bounded. Before the capacity-aware admission all
256 were admitted and 252 answered 504 after a minute (docs/benchmarks.md).

The latency bound here has headroom for a busy CI machine: the load generator shares the 2 CPU
cores with the server and its rank, and the 256 first requests arrive at once. The measured
figures (429 latency server- and client-side, RSS growth) are in docs/benchmarks.md
(``benchmarks/bench_overload.py``).

Run: python -m pytest tests/serving/test_overload.py -q     (~40 s on 2 cores)
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from loadtest.overload import QUESTION, OverloadConfig, long_context, run_overload

CLIENTS = 256
CONTEXT_CHARS = 20_000
P50_429_BOUND_MS = 2000.0  # measured ~0.33 s client-side, ~5 ms inside the server (docs/benchmarks.md)
RSS_GROWTH_BOUND_MB = 250.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, subprocess.Popen]]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "shardserve", "serve", "--model", "tiny-bert", "--replicas", "1",
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"server exited with {proc.returncode}"
            assert time.monotonic() < deadline, "server not ready after 120 s"
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        body = {"question": QUESTION, "context": long_context(CONTEXT_CHARS)}
        httpx.post(f"{url}/v1/qa", json=body, timeout=120).raise_for_status()  # the rate is measured
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_256_clients_with_long_contexts_get_fast_429s_and_memory_stays_bounded(server) -> None:
    url, proc = server
    cfg = OverloadConfig(url=url, pid=proc.pid, clients=CLIENTS, duration_s=10, context_chars=CONTEXT_CHARS)  # fmt: skip
    report = asyncio.run(run_overload(cfg))
    summary = report.summary()
    assert proc.poll() is None, "the server died under overload"
    assert not report.transport_errors, summary
    assert set(report.latencies_ms) <= {200, 429, 504}, summary  # no 5xx, no 4xx other than shedding
    # it served, and every client it did not serve was told to come back (at least once)
    assert report.count(200) >= 1 and report.count(429) >= CLIENTS - report.count(200), summary
    assert report.missing_retry_after == 0, summary
    # the median 429 comes at once; the tail (requests refused only after tokenizing) is not
    # bounded yet: docs/benchmarks.md
    assert report.latency_ms(429, 50) < P50_429_BOUND_MS, summary
    # admitted work meets its deadline: a few 504s may come from a rate estimate that moved
    assert report.count(504) <= max(2, report.count(200) // 10), summary
    assert report.rss_growth_mb is not None and report.rss_growth_mb < RSS_GROWTH_BOUND_MB, summary
