"""Serving several models with a placement (serving/fleet/placement.py): the device groups they
share, answered through every protocol, loads / unloads / re-plans rolled live, on fake gangs.

Run: python -m pytest tests/serving/fleet/test_placement.py -q
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from fastapi.testclient import TestClient

from shardserve.partitioner.placement.workload import alternating_bursts
from shardserve.partitioner.runtime.fake_gang import FakeFactory
from shardserve.serving.fleet import placement as placement_runtime
from shardserve.serving.frontend.cli import startup_line
from shardserve.serving.frontend.settings import ServeSettings
from tests.clients import closed_loop
from tests.serving.frontend.api_helpers import TOKEN, ask, serving, wait_until
from tests.serving.frontend.v2.test_repository import AUTH, v2_body

TWO = ["a=tiny-bert", "b=tiny-bert"]
# 20 ms a request: a device answers 50 req/s alone, two as one pipeline about twice that
PLACED: dict[str, Any] = {"devices": 2, "single_latency_ms": 20.0, "threads_per_rank": 1, "dtype": "float32"}
ONE_MODEL_MB = 110.0  # one tiny-bert (8.3 MiB of fp32 weights + 99 MiB of activations) fits; two do not


def placed(factory: FakeFactory | None = None, **kw: Any) -> Any:
    return serving(factory, model=TWO, **PLACED, **kw)


def groups(client: TestClient) -> list[tuple[list[int], int, list[str]]]:
    placement = client.get("/ui/status").json()["placement"]
    return [(g["devices"], g["pp"], g["models"]) for g in placement["groups"]]


def devices_of(client: TestClient) -> dict[str, set[int]]:
    """Each model -> the devices of the groups holding it."""
    out: dict[str, set[int]] = {}
    for devices, _pp, models in groups(client):
        for m in models:
            out.setdefault(m, set()).update(devices)
    return out


def test_multiplexed_models_share_one_gang_and_answer_on_every_protocol() -> None:
    factory = FakeFactory()
    with placed(factory, placement="multiplexed") as (client, _):
        assert factory.models == ["tiny-bert+tiny-bert"]  # one gang of both
        assert factory.gangs[0].models == ["a", "b"]
        assert ask(client, model="a").json()["model"] == "a"
        assert ask(client, model="b").json()["model"] == "b"
        v2 = client.post("/v2/models/b/infer", json=v2_body())
        assert v2.status_code == 200 and v2.json()["model_name"] == "b"
        assert factory.gangs[0].submitted_models[-3:] == ["a", "b", "b"]  # each tagged with its model
        status = client.get("/ui/status").json()
        assert groups(client) == [([0, 1], 2, ["a", "b"])]
        assert status["placement"]["policy"] == "multiplexed" and status["placement"]["groups"][0]["running"]
        assert {m["name"]: m["state"] for m in status["models"]} == {"a": "READY", "b": "READY"}
        replicas = client.get("/admin/replicas?model=b", headers=AUTH).json()
        assert replicas["target"] == 1 and not replicas["autoscaling"]
        index = client.get("/v2/repository/index", headers=AUTH).json()
        assert [(e["name"], e["state"]) for e in index] == [("a", "READY"), ("b", "READY")]
        line = startup_line(client.app.state, "http://127.0.0.1:8000")
        assert "serving a=tiny-bert, b=tiny-bert at http://127.0.0.1:8000" in line, line
        assert "placement multiplexed on 2 devices: [0,1] pp=2 tp=1: a,b, predicted SLO attainment" in line
        assert "at 10 req/s, CV 1, SLO 5x; 1 thread(s) per rank" in line, line


def test_dedicated_gives_each_model_devices_of_its_own_within_the_memory_budget() -> None:
    factory = FakeFactory()
    with placed(factory, placement="dedicated", device_memory_mb=ONE_MODEL_MB) as (client, _):
        assert sorted(factory.models) == ["tiny-bert", "tiny-bert"]
        assert sorted(g.models[0] for g in factory.gangs) == ["a", "b"]
        assert sorted((models, pp) for _, pp, models in groups(client)) == [(["a"], 1), (["b"], 1)]
        assert ask(client, model="a").status_code == ask(client, model="b").status_code == 200


def test_the_start_is_placed_for_the_declared_skew(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--workload-skew``: the start's placement is chosen for uneven rates (the first model hot,
    1 / k**skew) and gives the hot model the replicas."""
    chosen_for: list[dict[str, float]] = []
    choose = placement_runtime.choose_placement

    def noting(policy: str, profiles: Any, workload: Any, **kw: Any) -> Any:
        chosen_for.append({a.model: a.rate for a in workload.arrivals})
        return choose(policy, profiles, workload, **kw)

    monkeypatch.setattr(placement_runtime, "choose_placement", noting)
    kw = {**PLACED, "devices": 3, "placement": "dedicated", "device_memory_mb": ONE_MODEL_MB}
    with serving(FakeFactory(), model=TWO[::-1], workload_rate=63.0, workload_skew=3.0, **kw) as (client, _):
        assert chosen_for == [{"b": pytest.approx(56.0), "a": pytest.approx(7.0)}]
        assert {m: len(d) for m, d in devices_of(client).items()} == {"a": 1, "b": 2}


