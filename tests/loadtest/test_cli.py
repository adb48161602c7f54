"""``shardserve loadtest`` command line: registered in the console script, every flag explained,
configuration errors answered with exit code 2 and the offending numbers.

python -m pytest tests/loadtest/test_cli.py -q
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import pytest

from shardserve.cli import build_parser
from shardserve.cli import main as shardserve_main
from shardserve.loadtest.local_server import free_port
from shardserve.loadtest.runner import LoadTestConfig


def _loadtest_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["loadtest"]


def test_every_flag_has_help_text() -> None:
    actions = [a for a in _loadtest_parser()._actions if a.option_strings and a.dest != "help"]
    assert len(actions) >= 20
    for action in actions:
        assert action.help and len(action.help) > 15, f"{action.option_strings} has no real help"


def test_defaults_match_the_documented_metric_names() -> None:
    args = _loadtest_parser().parse_args([])
    assert args.queue_metric == "shardserve_queue_depth_requests"
    assert args.replicas_metric == 'shardserve_replicas{state="ready"}'
    assert (args.scenario, args.host) == ("steady", "http://127.0.0.1:8000")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--scenario", "bursty", "--cv", "0.5"], "cv=0.5 must be > 1 for the bursty scenario"),
        (["--users", "2", "--low-users", "3"], "low_users=3 > peak_users=2"),
        (["--slo-ms", "0"], "slo_ms=0.0 must be > 0"),
        (["--queue-metric", "bad name"], "queue_metric"),
    ],
)
def test_bad_flags_exit_2_with_the_numbers(
    argv: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    assert shardserve_main(["loadtest", *argv]) == 2
    assert message in capsys.readouterr().err


def _one_line_error(capsys: pytest.CaptureFixture, argv: list[str], *needles: str) -> str:
    """``shardserve loadtest ARGV`` exits 2 with one ``error:`` line on stderr holding ``needles``."""
    assert shardserve_main(["loadtest", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def _finished_run(folder: Path) -> Path:
    """A minimal finished run folder (run config and a request log of two answers)."""
    folder.mkdir()
    (folder / "run_config.json").write_text(json.dumps({"slo_ms": 100.0, "bin_s": 1.0, "scenario": {}}))
    (folder / "requests.csv").write_text(
        "start,latency_ms,status,outcome,lag_ms,error\n1700000000.0,10,200,ok,0,\n1700000000.5,20,200,ok,0,\n"
    )
    return folder


def test_report_only_mistakes_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "missing"
    _one_line_error(capsys, ["--report-only", str(missing)], f"{missing}: no such folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_error(capsys, ["--report-only", str(empty)], "not a load-test run folder (no run_config.json)")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "run_config.json").write_text("{not json")
    _one_line_error(capsys, ["--report-only", str(corrupt)], "run_config.json: not valid JSON (")
    (corrupt / "run_config.json").write_text("[1, 2]")
    _one_line_error(capsys, ["--report-only", str(corrupt)], "not a run config")
    (corrupt / "run_config.json").write_text("{}")
    _one_line_error(capsys, ["--report-only", str(corrupt)], "no requests.csv")
    (corrupt / "requests.csv").write_text("start,latency_ms\nx,y\n")
    _one_line_error(capsys, ["--report-only", str(corrupt)], "requests.csv: not a request log")
    run = _finished_run(tmp_path / "run")
    _one_line_error(capsys, ["--report-only", str(run), "--bin", "0"], "--bin 0 must be > 0")
    _one_line_error(capsys, ["--report-only", str(run), "--slo-ms", "-1"], "--slo-ms -1 must be > 0")
    _one_line_error(capsys, ["--report-only", str(run), "--bin", "1e-9"], "use a wider --bin")
    assert shardserve_main(["loadtest", "--report-only", str(run), "--bin", "0.5"]) == 0
    assert "requests=2 ok=2" in capsys.readouterr().out


needs_locust = pytest.mark.skipif(
    importlib.util.find_spec("locust") is None or importlib.util.find_spec("matplotlib") is None,
    reason="locust and matplotlib are in the test extra: pip install -e '.[test]'",
)


def _nobody_home() -> list[str]:
    """Flags aiming at a loopback port where nothing listens, with a long readiness wait: a check
    that runs before the wait answers at once; one that runs after it would take a minute."""
    return ["--host", f"http://127.0.0.1:{free_port()}", "--ready-timeout", "60", "--no-progress"]


@needs_locust
def test_an_out_folder_that_cannot_be_made_is_one_line_before_any_wait(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    a_file = tmp_path / "afile"
    a_file.write_text("")
    t0 = time.monotonic()
    _one_line_error(capsys, [*_nobody_home(), "--out", str(a_file)], "is an existing file, not a folder")
    _one_line_error(
        capsys, [*_nobody_home(), "--out", str(a_file / "sub")], "cannot create the report folder", "(--out)"
    )
    assert time.monotonic() - t0 < 10


@needs_locust
@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ({"data": [{"title": "t", "paragraphs": [{"text": "abc"}]}]}, "no questions found"),
        ({"version": "1.1", "data": []}, "no questions found"),
        ([{"question": "q", "context": "c"}], "not SQuAD format"),
        ('{"data": [{"title": "trunc', "not valid JSON"),
    ],
)
def test_a_question_file_locust_cannot_use_is_named_before_waiting_for_the_server(
    tmp_path: Path, capsys: pytest.CaptureFixture, content: object, needle: str
) -> None:
    data = tmp_path / "questions.json"
    data.write_text(content if isinstance(content, str) else json.dumps(content))
    t0 = time.monotonic()
    out = tmp_path / "out"
    _one_line_error(
        capsys, [*_nobody_home(), "--data", str(data), "--out", str(out)], f"--data {data}: {needle}"
    )
    assert time.monotonic() - t0 < 10
    assert not out.exists()  # nothing written for a run that could not start


def test_a_relative_data_path_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """locust runs in the report folder: a path relative to the caller's folder must not reach it."""
    (tmp_path / "small.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    config = LoadTestConfig(data="small.json")
    assert config.data == str(tmp_path.resolve() / "small.json")
