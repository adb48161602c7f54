"""``shardserve plan``: how a model is split across ranks; the flags ``plan`` and ``verify`` share.

``PLAN`` is the command as data (the console script generates its flags from ``PlanSettings``);
``PartitionSettings`` (model, pp, tp, device, dtype, boundaries) is also the base of ``verify``'s
settings (``partitioner/stream/verify_command.py``).

    shardserve plan --model minilm --pp 2 --tp 2 --batch-size 8 --seq-len 384
    shardserve plan --model tiny-bert --pp 3 --json
    shardserve plan --model default --pp auto --tp auto --max-memory-per-rank 450MiB  # the fewest ranks that fit
    shardserve plan --model minilm --dp 2 --pp 2 --batch-size 4 --seq-len 256   # training: 4 ranks

With ``--placement`` it plans several models on a pool of devices instead (AlpaServe-style, the
simulator of ``partitioner/placement/``): the device groups, each group's pp/tp, the models on each
and their memory per device, and the predicted SLO attainment per model for a Poisson/Gamma load:

    shardserve plan --placement auto --models a=default,b=minilm --devices 4 --rate 10 --cv 3
    shardserve plan --placement dedicated --devices 2 --single-latency-ms 40 --slo-scale 3 --json
"""

from __future__ import annotations

import json
import logging
import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from shardserve.models.config import EncoderConfig
from shardserve.models.registry import MODEL_NAMES, resolve_model
from shardserve.partitioner.command import Command, Settings, at_least, positive_number, split_list
from shardserve.partitioner.cost import UnitCost, analytic_costs, profile_costs
from shardserve.partitioner.fit import (
    DEGREE_HELP,
    MEMORY_HELP,
    Degree,
    LayoutChoice,
    MemorySize,
    fit_layout,
    memory_budget,
)
from shardserve.partitioner.placement.cost_profile import (
    ASSUMED_FLOPS,
    cost_profiles,
    default_device_memory_bytes,
)
from shardserve.partitioner.placement.latency import MeasuredLatency, ModelProfile
from shardserve.partitioner.placement.search import PlacementChoice, choose_placement
from shardserve.partitioner.placement.simulator import SimConfig
from shardserve.partitioner.placement.workload import steady
from shardserve.partitioner.plan import ParallelDims, default_devices, make_plan
from shardserve.partitioner.precision import DTYPE_CHOICES, DtypeChoice, resolve_dtype

logger = logging.getLogger(__name__)

MIB = 2**20


def _name_and_model(item: str) -> tuple[str, str]:
    """``NAME=MODEL`` -> (NAME, MODEL); a bare registry name is both."""
    name, sep, model = item.partition("=")
    return (name.strip(), model.strip()) if sep else (item.strip(), item.strip())


def _model_item(item: str) -> str:
    """A field validator: ``NAME=MODEL`` with both parts, or a model alone."""
    name, model = _name_and_model(item)
    if not name or not model:
        raise ValueError(f"must be NAME=MODEL or a model name (got {item!r})")
    return item


def _non_negative(value: float) -> float:
    """A field validator: a finite number >= 0."""
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"must be a number >= 0 (got {value:g})")
    return value


def _flops_text() -> str:
    return ", ".join(f"{k} {v / 1e9:g} GFLOP/s" for k, v in ASSUMED_FLOPS.items())


class PartitionSettings(Settings):
    """The flags ``plan`` and ``verify`` share: which model, split how, where."""

    model: str = Field(
        "default", description=f"registry name {MODEL_NAMES} or a local Hugging Face model directory"
    )
    pp: Degree = Field(1, description=f"pipeline-parallel degree: number of stages, {DEGREE_HELP}")
    tp: Degree = Field(
        1, description=f"tensor-parallel degree: ranks per stage sharing heads and MLP, {DEGREE_HELP}"
    )
    max_memory_per_rank: MemorySize = Field(
        None, description=MEMORY_HELP, json_schema_extra={"metavar": "SIZE"}
    )
    device: Literal["cpu", "cuda"] = Field(
        "cpu",
        description="where ranks run: cpu (gloo), or cuda (one GPU per rank round-robin; NCCL when every "
        "rank has its own GPU, gloo through host memory when ranks share one)",
    )
    dtype: Literal[DTYPE_CHOICES] = Field(  # type: ignore[valid-type]
        "auto",
        description="compute dtype of the ranks: auto picks bfloat16 on GPUs and on CPUs with bf16 units "
        "(AMX, AVX512-BF16), else float32; float16 only where the device has fp16 units",
    )
    boundaries: list[int] | None = Field(
        None,
        description="manual split: first layer of stages 1..pp-1, e.g. '2,4' (default: balanced by the "
        "cost model)",
    )

    @model_validator(mode="before")
    @classmethod
    def _split_boundaries(cls, data: Any) -> Any:
        return split_list(data, "boundaries")

    def layout(
        self,
        name: str,
        config: EncoderConfig,
        *,
        batch_size: int,
        seq_len: int,
        dtype: DtypeChoice,
        costs: list[UnitCost] | None = None,
        remedy: str | None = None,
    ) -> LayoutChoice:
        """``pp`` x ``tp`` (either ``auto``) checked against ``max_memory_per_rank`` by the serving
        estimate of a ``batch_size x seq_len`` micro-batch (``partitioner/fit.py``): ``LayoutDoesNotFit``
        (one line, exit 2) when it does not fit."""
        budget = memory_budget(
            self.max_memory_per_rank, device=self.device, batch_size=batch_size, seq_len=seq_len, dtype=dtype
        )
        return fit_layout(
            {name: config},
            pp=self.pp,
            tp=self.tp,
            budget=budget,
            device=self.device,
            costs=None if costs is None else {name: costs},
            boundaries=self.boundaries,
            **({} if remedy is None else {"remedy": remedy}),
        )


