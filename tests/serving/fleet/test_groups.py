"""Tests for serving/fleet/groups.py: one gang per device group, shared by the replica managers of the
models placed on it (fake gangs, real managers on an event loop).

Run: python -m pytest tests/serving/fleet/test_groups.py -q
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from shardserve.models.registry import resolve_model
from shardserve.partitioner.placement.layout import Group, Placement
from shardserve.partitioner.plan import ParallelDims
from shardserve.partitioner.runtime.fake_gang import FakeFactory
from shardserve.serving.config import SchedulerConfig
from shardserve.serving.engine.scheduler import Scheduler
from shardserve.serving.fleet.backend import ModelGeneration
from shardserve.serving.fleet.groups import DeviceGroups
from shardserve.serving.fleet.replicas import ReplicaManager, ReplicaState
from shardserve.serving.metrics import ServingMetrics

MUX = Placement((Group((0, 1), pp=2, models=("a", "b")),))
DEDICATED = Placement((Group((0,), pp=1, models=("a",)), Group((1,), pp=1, models=("b",))))


@pytest.fixture(scope="module")
def base() -> ModelGeneration:
    source = resolve_model("tiny-bert")
    return ModelGeneration(
        0, source, ParallelDims(1, 1), AutoTokenizer.from_pretrained(str(source.tokenizer_dir))
    )


def gens(base: ModelGeneration, pp: int) -> dict[str, ModelGeneration]:
    return {m: dataclasses.replace(base, dims=ParallelDims(pp, 1)) for m in ("a", "b")}


async def until(cond: Callable[[], Any], what: str, timeout: float = 5.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def run(
    base: ModelGeneration,
    body: Callable[[DeviceGroups, dict[str, ReplicaManager], FakeFactory], Awaitable[None]],
) -> FakeFactory:
    """Place both models on one pp=2 group, start a manager for each, run ``body``, close them."""
    factory = FakeFactory()

    async def main() -> None:
        groups = DeviceGroups(factory=factory, labels=["cpu", "cpu"])
        models = gens(base, 2)
        groups.place(MUX, models)
        metrics = ServingMetrics()
        managers = {
            m: ReplicaManager(
                gangs=groups.source(m),
                model=models[m],
                metrics=metrics.for_model(m),
                ledger=Scheduler(SchedulerConfig()),
                restart_backoff_s=0.05,
            )
            for m in models
        }
        for name, manager in managers.items():
            assert manager.set_target(groups.replicas(name)) == 1
        await until(lambda: all(m.ready == 1 for m in managers.values()), "both models ready")
        try:
            await body(groups, managers, factory)
        finally:
            await asyncio.gather(*(m.close(timeout_s=1) for m in managers.values()))
        assert groups.pool.free == groups.pool.capacity  # every gang's slots were given back

    asyncio.run(main())
    return factory


def ask(manager: ReplicaManager) -> torch.Tensor:
    (replica,) = manager.routable()
    assert replica.backend is not None
    return replica.backend.submit(torch.ones(1, 8, dtype=torch.long), torch.ones(1, 8)).result(timeout=5)


def test_the_models_of_a_group_share_one_gang_and_each_submits_its_own_micro_batches(base):
    async def body(groups, managers, factory):
        assert factory.models == ["tiny-bert+tiny-bert"]  # one gang, holding both models
        (gang,) = factory.gangs
        assert gang.models == ["a", "b"]
        ask(managers["b"])
        ask(managers["a"])
        # warm-ups (one per model) then the two asked: each tagged with its own model
        assert gang.submitted_models == ["a", "b", "b", "a"] or gang.submitted_models == ["b", "a", "b", "a"]
        assert groups.describe() == [
            {"devices": [0, 1], "pp": 2, "tp": 1, "models": ["a", "b"], "gang": gang.name, "running": True}
        ]

    factory = run(base, body)
    assert factory.gangs[0]._stopped  # the last model's replica stopping stopped it


def test_a_lost_rank_fails_every_model_on_the_group_and_one_fresh_gang_replaces_it(base):
    async def body(groups, managers, factory):
        factory.gangs[0].kill()
        for manager in managers.values():
            manager.check_health()  # the one owner of replica health, per model
        assert all(m.ready == 0 for m in managers.values())
        await until(lambda: all(m.ready == 1 for m in managers.values()), "both models back")
        assert len(factory.gangs) == 2  # one restart for both, not one per model
        assert all(m.restarts == 1 for m in managers.values())
        assert torch.equal(ask(managers["a"]), ask(managers["b"]))  # both answered by the new gang
        assert factory.gangs[1].submitted_models[-2:] == ["a", "b"]

    run(base, body)


def test_a_new_placement_rolls_each_model_onto_its_new_gangs_before_the_old_one_stops(base):
    async def body(groups, managers, factory):
        old = factory.gangs[0]
        models = gens(base, 1)
        groups.place(DEDICATED, models)
        assert [m.gangs.current(r.slots) for m in managers.values() for r in m.routable()] == [False, False]
        await asyncio.gather(*(m.reload(models[n], replicas=groups.replicas(n)) for n, m in managers.items()))
        assert sorted(factory.models[1:]) == ["tiny-bert", "tiny-bert"]  # a gang of its own each
        assert old._stopped and not any(g._stopped for g in factory.gangs[1:])
        for name, manager in managers.items():
            (replica,) = manager.routable()
            assert replica.model is models[name] and manager.gangs.current(replica.slots)
        assert [g.models for g in factory.gangs[1:]] in (
            [["a"], ["b"]],
            [["b"], ["a"]],
        )
        assert groups.pool.free == groups.pool.capacity - 2  # the old gang's two slots came back

    run(base, body)


def test_a_model_stopping_leaves_the_shared_gang_to_the_other(base):
    async def body(groups, managers, factory):
        (gang,) = factory.gangs
        await managers["a"].close(timeout_s=1)
        assert not gang._stopped and managers["b"].ready == 1
        ask(managers["b"])
        assert managers["a"].count(ReplicaState.READY) == 0

    run(base, body)


def test_a_placement_that_does_not_match_the_models_is_refused_with_the_numbers(base):
    groups = DeviceGroups(factory=FakeFactory(), labels=["cpu"])
    with pytest.raises(ValueError, match=r"there are 1 devices.*'a' is pp=1 tp=1, its group pp=2 tp=1"):
        groups.place(MUX, gens(base, 1))
    with pytest.raises(ValueError, match="'c' is placed but not loaded"):
        groups.place(Placement((Group((0,), pp=1, models=("c",)),)), gens(base, 1))
