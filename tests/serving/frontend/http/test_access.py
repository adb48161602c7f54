"""Access and identity (``serving/frontend/http/access.py``): the optional API key of the inference routes, the
``X-Request-ID`` taken or generated and echoed, the access-log line, and ``--served-model-name``.

Run: python -m pytest tests/serving/frontend/http/test_access.py -q      (fake in-process gangs; a few seconds)
"""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path
from typing import Any

import pytest
from fastapi import APIRouter, FastAPI
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from shardserve.cli import add_serve_arguments
from shardserve.serving.frontend.http.access import ApiKeyRoute, include_protected, valid_request_id
from shardserve.serving.frontend.settings import ServeSettings
from tests.serving.frontend.api_helpers import CONTEXT, QUESTION, TOKEN, serving

KEY = "api-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
LINE = re.compile(
    r"method=(?P<method>[A-Z]+) path=(?P<path>\S+) status=(?P<status>\d{3}) latency_ms=(?P<ms>\d+\.\d) "
    r"windows=(?P<windows>\d+|-) request_id=(?P<rid>[A-Za-z0-9._:+=/-]{1,128})$"
)


def ask(client: Any, *, headers: dict[str, Any] | None = None, **extra: Any) -> Any:
    return client.post("/v1/qa", json={"question": QUESTION, "context": CONTEXT, **extra}, headers=headers)


# ------------------------------------------------------------------------------------------ API key


def test_api_key_401_without_200_with() -> None:
    with serving(api_key=KEY) as (client, _):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
            r = ask(client, headers=headers)
            assert r.status_code == 401, headers
            assert r.headers["WWW-Authenticate"] == "Bearer"
            body = r.json()
            assert body["error"] == "unauthorized" and "API key" in body["detail"]
            assert body["request_id"] == r.headers["X-Request-ID"]
        assert client.get("/v1/models").status_code == 401
        assert client.post("/v1/qa/batch", json={"items": []}).status_code == 401  # before validation
        r = ask(client, headers=AUTH)
        assert r.status_code == 200 and r.json()["answers"]
        assert client.get("/v1/models", headers=AUTH).status_code == 200


@pytest.mark.parametrize(
    "body",
    [b"garbage", b'{"question": 3}', b"[" * 2000 + b"]" * 2000],
    ids=["not json", "schema-invalid", "too deep"],
)
def test_api_key_is_checked_before_the_body_is_parsed(body: bytes) -> None:
    """Without the key, a bad body was a 422 (native) / 400 (v2) naming the body: a 401 comes first."""
    json_type = {"content-type": "application/json"}
    with serving(api_key=KEY, served_model_name="m") as (client, _):
        for path in ("/v1/qa", "/v1/qa/batch", "/v2/models/m/infer", "/v2/models/other/infer"):
            r = client.post(path, content=body, headers=json_type)
            assert r.status_code == 401, (path, r.text)
            assert r.headers["WWW-Authenticate"] == "Bearer"
            reply = r.json()
            assert "API key" in (reply["error"] if path.startswith("/v2") else reply["detail"]), reply
            with_key = client.post(path, content=body, headers={**json_type, **AUTH})
            assert with_key.status_code == (400 if path.startswith("/v2") else 422), (path, with_key.text)


def test_include_protected_refuses_routes_that_read_the_body_first() -> None:
    late = APIRouter()
    late.post("/late")(lambda: None)
    with pytest.raises(TypeError, match=r"\['/late'\] would read the body before the API key"):
        include_protected(FastAPI(), late, settings=ServeSettings(api_key=KEY))
    early = APIRouter(route_class=ApiKeyRoute)
    early.post("/early")(lambda: None)
    app = FastAPI()
    include_protected(app, early, settings=ServeSettings(api_key=KEY))
    assert "/early" in app.openapi()["paths"]


