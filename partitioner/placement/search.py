"""Placement policies: which devices form groups, how each group is split, which models it holds.

Owns the three policies of ``shardserve plan --placement`` and re-planning; each returns a
``PlacementChoice`` (the placement and its simulated ``SimResult`` on the given trace). Every
decision is taken by simulating the trace (``partitioner/placement/simulator.py``), under a
per-device memory budget (``Placement.check_memory``); deterministic for a given trace.

- ``dedicated`` (AlpaServe's selective replication): every device is its own group (pp = tp = 1)
  holding whole models; device by device, the model whose replica raises the simulated attainment
  most (ties: the lower p99 latency, then the model with fewer replicas, then the first) gets it,
  models without a device first; then, where a device's memory holds more, models not placed yet
  and further replicas join devices as in ``auto`` (one gang per device runs its models).
- ``multiplexed``: groups of ``group_size`` devices (default: all of them) as ``pp = group_size``
  pipelines, each holding every model when they all fit; when they do not, models go to groups
  greedily as in ``auto``.
- ``auto`` (AlpaServe's search): for every group size dividing the device count and every
  ``(pp, tp)`` of that size some profile has latencies for, equal groups are filled greedily: each
  step adds the (model, group) pair whose simulated attainment is highest (ties: lower p99
  latency), first placing every model once, then replicas while the attainment rises and memory
  allows; the best placement over all configs wins, ties to fewer devices per group.
- ``replan``: ``auto`` on an observed trace (or workload), kept only when it beats the current
  placement on that trace by ``min_gain`` attainment.

At cluster scale (a greedy step with more than ``EXACT_CANDIDATES`` (model, group) candidates, e.g.
64 devices and 32 models) a step simulates a pruned set: while models are unplaced, the busiest of
them (most requests) on the ``GROUPS_PER_MODEL`` groups least loaded after taking it; then, for the
``WIDTH`` models losing the most requests in turn, a replica on each one's ``GROUPS_PER_MODEL``
least-loaded groups, the first model whose best replica raises the attainment taking the step (load:
each model's request rate, shared evenly by its replicas, times its batch-1 bottleneck stage);
``dedicated`` gives each device the busiest unplaced model, then the best of the ``WIDTH`` losing the
most. Every placement is simulated by ``partitioner/placement/evaluate.py`` (only the components a step changes).

    choice = auto(profiles, trace, num_devices=4, device_memory_bytes=8 * 2**30, slo_s=0.1)
    choice.placement.describe(), choice.result.attainment
    python -m pytest tests/partitioner/placement/test_search.py -q
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from shardserve.partitioner.placement.evaluate import Evaluator
from shardserve.partitioner.placement.latency import ModelProfile, PlacementError, by_name
from shardserve.partitioner.placement.layout import MIB, Group, Placement, uniform_groups
from shardserve.partitioner.placement.simulator import SimConfig, SimResult
from shardserve.partitioner.placement.workload import Trace, Workload

logger = logging.getLogger(__name__)

PolicyName = Literal["dedicated", "multiplexed", "auto"]
POLICIES: tuple[str, ...] = ("dedicated", "multiplexed", "auto")
EPS = 1e-9  # attainment differences below this are ties
EXACT_CANDIDATES = 16  # a greedy step with more (model, group) candidates is pruned (module doc)
WIDTH = 4  # models tried per pruned step
GROUPS_PER_MODEL = 2  # groups tried per model in a pruned step


@dataclass(frozen=True)
class PlacementChoice:
    """A policy's placement and its simulated result on the trace it was chosen for."""

    policy: str
    placement: Placement
    result: SimResult

    def to_dict(
        self, profiles: Sequence[ModelProfile] | Mapping[str, ModelProfile] | None = None
    ) -> dict[str, Any]:
        prof = by_name(profiles) if profiles is not None else None
        return {"policy": self.policy, **self.placement.to_dict(prof), "prediction": self.result.to_dict()}


@dataclass(frozen=True)
class _Problem:
    """What every policy is given, validated once."""

    profiles: dict[str, ModelProfile]
    trace: Trace
    num_devices: int
    device_memory_bytes: int
    slo_s: float | Mapping[str, float]
    config: SimConfig
    evaluator: Evaluator = field(init=False, repr=False, compare=False)
    counts: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        problems = []
        if self.num_devices < 1:
            problems.append(f"num_devices={self.num_devices} must be >= 1")
        if self.device_memory_bytes < 1:
            problems.append(f"device_memory_bytes={self.device_memory_bytes} must be >= 1")
        unknown = [m for m in self.trace.models if m not in self.profiles]
        if unknown:
            problems.append(
                f"the trace has requests for models {unknown} without a profile (have {sorted(self.profiles)})"
            )
        if not self.profiles:
            problems.append("no model profiles")
        if problems:
            raise PlacementError("invalid placement problem: " + "; ".join(problems))
        ev = Evaluator(self.profiles, self.trace, slo_s=self.slo_s, config=self.config)
        object.__setattr__(self, "evaluator", ev)
        object.__setattr__(self, "counts", self.trace.counts())

    def run(self, placement: Placement) -> SimResult:
        return self.evaluator.run(placement)

    def fits(self, group: Group) -> bool:
        return all(b <= self.device_memory_bytes for b in group.device_bytes(self.profiles).values())


