"""HTTP API contract over fake in-process gangs (``partitioner/runtime/fake_gang.py``): answers with
exact offsets, windowing, the batch route, no-answer thresholds, health / readiness / models /
OpenAPI, a slash too many, metrics. Bad input: test_api_inputs.py; 429 / 413 / 504 and fairness:
test_api_admission.py; admin, scaling and reload: test_api_admin.py; replica failures, stalls and
drain: test_api_failures.py; the shared helpers (``serving``, ``ask``, ...): api_helpers.py.

Run: python -m pytest tests/serving/frontend/test_api.py -q      (no worker processes; a few seconds)
"""

from __future__ import annotations

import re
import time

import httpx
from fastapi.testclient import TestClient

from shardserve.partitioner.runtime.fake_gang import FakeFactory
from shardserve.serving.frontend.app import build_app
from shardserve.serving.frontend.settings import ServeSettings
from tests.serving.frontend.api_helpers import (
    CONTEXT,
    QUESTION,
    ask,
    serving,
    wait_until,
)


def assert_offsets(answers: list[dict], context: str) -> None:
    for a in answers:
        assert context[a["start"] : a["end"]] == a["text"]
        assert 0 <= a["start"] < a["end"] <= len(context)
        assert 0.0 <= a["score"] <= 1.0


# ------------------------------------------------------------------------------------- contract


def test_qa_answers_with_exact_character_offsets() -> None:
    with serving() as (client, _):
        r = ask(client, top_k=3)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == "tiny-bert" and body["windows"] == 1 and body["no_answer"] is False
        assert 1 <= len(body["answers"]) <= 3
        assert_offsets(body["answers"], CONTEXT)
        assert len({(a["start"], a["end"]) for a in body["answers"]}) == len(body["answers"])
        scores = [a["score"] for a in body["answers"]]
        assert scores == sorted(scores, reverse=True)


def test_long_context_is_windowed_and_offsets_stay_exact() -> None:
    long_context = " ".join([CONTEXT] * 6)
    with serving(max_seq_len=64, doc_stride=16, max_question_len=16, length_buckets="32,64") as (client, _):
        r = ask(client, context=long_context, top_k=2, max_answer_length=5)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["windows"] > 3
        assert_offsets(body["answers"], long_context)


def test_batch_endpoint_answers_each_pair_in_order() -> None:
    contexts = [CONTEXT, "Ann met Bob in Paris in 1999.", "Water boils at 100 degrees Celsius at sea level."]
    items = [{"question": "What?", "context": c, "top_k": 2} for c in contexts]
    with serving() as (client, _):
        r = client.post("/v1/qa/batch", json={"items": items})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert len(results) == 3
        for res, c in zip(results, contexts, strict=True):
            assert res["answers"]
            assert_offsets(res["answers"], c)


def test_no_answer_threshold_returns_empty_answers_with_flag() -> None:
    with serving(null_threshold=-1e6) as (client, _):  # any null score beats the span: abstain
        body = ask(client).json()
        assert body["no_answer"] is True and body["answers"] == []
        assert isinstance(body["null_score_diff"], float)


def test_per_request_null_threshold_overrides_the_server() -> None:
    """A request's ``null_threshold`` decides abstention for that pair, over the server's setting."""
    with serving() as (client, _):  # no server threshold: always answers
        first = ask(client).json()
        diff = first["null_score_diff"]
        assert first["no_answer"] is False and first["answers"]
        abstain = ask(client, null_threshold=diff - 0.5).json()
        assert abstain["no_answer"] is True and abstain["answers"] == []
        answer = ask(client, null_threshold=diff + 0.5).json()
        assert answer["no_answer"] is False and answer["answers"] == first["answers"]
        for bad in (1e6, -1001, "0.5", True):
            r = ask(client, null_threshold=bad)
            assert r.status_code == 422, (bad, r.text)
            assert "null_threshold" in r.text
    with serving(null_threshold=-1e6) as (client, _):  # the server abstains ...
        assert ask(client).json()["no_answer"] is True
        body = ask(client, null_threshold=1000).json()  # ... unless the request says otherwise
        assert body["no_answer"] is False and body["answers"]
        items = [
            {"question": QUESTION, "context": CONTEXT, "null_threshold": 1000.0},
            {"question": QUESTION, "context": CONTEXT},
        ]
        results = client.post("/v1/qa/batch", json={"items": items}).json()["results"]
        assert [res["no_answer"] for res in results] == [False, True]


def test_models_health_and_openapi() -> None:
    with serving() as (client, _):
        assert client.get("/healthz").json() == {"status": "alive"}
        ready = client.get("/readyz")
        assert ready.status_code == 200 and ready.json()["ready_replicas"] == 1
        models = client.get("/v1/models").json()
        assert models[0]["model"] == "tiny-bert" and models[0]["plan"]["pp"] == 1
        assert models[0]["checkpoint"]["arch"] == "bert"
        assert [r["state"] for r in models[0]["replicas"]] == ["ready"]
        paths = client.get("/openapi.json").json()["paths"]
        assert {"/v1/qa", "/v1/qa/batch", "/v1/models", "/readyz", "/admin/reload"} <= set(paths)


