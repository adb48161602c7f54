"""End-to-end load tests against a stub server on loopback: locust runs headless in a subprocess,
and the report's numbers must equal what the server counted.

python -m pytest tests/loadtest/test_runner.py -q
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardserve.cli import main as shardserve_main
from shardserve.loadtest.checks import is_loopback_host
from shardserve.loadtest.local_server import ServerNotReady, wait_ready
from shardserve.loadtest.report import PLOTS
from shardserve.loadtest.runner import LOCUSTFILE, LoadTestConfig, LoadTestError, run_loadtest
from shardserve.loadtest.scenarios import GammaArrivals, ScenarioConfig
from tests.loadtest.stub_server import StubServer

# locust is never imported here: it monkey-patches the process with gevent on import
if importlib.util.find_spec("locust") is None:
    pytest.skip("locust is in the test extra: pip install -e '.[test]'", allow_module_level=True)
pytest.importorskip("matplotlib", reason="matplotlib is in the test extra: pip install -e '.[test]'")


def _requests(out: Path) -> list[dict[str, str]]:
    with open(out / "requests.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def test_steady_run_report_matches_server_counts(tmp_path: Path) -> None:
    with StubServer(shed_every=4, replicas=2) as srv:
        summary = run_loadtest(
            LoadTestConfig(
                host=srv.url,
                out_dir=str(tmp_path),
                scenario=ScenarioConfig(name="steady", duration_s=3, peak_users=2),
                slo_ms=1000,
                bin_s=1,
                scrape_interval_s=0.5,
            )
        )
        counts = dict(srv.counts)
    assert counts["received"] > 10
    assert summary["requests"] == counts["received"] == len(_requests(tmp_path))
    assert summary["ok"] == counts["ok"] and summary["shed"] == counts["shed"]
    assert summary["shed"] == counts["received"] // 4
    assert summary["failed"] == 0
    assert summary["replicas_min"] == summary["replicas_max"] == 2.0
    assert summary["scrapes"] >= 4 and summary["scrapes_failed"] == 0
    for name in (*PLOTS, "timeseries", "summary", "metrics", "requests"):
        matches = list(tmp_path.glob(f"{name}.*"))
        assert matches and all(m.stat().st_size > 0 for m in matches), name
    rows = list(csv.DictReader(open(tmp_path / "timeseries.csv", newline="")))
    assert sum(int(r["requests"]) for r in rows) == counts["received"]
    assert json.loads((tmp_path / "summary.json").read_text())["requests"] == counts["received"]


def test_bursty_run_sends_exactly_the_gamma_schedule(tmp_path: Path) -> None:
    rate, cv, duration, seed = 25.0, 3.0, 3.0, 5
    clock = GammaArrivals(rate_rps=rate, cv=cv, seed=seed)
    expected = 0
    while clock.next_time() < duration:
        expected += 1
    with StubServer(delay_s=0.005) as srv:
        summary = run_loadtest(
            LoadTestConfig(
                host=srv.url,
                out_dir=str(tmp_path),
                scenario=ScenarioConfig(
                    name="bursty", duration_s=duration, peak_users=16, rate_rps=rate, cv=cv, seed=seed
                ),
                scrape_interval_s=0.5,
            )
        )
        received = srv.counts["received"]
    assert summary["requests"] == received == expected
    assert summary["failed"] == 0
    assert summary["arrival_cv"] > 1.0  # burstier than Poisson, as configured


def test_cli_exits_1_when_answers_have_wrong_offsets(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with StubServer(bad_offsets=True) as srv:
        code = shardserve_main(
            ["loadtest", "--host", srv.url, "--duration", "1.5", "--users", "1", "--out", str(tmp_path)]
        )
        received = srv.counts["received"]
    out = capsys.readouterr().out
    assert code == 1
    assert f"failed={received}" in out and "report:" in out
    errors = {r["error"] for r in _requests(tmp_path)}
    assert len(errors) >= 1 and all("!= context[0:" in e for e in errors)


def test_non_loopback_hosts_are_refused_before_any_traffic(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ValueError, match=r"host='http://10\.1\.2\.3:8000' is not a loopback address"):
        LoadTestConfig(host="http://10.1.2.3:8000")
    assert LoadTestConfig(host="http://10.1.2.3:8000", allow_remote=True).base_url == "http://10.1.2.3:8000"
    assert shardserve_main(["loadtest", "--host", "http://192.168.1.5:8000"]) == 2
    assert "not a loopback address" in capsys.readouterr().err
    assert all(
        is_loopback_host(h)
        for h in ("http://127.0.0.1:1", "http://127.3.4.5", "http://[::1]:8", "http://localhost")
    )
    assert not is_loopback_host("http://8.8.8.8")


def test_wait_ready_gives_up_with_the_last_error() -> None:
    with StubServer() as srv:
        url = srv.url
    with pytest.raises(ServerNotReady, match=r"/readyz not ready after 0\.5 s \(last: .*refused"):
        wait_ready(url, timeout_s=0.5)


def test_plain_locust_run_refuses_a_non_loopback_host(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "SHARDSERVE_DURATION_S": "2",
        "SHARDSERVE_REQUESTS_CSV": str(tmp_path / "requests.csv"),
    }
    env.pop("SHARDSERVE_LOADTEST_CONFIG", None)
    env.pop("SHARDSERVE_ALLOW_REMOTE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", "http://10.9.9.9:1"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "not a loopback address" in proc.stderr + proc.stdout
    assert _requests(tmp_path) == []


def test_requests_unanswered_at_the_end_are_logged_as_failures(tmp_path: Path) -> None:
    with StubServer(hang_after=5) as srv:
        summary = run_loadtest(
            LoadTestConfig(
                host=srv.url,
                out_dir=str(tmp_path),
                scenario=ScenarioConfig(name="steady", duration_s=1.5, peak_users=2),
                stop_timeout_s=1.0,
            )
        )
        received = srv.counts["received"]
    assert received == 7  # 5 answered, then each of the 2 users hangs on its next request
    assert summary["requests"] == received
    assert (summary["ok"], summary["failed"]) == (5, 2)
    assert summary["first_errors"] == ["unfinished when the run stopped (no answer within the stop timeout)"]


def _squad(path: Path, questions: list[str]) -> Path:
    context = "The old bridge in Lisbon was completed in 1901."
    doc = {
        "data": [
            {"title": "t", "paragraphs": [{"context": context, "qas": [{"question": q} for q in questions]}]}
        ]
    }
    path.write_text(json.dumps(doc))
    return path


def test_a_relative_data_path_reaches_locust(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``--data small.json`` from the caller's folder: locust (running in the report folder) reads
    that same file, and the progress lines on stderr count the requests while the run goes."""
    _squad(tmp_path / "small.json", ["When was the bridge completed?", "Where is the bridge?"])
    monkeypatch.chdir(tmp_path)
    with StubServer() as srv:
        code = shardserve_main(
            ["loadtest", "--host", srv.url, "--duration", "2", "--users", "1", "--data", "small.json",
             "--out", "out"]
        )  # fmt: skip
        received = srv.counts["received"]
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert received > 0 and f"requests={received} ok={received}" in captured.out
    assert json.loads((tmp_path / "out" / "run_config.json").read_text())["data"] == str(
        tmp_path.resolve() / "small.json"
    )
    lines = [ln for ln in captured.err.splitlines() if ln.startswith(f"steady load on {srv.url}: ")]
    assert lines and lines[-1].endswith(" failed") and " requests, 0 failed" in lines[-1], captured.err


def test_the_wait_for_readyz_shows_progress(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with StubServer() as srv:
        url = srv.url  # closed again: nothing answers there
    config = LoadTestConfig(host=url, out_dir=str(tmp_path), ready_timeout_s=1.0, progress=True)
    with pytest.raises(LoadTestError, match="not ready after 1 s"):
        run_loadtest(config)
    err = capsys.readouterr().err
    assert f"waiting for {url}/readyz: 0/1 s, last: " in err, err


def test_a_locust_failure_is_one_line_naming_its_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = _squad(tmp_path / "q.json", ["Where?"])
    with StubServer() as srv:
        config = LoadTestConfig(host=srv.url, out_dir=str(tmp_path / "out"), data=str(data))
        data.write_text("[]")  # spoilt after the check: the locust process fails to read it
        monkeypatch.setattr("shardserve.loadtest.runner.check_data_file", lambda path: None)
        with pytest.raises(LoadTestError) as info:
            run_loadtest(config)
    message = str(info.value)
    assert "\n" not in message and message.startswith("locust exited with 1: ValueError: "), message
    assert "not SQuAD format" in message and str(tmp_path / "out" / "locust.log") in message
