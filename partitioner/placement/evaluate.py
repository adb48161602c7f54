"""Simulated results of many placements on one trace, for the search: component by component, cached.

Owns ``Evaluator``. Without a shared front (``SimConfig.overhead_s == 0``) groups that share no
model never interact, so a placement's result is the union of its components' (groups linked by a
model they both hold, with those models), each simulated on its own models' requests; requests for
models held nowhere are refused. A component is cached by its groups' ``(pp, tp, models)`` in
placement order, so a greedy step that adds a model to one group re-simulates only the component it
touches, and the result equals ``simulate`` of the whole placement (same events, same order within
a component). With a front (``overhead_s > 0``: one process tokenizes for every model) a placement
is simulated whole, cached by its groups. PURE LOGIC.

    ev = Evaluator(profiles, trace, slo_s=0.1, config=SimConfig())
    ev.run(placement).attainment      # == simulate(placement, profiles, trace, slo_s=0.1).attainment
    python -m pytest tests/partitioner/placement/test_evaluate.py -q
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from shardserve.partitioner.placement.latency import ModelProfile
from shardserve.partitioner.placement.layout import Group, Placement
from shardserve.partitioner.placement.simulator import (
    COUNT_KEYS,
    ModelStats,
    SimConfig,
    SimResult,
    model_stats,
    simulate,
    simulate_parts,
)
from shardserve.partitioner.placement.workload import Trace

logger = logging.getLogger(__name__)

GroupKey = tuple[int, int, tuple[str, ...]]


@dataclass(frozen=True)
class _Part:
    """One component's outcome: per-model stats, summed counts, and every finished request's latency."""

    per_model: dict[str, ModelStats]
    counts: dict[str, int]
    latencies: np.ndarray


class Evaluator:
    """``simulate`` of many placements of ``profiles`` on one ``trace`` (see module doc)."""

    def __init__(
        self,
        profiles: Mapping[str, ModelProfile],
        trace: Trace,
        *,
        slo_s: float | Mapping[str, float],
        config: SimConfig,
    ) -> None:
        self.profiles, self.trace, self.slo_s, self.config = profiles, trace, slo_s, config
        self.decomposed = config.overhead_s == 0
        self.order = tuple(dict.fromkeys((*(m for m in profiles if m in trace.models), *trace.models)))
        self._index: dict[str, list[int]] = {m: [] for m in self.order}
        for i, (_, m) in enumerate(trace.requests):
            self._index[m].append(i)
        self._parts: dict[tuple[GroupKey, ...], _Part] = {}
        self._whole: dict[tuple[GroupKey, ...], SimResult] = {}
        self.simulations = 0  # components (or whole placements) simulated, for the search's log

    def run(self, placement: Placement) -> SimResult:
        """The simulated result of ``placement`` on the trace (equal to ``simulate``'s)."""
        if not self.decomposed:
            key = tuple(_key(g) for g in placement.groups)
            if key not in self._whole:
                self.simulations += 1
                self._whole[key] = simulate(
                    placement, self.profiles, self.trace, slo_s=self.slo_s, config=self.config
                )
            return self._whole[key]
        parts = [self._part(groups) for groups in _components(placement)]
        held = {m for g in placement.groups for m in g.models}
        orphans = tuple(m for m in self.order if m not in held)
        if orphans:
            parts.append(self._part((), orphans))
        return self._assemble(parts)

    def _part(self, groups: tuple[Group, ...], orphans: tuple[str, ...] = ()) -> _Part:
        key = (*(_key(g) for g in groups), (0, 0, orphans))
        hit = self._parts.get(key)
        if hit is not None:
            return hit
        models = orphans or tuple(dict.fromkeys(m for g in groups for m in g.models))
        picked = sorted(i for m in models for i in self._index.get(m, ()))
        requests = self.trace.requests
        sub = Trace(tuple(requests[i] for i in picked), self.trace.duration_s)
        slo = self.slo_s if not isinstance(self.slo_s, Mapping) else {m: self.slo_s[m] for m in sub.models}
        self.simulations += 1
        names, counts, latencies = simulate_parts(
            Placement(groups), self.profiles, sub, slo_s=slo, config=self.config
        )
        part = _Part(
            {m: model_stats(m, counts[m], latencies[m]) for m in names if counts[m]["requests"]},
            {k: sum(counts[m][k] for m in names) for k in COUNT_KEYS},
            np.fromiter((x for m in names for x in latencies[m]), dtype=float),
        )
        self._parts[key] = part
        return part

    def _assemble(self, parts: list[_Part]) -> SimResult:
        per_model: dict[str, ModelStats] = {}
        for p in parts:
            per_model.update(p.per_model)
        per_model = {m: per_model[m] for m in self.order if m in per_model}
        total = {k: sum(p.counts[k] for p in parts) for k in COUNT_KEYS}
        latencies = np.concatenate([p.latencies for p in parts]) if parts else np.empty(0)
        return SimResult(per_model, model_stats("*", total, latencies), self.trace.duration_s)


def _key(g: Group) -> GroupKey:
    return (g.pp, g.tp, g.models)


def _components(placement: Placement) -> list[tuple[Group, ...]]:
    """The placement's groups that hold models, split into sets linked by a shared model (each in
    placement order)."""
    groups = [g for g in placement.groups if g.models]
    parent = list(range(len(groups)))

    def root(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    first: dict[str, int] = {}
    for k, g in enumerate(groups):
        for m in g.models:
            if m in first:
                parent[root(k)] = root(first[m])
            else:
                first[m] = k
    out: dict[int, list[Group]] = {}
    for k, g in enumerate(groups):
        out.setdefault(root(k), []).append(g)
    return [tuple(v) for v in out.values()]