def _problem(
    profiles: Sequence[ModelProfile] | Mapping[str, ModelProfile],
    trace: Trace | Workload,
    num_devices: int,
    device_memory_bytes: int,
    slo_s: float | Mapping[str, float],
    config: SimConfig | None,
) -> _Problem:
    tr = trace.trace() if isinstance(trace, Workload) else trace
    return _Problem(by_name(profiles), tr, num_devices, device_memory_bytes, slo_s, config or SimConfig())


def _key(result: SimResult) -> tuple[float, float]:
    """What the policies maximise: attainment, then a lower p99 latency (spreading models out when
    both meet every SLO)."""
    p99 = result.overall.p99_s
    return (round(result.attainment / EPS) * EPS, -p99 if p99 == p99 else -math.inf)


def _greedy_fill(pb: _Problem, start: Placement) -> tuple[Placement, SimResult]:
    """Add (model, group) pairs one at a time, the best simulated one each step (see module doc).

    Models not placed yet go first, with requests in the trace or not (a server serves every model it
    holds; each step places one of them, where it does best), so a replica of a busy model never takes
    the memory a model without any would need; then replicas, while the attainment rises."""
    current, best = start, pb.run(start)
    while (step := _next(pb, current, best)) is not None:
        current, best = step
        logger.debug("greedy: %s -> attainment %.4f", current.describe(), best.attainment)
    return current, best


def _next(pb: _Problem, current: Placement, best: SimResult) -> tuple[Placement, SimResult] | None:
    """The greedy's next placement and its result; None when no step raises the attainment. Exact:
    the best of every (model, group) pair; at cluster scale the pruned candidates (module doc), model
    by model, the first model whose best candidate raises the attainment."""
    unplaced = [m for m in pb.profiles if not current.replicas(m)]
    distinct = _distinct_groups(current)
    exact = len(distinct) * len(pb.profiles) <= EXACT_CANDIDATES
    if unplaced:  # placed whether or not the attainment rises
        tries = [unplaced] if exact else [[m] for m in sorted(unplaced, key=lambda m: -pb.counts.get(m, 0))]
        for models in tries:
            groups = distinct if exact else _least_loaded(pb, current, models[0], distinct)
            if candidates := _candidates(pb, current, models, groups):
                return _best(pb, candidates)
    if exact:
        tries = [list(pb.profiles)]
    else:
        lost = {m: st.requests - st.good for m, st in best.per_model.items()}
        tries = [[m] for m in sorted((m for m in lost if lost[m] > 0), key=lambda m: -lost[m])[:WIDTH]]
    for models in tries:
        groups = distinct if exact else _least_loaded(pb, current, models[0], distinct)
        if candidates := _candidates(pb, current, models, groups):
            chosen, result = _best(pb, candidates)
            if result.attainment > best.attainment + EPS:
                return chosen, result
    return None


def _best(pb: _Problem, candidates: list[Placement]) -> tuple[Placement, SimResult]:
    """The candidate with the best simulated result (``_key``; ties: the first)."""
    scored = [(pb.run(c), c) for c in candidates]
    result, chosen = max(scored, key=lambda rc: _key(rc[0]))  # max keeps the first of equals
    return chosen, result


def _distinct_groups(current: Placement) -> list[int]:
    """Indexes of the groups that differ (equal groups are interchangeable: the first stands for all)."""
    seen: set[tuple[int, int, frozenset[str]]] = set()
    out = []
    for k, g in enumerate(current.groups):
        state = (g.pp, g.tp, frozenset(g.models))
        if state not in seen:
            seen.add(state)
            out.append(k)
    return out


