"""Device groups: a multi-model placement made real, each group ONE gang holding its stage of several models.

The placement (``partitioner/placement/``: AlpaServe's groups, each a ``pp x tp`` pipeline holding
several models) says which models share which devices; this module runs it. Each group of the
current placement has one gang (a ``Backend`` from the factory, given every model placed on the
group: ``partitioner/stream/multiplex.py`` tags each micro-batch with its model). Each model's
``ReplicaManager`` sees the groups holding it as the places of its replicas (``source(name)``, a
``GangSource``), and a replica's backend is a view of its group's gang that submits that model's
micro-batches; the managers, their health checks, restarts and rolls work as for gangs of their own.

A group's gang is shared:

- it starts once, with the first of its models' replicas to start (the others wait for that start);
- it stops when the last replica on it stops (the drains have finished its work);
- it fails as one unit: a lost rank fails every model's replica on it; each model's manager restarts
  its own, and the first restart makes a fresh gang that the others join (a failed gang is never
  handed out again).

``place(placement, models)`` sets a new placement, or new generations of some models (a reload):
groups whose devices, split and models' generations are unchanged keep their gangs; a changed group
gets a new gang once a replica asks for it. Each model's manager then rolls onto the new places
like a reload (``ReplicaManager.reload``: new gangs ready before the old ones drain; ``current``
tells which of its replicas are on places of the old placement), and an old gang stops once none
of its models use it. The slots of the device pool, twice the placement's devices, leave room for
the old and the new gangs of a roll.

    groups = DeviceGroups(factory=gang_factory(...), labels=["cpu"] * 2)
    groups.place(Placement((Group((0, 1), pp=2, models=("a", "b")),)), {"a": gen_a, "b": gen_b})
    manager_a = ReplicaManager(gangs=groups.source("a"), model=gen_a, ...)   # groups.replicas("a") replicas

Tests: ``pytest tests/serving/fleet/test_groups.py``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from shardserve.partitioner.placement.layout import Group, Placement
from shardserve.partitioner.runtime.gang import GangError
from shardserve.serving.fleet.backend import Backend, BackendFactory, ModelGeneration
from shardserve.serving.fleet.pool import DevicePool

logger = logging.getLogger(__name__)

GroupKey = tuple[Any, ...]  # what makes two groups' gangs interchangeable (see ``_key``)


def _key(group: Group, models: Mapping[str, ModelGeneration]) -> GroupKey:
    """Devices, split, and each model by name and generation object (a reload makes a new object)."""
    return (group.devices, group.pp, group.tp, tuple((m, id(models[m])) for m in group.models))


@dataclass(eq=False)
class _GroupGang:
    """One gang of a group: the models it holds, its slots, the models with a replica on it."""

    key: GroupKey
    group: Group
    models: dict[str, ModelGeneration]  # in the group's order (the first: the gang's default model)
    slots: list[int]  # device pool slots (accounting), one per rank
    devices: tuple[str, ...]  # each rank's device
    name: str
    backend: Backend | None = None
    holders: set[str] = field(default_factory=set)  # models with a replica on it (acquired, not released)
    serving: set[str] = field(default_factory=set)  # models whose replica on it started
    closing: bool = False  # its last replica is stopping: never handed out again
    started: threading.Event = field(default_factory=threading.Event)  # the start ended (either way)
    start_error: BaseException | None = None

    @property
    def failed(self) -> bool:
        """Started (or tried to) and no longer able to serve."""
        if not self.started.is_set():
            return False
        return self.start_error is not None or self.backend is None or not self.backend.healthy


class DeviceGroups:
    """The current placement's groups and their gangs (see module doc); thread-safe (views start
    and stop on the manager's threads)."""

    def __init__(self, *, factory: BackendFactory, labels: list[str]) -> None:
        self.factory = factory
        self.labels = list(labels)  # the device of each placement device index
        self.pool = DevicePool(self.labels * 2)  # slots: one placement's gangs + the next one's (a roll)
        self.placement = Placement(())
        self._models: dict[str, ModelGeneration] = {}
        self._target: dict[GroupKey, Group] = {}  # the current placement's groups by key, in order
        self._current: dict[GroupKey, _GroupGang] = {}  # the gang handed out for each key
        self._by_slots: dict[tuple[int, ...], _GroupGang] = {}  # every gang not yet released
        self._lock = threading.Lock()
        self._ids = 0

    # ------------------------------------------------------------------ the placement
    def place(self, placement: Placement, models: Mapping[str, ModelGeneration]) -> None:
        """Serve ``placement`` with these model generations (each model's dims must be its groups'
        pp and tp); replicas on places it no longer has are ``current() == False`` from now on."""
        problems = []
        for g in placement.groups:
            if max(g.devices, default=-1) >= len(self.labels):
                problems.append(f"group on devices {list(g.devices)}: there are {len(self.labels)} devices")
            for m in g.models:
                if m not in models:
                    problems.append(f"model {m!r} is placed but not loaded")
                elif (models[m].dims.pp, models[m].dims.tp) != (g.pp, g.tp):
                    d = models[m].dims
                    problems.append(f"model {m!r} is pp={d.pp} tp={d.tp}, its group pp={g.pp} tp={g.tp}")
        if problems:
            raise ValueError("cannot serve this placement: " + "; ".join(problems))
        with self._lock:
            self.placement = placement
            self._models = dict(models)
            self._target = {_key(g, models): g for g in placement.groups}
        logger.info("placement: %s", placement.describe())

    def replicas(self, name: str) -> int:
        """Groups of the current placement holding model ``name`` (its replica target)."""
        return sum(1 for g in self._target.values() if name in g.models)

    def source(self, name: str) -> ModelPlaces:
        """Model ``name``'s view of the groups: where its replica manager's gangs come from."""
        return ModelPlaces(self, name)

    def describe(self) -> list[dict[str, Any]]:
        """Each group of the current placement: devices, pp, tp, models, and whether its gang runs."""
        out = []
        for key, g in list(self._target.items()):
            gang = self._current.get(key)
            running = gang is not None and gang.backend is not None and gang.backend.healthy
            out.append({**g.to_dict(), "gang": gang.name if gang else None, "running": running})
        return out

    # ------------------------------------------------------------------ leases (ModelPlaces' calls)
    def _acquire(self, name: str) -> list[int] | None:
        with self._lock:
            for key, g in self._target.items():
                if name not in g.models:
                    continue
                gang = self._current.get(key)
                if gang is None or gang.closing or gang.failed:
                    gang = self._new_gang(key, g)
                    if gang is None:
                        return None
                if name in gang.holders:
                    continue
                gang.holders.add(name)
                return list(gang.slots)
        return None

    def _new_gang(self, key: GroupKey, group: Group) -> _GroupGang | None:
        slots = self.pool.acquire(group.size)
        if slots is None:
            logger.warning("device groups: no free slots for a new gang of %s", group.models)
            return None
        self._ids += 1
        gang = _GroupGang(
            key=key,
            group=group,
            models={m: self._models[m] for m in group.models},
            slots=slots,
            devices=tuple(self.labels[d] for d in group.devices),
            name=f"g{self._ids}-{'+'.join(group.models)}",
        )
        self._current[key] = gang
        self._by_slots[tuple(slots)] = gang
        return gang

    def _gang(self, slots: list[int]) -> _GroupGang:
        gang = self._by_slots.get(tuple(slots))
        if gang is None:
            raise KeyError(f"no group gang holds slots {slots}")
        return gang

    def _release(self, name: str, slots: list[int]) -> None:
        with self._lock:
            gang = self._by_slots.get(tuple(slots))
            if gang is None:
                return
            gang.holders.discard(name)
            if gang.holders:
                return
            gang.closing = True
            del self._by_slots[tuple(slots)]
            if self._current.get(gang.key) is gang:
                del self._current[gang.key]
            self.pool.release(gang.slots)
        if gang.backend is not None and gang.backend.healthy:  # (its last view stopped it already)
            gang.backend.stop(timeout_s=0.0)

    def _is_current(self, slots: list[int]) -> bool:
        gang = self._by_slots.get(tuple(slots))
        return gang is not None and gang.key in self._target and self._current.get(gang.key) is gang

    # ------------------------------------------------------------------ the shared gang (views' calls)
    def _start(self, gang: _GroupGang) -> None:
        """Start the gang (the first caller does; the others wait for its outcome); GangError when it
        failed to start, or failed since."""
        with self._lock:
            if gang.closing and gang.backend is None:
                raise GangError(f"{gang.name}: the group's gang was stopped before it started")
            first = gang.backend is None
            if first:
                models = {m: (g.source, g.plan(gang.devices)) for m, g in gang.models.items()}
                gang.backend = self.factory(models, gang.name)
        if first:
            try:
                assert gang.backend is not None
                gang.backend.start()
            except BaseException as err:
                gang.start_error = err
                raise
            finally:
                gang.started.set()
            logger.info("group gang %s ready (%s)", gang.name, ", ".join(gang.models))
            return
        gang.started.wait()
        if gang.start_error is not None:
            raise GangError(f"{gang.name}: the group's gang failed to start: {gang.start_error}")
        if gang.failed or gang.closing:
            raise GangError(f"{gang.name}: the group's gang is no longer running")

    def _served(self, gang: _GroupGang, name: str) -> None:
        with self._lock:
            gang.serving.add(name)

    def _stop(self, gang: _GroupGang, name: str, timeout_s: float) -> None:
        """Model ``name``'s replica stops: the gang stops with the last of them."""
        with self._lock:
            gang.serving.discard(name)
            last = not gang.holders - {name}
            gang.closing = gang.closing or last
        if last and gang.backend is not None:
            gang.backend.stop(timeout_s=timeout_s)

    def _kill(self, gang: _GroupGang, name: str) -> None:
        """Model ``name``'s replica must end now: the ranks die unless another model's replica
        serves from them (that one's manager decides for it; this start ends with the gang's)."""
        with self._lock:
            others = gang.serving - {name}
        if not others and gang.backend is not None:
            gang.backend.kill()


