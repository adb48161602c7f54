"""A replica's gang as the fleet sees it: the ``Backend`` interface, the factory of real gangs
(the forward stream, ``partitioner/stream/``; a gang may hold several models), the model generation a
replica serves, where a model's replica gangs come from (``GangSource``: ``OwnGangs``, a gang of its
own from the device pool; ``serving/fleet/groups.py``, a place on a device group shared with other
models), and the warm-up micro-batch a new gang must answer before it is routable.

    factory = gang_factory(threads_per_rank=1, heartbeat_timeout_s=1.5, start_timeout_s=300)
    backend = factory({"tiny-bert": (source, plan)}, "tiny-bert-r0"); backend.start()
    gangs = OwnGangs(DevicePool.for_device("cpu", cpu_slots=4), factory)
    slots = gangs.acquire(2); backend = gangs.make(model, slots, "tiny-bert-r0"); warm_up(backend, model, timeout_s=60)

Tests use a fake backend with the same interface (``partitioner/runtime/fake_gang.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from shardserve.models.qa_windows import WindowConfig, encode_qa, pad_windows
from shardserve.models.registry import ModelSource
from shardserve.partitioner.plan import ParallelDims, PartitionPlan, make_plan
from shardserve.partitioner.runtime.gang import GangError
from shardserve.partitioner.runtime.remote import GangNetwork
from shardserve.serving.fleet.pool import DevicePool

WARMUP_QUESTION = "What does the warm-up check?"
WARMUP_CONTEXT = "The warm-up checks that every stage of a new gang answers before traffic is routed to it."


class Backend(Protocol):
    """What the server needs of a gang (``shardserve.partitioner.stream.driver.StreamGang`` satisfies it); ``submit``'s
    ``model``: which of the gang's models (None: its first)."""

    def start(self) -> Any: ...
    def submit(
        self, input_ids: Any, attention_mask: Any, token_type_ids: Any = None, *, model: str | None = None
    ) -> Future: ...
    def stop(self, *, timeout_s: float = 30.0) -> None: ...
    def kill(self) -> None: ...  # any thread: the ranks die now, a start() waiting for them fails
    def fail(self, err: GangError) -> None: ...  # the fleet decided it failed: its futures fail with err
    def pids(self) -> list[int]: ...

    @property
    def healthy(self) -> bool: ...


GangModels = Mapping[
    str, tuple[ModelSource, PartitionPlan]
]  # a gang's models by name; the first: its default
BackendFactory = Callable[[GangModels, str], Backend]  # (models, gang name) -> a gang, not started


def gang_factory(
    *,
    threads_per_rank: int,
    heartbeat_timeout_s: float,
    start_timeout_s: float,
    dtype: str = "float32",
    compile: bool = False,
    warmup_lengths: tuple[int, ...] = (128,),
    network: GangNetwork | None = None,
) -> BackendFactory:
    """A factory of real gangs (worker processes) with these settings, each holding its stage of every
    model it is given; ``compile``: each rank compiles its stages and runs ``warmup_lengths`` before
    ready; ``network``: where the gang listens and which ranks run elsewhere (default: all here, on
    loopback; ranks elsewhere run the stream as ``serve``)."""
    from shardserve.partitioner.stream.driver import StreamGang
    from shardserve.partitioner.stream.program import STREAM_PROGRAM, stream_spec_multi

    network = dataclasses.replace(network or GangNetwork(), program=STREAM_PROGRAM)

    def make(models: GangModels, name: str) -> Backend:
        spec = stream_spec_multi(
            models,
            threads_per_rank=threads_per_rank,
            dtype=dtype,
            compile=compile,
            warmup_lengths=warmup_lengths,
        )
        return StreamGang(
            spec,
            name=name,
            heartbeat_timeout_s=heartbeat_timeout_s,
            start_timeout_s=start_timeout_s,
            network=network,
        )

    return make


def _probe(backend: Backend, name: str) -> list | None:
    """``backend.<name>()`` when the backend has it and can tell, else None."""
    probe = getattr(backend, name, None)
    if probe is None:
        return None
    try:
        return probe() or None
    except (TypeError, ValueError, OSError):
        return None