def _least_loaded(pb: _Problem, current: Placement, model: str, groups: list[int]) -> list[int]:
    """The ``GROUPS_PER_MODEL`` of ``groups`` that can take ``model`` with the least load after taking it:
    each model's requests shared evenly by its replicas, times its batch-1 bottleneck stage."""
    replicas = {m: len(current.replicas(m)) + (m == model) for m in pb.profiles}
    rates = pb.counts

    def load(k: int) -> float:
        g = current.groups[k]
        return sum(
            rates.get(m, 0) / replicas[m] * max(pb.profiles[m].latency.stages(g.pp, g.tp, 1))
            for m in (*g.models, model)
        )

    able = [k for k in groups if _can_take(pb, current.groups[k], model)]
    return sorted(able, key=lambda k: (load(k), k))[:GROUPS_PER_MODEL]


def _candidates(pb: _Problem, current: Placement, models: list[str], groups: list[int]) -> list[Placement]:
    """``current`` with one of ``models`` added to one of ``groups``, where it fits and has latencies."""
    return [
        current.replace(k, current.groups[k].with_model(m))
        for k in groups
        for m in models
        if _can_take(pb, current.groups[k], m)
    ]


def _can_take(pb: _Problem, group: Group, model: str) -> bool:
    """``group`` does not hold ``model``, has its latencies, and has the memory for it."""
    return (
        model not in group.models
        and pb.profiles[model].latency.has(group.pp, group.tp)
        and pb.fits(group.with_model(model))
    )


def dedicated(
    profiles: Sequence[ModelProfile] | Mapping[str, ModelProfile],
    trace: Trace | Workload,
    *,
    num_devices: int,
    device_memory_bytes: int,
    slo_s: float | Mapping[str, float],
    config: SimConfig | None = None,
) -> PlacementChoice:
    """Selective replication: whole models on single devices, given greedily (see module doc)."""
    pb = _problem(profiles, trace, num_devices, device_memory_bytes, slo_s, config)
    too_big = []
    for m in pb.profiles:
        need = Group((0,), 1, 1, (m,)).device_bytes(pb.profiles)[0]
        if need > pb.device_memory_bytes:
            too_big.append(f"{m} needs {need / MIB:.1f} MiB")
    if too_big:
        raise PlacementError(
            f"dedicated placement holds a whole model per device: {'; '.join(too_big)} > "
            f"{pb.device_memory_bytes / MIB:.1f} MiB per device"
        )
    missing = [m for m, p in pb.profiles.items() if not p.latency.has(1, 1)]
    if missing:
        raise PlacementError(f"dedicated placement needs pp=1 tp=1 latencies; models {missing} have none")
    groups: tuple[Group, ...] = ()
    result = pb.run(Placement(groups))
    order = list(pb.profiles)
    pruned = pb.num_devices * len(order) > EXACT_CANDIDATES
    for d in range(pb.num_devices):
        placed = {m for g in groups for m in g.models}
        unplaced = [m for m in order if m not in placed]
        tried = unplaced or order  # every model gets a device before any gets a replica
        if pruned:  # the busiest unplaced model; then the WIDTH losing the most requests
            lost = {m: st.requests - st.good for m, st in result.per_model.items()}
            ranked = sorted(tried, key=lambda m: -(pb.counts.get(m, 0) if unplaced else lost.get(m, 0)))
            tried = ranked[:1] if unplaced else ranked[:WIDTH]
        options = []
        for i, m in enumerate(order):
            if m not in tried:
                continue
            cand = Placement((*groups, Group((d,), 1, 1, (m,))))
            res = pb.run(cand)
            replicas = sum(1 for g in groups if m in g.models)
            options.append(((*_key(res), -replicas, -i), cand, res))
        _, chosen, result = max(options, key=lambda o: o[0])
        groups = chosen.groups
    # more models than devices, or room for more: whole models join devices as _greedy_fill places them
    placement, result = _greedy_fill(pb, Placement(groups))
    return PlacementChoice("dedicated", placement, result)


def multiplexed(
    profiles: Sequence[ModelProfile] | Mapping[str, ModelProfile],
    trace: Trace | Workload,
    *,
    num_devices: int,
    device_memory_bytes: int,
    slo_s: float | Mapping[str, float],
    group_size: int | None = None,
    config: SimConfig | None = None,
) -> PlacementChoice:
    """``pp = group_size`` pipelines (default one of every device) holding every model that fits."""
    pb = _problem(profiles, trace, num_devices, device_memory_bytes, slo_s, config)
    size = pb.num_devices if group_size is None else group_size
    empty = uniform_groups(pb.num_devices, pp=size)
    missing = [m for m, p in pb.profiles.items() if not p.latency.has(size, 1)]
    if missing:
        have = sorted({c for m in missing for c in pb.profiles[m].latency.configs})
        raise PlacementError(
            f"multiplexed placement over {size} devices needs pp={size} latencies; models {missing} have "
            f"only (pp, tp) {have}"
        )
    proto = empty.groups[0]
    too_big = []
    for m in pb.profiles:
        per_device = max(proto.with_model(m).device_bytes(pb.profiles).values())
        if per_device > pb.device_memory_bytes:
            too_big.append(f"{m} needs {per_device / MIB:.1f} MiB per device at pp={size}")
    if too_big:
        raise PlacementError(f"{'; '.join(too_big)} > {pb.device_memory_bytes / MIB:.1f} MiB per device")
    everything = Placement(tuple(Group(g.devices, g.pp, g.tp, tuple(pb.profiles)) for g in empty.groups))
    if all(pb.fits(g) for g in everything.groups):
        return PlacementChoice("multiplexed", everything, pb.run(everything))
    logger.info(
        "multiplexed: the %d models do not all fit a group of %d devices; placing greedily",
        len(pb.profiles),
        size,
    )
    placement, result = _greedy_fill(pb, empty)
    return PlacementChoice("multiplexed", placement, result)


