"""``shardserve loadtest``: run a locust scenario headless against a local server and write a report.

    shardserve serve --model tiny-bert &                    # in another shell
    shardserve loadtest --scenario step --host http://127.0.0.1:8000 --duration 40 --users 6
    shardserve loadtest --scenario bursty --rate 8 --cv 3 --users 8 --out lt-bursty
    shardserve loadtest --report-only lt-bursty --slo-ms 300   # rebuild plots from a finished run

Prints the report path and a one-line summary; exit code 1 when any request failed (a 429 is
deliberate shedding, not a failure), 2 on a configuration error.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

from loadtest.report import ReportError
from loadtest.runner import (
    DEFAULT_QUEUE_METRIC,
    DEFAULT_REPLICAS_METRIC,
    LoadTestConfig,
    LoadTestError,
    run_loadtest,
)
from loadtest.scenarios import SCENARIOS, ScenarioConfig


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Register ``shardserve loadtest``."""
    p = sub.add_parser(
        "loadtest",
        help="run a locust load scenario headless and write a report with plots",
        description="Run a load scenario (locust, headless, bounded in time) against a running "
        "shardserve server on loopback, scrape its /metrics meanwhile, and write CSV files, PNG "
        "plots (throughput, p50/p95/p99 latency, 429 rate, queue depth, replicas, SLO attainment) "
        "and report.md / report.html into --out.",
    )
    p.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default="steady",
        help="steady: constant users; step: low -> peak (--step-up-at..--step-down-at) -> low; bursty: "
        "open-loop Gamma arrivals at --rate with --cv > 1; ramp-down: peak users falling linearly "
        "to --low-users (default: %(default)s)",
    )
    p.add_argument(
        "--host",
        default="http://127.0.0.1:8000",
        help="server base URL; must be loopback unless --allow-remote (default: %(default)s)",
    )
    p.add_argument(
        "--duration", type=float, default=30.0, help="scenario length in seconds (default: %(default)s)"
    )
    p.add_argument(
        "--users",
        type=int,
        default=4,
        help="peak concurrent users (bursty: the pool picking up arrivals) (default: %(default)s)",
    )
    p.add_argument(
        "--low-users",
        type=int,
        default=1,
        help="users in the low phases of step and at the end of ramp-down (default: %(default)s)",
    )
    p.add_argument(
        "--think-time",
        type=float,
        default=0.0,
        help="closed-loop scenarios: seconds a user waits between answers (default: %(default)s)",
    )
    p.add_argument(
        "--rate", type=float, default=10.0, help="bursty: mean arrivals per second (default: %(default)s)"
    )
    p.add_argument(
        "--cv",
        type=float,
        default=3.0,
        help="bursty: coefficient of variation of the Gamma inter-arrival gaps, > 1 (default: %(default)s)",
    )
    p.add_argument(
        "--step-up-at",
        type=float,
        default=0.25,
        help="step: fraction of --duration where users go from --low-users to --users (default: %(default)s)",
    )
    p.add_argument(
        "--step-down-at",
        type=float,
        default=0.60,
        help="step: fraction of --duration where users go back to --low-users (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for the arrival clock (default: %(default)s)")
    p.add_argument(
        "--slo-ms",
        type=float,
        default=500.0,
        help="latency SLO for the attainment figure and the latency plot's line (default: %(default)s)",
    )
    p.add_argument(
        "--bin", type=float, default=2.0, help="time-series bin width in seconds (default: %(default)s)"
    )
    p.add_argument(
        "--scrape-interval",
        type=float,
        default=1.0,
        help="seconds between /metrics scrapes (default: %(default)s)",
    )
    p.add_argument(
        "--queue-metric",
        default=DEFAULT_QUEUE_METRIC,
        help='Prometheus selector for queue depth, NAME or NAME{label="v"}; matching samples are '
        "summed, a missing metric gives an empty series (default: %(default)s)",
    )
    p.add_argument(
        "--replicas-metric",
        default=DEFAULT_REPLICAS_METRIC,
        help="Prometheus selector for the replica count, as --queue-metric (default: %(default)s)",
    )
    p.add_argument(
        "--data",
        default=None,
        help="SQuAD-format JSON for questions/contexts (default: ../shared/data/squad pool if "
        "present, else generated questions)",
    )
    p.add_argument(
        "--top-k", type=int, default=1, help="answers requested per question (default: %(default)s)"
    )
    p.add_argument(
        "--max-answer-length",
        type=int,
        default=30,
        help="max answer length in tokens sent with each request (default: %(default)s)",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for /readyz before giving up (default: %(default)s)",
    )
    p.add_argument(
        "--cooldown",
        type=float,
        default=0.0,
        help="seconds to keep scraping /metrics after the load ends, to watch replicas drain "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--stop-timeout",
        type=float,
        default=5.0,
        help="seconds in-flight requests get when the scenario ends; unanswered ones are logged as "
        "failed (default: %(default)s)",
    )
    p.add_argument("--out", default="loadtest-report", help="report folder (default: %(default)s)")
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a non-loopback --host (only for machines you own; off by default)",
    )
    p.add_argument(
        "--report-only",
        metavar="DIR",
        default=None,
        help="do not send load: rebuild the report of a finished run in DIR (uses --slo-ms, --bin)",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="do not show progress on stderr (by default: the wait for /readyz, the run's elapsed time "
        "with requests and failures so far, the cooldown; a bar on a terminal, else a line every 10 s)",
    )
    p.set_defaults(func=cmd_loadtest)


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


def _report_only(args: argparse.Namespace) -> int:
    from loadtest.report import build_report

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


def cmd_loadtest(args: argparse.Namespace) -> int:
    if args.report_only:
        return _report_only(args)
    try:
        config = LoadTestConfig(
            host=args.host,
            out_dir=args.out,
            scenario=ScenarioConfig(
                name=args.scenario,
                duration_s=args.duration,
                peak_users=args.users,
                low_users=args.low_users,
                think_time_s=args.think_time,
                rate_rps=args.rate,
                cv=args.cv,
                step_up_at=args.step_up_at,
                step_down_at=args.step_down_at,
                seed=args.seed,
            ),
            slo_ms=args.slo_ms,
            bin_s=args.bin,
            scrape_interval_s=args.scrape_interval,
            queue_metric=args.queue_metric,
            replicas_metric=args.replicas_metric,
            data=args.data,
            top_k=args.top_k,
            max_answer_length=args.max_answer_length,
            ready_timeout_s=args.ready_timeout,
            cooldown_s=args.cooldown,
            stop_timeout_s=args.stop_timeout,
            allow_remote=args.allow_remote,
            command=_reproduce_command(),
            progress=not args.no_progress,
        )
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
