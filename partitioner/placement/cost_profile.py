"""A ``ModelProfile`` from the analytic cost model, anchored to one measured single-request latency.

Owns the translation of ``partitioner/cost.py`` (per-unit costs, the balanced pipeline split, the
per-stage parameter counts and activation bytes) into the simulator's latency table. The cost model
gives relative costs; ``single_latency_s`` (one request at pp=1, tp=1, measured or assumed) fixes
the scale. For each ``(pp, tp)``:

    stage_k(b) = single_latency_s * cost_k / total_cost * (fixed_share + (1 - fixed_share) * b) / tp
                 + hop_s                           (pp > 1: sending the boundary activations on)
                 + 2 * layers_k * allreduce_s      (tp > 1: two all-reduces per layer)

``fixed_share`` is the part of a micro-batch's time that does not grow with its size (weights read,
kernel launches): 0 means no batching gain, as on a CPU that is already compute bound. A named GPU
(``gpu=``, ``partitioner/placement/gpus.py``) replaces ``single_latency_s * (fixed_share + ...) / tp``
by its roofline time of a micro-batch of ``b`` on ``tp`` shards (the kernel launches not shared) and
brings its own ``hop_s``, ``allreduce_s`` and largest ``tp`` (a node's GPUs). Memory:
weights at ``dtype_bytes`` per parameter (the largest tensor rank of each stage, so stage 0 carries
the embeddings) and an activation allowance of one ``max_batch_size x seq_len`` micro-batch.

    profile = profile_from_cost_model("a", config, single_latency_s=0.02, hop_s=0.001, max_devices=4)
    estimated_single_latency_s(config, seq_len=384, device="cpu")   # when nothing was measured
    profiles, single, how = cost_profiles({"a": config_a, "b": config_b}, devices=2, seq_len=384,
                                          max_batch_size=8, dtype_bytes=2, single_latency_s=None)
    default_device_memory_bytes("cpu", devices=2)                   # the machine's memory / devices
    python -m pytest tests/partitioner/placement/test_cost_profile.py -q
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence

from shardserve.models.config import EncoderConfig
from shardserve.partitioner.cost import (
    analytic_costs,
    balanced_split,
    serving_memory_bytes,
    stage_costs,
    stage_param_counts,
)
from shardserve.partitioner.placement.gpus import GpuSpec, roofline_batch_time
from shardserve.partitioner.placement.latency import (
    LatencyModel,
    MeasuredLatency,
    ModelProfile,
    ParallelConfig,
    PlacementError,
)

logger = logging.getLogger(__name__)

# Sustained FLOP/s assumed for a forward pass when no latency was measured: conservative figures
# (a few CPU cores in fp32; a data-center GPU far below its peak at small batches).
ASSUMED_FLOPS = {"cpu": 50e9, "cuda": 5e12}
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


def estimated_single_latency_s(config: EncoderConfig, *, seq_len: int, device: str = "cpu") -> float:
    """One request's forward time from the analytic FLOPs at ``seq_len`` and ``ASSUMED_FLOPS[device]``."""
    if device not in ASSUMED_FLOPS:
        raise PlacementError(f"no assumed FLOP/s for device {device!r} (have {sorted(ASSUMED_FLOPS)})")
    flops = sum(u.cost for u in analytic_costs(config, seq_len=seq_len)) * seq_len
    return flops / ASSUMED_FLOPS[device]


def parallel_configs(
    config: EncoderConfig, *, max_devices: int, tensor_parallel: bool = False, max_tp: int | None = None
) -> list[ParallelConfig]:
    """Every ``(pp, tp)`` with ``pp * tp <= max_devices`` the model can be split into: ``pp`` at most
    its layer count; ``tp`` (only when ``tensor_parallel``; at most ``max_tp``) dividing its heads,
    key/value heads and MLP width."""
    out = []
    for size in range(1, max_devices + 1):
        for tp in range(1, size + 1):
            if size % tp or (tp > 1 and not tensor_parallel) or (max_tp is not None and tp > max_tp):
                continue
            if tp > 1 and (
                config.num_heads % tp or config.num_kv_heads % tp or config.intermediate_size % tp
            ):
                continue
            pp = size // tp
            if pp <= config.num_layers:
                out.append((pp, tp))
    return out


