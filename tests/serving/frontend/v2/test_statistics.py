"""Triton's statistics extension (serving/frontend/v2/statistics.py): the counts of each model match the
requests it answered and failed whatever their protocol, the phases' times are inside the requests'
times, models are independent, 404 / 401 as v2 errors, and the JSON parses as Triton's protobuf; on
fake gangs. (Triton's HTTP client reads it in v2/test_binary.py's live test.)

Run: python -m pytest tests/serving/frontend/v2/test_statistics.py -q
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest

from shardserve.serving.frontend.v2.statistics import model_statistics
from shardserve.serving.metrics import ServingMetrics
from tests.serving.frontend.api_helpers import ask, serving, wait_busy
from tests.serving.frontend.v2.test_routes import assert_v2_error, infer, infer_body

PHASES = ("queue", "compute_input", "compute_infer", "compute_output")


def parse_as_triton(body: dict[str, Any]) -> Any:
    """``body`` as ``tritonclient.grpc``'s ModelStatisticsResponse (what the gRPC front end answers)."""
    service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
    json_format = pytest.importorskip("google.protobuf.json_format")
    return json_format.ParseDict(body, service_pb2.ModelStatisticsResponse())


def test_model_statistics_reads_counts_and_nanoseconds_from_the_registry() -> None:
    metrics = ServingMetrics()
    m = metrics.for_model("a")
    m.request_duration.labels(outcome="success").observe(0.25)
    m.request_duration.labels(outcome="success").observe(0.5)
    m.request_duration.labels(outcome="fail").observe(1.0)
    m.inferences.inc(5)
    m.request_phase.labels(phase="queue").observe(0.125)
    for size, seconds in ((10, 0.5), (2, 0.25), (2, 0.25)):
        m.executions.labels(batch_size=str(size)).observe(seconds)
    metrics.for_model("b").inferences.inc(7)  # another model's series are not a's
    served = SimpleNamespace(name="a", generation=1)  # an engine, as stats read it
    (a,) = model_statistics(metrics, [served])["model_stats"]  # type: ignore[list-item]
    stats = a["inference_stats"]
    assert (a["inference_count"], a["execution_count"], a["last_inference"], a["version"]) == (5, 3, 0, "2")
    assert stats["success"] == {"count": 2, "ns": 750_000_000} and stats["fail"] == {"count": 1, "ns": 10**9}
    assert stats["queue"] == {"count": 1, "ns": 125_000_000}
    assert stats["compute_infer"] == stats["cache_hit"] == {"count": 0, "ns": 0}
    assert [(b["batch_size"], b["compute_infer"]) for b in a["batch_stats"]] == [
        (2, {"count": 2, "ns": 500_000_000}),  # by size as a number: 2 before 10
        (10, {"count": 1, "ns": 500_000_000}),
    ]
    parsed = parse_as_triton({"model_stats": [a]})
    assert parsed.model_stats[0].batch_stats[1].compute_infer.ns == 500_000_000


def test_each_model_s_stats_count_its_answered_requests_whatever_their_protocol() -> None:
    with serving(model=["a=tiny-bert", "b=tiny-bert"]) as (client, _):
        assert "statistics" in client.get("/v2").json()["extensions"]
        before_ms = time.time() * 1000
        for _ in range(2):  # 2 pairs each over v2, one over the native API: 3 requests, 5 pairs
            assert infer(client, infer_body(), model="a").status_code == 200
        assert ask(client, model="a").status_code == 200
        after_ms = time.time() * 1000
        body = client.get("/v2/models/a/stats").json()
        (a,) = body["model_stats"]
        stats = a["inference_stats"]
        assert a["name"] == "a" and a["version"] == "1"  # as in the repository index
        assert (a["inference_count"], stats["success"]["count"], stats["fail"]["count"]) == (5, 3, 0)
        assert before_ms <= a["last_inference"] <= after_ms
        assert a["execution_count"] == sum(b["compute_infer"]["count"] for b in a["batch_stats"]) >= 1
        for phase in PHASES:
            assert stats[phase]["count"] == 3 and 0 < stats[phase]["ns"] <= stats["success"]["ns"], phase
        assert sum(stats[p]["ns"] for p in PHASES) <= stats["success"]["ns"]  # phases of each request
        assert parse_as_triton(body).model_stats[0].inference_stats.success.count == 3

        b = client.get("/v2/models/b/stats").json()["model_stats"][0]  # no request yet: zeros
        assert (b["inference_count"], b["last_inference"], b["batch_stats"]) == (0, 0, [])
        assert ask(client, model="b").status_code == 200
        both = client.get("/v2/models/stats").json()
        assert [s["name"] for s in both["model_stats"]] == ["a", "b"]
        assert both["model_stats"][0]["inference_count"] == 5  # b's request is b's only
        assert both["model_stats"][1]["inference_stats"]["success"]["count"] == 1
        assert len(parse_as_triton(both).model_stats) == 2

        missing = client.get("/v2/models/nope/stats")
        assert "nope" in assert_v2_error(missing, 404)


def test_a_request_that_failed_in_the_engine_is_a_failure_and_a_refused_one_is_not() -> None:
    with serving(max_inflight_per_replica=1, max_batch_size=1) as (client, factory):
        factory.gate.clear()
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(ask, client)
            wait_busy(client)
            late = infer(client, infer_body(parameters={"timeout_s": 0.2}), model="tiny-bert")
            assert_v2_error(late, 504)  # admitted, expired in the queue
            assert_v2_error(infer(client, infer_body(["q"]), model="tiny-bert"), 400)  # never admitted
            factory.gate.set()
            assert held.result(timeout=10).status_code == 200
        stats = client.get("/v2/models/tiny-bert/stats").json()["model_stats"][0]["inference_stats"]
    assert stats["success"]["count"] == 1 and stats["fail"]["count"] == 1
    assert stats["fail"]["ns"] >= 200_000_000  # it failed at its deadline
    # the phases of the answered request only (Triton's): every phase counts the same requests
    assert [stats[p]["count"] for p in PHASES] == [1] * len(PHASES)


def test_stats_need_the_api_key_when_one_is_set() -> None:
    with serving(api_key="k3y") as (client, _):
        for path in ("/v2/models/tiny-bert/stats", "/v2/models/stats"):
            assert_v2_error(client.get(path), 401)
            ok = client.get(path, headers={"Authorization": "Bearer k3y"})
            assert ok.status_code == 200 and ok.json()["model_stats"][0]["name"] == "tiny-bert"
