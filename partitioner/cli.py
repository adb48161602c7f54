"""``shardserve plan``: how a model is split across ranks; the flags ``plan`` and ``verify`` share.

``PLAN`` is the command as data (the console script generates its flags from ``PlanSettings``);
``PartitionSettings`` (model, pp, tp, device, dtype, boundaries) is also the base of ``verify``'s
settings (``partitioner/stream/verify_command.py``).

    shardserve plan --model minilm --pp 2 --tp 2 --batch-size 8 --seq-len 384
    shardserve plan --model tiny-bert --pp 3 --json
    shardserve plan --model minilm --dp 2 --pp 2 --batch-size 4 --seq-len 256   # training: 4 ranks
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from models.registry import MODEL_NAMES, resolve_model
from partitioner.command import Command, Settings, at_least, split_list
from partitioner.cost import analytic_costs, profile_costs
from partitioner.plan import ParallelDims, default_devices, make_plan
from partitioner.precision import DTYPE_CHOICES, resolve_dtype

logger = logging.getLogger(__name__)


class PartitionSettings(Settings):
    """The flags ``plan`` and ``verify`` share: which model, split how, where."""

    model: str = Field(
        "default", description=f"registry name {MODEL_NAMES} or a local Hugging Face model directory"
    )
    pp: int = Field(1, description="pipeline-parallel degree: number of stages")
    tp: int = Field(1, description="tensor-parallel degree: ranks per stage sharing heads and MLP")
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


class PlanSettings(PartitionSettings):
    """``shardserve plan``."""

    dp: int = Field(
        1,
        description="training only: data-parallel copies of the pipeline; adds the gradient all-reduce "
        "volume per step",
    )
    batch_size: Annotated[int, AfterValidator(at_least(1))] = Field(
        8, description="micro-batch size for memory estimates"
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
    """``shardserve plan``: print the partition plan as a table, or as JSON."""
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
    dims = ParallelDims(pp=args.pp, tp=args.tp, dp=args.dp)
    plan = make_plan(
        cfg,
        dims,
        boundaries=args.boundaries,
        costs=costs,
        cost_source=how,
        devices=default_devices(dims.world_size, device=args.device),
    )
    choice = resolve_dtype(args.dtype, plan.devices[0])
    mem = plan.memory_estimates(
        cfg, batch_size=args.batch_size, seq_len=args.seq_len, dtype_bytes=choice.itemsize
    )
    if args.as_json:
        out = plan.to_dict()
        out["model"] = source.describe()
        out["dtype"] = choice.name
        for s, m in zip(out["stages"], mem, strict=True):
            s.update(m)
        print(json.dumps(out, indent=2))
        return 0
    dp = f"dp={args.dp} " if args.dp > 1 else ""
    print(
        f"model {source.name}: {cfg.arch}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_heads} heads; {dp}pp={args.pp} tp={args.tp} ({plan.dims.world_size} ranks); "
        f"cost: {plan.cost_source}; memory at batch {args.batch_size} x seq {args.seq_len}, {choice.name} "
        f"(training: fp32 weights + Adam, 16 B/param)"
    )
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
    "memory estimates for serving and training, and each stage's cost share.",
    settings=PlanSettings,
    run=cmd_plan,
)
