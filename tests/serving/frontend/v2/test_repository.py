"""Many models in one server: routing by name on every protocol, per-model readiness, metrics and
status, and Triton's repository extension (index, load, unload) under load, on fake gangs.

Run: python -m pytest tests/serving/frontend/v2/test_repository.py -q
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shardserve.models.presets import materialise_preset
from shardserve.partitioner.runtime.fake_gang import FakeFactory
from shardserve.serving.frontend.settings import ServeSettings
from tests.clients import closed_loop
from tests.serving.frontend.api_helpers import CONTEXT, QUESTION, TOKEN, ask, serving, wait_until

AUTH = {"Authorization": f"Bearer {TOKEN}"}
TWO = ["a=tiny-bert", "b=tiny-roberta"]


def v2_body() -> dict[str, Any]:
    return {
        "inputs": [
            {"name": "question", "datatype": "BYTES", "shape": [1], "data": [QUESTION]},
            {"name": "context", "datatype": "BYTES", "shape": [1], "data": [CONTEXT]},
        ]
    }


def series(text: str, name: str) -> dict[str, float]:
    """``model`` label -> value of the samples called ``name`` (summed over the other labels)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[s.labels["model"]] = out.get(s.labels["model"], 0.0) + s.value
    return out


# ------------------------------------------------------------------------------------ settings