class ModelPlaces:
    """One model's ``GangSource`` over the device groups holding it (``DeviceGroups.source``)."""

    def __init__(self, groups: DeviceGroups, name: str) -> None:
        self.groups, self.name = groups, name

    @property
    def capacity(self) -> int:
        return self.groups.pool.capacity

    @property
    def free(self) -> int:
        """Slots of the current placement's groups holding the model where it has no replica yet."""
        taken = sum(
            1
            for slots, gang in list(self.groups._by_slots.items())
            if self.name in gang.holders and self.groups._is_current(list(slots))
        )
        size = next((g.size for g in self.groups._target.values()), 0)
        return max(0, self.groups.replicas(self.name) - taken) * size

    def cap(self, world_size: int) -> int:
        return self.groups.replicas(self.name)

    def acquire(self, world_size: int) -> list[int] | None:
        return self.groups._acquire(self.name)

    def release(self, slots: list[int]) -> None:
        self.groups._release(self.name, slots)

    def devices(self, slots: list[int]) -> tuple[str, ...]:
        return self.groups._gang(slots).devices

    def current(self, slots: list[int]) -> bool:
        """Whether a replica on ``slots`` is on a place of the current placement."""
        return self.groups._is_current(slots)

    def make(self, model: ModelGeneration, slots: list[int], name: str) -> Backend:
        gang = self.groups._gang(slots)
        if gang.models.get(self.name) is not model:
            raise GangError(
                f"group gang {gang.name} holds another generation of model {self.name!r} (a roll in progress?)"
            )
        return GroupView(self.groups, gang, self.name)


