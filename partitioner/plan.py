"""``ParallelDims`` and ``PartitionPlan``: the one definition of how a model is split.

Ranks are laid out as Megatron does, tp innermost, then pp, then dp:
``rank = dp_rank * pp * tp + stage * tp + tp_rank``. The stages' ``ranks`` are those of pipeline
replica 0 (``0 .. pp*tp-1``); training at ``dp > 1`` runs ``dp`` such replicas side by side, and
serving keeps ``dp == 1`` (a serving replica is its own data-parallel copy). Stage ``k`` owns
encoder layers ``[layer_start, layer_end)``; stage 0 also owns the embeddings and the last stage the QA head.
Inside a stage, the ``tp`` ranks shard attention heads, the MLP and the word embeddings
Megatron-style (see ``partitioner/tensor_parallel.py``).

    plan = make_plan(config, ParallelDims(pp=2, tp=2))                    # balanced by cost model
    plan = make_plan(config, ParallelDims(pp=2, tp=1), boundaries=[4])    # manual: layers [0,4) [4,L)
    plan = make_plan(config, ParallelDims(dp=2, pp=2))                   # training: 4 ranks, 2 copies
    plan.to_dict()  # JSON-friendly, used by `shardserve plan --json` and the gang runtime
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Any

from shardserve.models.config import EncoderConfig
from shardserve.partitioner.cost import (
    RANK_RUNTIME_BYTES,
    InfeasiblePlanError,
    UnitCost,
    analytic_costs,
    balanced_split,
    ring_allreduce_bytes,
    serving_memory_bytes,
    stage_costs,
    stage_param_counts,
    training_memory_bytes,
)


@dataclass(frozen=True)
class ParallelDims:
    """Pipeline (pp), tensor-parallel (tp) and data-parallel (dp) degrees; ``world_size = dp * pp * tp``.

    ``coords``/``rank_of`` speak of a rank's place inside its pipeline replica (stage, tp_rank);
    ``dp_rank`` says which replica. With ``dp == 1`` (serving, and training without --dp) every
    formula reduces to the stage-major ``rank = stage * tp + tp_rank`` of a single gang.
    """

    pp: int = 1
    tp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        if self.pp < 1 or self.tp < 1 or self.dp < 1:
            raise InfeasiblePlanError(f"dp={self.dp}, pp={self.pp} and tp={self.tp} must all be >= 1")

    @property
    def model_parallel_size(self) -> int:
        """Ranks of one pipeline replica: ``pp * tp``."""
        return self.pp * self.tp

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def validate_for(self, config: EncoderConfig) -> None:
        """Reject degrees the model cannot be split into, printing the numbers."""
        if config.num_heads % self.tp:
            raise InfeasiblePlanError(f"tp={self.tp} does not divide num_attention_heads={config.num_heads}")
        kv = config.num_kv_heads
        if (kv % self.tp if self.tp <= kv else self.tp % kv) and kv != config.num_heads:
            raise InfeasiblePlanError(
                f"tp={self.tp} neither divides num_key_value_heads={kv} nor is a multiple of it"
            )
        if config.intermediate_size % self.tp:
            raise InfeasiblePlanError(
                f"tp={self.tp} does not divide intermediate_size={config.intermediate_size}"
            )
        if self.pp > config.num_layers:
            raise InfeasiblePlanError(
                f"pp={self.pp} stages need at least one layer each, but num_layers={config.num_layers}"
            )

    def validate_world(self, world_size: int, *, n_devices: int | None = None) -> None:
        """``dp x pp x tp`` must equal the ranks launched (and fit the devices given), with numbers."""
        if world_size != self.world_size:
            raise InfeasiblePlanError(
                f"dp={self.dp} x pp={self.pp} x tp={self.tp} = {self.world_size} ranks, "
                f"but the world has {world_size}"
            )
        if n_devices is not None and n_devices != self.world_size:
            raise InfeasiblePlanError(
                f"{n_devices} devices given for dp={self.dp} x pp={self.pp} x tp={self.tp} = "
                f"{self.world_size} ranks"
            )

    def coords(self, rank: int) -> tuple[int, int]:
        """Global rank -> (stage, tp_rank) inside its pipeline replica."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} outside world_size={self.world_size}")
        return divmod(rank % self.model_parallel_size, self.tp)

    def dp_rank(self, rank: int) -> int:
        """Global rank -> index of its data-parallel replica."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} outside world_size={self.world_size}")
        return rank // self.model_parallel_size

    def rank_of(self, stage: int, tp_rank: int, dp_rank: int = 0) -> int:
        return dp_rank * self.model_parallel_size + stage * self.tp + tp_rank

    def dp_groups(self) -> list[list[int]]:
        """Ranks holding the same parameter shard (same stage and tp_rank), one list per shard."""
        mp = self.model_parallel_size
        return [[d * mp + r for d in range(self.dp)] for r in range(mp)]

    def model_parallel_groups(self) -> list[list[int]]:
        """The ``pp * tp`` ranks of each pipeline replica, one list per dp rank."""
        mp = self.model_parallel_size
        return [list(range(d * mp, (d + 1) * mp)) for d in range(self.dp)]


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: its layer range, ranks, and the cost model's view of it."""

    index: int
    layer_start: int
    layer_end: int
    ranks: tuple[int, ...]
    has_embeddings: bool
    has_head: bool
    params_per_rank: int
    cost: float
    cost_share: float

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)


