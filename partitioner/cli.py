"""``shardserve plan``: how a model is split across ranks; the flags ``plan`` and ``verify`` share.

``PLAN`` is the command as data (the console script generates its flags from ``PlanSettings``);
``PartitionSettings`` (model, boundaries, and the layout flags every command shares: pp, tp,
max_memory_per_rank, device, dtype, ``partitioner/layout_flags.py``) is also the base of ``verify``'s
settings (``partitioner/stream/verify_command.py``).

    shardserve plan --model minilm --pp 2 --tp 2 --batch-size 8 --seq-len 384
    shardserve plan --model tiny-bert --pp 3 --json
    shardserve plan --model default --pp auto --tp auto --max-memory-per-rank 450MiB  # the fewest ranks that fit
    shardserve plan --model minilm --dp 2 --pp 2 --batch-size 4 --seq-len 256   # training: 4 ranks

With ``--placement`` it plans several models on a pool of devices instead (AlpaServe-style, the
simulator of ``partitioner/placement/``; flags and output in ``partitioner/placement/plan_command.py``):
the device groups, each group's pp/tp, the models on each and their memory per device, and the
predicted SLO attainment per model for a Poisson/Gamma load:

    shardserve plan --placement auto --models a=default,b=minilm --devices 4 --rate 10 --cv 3
    shardserve plan --placement dedicated --devices 2 --single-latency-ms 40 --slo-scale 3 --json
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any

from pydantic import AfterValidator, Field, model_validator

from shardserve.models.config import EncoderConfig
from shardserve.models.registry import MODEL_NAMES, resolve_model
from shardserve.partitioner.command import Command, Settings, at_least, split_list
from shardserve.partitioner.cost import UnitCost, analytic_costs, profile_costs
from shardserve.partitioner.fit import LayoutChoice
from shardserve.partitioner.layout_flags import LAYOUT_FIELDS, LAYOUT_SECTION, LayoutFlags
from shardserve.partitioner.placement.plan_command import PlacementFlags, cmd_placement
from shardserve.partitioner.plan import ParallelDims, default_devices, make_plan
from shardserve.partitioner.precision import DtypeChoice, resolve_dtype

logger = logging.getLogger(__name__)

MIB = 2**20


class PartitionSettings(LayoutFlags, Settings):
    """The flags ``plan`` and ``verify`` share: which model, split how (the layout flags,
    ``LayoutFlags``: ``pp``, ``tp``, ``max_memory_per_rank``, ``device``, ``dtype``), where."""

    model: str = Field(
        "default", description=f"registry name {MODEL_NAMES} or a local Hugging Face model directory"
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
        estimate of a ``batch_size x seq_len`` micro-batch (``LayoutFlags.choose_layout``):
        ``LayoutDoesNotFit`` (one line, exit 2) when it does not fit."""
        return self.choose_layout(
            {name: config},
            batch_size=batch_size,
            seq_len=seq_len,
            dtype=dtype,
            costs=None if costs is None else {name: costs},
            boundaries=self.boundaries,
            remedy=remedy,
        )


class PlanSettings(PartitionSettings, PlacementFlags):
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


def cmd_plan(args: PlanSettings) -> int:
    """``shardserve plan``: print the partition plan as a table, or as JSON (``--placement``: the
    multi-model placement, ``cmd_placement``)."""
    if args.placement is not None:
        # PlacementError / WorkloadError: one line (shardserve/errors.py)
        return cmd_placement(
            args,
            device=args.device,
            dtype=args.dtype,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            as_json=args.as_json,
        )
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


PLAN = Command(
    "plan",
    help="show how a model is split across ranks",
    description="Print the partition plan: stages, ranks, layers, parameters per rank, "
    "memory estimates for serving and training, and each stage's cost share. With --placement: "
    "the placement of several models on a pool of devices and its simulated SLO attainment.",
    settings=PlanSettings,
    run=cmd_plan,
    groups={LAYOUT_SECTION: LAYOUT_FIELDS},
)
