"""``shardserve plan --placement``: several models on a pool of devices, chosen by simulating their load.

Owns the placement half of ``plan``: its flags (``PlacementFlags``, a base of ``PlanSettings`` in
``partitioner/cli.py``), the models' profiles (a checkpoint, or a public model's shape from
``models/shapes.py``; latencies from a measured profile, a named GPU's roofline or the cost model),
the table / JSON it prints, and the gain over dedicated: the largest total rate and the largest CV
each placement serves at ``--target-attainment`` (``partitioner/placement/headroom.py``).

    shardserve plan --placement auto --models a=default,b=minilm --devices 4 --rate 10 --cv 3
    shardserve plan --placement auto --devices 64 --gpu h100 --rate 3000 --cv 4 --skew 1 \\
        --models minilm-l6:8,bert-base:8,bert-large:8,qwen2-1.5b:8 --duration-s 20
"""

from __future__ import annotations

import json
import logging
import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from shardserve.models.config import EncoderConfig
from shardserve.models.registry import MODEL_NAMES, resolve_model
from shardserve.models.shapes import SHAPES, shape_config
from shardserve.partitioner.command import Settings, at_least, positive_number, split_list
from shardserve.partitioner.placement.cost_profile import (
    ASSUMED_FLOPS,
    cost_profiles,
    default_device_memory_bytes,
)
from shardserve.partitioner.placement.gpus import GPUS
from shardserve.partitioner.placement.headroom import headroom
from shardserve.partitioner.placement.latency import MeasuredLatency, ModelProfile, PlacementError
from shardserve.partitioner.placement.search import PlacementChoice, choose_placement
from shardserve.partitioner.placement.simulator import SimConfig
from shardserve.partitioner.placement.workload import Workload, steady
from shardserve.partitioner.precision import resolve_dtype

logger = logging.getLogger(__name__)

MIB = 2**20


def model_items(item: str) -> list[tuple[str, str]]:
    """``[NAME=]MODEL[:COUNT]`` -> its (name, model) pairs: a bare model is its own name; ``:COUNT``
    makes COUNT copies named ``NAME-1`` ... ``NAME-COUNT``."""
    head, sep, count = item.rpartition(":")
    copies = int(count) if sep and count.strip().isdigit() else None
    text = head if copies is not None else item
    name, eq, model = text.partition("=")
    name, model = (name.strip(), model.strip()) if eq else (text.strip(), text.strip())
    if copies is None:
        return [(name, model)]
    return [(f"{name}-{k}", model) for k in range(1, copies + 1)]


def _model_item(item: str) -> str:
    """A field validator: ``[NAME=]MODEL[:COUNT]`` with both parts and a count >= 1."""
    pairs = model_items(item)
    if not pairs or not all(name and model for name, model in pairs):
        raise ValueError(f"must be NAME=MODEL, a model name, or either with :COUNT >= 1 (got {item!r})")
    return item


def _non_negative(value: float) -> float:
    """A field validator: a finite number >= 0."""
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"must be a number >= 0 (got {value:g})")
    return value


def _fraction(value: float) -> float:
    if not 0 < value < 1:
        raise ValueError(f"must be a fraction in (0, 1) (got {value:g})")
    return value


def planning_config(model: str) -> EncoderConfig:
    """A public model's shape (``models/shapes.py``) or a checkpoint's config."""
    return shape_config(model) if model in SHAPES else resolve_model(model).config


def _flops_text() -> str:
    return ", ".join(f"{k} {v / 1e9:g} GFLOP/s" for k, v in ASSUMED_FLOPS.items())


