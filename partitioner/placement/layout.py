"""A multi-model placement: device groups, each a ``pp x tp`` pipeline holding its stage of several models.

Owns ``Group`` and ``Placement`` (validated once: a group's ``pp * tp`` equals its device count,
devices are used once across groups, a model appears once per group) and the per-device memory
check. Device ``i`` of a group (in ``devices`` order) is stage ``i // tp``, tensor rank ``i % tp``;
it holds that stage of every model on the group (``ModelProfile.weight_bytes``) plus one
activation allowance, the largest of its models' (one micro-batch computes on a device at a time).
A model on several groups has replicas. PURE LOGIC.

    p = Placement((Group((0, 1), pp=2, models=("a", "b")),))
    p.check_memory(profiles, device_memory_bytes=2 * 2**30)   # PlacementError with the numbers
    p.to_dict(profiles)
    python -m pytest tests/partitioner/placement/test_simulator.py -q
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardserve.partitioner.placement.latency import ModelProfile, PlacementError

logger = logging.getLogger(__name__)

MIB = 2**20


@dataclass(frozen=True)
class Group:
    """``devices`` running a ``pp``-stage pipeline with ``tp`` ranks per stage, holding ``models``."""

    devices: tuple[int, ...]
    pp: int
    tp: int = 1
    models: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "models", tuple(self.models))
        problems = []
        if self.pp < 1 or self.tp < 1:
            problems.append(f"pp={self.pp} and tp={self.tp} must be >= 1")
        elif self.pp * self.tp != len(self.devices):
            problems.append(
                f"pp={self.pp} x tp={self.tp} = {self.pp * self.tp} != {len(self.devices)} devices"
            )
        if len(set(self.devices)) != len(self.devices) or any(d < 0 for d in self.devices):
            problems.append(f"devices {self.devices} must be distinct and >= 0")
        if len(set(self.models)) != len(self.models):
            problems.append(f"models {self.models} appear more than once")
        if problems:
            raise PlacementError(f"invalid group on devices {self.devices}: " + "; ".join(problems))

    @property
    def size(self) -> int:
        """Devices in the group: ``pp * tp``."""
        return len(self.devices)

    def with_model(self, model: str) -> Group:
        """This group also holding ``model``."""
        return Group(self.devices, self.pp, self.tp, (*self.models, model))

    def device_bytes(self, profiles: Mapping[str, ModelProfile]) -> dict[int, int]:
        """Bytes each device of the group needs: its stage of every model + the largest activation allowance."""
        missing = [m for m in self.models if m not in profiles]
        if missing:
            raise PlacementError(f"no profile for models {missing} (have {sorted(profiles)})")
        act = max((profiles[m].activation_bytes for m in self.models), default=0)
        return {
            d: act + sum(profiles[m].weight_bytes(self.pp, self.tp, i // self.tp) for m in self.models)
            for i, d in enumerate(self.devices)
        }

    def to_dict(self, profiles: Mapping[str, ModelProfile] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "devices": list(self.devices),
            "pp": self.pp,
            "tp": self.tp,
            "models": list(self.models),
        }
        if profiles is not None:
            out["device_bytes"] = {str(d): b for d, b in self.device_bytes(profiles).items()}
        return out


@dataclass(frozen=True)
class Placement:
    """Disjoint device groups; a model may be on several of them (replicas)."""

    groups: tuple[Group, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        seen: dict[int, int] = {}
        for k, g in enumerate(self.groups):
            for d in g.devices:
                if d in seen:
                    raise PlacementError(
                        f"device {d} is in group {seen[d]} and group {k}: groups must be disjoint"
                    )
                seen[d] = k

    @property
    def devices(self) -> tuple[int, ...]:
        """Every device of the placement, sorted."""
        return tuple(sorted(d for g in self.groups for d in g.devices))

    @property
    def models(self) -> tuple[str, ...]:
        """The models placed somewhere, in order of first appearance."""
        return tuple(dict.fromkeys(m for g in self.groups for m in g.models))

    def replicas(self, model: str) -> tuple[int, ...]:
        """Indexes of the groups holding ``model``."""
        return tuple(k for k, g in enumerate(self.groups) if model in g.models)

    def replace(self, index: int, group: Group) -> Placement:
        """This placement with group ``index`` replaced."""
        return Placement((*self.groups[:index], group, *self.groups[index + 1 :]))

    def device_bytes(self, profiles: Mapping[str, ModelProfile]) -> dict[int, int]:
        """Bytes needed on every device (see ``Group.device_bytes``)."""
        out: dict[int, int] = {}
        for g in self.groups:
            out.update(g.device_bytes(profiles))
        return dict(sorted(out.items()))

    def fits(self, profiles: Mapping[str, ModelProfile], *, device_memory_bytes: int) -> bool:
        """Whether every device's bytes are within ``device_memory_bytes``."""
        return all(b <= device_memory_bytes for b in self.device_bytes(profiles).values())

    def check_memory(self, profiles: Mapping[str, ModelProfile], *, device_memory_bytes: int) -> None:
        """``PlacementError`` naming every device over ``device_memory_bytes``, with its models and bytes."""
        over = []
        for g in self.groups:
            for d, b in g.device_bytes(profiles).items():
                if b > device_memory_bytes:
                    over.append(
                        f"device {d} (pp={g.pp} tp={g.tp}, models {','.join(g.models)}) needs "
                        f"{b / MIB:.1f} MiB > {device_memory_bytes / MIB:.1f} MiB"
                    )
        if over:
            raise PlacementError("placement does not fit device memory: " + "; ".join(over))

    def to_dict(self, profiles: Mapping[str, ModelProfile] | None = None) -> dict[str, Any]:
        """JSON-friendly: the groups (with each device's bytes when ``profiles`` are given)."""
        return {"groups": [g.to_dict(profiles) for g in self.groups]}

    def describe(self) -> str:
        """One line: ``[0,1] pp=2 tp=1: a,b | [2] pp=1 tp=1: c``."""
        return " | ".join(
            f"[{','.join(map(str, g.devices))}] pp={g.pp} tp={g.tp}: {','.join(g.models) or '-'}"
            for g in self.groups
        )


def uniform_groups(num_devices: int, *, pp: int, tp: int = 1) -> Placement:
    """``num_devices / (pp * tp)`` empty groups of consecutive devices."""
    size = pp * tp
    if num_devices < 1 or size < 1 or num_devices % size:
        raise PlacementError(
            f"groups of pp={pp} x tp={tp} = {size} devices do not divide {num_devices} devices"
        )
    return Placement(tuple(Group(tuple(range(s, s + size)), pp, tp) for s in range(0, num_devices, size)))
