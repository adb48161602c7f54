"""One rank of a gang: join the process group, build and load this rank's stage, stream micro-batches.

Started by ``partitioner/gang.py`` (one spawned process per rank), with torchrun-style
environment variables (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``).
Each rank then runs ``spec.program`` (by default the forward-only streaming schedule in
``partitioner/schedules.py``, which runs until a stop message flows through the pipeline). Every failure is reported to the driver with the rank and traceback
before the process exits; a rank whose driver disappears exits on its own.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from models.registry import ModelSource
from partitioner.plan import PartitionPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FaultSpec:
    """Deliberate failure for tests: ``mode`` in {"raise", "hang", "exit"} on ``rank`` when it
    reaches micro-batch number ``at_batch`` (-1: while loading)."""

    rank: int
    mode: str
    at_batch: int = 0


@dataclass(frozen=True)
class GangSpec:
    """What every rank of a gang needs (picklable)."""

    source: ModelSource
    plan: PartitionPlan
    threads_per_rank: int = 1
    dtype: str = "float32"
    backend: str = "auto"  # "gloo", "nccl" or "auto"
    collective_timeout_s: float = 120.0
    head_seed: int = 0
    fault: FaultSpec | None = None
    # "module:function" every rank runs after joining the group: fn(ctx, queues, *, ready) -> None.
    # Serving streams forward passes; training plugs in its own schedule with ``extra`` settings.
    program: str = "partitioner.schedules:forward_stream"
    extra: dict[str, Any] = field(default_factory=dict)

    def resolved_backend(self) -> str:
        """NCCL when every rank has its own CUDA device, gloo otherwise (CPU, or ranks sharing a GPU)."""
        if self.backend != "auto":
            return self.backend
        devs = self.plan.devices
        if all(d.startswith("cuda") for d in devs) and len(set(devs)) == len(devs):
            return "nccl"
        return "gloo"


@dataclass
class RankContext:
    """A rank's place in the gang, handed to the schedule."""

    rank: int
    stage: int
    tp_rank: int
    spec: GangSpec
    device: torch.device
    backend: str
    tp_group: dist.ProcessGroup | None
    progress: Any  # shared per-rank count of finished micro-batches
    busy_since: Any  # shared per-rank wall time the current micro-batch started (0: idle/waiting)
    dp_rank: int = 0  # which data-parallel replica (training with dp > 1)
    dp_group: dist.ProcessGroup | None = None  # ranks holding the same shard (None: dp == 1)
    mp_group: dist.ProcessGroup | None = None  # this replica's pp * tp ranks (None: the world)

    @property
    def plan(self) -> PartitionPlan:
        return self.spec.plan

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.plan.dims.pp - 1

    def prev_rank(self) -> int:
        return self.plan.dims.rank_of(self.stage - 1, self.tp_rank, self.dp_rank)

    def next_rank(self) -> int:
        return self.plan.dims.rank_of(self.stage + 1, self.tp_rank, self.dp_rank)

    def maybe_fault(self, batch_number: int) -> None:
        fault = self.spec.fault
        if fault is None or fault.rank != self.rank or fault.at_batch != batch_number:
            return
        if fault.mode == "raise":
            raise RuntimeError(f"injected fault on rank {self.rank} at micro-batch {batch_number}")
        if fault.mode == "exit":
            os._exit(3)
        if fault.mode == "hang":
            while True:
                time.sleep(3600)


def _watch_parent(parent_pid: int) -> None:
    """Exit when the driver process is gone (so no orphan ranks hold ports or memory)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(4)
        time.sleep(0.5)


def init_distributed(spec: GangSpec, rank: int, world_size: int) -> str:
    """Join the gang's process group from torchrun-style environment variables."""
    backend = spec.resolved_backend()
    timeout = timedelta(seconds=spec.collective_timeout_s)
    if os.environ.get("SHARDSERVE_DRIVER_STORE") == "1":
        # The local driver hosts the rendezvous store (no free-port race, nothing left on stop).
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world_size,
            is_master=False,
            timeout=timeout,
        )
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    else:  # launched by torchrun (possibly across hosts): rank 0 hosts the store
        spec.plan.dims.validate_world(int(os.environ.get("WORLD_SIZE", world_size)))
        dist.init_process_group(
            backend, init_method="env://", rank=rank, world_size=world_size, timeout=timeout
        )
    return backend


def tp_group_for(plan: PartitionPlan, stage: int, dp_rank: int = 0) -> dist.ProcessGroup | None:
    """Create every stage's tensor-parallel group in every replica (all ranks must take part) and
    return ours."""
    dims = plan.dims
    if dims.tp == 1:
        return None
    mine = None
    for d in range(dims.dp):
        for spec in plan.stages:
            group = dist.new_group([dims.rank_of(spec.index, t, d) for t in range(dims.tp)])
            if spec.index == stage and d == dp_rank:
                mine = group
    return mine


def dp_groups_for(
    plan: PartitionPlan, rank: int
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(data-parallel group of this rank's shard, model-parallel group of its replica); both None
    when dp == 1 (the world is the one replica). Every rank creates every group, in one order."""
    dims = plan.dims
    if dims.dp == 1:
        return None, None
    dp_mine = mp_mine = None
    for ranks in dims.dp_groups():
        group = dist.new_group(ranks)
        if rank in ranks:
            dp_mine = group
    for ranks in dims.model_parallel_groups():
        group = dist.new_group(ranks)
        if rank in ranks:
            mp_mine = group
    return dp_mine, mp_mine


def worker_main(
    rank: int, spec: GangSpec, env: dict[str, str], queues: dict[str, Any], progress: Any, busy_since: Any
) -> None:
    """Process entry point of one rank."""
    os.environ.update(env)
    # Ctrl-C in a terminal (or `timeout`, or `kill -- -PGID`) signals the whole process group: let
    # the driver drain and stop the gang rather than every rank dying mid-micro-batch. Ranks still
    # exit on a stop message, on SIGKILL from the driver, or on their own when the driver is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=os.environ.get("SHARDSERVE_LOG_LEVEL", "WARNING"),
        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s",
    )
    threading.Thread(target=_watch_parent, args=(int(env["SHARDSERVE_PARENT_PID"]),), daemon=True).start()
    ctrl = queues["ctrl"]
    code = 0
    try:
        torch.set_num_threads(spec.threads_per_rank)
        plan = spec.plan
        stage, tp_rank = plan.dims.coords(rank)
        device = torch.device(plan.devices[rank])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        t0 = time.perf_counter()
        backend = init_distributed(spec, rank, plan.dims.world_size)
        dp_rank = plan.dims.dp_rank(rank)
        tp_group = tp_group_for(plan, stage, dp_rank)
        dp_group, mp_group = dp_groups_for(plan, rank)
        ctx = RankContext(
            rank,
            stage,
            tp_rank,
            spec,
            device,
            backend,
            tp_group,
            progress,
            busy_since,
            dp_rank=dp_rank,
            dp_group=dp_group,
            mp_group=mp_group,
        )
        ctx.maybe_fault(-1)
        module_name, _, func_name = spec.program.partition(":")
        program = getattr(importlib.import_module(module_name), func_name)
        program(
            ctx,
            queues,
            ready=lambda info: ctrl.put(("ready", rank, {**info, "setup_s": time.perf_counter() - t0})),
        )
        ctrl.put(("stopped", rank, None))
    except BaseException:
        ctrl.put(("error", rank, traceback.format_exc()))
        code = 1
    finally:
        for q in queues.values():
            if hasattr(q, "close"):
                q.close()
                q.join_thread()
        if code == 0 and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        os._exit(code)