class PlacementFlags(Settings):
    """The flags of ``plan --placement`` (see module doc)."""

    placement: Literal["dedicated", "multiplexed", "auto"] | None = Field(
        None,
        description="plan several models (--models) on a pool of devices by simulating their load instead "
        "of splitting one model: dedicated (one whole model per device, replicas chosen greedily), "
        "multiplexed (every model split over all devices as one pipeline), auto (AlpaServe's search over "
        "group sizes, pipeline and, with --placement-max-tp, tensor-parallel degrees). Without it, plan "
        "splits --model as above and the flags below are not used",
    )
    models: list[Annotated[str, AfterValidator(_model_item)]] = Field(
        ["a=default", "b=default"],
        description="with --placement: the models sharing the devices, each NAME=MODEL or a model alone "
        f"(MODEL: a registry name {MODEL_NAMES}, a local Hugging Face model directory, or a public model's "
        f"shape for planning only: {', '.join(SHAPES)}); MODEL:COUNT or NAME=MODEL:COUNT adds COUNT "
        "copies named NAME-1 ... NAME-COUNT",
    )
    devices: Annotated[int, AfterValidator(at_least(1))] = Field(
        2, description="with --placement: devices in the pool"
    )
    device_memory_mb: Annotated[float, AfterValidator(positive_number)] | None = Field(
        None,
        description="with --placement: memory of one device in MiB (default: --gpu's usable memory; the "
        "GPU's memory with --device cuda; the machine's memory divided by devices with --device cpu)",
    )
    gpu: Literal[tuple(GPUS)] | None = Field(  # type: ignore[valid-type]
        None,
        description="with --placement: plan for this GPU without one: each micro-batch's time from its "
        "datasheet (roofline: the larger of FLOPs at half the dense bf16 peak and one read of the weights, "
        "plus kernel launches; partitioner/placement/gpus.py), its memory and NVLink hop; bf16 weights "
        "unless --dtype says otherwise",
    )
    placement_max_tp: Annotated[int, AfterValidator(at_least(1))] | None = Field(
        None,
        description="with --placement auto: groups may also be tensor parallel, tp up to this (dividing "
        "each model's heads, key/value heads and MLP width), each tp > 1 layer paying two all-reduces "
        "(--gpu's own cost, else --hop-ms's). Default: --gpu's GPUs per node (8), 1 (pipelines only) "
        "without --gpu or with --latency-profile (it has no tensor-parallel times)",
    )
    rate: Annotated[float, AfterValidator(positive_number)] = Field(
        4.0, description="with --placement: total requests/s, shared by the models (see --skew)"
    )
    skew: Annotated[float, AfterValidator(_non_negative)] = Field(
        0.0,
        description="with --placement: Zipf-like popularity: the k-th model of --models gets a share of "
        "--rate in proportion to 1/k^skew (0: evenly)",
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
        "of b requests is assumed to take b times as long). Default: --gpu's roofline, else each model's "
        f"analytic FLOPs at seq_len over a conservative assumed rate ({_flops_text()}), an estimate only",
    )
    latency_profile: str | None = Field(
        None,
        description="with --placement: a JSON file of stage times measured for the models' shape (what "
        "benchmarks/bench_multimodel.py writes) instead of the cost model's; --single-latency-ms and "
        "--hop-ms are then not used",
    )
    hop_ms: Annotated[float, AfterValidator(_non_negative)] | None = Field(
        None,
        description="with --placement: time a pipeline stage adds to pass its activations on (each stage, "
        "when pp > 1; default 1 ms, --gpu's own with --gpu)",
    )
    seed: int = Field(0, description="with --placement: seed of the simulated arrivals")
    target_attainment: Annotated[float, AfterValidator(_fraction)] = Field(
        0.99,
        description="with --placement auto or multiplexed: the SLO attainment at which the gain over "
        "dedicated is measured (the largest total rate, and the largest CV at --rate, each placement "
        "serves at it, the placements held fixed)",
    )
    no_gain: bool = Field(
        False, description="with --placement: skip the gain over dedicated (saves its simulations)"
    )

    @model_validator(mode="before")
    @classmethod
    def _split_models(cls, data: Any) -> Any:
        return split_list(data, "models")

    @field_validator("models")
    @classmethod
    def _distinct_names(cls, value: list[str]) -> list[str]:
        names = [name for item in value for name, _ in model_items(item)]
        if not names:
            raise ValueError("needs at least one model")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"model names must be distinct ({', '.join(twice)} given twice)")
        return value

    @model_validator(mode="after")
    def _tp_needs_modelled_times(self) -> PlacementFlags:
        if self.placement_max_tp not in (None, 1) and self.latency_profile is not None:
            raise ValueError(
                f"--placement-max-tp {self.placement_max_tp} applies to the cost model's times, not with "
                "--latency-profile (the (pp, tp) it measured are the ones searched)"
            )
        return self

    def named_models(self) -> dict[str, str]:
        """Model name -> what it is (registry name, directory or shape), in the order given."""
        return dict(pair for item in self.models for pair in model_items(item))

    def max_tp(self) -> int:
        """The largest tensor-parallel degree of a group (``--placement-max-tp``, its default)."""
        if self.placement_max_tp is not None:
            return self.placement_max_tp
        return GPUS[self.gpu].max_tp if self.gpu and self.latency_profile is None else 1

    def workload(self, names: list[str], *, rate: float | None = None, cv: float | None = None) -> Workload:
        """The simulated load (at ``rate`` / ``cv`` instead of the flags' when given)."""
        return steady(
            names,
            rate=self.rate if rate is None else rate,
            cv=self.cv if cv is None else cv,
            duration_s=self.duration_s,
            seed=self.seed,
            skew=self.skew,
        )


