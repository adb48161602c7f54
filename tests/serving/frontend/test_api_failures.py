"""HTTP API under failures over fake in-process gangs: a killed, idle or hung replica (its work
retried, readiness truthful), micro-batches slower than the stall timeout, gangs that cannot start
(fatal first, back-off later), every 503 with Retry-After, SIGTERM and a drain that runs out
(helpers: api_helpers.py).

Run: python -m pytest tests/serving/frontend/test_api_failures.py -q      (no worker processes; ~20 s)
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from shardserve.partitioner.runtime.fake_gang import FakeFactory
from shardserve.serving.fleet.replicas import ReplicaState
from shardserve.serving.frontend.app import build_app
from shardserve.serving.frontend.cli import DrainingServer
from shardserve.serving.frontend.settings import ServeSettings
from tests.serving.frontend.api_helpers import (
    CONTEXT,
    QUESTION,
    WORKER_TRACEBACK,
    _submit_async,
    ask,
    serving,
    wait_until,
)

# ------------------------------------------------------------------------------------- replica failures


def test_killed_replica_in_flight_work_is_retried_on_another() -> None:
    with serving(replicas=2, max_batch_size=1) as (client, factory):
        manager = client.app.state.manager
        wait_until(lambda: manager.ready == 2, what="2 ready")
        factory.gate.clear()
        with ThreadPoolExecutor(8) as pool:
            futures = _submit_async(client, pool, 6)
            wait_until(lambda: all(r.inflight_batches for r in manager.routable()), what="both busy")
            victim = manager.routable()[0]
            victim.backend.kill(rank=1)
            wait_until(lambda: victim.state is not ReplicaState.READY, what="victim marked failed")
            factory.gate.set()
            statuses = [f.result(timeout=10).status_code for f in futures]
        assert statuses == [200] * 6
        assert client.app.state.metrics.retried_windows.labels(model="tiny-bert")._value.get() >= 1
        wait_until(lambda: manager.ready == 2 and manager.restarts == 1, what="gang restarted")
        assert client.get("/readyz").status_code == 200


def test_last_replica_killed_answers_503_then_recovers() -> None:
    # the first goes at once to the idle replica, the other two as its second batch (the 200 ms
    # batching delay gathers them): all three in flight, none left queued for the restart
    with serving(restart_backoff_s=0.5, max_queue_delay_ms=200.0) as (client, factory):
        manager = client.app.state.manager
        engine = client.app.state.engine
        factory.gate.clear()
        with ThreadPoolExecutor(4) as pool:
            futures = _submit_async(client, pool, 3)
            wait_until(
                lambda: engine.ongoing == 3 and engine.scheduler.stats().queued_requests == 0,
                what="all three in flight",
            )
            manager.routable()[0].backend.kill()
            statuses = sorted(f.result(timeout=10).status_code for f in futures)
        assert set(statuses) <= {503} and statuses
        r = client.get("/readyz")
        assert r.status_code == 503 and r.json()["error"] == "not_ready"
        factory.gate.set()
        wait_until(lambda: client.get("/readyz").status_code == 200, what="recovery")
        assert ask(client).status_code == 200


def test_idle_replica_death_is_noticed_without_traffic() -> None:
    with serving() as (client, _):
        manager = client.app.state.manager
        manager.routable()[0].backend.kill()
        wait_until(lambda: client.get("/readyz").status_code == 503 or manager.restarts, what="noticed")
        wait_until(lambda: client.get("/readyz").status_code == 200 and manager.restarts == 1, what="restart")


def test_hung_replica_leaves_readiness_and_its_requests_are_retried_in_time() -> None:
    """A rank that stops answering (SIGSTOP) with work in flight (issue 11.3): after half the stall
    timeout the replica no longer counts as ready nor gets work; after the stall timeout it is
    failed and its requests answered by the other replica, long before their deadline."""
    # stall timeout 8 s: readiness drops after 4 s, the failure comes at 8 s; the 4 s between them
    # leave a busy machine time to see the first before the second (with 2 s between them, a CI run
    # on 2 busy cores polled past the window: its health check itself came 1.2 s late)
    with serving(replicas=2, max_batch_size=1, stall_timeout_s=8.0, request_timeout_s=30.0) as (
        client,
        _,
    ):
        manager = client.app.state.manager
        wait_until(lambda: manager.ready == 2, what="2 ready")
        victim = manager.routable()[0]
        victim.backend.hang()
        with ThreadPoolExecutor(8) as pool:
            t0 = time.monotonic()
            futures = _submit_async(client, pool, 6)
            wait_until(lambda: victim.inflight_batches > 0, what="work on the hung replica")
            wait_until(
                lambda: client.get("/readyz").json().get("ready_replicas") == 1, what="truthful readiness"
            )
            assert victim.state is ReplicaState.READY  # readiness dropped before the failure itself
            statuses = [f.result(timeout=30).status_code for f in futures]
            elapsed = time.monotonic() - t0
        assert statuses == [200] * 6
        assert elapsed < 20.0  # stall timeout 8 s + retry, well inside the 30 s deadline
        assert victim.state is not ReplicaState.READY and "stalled" in (victim.error or "")
        assert client.app.state.metrics.retried_windows.labels(model="tiny-bert")._value.get() >= 1
        wait_until(lambda: manager.ready == 2, timeout=15, what="replacement gang")


@pytest.mark.parametrize("reports_layers", [True, False])
def test_a_micro_batch_slower_than_the_stall_timeout_is_progress_while_its_layers_finish(reports_layers):
    """A large model's micro-batch may take longer than the stall timeout on a CPU rank: while its
    ranks' heartbeats report layers finishing, the replica is computing, not hung, and answers; a
    gang that reports nothing inside a batch is failed as stalled (as every gang was before)."""
    factory = FakeFactory()
    factory.batch_s, factory.report_steps = 2.5, reports_layers
    with serving(factory, max_batch_size=1, stall_timeout_s=1.0, request_timeout_s=30.0) as (client, _):
        manager = client.app.state.manager
        (replica,) = manager.routable()
        status = ask(client).status_code
        if reports_layers:
            assert status == 200 and replica.state is ReplicaState.READY and manager.restarts == 0
        else:  # failed at 1 s, and so was the gang its window was retried on: 503
            assert status == 503 and "stalled" in (replica.error or "")


# ------------------------------------------------------------------------------------- start failures, 503s (issue 11)


def test_every_503_carries_retry_after() -> None:
    """Starting, replica lost, shutting down: each 503 says when to come back (issue 11.9)."""
    factory = FakeFactory(start_s=0.5)
    # no replacement gang comes up during the test: the lost requests cannot be retried on one
    # (whether a retry meets the restarted gang or finds none would otherwise be a race); room for
    # the 3 requests in flight even when they arrive as 3 batches (a request still queued when the
    # gang dies waits for the restart instead: not what this test is about)
    settings = ServeSettings(model="tiny-bert", replicas=1, restart_backoff_s=30, max_inflight_per_replica=3)
    app = build_app(settings, backend_factory=factory)
    with TestClient(app) as client:
        starting = client.get("/readyz")
        assert starting.status_code == 503 and int(starting.headers["Retry-After"]) >= 1
        wait_until(lambda: client.get("/readyz").status_code == 200, what="readiness")
        manager, scheduler = client.app.state.manager, client.app.state.engine.scheduler
        factory.gate.clear()
        with ThreadPoolExecutor(4) as pool:
            futures = _submit_async(client, pool, 3)
            wait_until(
                lambda: scheduler.ongoing == 3 and scheduler.stats().queued_requests == 0,
                what="the 3 requests in flight",
            )
            manager.routable()[0].backend.kill()
            lost = [f.result(timeout=10) for f in futures]
        factory.gate.set()
        assert {r.status_code for r in lost} == {503}
        assert all(int(r.headers["Retry-After"]) >= 1 for r in lost)
        no_replica = client.get("/readyz")
        assert no_replica.status_code == 503 and "Retry-After" in no_replica.headers
        client.app.state.shutting_down = True
        for r in (client.get("/readyz"), ask(client)):
            assert r.status_code == 503 and "Retry-After" in r.headers, r.text


def test_first_gang_that_cannot_start_is_fatal_not_retried_forever() -> None:
    """The first gang fails: no endless restarts; readiness says why, in one path-free line (11.4)."""
    factory = FakeFactory()
    factory.fail_start_models.add("tiny-bert")
    factory.start_error = WORKER_TRACEBACK
    app = build_app(
        ServeSettings(model="tiny-bert", replicas=1, restart_backoff_s=0.01), backend_factory=factory
    )
    with TestClient(app) as client:
        manager = client.app.state.manager
        wait_until(lambda: manager.fatal_error is not None, what="fatal error")
        time.sleep(0.3)
        assert len(factory.gangs) == 1  # not retried
        r = client.get("/readyz")
        assert r.status_code == 503 and r.json()["error"] == "failed" and "Retry-After" in r.headers
        fatal = r.json()["detail"]["fatal"]
        assert "no weights found" in fatal and "/srv/" not in fatal and "\n" not in fatal
        assert "/srv/models/secret-run/final" in manager.fatal_error  # the operator's terminal: the path
        assert 'shardserve_replica_failures_total{model="tiny-bert"} 1.0' in client.get("/metrics").text


def test_later_start_failures_back_off_and_show_in_metrics_and_readiness() -> None:
    """After a gang was ready, failing restarts are retried with back-off, counted and shown (11.4)."""
    with serving(replicas=1, restart_backoff_s=0.05) as (client, factory):
        manager = client.app.state.manager
        factory.fail_start_models.add("tiny-bert")
        factory.start_error = WORKER_TRACEBACK
        manager.routable()[0].backend.kill()
        wait_until(lambda: manager.start_failures >= 3, what="three failed restarts")
        assert manager.fatal_error is None  # never fatal once a gang served
        r = client.get("/readyz")
        assert r.status_code == 503 and r.json()["error"] == "not_ready"
        detail = r.json()["detail"]
        assert detail["failed_starts"] >= 3 and detail["consecutive_failures"] >= 3
        assert "no weights found" in detail["last_failure"] and "/srv/" not in detail["last_failure"]
        failures = [
            float(line.split()[-1])
            for line in client.get("/metrics").text.splitlines()
            if line.startswith("shardserve_replica_failures_total{")
        ]
        assert failures and failures[0] >= 4  # the kill + three failed restarts
        starts = len(factory.gangs)
        assert manager._backoff() > 0.05  # exponential: the pause grows with each failure
        factory.fail_start_models.clear()
        wait_until(lambda: manager.ready == 1, timeout=15, what="recovery once the model loads")
        assert len(factory.gangs) > starts


# ------------------------------------------------------------------------------------- shutdown, drain


def test_sigterm_flips_readiness_and_refuses_new_work() -> None:
    with serving() as (client, _):
        app = client.app
        server = DrainingServer(uvicorn.Config(app), app)
        server.handle_exit(signal.SIGTERM, None)
        assert server.should_exit and not server._captured_signals  # exits 0, no re-raised signal
        r = client.get("/readyz")
        assert r.status_code == 503 and r.json()["error"] == "shutting_down"
        refused = ask(client)
        assert refused.status_code == 503 and refused.json()["error"] == "shutting_down"


def test_a_drain_that_runs_out_answers_503_not_uvicorns_500() -> None:
    """Through uvicorn as ``shardserve serve`` configures it: a request still held when the drain's
    time is out gets the JSON 503 (with Retry-After), written before uvicorn cancels what is left
    (which would answer a bare 500), and the server then exits."""
    from tests.serving.live import draining_server, free_port

    factory = FakeFactory()
    settings = ServeSettings(
        model="tiny-bert", replicas=1, host="127.0.0.1", port=free_port(), drain_timeout_s=1.0
    )
    base = f"http://{settings.host}:{settings.port}"
    with draining_server(settings, factory) as (server, app, thread):
        factory.gate.clear()  # the gang holds the request past the drain's time
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(
                httpx.post, f"{base}/v1/qa", json={"question": QUESTION, "context": CONTEXT}, timeout=30
            )
            wait_until(lambda: app.state.engine.ongoing == 1, what="the request in flight")
            t0 = time.monotonic()
            server.handle_exit(signal.SIGTERM, None)
            r = held.result(timeout=30)
        assert r.status_code == 503 and r.json()["error"] == "shutting_down", r.text
        assert "drain time ran out" in r.json()["detail"] and "Retry-After" in r.headers
        assert time.monotonic() - t0 < 1.0 + 2.0
        thread.join(timeout=30)
        assert not thread.is_alive()
