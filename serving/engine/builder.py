"""Building a serving engine from configs: the scheduler, the fleet (device pool, gangs, replica
manager, supervisor) and the engine wired to them (vLLM's ``AsyncLLM.from_config``).

The one place that wires the rooms below the front end: the front end passes the configs its
settings build (``serving/config.py``) and gets an ``Engine`` whose facade (``serving/engine/core.py``)
is all it talks to about one model; of the fleet it imports only the model repository
(``serving/fleet/repository.py``), which holds these engines (``build_engine`` is the engine factory
the front end's lifespan hands it). The model is loaded and the device pool checked here too, before
anything starts (the CLI checks both before the server starts).

    fleet = settings.fleet_config(dtype="float32", compile=False)
    model = load_model(fleet, "tiny-bert", generation=0)   # ValueError / CheckpointError / OSError
    replica_cap(fleet)                                      # gangs the device pool holds; ValueError: none
    engine = build_engine(model=model, fleet=fleet, scheduler=settings.scheduler_config(),
                          autoscaling=settings.autoscaling_config(), metrics=ServingMetrics())
    await engine.start(); ...; await engine.shutdown(timeout_s=30)

``build_models`` assembles the whole server's models from the same configs (the serve lifespan's one
call): the device pool every engine shares, the placement when there is one, and the model
repository with its engine factory.

With ``--placement``, ``build_placement`` makes the device groups several models share, and each
model's engine is built with ``gangs=placed.gangs(name)`` (``serving/fleet/placement.py``).

Tests pass ``backend_factory`` (``partitioner/runtime/fake_gang.py``) instead of real gangs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Awaitable, Callable
from pathlib import Path

from shardserve.partitioner.placement.simulator import SimConfig
from shardserve.serving.config import AutoscalingConfig, FleetConfig, PlacementConfig, SchedulerConfig
from shardserve.serving.engine.core import Engine
from shardserve.serving.engine.scheduler import Scheduler
from shardserve.serving.fleet import model_loader
from shardserve.serving.fleet.backend import (
    BackendFactory,
    GangSource,
    ModelGeneration,
    OwnGangs,
    gang_factory,
)
from shardserve.serving.fleet.groups import DeviceGroups
from shardserve.serving.fleet.placement import PlacedModels
from shardserve.serving.fleet.pool import DevicePool
from shardserve.serving.fleet.replicas import ReplicaManager
from shardserve.serving.fleet.repository import ModelRepository
from shardserve.serving.fleet.supervisor import Supervisor
from shardserve.serving.metrics import ServingMetrics

__all__ = [
    "BackendFactory",
    "DevicePool",
    "ModelGeneration",
    "PlacedModels",
    "build_engine",
    "build_models",
    "build_placement",
    "device_pool",
    "load_model",
    "replica_cap",
]


def load_model(fleet: FleetConfig, name: str, *, generation: int) -> ModelGeneration:
    """A checked model generation (``serving/fleet/model_loader.py``); raises ValueError /
    CheckpointError / OSError before any gang starts."""
    return model_loader.load_generation(fleet, name, generation=generation)


def gang_factory_for(fleet: FleetConfig, scheduler: SchedulerConfig) -> BackendFactory:
    """Real gangs as ``fleet`` wants them (threads, dtype, compile warmed over the length buckets)."""
    return gang_factory(
        threads_per_rank=fleet.rank_threads,
        dtype=fleet.dtype,
        compile=fleet.compile,
        warmup_lengths=scheduler.length_buckets,
        heartbeat_timeout_s=fleet.heartbeat_timeout_s,
        start_timeout_s=fleet.start_timeout_s,
        network=fleet.network,
    )


def build_placement(
    config: PlacementConfig,
    *,
    fleet: FleetConfig,
    scheduler: SchedulerConfig,
    backend_factory: BackendFactory | None = None,
) -> PlacedModels:
    """The placement of several models on shared devices (``--placement``): its device groups run
    gangs from ``backend_factory`` (default: real ones, as ``fleet`` wants them); its simulation
    batches as ``scheduler`` does."""
    groups = DeviceGroups(
        factory=backend_factory or gang_factory_for(fleet, scheduler), labels=list(config.labels)
    )
    return PlacedModels(config, groups=groups, sim=SimConfig.from_scheduler(scheduler))


def replica_cap(fleet: FleetConfig) -> int:
    """Replica gangs the device pool of ``fleet`` holds; ValueError (with the numbers) when none fits."""
    return model_loader.device_pool(fleet).gangs_that_fit(fleet.world_size)


def device_pool(fleet: FleetConfig) -> DevicePool:
    """The device pool of ``fleet``, for engines that share it (``pool=`` of ``build_engine``); ValueError
    (with the numbers) when no gang fits."""
    return model_loader.device_pool(fleet)


def build_engine(
    *,
    model: ModelGeneration,
    fleet: FleetConfig,
    scheduler: SchedulerConfig,
    autoscaling: AutoscalingConfig,
    metrics: ServingMetrics,
    max_request_timeout_s: float = 300.0,
    name: str | None = None,
    backend_factory: BackendFactory | None = None,
    pool: DevicePool | None = None,
    gangs: GangSource | None = None,
    roll: Callable[[ModelGeneration], Awaitable[None]] | None = None,
) -> Engine:
    """Scheduler (the in-flight ledger) + replica manager + engine (attached to the manager) +
    supervisor; nothing starts until ``engine.start()``. ``name``: the model's name for clients
    (default: the loaded model's), fixed across reloads, and its ``model`` label in ``metrics``;
    ``pool``: a device pool shared with other models' engines (default: its own, from ``fleet``);
    ``gangs``: where its replica gangs come from instead (a placement's device groups, with ``roll``
    its reloads: ``serving/fleet/placement.py``)."""
    name = name or model.source.name
    model_metrics = metrics.for_model(name)
    if gangs is None:
        factory = backend_factory or gang_factory_for(fleet, scheduler)
        gangs = OwnGangs(pool or model_loader.device_pool(fleet), factory)
    sched = Scheduler(scheduler)  # its ledger: the one count of in-flight work, as the fleet reads it
    manager = ReplicaManager(
        gangs=gangs,
        model=model,
        metrics=model_metrics,
        ledger=sched,
        drain_timeout_s=fleet.drain_timeout_s,
        restart_backoff_s=fleet.restart_backoff_s,
        fail_fast=True,
        stall_timeout_s=fleet.stall_timeout_s,
    )
    supervisor = Supervisor(
        ledger=sched,
        manager=manager,
        metrics=model_metrics,
        config=autoscaling,
        interval_s=fleet.autoscale_interval_s,
    )
    engine = Engine(
        scheduler=sched,
        manager=manager,
        supervisor=supervisor,
        metrics=model_metrics,
        fleet=fleet,
        name=name,
        max_request_timeout_s=max_request_timeout_s,
        roll=roll,
    )
    manager.attach(engine)  # replica changes wake the engine; a failed replica's work fails over
    return engine


def build_models(
    *,
    fleet: FleetConfig,
    scheduler: SchedulerConfig,
    autoscaling: AutoscalingConfig,
    placement: PlacementConfig | None,
    metrics: ServingMetrics,
    max_request_timeout_s: float,
    root: Path | None = None,
    drain_timeout_s: float = 30.0,
    ready_timeout_s: float = 300.0,
    backend_factory: BackendFactory | None = None,
) -> tuple[ModelRepository[Engine], DevicePool]:
    """The served models' repository (nothing started: ``await models.start(...)``) and the device
    pool every engine shares, the placement's device groups when ``placement`` is given (each model
    then has as many replicas as places), and ``build_engine`` as the repository's engine factory."""
    pool = device_pool(fleet)
    placed = (
        None
        if placement is None
        else build_placement(placement, fleet=fleet, scheduler=scheduler, backend_factory=backend_factory)
    )

    def build(name: str, model: ModelGeneration) -> Engine:
        scaling, where = autoscaling, {}
        if placed is not None:  # its replicas: its places on the device groups, as many as they are
            n = placed.replicas(name)
            scaling = dataclasses.replace(autoscaling, min_replicas=n, max_replicas=n)
            where = {"gangs": placed.gangs(name), "roll": functools.partial(placed.reload, name)}
        return build_engine(
            model=model,
            fleet=fleet,
            scheduler=scheduler,
            autoscaling=scaling,
            metrics=metrics,
            max_request_timeout_s=max_request_timeout_s,
            name=name,
            backend_factory=backend_factory,
            pool=pool,
            **where,
        )

    models = ModelRepository(
        load=lambda ref, generation: load_model(fleet, ref, generation=generation),
        build=build,
        metrics=metrics,
        root=root,
        drain_timeout_s=drain_timeout_s,
        ready_timeout_s=ready_timeout_s,
        placement=placed,
    )
    return models, pool