def placement_profiles(
    args: PlacementFlags,
    *,
    device: str,
    dtype: str,
    seq_len: int,
    batch_size: int,
    measured: MeasuredLatency | None = None,
) -> tuple[list[ModelProfile], dict[str, float], str]:
    """The models' profiles, each one's single-request latency (s) and where that latency came from;
    ``measured``: ``--latency-profile`` as read already (None: read here when given)."""
    gpu = GPUS[args.gpu] if args.gpu else None
    if measured is None and args.latency_profile is not None:
        measured = MeasuredLatency.read(args.latency_profile)
    profiles, single, how = cost_profiles(
        {name: planning_config(model) for name, model in args.named_models().items()},
        devices=args.devices,
        seq_len=seq_len,
        max_batch_size=batch_size,
        # a named GPU is planned without one: bf16 (2 bytes) unless float32 is asked for
        dtype_bytes=(4 if dtype == "float32" else 2) if gpu else resolve_dtype(dtype, device).itemsize,
        device="cuda" if gpu else device,
        single_latency_s=None if args.single_latency_ms is None else args.single_latency_ms / 1000.0,
        hop_s=None if args.hop_ms is None else args.hop_ms / 1000.0,
        measured=measured,
        gpu=gpu,
        max_tp=args.max_tp(),
    )
    given = args.single_latency_ms is not None and args.latency_profile is None
    return profiles, single, ("as given by --single-latency-ms" if given else how)


def cmd_placement(
    args: PlacementFlags, *, device: str, dtype: str, seq_len: int, batch_size: int, as_json: bool = False
) -> int:
    """``shardserve plan --placement POLICY``: the chosen placement, its predicted SLO attainment and
    (auto, multiplexed) its gain over dedicated."""
    assert args.placement is not None
    measured = MeasuredLatency.read(args.latency_profile) if args.latency_profile else None
    profiles, single, how = placement_profiles(
        args, device=device, dtype=dtype, seq_len=seq_len, batch_size=batch_size, measured=measured
    )
    if args.device_memory_mb is not None:
        memory = int(args.device_memory_mb * MIB)
    elif args.gpu:
        memory = GPUS[args.gpu].usable_memory_bytes
    else:
        memory = default_device_memory_bytes(device, args.devices)
    names = [p.name for p in profiles]
    slo = {m: args.slo_scale * single[m] for m in names}
    config = SimConfig(max_batch_size=batch_size, overhead_s=measured.overhead_s if measured else 0.0)
    kw: dict[str, Any] = dict(num_devices=args.devices, device_memory_bytes=memory, slo_s=slo, config=config)
    workload = args.workload(names)  # its trace drawn once (cached), for the choice and the gain
    choice = choose_placement(args.placement, profiles, workload, **kw)
    gain = (
        None if args.no_gain or args.placement == "dedicated" else _gain(args, choice, profiles, workload, kw)
    )
    if as_json:
        out = choice.to_dict(profiles)
        out.update(
            devices=args.devices,
            device_memory_bytes=memory,
            models=args.named_models(),
            workload={
                "rate": args.rate,
                "cv": args.cv,
                "skew": args.skew,
                "duration_s": args.duration_s,
                "seed": args.seed,
            },
            slo_ms={m: round(s * 1000, 3) for m, s in slo.items()},
            single_latency_ms={m: round(s * 1000, 3) for m, s in single.items()},
            single_latency_source=how,
            max_batch_size=config.max_batch_size,
            max_inflight=config.max_inflight,
            gain=gain,
        )
        print(json.dumps(out, indent=2))
        return 0
    _print_placement(args, choice, profiles, memory=memory, slo=slo, single=single, how=how, batch=batch_size)
    if gain is not None:
        _print_gain(args, gain)
    return 0


