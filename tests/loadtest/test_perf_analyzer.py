"""Triton's perf_analyzer drives the server (loadtest/perf_analyzer.py): fetched from PyPI into the
test cache, run at concurrency 4 over HTTP with binary and with JSON tensors against a live server on
fake gangs, every request answered. Skipped, with the reason, where the binary cannot be fetched or
started (no registry; no libb64-0d: ``apt-get install libb64-0d``).

Run: python -m pytest tests/loadtest/test_perf_analyzer.py -q
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from loadtest.perf_analyzer import PerfAnalyzerUnavailable, install, run
from serving.frontend.app import build_app
from serving.frontend.settings import ServeSettings
from tests.serving.fakes import FakeFactory
from tests.serving.frontend.test_api import CONTEXT
from tests.serving.live import live_server

PAIRS = [("Which team won Super Bowl 50?", CONTEXT), ("Where did Ann meet Bob?", "Ann met Bob in Paris.")]


@pytest.mark.timeout(900)
def test_perf_analyzer_runs_at_concurrency_4_over_http_binary_and_json() -> None:
    cache = Path(os.environ.get("SHARDSERVE_CACHE", tempfile.gettempdir())) / "perf_analyzer"
    try:
        pa = install(cache)
    except PerfAnalyzerUnavailable as why:
        pytest.skip(str(why))
    factory = FakeFactory()
    settings = ServeSettings(model="tiny-bert", replicas=1, max_queue_delay_ms=1.0, api_key="k3y")
    with live_server(build_app(settings, backend_factory=factory), ready_timeout_s=30) as base:
        url = base.removeprefix("http://")
        auth = {"Authorization": "Bearer k3y"}
        for binary in (True, False):
            (row,) = run(pa, url, "tiny-bert", pairs=PAIRS, concurrency=[4], binary_data=binary, headers=auth)
            assert row["Concurrency"] == 4 and row["Inferences/Second"] > 0, row
        with pytest.raises(RuntimeError, match=r"401|nauthorized|key"):  # the key is checked
            run(pa, url, "tiny-bert", pairs=PAIRS, concurrency=[4])
