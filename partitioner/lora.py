"""LoRA adapters on the encoder's projections, tensor-parallel aware, plus layer freezing.

``apply_lora(stage, rank=r, alpha=a, targets=..., seed=s)`` adds two trainable factors to every
targeted linear of a (possibly partial, possibly sharded) stage, after its weights are loaded:
``y = base(x) + (alpha / r) * x A^T B^T`` with ``A: (r, in)`` and ``B: (out, r)`` (B starts at zero,
so the adapted model equals the base model at step 0). The factors are registered on the linear
itself as ``lora_A`` / ``lora_B``, so their names are the canonical names plus a suffix
(``layers.3.attention.query.lora_A``), which is also how the shipped overlay names them.

Tensor parallelism (Megatron layout, see ``partitioner/tp_layers.py``):

- column-parallel base (``W_i``: out/t rows): ``A`` replicated, ``B`` sharded by output rows.
  ``h = x A^T`` is identical on every rank; it enters ``B_i`` through ``copy_to_tp`` so the
  gradient of ``h`` (hence of ``A``) is the sum of every rank's partial gradient.
- row-parallel base (``W_i``: in/t columns, input ``x_i`` sharded): ``A`` sharded by input columns,
  ``B`` replicated. ``h = all_reduce(x_i A_i^T)`` (an r-wide all-reduce, ``reduce_from_tp``), then
  ``h B^T`` is added to the (already reduced) output, identically on every rank.

Initial ``A`` is drawn from a generator seeded by (seed, parameter name) over the FULL shape and
then sliced, so every (pp, tp) layout starts from the same adapter. ``shard_specs`` of the linear
gain the factors' slices, so the checkpoint gatherer treats them like any other sharded tensor
(and ``partitioner/shard_loading.py`` reads overlay factors slice by slice).

    n = apply_lora(stage, rank=16, alpha=32.0, seed=0)     # targets: lora_targets(stage)
    merged = merged_state_dict(stage)          # W + (alpha/r) B A per linear, local shards
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from shardserve.models.build import QAModel
from shardserve.partitioner.collectives import copy_to_tp, reduce_from_tp
from shardserve.partitioner.shard_loading import ShardSlice
from shardserve.partitioner.tp_layers import ColumnParallelLinear, RowParallelLinear


def lora_targets(model: QAModel) -> tuple[str, ...]:
    """The projections LoRA adapts by default: every linear tensor parallelism shards (q, k, v, out
    and the MLP's), named inside a layer."""
    return (*model.column_linears, *model.row_linears)


def _name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _tp_size(module: nn.Module) -> int:
    group = getattr(module, "group", None)
    return 1 if group is None else dist.get_world_size(group)


def _tp_rank(module: nn.Module) -> int:
    group = getattr(module, "group", None)
    return 0 if group is None else dist.get_rank(group)


class _LoRAHook:
    """Forward hook adding the low-rank update to a linear's output (picklable-free, per module)."""

    def __init__(self, scale: float, kind: str) -> None:
        self.scale = scale
        self.kind = kind  # "plain", "column" or "row"

    def __call__(
        self, module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor
    ) -> torch.Tensor:
        x = inputs[0]  # (..., in) or (..., in/t) for row-parallel
        a, b = module.lora_A, module.lora_B
        group = getattr(module, "group", None)
        if self.kind == "row":
            h = reduce_from_tp(x @ a.t(), group)  # (..., r), summed over the input shards
        else:
            h = x @ a.t()  # (..., r), identical on every tp rank
            if self.kind == "column":
                h = copy_to_tp(h, group)  # backward: sum the partial grads of h over tp ranks
        return out + self.scale * (h @ b.t())  # (..., out) or (..., out/t)


def apply_lora(
    stage: QAModel,
    *,
    rank: int,
    alpha: float,
    targets: Sequence[str] | None = None,
    seed: int = 0,
) -> int:
    """Add LoRA factors to every targeted linear of ``stage``; returns how many linears got one."""
    if rank < 1:
        raise ValueError(f"LoRA rank={rank} must be >= 1")
    count = 0
    for lname, layer in stage.layers.items():
        for target in targets or lora_targets(stage):
            module = layer.get_submodule(target)
            canonical = f"layers.{lname}.{target}"
            w = module.weight
            tp, tp_rank = _tp_size(module), _tp_rank(module)
            if isinstance(module, ColumnParallelLinear):
                kind, full_in, full_out = "column", w.shape[1], w.shape[0] * tp
            elif isinstance(module, RowParallelLinear):
                kind, full_in, full_out = "row", w.shape[1] * tp, w.shape[0]
            else:
                kind, full_in, full_out = "plain", w.shape[1], w.shape[0]
            gen = torch.Generator().manual_seed(_name_seed(seed, canonical + ".lora_A"))
            bound = 1.0 / math.sqrt(full_in)
            a_full = torch.empty(rank, full_in).uniform_(-bound, bound, generator=gen)  # (r, in)
            specs = dict(getattr(module, "shard_specs", {}))
            if kind == "row":
                local = w.shape[1]
                a = a_full.narrow(1, tp_rank * local, local)  # (r, in/t)
                b = torch.zeros(full_out, rank)  # (out, r), replicated
                specs["lora_A"] = ShardSlice(1, tp_rank * local, local)
            elif kind == "column":
                local = w.shape[0]
                a = a_full  # (r, in), replicated
                b = torch.zeros(local, rank)  # (out/t, r)
                specs["lora_B"] = module.shard_specs["weight"]  # the weight's rows (of every block, if fused)
            else:
                a, b = a_full, torch.zeros(full_out, rank)
            module.lora_A = nn.Parameter(a.to(device=w.device, dtype=w.dtype).contiguous())
            module.lora_B = nn.Parameter(b.to(device=w.device, dtype=w.dtype))
            module.lora_scale = alpha / rank
            if specs:
                module.shard_specs = specs
            module.register_forward_hook(_LoRAHook(alpha / rank, kind))
            count += 1
    return count


def freeze_for_peft(
    stage: QAModel, *, freeze_layers: int, lora: bool, freeze_embeddings: bool = False
) -> None:
    """Set ``requires_grad``: with LoRA only the factors, biases, LayerNorms and the QA head train
    (embeddings and base matrices are frozen); with ``freeze_layers=k`` the embeddings and layers
    ``< k`` are frozen; ``freeze_embeddings`` freezes the embeddings alone. They may be combined
    (LoRA only above the frozen layers trains)."""
    for name, p in stage.named_parameters():
        trainable = True
        if lora and not name.startswith("qa_outputs."):
            is_factor = name.endswith((".lora_A", ".lora_B"))
            is_small = name.endswith(".bias") or "norm" in name.split(".")[-2].lower()
            trainable = (is_factor or is_small) and not name.startswith("embeddings.")
        if name.startswith("embeddings.") and (freeze_embeddings or freeze_layers > 0):
            trainable = False
        elif name.startswith("layers.") and int(name.split(".")[1]) < freeze_layers:
            trainable = False
        p.requires_grad_(trainable)


@torch.no_grad()
def merged_state_dict(stage: nn.Module) -> dict[str, torch.Tensor]:
    """The stage's local state with every LoRA update folded into its base weight (no factors)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in stage.named_parameters():
        if name.endswith((".lora_A", ".lora_B")):
            continue
        owner_name, _, local = name.rpartition(".")
        owner = stage.get_submodule(owner_name)
        t = p.detach()
        if local == "weight" and hasattr(owner, "lora_A"):
            t = t + owner.lora_scale * (owner.lora_B @ owner.lora_A)  # (out_l, r) @ (r, in_l)
        out[name] = t.clone()
    return out
