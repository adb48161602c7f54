"""One rank of a gang: join the process group, then run the gang's program.

Started by ``partitioner/runtime/gang.py`` (one process per rank, forked from the driver's fork
server) or by ``shardserve worker`` on another host (``remote.py``), with torchrun-style
environment variables (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``). It talks to the driver through ``ctx.link`` (``channel.py``: ZeroMQ over TCP,
named by ``SHARDSERVE_DRIVER`` and keyed by ``SHARDSERVE_GANG_KEY``). The program is
``spec.program(ctx, ready=...)``, a module-level function that multiprocessing pickles by its
qualified name: the forward stream (``partitioner/stream/program.py``) or training's
``train_rank``; the runtime knows neither.

Every rank reports ``RankReady`` / ``RankStopped``, or ``RankFailed`` with its traceback before
the process exits, and beats every ``HEARTBEAT_S`` with its progress; a rank whose driver
disappears (no heartbeat for ``DRIVER_TIMEOUT_S``, or, when started locally, the driver's process
gone) exits on its own, after the hooks given to ``before_hard_exit``. A rank raises its own
``oom_score_adj`` (``prefer_for_oom_kill``): when memory runs out, the kernel kills a rank, whose
replica restarts, before the driver or its fork server.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn, Protocol

import torch
import torch.distributed as dist

from shardserve.models.registry import ModelSource
from shardserve.partitioner.p2p import P2PCommunicator
from shardserve.partitioner.plan import PartitionPlan
from shardserve.partitioner.runtime.channel import ENV_ENDPOINTS, RankChannel
from shardserve.partitioner.runtime.messages import RankFailed, RankReady, RankStopped
from shardserve.partitioner.runtime.rank_process import has_exited, pidfd_of
from shardserve.partitioner.schedules import InputsFn, LogitsFn, LossFn, StageExecutor

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FaultSpec:
    """Deliberate failure for tests: ``mode`` in {"raise", "hang", "exit"} on ``rank`` when it
    reaches micro-batch number ``at_batch`` (-1: while loading)."""

    rank: int
    mode: str
    at_batch: int = 0


class Program(Protocol):
    """What every rank of a gang runs after joining the group; calls ``ready(info)`` once its
    stage is built. Must be a module-level function (spawned ranks import it by name)."""

    def __call__(self, ctx: RankContext, *, ready: Callable[[dict[str, Any]], None]) -> None: ...


@dataclass
class RankContext:
    """A rank's place in the gang, handed to the program."""

    rank: int
    stage: int
    tp_rank: int
    spec: GangSpec
    device: torch.device
    backend: str
    tp_group: dist.ProcessGroup | None
    link: RankChannel  # to the driver: get() its Batch / Stop, send() results and reports
    dp_rank: int = 0  # which data-parallel replica (training with dp > 1)
    dp_group: dist.ProcessGroup | None = None  # ranks holding the same shard (None: dp == 1)
    mp_group: dist.ProcessGroup | None = None  # this replica's pp * tp ranks (None: the world)
    # the ranks of this replica holding this tp shard of a layer every stage shares (ALBERT; pp > 1)
    shared_group: dist.ProcessGroup | None = None

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

    def stage_executor(
        self,
        module: torch.nn.Module,
        comm: P2PCommunicator | None,
        *,
        get_inputs: InputsFn | None = None,
        compute_loss: LossFn | None = None,
        on_logits: LogitsFn | None = None,
        **flags: Any,
    ) -> StageExecutor:
        """This rank's ``StageExecutor``: its neighbours filled in, stage 0's ``get_inputs`` and the
        last stage's ``compute_loss`` / ``on_logits`` kept where they apply; ``flags``: the rest."""
        return StageExecutor(
            module=module,
            comm=comm,
            is_first=self.is_first,
            is_last=self.is_last,
            prev_rank=None if self.is_first else self.prev_rank(),
            next_rank=None if self.is_last else self.next_rank(),
            get_inputs=get_inputs if self.is_first else None,
            compute_loss=compute_loss if self.is_last else None,
            on_logits=on_logits if self.is_last else None,
            **flags,
        )

    def count_layers(self, stage: torch.nn.Module) -> None:
        """Count every layer of ``stage`` that finishes in this rank's heartbeats (``steps``): the
        driver sees progress inside a micro-batch, so a slow one is not taken for a hang (a micro-
        batch of a large model on one CPU thread may take longer than the stall timeout). Eager
        stages only (a hook's side effect does not belong in a compiled graph)."""
        unique = {id(layer): layer for layer in stage.layers.values()}  # ALBERT: one layer, many keys
        for layer in unique.values():
            layer.register_forward_hook(self._layer_done)

    def _layer_done(self, *_: Any) -> None:
        self.link.steps += 1

    @contextlib.contextmanager
    def micro_batch(self, n: int) -> Iterator[None]:
        """Around the computation of this rank's ``n``-th micro-batch (0-based): busy while inside
        (the driver's stall diagnosis), the injected fault if any, progress counted after."""
        t0 = time.perf_counter()
        self.link.busy_since = time.time()
        self.maybe_fault(n)
        yield
        self.link.busy_s += time.perf_counter() - t0
        self.link.progress = n + 1
        self.link.busy_since = 0.0


