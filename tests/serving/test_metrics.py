"""Prometheus metrics of one server (serving/metrics.py): per-replica series are bounded.

Run: python -m pytest tests/serving/test_metrics.py -q
"""

from __future__ import annotations

import re

from shardserve.serving.frontend.status.board import read_registry
from shardserve.serving.metrics import ServingMetrics
from tests.serving.frontend.api_helpers import ask, serving, wait_until

BUSY = "shardserve_stage_busy_seconds_total"
BUBBLE = "shardserve_pipeline_bubble_fraction"


def _replicas_in(text: str, name: str) -> set[str]:
    return set(re.findall(rf'^{name}\{{model="[^"]*",replica="(r\d+)"', text, re.M))


def test_forget_replica_drops_only_the_series_of_that_gang() -> None:
    everything = ServingMetrics()
    m, other = everything.for_model("a"), everything.for_model("b")
    for replica, busy in (("r0", 1.5), ("r1", 2.25)):
        for stage in ("0", "1"):
            m.stage_busy.labels(replica=replica, stage=stage).inc(busy)
        m.bubble.labels(replica=replica).set(busy / 10)
    other.bubble.labels(replica="r0").set(0.5)  # another model's r0 is another gang
    m.forget_replica("r0")
    m.forget_replica("r9")  # never had series: nothing happens
    snap = read_registry(everything.registry)
    assert snap[(BUBBLE, (("model", "b"), ("replica", "r0")))] == 0.5
    snap = {k: v for k, v in snap.items() if dict(k[1]).get("model") == "a"}
    busy = {dict(lb)["replica"] + "/" + dict(lb)["stage"]: v for (n, lb), v in snap.items() if n == BUSY}
    bubble = {dict(lb)["replica"]: v for (n, lb), v in snap.items() if n == BUBBLE}
    assert busy == {"r1/0": 2.25, "r1/1": 2.25} and bubble == {"r1": 0.225}  # the live gang's values kept


def test_metrics_forget_a_failed_gang_after_its_restart() -> None:
    """Replica ids grow with each restart (r0, r1, ...): /metrics must not keep every gang ever run."""
    # a restart back-off several autoscaler ticks long: the gang is neither ready nor starting meanwhile
    with serving(min_replicas=1, max_replicas=2, restart_backoff_s=1.0, autoscale_interval_s=0.1) as (
        client,
        factory,
    ):
        gang = factory.gangs[0]
        gang.busy_seconds = lambda: [0.75]  # type: ignore[attr-defined]  # the rank reports its busy time
        wait_until(lambda: _replicas_in(client.get("/metrics").text, BUSY) == {"r0"}, what="r0 busy series")
        assert ask(client).status_code == 200
        text = client.get("/metrics").text
        assert re.search(rf'^{BUSY}\{{model="tiny-bert",replica="r0",stage="0"\}} 0\.75$', text, re.M), text
        gang.kill()
        wait_until(
            lambda: (
                [r["id"] for r in client.get("/ui/status").json()["replicas"] if r["state"] == "ready"]
                == ["r1"]
            ),
            what="r1 replacing r0",
        )
        # r0 is gone: its series went with it
        wait_until(lambda: not _replicas_in(client.get("/metrics").text, BUSY), what="r0 series dropped")
        text = client.get("/metrics").text
        assert _replicas_in(text, BUSY) == set() and _replicas_in(text, BUBBLE) == set(), text
        assert (
            'shardserve_replica_restarts_total{model="tiny-bert"} 1.0' in text
        )  # the server-wide counters stay
        # the restart kept the target where it was: no autoscaling decision happened (the lower-bound
        # "up" during the restart back-off used to be counted at every autoscaler tick)
        assert not re.search(r'^shardserve_autoscale_decisions_total\{direction="up"\} [1-9]', text, re.M), (
            text
        )


def test_every_answer_to_a_qa_request_is_counted_whoever_gave_it() -> None:
    """Request validation (422), the API key (401) and the routes (200, 413) all count in
    shardserve_requests_total; before, only the answers of the route handlers did."""
    key = {"authorization": "Bearer k"}
    with serving(api_key="k", max_body_bytes=2048) as (client, _):
        assert (
            client.post(
                "/v1/qa", content=b"{", headers={**key, "content-type": "application/json"}
            ).status_code
            == 422
        )
        assert ask(client).status_code == 401
        assert (
            client.post(
                "/v1/qa", json={"question": "Who?", "context": "Ann met Bob."}, headers=key
            ).status_code
            == 200
        )
        big = {"items": [{"question": "q", "context": "x" * 4096}]}
        assert client.post("/v1/qa/batch", json=big, headers=key).status_code == 413
        text = client.get("/metrics").text
    counted = {
        (endpoint, status): float(value)
        for endpoint, status, value in re.findall(
            r'^shardserve_requests_total\{endpoint="(\w+)",model="[^"]*",status="(\d+)"\} (\S+)$', text, re.M
        )
    }
    assert counted == {("qa", "422"): 1.0, ("qa", "401"): 1.0, ("qa", "200"): 1.0, ("batch", "413"): 1.0}
    # refused before a route read the body (the API key, the JSON): no model named yet, model=""
    latency = re.findall(
        r'^shardserve_request_latency_seconds_count\{endpoint="qa",model="([^"]*)"\} (\S+)$', text, re.M
    )
    assert sorted(latency) == [("", "2.0"), ("tiny-bert", "1.0")], text


def test_forget_model_drops_every_series_of_that_model_only() -> None:
    everything = ServingMetrics()
    for name in ("a", "b"):
        m = everything.for_model(name)
        m.queue_depth.set(2)
        m.batches.labels(reason="full").inc()
        m.request_duration.labels(outcome="success").observe(0.1)  # Triton's statistics (v2/statistics.py)
        m.executions.labels(batch_size="4").observe(0.05)
        m.set_model_info(precision="float32", pp=1, tp=1)
        everything.requests.labels(model=name, endpoint="qa", status="200").inc()
    everything.forget_model("a")
    series = read_registry(everything.registry)
    models = {
        dict(lb).get("model") for (name, lb), _ in series.items() if not name.startswith("shardserve_api_")
    }
    assert models == {"b"}  # every series but the server's own (its API processes)


def test_series_written_again_after_they_were_dropped_are_exported() -> None:
    """Labelled series are kept for the hot path (``ServingMetrics.child``); a series dropped with its
    gang or its model and then written again must reach the registry, not a kept orphan."""
    everything = ServingMetrics()
    m = everything.for_model("a")
    m.stage_busy.labels(replica="r1", stage="0").inc(1.0)
    m.forget_replica("r1")
    m.stage_busy.labels(replica="r1", stage="0").inc(2.0)
    busy = ("shardserve_stage_busy_seconds_total", (("model", "a"), ("replica", "r1"), ("stage", "0")))
    assert read_registry(everything.registry)[busy] == 2.0
    m.queue_depth.set(3)
    everything.forget_model("a")
    again = everything.for_model("a")  # a model loaded again under its old name
    assert again is not m
    again.queue_depth.set(5)
    assert read_registry(everything.registry)[("shardserve_queue_depth_requests", (("model", "a"),))] == 5.0
