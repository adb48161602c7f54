"""Open Inference Protocol (KServe v2) routes, checked against the spec (kserve/open-inference-protocol,
``inference_rest.md``): health, server / model metadata and readiness, inference with BYTES inputs of
shape [N] / [N, 1] and typed outputs, the ``{"error": message}`` object with its 4xx, 404 for another
model, the API key, and the same engine path as /v1/qa/batch (answers, 429 with Retry-After).

Run: python -m pytest tests/serving/frontend/v2/test_routes.py -q      (fake in-process gangs; a few seconds)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from fastapi.testclient import TestClient

from shardserve.partitioner.runtime.fake_gang import FakeFactory
from tests.serving.frontend.api_helpers import CONTEXT, QUESTION, ask, serving, wait_busy, wait_until

NAME = "squad-qa"
KEY = "v2-api-key"
CONTEXTS = [CONTEXT, "Ann met Bob in Paris in 1999."]
QUESTIONS = [QUESTION, "Where did Ann meet Bob?"]


def tensor(name: str, data: list[Any], *, shape: list[int] | None = None, datatype: str = "BYTES") -> dict:
    return {"name": name, "shape": shape or [len(data)], "datatype": datatype, "data": data}


def infer_body(questions: list[Any] = QUESTIONS, contexts: list[Any] = CONTEXTS, **extra: Any) -> dict:
    return {"inputs": [tensor("question", questions), tensor("context", contexts)], **extra}


def infer(client: TestClient, body: dict, *, model: str = NAME, **kw: Any) -> Any:
    return client.post(f"/v2/models/{model}/infer", json=body, **kw)


def outputs(response: Any) -> dict[str, dict]:
    return {o["name"]: o for o in response.json()["outputs"]}


def assert_v2_error(response: Any, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"], body
    return body["error"]


@pytest.fixture(scope="module")
def shared() -> Iterator[tuple[TestClient, FakeFactory]]:
    """One server for the many bad-request cases (none of them changes its state)."""
    with serving(served_model_name=NAME) as running:
        yield running


# ------------------------------------------------------------------------------------- health, metadata


def test_server_metadata_and_health() -> None:
    with serving(served_model_name=NAME) as (client, _):
        meta = client.get("/v2").json()
        assert (
            meta["name"] == "shardserve"
            and isinstance(meta["version"], str)
            and meta["extensions"]
            == ["binary_tensor_data", "model_repository", "model_configuration", "statistics"]
        )
        live = client.get("/v2/health/live")
        assert live.status_code == 200 and live.json() == {"live": True}
        ready = client.get("/v2/health/ready")
        assert ready.status_code == 200 and ready.json() == {"ready": True}
        model_ready = client.get(f"/v2/models/{NAME}/ready")
        assert model_ready.status_code == 200 and model_ready.json() == {"name": NAME, "ready": True}


def test_not_ready_is_a_4xx_with_ready_false() -> None:
    """The spec: a 200 status is true, a 4xx false (readiness never lies while draining)."""
    with serving(served_model_name=NAME) as (client, _):
        client.app.state.shutting_down = True
        try:
            r = client.get("/v2/health/ready")
            assert r.status_code == 400 and r.json() == {"ready": False}
            r = client.get(f"/v2/models/{NAME}/ready")
            assert r.status_code == 400 and r.json() == {"name": NAME, "ready": False}
            assert client.get("/v2/health/live").json() == {"live": True}
        finally:
            client.app.state.shutting_down = False


def test_model_metadata_names_the_tensors() -> None:
    with serving(served_model_name=NAME) as (client, _):
        meta = client.get(f"/v2/models/{NAME}").json()
        assert meta["name"] == NAME and meta["platform"] == "pytorch_shardserve"
        assert "versions" not in meta  # unversioned model: the field is optional and absent
        assert meta["inputs"] == [
            {"name": "question", "datatype": "BYTES", "shape": [-1]},
            {"name": "context", "datatype": "BYTES", "shape": [-1]},
        ]
        types = {o["name"]: (o["datatype"], o["shape"]) for o in meta["outputs"]}
        assert types == {
            "answer": ("BYTES", [-1, -1]),
            "score": ("FP32", [-1, -1]),
            "start": ("INT64", [-1, -1]),
            "end": ("INT64", [-1, -1]),
            "no_answer": ("BOOL", [-1]),
        }


def test_unknown_model_is_404_in_the_v2_error_format() -> None:
    with serving(served_model_name=NAME) as (client, _):
        for r in (
            client.get("/v2/models/tiny-bert"),
            client.get("/v2/models/other/ready"),
            infer(client, infer_body(), model="Squad-QA"),  # names are case-sensitive
        ):
            assert "not found" in assert_v2_error(r, 404)


def test_default_model_name_is_the_loaded_model() -> None:
    with serving() as (client, _):
        assert client.get("/v2/models/tiny-bert").json()["name"] == "tiny-bert"
        assert infer(client, infer_body(), model="tiny-bert").json()["model_name"] == "tiny-bert"


# ------------------------------------------------------------------------------------- inference


def test_batch_of_two_returns_typed_tensors_with_exact_offsets() -> None:
    with serving(served_model_name=NAME) as (client, _):
        r = infer(client, infer_body(id="42"))
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model_name"] == NAME and body["id"] == "42" and "model_version" not in body
        out = outputs(r)
        assert [o["name"] for o in body["outputs"]] == ["answer", "score", "start", "end", "no_answer"]
        expected = {"answer": "BYTES", "score": "FP32", "start": "INT64", "end": "INT64", "no_answer": "BOOL"}
        for name, datatype in expected.items():
            assert out[name]["datatype"] == datatype
            assert out[name]["shape"] == ([2] if name == "no_answer" else [2, 1])
        for i, context in enumerate(CONTEXTS):
            text, start, end = out["answer"]["data"][i], out["start"]["data"][i], out["end"]["data"][i]
            assert isinstance(start, int) and isinstance(end, int) and context[start:end] == text
            assert 0.0 <= out["score"]["data"][i] <= 1.0
        assert out["no_answer"]["data"] == [False, False]
        # the same engine path as /v1/qa/batch: the same answers
        native = client.post(
            "/v1/qa/batch",
            json={"items": [{"question": q, "context": c} for q, c in zip(QUESTIONS, CONTEXTS, strict=True)]},
        ).json()["results"]
        assert [res["answers"][0]["text"] for res in native] == out["answer"]["data"]
        assert [res["answers"][0]["start"] for res in native] == out["start"]["data"]
        metrics = client.get("/metrics").text
        assert f'shardserve_requests_total{{endpoint="v2_infer",model="{NAME}",status="200"}} 1.0' in metrics


def test_shape_n_by_1_nested_data_and_top_k_rows() -> None:
    with serving(served_model_name=NAME) as (client, _):
        body = {
            "inputs": [
                tensor("question", [[q] for q in QUESTIONS], shape=[2, 1]),
                tensor("context", [[c] for c in CONTEXTS], shape=[2, 1]),
            ],
            "parameters": {"top_k": 3, "max_answer_length": 10},
        }
        r = infer(client, body)
        assert r.status_code == 200, r.text
        out = outputs(r)
        assert out["answer"]["shape"] == out["score"]["shape"] == out["start"]["shape"] == [2, 3]
        assert len(out["answer"]["data"]) == 6  # row-major, flattened
        for i, context in enumerate(CONTEXTS):
            row = slice(3 * i, 3 * i + 3)
            for text, start, end, score in zip(
                out["answer"]["data"][row],
                out["start"]["data"][row],
                out["end"]["data"][row],
                out["score"]["data"][row],
                strict=True,
            ):
                if start == -1:  # padding of a row with fewer than K answers
                    assert (text, end, score) == ("", -1, 0.0)
                else:
                    assert context[start:end] == text
            scores = [s for s in out["score"]["data"][row] if s > 0]
            assert scores == sorted(scores, reverse=True)


def test_no_answer_rows_are_padded() -> None:
    with serving(served_model_name=NAME, null_threshold=-1e6) as (client, _):  # always abstain
        out = outputs(infer(client, infer_body()))
        assert out["no_answer"]["data"] == [True, True]
        assert out["answer"]["data"] == ["", ""] and out["start"]["data"] == out["end"]["data"] == [-1, -1]


def test_requested_outputs_only_in_their_order_and_id_defaults_to_the_request_id() -> None:
    with serving(served_model_name=NAME) as (client, _):
        r = infer(
            client,
            infer_body(outputs=[{"name": "score"}, {"name": "answer", "parameters": {"binary_data": False}}]),
            headers={"X-Request-ID": "trace-7"},
        )
        assert r.status_code == 200, r.text
        assert [o["name"] for o in r.json()["outputs"]] == ["score", "answer"]
        assert r.json()["id"] == "trace-7" == r.headers["X-Request-ID"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"inputs": [tensor("question", [1.5], datatype="FP32"), tensor("context", [CONTEXT])]}, "datatype"),
        ({"inputs": [tensor("question", QUESTIONS, shape=[1, 2]), tensor("context", CONTEXTS)]}, "shape"),
        (
            {"inputs": [tensor("question", [QUESTION], shape=[1, 1, 1]), tensor("context", [CONTEXT])]},
            "shape",
        ),
        ({"inputs": [tensor("question", QUESTIONS, shape=[3]), tensor("context", CONTEXTS)]}, "elements"),
        ({"inputs": [tensor("question", [QUESTION], shape=[0]), tensor("context", [CONTEXT])]}, "shape"),
        ({"inputs": [tensor("question", [3]), tensor("context", [CONTEXT])]}, "JSON strings"),
        ({"inputs": [tensor("question", [QUESTION])]}, "missing input 'context'"),
        ({"inputs": [tensor("query", [QUESTION]), tensor("context", [CONTEXT])]}, "unknown input 'query'"),
        ({"inputs": [tensor("question", QUESTIONS), tensor("context", [CONTEXT])]}, "2 questions but 1"),
        (infer_body(parameters={"topk": 2}), "unknown parameter 'topk'"),
        (infer_body(parameters={"top_k": 0}), "parameters.top_k"),
        (infer_body(parameters={"top_k": "3"}), "parameters.top_k"),
        (infer_body(parameters={"timeout_s": -1}), "timeout_s"),
        (infer_body(outputs=[{"name": "logits"}]), "unknown output 'logits'"),
        (infer_body(outputs=[{"name": "score"}, {"name": "score"}]), "output 'score' is requested twice"),
        (
            {"inputs": [tensor("question", [[QUESTION]], shape=[1]), tensor("context", [CONTEXT])]},
            "input 'question': data is nested otherwise than its shape [1]",
        ),
        (
            {"inputs": [tensor("question", [QUESTIONS], shape=[2, 1]), tensor("context", CONTEXTS)]},
            "input 'question': data is nested otherwise than its shape [2, 1]",
        ),
        (infer_body(contexts=[CONTEXT, "\u0301\u0301"]), "invalid_input: context[1]: yields no tokens"),
        (infer_body(questions=[QUESTION, "   "]), "question[1]"),
        (
            {
                "inputs": [
                    {"name": "question", "shape": [1], "datatype": "BYTES"},
                    tensor("context", [CONTEXT]),
                ]
            },
            "input 'question' has no data",
        ),
        ({"inputs": "question"}, "inputs"),
        ({"inputs": [], "extra": 1}, "extra"),
    ],
)
def test_bad_requests_are_400_with_the_error_object(
    shared: tuple[TestClient, FakeFactory], body: dict, needle: str
) -> None:
    client, factory = shared
    before = len(factory.batches())
    message = assert_v2_error(infer(client, body), 400)
    assert needle in message, message
    assert len(factory.batches()) == before  # nothing reached a gang


def test_data_nested_far_deeper_than_its_shape_is_400(shared: tuple[TestClient, FakeFactory]) -> None:
    """Shape [1] with data nested 940 levels deep was flattened and answered (200)."""
    deep: list[Any] = [QUESTION]
    for _ in range(939):
        deep = [deep]
    body = {"inputs": [tensor("question", deep, shape=[1]), tensor("context", [CONTEXT])]}
    message = assert_v2_error(infer(shared[0], body), 400)
    assert message.startswith("input 'question': data is nested otherwise than its shape [1]"), message


def test_malformed_json_and_limits_are_400() -> None:
    with serving(served_model_name=NAME, max_context_chars=100, max_batch_items=2) as (client, _):
        r = client.post(
            f"/v2/models/{NAME}/infer", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert_v2_error(r, 400)
        message = assert_v2_error(infer(client, infer_body(contexts=["short context.", CONTEXT])), 400)
        assert "context[1]" in message and "100" in message
        three = infer_body(questions=[QUESTION] * 3, contexts=["Ann met Bob."] * 3)
        assert "max_batch_items=2" in assert_v2_error(infer(client, three), 400)


def test_a_body_without_content_type_is_json_and_another_media_type_is_415(
    shared: tuple[TestClient, FakeFactory],
) -> None:
    """Open Inference Protocol clients may send JSON with no Content-Type: it is read as JSON. A
    body declared as something else gets a 415 that says so (not "not a valid dictionary")."""
    client, _ = shared
    raw = json.dumps(infer_body()).encode()
    bare = client.post(f"/v2/models/{NAME}/infer", content=raw)
    assert "content-type" not in bare.request.headers
    assert bare.status_code == 200, bare.text
    plain = client.post(f"/v2/models/{NAME}/infer", content=raw, headers={"content-type": "text/plain"})
    message = assert_v2_error(plain, 415)
    assert "application/json" in message and "text/plain" in message, message


def test_errors_answered_outside_the_routes_have_the_v2_shape_under_v2() -> None:
    """The body guard (413, 400) and routing (404, 405) answer before any v2 route runs: under /v2
    they too are ``{"error": message}``, the code kept at the front of the message."""
    with serving(served_model_name=NAME, max_body_bytes=2048) as (client, _):
        big = infer_body(contexts=["x" * 3000])
        assert assert_v2_error(infer(client, big), 413).startswith("body_too_large: ")
        bad = client.post(
            f"/v2/models/{NAME}/infer", content=b"\xff\xfe", headers={"content-type": "application/json"}
        )
        assert assert_v2_error(bad, 400).startswith("invalid_utf8: ")
        assert assert_v2_error(client.get("/v2/no/such/route"), 404)
        assert assert_v2_error(client.post("/v2/health/live"), 405).startswith("method_not_allowed: ")
        native = client.get("/v1/no/such/route").json()  # the native API keeps its own shape
        assert {"error", "detail"} <= set(native)


def test_full_queue_is_429_with_retry_after_through_the_shared_admission() -> None:
    with serving(served_model_name=NAME, max_queue_size=1, max_inflight_per_replica=1, max_batch_size=1) as (
        client,
        factory,
    ):
        engine = client.app.state.engine
        factory.gate.clear()
        with ThreadPoolExecutor(4) as pool:
            held = [pool.submit(ask, client)]
            wait_busy(client)
            held.append(pool.submit(ask, client))
            wait_until(lambda: engine.scheduler.stats().queued_requests == 1, what="a full queue")
            r = infer(client, infer_body())
            assert "queue_full" in assert_v2_error(r, 429)
            assert int(r.headers["Retry-After"]) >= 1
            factory.gate.set()
            assert [f.result(timeout=10).status_code for f in held] == [200, 200]


# ------------------------------------------------------------------------------------- API key, OpenAPI


def test_api_key_guards_the_model_routes_not_health_or_server_metadata() -> None:
    """Model readiness is health in the spec (KServe probes poll it): open, like /v2/health/*."""
    auth = {"Authorization": f"Bearer {KEY}"}
    with serving(served_model_name=NAME, api_key=KEY) as (client, _):
        for path in ("/v2", "/v2/health/live", "/v2/health/ready", f"/v2/models/{NAME}/ready"):
            assert client.get(path).status_code == 200, path
        assert client.get(f"/v2/models/{NAME}/ready").json() == {"name": NAME, "ready": True}
        assert client.get("/v2/models/other/ready").status_code == 404  # still the spec's answers
        for r in (
            client.get(f"/v2/models/{NAME}"),
            infer(client, infer_body()),
            infer(client, infer_body(), headers={"Authorization": "Bearer wrong"}),
        ):
            assert "API key" in assert_v2_error(r, 401)
            assert r.headers["WWW-Authenticate"] == "Bearer"
        assert client.get(f"/v2/models/{NAME}", headers=auth).status_code == 200
        assert infer(client, infer_body(), headers=auth).status_code == 200


def test_openapi_documents_the_v2_routes_truthfully() -> None:
    with serving(served_model_name=NAME) as (client, _):
        doc = client.get("/openapi.json").json()
        paths = doc["paths"]
        op = paths["/v2/models/{model_name}/infer"]["post"]
        assert set(op["responses"]) == {"200", "400", "404", "408", "413", "415", "429", "500", "503", "504"}
        assert "security" not in op  # no API key configured: nothing to authenticate
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/V2InferenceRequest"
        )
        assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/V2Error")
        for status in ("429", "503"):
            assert op["responses"][status]["headers"]["Retry-After"]["required"] is True
        assert set(paths["/v2/health/ready"]["get"]["responses"]) == {"200", "400"}
        assert "HTTPValidationError" not in doc["components"]["schemas"]
    with serving(served_model_name=NAME, api_key=KEY) as (client, _):
        paths = client.get("/openapi.json").json()["paths"]
        op = paths["/v2/models/{model_name}/infer"]["post"]
        assert op["security"] == [{"ApiKey": []}] and "401" in op["responses"]
        assert "security" not in paths["/v2"]["get"] and "security" not in paths["/v2/health/ready"]["get"]
        assert "security" not in paths["/v2/models/{model_name}/ready"]["get"]