def test_health_metrics_and_docs_stay_open_and_admin_keeps_its_own_token() -> None:
    with serving(api_key=KEY) as (client, _):
        for path in (
            "/healthz",
            "/readyz",
            "/metrics",
            "/v2/health/live",
            "/v2/health/ready",
            "/v2",
            "/openapi.json",
        ):
            assert client.get(path).status_code == 200, path
        assert client.get("/admin/replicas", headers=AUTH).status_code == 401  # the API key is not admin
        assert client.get("/admin/replicas", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_without_a_key_everything_is_open_and_nothing_claims_auth() -> None:
    with serving() as (client, _):
        assert ask(client).status_code == 200
        doc = client.get("/openapi.json").json()
        assert "ApiKey" not in doc["components"]["securitySchemes"]
        assert "security" not in doc["paths"]["/v1/qa"]["post"]


def test_openapi_declares_the_key_on_the_inference_routes_only() -> None:
    with serving(api_key=KEY) as (client, _):
        doc = client.get("/openapi.json").json()
        assert doc["components"]["securitySchemes"]["ApiKey"]["scheme"] == "bearer"
        for path, method in [("/v1/qa", "post"), ("/v1/qa/batch", "post"), ("/v1/models", "get")]:
            op = doc["paths"][path][method]
            assert op["security"] == [{"ApiKey": []}], path
            assert op["responses"]["401"]["headers"]["WWW-Authenticate"]["required"] is True
        for path in ("/healthz", "/readyz", "/metrics"):
            assert "security" not in doc["paths"][path]["get"], path


def test_api_key_file_and_flags(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text(f"{KEY}\n", encoding="utf-8")
    assert ServeSettings(api_key_file=str(path)).api_key == KEY
    with pytest.raises(ValidationError, match="give api_key or api_key_file, not both"):
        ServeSettings(api_key="x", api_key_file=str(path))
    (tmp_path / "empty").write_text("\n", encoding="utf-8")
    with pytest.raises(ValidationError, match="is empty"):
        ServeSettings(api_key_file=str(tmp_path / "empty"))
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    text = " ".join(parser.format_help().split())
    for flag, env in [
        ("--api-key ", "SHARDSERVE_API_KEY"),
        ("--api-key-file", "SHARDSERVE_API_KEY_FILE"),
        ("--served-model-name", "SHARDSERVE_SERVED_MODEL_NAME"),
    ]:
        assert flag in text and env in text, flag


def test_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDSERVE_API_KEY", KEY)
    assert ServeSettings().api_key == KEY


# ------------------------------------------------------------------------------------------ request id


@pytest.mark.parametrize("given", ["abc-1", "trace.id:42/x+y=", "a" * 128])
def test_a_valid_client_request_id_is_echoed_everywhere(given: str) -> None:
    with serving() as (client, _):
        r = ask(client, headers={"X-Request-ID": given})
        assert r.headers["X-Request-ID"] == given and r.json()["request_id"] == given
        r = client.get("/healthz", headers={"X-Request-ID": given})
        assert r.headers["X-Request-ID"] == given


@pytest.mark.parametrize("given", ["a" * 129, "has space", "semi;colon", "new\\nline", "ü"])
def test_an_invalid_client_request_id_is_replaced(given: str) -> None:
    assert not valid_request_id(given)
    with serving() as (client, _):
        r = ask(client, headers={"X-Request-ID": given.encode("utf-8")})
        rid = r.headers["X-Request-ID"]
        assert rid != given and re.fullmatch(r"[0-9a-f]{32}", rid)
        assert r.json()["request_id"] == rid


def test_generated_ids_are_unique_and_in_error_bodies() -> None:
    with serving(max_body_bytes=1024, max_context_chars=100) as (client, _):
        ids = {client.get("/healthz").headers["X-Request-ID"] for _ in range(5)}
        assert len(ids) == 5 and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
        errors = {
            "413 (request guard)": client.post("/v1/qa", content=b"x" * 2048),
            "422 (validation)": client.post("/v1/qa", json={"question": QUESTION}),
            "422 (limit)": ask(client, context=CONTEXT),
            "404": client.get("/no/such/path"),
            "405": client.delete("/v1/qa"),
        }
        for name, r in errors.items():
            assert r.status_code >= 400, name
            assert r.json()["request_id"] == r.headers["X-Request-ID"], name
            assert int(r.headers["content-length"]) == len(r.content), name
        r = client.post("/v2/models/tiny-bert/infer", json={"inputs": 3}, headers={"X-Request-ID": "v2-err"})
        assert r.json().keys() == {"error"} and r.headers["X-Request-ID"] == "v2-err"  # v2: the spec's object


# ------------------------------------------------------------------------------------------ HEAD

GET_PATHS = ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready", "/v2", "/", "/docs", "/ui/status")


def test_head_is_answered_like_get_without_a_body(caplog: pytest.LogCaptureFixture) -> None:
    """HEAD was a 405 on every GET route (load balancers probe with HEAD)."""
    with serving(api_key=KEY) as (client, _):
        for path in (*GET_PATHS, "/v1/models", "/admin/replicas"):  # the last two: 401 without a token
            get, head = client.get(path), client.head(path)
            assert head.status_code == get.status_code and get.content, (path, head.status_code)
            assert head.content == b"", path
            assert head.headers["content-type"] == get.headers["content-type"], path
        for path in ("/healthz", "/v2/health/live", "/v1/models"):  # same length, body and request id alike
            assert client.head(path).headers["content-length"] == str(len(client.get(path).content)), path
        head = client.head("/v1/qa")  # POST only: HEAD is refused like GET, naming what is served
        assert head.status_code == 405 and head.headers["Allow"] == "POST" and head.content == b""
        assert client.post("/healthz").headers["Allow"] == "GET, HEAD"
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="shardserve.access"):
            client.head("/healthz")
        assert [r.getMessage().split()[:3] for r in caplog.records if r.name == "shardserve.access"] == [
            ["method=HEAD", "path=/healthz", "status=200"]
        ]
        document = client.get("/openapi.json").json()
        assert not [p for p, ops in document["paths"].items() if "head" in ops]  # no junk operations


# ------------------------------------------------------------------------------------------ access log


def test_one_access_log_line_per_request(caplog: pytest.LogCaptureFixture) -> None:
    with serving() as (client, _):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="shardserve.access"):
            ask(client, headers={"X-Request-ID": "log-1"})
            client.get("/healthz?secret=1", headers={"X-Request-ID": "log-2"})
            client.post("/v1/qa", json={"question": QUESTION}, headers={"X-Request-ID": "log-3"})
            client.get("/a path with spaces", headers={"X-Request-ID": "log-4"})
        lines = [r.getMessage() for r in caplog.records if r.name == "shardserve.access"]
        assert len(lines) == 4, lines
        parsed = [LINE.match(line) for line in lines[:3]]
        assert all(parsed), lines
        qa, health, bad = (m.groupdict() for m in parsed if m)
        assert (qa["method"], qa["path"], qa["status"], qa["windows"], qa["rid"]) == (
            "POST",
            "/v1/qa",
            "200",
            "1",
            "log-1",
        )
        assert (health["path"], health["status"], health["windows"], health["rid"]) == (
            "/healthz",
            "200",
            "-",
            "log-2",
        )
        assert (bad["status"], bad["windows"]) == ("422", "-")
        assert float(qa["ms"]) > 0
        assert 'path="/a path with spaces" status=404' in lines[3]  # quoted: one line, one field