def rank_processes(backend: Backend) -> list[tuple[str, int] | None] | None:
    """Per rank: (host, pid) as the rank reports them (None: not heard yet); None when the backend
    cannot tell (``shardserve.partitioner.runtime.gang.Gang.rank_processes``)."""
    return _probe(backend, "rank_processes")


def busy_seconds(backend: Backend) -> list[float] | None:
    """Per rank: seconds spent inside micro-batches so far (None when the backend cannot tell)."""
    return _probe(backend, "busy_seconds")


def layer_steps(backend: Backend) -> list[int] | None:
    """Per rank: layers finished so far (None when the backend cannot tell)."""
    return _probe(backend, "layer_steps")


@dataclass
class ModelGeneration:
    """One loaded model: source, base plan, tokenizer (shared by every gang of the generation)."""

    generation: int
    source: ModelSource
    dims: ParallelDims
    tokenizer: Any

    def plan(self, devices: tuple[str, ...] | None = None) -> PartitionPlan:
        return make_plan(self.source.config, self.dims, devices=devices)


class GangSource(Protocol):
    """Where one model's replica gangs come from (what its ``ReplicaManager`` draws on): device slots
    for a gang, and the gang on them. ``OwnGangs``: a gang of its own per replica, from the device
    pool; ``shardserve.serving.fleet.groups``: a place on each device group the placement put the model on."""

    @property
    def capacity(self) -> int: ...  # device slots in all (messages)
    @property
    def free(self) -> int: ...  # slots a new gang of this model could take now

    def cap(self, world_size: int) -> int: ...  # gangs of ``world_size`` ranks it can hold at most
    def acquire(self, world_size: int) -> list[int] | None: ...  # a new gang's slots; None: no room
    def release(self, slots: list[int]) -> None: ...
    def devices(self, slots: list[int]) -> tuple[str, ...]: ...
    def current(self, slots: list[int]) -> bool: ...  # False: a place of an older placement (roll it)
    def make(self, model: ModelGeneration, slots: list[int], name: str) -> Backend: ...  # not started


class OwnGangs:
    """Each replica a gang of its own, holding only its model, on slots of the device pool (which the
    engines of several models may share: together they never hold more slots than it has)."""

    def __init__(self, pool: DevicePool, factory: BackendFactory) -> None:
        self.pool, self.factory = pool, factory

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    @property
    def free(self) -> int:
        return self.pool.free

    def cap(self, world_size: int) -> int:
        return self.pool.gangs_that_fit(world_size)

    def acquire(self, world_size: int) -> list[int] | None:
        return self.pool.acquire(world_size)

    def release(self, slots: list[int]) -> None:
        self.pool.release(slots)

    def devices(self, slots: list[int]) -> tuple[str, ...]:
        return self.pool.devices(slots)

    def current(self, slots: list[int]) -> bool:
        return True

    def make(self, model: ModelGeneration, slots: list[int], name: str) -> Backend:
        return self.factory({model.source.name: (model.source, model.plan(self.devices(slots)))}, name)


def warm_up(backend: Backend, model: ModelGeneration, *, timeout_s: float) -> None:
    """Send one real micro-batch through every stage; raises if the gang cannot answer."""
    enc = encode_qa(
        model.tokenizer,
        [WARMUP_QUESTION],
        [WARMUP_CONTEXT],
        window=WindowConfig(max_seq_len=64, doc_stride=8, max_question_len=16),
    )
    batch = pad_windows(enc.windows, pad_token_id=enc.pad_token_id)
    types = batch.token_type_ids if model.source.config.uses_token_types else None
    out = backend.submit(batch.input_ids, batch.attention_mask, types).result(timeout=timeout_s)
    if tuple(out.shape[:2]) != tuple(batch.input_ids.shape):
        raise RuntimeError(
            f"warm-up logits have shape {tuple(out.shape)} for inputs {tuple(batch.input_ids.shape)}"
        )