@dataclass(frozen=True)
class GangSpec:
    """What every rank of a gang needs (picklable)."""

    source: ModelSource
    plan: PartitionPlan
    program: Program  # what every rank runs after joining the group (module-level: ranks import it by name)
    threads_per_rank: int = 1
    dtype: str = "float32"
    backend: str = "auto"  # "gloo", "nccl" or "auto"
    collective_timeout_s: float = 120.0
    head_seed: int = 0
    fault: FaultSpec | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # the program's own settings

    def __post_init__(self) -> None:
        name = getattr(self.program, "__qualname__", "<not a function>")
        if not callable(self.program) or "<" in name:
            raise TypeError(
                f"GangSpec.program must be a module-level function (ranks import it by name), got {name}"
            )

    def resolved_backend(self) -> str:
        """NCCL when every rank has its own CUDA device, gloo otherwise (CPU, or ranks sharing a GPU)."""
        if self.backend != "auto":
            return self.backend
        devs = self.plan.devices
        if all(d.startswith("cuda") for d in devs) and len(set(devs)) == len(devs):
            return "nccl"
        return "gloo"


_HARD_EXIT_HOOKS: list[Callable[[], None]] = []


def before_hard_exit(hook: Callable[[], None]) -> None:
    """Run ``hook`` if this rank ends in ``hard_exit`` (its driver or parent gone), where neither
    ``finally`` blocks nor ``atexit`` run: e.g. removing a scratch directory."""
    _HARD_EXIT_HOOKS.append(hook)


def hard_exit(code: int) -> NoReturn:
    """End the rank at once from any thread (``os._exit``), after the ``before_hard_exit`` hooks."""
    for hook in _HARD_EXIT_HOOKS:
        try:
            hook()
        except Exception:
            logger.exception("a hook before the rank's exit failed")
    os._exit(code)


# A rank is the process to lose when memory runs out: its replica restarts (``serving/fleet``), where
# the driver is the whole server and its fork server starts every next rank. Raising
# one's own oom_score_adj needs no privilege; the value is relative, so a container's own setting
# (Kubernetes' QoS class) keeps its standing against other containers.
OOM_SCORE_RAISE = 500


def prefer_for_oom_kill(proc: str = "/proc/self/oom_score_adj") -> int | None:
    """Raise this process's ``oom_score_adj`` by ``OOM_SCORE_RAISE`` (at most 1000): the kernel's
    OOM killer then picks a rank before its driver. The new value, or None where there is no such
    file (not Linux) or it cannot be written."""
    try:
        now = int(Path(proc).read_text())
        raised = min(1000, now + OOM_SCORE_RAISE)
        Path(proc).write_text(str(raised))
    except (OSError, ValueError) as err:
        logger.debug("oom_score_adj left as it is: %s", err)
        return None
    return raised


def _watch_driver(driver_pid: int, parent_pid: int) -> None:
    """Exit when the driver is gone (so no orphan ranks hold ports or memory), at once: the rank
    watches a pidfd on the driver, taken while its parent, the fork server (``gang.rank_context``),
    runs (so the driver did: no pid reuse); a fork server that dies alone leaves the rank running.
    Without pidfds it watches its parent, which outlives the driver until the ranks are gone (they
    hold multiprocessing's "alive" pipe of the fork server): then the heartbeat timeout ends it."""
    pidfd = pidfd_of(driver_pid)
    if pidfd is not None and os.getppid() == parent_pid:
        has_exited(pidfd, None)
        hard_exit(4)
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    hard_exit(4)


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


def shared_layer_group_for(plan: PartitionPlan, rank: int) -> dist.ProcessGroup | None:
    """Create, for every replica and tp rank, the group of the pp stages' copies of a shared layer
    (all ranks take part, in one order) and return ours; None when pp == 1."""
    dims = plan.dims
    if dims.pp == 1:
        return None
    mine = None
    for d in range(dims.dp):
        for t in range(dims.tp):
            ranks = [dims.rank_of(s, t, d) for s in range(dims.pp)]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
    return mine


def worker_main(rank: int, spec: GangSpec, env: dict[str, str]) -> None:
    """Process entry point of one rank (``env``: the rendezvous and the driver's channel)."""
    # The garbage collector skips the heap the fork server handed over (torch, this runtime: ~170k
    # objects) and, once the rank is ready, what its start-up built. Full collections of a starting
    # rank's 350-470k objects took 100-440 ms on 2 quiet cores with the GIL held, the heartbeat
    # thread silent meanwhile; after the first freeze at most 100 ms (docs/benchmarks.md).
    gc.freeze()
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
    prefer_for_oom_kill()
    if "SHARDSERVE_DRIVER_PID" in env:  # started by a local driver: leave with it at once
        driver = int(env["SHARDSERVE_DRIVER_PID"])
        threading.Thread(target=_watch_driver, args=(driver, os.getppid()), daemon=True).start()
    link = RankChannel.from_env(rank, on_driver_lost=lambda: hard_exit(4))  # heartbeats start now
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
        shared_group = shared_layer_group_for(plan, rank) if spec.source.config.has_stage_copies else None
        ctx = RankContext(
            rank,
            stage,
            tp_rank,
            spec,
            device,
            backend,
            tp_group,
            link,
            dp_rank=dp_rank,
            dp_group=dp_group,
            mp_group=mp_group,
            shared_group=shared_group,
        )
        ctx.maybe_fault(-1)
        if not link.wait_connected(spec.collective_timeout_s):
            raise RuntimeError(f"rank {rank}: the driver at {env.get(ENV_ENDPOINTS)} never reached this rank")

        def ready(info: dict[str, Any]) -> None:
            info = {**info, "setup_s": time.perf_counter() - t0, "host": socket.gethostname()}
            gc.freeze()  # the stage, its modules and imports (see above)
            link.send(RankReady(rank, info))

        spec.program(ctx, ready=ready)
        link.send(RankStopped(rank))
    except BaseException:
        link.send(RankFailed(rank, traceback.format_exc()))
        code = 1
    finally:
        link.close()  # delivers the last report
        if code == 0 and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        os._exit(code)
