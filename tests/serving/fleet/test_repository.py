"""Tests for serving/fleet/repository.py on engines of its own kind: the fleet holds engines as
``ModelEngine`` (serving/fleet/model_engine.py) and gets them from the ``build`` it is handed, so the
repository's states, errors, loads and unloads run here without the engine room; the engine room's
``Engine`` has what the protocol asks. Through every protocol, on fake gangs:
tests/serving/frontend/test_v2_repository.py.

Run: python -m pytest tests/serving/fleet/test_repository.py -q
"""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace
from typing import Any

import pytest

from shardserve.serving.engine import qa_types
from shardserve.serving.errors import EngineError
from shardserve.serving.fleet.model_engine import ModelEngine
from shardserve.serving.fleet.repository import ModelRepository, ModelState, model_version
from shardserve.serving.metrics import ServingMetrics


class FakeEngine:
    """A ``ModelEngine``: ready once started (unless ``fails``), stopped by ``shutdown``."""

    def __init__(self, name: str, model: Any, *, fails: bool = False) -> None:
        self.name, self.model, self.fails = name, model, fails
        self.manager = SimpleNamespace(fatal_error=None)
        self.supervisor = None
        self.arrivals: deque[float] = deque()
        self.generation = 0
        self.ready = 0
        self.calls: list[str] = []

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ready_replicas": self.ready, "starting_replicas": 0}
        if self.manager.fatal_error is not None:
            out["fatal"] = self.manager.fatal_error
        return out

    async def start(self) -> None:
        self.calls.append("start")
        if self.fails:
            self.manager.fatal_error = f"model {self.name!r}: its gang failed to start"
        else:
            self.ready = 1

    async def reload(self, name: str) -> Any:
        self.calls.append(f"reload {name}")
        self.generation += 1
        return self.model

    def begin_drain(self, *, within_s: float | None = None) -> None:
        self.calls.append("drain")

    def abort(self) -> None:
        self.calls.append("abort")

    async def shutdown(self, *, timeout_s: float) -> None:
        self.calls.append("shutdown")
        self.ready = 0


def load(ref: str, generation: int) -> Any:
    """A checked model, as the fleet's loader gives it; ``bad*`` do not fit, ``gone*`` do not load."""
    if ref.startswith("bad"):
        raise ValueError(f"max_seq_len=512 > the model's 128 positions ({ref})")
    if ref.startswith("gone"):
        raise OSError(f"/secret/{ref}: no such file")
    return SimpleNamespace(source=SimpleNamespace(name=ref), generation=generation)


def repository(**kw: Any) -> tuple[ModelRepository[FakeEngine], dict[str, FakeEngine]]:
    built: dict[str, FakeEngine] = {}

    def build(name: str, model: Any) -> FakeEngine:
        built[name] = FakeEngine(name, model, fails=model.source.name.startswith("dead"))
        return built[name]

    return ModelRepository(load=load, build=build, metrics=ServingMetrics(), **kw), built


def test_the_server_engine_and_a_fake_satisfy_the_fleet_protocol() -> None:
    from shardserve.partitioner.runtime.fake_gang import FakeFactory
    from shardserve.serving.config import SchedulerConfig
    from shardserve.serving.engine.core import Engine
    from shardserve.serving.engine.scheduler import Scheduler
    from shardserve.serving.fleet.backend import OwnGangs
    from shardserve.serving.fleet.pool import DevicePool
    from shardserve.serving.fleet.replicas import ReplicaManager

    model = SimpleNamespace(source=SimpleNamespace(name="m"), generation=0)
    metrics = ServingMetrics().for_model("m")
    scheduler = Scheduler(SchedulerConfig())
    gangs = OwnGangs(DevicePool(["cpu"]), FakeFactory())
    manager = ReplicaManager(gangs=gangs, model=model, metrics=metrics, ledger=scheduler)  # type: ignore[arg-type]
    engine = Engine(scheduler=scheduler, manager=manager, metrics=metrics, name="m")
    assert isinstance(engine, ModelEngine)
    assert isinstance(FakeEngine("m", model), ModelEngine)
    assert not isinstance(object(), ModelEngine)
    assert qa_types.EngineError is EngineError  # the request path and the fleet raise one error


def test_models_start_each_failure_reported_and_the_rest_served() -> None:
    async def main() -> None:
        repo, built = repository()
        await repo.start([("a", "bad-a"), ("b", "tiny"), ("c", "gone-c"), ("d", "dead-d")])
        states = {row["name"]: (row["state"], row["reason"]) for row in repo.index()}
        assert states["a"] == (
            "UNAVAILABLE",
            "failed to load: max_seq_len=512 > the model's 128 positions (bad-a)",
        )
        assert states["b"] == ("READY", "")
        assert states["c"] == (
            "UNAVAILABLE",
            "failed to load: not a loadable model (the server log has the reason)",
        )  # no server path
        assert states["d"] == ("UNAVAILABLE", "its gangs could not start (the server log has the reason)")
        assert set(built) == {"b", "d"} and built["b"].calls == ["start"]
        assert repo.ready() and repo.default_name == "b" and repo.engine() is built["b"]
        assert repo.fatal_error() is None  # b serves
        assert [row["version"] for row in repo.index()] == ["", "1", "", "1"]
        with pytest.raises(EngineError) as unknown:
            repo.engine("nope")
        assert (unknown.value.status, unknown.value.code) == (404, "model_not_found")
        assert "'a', 'b', 'c', 'd'" in unknown.value.detail
        with pytest.raises(EngineError) as unavailable:
            repo.engine("a")
        assert (unavailable.value.status, unavailable.value.code) == (503, "model_unavailable")
        health = repo.health()
        assert health["ready_replicas"] == 1 and health["models"]["d"]["state"] == "UNAVAILABLE"
        await repo.shutdown(timeout_s=1)
        assert built["b"].calls[-1] == "shutdown"

    asyncio.run(main())


def test_unload_keeps_the_model_known_and_load_by_name_serves_it_again() -> None:
    async def main() -> None:
        repo, built = repository()
        await repo.start([("a", "tiny"), ("b", "tiny")])
        first = built["a"]
        await repo.unload("a")
        assert first.calls == ["start", "shutdown"]
        assert repo.entries["a"].state is ModelState.UNAVAILABLE and repo.entries["a"].reason == "unloaded"
        with pytest.raises(EngineError) as gone:
            repo.engine("a")
        assert gone.value.status == 503 and "unloaded" in gone.value.detail
        entry = await repo.load("a")  # by its name alone: from what declared it
        assert entry.state is ModelState.READY and built["a"] is not first and repo.engine("a") is built["a"]
        await repo.load("a", "tiny-2")  # served already: a reload of its engine
        assert built["a"].calls == ["start", "reload tiny-2"] and model_version(built["a"]) == "2"
        with pytest.raises(EngineError) as failed:
            await repo.load("c", "bad-c")
        assert (failed.value.status, failed.value.code) == (400, "load_failed")
        with pytest.raises(EngineError) as unknown:
            await repo.load("d")
        assert (unknown.value.status, unknown.value.code) == (404, "model_not_found")
        repo.begin_drain(within_s=1.0)
        repo.abort()
        assert built["b"].calls == ["start", "drain", "abort"]
        await repo.shutdown(timeout_s=1)
        with pytest.raises(EngineError) as stopping:
            await repo.load("a")
        assert (stopping.value.status, stopping.value.code) == (503, "shutting_down")

    asyncio.run(main())
