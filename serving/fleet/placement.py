"""Placed models: where a server's models run on its devices (``--placement``), chosen, made real, changed live.

- **choose**: the policy (``dedicated``, ``multiplexed`` or ``auto``: ``partitioner/placement/search.py``,
  AlpaServe's) simulates the workload over the models' cost-model profiles under each device's
  memory: at start the declared workload (``PlacementConfig.rate`` / ``cv`` / ``skew``), in auto's re-plans
  the arrivals observed since (each engine's ``arrivals``);
- **make real**: each model's generation is split as its groups are (their pp and tp), and the
  groups' gangs are ``serving/fleet/groups.py``'s; each model's engine draws its replicas from there
  (``gangs(name)``, ``replicas(name)``) and follows the placement once attached (``attach``: a
  ``ModelEngine``, ``serving/fleet/model_engine.py``, whose replica manager it rolls);
- **change**: a new placement (a model loaded or unloaded, a model reloaded, or a re-plan that
  predicts more SLO attainment by ``min_gain``) rolls every engine whose places changed, all at
  once (a group shared by several models starts once), each like a reload: its new gangs are ready
  before its old ones drain, so requests are answered throughout. Each search after the start is
  timed (``searches`` in ``describe``: it runs on a thread beside the front end).

    placed = PlacedModels(config, groups=DeviceGroups(factory=..., labels=list(config.labels)))
    gens = placed.place({"a": gen_a, "b": gen_b})          # each model at its groups' pp / tp
    engine = build_engine(..., gangs=placed.gangs("a"))     # its replicas: placed.replicas("a")
    placed.attach("a", engine)
    await placed.change({"a": gen_a, "b": gen_b, "c": gen_c}, reason="model c loaded")
    await placed.replan()                                   # auto: from the observed arrivals

Tests: ``pytest tests/serving/fleet/test_placement.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from shardserve.partitioner.placement.cost_profile import cost_profiles
from shardserve.partitioner.placement.latency import MeasuredLatency, PlacementError
from shardserve.partitioner.placement.search import PlacementChoice, choose_placement, replan
from shardserve.partitioner.placement.simulator import SimConfig
from shardserve.partitioner.placement.workload import Trace, look_back, steady
from shardserve.partitioner.plan import ParallelDims
from shardserve.serving.config import PlacementConfig
from shardserve.serving.fleet.backend import GangSource, ModelGeneration
from shardserve.serving.fleet.groups import DeviceGroups
from shardserve.serving.fleet.model_engine import ModelEngine

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Searches:
    """The placement searches made after the start (re-plans, loads, unloads) and their wall time:
    each runs on a thread of the server's process, beside the front end, so their cost is shown."""

    count: int = 0
    seconds: float = 0.0
    last_s: float | None = None

    def add(self, seconds: float) -> None:
        self.count, self.seconds, self.last_s = self.count + 1, self.seconds + seconds, seconds

    def describe(self) -> dict[str, Any]:
        last = None if self.last_s is None else round(self.last_s, 4)
        return {"count": self.count, "seconds": round(self.seconds, 4), "last_s": last}


