"""One replica gang as the status page shows it: its state, and where its ranks run as they report it.

Built from the replica manager's ``Replica`` by ``Engine.replica_details`` (``serving/engine/core.py``),
read by ``serving/frontend/status/board.py``; plain data, so the front end never holds a fleet object.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardserve.serving.fleet.backend import busy_seconds, rank_processes
from shardserve.serving.fleet.replicas import Replica, ReplicaState


@dataclass(frozen=True)
class ReplicaDetail:
    """One replica gang for the status page: where its ranks run, as the ranks report it."""

    replica_id: str
    state: str
    generation: int
    world_size: int
    pp: int
    coords: list[tuple[int, int]]  # (stage, tp_rank) of each rank
    restarts: int
    replaces: str | None
    inflight_batches: int
    created_at: float  # time.monotonic() of its start
    error: str | None  # whole (callers cut it to one line)
    devices: tuple[str, ...]  # the pool's device of each rank
    processes: list[tuple[str, int] | None]  # (host, pid) of each rank heard from
    reports_busy: bool  # the gang reports its ranks' busy time

    @classmethod
    def of(cls, r: Replica, devices: tuple[str, ...]) -> ReplicaDetail:
        dims = r.model.dims
        live = r.backend is not None and r.state is not ReplicaState.STOPPED
        return cls(
            replica_id=r.replica_id,
            state=r.state.value,
            generation=r.model.generation,
            world_size=dims.world_size,
            pp=dims.pp,
            coords=[dims.coords(rank) for rank in range(dims.world_size)],
            restarts=r.restarts,
            replaces=r.replaces,
            inflight_batches=r.inflight_batches,
            created_at=r.created_at,
            error=r.error,
            devices=devices,
            processes=(rank_processes(r.backend) if live and r.backend is not None else None) or [],
            reports_busy=r.backend is not None and busy_seconds(r.backend) is not None,
        )
