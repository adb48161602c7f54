"""Prometheus text parsing and metric selectors used by the /metrics scraper.

python -m pytest tests/loadtest/test_prom.py -q
"""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path

import pytest

from shardserve.loadtest.prom import MetricSelector, MetricsScraper, parse_prometheus_text
from tests.loadtest.stub_server import StubServer

TEXT = """# HELP shardserve_queue_depth Requests waiting.
# TYPE shardserve_queue_depth gauge
shardserve_queue_depth 7
shardserve_replicas{state="ready",model="tiny-bert"} 2
shardserve_replicas{state="starting",model="tiny-bert"} 1
shardserve_request_latency_seconds_bucket{le="0.5"} 3 1700000000000
weird line without value
shardserve_label_escape{path="a\\"b"} 1e3
"""


def test_parse_values_labels_and_timestamps() -> None:
    samples = parse_prometheus_text(TEXT)
    by = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}
    assert by[("shardserve_queue_depth", ())] == 7.0
    assert by[("shardserve_replicas", (("model", "tiny-bert"), ("state", "ready")))] == 2.0
    assert by[("shardserve_request_latency_seconds_bucket", (("le", "0.5"),))] == 3.0
    assert by[("shardserve_label_escape", (("path", 'a"b'),))] == 1000.0
    assert len(samples) == 5


def test_selectors_sum_matching_samples_and_missing_is_nan() -> None:
    samples = parse_prometheus_text(TEXT)
    assert MetricSelector.parse("shardserve_replicas").value(samples) == 3.0
    assert MetricSelector.parse('shardserve_replicas{state="ready"}').value(samples) == 2.0
    assert math.isnan(MetricSelector.parse("shardserve_absent").value(samples))
    assert str(MetricSelector.parse('x{b="2", a="1"}')) == 'x{a="1",b="2"}'
    with pytest.raises(ValueError, match="not NAME"):
        MetricSelector.parse("9bad name")


def test_scraper_writes_rows_and_survives_a_dead_server(tmp_path: Path) -> None:
    with StubServer(replicas=3) as srv:
        live = MetricsScraper(
            url=srv.url + "/metrics",
            selectors={
                "replicas": MetricSelector.parse('shardserve_replicas{state="ready"}'),
                "absent": MetricSelector.parse("shardserve_absent"),
            },
            out_csv=tmp_path / "live.csv",
            interval_s=0.05,
        )
        with open(tmp_path / "live.csv", "w", newline="") as fh:
            live.scrape_once(csv.writer(fh))
        url = srv.url
    # the server is gone now: every scrape fails, rows keep coming with NaN values
    dead = MetricsScraper(
        url=url + "/metrics",
        selectors={"replicas": MetricSelector.parse("shardserve_replicas")},
        out_csv=tmp_path / "dead.csv",
        interval_s=0.05,
    )
    dead.start()
    deadline = time.monotonic() + 20
    while dead.rows < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    dead.stop()
    assert live.rows == 1 and live.failures == 0
    assert (tmp_path / "live.csv").read_text().strip().split(",")[1:] == ["1", "3", "nan"]
    rows = list(csv.DictReader(open(tmp_path / "dead.csv", newline="")))
    assert len(rows) == dead.rows >= 2
    assert rows[0]["ok"] == "0" and rows[0]["replicas"] == "nan"
    assert dead.failures == dead.rows