@dataclass(frozen=True)
class PartitionPlan:
    """Stages, tensor-parallel degree and devices for one gang of ``dp * pp * tp`` ranks (stage
    ``ranks`` are those of replica 0; replica ``d`` adds ``d * pp * tp``)."""

    dims: ParallelDims
    stages: tuple[StageSpec, ...]
    devices: tuple[str, ...]  # per global rank
    num_layers: int
    cost_source: str  # "analytic", "profile" or "manual"

    def stage_of(self, rank: int) -> StageSpec:
        return self.stages[self.dims.coords(rank)[0]]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dp": self.dims.dp} if self.dims.dp > 1 else {}
        return out | {
            "pp": self.dims.pp,
            "tp": self.dims.tp,
            "world_size": self.dims.world_size,
            "num_layers": self.num_layers,
            "cost_source": self.cost_source,
            "devices": list(self.devices),
            "stages": [{**asdict(s), "ranks": list(s.ranks)} for s in self.stages],
        }

    def memory_estimates(
        self, config: EncoderConfig, *, batch_size: int, seq_len: int, dtype_bytes: int = 4
    ) -> list[dict[str, int]]:
        """Per stage, bytes on one rank (its process's runtime included) for serving and for training
        at this batch/sequence, and for ``dp > 1`` the gradient bytes each rank sends (and receives) per optimizer step in the ring
        all-reduce over its data-parallel group: ``2 (dp - 1) / dp`` x its fp32 gradients (full
        fine-tuning). Training memory is the same at every dp: AdamW state is replicated (no ZeRO)."""
        out = []
        for s in self.stages:
            kw = dict(n_layers=len(s.layers), batch_size=batch_size, seq_len=seq_len, tp=self.dims.tp)
            out.append(
                {
                    "serving_bytes": RANK_RUNTIME_BYTES
                    + serving_memory_bytes(s.params_per_rank, config, dtype_bytes=dtype_bytes, **kw),
                    "training_bytes": RANK_RUNTIME_BYTES
                    + training_memory_bytes(
                        s.params_per_rank,
                        config,
                        stage_index=s.index,
                        pp=self.dims.pp,
                        dtype_bytes=dtype_bytes,
                        **kw,
                    ),
                    "allreduce_bytes": ring_allreduce_bytes(4 * s.params_per_rank, self.dims.dp),
                }
            )
        return out


def default_devices(world_size: int, *, device: str = "cpu") -> tuple[str, ...]:
    """``cpu`` for every rank, or ``cuda:i`` round-robin over the visible GPUs."""
    if device == "cpu":
        return ("cpu",) * world_size
    import torch

    n = torch.cuda.device_count()
    if n == 0:
        raise InfeasiblePlanError(f"device={device!r} requested but torch.cuda.device_count() is 0")
    return tuple(f"cuda:{r % n}" for r in range(world_size))


def make_plan(
    config: EncoderConfig,
    dims: ParallelDims,
    *,
    boundaries: list[int] | None = None,
    costs: list[UnitCost] | None = None,
    cost_source: str = "analytic",
    seq_len: int = 384,
    devices: tuple[str, ...] | None = None,
) -> PartitionPlan:
    """Build a validated plan.

    ``boundaries`` (manual override): the first layer of stages 1..pp-1, strictly increasing.
    Otherwise layers are split by ``balanced_split`` over ``costs`` (analytic at ``seq_len`` when
    not given).
    """
    dims.validate_for(config)
    costs = costs if costs is not None else analytic_costs(config, seq_len=seq_len)
    if len(costs) != config.num_layers + 2:
        raise InfeasiblePlanError(f"{len(costs)} unit costs for num_layers={config.num_layers} (need L+2)")
    if boundaries is not None:
        cuts = [0, *boundaries, config.num_layers]
        if len(boundaries) != dims.pp - 1 or any(b <= a for a, b in itertools.pairwise(cuts)):
            raise InfeasiblePlanError(
                f"boundaries={boundaries} must be pp-1={dims.pp - 1} strictly increasing layer indices "
                f"in 1..{config.num_layers - 1}"
            )
        bounds = list(itertools.pairwise(cuts))
        cost_source = "manual"
    else:
        bounds = balanced_split(costs, dims.pp)
    devices = devices or default_devices(dims.world_size)
    dims.validate_world(dims.world_size, n_devices=len(devices))
    per_stage_cost = stage_costs(costs, bounds)
    total = sum(per_stage_cost) or 1.0
    params = stage_param_counts(costs, bounds, dims.tp)
    stages = tuple(
        StageSpec(
            index=k,
            layer_start=a,
            layer_end=b,
            ranks=tuple(dims.rank_of(k, t) for t in range(dims.tp)),
            has_embeddings=k == 0,
            has_head=k == dims.pp - 1,
            params_per_rank=params[k],
            cost=per_stage_cost[k],
            cost_share=per_stage_cost[k] / total,
        )
        for k, (a, b) in enumerate(bounds)
    )
    return PartitionPlan(dims, stages, tuple(devices), config.num_layers, cost_source)
