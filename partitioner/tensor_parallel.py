"""``apply_tensor_parallel``: turn a plain ``EncoderForQA`` (or a stage of it) tensor-parallel.

One short transform applied after the model is built (on the meta device, before loading):
Q/K/V and the MLP up-projection become column-parallel (each rank keeps num_heads/tp heads and
intermediate/tp units), the attention output and MLP down-projection row-parallel (one all-reduce
after each block), and the word embeddings vocab-parallel. LayerNorms, position/type embeddings and
the QA head stay replicated. With ``tp_size == 1`` the model is returned untouched.

    stage = apply_tensor_parallel(stage, tp_rank=r, tp_size=2, group=tp_group)
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from models.encoder import EncoderForQA
from partitioner.tp_layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


def _swap_linear(
    old: nn.Linear,
    cls: type[ColumnParallelLinear | RowParallelLinear],
    *,
    tp_rank: int,
    tp_size: int,
    group: dist.ProcessGroup | None,
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
    )


def apply_tensor_parallel(
    model: EncoderForQA, *, tp_rank: int, tp_size: int, group: dist.ProcessGroup | None
) -> EncoderForQA:
    """Replace the model's linears/embeddings by sharded ones (new, uninitialised parameters)."""
    if tp_size == 1:
        return model
    kw = dict(tp_rank=tp_rank, tp_size=tp_size, group=group)
    for layer in {id(m): m for m in model.layers.values()}.values():  # a shared layer (ALBERT) once
        attn, mlp = layer.attention, layer.mlp
        attn.query = _swap_linear(attn.query, ColumnParallelLinear, **kw)
        attn.key = _swap_linear(attn.key, ColumnParallelLinear, **kw)
        attn.value = _swap_linear(attn.value, ColumnParallelLinear, **kw)
        attn.out = _swap_linear(attn.out, RowParallelLinear, **kw)
        mlp.up = _swap_linear(mlp.up, ColumnParallelLinear, **kw)
        mlp.down = _swap_linear(mlp.down, RowParallelLinear, **kw)
    if model.embeddings is not None:
        old = model.embeddings.word_embeddings
        model.embeddings.word_embeddings = VocabParallelEmbedding(
            old.num_embeddings, old.embedding_dim, device=old.weight.device, dtype=old.weight.dtype, **kw
        )
    return model
