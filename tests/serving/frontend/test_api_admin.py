"""HTTP API admin routes over fake in-process gangs: the bearer token (or token file), setting the
replica count, autoscaling under a load step, and hot reload (no failed requests, a starting gang,
broken checkpoints, path-free replies, one reload at a time) (helpers: api_helpers.py).

Run: python -m pytest tests/serving/frontend/test_api_admin.py -q      (no worker processes; seconds)
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from shardserve.partitioner.runtime.fake_gang import FakeFactory
from shardserve.serving.frontend.settings import ServeSettings
from tests.clients import closed_loop
from tests.serving.frontend.api_helpers import (
    TOKEN,
    WORKER_TRACEBACK,
    _submit_async,
    ask,
    serving,
    wait_until,
)

# ------------------------------------------------------------------------------------- admin


def test_admin_requires_the_bearer_token() -> None:
    with serving(admin_token=None) as (client, _):
        r = client.get("/admin/replicas", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 401 and r.json()["error"] == "admin_disabled"
    with serving() as (client, _):
        assert client.get("/admin/replicas").status_code == 401
        wrong = client.get("/admin/replicas", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.headers["WWW-Authenticate"] == "Bearer"
        assert client.post("/admin/replicas", json={"replicas": 2}).status_code == 401
        assert client.post("/admin/reload", json={"model": "tiny-roberta"}).status_code == 401
        ok = client.get("/admin/replicas", headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200 and ok.json()["ready"] == 1


def test_admin_sets_the_replica_count() -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with serving(cpu_slots=3) as (client, factory):
        r = client.post("/admin/replicas", json={"replicas": 3}, headers=auth)
        assert r.status_code == 200 and r.json()["target"] == 3 and r.json()["autoscaling"] is False
        wait_until(lambda: client.get("/admin/replicas", headers=auth).json()["ready"] == 3, what="3 ready")
        r = client.post("/admin/replicas", json={"replicas": 5}, headers=auth)  # pool fits 3 gangs of 1 rank
        assert r.status_code == 422 and "exceeds the cap of 3" in r.json()["detail"]
        client.post("/admin/replicas", json={"replicas": 1}, headers=auth)
        wait_until(lambda: len(client.app.state.manager.replicas) == 1, what="scale down to 1")
        assert sum(g.healthy for g in factory.gangs) == 1
        bad = client.post("/admin/replicas", json={"min_replicas": 3, "max_replicas": 2}, headers=auth)
        assert bad.status_code == 422 and "min_replicas=3 > max_replicas=2" in bad.json()["detail"]


def test_admin_token_file_keeps_the_token_off_the_command_line(tmp_path: Any) -> None:
    token_file = tmp_path / "admin-token"
    token_file.write_text("from-a-file\n")
    with serving(admin_token=None, admin_token_file=str(token_file)) as (client, _):
        assert (
            client.get("/admin/replicas", headers={"Authorization": "Bearer from-a-file"}).status_code == 200
        )
        assert client.get("/admin/replicas", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 401
    with pytest.raises(ValueError, match="not both"):
        ServeSettings(admin_token="x", admin_token_file=str(token_file))
    with pytest.raises(ValueError, match="cannot be read"):
        ServeSettings(admin_token_file=str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        ServeSettings(admin_token_file=str(tmp_path / "empty"))


# ------------------------------------------------------------------------------------- autoscaling


def test_autoscaler_scales_up_under_a_load_step_and_back_down() -> None:
    kw = dict(
        min_replicas=1,
        max_replicas=3,
        cpu_slots=4,
        target_ongoing_requests=1.0,
        upscale_delay_s=0.0,
        downscale_delay_s=0.3,
        look_back_period_s=0.3,
        autoscale_interval_s=0.05,
        max_batch_size=1,
        max_inflight_per_replica=1,
    )
    with serving(**kw) as (client, factory):
        manager = client.app.state.manager
        factory.gate.clear()
        with ThreadPoolExecutor(8) as pool:
            futures = _submit_async(client, pool, 6)  # load step: 6 ongoing vs target 1 per replica
            wait_until(lambda: manager.ready == 3, what="scale up to 3")
            factory.gate.set()
            assert [f.result(timeout=10).status_code for f in futures] == [200] * 6
        wait_until(lambda: len(manager.replicas) == 1, timeout=10, what="scale down to 1")
        sup = client.app.state.supervisor
        assert sup.autoscaler.counts["up"] >= 1 and sup.autoscaler.counts["down"] >= 1
        text = client.get("/metrics").text
        assert 'shardserve_autoscale_decisions_total{direction="up",model="tiny-bert"}' in text


# ------------------------------------------------------------------------------------- reload


def test_hot_reload_switches_model_without_failed_requests() -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with serving(replicas=1) as (client, factory):
        statuses: list[int] = []

        with closed_loop(lambda _: statuses.append(ask(client).status_code), n=3):
            wait_until(lambda: len(statuses) > 5, what="traffic")
            r = client.post("/admin/reload", json={"model": "tiny-roberta"}, headers=auth)
            n_at_switch = len(statuses)
            wait_until(lambda: len(statuses) > n_at_switch + 5, what="traffic after reload")
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "tiny-roberta" and r.json()["generation"] == 1
        assert set(statuses) == {200}
        assert factory.models == ["tiny-bert", "tiny-roberta"]
        assert factory.gangs[0].healthy is False and factory.gangs[1].healthy
        assert factory.gangs[1].token_types_seen[-1] is False  # roberta: no token_type_ids
        assert ask(client).json()["model"] == "tiny-bert"  # the public name stays; a new generation serves
        assert client.get("/v1/models").json()[0]["generation"] == 1


def test_reload_while_a_gang_starts_ends_that_start_and_keeps_serving() -> None:
    """A scale-up gang still starting holds slots: the reload ends that start (not a start failure)
    instead of draining the serving gang and then finding no free slot for the new one."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with serving(cpu_slots=2) as (client, factory):
        manager = client.app.state.manager
        factory.start_s = 60.0  # the scale-up gang hangs while starting
        client.post("/admin/replicas", json={"replicas": 2}, headers=auth)
        wait_until(lambda: manager.starting == 1, what="a starting gang")
        factory.start_s = 0.0
        with ThreadPoolExecutor(1) as pool:
            reload = pool.submit(client.post, "/admin/reload", json={"model": "tiny-roberta"}, headers=auth)
            readiness = []
            while not reload.done():
                readiness.append(client.get("/readyz").status_code)
            r = reload.result()
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "tiny-roberta" and set(readiness) == {200}
        wait_until(lambda: manager.ready == 2, what="two gangs of the new model")
        assert factory.models == ["tiny-bert", "tiny-bert", "tiny-roberta", "tiny-roberta"]
        assert manager.start_failures == 0 and ask(client).json()["model"] == "tiny-bert"