def profile_from_cost_model(
    name: str,
    config: EncoderConfig,
    *,
    single_latency_s: float,
    configs: Sequence[ParallelConfig] | None = None,
    max_devices: int = 1,
    seq_len: int = 384,
    hop_s: float = 0.0,
    allreduce_s: float = 0.0,
    fixed_share: float = 0.0,
    max_batch_size: int = 32,
    dtype_bytes: int = 4,
    batch_sizes: Sequence[int] = BATCH_SIZES,
    batch_time: Callable[[int, int], float] | None = None,
) -> ModelProfile:
    """The profile of ``config`` for ``configs`` (default: ``parallel_configs(max_devices)``; see module
    doc). ``batch_time``: seconds of a whole-model micro-batch of ``b`` requests on ``tp`` shards, at
    pp=1, all-reduces not included (default: ``single_latency_s * (fixed_share + (1 - fixed_share) *
    b) / tp``)."""
    problems = []
    if not (math.isfinite(single_latency_s) and single_latency_s > 0):
        problems.append(f"single_latency_s={single_latency_s!r} must be > 0")
    for label, value in (("hop_s", hop_s), ("allreduce_s", allreduce_s)):
        if not (math.isfinite(value) and value >= 0):
            problems.append(f"{label}={value!r} must be >= 0")
    if not 0 <= fixed_share < 1:
        problems.append(f"fixed_share={fixed_share!r} must be in [0, 1)")
    if max_batch_size < 1 or dtype_bytes < 1:
        problems.append(f"max_batch_size={max_batch_size} and dtype_bytes={dtype_bytes} must be >= 1")
    if problems:
        raise PlacementError(f"invalid cost profile for {name!r}: " + "; ".join(problems))
    costs = analytic_costs(config, seq_len=seq_len)
    total = sum(u.cost for u in costs)
    whole = batch_time or (lambda b, tp: single_latency_s * (fixed_share + (1 - fixed_share) * b) / tp)
    wanted = list(configs) if configs is not None else parallel_configs(config, max_devices=max_devices)
    table: dict[ParallelConfig, dict[int, tuple[float, ...]]] = {}
    stage_bytes: dict[ParallelConfig, tuple[int, ...]] = {}
    for pp, tp in wanted:
        if pp > config.num_layers:
            raise PlacementError(f"pp={pp} stages need at most num_layers={config.num_layers} for {name!r}")
        bounds = balanced_split(costs, pp)
        shares = [c / total for c in stage_costs(costs, bounds)]
        fixed = [
            (hop_s if pp > 1 else 0.0) + (2 * (b - a) * allreduce_s if tp > 1 else 0.0) for a, b in bounds
        ]
        table[(pp, tp)] = {
            bs: tuple(whole(bs, tp) * share + extra for share, extra in zip(shares, fixed, strict=True))
            for bs in batch_sizes
        }
        stage_bytes[(pp, tp)] = tuple(p * dtype_bytes for p in stage_param_counts(costs, bounds, tp))
    activation = serving_memory_bytes(
        0, config, n_layers=1, batch_size=max_batch_size, seq_len=seq_len, tp=1, dtype_bytes=dtype_bytes
    )
    return ModelProfile(
        name,
        param_bytes=sum(u.params for u in costs) * dtype_bytes,
        latency=LatencyModel(table),
        activation_bytes=activation,
        stage_bytes=stage_bytes,
    )


def cost_profiles(
    configs: Mapping[str, EncoderConfig],
    *,
    devices: int,
    seq_len: int,
    max_batch_size: int,
    dtype_bytes: int,
    device: str = "cpu",
    single_latency_s: float | None = None,
    hop_s: float | None = None,
    measured: MeasuredLatency | None = None,
    gpu: GpuSpec | None = None,
    max_tp: int = 1,
) -> tuple[list[ModelProfile], dict[str, float], str]:
    """Each model's profile for groups of up to ``devices`` devices, its single-request latency (s:
    ``single_latency_s`` as measured, else ``gpu``'s roofline time of one request, else
    ``estimated_single_latency_s``) and where that came from. ``measured``: stage times measured for
    every model (a ``MeasuredLatency`` profile) instead of the cost model's; the single-request
    latency is then its pp=1 time plus its overhead. ``gpu`` (without ``single_latency_s``): every
    micro-batch at its roofline time (``partitioner/placement/gpus.py``), stages passing activations
    on in its ``hop_s`` (unless ``hop_s`` is given; else 1 ms). ``max_tp`` > 1: groups may also be
    tensor parallel up to that degree, each all-reduce costing ``gpu``'s ``allreduce_s`` (else
    ``hop_s``); not with ``measured`` (it has the stage times it measured, nothing else)."""
    if measured is not None:
        single_latency_s = measured.latency.latency(1, 1, 1) + measured.overhead_s
    roofline = gpu if single_latency_s is None else None
    if hop_s is None:
        hop_s = roofline.hop_s if roofline is not None else 0.001
    allreduce_s = roofline.allreduce_s if roofline is not None else hop_s
    profiles, single = [], {}
    for name, config in configs.items():
        batch_time = (
            None
            if roofline is None
            else roofline_batch_time(config, roofline, seq_len=seq_len, dtype_bytes=dtype_bytes)
        )
        single[name] = (
            single_latency_s
            if single_latency_s is not None
            else batch_time(1)
            if batch_time is not None
            else estimated_single_latency_s(config, seq_len=seq_len, device=device)
        )
        profiles.append(
            profile_from_cost_model(
                name,
                config,
                single_latency_s=single[name],
                configs=parallel_configs(
                    config,
                    max_devices=devices,
                    tensor_parallel=max_tp > 1 and measured is None,
                    max_tp=max_tp,
                ),
                seq_len=seq_len,
                hop_s=hop_s,
                allreduce_s=allreduce_s,
                max_batch_size=max_batch_size,
                dtype_bytes=dtype_bytes,
                batch_time=batch_time,
            )
        )
    if measured is not None:
        profiles = [dataclasses.replace(p, latency=measured.latency) for p in profiles]
    how = (
        "measured stage times"
        if measured is not None
        else "as measured"
        if single_latency_s is not None
        else f"roofline of {roofline.name} (datasheet figures, {roofline.efficiency:.0%} of peak FLOP/s)"
        if roofline is not None
        else f"estimated from analytic FLOPs at {ASSUMED_FLOPS[device] / 1e9:g} GFLOP/s"
    )
    return profiles, single, how


def default_device_memory_bytes(device: str, devices: int) -> int:
    """One device's memory: the first GPU's with ``cuda``; else the machine's memory / ``devices``."""
    if device == "cuda":
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory)
        logger.warning("device cuda but no GPU visible: using the machine's memory / devices")
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // devices
