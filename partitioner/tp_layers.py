"""Megatron-style tensor-parallel layers.

With ``t`` ranks and a linear map ``Y = X A + b`` (A: in x out):

ColumnParallelLinear splits A by columns, ``A = [A_1 … A_t]``; rank i computes
``Y_i = X A_i + b_i`` and keeps its slice of the output (for attention: its heads; for the MLP:
its slice of the intermediate). Input enters through ``copy_to_tp``.

RowParallelLinear splits A by rows, ``A = [A_1; …; A_t]``, and takes the matching input slice
``X_i``; ``Y = Σ_i X_i A_i + b`` needs one all-reduce (``reduce_from_tp``), after which the
(replicated) bias is added once.

VocabParallelEmbedding splits the vocabulary; each rank looks up the ids in its range, zeroes the
rest, and an all-reduce sums the partial embeddings.

Weights use ``nn.Linear``'s (out, in) layout; Column and Row share one constructor
(``_ParallelLinear``, split along dim 0 or 1). ``shard_specs`` tells the shard loader
(``partitioner/shard_loading.py``) which slice of the full checkpoint tensor each parameter holds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardserve.partitioner.collectives import copy_to_tp, reduce_from_tp
from shardserve.partitioner.shard_loading import ShardSlice


def shard_range(size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(start, length) of rank ``tp_rank``'s contiguous part of ``size`` items (last part may be short)."""
    per = -(-size // tp_size)
    start = min(size, tp_rank * per)
    return start, max(0, min(per, size - start))


class _ParallelLinear(nn.Module):
    """The constructor Column/Row share: an ``nn.Linear``-layout (out, in) weight split ``tp`` ways
    along ``split_dim`` (0: output rows, 1: input columns). The bias is split with the output and
    replicated otherwise; ``shard_specs`` names each sharded parameter's slice of the full tensor."""

    split_dim: int

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_rank: int,
        tp_size: int,
        group: dist.ProcessGroup | None,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        parts: int | None = None,
        blocks: int = 1,
    ) -> None:
        super().__init__()
        # ``parts`` < tp (key/value heads fewer than the ranks): the weight is cut into ``parts``
        # pieces and rank r holds piece r * parts // tp (a piece is replicated on tp / parts ranks).
        # ``blocks`` > 1 (a fused projection, e.g. query/key/value in one matrix): each of that many
        # blocks is cut so, and the rank holds its piece of every block, in block order.
        parts = parts or tp_size
        full = [out_features, in_features]
        size = full[self.split_dim] // blocks
        if full[self.split_dim] % blocks or size % parts or (parts < tp_size and tp_size % parts):
            name = ("out_features", "in_features")[self.split_dim]
            raise ValueError(
                f"{name}={full[self.split_dim]} not divisible by tp={tp_size} ({blocks} block(s) of {parts} parts)"
            )
        self.group = group
        local = size // parts
        shape = list(full)
        shape[self.split_dim] = local * blocks  # (out / tp, in) or (out, in / tp)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(shape[0], device=device, dtype=dtype)) if bias else None
        spec = ShardSlice(self.split_dim, tp_rank * parts // tp_size * local, local, blocks)
        self.shard_specs = {"weight": spec, **({"bias": spec} if self.split_dim == 0 else {})}


class ColumnParallelLinear(_ParallelLinear):
    """Y_i = X A_i + b_i; output stays sharded along the last dimension."""

    split_dim = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (..., in) replicated -> (..., out / tp)
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(_ParallelLinear):
    """Y = all_reduce(X_i A_i) + b; input arrives sharded along its last dimension."""

    split_dim = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (..., in / tp) -> (..., out) replicated
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows across the tensor-parallel ranks."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_rank: int,
        tp_size: int,
        group: dist.ProcessGroup | None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.vocab_start, length = shard_range(num_embeddings, tp_rank, tp_size)
        self.vocab_end = self.vocab_start + length
        self.weight = nn.Parameter(torch.empty(length, embedding_dim, device=device, dtype=dtype))
        self.shard_specs = {"weight": ShardSlice(0, self.vocab_start, length)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: (B, S) -> (B, S, H)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        emb = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(emb, self.group)