# ------------------------------------------------------------------------------------------ model name


def test_served_model_name_names_the_model_everywhere() -> None:
    with serving(served_model_name="squad-qa") as (client, _):
        assert ask(client).json()["model"] == "squad-qa"
        assert (
            client.post("/v1/qa/batch", json={"items": [{"question": QUESTION, "context": CONTEXT}]}).json()[
                "model"
            ]
            == "squad-qa"
        )
        (info,) = client.get("/v1/models").json()
        assert info["model"] == "squad-qa" and info["checkpoint"]["name"] == "tiny-bert"
        assert client.get("/v2/models/squad-qa").status_code == 200
        dtype = client.app.state.precision.name  # auto: bf16 on a CPU with bf16 units, else fp32
        assert model_info(client.get("/metrics").text) == [
            {"model": "squad-qa", "precision": dtype, "pp": "1", "tp": "1"}
        ]
        reload = client.post(
            "/admin/reload", json={"model": "tiny-roberta"}, headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert reload.status_code == 200, reload.text
        assert ask(client).json()["model"] == "squad-qa"  # the served name stays across a reload
        assert [m["model"] for m in model_info(client.get("/metrics").text)] == ["squad-qa"]
    with serving() as (client, _):
        assert ask(client).json()["model"] == "tiny-bert"
        assert [m["model"] for m in model_info(client.get("/metrics").text)] == ["tiny-bert"]
        reload = client.post(
            "/admin/reload", json={"model": "tiny-roberta"}, headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert reload.status_code == 200, reload.text
        # the public name is the model's from its start (as a repository's NAME): a reload is a new version
        assert ask(client).json()["model"] == "tiny-bert"
        assert client.get("/v1/models").json()[0]["checkpoint"]["name"] == "tiny-roberta"
        assert [m["model"] for m in model_info(client.get("/metrics").text)] == ["tiny-bert"]  # one series


def model_info(exposition: str) -> list[dict[str, str]]:
    """The label sets of the ``shardserve_model_info`` series in a /metrics page (each must be 1)."""
    out = []
    for family in text_string_to_metric_families(exposition):
        if family.name == "shardserve_model_info":
            for sample in family.samples:
                assert sample.value == 1.0, sample
                out.append(dict(sample.labels))
    return out


@pytest.mark.parametrize("bad", ["", "a/b", "-lead", "has space", "x" * 129])
def test_served_model_name_must_be_one_url_segment(bad: str) -> None:
    with pytest.raises(ValidationError, match="served_model_name"):
        ServeSettings(served_model_name=bad)
