"""Locust user and load shape for shardserve: SQuAD questions POSTed to ``/v1/qa``, every answer's
character offsets checked against its text, one CSV row per request for the report.

Normally launched by ``shardserve loadtest`` (``loadtest/runner.py``), which writes a run config
and points ``SHARDSERVE_LOADTEST_CONFIG`` at it. It also runs on its own (loopback servers only)::

    SHARDSERVE_SCENARIO=step SHARDSERVE_DURATION_S=40 SHARDSERVE_PEAK_USERS=6 \
        locust -f loadtest/locustfile.py --headless --stop-timeout 5 --host http://127.0.0.1:8000

Outcomes written to the request log (``requests.csv``): ``ok`` (200 with consistent answers),
``shed`` (a deliberate 429 from admission control: counted apart, not a failure) and ``fail``
(anything else: other statuses, connection errors, malformed JSON, offsets that do not match).
Only loopback targets are accepted unless ``SHARDSERVE_ALLOW_REMOTE=1`` (or the runner's
``--allow-remote``); ``--stop-timeout`` lets in-flight requests finish so every one is logged.
Closed-loop users honour ``Retry-After`` (capped) after a 429; the bursty scenario is open loop:
a shared Gamma arrival clock decides when each request starts.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import gevent
from gevent import GreenletExit
from locust import FastHttpUser, LoadTestShape, constant, events, task

from shardserve.loadtest.checks import check_answers, is_loopback_host
from shardserve.loadtest.data import QAItem, load_qa_items
from shardserve.loadtest.scenarios import GammaArrivals, Scenario, ScenarioConfig

logger = logging.getLogger(__name__)

CONFIG_ENV = "SHARDSERVE_LOADTEST_CONFIG"
REQUEST_NAME = "/v1/qa"
SHAPE_START_FILE = "shape_start.txt"  # epoch time of the first shape tick: t = 0 in the report
LOG_COLUMNS = ["start", "latency_ms", "status", "outcome", "lag_ms", "error"]


def _standalone_config() -> dict[str, Any]:
    """Run config from plain environment variables (when not launched by the runner)."""
    env = os.environ
    return {
        "scenario": {
            "name": env.get("SHARDSERVE_SCENARIO", "steady"),
            "duration_s": float(env.get("SHARDSERVE_DURATION_S", "30")),
            "peak_users": int(env.get("SHARDSERVE_PEAK_USERS", "4")),
            "low_users": int(env.get("SHARDSERVE_LOW_USERS", "1")),
            "think_time_s": float(env.get("SHARDSERVE_THINK_TIME_S", "0")),
            "rate_rps": float(env.get("SHARDSERVE_RATE_RPS", "10")),
            "cv": float(env.get("SHARDSERVE_CV", "3")),
            "step_up_at": float(env.get("SHARDSERVE_STEP_UP_AT", "0.25")),
            "step_down_at": float(env.get("SHARDSERVE_STEP_DOWN_AT", "0.6")),
            "seed": int(env.get("SHARDSERVE_SEED", "0")),
        },
        "requests_csv": env.get("SHARDSERVE_REQUESTS_CSV", "requests.csv"),
        "data": env.get("SHARDSERVE_QA_DATA") or None,
    }


def _load_run_config() -> dict[str, Any]:
    path = os.environ.get(CONFIG_ENV)
    if path:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    return _standalone_config()


RUN = _load_run_config()
SCENARIO = Scenario(ScenarioConfig(**RUN["scenario"]))
ITEMS: list[QAItem] = load_qa_items(RUN.get("data"), limit=int(RUN.get("limit", 2000)))
TOP_K = int(RUN.get("top_k", 1))
MAX_ANSWER_LENGTH = int(RUN.get("max_answer_length", 30))
RETRY_AFTER_CAP_S = float(RUN.get("retry_after_cap_s", 1.0))
ARRIVALS = (
    GammaArrivals(rate_rps=SCENARIO.config.rate_rps, cv=SCENARIO.config.cv, seed=SCENARIO.config.seed)
    if SCENARIO.open_loop
    else None
)


class _RequestLog:
    """Appends one row per request to the run's request CSV (single greenlet-safe writer)."""

    def __init__(self, path: str | Path) -> None:
        self._fh = open(path, "w", newline="", encoding="utf-8")
        self._writer = csv.writer(self._fh)
        self._writer.writerow(LOG_COLUMNS)
        self._rows = 0

    def write(self, row: list[object]) -> None:
        if self._fh.closed:
            logger.warning("request after the log was closed: %s", row)
            return
        self._writer.writerow(row)
        self._rows += 1
        if self._rows % 50 == 0:
            self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.flush()
            self._fh.close()


LOG = _RequestLog(RUN["requests_csv"])
T0: list[float] = []  # wall-clock start of the load shape (set on the first tick)