def test_reload_to_a_broken_checkpoint_keeps_the_old_gangs() -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    factory = FakeFactory()
    factory.fail_start_models.add("tiny-roberta")
    with serving(factory) as (client, _):
        r = client.post("/admin/reload", json={"model": "tiny-roberta"}, headers=auth)
        assert r.status_code == 422 and r.json()["error"] == "reload_failed"
        missing = client.post("/admin/reload", json={"model": "/no/such/dir"}, headers=auth)
        assert missing.status_code == 422 and missing.json()["error"] == "invalid_model"
        assert ask(client).json()["model"] == "tiny-bert"


def test_reload_answers_alike_for_existing_and_missing_directories(tmp_path: Any) -> None:
    """/admin/reload must not map the file system: a system directory, a missing one and a folder
    with only config.json get the same reply (issue 11.7)."""
    import shutil

    from shardserve.models.registry import resolve_model

    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(resolve_model("tiny-bert").checkpoint / "config.json", no_weights)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with serving() as (client, factory):
        replies = []
        for target in ("/etc", "/no/such/dir", str(tmp_path), str(no_weights)):
            r = client.post("/admin/reload", json={"model": target}, headers=auth)
            assert r.status_code == 422, r.text
            replies.append(r.json()["detail"].replace(repr(target), "MODEL"))
        assert len(set(replies)) == 1 and "Traceback" not in replies[0]
        assert factory.models == ["tiny-bert"] * len(factory.models)  # nothing started for any of them


def test_failed_reload_detail_is_one_line_without_paths() -> None:
    """A gang that fails to start during a reload: its traceback stays in the log (issue 11.6)."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    factory = FakeFactory()
    factory.fail_start_models.add("tiny-roberta")
    factory.start_error = WORKER_TRACEBACK
    with serving(factory) as (client, _):
        r = client.post("/admin/reload", json={"model": "tiny-roberta"}, headers=auth)
        assert r.status_code == 422 and r.json()["error"] == "reload_failed"
        detail = r.json()["detail"]
        assert "\n" not in detail and "Traceback" not in detail and "/srv/" not in detail
        assert "/usr/lib" not in detail and "CheckpointError" in detail and "no weights found" in detail
        assert ask(client).json()["model"] == "tiny-bert"


def test_reload_while_another_reload_runs_is_409() -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with serving() as (client, _):
        client.app.state.manager._reloading = True  # as while a reload is rolling the gangs
        try:
            r = client.post("/admin/reload", json={"model": "tiny-roberta"}, headers=auth)
        finally:
            client.app.state.manager._reloading = False
        assert r.status_code == 409 and r.json()["error"] == "reload_in_progress"