class GroupView:
    """A ``Backend`` for one model on its group's shared gang: submits that model's micro-batches;
    start / stop / kill / fail act on the shared gang as the module doc says."""

    def __init__(self, groups: DeviceGroups, gang: _GroupGang, model: str) -> None:
        self._groups, self._gang, self.model = groups, gang, model

    @property
    def name(self) -> str:
        return self._gang.name

    def start(self) -> GroupView:
        self._groups._start(self._gang)
        self._groups._served(self._gang, self.model)
        return self

    def submit(
        self, input_ids: Any, attention_mask: Any, token_type_ids: Any = None, *, model: str | None = None
    ) -> Future:
        backend = self._gang.backend
        if backend is None:
            raise GangError(f"{self.name}: not started")
        return backend.submit(input_ids, attention_mask, token_type_ids, model=model or self.model)

    def stop(self, *, timeout_s: float = 30.0) -> None:
        self._groups._stop(self._gang, self.model, timeout_s)

    def kill(self) -> None:
        self._groups._kill(self._gang, self.model)

    def fail(self, err: GangError) -> None:
        if self._gang.backend is not None:
            self._gang.backend.fail(err)

    def pids(self) -> list[int]:
        return self._gang.backend.pids() if self._gang.backend is not None else []

    @property
    def healthy(self) -> bool:
        backend = self._gang.backend
        return backend is not None and backend.healthy and not self._gang.closing

    @property
    def error(self) -> Any:
        return getattr(self._gang.backend, "error", None)

    def rank_processes(self) -> Any:
        return getattr(self._gang.backend, "rank_processes", list)()

    def busy_seconds(self) -> Any:
        return getattr(self._gang.backend, "busy_seconds", list)()

    def layer_steps(self) -> Any:
        return getattr(self._gang.backend, "layer_steps", list)()

    def stuck_ranks(self, after_s: float) -> Any:
        stuck = getattr(self._gang.backend, "stuck_ranks", None)
        return stuck(after_s) if stuck is not None else ([], "")
