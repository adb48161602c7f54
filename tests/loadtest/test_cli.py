"""``shardserve loadtest`` command line: registered in the console script, every flag explained,
configuration errors answered with exit code 2 and the offending numbers.

python -m pytest tests/loadtest/test_cli.py -q
"""

from __future__ import annotations

import argparse

import pytest

from shardserve.cli import build_parser
from shardserve.cli import main as shardserve_main


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
