"""Report numbers from a synthetic run folder (known latencies -> known percentiles) and the files.

python -m pytest tests/loadtest/test_report.py -q
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from shardserve.loadtest.report import PLOTS, build_report

T0 = 1_700_000_000.0


def _write_run(folder: Path, *, with_metrics: bool = True) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "run_config.json").write_text(
        json.dumps({"host": "http://127.0.0.1:1", "scenario": {"name": "steady", "peak_users": 2},
                    "slo_ms": 100.0, "bin_s": 1.0, "command": "shardserve loadtest", "phase_times": [1.0]})
    )  # fmt: skip
    (folder / "shape_start.txt").write_text(f"{T0}\n")
    with open(folder / "requests.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["start", "latency_ms", "status", "outcome", "lag_ms", "error"])
        # bin 0: 10 answered requests of 10..100 ms, ending inside [T0, T0+1)
        for i in range(10):
            w.writerow([T0 + 0.1 * i, 10 * (i + 1) * 0.5, 200, "ok", 0, ""])
        # bin 1: 4 answered at 200 ms, 4 shed, 2 failed
        for i in range(4):
            w.writerow([T0 + 1.0 + 0.1 * i, 200, 200, "ok", 0, ""])
        for i in range(4):
            w.writerow([T0 + 1.5 + 0.05 * i, 2, 429, "shed", 0, ""])
        for i in range(2):
            w.writerow([T0 + 1.8 + 0.01 * i, 5, 0, "fail", 3.0, "ConnectionRefusedError"])
    if with_metrics:
        with open(folder / "metrics.csv", "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["time", "ok", "queue_depth", "replicas"])
            w.writerows([[T0 + 0.5, 1, 0, 1], [T0 + 1.5, 1, 4, 2], [T0 + 1.9, 0, "nan", "nan"]])


def test_report_numbers_match_the_request_log(tmp_path: Path) -> None:
    _write_run(tmp_path)
    summary = build_report(tmp_path)
    lat_bin0 = np.array([5 * (i + 1) for i in range(10)], dtype=float)
    assert summary["requests"] == 20 and summary["ok"] == 14
    assert summary["shed"] == 4 and summary["failed"] == 2
    assert summary["shed_rate"] == pytest.approx(0.2)
    all_ok = np.concatenate([lat_bin0, [200.0] * 4])
    assert summary["p50_ms"] == pytest.approx(np.percentile(all_ok, 50))
    assert summary["p99_ms"] == pytest.approx(np.percentile(all_ok, 99))
    # within 100 ms: the 10 fast ones, out of 20 sent (shed and failed miss the SLO)
    assert summary["slo_attainment"] == pytest.approx(10 / 20)
    assert summary["slo_attainment_by_scale"]["2.0"] == pytest.approx(14 / 20)
    assert summary["late_arrivals"] == 2
    assert summary["replicas_max"] == 2.0 and summary["queue_depth_max"] == 4.0
    assert summary["scrapes"] == 3 and summary["scrapes_failed"] == 1
    assert summary["first_errors"] == ["ConnectionRefusedError"]

    rows = list(csv.DictReader(open(tmp_path / "timeseries.csv")))
    assert [float(r["t"]) for r in rows] == [0.0, 1.0]
    assert float(rows[0]["throughput_rps"]) == 10.0 and float(rows[1]["throughput_rps"]) == 4.0
    assert float(rows[0]["p50_ms"]) == pytest.approx(np.percentile(lat_bin0, 50))
    assert float(rows[1]["p95_ms"]) == pytest.approx(200.0)
    assert float(rows[1]["shed_rate"]) == pytest.approx(0.4)
    assert float(rows[0]["slo_attainment"]) == 1.0 and float(rows[1]["slo_attainment"]) == 0.0
    assert float(rows[0]["replicas"]) == 1.0 and float(rows[1]["replicas"]) == 2.0


def test_report_files_exist_and_are_pngs(tmp_path: Path) -> None:
    _write_run(tmp_path)
    build_report(tmp_path)
    for name in PLOTS:
        data = (tmp_path / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    md = (tmp_path / "report.md").read_text()
    assert all(f"({name}.png)" in md for name in PLOTS)
    assert "| p99_ms |" in md and "Reproduce: `shardserve loadtest`" in md
    assert '<img src="overview.png"' in (tmp_path / "report.html").read_text()


def test_missing_metrics_give_empty_series_not_a_crash(tmp_path: Path) -> None:
    _write_run(tmp_path, with_metrics=False)
    summary = build_report(tmp_path)
    assert summary["scrapes"] == 0
    assert "replicas_max" not in summary
    assert (tmp_path / "replicas.png").is_file()
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["requests"] == 20 and not math.isnan(saved["p50_ms"])
