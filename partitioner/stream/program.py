"""The forward stream: the rank program that streams micro-batches through a partition's stages.

It is what a serving replica runs, and what ``verify``, ``eval`` and the benchmarks run to get
span logits from a partitioned model. Stage 0 takes ``Batch`` messages from the driver (``Stop``
ends the stream and flows down the pipeline behind the last micro-batch); activations go rank to
rank over torch.distributed (``partitioner/schedules.py``'s ``run_stream``); the last stage's tp
rank 0 answers each with a ``Result``. The driver side is ``partitioner/stream/driver.py``.

A gang may hold several models (multiplexing, ``partitioner/stream/multiplex.py``): every rank
builds its stage of each, a ``Batch`` names its model (default: the gang's first), the name travels
down the pipeline as a tag on the micro-batch id, and each stage runs that model's module.

    spec = stream_spec(source, plan, dtype="bfloat16", compile=True, warmup_lengths=(128, 384))
    StreamGang(spec).start().submit(ids, mask).result()     # (B, S, 2) float32 logits
    spec = stream_spec_multi({"bert": (bert, plan_b), "roberta": (roberta, plan_r)})
    StreamGang(spec).start().submit(ids, mask, model="roberta").result()

Ranks on other hosts run it under the name ``serve`` (``STREAM_PROGRAM``; its settings, the models
included, cross as JSON).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shardserve.models.build import QAModel
from shardserve.models.registry import ModelSource
from shardserve.partitioner.compiled import compile_stage, warm_up
from shardserve.partitioner.host_copy import to_host
from shardserve.partitioner.p2p import P2PCommunicator
from shardserve.partitioner.plan import PartitionPlan
from shardserve.partitioner.precision import compute_dtype
from shardserve.partitioner.runtime.rank import GangSpec, RankContext
from shardserve.partitioner.runtime.remote import RemoteProgram
from shardserve.partitioner.runtime.wire import register_messages
from shardserve.partitioner.schedules import IDLE, Idle, MicroBatch, run_stream
from shardserve.partitioner.stages import build_stage
from shardserve.partitioner.stream.multiplex import (
    MultiplexedExecutor,
    check_models,
    gang_models,
    models_extra,
    models_from_json,
    models_to_json,
    tag,
    untag,
)


@dataclass(frozen=True)
class Batch:
    """One micro-batch for the pipeline (driver -> stage-0 ranks); ``mb_id`` comes back on its ``Result``."""

    mb_id: int
    input_ids: np.ndarray  # (B, S) int64
    attention_mask: np.ndarray  # (B, S)
    token_type_ids: np.ndarray | None = None  # (B, S)
    model: str | None = None  # which of the gang's models (None: its first)


@dataclass(frozen=True)
class Stop:
    """The stream is over: stage 0 passes it down the pipeline behind the last micro-batch."""


@dataclass(frozen=True)
class Result:
    """Span logits of micro-batch ``mb_id`` (last stage, tp rank 0 -> driver)."""

    mb_id: int
    logits: np.ndarray  # (B, S, 2) float32
    model: str | None = None  # the model that answered


register_messages(Batch, Stop, Result)

DEFAULT_WARMUP = (128,)  # lengths a compiled stage runs at batch 1 and 2 before it is ready
# An idle stage 0 sends a keep-alive down the pipeline this often, in parts of the process group's
# timeout: the later stages wait for their next micro-batch in a receive that the timeout would end
# (a server idle that long would lose its pipelined replicas).
KEEPALIVE_PER_TIMEOUT = 4


def stream_rank(ctx: RankContext, *, ready: Callable[[dict[str, Any]], None]) -> None:
    """Build this rank's stage of every model of the gang (each compiled and warmed up when
    ``extra["compile"]``), then stream."""
    t0 = time.perf_counter()
    dtype = compute_dtype(ctx.spec.dtype)
    table = gang_models(ctx.spec)
    index_of = {m.name: i for i, m in enumerate(table)}
    stages = [
        build_stage(
            m.source,
            m.plan,
            rank=ctx.rank,
            tp_group=ctx.tp_group,
            dtype=dtype,
            head_seed=ctx.spec.head_seed,
            int8=ctx.spec.dtype == "int8",
        )
        for m in table
    ]
    info: dict[str, Any] = {"load_s": time.perf_counter() - t0}
    if ctx.spec.extra.get("compile", False):
        lengths = ctx.spec.extra.get("warmup_lengths", DEFAULT_WARMUP)
        info["compile_s"] = 0.0
        for stage in stages:
            compile_stage(stage)
            info["compile_s"] += warm_up(stage, lengths=lengths, dtype=dtype, device=ctx.device)
    else:
        for stage in stages:
            ctx.count_layers(stage)  # progress inside a micro-batch, in the heartbeats
    held = {m.name: _holding(stage) for m, stage in zip(table, stages, strict=True)}
    totals = {
        k: sum(h[k] for h in held.values())
        for k in ("param_bytes", "layer_param_bytes", "checkpoint_bytes_read")
    }
    models = {"models": held} if len(table) > 1 else {}
    ready({**info, **totals, "layers": held[table[0].name]["layers"], **models})

    keepalive_s = ctx.spec.collective_timeout_s / KEEPALIVE_PER_TIMEOUT

    def from_driver(_mb: int | None) -> MicroBatch | Idle | None:
        try:
            item: Batch | Stop = ctx.link.get(keepalive_s)
        except queue.Empty:
            return IDLE
        if isinstance(item, Stop):
            return None
        index = 0 if item.model is None else index_of.get(item.model)
        if index is None:
            raise ValueError(
                f"rank {ctx.rank}: micro-batch {item.mb_id} is for model {item.model!r}; "
                f"this gang holds {list(index_of)}"
            )
        types = item.token_type_ids
        return MicroBatch(
            tag(item.mb_id, index),  # the model travels with the micro-batch to every stage
            torch.from_numpy(item.input_ids).to(ctx.device),  # (B, S) int64
            torch.from_numpy(item.attention_mask).to(ctx.device),  # (B, S)
            torch.from_numpy(types).to(ctx.device) if types is not None else None,
        )

    def to_driver(mb: int, logits: torch.Tensor) -> None:
        if ctx.tp_rank == 0:
            mb_id, index = untag(mb)
            ctx.link.send(Result(mb_id, to_host(logits).numpy(), table[index].name))  # (B, S, 2) float32

    comm = P2PCommunicator(device=ctx.device, backend=ctx.backend)
    ex = ctx.stage_executor(stages[0], comm, get_inputs=from_driver, on_logits=to_driver, forward_only=True)
    with torch.inference_mode():
        run_stream(MultiplexedExecutor.over(ex, stages), around_step=ctx.micro_batch)


def _holding(stage: QAModel) -> dict[str, Any]:
    """What a rank's stage of one model holds, for its ready info (int8 layers: their packed weights)."""

    def held(module: torch.nn.Module) -> int:
        packed = sum(getattr(m, "weight_bytes", 0) for m in module.modules())
        return packed + sum(p.numel() * p.element_size() for p in module.parameters())

    return {
        "param_bytes": held(stage),
        "layer_param_bytes": held(stage.layers),
        "checkpoint_bytes_read": stage.load_report.bytes_read,
        "layers": [int(k) for k in stage.layers],
    }