class PlanSettings(PartitionSettings):
    """``shardserve plan``."""

    dp: int = Field(
        1,
        description="training only: data-parallel copies of the pipeline; adds the gradient all-reduce "
        "volume per step",
    )
    batch_size: Annotated[int, AfterValidator(at_least(1))] = Field(
        8,
        description="micro-batch size for memory estimates (with --placement: the largest micro-batch the "
        "simulated scheduler forms, and the activation memory reserved per device)",
    )
    seq_len: Annotated[int, AfterValidator(at_least(1))] = Field(
        384, description="sequence length for costs and memory estimates"
    )
    profile: bool = Field(
        False,
        description="measure per-layer cost with a short CPU profile instead of computing it from shapes",
    )
    as_json: bool = Field(False, alias="json", description="print the plan as JSON instead of a table")
    # -- multi-model placement (only with --placement) --
    placement: Literal["dedicated", "multiplexed", "auto"] | None = Field(
        None,
        description="plan several models (--models) on a pool of devices by simulating their load instead "
        "of splitting one model: dedicated (one whole model per device, replicas chosen greedily), "
        "multiplexed (every model split over all devices as one pipeline), auto (AlpaServe's search over "
        "group sizes and pipeline degrees); pipeline groups only (tp=1). Without it, plan splits --model as "
        "above and the flags below are not used",
    )
    models: list[Annotated[str, AfterValidator(_model_item)]] = Field(
        ["a=default", "b=default"],
        description="with --placement: the models sharing the devices, each NAME=MODEL (MODEL: a registry "
        f"name {MODEL_NAMES} or a local Hugging Face model directory) or a registry name alone",
    )
    devices: Annotated[int, AfterValidator(at_least(1))] = Field(
        2, description="with --placement: devices in the pool"
    )
    device_memory_mb: Annotated[float, AfterValidator(positive_number)] | None = Field(
        None,
        description="with --placement: memory of one device in MiB (default: the GPU's memory with "
        "--device cuda; the machine's memory divided by devices with --device cpu)",
    )
    rate: Annotated[float, AfterValidator(positive_number)] = Field(
        4.0, description="with --placement: total requests/s, shared evenly by the models"
    )
    cv: Annotated[float, AfterValidator(positive_number)] = Field(
        1.0,
        description="with --placement: coefficient of variation of each model's inter-arrival times "
        "(Gamma process; 1 is Poisson, larger is burstier)",
    )
    slo_scale: Annotated[float, AfterValidator(positive_number)] = Field(
        5.0, description="with --placement: each model's SLO as a multiple of its single-request latency"
    )
    duration_s: Annotated[float, AfterValidator(positive_number)] = Field(
        60.0, description="with --placement: seconds of load to simulate"
    )
    single_latency_ms: Annotated[float, AfterValidator(positive_number)] | None = Field(
        None,
        description="with --placement: measured latency of one request at pp=1 (every model; a micro-batch "
        "of b requests is assumed to take b times as long). Default: each model's analytic FLOPs at "
        f"seq_len over a conservative assumed rate ({_flops_text()}), an estimate only",
    )
    latency_profile: str | None = Field(
        None,
        description="with --placement: a JSON file of stage times measured for the models' shape (what "
        "benchmarks/bench_multimodel.py writes) instead of the cost model's; --single-latency-ms and "
        "--hop-ms are then not used",
    )
    hop_ms: Annotated[float, AfterValidator(_non_negative)] = Field(
        1.0,
        description="with --placement: time a pipeline stage adds to pass its activations on (each stage, "
        "when pp > 1)",
    )
    seed: int = Field(0, description="with --placement: seed of the simulated arrivals")

    @model_validator(mode="before")
    @classmethod
    def _split_models(cls, data: Any) -> Any:
        return split_list(data, "models")

    @field_validator("models")
    @classmethod
    def _distinct_names(cls, value: list[str]) -> list[str]:
        names = [_name_and_model(item)[0] for item in value]
        if not names:
            raise ValueError("needs at least one model")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"model names must be distinct ({', '.join(twice)} given twice)")
        return value