@events.request.add_listener
def _on_request(
    request_type: str,
    name: str,
    response_time: float,
    response_length: int,
    response: Any = None,
    context: dict | None = None,
    exception: BaseException | None = None,
    start_time: float | None = None,
    **_: Any,
) -> None:
    status = int(getattr(response, "status_code", 0) or 0)
    outcome = "fail" if exception is not None else ("shed" if status == 429 else "ok")
    lag_ms = (context or {}).get("lag_ms", 0.0)
    start = start_time if start_time is not None else time.time() - response_time / 1000.0
    error = "" if exception is None else str(exception).replace("\n", " ")[:200]
    LOG.write([f"{start:.4f}", f"{response_time:.2f}", status, outcome, f"{lag_ms:.1f}", error])


@events.init.add_listener
def _loopback_only(environment: Any, **_: Any) -> None:
    """Refuse a non-loopback --host unless the run allows it (runner --allow-remote or env)."""
    allowed = RUN.get("allow_remote") or os.environ.get("SHARDSERVE_ALLOW_REMOTE") == "1"
    host = environment.host or ""
    if not allowed and not is_loopback_host(host):
        logger.error("refusing to load-test %r: not a loopback address (set SHARDSERVE_ALLOW_REMOTE=1)", host)
        sys.exit(2)


@events.quitting.add_listener
def _on_quit(environment: Any, **_: Any) -> None:
    LOG.close()


class QAUser(FastHttpUser):
    """Asks one question at a time; closed loop, or paced by the shared arrival clock (bursty)."""

    wait_time = constant(0)

    def on_start(self) -> None:
        self._rng = random.Random(hash((id(self), SCENARIO.config.seed)))

    def _pace(self) -> float | None:
        """Open loop: sleep until this user's claimed arrival; how late it starts (ms), or None
        when the arrival falls after the scenario's end (nothing is sent)."""
        if ARRIVALS is None or not T0:
            return 0.0
        offset = ARRIVALS.next_time()
        if offset >= SCENARIO.config.duration_s:
            gevent.sleep(1.0)  # the run is ending: idle until locust stops this user
            return None
        delay = T0[0] + offset - time.time()
        if delay > 0:
            gevent.sleep(delay)
            return 0.0
        return -delay * 1000.0

    def _judge(self, resp: Any, item: QAItem) -> float:
        """Mark the response ok / failed; the Retry-After seconds of a 429 (else 0)."""
        if resp.status_code == 429:
            resp.success()  # deliberate shedding: logged as "shed", not a failure
            try:
                return float(resp.headers.get("Retry-After", "0") or 0)
            except ValueError:
                return 0.0
        if resp.status_code != 200:
            resp.failure(f"HTTP {resp.status_code}: {(resp.text or '')[:120]}")
            return 0.0
        try:
            body = resp.json()
        except ValueError as exc:
            resp.failure(f"invalid JSON: {exc}")
            return 0.0
        problem = check_answers(body, item.context, top_k=TOP_K)
        if problem:
            resp.failure(problem)
        return 0.0

    @task
    def ask(self) -> None:
        lag_ms = self._pace()
        if lag_ms is None:
            return
        item = self._rng.choice(ITEMS)
        payload = {
            "question": item.question,
            "context": item.context,
            "top_k": TOP_K,
            "max_answer_length": MAX_ANSWER_LENGTH,
        }
        retry_after = 0.0
        started = time.time()
        try:
            with self.client.post(
                REQUEST_NAME, json=payload, catch_response=True, context={"lag_ms": lag_ms}
            ) as resp:
                retry_after = self._judge(resp, item)
        except GreenletExit:
            # locust stopped this user mid-request (after --stop-timeout): no request event fires,
            # so log it here: an unanswered request is a failure, not a silent gap in the log
            LOG.write([f"{started:.4f}", f"{(time.time() - started) * 1000:.2f}", 0, "fail", f"{lag_ms:.1f}",
                       "unfinished when the run stopped (no answer within the stop timeout)"])  # fmt: skip
            raise
        if retry_after > 0 and ARRIVALS is None:
            gevent.sleep(min(retry_after, RETRY_AFTER_CAP_S))
        elif SCENARIO.config.think_time_s > 0 and ARRIVALS is None:
            gevent.sleep(SCENARIO.config.think_time_s)


class ScenarioShape(LoadTestShape):
    """The chosen scenario's user count at each tick; stops the run at its duration."""

    def tick(self) -> tuple[int, float] | None:
        if not T0:
            T0.append(time.time())
            Path(RUN["requests_csv"]).with_name(SHAPE_START_FILE).write_text(f"{T0[0]:.4f}\n")
        users = SCENARIO.users_at(self.get_run_time())
        if users is None:
            return None
        return users, 100.0  # spawn rate: level changes apply within a tick
