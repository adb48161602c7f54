"""The autoscaling scenario as a test: a real ``shardserve serve --model tiny-bert`` subprocess with
1..2 replicas and short autoscaler delays, driven by the ``step`` scenario (1 -> 6 -> 1 users).

Checks, from the scraped /metrics and the request log: before the step one replica; during the
step a second replica becomes ready; once it serves, p99 of the answered requests is under a
generous SLO; after the load drops the gang count drains back to the minimum; no request fails
(429 shedding is allowed and counted apart). ~70 s on 2 CPU cores.

python -m pytest tests/loadtest/test_autoscaling.py -q
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

from shardserve.loadtest.local_server import local_server
from shardserve.loadtest.report import read_metrics, read_requests, window_stats
from shardserve.loadtest.runner import LoadTestConfig, run_loadtest
from shardserve.loadtest.scenarios import ScenarioConfig

# locust is never imported here: it monkey-patches the process with gevent on import
if importlib.util.find_spec("locust") is None:
    pytest.skip("locust is in the test extra: pip install -e '.[test]'", allow_module_level=True)
pytest.importorskip(
    "shardserve.serving.frontend.app", reason="needs the HTTP server (serving/frontend/app.py: shardserve serve)"
)

SLO_MS = 1000.0  # generous on purpose: the test checks the scaling behaviour, not the speed
# step: 1 user for 6 s, 6 users until 30 s (room for the decision, ~4 s, and a replica start under
# load, up to ~10 s on 2 busy cores), then 1 user until 48 s (scale-down: look-back 3 s + delay 4 s)
DURATION_S = 48.0
STEP_UP_AT, STEP_DOWN_AT = 6.0 / DURATION_S, 30.0 / DURATION_S
COOLDOWN_S = 3.0


@pytest.fixture
def server(tmp_path: Path):
    serve_args = [
        "--model", "tiny-bert",
        "--min-replicas", "1", "--max-replicas", "2", "--target-ongoing-requests", "2",
        "--upscale-delay-s", "2", "--downscale-delay-s", "4", "--look-back-period-s", "3",
        "--autoscale-interval-s", "0.5", "--drain-timeout-s", "5",
    ]  # fmt: skip
    env = {"SHARDSERVE_CACHE": os.environ.get("SHARDSERVE_CACHE", str(tmp_path / "cache"))}
    log_path = tmp_path / "serve.log"
    with (
        open(log_path, "w") as log,
        local_server(
            serve_args,
            global_args=["--log-level", "INFO"],
            log=log,
            env=env,
            ready_timeout_s=120,
            stop_timeout_s=15,
        ) as srv,
    ):
        yield srv.url, srv.proc, log_path


def test_step_load_scales_up_meets_slo_and_drains_back(server, tmp_path: Path) -> None:
    url, proc, log_path = server
    out = tmp_path / "report"
    try:
        summary = run_loadtest(
            LoadTestConfig(
                host=url,
                out_dir=str(out),
                scenario=ScenarioConfig(
                    name="step",
                    duration_s=DURATION_S,
                    peak_users=6,
                    low_users=1,
                    step_up_at=STEP_UP_AT,
                    step_down_at=STEP_DOWN_AT,
                ),
                slo_ms=SLO_MS,
                bin_s=2.0,
                scrape_interval_s=0.5,
                ready_timeout_s=120,
                cooldown_s=COOLDOWN_S,
            )
        )
    except Exception:
        print(log_path.read_text()[-3000:])
        raise
    assert proc.poll() is None, "the server died during the load test"

    t0 = float((out / "shape_start.txt").read_text())
    step_up, step_down = (t0 + t for t in json.loads((out / "run_config.json").read_text())["phase_times"])
    m = read_metrics(out / "metrics.csv")
    t, replicas = m["time"], m["replicas"]
    seen = ~np.isnan(replicas)
    assert seen.sum() > 20, "replica count not scraped from /metrics"

    before = replicas[seen & (t < step_up)]
    assert len(before) and before.max() == 1, f"replicas before the step: {sorted(set(before))}"
    during = seen & (t >= step_up) & (t < step_down)
    assert replicas[during].max() == 2, f"no scale-up during the step: {sorted(set(replicas[during]))}"
    scaled_at = float(t[during & (replicas == 2)][0])
    assert replicas[seen][-1] == 1, "did not drain back to min_replicas=1 after the load dropped"
    after_up = t > scaled_at
    assert (replicas[seen & after_up & (t > step_down)] == 1).any()

    log = read_requests(out / "requests.csv")
    assert summary["failed"] == 0, summary["first_errors"]
    assert summary["requests"] == summary["ok"] + summary["shed"] > 100
    # with the second replica serving (1 s to settle) until the load drops: p99 under the SLO
    w = window_stats(log, t_from=scaled_at + 1.0, t_to=step_down, slo_ms=SLO_MS)
    assert w.ok >= 20, f"too few answers with 2 replicas to judge p99: {w}"
    assert w.p99_ms <= SLO_MS, f"p99 {w.p99_ms:.0f} ms > SLO {SLO_MS:.0f} ms with 2 replicas"