def cmd_plan(args: PlanSettings) -> int:
    """``shardserve plan``: print the partition plan as a table, or as JSON (``--placement``: the
    multi-model placement, ``cmd_placement``)."""
    if args.placement is not None:
        return cmd_placement(args)  # PlacementError / WorkloadError: one line (shardserve/errors.py)
    source = resolve_model(args.model)
    cfg = source.config
    if args.profile:
        costs = profile_costs(
            cfg,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            device="cuda" if args.device == "cuda" else "cpu",
        )
        how = "profile"
    else:
        costs, how = analytic_costs(cfg, seq_len=args.seq_len), "analytic"
    choice = resolve_dtype(args.dtype, "cuda:0" if args.device == "cuda" else "cpu")
    layout = args.layout(
        source.name, cfg, batch_size=args.batch_size, seq_len=args.seq_len, dtype=choice, costs=costs
    )
    dims = ParallelDims(pp=layout.dims.pp, tp=layout.dims.tp, dp=args.dp)
    plan = make_plan(
        cfg,
        dims,
        boundaries=args.boundaries,
        costs=costs,
        cost_source=how,
        devices=default_devices(dims.world_size, device=args.device),
    )
    mem = plan.memory_estimates(
        cfg, batch_size=args.batch_size, seq_len=args.seq_len, dtype_bytes=choice.itemsize
    )
    if args.as_json:
        out = plan.to_dict()
        out["model"] = source.describe()
        out["dtype"] = choice.name
        out["max_memory_per_rank"] = layout.budget.limit_bytes
        out["layout"] = layout.line()
        for s, m in zip(out["stages"], mem, strict=True):
            s.update(m)
        print(json.dumps(out, indent=2))
        return 0
    dp = f"dp={args.dp} " if args.dp > 1 else ""
    print(
        f"model {source.name}: {cfg.arch}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_heads} heads; {dp}pp={dims.pp} tp={dims.tp} ({plan.dims.world_size} ranks); "
        f"cost: {plan.cost_source}; memory at batch {args.batch_size} x seq {args.seq_len}, {choice.name} "
        f"(training: fp32 weights + Adam, 16 B/param)"
    )
    if layout.auto or args.max_memory_per_rank is not None:
        print(layout.line())
    if args.dp > 1:
        mp = plan.dims.model_parallel_size
        print(
            f"data parallel: {args.dp} copies of the pipeline (ranks below are copy 0; copy d adds "
            f"d x {mp}); AdamW state is replicated on every copy (no ZeRO-1), so train MB per rank is "
            f"the same at any dp; AR MB = fp32 gradient bytes each rank sends (and receives) per step "
            f"in the ring all-reduce, 2 x ({args.dp}-1)/{args.dp} x 4 B/param"
        )
    ar = args.dp > 1
    header = f"{'stage':>5}  {'ranks':<12} {'layers':<9} {'params/rank':>12} {'serve MB':>9} {'train MB':>9} {'cost':>6}"
    header += f" {'AR MB':>8}" if ar else ""
    print(header)
    print("-" * len(header))
    for s, m in zip(plan.stages, mem, strict=True):
        parts = (
            (["emb"] if s.has_embeddings else [])
            + [f"{s.layer_start}-{s.layer_end - 1}"]
            + (["head"] if s.has_head else [])
        )
        row = (
            f"{s.index:>5}  {','.join(map(str, s.ranks)):<12} {'+'.join(parts):<9} {s.params_per_rank:>12,} "
            f"{m['serving_bytes'] / 2**20:>9.1f} {m['training_bytes'] / 2**20:>9.1f} {s.cost_share:>6.1%}"
        )
        print(row + (f" {m['allreduce_bytes'] / 2**20:>8.1f}" if ar else ""))
    return 0


def placement_profiles(args: PlanSettings) -> tuple[list[ModelProfile], dict[str, float], str]:
    """The models' profiles from the cost model, each one's single-request latency (s) and where that
    latency came from."""
    profiles, single, how = cost_profiles(
        {name: resolve_model(model).config for name, model in map(_name_and_model, args.models)},
        devices=args.devices,
        seq_len=args.seq_len,
        max_batch_size=args.batch_size,
        dtype_bytes=resolve_dtype(args.dtype, "cuda" if args.device == "cuda" else "cpu").itemsize,
        device=args.device,
        single_latency_s=None if args.single_latency_ms is None else args.single_latency_ms / 1000.0,
        hop_s=args.hop_ms / 1000.0,
        measured=None if args.latency_profile is None else MeasuredLatency.read(args.latency_profile),
    )
    given = args.single_latency_ms is not None and args.latency_profile is None
    return profiles, single, ("as given by --single-latency-ms" if given else how)


