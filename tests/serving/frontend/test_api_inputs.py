"""HTTP API bad input over fake in-process gangs: every bad-input class of /v1/qa and /v1/qa/batch
(JSON, raw bodies, content types, streamed and oversized bodies, limits) is a 4xx with a reason, the
server still answers after them, and the OpenAPI schema says what is rejected (helpers:
api_helpers.py).

Run: python -m pytest tests/serving/frontend/test_api_inputs.py -q      (no worker processes; seconds)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from shardserve.partitioner.runtime.fake_gang import FakeFactory
from tests.serving.frontend.api_helpers import (
    CONTEXT,
    QUESTION,
    ask,
    serving,
)

# ------------------------------------------------------------------------------------- bad input

BAD_JSON_BODIES = {
    "empty question": {"question": "", "context": CONTEXT},
    "whitespace question": {"question": "  \n\t", "context": CONTEXT},
    "whitespace context": {"question": QUESTION, "context": "   "},
    "question not a string": {"question": 42, "context": CONTEXT},
    "context is a list": {"question": QUESTION, "context": ["a", "b"]},
    "context null": {"question": QUESTION, "context": None},
    "missing context": {"question": QUESTION},
    "missing everything": {},
    "top_k zero": {"question": QUESTION, "context": CONTEXT, "top_k": 0},
    "top_k negative": {"question": QUESTION, "context": CONTEXT, "top_k": -3},
    "top_k huge": {"question": QUESTION, "context": CONTEXT, "top_k": 10**12},
    "top_k string": {"question": QUESTION, "context": CONTEXT, "top_k": "3"},
    "top_k float": {"question": QUESTION, "context": CONTEXT, "top_k": 2.5},
    "top_k bool": {"question": QUESTION, "context": CONTEXT, "top_k": True},
    "max_answer_length zero": {"question": QUESTION, "context": CONTEXT, "max_answer_length": 0},
    "unknown field": {"question": QUESTION, "context": CONTEXT, "topk": 2},
    "timeout negative": {"question": QUESTION, "context": CONTEXT, "timeout_s": -1},
    "timeout over max": {"question": QUESTION, "context": CONTEXT, "timeout_s": 10**6},
    "body is a list": [QUESTION, CONTEXT],
    "context over limit": {"question": QUESTION, "context": "word " * 500},
    "question over limit": {"question": "why " * 100, "context": CONTEXT},
}


@pytest.fixture(scope="module")
def limited_client() -> Iterator[tuple[TestClient, FakeFactory]]:
    with serving(max_context_chars=2000, max_question_chars=200, max_body_bytes=4096, max_batch_items=4) as c:
        yield c


@pytest.mark.parametrize("name", list(BAD_JSON_BODIES))
def test_bad_json_input_is_a_4xx_with_a_reason(limited_client: Any, name: str) -> None:
    client, _ = limited_client
    r = client.post("/v1/qa", json=BAD_JSON_BODIES[name])
    assert r.status_code == 422, (name, r.status_code, r.text)
    body = r.json()
    assert body["error"] in ("invalid_request", "invalid_input", "invalid_timeout") and body["detail"]


@pytest.mark.parametrize(
    ("name", "raw", "status", "code"),
    [
        ("invalid utf-8", b'{"question": "\xff\xfe", "context": "abc"}', 400, "invalid_utf8"),
        ("truncated utf-8", b'{"question": "caf\xc3", "context": "abc"}', 400, "invalid_utf8"),
        ("not json", b"question=what&context=that", 422, "invalid_request"),
        ("truncated json", b'{"question": "a", "context": ', 422, "invalid_request"),
        ("lone surrogate escape", b'{"question": "\\ud800 who", "context": "abc"}', 422, "invalid_request"),
        (
            "context of zero-width chars",
            b'{"question": "who", "context": "\\u200b\\u200b"}',
            422,
            "invalid_input",
        ),
        ("empty body", b"", 422, "invalid_request"),
        ("json null", b"null", 422, "invalid_request"),
        ("timeout NaN", b'{"question": "a", "context": "b", "timeout_s": NaN}', 422, "invalid_request"),
        ("top_k overflow", b'{"question": "a", "context": "b", "top_k": 1e400}', 422, "invalid_request"),
        (
            "oversized body",
            json.dumps({"question": "q", "context": "x" * 10_000}).encode(),
            413,
            "body_too_large",
        ),
    ],
)
def test_bad_raw_body_is_a_4xx_with_a_reason(
    limited_client: Any, name: str, raw: bytes, status: int, code: str
) -> None:
    client, _ = limited_client
    r = client.post("/v1/qa", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, (name, r.text)
    assert r.json()["error"] == code


def test_a_body_without_content_type_is_json_and_a_form_is_415(limited_client: Any) -> None:
    """``curl -d`` without ``-H content-type`` sends a form type: a 415 naming the header, not a 422
    about a dictionary; no Content-Type at all is read as JSON."""
    client, _ = limited_client
    raw = json.dumps({"question": QUESTION, "context": CONTEXT[:90]}).encode()
    assert client.post("/v1/qa", content=raw).status_code == 200
    form = {"content-type": "application/x-www-form-urlencoded"}
    r = client.post("/v1/qa", content=raw, headers=form)
    assert r.status_code == 415 and r.json()["error"] == "unsupported_media_type"
    assert "Content-Type: application/json" in r.json()["detail"]
    admin = client.post(
        "/admin/replicas", content=b'{"replicas": 1}', headers={**form, "authorization": "Bearer x"}
    )
    assert admin.status_code == 401  # the token first, as before the body


def test_oversized_streamed_body_without_content_length_is_413(limited_client: Any) -> None:
    client, _ = limited_client

    def chunks() -> Iterator[bytes]:
        yield b'{"question": "q", "context": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    r = client.post("/v1/qa", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"] == "body_too_large"


def test_bad_batch_inputs(limited_client: Any) -> None:
    client, _ = limited_client
    good = {"question": QUESTION, "context": CONTEXT}
    cases = [
        ({"items": []}, "invalid_request"),
        ({"items": [good] * 5}, "too_many_items"),
        ({"items": [good, {"question": " ", "context": CONTEXT}]}, "invalid_request"),
        ({"items": [good, {"question": QUESTION, "context": "w " * 1500}]}, "invalid_input"),
        ({"items": good}, "invalid_request"),
    ]
    for body, code in cases:
        r = client.post("/v1/qa/batch", json=body)
        assert r.status_code == 422 and r.json()["error"] == code, (body, r.text)


def test_server_still_answers_after_bad_inputs(limited_client: Any) -> None:
    client, factory = limited_client
    for body in BAD_JSON_BODIES.values():
        client.post("/v1/qa", json=body)
    r = ask(client)
    assert r.status_code == 200 and r.json()["answers"]
    assert all(g.healthy for g in factory.gangs)


def test_openapi_declares_that_question_and_context_must_not_be_empty() -> None:
    """Empty strings were schema-valid but answered 422 (issue 11.10)."""
    with serving() as (client, _):
        schemas = client.get("/openapi.json").json()["components"]["schemas"]
        for name in ("QARequest", "QAItem"):
            props = schemas[name]["properties"]
            assert props["question"]["minLength"] == 1 and props["context"]["minLength"] == 1
        assert ask(client, question="").status_code == 422