def _gain(
    args: PlacementFlags,
    choice: PlacementChoice,
    profiles: list[ModelProfile],
    workload: Workload,
    kw: dict[str, Any],
) -> dict[str, Any]:
    """The largest total rate and CV at ``target_attainment`` of the chosen placement and of dedicated's
    (each chosen for the flags' ``workload``, then held fixed)."""
    names = [p.name for p in profiles]
    try:
        dedicated = choose_placement("dedicated", profiles, workload, **kw)
    except PlacementError as err:
        return {"target": args.target_attainment, "error": f"no dedicated placement: {err}"}
    sim = dict(slo_s=kw["slo_s"], config=kw["config"], target=args.target_attainment)
    out: dict[str, Any] = {"target": args.target_attainment}
    for c in (dedicated, choice):
        out[c.policy] = {
            "placement": c.placement.describe(),
            "attainment": c.result.attainment,
            "max_rate": headroom(
                c.placement, profiles, lambda r: args.workload(names, rate=r).trace(), start=args.rate, **sim
            ),
            "max_cv": headroom(
                c.placement,
                profiles,
                lambda v: args.workload(names, cv=v).trace(),
                start=args.cv,
                high=64.0,
                **sim,
            ),
        }
    for key in ("max_rate", "max_cv"):
        base, mine = out["dedicated"][key], out[choice.policy][key]
        out[f"{key}_gain"] = mine / base if base > 0 else None
    return out


def _print_placement(
    args: PlacementFlags,
    choice: PlacementChoice,
    profiles: list[ModelProfile],
    *,
    memory: int,
    slo: dict[str, float],
    single: dict[str, float],
    how: str,
    batch: int,
) -> None:
    prof = {p.name: p for p in profiles}
    skew = f", skew {args.skew:g}" if args.skew else ""
    print(
        f"placement {choice.policy}: {args.devices} devices of {memory / MIB:,.0f} MiB; "
        f"{len(profiles)} models at {args.rate:g} req/s in all (cv {args.cv:g}{skew}, {args.duration_s:g} s "
        f"simulated, seed {args.seed}); SLO {args.slo_scale:g} x single-request latency ({how}); "
        f"micro-batches up to {batch}, 2 in flight per group"
    )
    width = max(20, *(len(",".join(g.models)) for g in choice.placement.groups))
    header = f"{'group':>5}  {'devices':<10} {'pp':>3} {'tp':>3}  {'models':<{width}} {'MiB per device':<20}"
    print(header)
    print("-" * len(header))
    for k, g in enumerate(choice.placement.groups):
        per_device = ",".join(f"{b / MIB:.0f}" for b in g.device_bytes(prof).values())
        devices = ",".join(map(str, g.devices))
        models = ",".join(g.models) or "-"
        print(f"{k:>5}  {devices:<10} {g.pp:>3} {g.tp:>3}  {models:<{width}} {per_device:<20}")
    print()
    name_w = max(10, *(len(m) for m in prof))
    header = (
        f"{'model':<{name_w}} {'latency ms':>10} {'SLO ms':>8} {'requests':>8} {'attain':>7} "
        f"{'p50 ms':>8} {'p99 ms':>8} {'late':>6} {'refused':>7} {'expired':>7}"
    )
    print(header)
    print("-" * len(header))
    res = choice.result
    for m in prof:
        st = res.per_model.get(m)
        if st is None:
            print(f"{m:<{name_w}} {single[m] * 1000:>10.1f} {slo[m] * 1000:>8.1f} {0:>8} (no requests)")
            continue
        p50 = "-" if math.isnan(st.p50_s) else f"{st.p50_s * 1000:.1f}"
        p99 = "-" if math.isnan(st.p99_s) else f"{st.p99_s * 1000:.1f}"
        print(
            f"{m:<{name_w}} {single[m] * 1000:>10.1f} {slo[m] * 1000:>8.1f} {st.requests:>8} "
            f"{st.attainment:>7.1%} {p50:>8} {p99:>8} {st.late:>6} {st.rejected:>7} {st.expired:>7}"
        )
    print(f"predicted SLO attainment {res.attainment:.1%}, goodput {res.goodput:.2f} req/s")


def _print_gain(args: PlacementFlags, gain: dict[str, Any]) -> None:
    print()
    if "error" in gain:
        print(f"gain over dedicated: not computed ({gain['error']})")
        return
    print(
        f"gain over dedicated at {gain['target']:.0%} attainment (each placement held fixed; max rate: the "
        f"total rate scaled, cv {args.cv:g}; max cv: at {args.rate:g} req/s; 0 = not even at 1/64 of it):"
    )
    print(f"{'policy':<12} {'attainment':>10} {'max rate req/s':>15} {'max cv':>8}")
    for policy in ("dedicated", args.placement):
        row = gain[policy]
        print(f"{policy:<12} {row['attainment']:>10.1%} {row['max_rate']:>15.1f} {row['max_cv']:>8.2f}")

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    points = 100 * (gain[args.placement]["attainment"] - gain["dedicated"]["attainment"])
    print(f"{'gain':<12} {points:>+9.1f}p {ratio(gain['max_rate_gain']):>15} {ratio(gain['max_cv_gain']):>8}")
