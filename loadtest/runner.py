"""Run one load test end to end: check the target is loopback and ready, run locust headless in a
subprocess (gevent never enters this process), scrape ``/metrics`` meanwhile, then build the report.

    from shardserve.loadtest.runner import LoadTestConfig, run_loadtest
    summary = run_loadtest(LoadTestConfig(host="http://127.0.0.1:8000", out_dir="lt-out",
                                          scenario=ScenarioConfig(name="step", duration_s=40)))

or ``shardserve loadtest --scenario step --host http://127.0.0.1:8000`` (``loadtest/cli.py``).
Every run is bounded: locust stops at the scenario's duration, and is killed (its whole process
group) ``kill_grace_s`` later if it has not exited. Tests: ``tests/loadtest/test_runner.py``.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from shardserve.loadtest.checks import is_loopback_host
from shardserve.loadtest.data import check_data_file
from shardserve.loadtest.local_server import ServerNotReady, wait_ready
from shardserve.loadtest.progress import StatusLine
from shardserve.loadtest.prom import MetricSelector, MetricsScraper
from shardserve.loadtest.report import MAX_BINS, build_report
from shardserve.loadtest.scenarios import Scenario, ScenarioConfig

logger = logging.getLogger(__name__)

LOCUSTFILE = Path(__file__).resolve().with_name("locustfile.py")
DEFAULT_QUEUE_METRIC = "shardserve_queue_depth_requests"
DEFAULT_REPLICAS_METRIC = 'shardserve_replicas{state="ready"}'


class LoadTestError(RuntimeError):
    """The load test could not run (bad target, server never ready, locust crashed)."""


@dataclass(frozen=True)
class LoadTestConfig:
    """Everything one run needs; validated once, errors print the numbers."""

    host: str = "http://127.0.0.1:8000"
    out_dir: str = "loadtest-report"
    scenario: ScenarioConfig = field(default_factory=ScenarioConfig)
    slo_ms: float = 500.0
    bin_s: float = 2.0
    scrape_interval_s: float = 1.0
    queue_metric: str = DEFAULT_QUEUE_METRIC
    replicas_metric: str = DEFAULT_REPLICAS_METRIC
    data: str | None = None  # SQuAD JSON; None: the shared pool or generated questions
    top_k: int = 1
    max_answer_length: int = 30
    ready_timeout_s: float = 60.0
    cooldown_s: float = 0.0  # keep scraping this long after the load ends (watch the drain)
    stop_timeout_s: float = 5.0  # at the end, in-flight requests get this long; then logged as failed
    kill_grace_s: float = 30.0
    allow_remote: bool = False
    command: str = ""  # the command line that reproduces the run, for the report
    progress: bool = False  # show the readiness wait, the run and the cooldown on stderr

    def __post_init__(self) -> None:
        problems = []
        parts = urllib.parse.urlsplit(self.host)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            problems.append(f"host={self.host!r} must be an http(s) URL like http://127.0.0.1:8000")
        elif not self.allow_remote and not is_loopback_host(self.host):
            problems.append(
                f"host={self.host!r} is not a loopback address (127.0.0.0/8, ::1, localhost); "
                "pass allow_remote / --allow-remote to load-test another machine you own"
            )
        for name in (
            "slo_ms",
            "bin_s",
            "scrape_interval_s",
            "ready_timeout_s",
            "kill_grace_s",
            "stop_timeout_s",
        ):
            if not getattr(self, name) > 0:
                problems.append(f"{name}={getattr(self, name)!r} must be > 0")
        if self.bin_s > 0 and self.scenario.duration_s / self.bin_s > MAX_BINS:
            problems.append(
                f"bin_s={self.bin_s!r} cuts duration_s={self.scenario.duration_s!r} into more than {MAX_BINS} bins"
            )
        if self.cooldown_s < 0:
            problems.append(f"cooldown_s={self.cooldown_s!r} must be >= 0")
        if self.top_k < 1 or self.max_answer_length < 1:
            problems.append(f"top_k={self.top_k} and max_answer_length={self.max_answer_length} must be >= 1")
        for name in ("queue_metric", "replicas_metric"):
            try:
                MetricSelector.parse(getattr(self, name))
            except ValueError as exc:
                problems.append(f"{name}: {exc}")
        if self.data is not None:
            if not Path(self.data).expanduser().is_file():
                problems.append(f"data={self.data!r} is not a file")
            else:  # locust runs in the report folder: hand it a path that does not depend on the cwd
                object.__setattr__(self, "data", str(Path(self.data).expanduser().resolve()))
        if problems:
            raise ValueError("invalid LoadTestConfig: " + "; ".join(problems))

    @property
    def base_url(self) -> str:
        return self.host.rstrip("/")


def equivalent_command(config: LoadTestConfig) -> str:
    """The ``shardserve loadtest`` command line that repeats this run (for the report)."""
    sc = config.scenario
    args = ["shardserve", "loadtest", "--scenario", sc.name, "--host", config.base_url,
            "--duration", f"{sc.duration_s:g}", "--users", str(sc.peak_users), "--low-users", str(sc.low_users),
            "--slo-ms", f"{config.slo_ms:g}", "--bin", f"{config.bin_s:g}"]  # fmt: skip
    if sc.name == "bursty":
        args += ["--rate", f"{sc.rate_rps:g}", "--cv", f"{sc.cv:g}", "--seed", str(sc.seed)]
    if sc.name == "step":
        args += ["--step-up-at", f"{sc.step_up_at:.4g}", "--step-down-at", f"{sc.step_down_at:.4g}"]
    if sc.think_time_s:
        args += ["--think-time", f"{sc.think_time_s:g}"]
    if config.cooldown_s:
        args += ["--cooldown", f"{config.cooldown_s:g}"]
    if config.data:
        args += ["--data", config.data]
    if config.queue_metric != DEFAULT_QUEUE_METRIC:
        args += ["--queue-metric", config.queue_metric]
    if config.replicas_metric != DEFAULT_REPLICAS_METRIC:
        args += ["--replicas-metric", config.replicas_metric]
    if config.allow_remote:
        args.append("--allow-remote")
    return shlex.join([*args, "--out", config.out_dir])


def locust_command(config: LoadTestConfig, out: Path) -> list[str]:
    """The headless locust command line (the scenario's shape sets users and stops the run)."""
    return [
        sys.executable, "-m", "locust",
        "-f", str(LOCUSTFILE),
        "--headless",
        "--host", config.base_url,
        "--csv", str(out / "locust"),
        "--only-summary",
        "--loglevel", "WARNING",
        "--stop-timeout", f"{config.stop_timeout_s:g}",
        "--exit-code-on-error", "0",
    ]  # fmt: skip


def _stop_process_group(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGINT, 10), (signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def prepare_out_dir(out_dir: str | Path) -> Path:
    """The report folder, created if needed (absolute); ``LoadTestError`` when it cannot be written."""
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise LoadTestError(f"report folder {str(out_dir)!r} (--out) is an existing file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LoadTestError(
            f"cannot create the report folder {str(out_dir)!r} (--out): {exc.strerror or exc}"
        ) from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise LoadTestError(f"the report folder {str(out_dir)!r} (--out) is not writable")
    return out


LOCUST_STATS_CSV = "locust_stats.csv"  # written by locust --csv every second: the live counts
SHAPE_START_FILE = "shape_start.txt"  # the locustfile's (not imported here: gevent) t = 0 of the scenario


def scenario_elapsed(out: Path) -> float | None:
    """Seconds since the scenario's first tick (None before locust has started it)."""
    try:
        return max(0.0, time.time() - float((out / SHAPE_START_FILE).read_text().strip()))
    except (OSError, ValueError):
        return None


def live_counts(out: Path) -> str:
    """Requests and failures so far, from locust's own stats CSV ("" before its first write)."""
    try:
        with open(out / LOCUST_STATS_CSV, newline="", encoding="utf-8") as fh:
            for row in csv.DictReader(fh):
                if row.get("Name") == "Aggregated":
                    return f"{int(row['Request Count'])} requests, {int(row['Failure Count'])} failed"
    except (OSError, KeyError, ValueError, csv.Error):
        pass
    return ""


def _locust_failure(returncode: int | None, log_path: Path) -> str:
    """One line: locust's exit code and the last line of its log (the exception, usually)."""
    try:
        lines = [ln.strip() for ln in log_path.read_text(encoding="utf-8", errors="replace").splitlines()]
    except OSError:
        lines = []
    last = next((ln for ln in reversed(lines) if ln), "")
    what = f"locust exited with {returncode}" if returncode else "locust wrote no request log"
    return f"{what}: {last[:300] or 'no output'} (full log: {log_path})"


def run_loadtest(config: LoadTestConfig) -> dict:
    """Run the scenario against ``config.host``; write the report into ``out_dir``; return the summary.

    Everything that can be checked without the server is checked first (locust installed, the
    report folder writable, the question file usable), then ``/readyz`` is awaited."""
    missing = [m for m in ("locust", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:  # found without importing: locust would monkey-patch this process with gevent
        raise LoadTestError(f"{' and '.join(missing)} not installed: pip install -e '.[loadtest]'")
    if config.data is not None:
        try:
            check_data_file(config.data)
        except ValueError as exc:
            raise LoadTestError(f"--data {exc}") from None
    out = prepare_out_dir(config.out_dir)
    scenario = Scenario(config.scenario)
    waiting = StatusLine(
        f"waiting for {config.base_url}/readyz", config.ready_timeout_s, enabled=config.progress, leave=False
    )
    try:
        wait_ready(
            config.base_url,
            timeout_s=config.ready_timeout_s,
            on_poll=lambda waited, last: waiting.update(waited, f"last: {last}"[:80]),
        )
    except ServerNotReady as exc:
        waiting.close()
        raise LoadTestError(str(exc)) from None
    waiting.close("ready")

    run_config = {
        "host": config.base_url,
        "scenario": config.scenario.to_dict(),
        "phase_times": scenario.phase_times(),
        "slo_ms": config.slo_ms,
        "bin_s": config.bin_s,
        "requests_csv": str(out / "requests.csv"),
        "data": config.data,
        "top_k": config.top_k,
        "max_answer_length": config.max_answer_length,
        "queue_metric": config.queue_metric,
        "replicas_metric": config.replicas_metric,
        "command": config.command or equivalent_command(config),
        "allow_remote": config.allow_remote,
        "started_at": None,
        "finished_at": None,
    }
    config_path = out / "run_config.json"
    config_path.write_text(json.dumps(run_config, indent=2), encoding="utf-8")

    scraper = MetricsScraper(
        url=config.base_url + "/metrics",
        selectors={
            "queue_depth": MetricSelector.parse(config.queue_metric),
            "replicas": MetricSelector.parse(config.replicas_metric),
        },
        out_csv=out / "metrics.csv",
        interval_s=config.scrape_interval_s,
    )
    cmd = locust_command(config, out)
    env = dict(os.environ)
    env["SHARDSERVE_LOADTEST_CONFIG"] = str(config_path)
    repo_root = str(LOCUSTFILE.parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH", "")) if p)
    logger.info("running: %s", shlex.join(cmd))

    duration = config.scenario.duration_s
    running = StatusLine(
        f"{config.scenario.name} load on {config.base_url}", duration, enabled=config.progress
    )
    for stale in ("requests.csv", SHAPE_START_FILE, LOCUST_STATS_CSV):  # a previous run's, in a reused --out
        (out / stale).unlink(missing_ok=True)
    scraper.start()
    started_at = time.time()
    log_path = out / "locust.log"
    try:
        with open(log_path, "w", encoding="utf-8") as log_fh:
            proc = subprocess.Popen(
                cmd, env=env, cwd=str(out), stdout=log_fh, stderr=subprocess.STDOUT, start_new_session=True
            )
            bound_s = duration + config.stop_timeout_s + config.kill_grace_s + 20
            t0 = time.monotonic()
            try:
                while True:
                    try:
                        proc.wait(timeout=0.5)
                        break
                    except subprocess.TimeoutExpired:
                        if time.monotonic() - t0 >= bound_s:
                            logger.warning("locust still running past its bound: stopping it")
                            break
                        elapsed = scenario_elapsed(out)
                        if elapsed is None:
                            running.update(0.0, "starting locust")
                        else:
                            stopping = " (stopping: in-flight requests finish)" if elapsed > duration else ""
                            running.update(elapsed, (live_counts(out) or "no requests yet") + stopping)
            finally:
                _stop_process_group(proc)
                running.close(live_counts(out) or None)
        finished_at = time.time()
        if config.cooldown_s > 0:
            cooling = StatusLine("cooldown: scraping /metrics", config.cooldown_s, enabled=config.progress)
            t0 = time.monotonic()
            while (waited := time.monotonic() - t0) < config.cooldown_s:
                cooling.update(waited)
                time.sleep(min(0.5, config.cooldown_s - waited))
            cooling.close()
    finally:
        scraper.stop()

    if proc.returncode not in (0, None) or not (out / "requests.csv").is_file():
        raise LoadTestError(_locust_failure(proc.returncode, log_path))
    run_config["started_at"] = started_at
    run_config["finished_at"] = finished_at
    config_path.write_text(json.dumps(run_config, indent=2), encoding="utf-8")
    return build_report(out)
