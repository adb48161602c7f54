"""``shardserve loadtest``: run a locust scenario headless against a local server and write a report.

    shardserve serve --model tiny-bert &                    # in another shell
    shardserve loadtest --scenario step --host http://127.0.0.1:8000 --duration 40 --users 6
    shardserve loadtest --scenario bursty --rate 8 --cv 3 --users 8 --out lt-bursty
    shardserve loadtest --report-only lt-bursty --slo-ms 300   # rebuild plots from a finished run

``LOADTEST`` is the command as data (the console script generates its flags from
``LoadTestSettings``). Prints the report path and a one-line summary; exit code 1 when any request
failed (a 429 is deliberate shedding, not a failure), 2 on a configuration error.
"""

from __future__ import annotations

import json
import logging
import math
import shlex
import sys
from pathlib import Path
from typing import Literal

from pydantic import Field

from shardserve.loadtest.report import ReportError
from shardserve.loadtest.runner import (
    DEFAULT_QUEUE_METRIC,
    DEFAULT_REPLICAS_METRIC,
    LoadTestConfig,
    LoadTestError,
    run_loadtest,
)
from shardserve.loadtest.scenarios import SCENARIOS, ScenarioConfig
from shardserve.partitioner.command import Command, Settings

logger = logging.getLogger(__name__)


class LoadTestSettings(Settings):
    """``shardserve loadtest`` (``to_config()``: the ``LoadTestConfig`` that checks the numbers)."""

    scenario: Literal[SCENARIOS] = Field(  # type: ignore[valid-type]
        "steady",
        description="steady: constant users; step: low -> peak (--step-up-at..--step-down-at) -> low; bursty: "
        "open-loop Gamma arrivals at --rate with --cv > 1; ramp-down: peak users falling linearly "
        "to --low-users",
    )
    host: str = Field(
        "http://127.0.0.1:8000", description="server base URL; must be loopback unless --allow-remote"
    )
    duration: float = Field(30.0, description="scenario length in seconds")
    users: int = Field(4, description="peak concurrent users (bursty: the pool picking up arrivals)")
    low_users: int = Field(1, description="users in the low phases of step and at the end of ramp-down")
    think_time: float = Field(0.0, description="closed-loop scenarios: seconds a user waits between answers")
    rate: float = Field(10.0, description="bursty: mean arrivals per second")
    cv: float = Field(
        3.0, description="bursty: coefficient of variation of the Gamma inter-arrival gaps, > 1"
    )
    step_up_at: float = Field(
        0.25, description="step: fraction of --duration where users go from --low-users to --users"
    )
    step_down_at: float = Field(
        0.60, description="step: fraction of --duration where users go back to --low-users"
    )
    seed: int = Field(0, description="seed for the arrival clock")
    slo_ms: float = Field(
        500.0, description="latency SLO for the attainment figure and the latency plot's line"
    )
    bin: float = Field(2.0, description="time-series bin width in seconds")
    scrape_interval: float = Field(1.0, description="seconds between /metrics scrapes")
    queue_metric: str = Field(
        DEFAULT_QUEUE_METRIC,
        description='Prometheus selector for queue depth, NAME or NAME{label="v"}; matching samples are '
        "summed, a missing metric gives an empty series",
    )
    replicas_metric: str = Field(
        DEFAULT_REPLICAS_METRIC, description="Prometheus selector for the replica count, as --queue-metric"
    )
    data: str | None = Field(
        None,
        description="SQuAD-format JSON for questions/contexts (default: ../shared/data/squad pool if "
        "present, else generated questions)",
    )
    top_k: int = Field(1, description="answers requested per question")
    max_answer_length: int = Field(30, description="max answer length in tokens sent with each request")
    ready_timeout: float = Field(60.0, description="seconds to wait for /readyz before giving up")
    cooldown: float = Field(
        0.0, description="seconds to keep scraping /metrics after the load ends, to watch replicas drain"
    )
    stop_timeout: float = Field(
        5.0,
        description="seconds in-flight requests get when the scenario ends; unanswered ones are logged as "
        "failed",
    )
    out: str = Field("loadtest-report", description="report folder")
    allow_remote: bool = Field(
        False, description="allow a non-loopback --host (only for machines you own; off by default)"
    )
    report_only: str | None = Field(
        None,
        description="do not send load: rebuild the report of a finished run in DIR (uses --slo-ms, --bin)",
        json_schema_extra={"metavar": "DIR"},
    )
    no_progress: bool = Field(
        False,
        description="do not show progress on stderr (by default: the wait for /readyz, the run's elapsed "
        "time with requests and failures so far, the cooldown; a bar on a terminal, else a line every 10 s)",
    )

    def to_config(self, *, command: str) -> LoadTestConfig:
        """The run these flags describe (``ValueError`` naming the numbers when they make none)."""
        return LoadTestConfig(
            host=self.host,
            out_dir=self.out,
            scenario=ScenarioConfig(
                name=self.scenario,
                duration_s=self.duration,
                peak_users=self.users,
                low_users=self.low_users,
                think_time_s=self.think_time,
                rate_rps=self.rate,
                cv=self.cv,
                step_up_at=self.step_up_at,
                step_down_at=self.step_down_at,
                seed=self.seed,
            ),
            slo_ms=self.slo_ms,
            bin_s=self.bin,
            scrape_interval_s=self.scrape_interval,
            queue_metric=self.queue_metric,
            replicas_metric=self.replicas_metric,
            data=self.data,
            top_k=self.top_k,
            max_answer_length=self.max_answer_length,
            ready_timeout_s=self.ready_timeout,
            cooldown_s=self.cooldown,
            stop_timeout_s=self.stop_timeout,
            allow_remote=self.allow_remote,
            command=command,
            progress=not self.no_progress,
        )


