"""Triton's perf_analyzer drives the server (loadtest/perf_analyzer.py): fetched from PyPI into the
test cache, run at concurrency 4 over HTTP with binary and with JSON tensors and over gRPC against a
live server on fake gangs, every request answered. Skipped, with the reason, where the binary cannot be fetched or
started (no registry; no libb64-0d: ``apt-get install libb64-0d``).

Run: python -m pytest tests/loadtest/test_perf_analyzer.py -q
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from shardserve.loadtest.perf_analyzer import PerfAnalyzerUnavailable, install, run
from shardserve.partitioner.runtime.fake_gang import FakeFactory
from shardserve.serving.frontend.app import build_app
from shardserve.serving.frontend.settings import ServeSettings
from tests.serving.frontend.api_helpers import CONTEXT
from tests.serving.live import free_port, live_server

PAIRS = [("Which team won Super Bowl 50?", CONTEXT), ("Where did Ann meet Bob?", "Ann met Bob in Paris.")]


@pytest.mark.timeout(900)
def test_perf_analyzer_runs_at_concurrency_4_over_http_and_grpc() -> None:
    cache = Path(os.environ.get("SHARDSERVE_CACHE", tempfile.gettempdir())) / "perf_analyzer"
    try:
        pa = install(cache)
    except PerfAnalyzerUnavailable as why:
        pytest.skip(str(why))
    factory = FakeFactory()
    settings = ServeSettings(
        model="tiny-bert", replicas=1, max_queue_delay_ms=1.0, api_key="k3y", grpc_port=free_port()
    )
    with live_server(build_app(settings, backend_factory=factory), ready_timeout_s=30) as base:
        url = base.removeprefix("http://")
        grpc_url = f"127.0.0.1:{settings.grpc_port}"
        auth = {"authorization": "Bearer k3y"}
        for protocol, where, binary in (("http", url, True), ("http", url, False), ("grpc", grpc_url, True)):
            (row,) = run(
                pa,
                where,
                "tiny-bert",
                pairs=PAIRS,
                concurrency=[4],
                protocol=protocol,
                binary_data=binary,
                headers=auth,
                stability_pct=100,  # a run that completes, not a stable figure: CI's 2 cores are noisy
            )
            assert row["Concurrency"] == 4 and row["Inferences/Second"] > 0, (protocol, binary, row)
        for protocol, where in (("http", url), ("grpc", grpc_url)):
            with pytest.raises(
                RuntimeError, match=r"401|nauthorized|UNAUTHENTICATED|key"
            ):  # the key is checked
                run(pa, where, "tiny-bert", pairs=PAIRS, concurrency=[4], protocol=protocol)