class PlacedModels:
    """The placement of the served models and the engines that follow it (see module doc)."""

    def __init__(
        self,
        config: PlacementConfig,
        *,
        groups: DeviceGroups,
        sim: SimConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.groups = groups
        # stage times measured for these models (--latency-profile), else the cost model's
        self.measured = (
            None if config.latency_profile is None else MeasuredLatency.read(config.latency_profile)
        )
        overhead = self.measured.overhead_s if self.measured is not None else 0.0
        self.sim = dataclasses.replace(sim or SimConfig(), overhead_s=overhead)
        self.clock = clock
        self.choice: PlacementChoice | None = None
        self.why: dict[str, str] = {}  # models the placement left out, and why
        self.history: list[dict[str, Any]] = []  # placements rolled out: time, reason, describe
        self.searches = Searches()  # what choosing has cost this process
        self._models: dict[str, ModelGeneration] = {}  # as loaded
        self._placed: dict[str, ModelGeneration] = {}  # at their groups' pp / tp
        self._engines: dict[str, ModelEngine] = {}
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ what engines read
    def gangs(self, name: str) -> GangSource:
        """Where model ``name``'s replica gangs come from: its places on the groups."""
        return self.groups.source(name)

    def replicas(self, name: str) -> int:
        """Groups holding model ``name`` (its replica count)."""
        return self.groups.replicas(name)

    def attach(self, name: str, engine: ModelEngine) -> None:
        """``engine`` serves model ``name`` from now on (it rolls with the placement)."""
        self._engines[name] = engine

    def detach(self, name: str) -> None:
        self._engines.pop(name, None)

    def describe(self) -> dict[str, Any]:
        """The placement for the status page and /admin: policy, groups, prediction, history."""
        choice = self.choice
        return {
            "policy": self.config.policy,
            "devices": self.config.devices,
            "device_memory_bytes": self.config.device_memory_bytes,
            "groups": self.groups.describe(),
            "unplaced": dict(self.why),
            "prediction": None if choice is None else choice.result.to_dict(),
            "history": list(self.history),
            "searches": self.searches.describe(),
        }

    # ------------------------------------------------------------------ choosing
    def _choose(self, models: Mapping[str, ModelGeneration], trace: Trace | None) -> PlacementChoice:
        cfg = self.config
        profiles, single, _how = cost_profiles(
            {name: gen.source.config for name, gen in models.items()},
            measured=self.measured,
            devices=cfg.devices,
            seq_len=cfg.seq_len,
            max_batch_size=self.sim.max_batch_size,
            dtype_bytes=cfg.dtype_bytes,
            device=cfg.device,
            single_latency_s=cfg.single_latency_s,
        )
        slo = {name: cfg.slo_scale * s for name, s in single.items()}
        kw: dict[str, Any] = {
            "num_devices": cfg.devices,
            "device_memory_bytes": cfg.device_memory_bytes,
            "slo_s": slo,
            "config": self.sim,
        }
        if trace is None:
            workload = steady(
                list(models), rate=cfg.rate, cv=cfg.cv, skew=cfg.skew, duration_s=cfg.simulate_s
            )
            return choose_placement(cfg.policy, profiles, workload, **kw)  # type: ignore[arg-type]
        current = self.choice.placement if self.choice is not None else None
        return replan(trace, profiles, current=current, min_gain=cfg.min_gain, **kw)

    def _apply(self, choice: PlacementChoice, models: Mapping[str, ModelGeneration]) -> None:
        """Each placed model's generation at its groups' pp / tp (the same object as before when
        neither changed, so its groups keep their gangs); the groups follow."""
        placed: dict[str, ModelGeneration] = {}
        for g in choice.placement.groups:
            for name in g.models:
                gen, before = models[name], self._placed.get(name)
                dims = ParallelDims(pp=g.pp, tp=g.tp)
                if before is not None and self._models.get(name) is gen and before.dims == dims:
                    placed[name] = before
                else:
                    placed[name] = gen if gen.dims == dims else dataclasses.replace(gen, dims=dims)
                    placed[name].plan()  # the split is feasible (InfeasiblePlanError with the numbers)
        self.groups.place(choice.placement, placed)
        self.choice, self._models, self._placed = choice, dict(models), placed
        self.why = {
            name: (
                f"not placed: it does not fit any group of the {self.config.devices} devices "
                f"({self.config.device_memory_bytes / 2**20:.0f} MiB each) beside the others"
            )
            for name in models
            if name not in placed
        }
        self.history.append(
            {
                "time": time.time(),
                "policy": choice.policy,
                "placement": choice.placement.describe(),
                "attainment": round(choice.result.attainment, 4),
            }
        )
        del self.history[:-20]

    def place(self, models: Mapping[str, ModelGeneration]) -> dict[str, ModelGeneration]:
        """The placement for the declared workload (at start, before any engine): each placed
        model's generation at its groups' pp / tp. PlacementError (with the numbers) when none fits."""
        self._apply(self._choose(models, None), models)
        logger.info(
            "placement %s for %g req/s (cv %g), SLO %g x single latency: %s, predicted attainment %.1f%%",
            self.config.policy,
            self.config.rate,
            self.config.cv,
            self.config.slo_scale,
            self.groups.placement.describe(),
            100 * self.choice.result.attainment if self.choice else 0.0,
        )
        return dict(self._placed)

    def placed(self, name: str) -> ModelGeneration | None:
        """Model ``name``'s generation as placed (None: not placed)."""
        return self._placed.get(name)

    @property
    def models(self) -> dict[str, ModelGeneration]:
        """The models the placement is for, as loaded."""
        return dict(self._models)

    # ------------------------------------------------------------------ changing
    async def change(
        self, models: Mapping[str, ModelGeneration], *, reason: str, trace: Trace | None = None
    ) -> dict[str, Exception]:
        """Place ``models`` (the declared workload; ``trace``: an observed one, kept only when it beats
        the current placement by ``min_gain``) and roll the engines onto it. PlacementError when
        nothing fits. Returns the engines that could not roll (each stays on its old gangs; a
        ``ReloadError``), by model name."""
        async with self._lock:
            t0 = time.perf_counter()
            choice = await asyncio.to_thread(self._choose, models, trace)
            self.searches.add(time.perf_counter() - t0)
            if choice.policy == "current" and set(models) == set(self._models):
                return {}
            self._apply(choice, models)
            self.history[-1]["reason"] = reason
            logger.info("placement -> %s (%s)", self.groups.placement.describe(), reason)
            return await self._roll()

    async def _roll(self) -> dict[str, Exception]:
        async def roll(name: str, engine: ModelEngine) -> None:
            gen, want = self._placed.get(name), self.replicas(name)
            manager = engine.manager
            moved = any(not manager.gangs.current(r.slots) for r in manager.replicas.values())
            if gen is None:
                gen, want = manager.model, 0
            if gen is not manager.model or moved or want != manager.target:
                await manager.reload(gen, replicas=want)
            if engine.supervisor is not None and want:
                engine.supervisor.pin(want, source="placement", reason=self.groups.placement.describe())

        names = list(self._engines)
        results = await asyncio.gather(*(roll(n, self._engines[n]) for n in names), return_exceptions=True)
        failed = {}
        for name, res in zip(names, results, strict=True):
            if isinstance(res, BaseException):
                if not isinstance(res, Exception):
                    raise res
                logger.error("model %s did not roll onto the new placement: %s", name, res)
                failed[name] = res
        return failed

    async def reload(self, name: str, model: ModelGeneration) -> None:
        """Serve a new generation of model ``name`` (a reload): its groups get new gangs, and every
        model on them rolls (``change``); raises what stopped model ``name`` itself from rolling."""
        failed = await self.change({**self._models, name: model}, reason=f"model {name} reloaded")
        if name in failed:
            raise failed[name]

    # ------------------------------------------------------------------ auto: re-planning
    def observed(self, now: float | None = None) -> Trace | None:
        """The arrivals of the last ``look_back_s`` over every attached engine (None when fewer than
        ``min_requests`` arrived: too little to fit)."""
        now = self.clock() if now is None else now
        arrivals = ((t, name) for name, e in self._engines.items() for t in list(e.arrivals))
        trace = look_back(arrivals, now=now, window_s=self.config.look_back_s)
        return trace if len(trace.requests) >= self.config.min_requests else None

    async def replan(self) -> None:
        """Auto: re-choose for the observed arrivals, roll only when it predicts ``min_gain`` more."""
        trace = self.observed()
        if trace is None:
            return
        try:
            await self.change(self._models, reason="re-plan for the observed load", trace=trace)
        except PlacementError as err:
            logger.warning("re-plan failed: %s", err)

    def start(self) -> None:
        """Auto with ``replan_interval_s`` > 0: re-plan on that period in the background."""
        if self.config.policy == "auto" and self.config.replan_interval_s > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._replan_loop(), name="shardserve-replan")

    async def _replan_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.replan_interval_s)
            try:
                await self.replan()
            except Exception:  # never let the loop die
                logger.exception("re-plan failed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