def auto(
    profiles: Sequence[ModelProfile] | Mapping[str, ModelProfile],
    trace: Trace | Workload,
    *,
    num_devices: int,
    device_memory_bytes: int,
    slo_s: float | Mapping[str, float],
    config: SimConfig | None = None,
    max_group_size: int | None = None,
) -> PlacementChoice:
    """AlpaServe's search over group sizes, parallel configs and greedy model placement (module doc)."""
    pb = _problem(profiles, trace, num_devices, device_memory_bytes, slo_s, config)
    have = {c for p in pb.profiles.values() for c in p.latency.configs}
    best: PlacementChoice | None = None
    tried = []
    for size in range(1, pb.num_devices + 1):
        if pb.num_devices % size or (max_group_size is not None and size > max_group_size):
            continue
        for pp, tp in sorted(c for c in have if c[0] * c[1] == size):
            placement, result = _greedy_fill(pb, uniform_groups(pb.num_devices, pp=pp, tp=tp))
            tried.append(f"pp={pp} tp={tp}: {result.attainment:.4f}")
            if not placement.models:
                continue
            # ties in attainment keep the smaller groups (found first), whatever their latency
            if best is None or _key(result)[0] > _key(best.result)[0]:
                best = PlacementChoice("auto", placement, result)
    logger.info("auto placement: %s", ", ".join(tried))
    if best is None:
        raise PlacementError(
            f"no model fits any group of {pb.num_devices} devices with {pb.device_memory_bytes / MIB:.1f} MiB "
            f"each (tried {', '.join(tried) or 'no parallel config'})"
        )
    return best


def replan(
    observed: Trace | Workload,
    profiles: Sequence[ModelProfile] | Mapping[str, ModelProfile],
    *,
    current: Placement | None,
    num_devices: int,
    device_memory_bytes: int,
    slo_s: float | Mapping[str, float],
    config: SimConfig | None = None,
    min_gain: float = 0.01,
) -> PlacementChoice:
    """``auto`` on the observed workload; the current placement (policy ``"current"``) stays unless
    the new one's attainment on it is higher by ``min_gain`` (a move costs a reload)."""
    choice = auto(
        profiles,
        observed,
        num_devices=num_devices,
        device_memory_bytes=device_memory_bytes,
        slo_s=slo_s,
        config=config,
    )
    if current is None:
        return choice
    pb = _problem(profiles, observed, num_devices, device_memory_bytes, slo_s, config)
    current.check_memory(pb.profiles, device_memory_bytes=pb.device_memory_bytes)
    now = pb.run(current)
    if choice.result.attainment >= now.attainment + min_gain:
        logger.info(
            "replan: %.4f -> %.4f attainment: %s",
            now.attainment,
            choice.result.attainment,
            choice.placement.describe(),
        )
        return choice
    return PlacementChoice("current", current, now)


POLICY_FUNCTIONS: dict[str, Callable[..., PlacementChoice]] = {
    "dedicated": dedicated,
    "multiplexed": multiplexed,
    "auto": auto,
}


def choose_placement(
    policy: PolicyName,
    profiles: Sequence[ModelProfile] | Mapping[str, ModelProfile],
    trace: Trace | Workload,
    *,
    num_devices: int,
    device_memory_bytes: int,
    slo_s: float | Mapping[str, float],
    config: SimConfig | None = None,
) -> PlacementChoice:
    """The placement of ``policy`` (one of ``POLICIES``)."""
    if policy not in POLICY_FUNCTIONS:
        raise PlacementError(f"unknown placement policy {policy!r} (choose from {', '.join(POLICIES)})")
    return POLICY_FUNCTIONS[policy](
        profiles,
        trace,
        num_devices=num_devices,
        device_memory_bytes=device_memory_bytes,
        slo_s=slo_s,
        config=config,
    )
