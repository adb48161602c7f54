"""``apply_tensor_parallel``: turn a plain QA model (or a stage of it) tensor-parallel.

One short transform applied after the model is built (on the meta device, before loading): the
linears a model names as ``column_linears`` (Q/K/V, the MLP's up and gate projections) become
column-parallel (each rank keeps num_heads/tp heads and intermediate/tp units), its
``row_linears`` (attention output, MLP down-projection) row-parallel (one all-reduce after each
block), and the word embeddings vocab-parallel. Grouped-query attention splits its key/value heads
``tp`` ways too, or, with fewer of them than ranks, gives each rank the one its query heads read.
A fused projection (``fused_linears``: ModernBERT's query/key/value in one matrix, its gate and up
in another) is split block by block: each rank holds its slice of every block, in block order.
Norms, position/type embeddings and the QA head stay replicated. With ``tp_size == 1`` the model
is returned untouched.

    stage = apply_tensor_parallel(stage, tp_rank=r, tp_size=2, group=tp_group)
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from shardserve.models.build import QAModel
from shardserve.partitioner.tp_layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


def _swap_linear(
    old: nn.Linear,
    cls: type[ColumnParallelLinear | RowParallelLinear],
    *,
    tp_rank: int,
    tp_size: int,
    group: dist.ProcessGroup | None,
    parts: int | None = None,
    blocks: int = 1,
) -> nn.Module:
    """A sharded ``cls`` with ``old``'s shape, bias, device and dtype (parameters uninitialised)."""
    return cls(
        old.in_features,
        old.out_features,
        tp_rank=tp_rank,
        tp_size=tp_size,
        group=group,
        bias=old.bias is not None,
        device=old.weight.device,
        dtype=old.weight.dtype,
        parts=parts,
        blocks=blocks,
    )


def _swap(layer: nn.Module, name: str, cls: type[ColumnParallelLinear | RowParallelLinear], **kw) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = layer.get_submodule(owner_name)
    setattr(owner, attr, _swap_linear(getattr(owner, attr), cls, **kw))


def apply_tensor_parallel(
    model: QAModel, *, tp_rank: int, tp_size: int, group: dist.ProcessGroup | None
) -> QAModel:
    """Replace the model's linears/embeddings by sharded ones (new, uninitialised parameters)."""
    if tp_size == 1:
        return model
    kw = dict(tp_rank=tp_rank, tp_size=tp_size, group=group)
    kv_parts = min(model.config.num_kv_heads, tp_size)  # fewer key/value heads than ranks: one each, shared
    for layer in {id(m): m for m in model.layers.values()}.values():  # a shared layer (ALBERT) once
        for name in model.column_linears:
            parts = kv_parts if name in model.key_value_linears else None
            blocks = dict(model.fused_linears).get(name, 1)
            _swap(layer, name, ColumnParallelLinear, parts=parts, blocks=blocks, **kw)
        for name in model.row_linears:
            _swap(layer, name, RowParallelLinear, **kw)
        model.shard_heads(layer, tp_size)
    if model.embeddings is not None:
        old = getattr(model.embeddings, model.token_table)
        setattr(
            model.embeddings,
            model.token_table,
            VocabParallelEmbedding(
                old.num_embeddings, old.embedding_dim, device=old.weight.device, dtype=old.weight.dtype, **kw
            ),
        )
    return model