def test_a_placement_that_cannot_fit_fails_the_start_with_the_numbers() -> None:
    app_settings = {"model": TWO, **PLACED, "placement": "multiplexed", "device_memory_mb": 1.0}
    from shardserve.serving.frontend.app import build_app

    with TestClient(build_app(ServeSettings(**app_settings), backend_factory=FakeFactory())) as client:
        fatal = wait_until(lambda: client.get("/readyz").json()["detail"].get("fatal"), what="the reason")
        assert "107.0 MiB per device at pp=2" in fatal and "> 1.0 MiB per device" in fatal, fatal


def test_load_and_unload_roll_the_shared_gang_while_the_other_model_serves_every_request() -> None:
    factory = FakeFactory()
    statuses: list[int] = []

    with placed(factory, placement="multiplexed") as (client, _):
        with closed_loop(lambda _: statuses.append(ask(client, model="a").status_code), n=2):
            wait_until(lambda: len(statuses) > 5, what="traffic")
            loaded = client.post(
                "/v2/repository/models/c/load", json={"parameters": {"path": "tiny-bert"}}, headers=AUTH
            )
            assert loaded.status_code == 200, loaded.text
            assert groups(client) == [([0, 1], 2, ["a", "b", "c"])]
            assert factory.models[-1] == "tiny-bert+tiny-bert+tiny-bert" and factory.gangs[0]._stopped
            assert ask(client, model="c").status_code == 200
            n = len(statuses)
            wait_until(lambda: len(statuses) > n + 5, what="traffic while c serves")
            assert client.post("/v2/repository/models/c/unload", headers=AUTH).status_code == 200
            assert groups(client) == [([0, 1], 2, ["a", "b"])]
            n = len(statuses)
            wait_until(lambda: len(statuses) > n + 5, what="traffic after the unload")
        assert len(factory.gangs) == 3 and sum(not g._stopped for g in factory.gangs) == 1
        history = client.get("/ui/status").json()["placement"]["history"]
        assert [h.get("reason") for h in history] == [None, "model c loaded", "model c unloaded"]
    assert set(statuses) == {200}, sorted(set(statuses))


def test_auto_re_plans_for_the_observed_bursts_and_rolls_without_failing_a_request() -> None:
    """Declared steady load: auto gives each model a device. The observed load alternates bursts
    of 80 req/s between the models, more than one device answers: the re-plan serves each model from
    both devices (with memory for both models on each device: a replica on each), and the engines
    roll onto it while they answer."""
    factory = FakeFactory()
    kw = {"placement": "auto", "workload_rate": 10.0, "replan_interval_s": 0, "device_memory_mb": 200.0}
    with placed(factory, **kw) as (client, _):
        assert sorted(map(sorted, devices_of(client).values())) == [[0], [1]]
        app = client.app
        placement = app.state.models.placement
        now = time.monotonic()
        trace = alternating_bursts(("a", "b"), burst_rate=80.0, period_s=2.0, duration_s=20.0).trace()
        for t, m in trace.requests:  # as if they had arrived over the last 20 s
            app.state.models.engine(m).arrivals.append(now - 20.0 + t)
        placement.config = placement.config.__class__(**{**placement.config.__dict__, "look_back_s": 20.0})

        def twenty(model: str) -> list[int]:
            return [ask(client, model=model).status_code for _ in range(20)]

        with ThreadPoolExecutor(2) as pool:
            asking = [pool.submit(twenty, m) for m in "ab"]
            client.portal.call(placement.replan)  # type: ignore[attr-defined]
            answered = [code for f in asking for code in f.result(timeout=20)]
        assert devices_of(client) == {"a": {0, 1}, "b": {0, 1}}
        assert set(answered) == {200}
        assert placement.history[-1]["reason"] == "re-plan for the observed load"
        assert ask(client, model="b").status_code == 200
        searches = client.get("/ui/status").json()["placement"]["searches"]
        assert searches["count"] == 1 and 0 < searches["last_s"] == searches["seconds"], searches


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"placement": "multiplexed", "pp": 2}, "decides pp, tp and the replicas: not with pp=2"),
        ({"placement": "auto", "replicas": 2}, "not with replicas=2"),
        ({"placement": "spread"}, "placement='spread' must be one of dedicated, multiplexed, auto"),
        ({"device_memory_mb": 100.0}, "device_memory_mb apply with placement only"),
        ({"placement": "auto", "latency_profile": "/no/such.json"}, r"latency profile /no/such\.json: "),
    ],
)
def test_placement_flag_mistakes_are_one_clear_error(kw: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        ServeSettings(model=TWO, **kw)


def test_admin_token_still_guards_the_repository_with_a_placement() -> None:
    with placed(placement="multiplexed") as (client, _):
        assert client.post("/v2/repository/models/a/unload").status_code == 401
        assert (
            client.get("/v2/repository/index", headers={"Authorization": f"Bearer {TOKEN}"}).status_code
            == 200
        )