def _print_summary(out: str, summary: dict) -> None:
    def f(key: str) -> str:
        v = summary.get(key)
        return "n/a" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))

    print(
        f"requests={f('requests')} ok={f('ok')} shed(429)={f('shed')} failed={f('failed')} "
        f"throughput={f('throughput_rps')} rps p50={f('p50_ms')} p95={f('p95_ms')} p99={f('p99_ms')} ms "
        f"SLO({f('slo_ms')} ms) attainment={f('slo_attainment')} replicas max={f('replicas_max')}"
    )
    print(f"report: {Path(out) / 'report.md'}")


def _reproduce_command() -> str:
    argv = sys.argv[1:]
    start = argv.index("loadtest") if "loadtest" in argv else 0
    return "shardserve " + shlex.join(argv[start:])


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _report_only(args: LoadTestSettings) -> int:
    from shardserve.loadtest.report import build_report

    for flag, value in (("--slo-ms", args.slo_ms), ("--bin", args.bin)):
        if not (value > 0 and math.isfinite(value)):
            return _error(f"{flag} {value:g} must be > 0")
    try:
        summary = build_report(args.report_only, slo_ms=args.slo_ms, bin_s=args.bin)
    except ReportError as exc:
        return _error(f"--report-only {exc}")
    except OSError as exc:
        where = exc.filename or args.report_only
        return _error(f"--report-only: cannot write the report into {where}: {exc.strerror or exc}")
    _print_summary(args.report_only, summary)
    return 0


def cmd_loadtest(args: LoadTestSettings) -> int:
    """``shardserve loadtest``: run the scenario (or rebuild a report) and print the summary."""
    if args.report_only:
        return _report_only(args)
    try:
        config = args.to_config(command=_reproduce_command())
    except ValueError as exc:
        return _error(str(exc))
    try:
        summary = run_loadtest(config)
    except (LoadTestError, ReportError) as exc:
        return _error(str(exc))
    _print_summary(args.out, summary)
    if summary.get("first_errors"):
        print("first errors: " + json.dumps(summary["first_errors"]))
    return 1 if summary.get("failed") else 0


LOADTEST = Command(
    "loadtest",
    help="run a locust load scenario headless and write a report with plots",
    description="Run a load scenario (locust, headless, bounded in time) against a running "
    "shardserve server on loopback, scrape its /metrics meanwhile, and write CSV files, PNG "
    "plots (throughput, p50/p95/p99 latency, 429 rate, queue depth, replicas, SLO attainment) "
    "and report.md / report.html into --out.",
    settings=LoadTestSettings,
    run=cmd_loadtest,
)