def stream_spec(
    source: ModelSource,
    plan: PartitionPlan,
    *,
    compile: bool = False,
    warmup_lengths: tuple[int, ...] = DEFAULT_WARMUP,
    **spec: Any,
) -> GangSpec:
    """A gang spec that runs the forward stream of one model; ``compile``: each rank compiles its
    stage and runs ``warmup_lengths`` at batch 1 and 2 before it is ready; ``spec``: the other
    ``GangSpec`` fields."""
    return stream_spec_multi(
        {source.name: (source, plan)}, compile=compile, warmup_lengths=warmup_lengths, **spec
    )


def stream_spec_multi(
    models: Mapping[str, tuple[ModelSource, PartitionPlan]],
    *,
    compile: bool = False,
    warmup_lengths: tuple[int, ...] = DEFAULT_WARMUP,
    **spec: Any,
) -> GangSpec:
    """A gang spec whose ranks each hold their stage of every model in ``models`` (name -> (source,
    plan); the first is the default of an untagged micro-batch). Every plan must split its own model
    at the same pp and tp over the same devices (``ValueError`` with the numbers otherwise).
    ``compile`` / ``warmup_lengths`` / ``spec``: as ``stream_spec``, for each model."""
    table = check_models(models)
    extra = {"compile": compile, "warmup_lengths": tuple(warmup_lengths), **models_extra(table)}
    return GangSpec(table[0].source, table[0].plan, program=stream_rank, extra=extra, **spec)


def _to_json(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "compile": bool(extra.get("compile", False)),
        "warmup_lengths": list(extra.get("warmup_lengths", DEFAULT_WARMUP)),
        **models_to_json(extra),
    }


def _from_json(body: dict[str, Any], source: ModelSource) -> tuple[dict[str, Any], ModelSource]:
    extra = {"compile": body["compile"], "warmup_lengths": tuple(body["warmup_lengths"])}
    return {**extra, **models_from_json(body)}, source


STREAM_PROGRAM = RemoteProgram("serve", stream_rank, to_json=_to_json, from_json=_from_json)