SLASH_MISFITS = [  # paths of the server with a slash too many (or, /ui, too few)
    ("POST", "/v1/qa/"),
    ("POST", "/v1/qa/batch/"),
    ("GET", "/v1/models/"),
    ("GET", "/readyz/"),
    ("GET", "/metrics/"),
    ("GET", "/openapi.json/"),
    ("GET", "/docs/"),
    ("GET", "/redoc/"),
    ("GET", "/ui"),
    ("GET", "/ui/status/"),
    ("GET", "/v2/"),
    ("GET", "/v2/models/tiny-bert/"),
    ("POST", "/v2/models/tiny-bert/infer/"),
]


def test_a_slash_too_many_is_a_404_never_a_redirect_to_the_host_header() -> None:
    """Starlette's ``redirect_slashes`` answered ``/v1/qa/`` 307 with ``Location:
    http://<the request's Host>/v1/qa`` (an open redirect). Through uvicorn (its proxy headers
    trusted from 127.0.0.1, as served), with a forged Host and X-Forwarded-*: the path's JSON 404."""
    from tests.serving.live import live_server

    app = build_app(ServeSettings(model="tiny-bert", replicas=1), backend_factory=FakeFactory())
    forged = {"Host": "evil.example", "X-Forwarded-Host": "evil.example", "X-Forwarded-Proto": "https"}
    with (
        live_server(app, ready_timeout_s=30) as base,
        httpx.Client(base_url=base, headers=forged, follow_redirects=False) as http,
    ):
        for method, path in SLASH_MISFITS:
            r = http.request(method, path, json={} if method == "POST" else None)
            assert r.status_code == 404 and "location" not in r.headers, (method, path, r.headers)
            if path.startswith("/v2"):  # the Open Inference Protocol's error object
                assert r.json() == {"error": "http_error: Not Found"}, path
            else:
                assert (r.json()["error"], r.json()["detail"]) == ("http_error", "Not Found"), path
        for path in ("/", "/docs", "/redoc", "/openapi.json", "/ui/status", "/ui/static/app.js"):
            assert http.get(path).status_code == 200, path  # the pages, where they are


def test_readyz_is_503_until_a_gang_is_warm() -> None:
    factory = FakeFactory(start_s=0.5)
    app = build_app(ServeSettings(model="tiny-bert"), backend_factory=factory)
    with TestClient(app) as client:
        first = client.get("/readyz")
        assert first.status_code == 503 and first.json()["error"] == "not_ready"
        assert client.get("/healthz").status_code == 200
        r = ask(client)  # admitted while a gang starts: answered once it is ready
        assert r.status_code == 200
        assert client.get("/readyz").status_code == 200


# ------------------------------------------------------------------------------------- metrics


def test_metrics_exports_requests_batches_queue_and_replicas() -> None:
    with serving() as (client, _):
        for _ in range(3):
            assert ask(client).status_code == 200
        text = client.get("/metrics").text
    for needle in (
        'shardserve_requests_total{endpoint="qa",model="tiny-bert",status="200"} 3.0',
        'shardserve_request_latency_seconds_count{endpoint="qa",model="tiny-bert"} 3.0',
        'shardserve_queue_wait_seconds_count{model="tiny-bert"} 3.0',
        # the same context three times: tokenized once (--context-cache-mb is on by default)
        'shardserve_context_cache_lookups_total{model="tiny-bert",result="miss"} 1.0',
        'shardserve_context_cache_lookups_total{model="tiny-bert",result="hit"} 2.0',
        "shardserve_batch_size_windows_count",
        'shardserve_queue_depth_requests{model="tiny-bert"} 0.0',
        'shardserve_replicas{model="tiny-bert",state="ready"} 1.0',
        "shardserve_pipeline_bubble_fraction",
        "shardserve_stage_busy_seconds_total",
    ):
        if "bubble" in needle or "stage_busy" in needle:
            assert f"# HELP {needle}" in text
        else:
            assert needle in text, needle


def test_bubble_fraction_is_near_zero_for_a_one_stage_gang_at_light_load() -> None:
    """The time a replica had work in flight is timed per batch (dispatch to result), not sampled at
    the supervisor's ticks: a one-stage gang busy for all of it shows a bubble near 0, however
    short its batches and the gaps between them."""
    factory = FakeFactory()
    factory.batch_s, factory.report_busy = 0.03, True
    with serving(factory) as (client, _):
        for _ in range(5):
            assert ask(client).status_code == 200
            time.sleep(0.07)
        [replica] = client.app.state.manager.routable()
        assert (
            5 * 0.03 <= replica.active_s < 5 * 0.03 + 0.2
        )  # the batches, plus dispatch overhead; no idle gap
        pattern = r'shardserve_pipeline_bubble_fraction\{model="tiny-bert",replica="r\d+"\} (\S+)'
        text = wait_until(lambda: re.search(pattern, client.get("/metrics").text), what="a bubble sample")
        assert 0.0 <= float(text.group(1)) < 0.4


# ------------------------------------------------------------------------------------- no paths (issue 11.7)


def test_models_endpoint_shows_no_file_system_paths() -> None:
    """Unauthenticated GET /v1/models names the checkpoint, never its absolute path (issue 11.7)."""
    with serving() as (client, _):
        source = client.app.state.manager.model.source
        r = client.get("/v1/models")
        assert r.status_code == 200
        assert str(source.checkpoint) not in r.text and str(source.checkpoint.parent) not in r.text
        info = r.json()[0]["checkpoint"]
        assert info["checkpoint"] == source.checkpoint.name and info["arch"] == "bert"