def cmd_placement(args: PlanSettings) -> int:
    """``shardserve plan --placement POLICY``: the chosen placement and its predicted SLO attainment."""
    assert args.placement is not None
    profiles, single, how = placement_profiles(args)
    memory = (
        int(args.device_memory_mb * MIB)
        if args.device_memory_mb is not None
        else default_device_memory_bytes(args.device, args.devices)
    )
    names = [p.name for p in profiles]
    slo = {m: args.slo_scale * single[m] for m in names}
    workload = steady(names, rate=args.rate, cv=args.cv, duration_s=args.duration_s, seed=args.seed)
    overhead = MeasuredLatency.read(args.latency_profile).overhead_s if args.latency_profile else 0.0
    config = SimConfig(max_batch_size=args.batch_size, overhead_s=overhead)
    choice = choose_placement(
        args.placement,
        profiles,
        workload,
        num_devices=args.devices,
        device_memory_bytes=memory,
        slo_s=slo,
        config=config,
    )
    if args.as_json:
        out = choice.to_dict(profiles)
        out.update(
            devices=args.devices,
            device_memory_bytes=memory,
            models={item.partition("=")[0]: _name_and_model(item)[1] for item in args.models},
            workload={"rate": args.rate, "cv": args.cv, "duration_s": args.duration_s, "seed": args.seed},
            slo_ms={m: round(s * 1000, 3) for m, s in slo.items()},
            single_latency_ms={m: round(s * 1000, 3) for m, s in single.items()},
            single_latency_source=how,
            max_batch_size=config.max_batch_size,
            max_inflight=config.max_inflight,
        )
        print(json.dumps(out, indent=2))
        return 0
    _print_placement(args, choice, profiles, memory=memory, slo=slo, single=single, how=how)
    return 0


def _print_placement(
    args: PlanSettings,
    choice: PlacementChoice,
    profiles: list[ModelProfile],
    *,
    memory: int,
    slo: dict[str, float],
    single: dict[str, float],
    how: str,
) -> None:
    prof = {p.name: p for p in profiles}
    print(
        f"placement {choice.policy}: {args.devices} devices of {memory / MIB:,.0f} MiB; "
        f"{len(profiles)} models at {args.rate:g} req/s in all (cv {args.cv:g}, {args.duration_s:g} s "
        f"simulated, seed {args.seed}); SLO {args.slo_scale:g} x single-request latency ({how}); "
        f"micro-batches up to {args.batch_size}, 2 in flight per group"
    )
    header = f"{'group':>5}  {'devices':<10} {'pp':>3} {'tp':>3}  {'models':<20} {'MiB per device':<20}"
    print(header)
    print("-" * len(header))
    for k, g in enumerate(choice.placement.groups):
        per_device = ",".join(f"{b / MIB:.0f}" for b in g.device_bytes(prof).values())
        devices = ",".join(map(str, g.devices))
        print(f"{k:>5}  {devices:<10} {g.pp:>3} {g.tp:>3}  {','.join(g.models) or '-':<20} {per_device:<20}")
    print()
    header = (
        f"{'model':<10} {'latency ms':>10} {'SLO ms':>8} {'requests':>8} {'attain':>7} "
        f"{'p50 ms':>8} {'p99 ms':>8} {'late':>6} {'refused':>7} {'expired':>7}"
    )
    print(header)
    print("-" * len(header))
    res = choice.result
    for m in prof:
        st = res.per_model.get(m)
        if st is None:
            print(f"{m:<10} {single[m] * 1000:>10.1f} {slo[m] * 1000:>8.1f} {0:>8} (no requests)")
            continue
        p50 = "-" if math.isnan(st.p50_s) else f"{st.p50_s * 1000:.1f}"
        p99 = "-" if math.isnan(st.p99_s) else f"{st.p99_s * 1000:.1f}"
        print(
            f"{m:<10} {single[m] * 1000:>10.1f} {slo[m] * 1000:>8.1f} {st.requests:>8} {st.attainment:>7.1%} "
            f"{p50:>8} {p99:>8} {st.late:>6} {st.rejected:>7} {st.expired:>7}"
        )
    print(f"predicted SLO attainment {res.attainment:.1%}, goodput {res.goodput:.2f} req/s")


PLAN = Command(
    "plan",
    help="show how a model is split across ranks",
    description="Print the partition plan: stages, ranks, layers, parameters per rank, "
    "memory estimates for serving and training, and each stage's cost share. With --placement: "
    "the placement of several models on a pool of devices and its simulated SLO attainment.",
    settings=PlanSettings,
    run=cmd_plan,
)