def test_model_flags_name_the_models_in_order() -> None:
    s = ServeSettings(model=["a=tiny-bert", "tiny-roberta"])
    assert s.models() == [("a", "tiny-bert"), ("tiny-roberta", "tiny-roberta")]
    assert ServeSettings(model="x=default,minilm").models() == [
        ("x", "default"),
        ("minilm", "minilm"),
    ]  # env form
    assert ServeSettings().models() == [("default", "default")]
    assert ServeSettings(model="tiny-bert", served_model_name="qa").models() == [("qa", "tiny-bert")]


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"model": ["a=tiny-bert", "a=tiny-roberta"]}, "model names must differ"),
        ({"model": ["a b=tiny-bert"]}, "model name 'a b'"),
        ({"model": ["a="]}, "nothing after '='"),
        ({"model": TWO, "served_model_name": "x"}, "served_model_name='x' names one model"),
        ({"model_repository": "/no/such/folder"}, "is not a folder"),
    ],
)
def test_model_flag_mistakes_are_one_clear_error(kw: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        ServeSettings(**kw)


def test_repository_folders_are_models_and_the_highest_version_is_served(tmp_path: Path) -> None:
    (tmp_path / "qa" / "1").mkdir(parents=True)
    (tmp_path / "qa" / "3").mkdir()
    (tmp_path / "qa" / "20").mkdir()
    (tmp_path / "plain").mkdir()
    (tmp_path / ".hidden").mkdir()
    s = ServeSettings(model_repository=str(tmp_path))
    assert s.models() == [("plain", str(tmp_path / "plain")), ("qa", str(tmp_path / "qa" / "20"))]
    assert s.model_count == 2 and s.pool_slots == 1 * (s.replica_bounds[1] * 2 + 1)


# --------------------------------------------------------------------------------- two models


def test_two_models_answer_by_name_on_every_protocol_with_their_own_series() -> None:
    factory = FakeFactory()
    with serving(factory, model=TWO) as (client, _):
        assert sorted(factory.models) == ["tiny-bert", "tiny-roberta"]  # one gang each
        assert ask(client).json()["model"] == "a"  # no model named: the first
        assert ask(client, model="b").json()["model"] == "b"
        batch = client.post(
            "/v1/qa/batch", json={"items": [{"question": QUESTION, "context": CONTEXT}], "model": "b"}
        )
        assert batch.status_code == 200 and batch.json()["model"] == "b"
        v2 = client.post("/v2/models/b/infer", json=v2_body())
        assert v2.status_code == 200 and v2.json()["model_name"] == "b"
        assert client.get("/v2/models/a").json()["name"] == "a"
        assert client.get("/v2/models/b/ready").json() == {"name": "b", "ready": True}
        missing = ask(client, model="c")
        assert missing.status_code == 404 and missing.json()["error"] == "model_not_found"
        assert "'a', 'b'" in missing.json()["detail"]
        assert client.post("/v2/models/c/infer", json=v2_body()).status_code == 404
        assert [m["model"] for m in client.get("/v1/models").json()] == ["a", "b"]
        ready = client.get("/readyz").json()
        assert ready["models"]["a"]["state"] == ready["models"]["b"]["state"] == "READY"
        text = client.get("/metrics").text
        assert series(text, "shardserve_requests_total") == {"a": 1.0, "b": 3.0, "c": 2.0}
        assert series(text, "shardserve_queue_wait_seconds_count") == {"a": 1.0, "b": 3.0}
        assert set(series(text, "shardserve_model_info")) == {"a", "b"}
        status = client.get("/ui/status").json()
        assert [(m["name"], m["state"]) for m in status["models"]] == [("a", "READY"), ("b", "READY")]
        assert {r["model"] for r in status["replicas"]} == {"a", "b"}
        assert next(m for m in status["models"] if m["name"] == "b")["answered_per_s"] > 0
        # admin routes take the model: b's replicas, pinned without touching a's
        assert client.get("/admin/replicas", params={"model": "b"}, headers=AUTH).json()["target"] == 1
        assert client.get("/admin/replicas", params={"model": "c"}, headers=AUTH).status_code == 404


def test_a_model_that_fails_to_load_is_reported_and_the_other_serves(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    with serving(model=["a=tiny-bert", f"bad={broken}"]) as (client, _):
        assert ask(client).status_code == 200
        r = ask(client, model="bad")
        assert r.status_code == 503 and r.json()["error"] == "model_unavailable"
        [entry] = [e for e in client.get("/v2/repository/index", headers=AUTH).json() if e["name"] == "bad"]
        assert entry["state"] == "UNAVAILABLE" and "failed to load" in entry["reason"]
        assert str(tmp_path) not in entry["reason"]  # no server paths
        assert client.get("/v2/models/bad/ready").status_code == 400
        assert client.get("/readyz").status_code == 200  # the server serves its other model
        shutil.copytree(materialise_preset("tiny-bert"), broken, dirs_exist_ok=True)  # mended
        again = client.post("/v2/repository/models/bad/load", headers=AUTH)  # by name: what declared it
        assert again.status_code == 200 and again.json()["state"] == "READY", again.text
        assert ask(client, model="bad").status_code == 200


def test_load_and_unload_under_load_fail_no_request_of_the_other_model() -> None:
    factory = FakeFactory()
    factory.batch_s = 0.005
    statuses: list[int] = []

    with serving(factory, model=["a=tiny-bert"], max_replicas=2, cpu_slots=4) as (client, _):
        with closed_loop(lambda _: statuses.append(ask(client, model="a").status_code), n=2):
            wait_until(lambda: len(statuses) > 5, what="traffic")
            loaded = client.post(
                "/v2/repository/models/b/load",
                json={"parameters": {"path": str(materialise_preset("tiny-roberta"))}},
                headers=AUTH,
            )
            assert loaded.status_code == 200 and loaded.json() == {"name": "b", "state": "READY"}, loaded.text
            assert ask(client, model="b").status_code == 200
            n = len(statuses)
            wait_until(lambda: len(statuses) > n + 5, what="traffic while b serves")
            index = {e["name"]: e for e in client.get("/v2/repository/index", headers=AUTH).json()}
            assert index["b"]["state"] == "READY" and index["b"]["version"] == "1"
            unloaded = client.post("/v2/repository/models/b/unload", headers=AUTH)
            assert unloaded.status_code == 200, unloaded.text
            n = len(statuses)
            wait_until(lambda: len(statuses) > n + 5, what="traffic after the unload")
        assert set(statuses) == {200}, sorted(set(statuses))
        gone = ask(client, model="b")  # known, not served: unload is not forget
        assert gone.status_code == 503 and gone.json()["error"] == "model_unavailable", gone.text
        assert "b" not in series(client.get("/metrics").text, "shardserve_model_info")  # its series went
        index = {e["name"]: e for e in client.get("/v2/repository/index", headers=AUTH).json()}
        assert (index["b"]["state"], index["b"]["reason"]) == ("UNAVAILABLE", "unloaded")
        again = client.post("/v2/repository/models/b/load", headers=AUTH)  # by name alone: its last path
        assert again.status_code == 200 and again.json() == {"name": "b", "state": "READY"}, again.text
        assert ask(client, model="b").json()["model"] == "b"


def test_repository_routes_need_the_admin_token_and_answer_v2_errors() -> None:
    with serving(model=["a=tiny-bert"]) as (client, _):
        assert client.get("/v2/repository/index").status_code == 401
        assert client.post("/v2/repository/models/a/unload").status_code == 401
        unknown = client.post("/v2/repository/models/zz/load", json={}, headers=AUTH)
        assert unknown.status_code == 404 and "model_not_found" in unknown.json()["error"]
        bad = client.post(
            "/v2/repository/models/zz/load", json={"parameters": {"path": "/no/such/model"}}, headers=AUTH
        )
        assert bad.status_code == 400 and "load_failed" in bad.json()["error"] and "/no/such" not in bad.text
        index = {e["name"]: e["state"] for e in client.get("/v2/repository/index", headers=AUTH).json()}
        assert index == {"a": "READY", "zz": "UNAVAILABLE"}  # the failed load is reported
        assert client.post("/v2/repository/models/zz/unload", headers=AUTH).status_code == 400  # not loaded
        assert client.post("/v2/repository/models/yy/unload", headers=AUTH).status_code == 404
        assert client.post("/v2/repository/index", json={"ready": True}, headers=AUTH).json() == [
            {"name": "a", "version": "1", "state": "READY", "reason": ""}
        ]
        assert ask(client).status_code == 200


def test_each_model_has_its_own_queue_a_burst_of_one_does_not_starve_the_other() -> None:
    """Model a's queue is full (429); model b's request is still admitted: separate admission per model.
    One window per micro-batch: a holds at most 2 gangs x 2 batches in flight + 2 queued, so 10
    requests overflow however they arrive (with 6, requests that trickled in were all admitted)."""
    factory = FakeFactory()
    with serving(factory, model=TWO, max_queue_size=2, max_batch_size=1) as (client, _):
        factory.gate.clear()  # every gang holds its batches: a's queue fills
        with ThreadPoolExecutor(12) as pool:
            held = [pool.submit(ask, client, model="a") for _ in range(10)]
            wait_until(lambda: any(f.done() for f in held), what="a 429")
            assert any(f.result().status_code == 429 for f in held if f.done())
            other = pool.submit(ask, client, model="b")
            time.sleep(0.2)
            assert not other.done()  # admitted and waiting for its gang, not refused
            factory.gate.set()
            assert other.result(timeout=10).status_code == 200
            assert all(f.result().status_code in (200, 429) for f in held)
