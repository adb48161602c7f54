"""The attention kernel the families on transformers' modules run: transformers' own SDPA, and on a
packed batch (``models/packing.py``) that same SDPA once per sequence.

transformers' attention modules call the function registered under their config's
``_attn_implementation`` with the keyword arguments their layer was given. ``hf_config`` names this
kernel (``KERNEL``) for the decoders and ModernBERT; a layer of a packed batch receives
``packed_sequences`` (``PackedSequences``: each sequence's length and its mask on its own, as the
family's mask makers build it for a batch of one) and the kernel splits query, key and value
(1, heads, T, D) into them. Without ``packed_sequences`` (training, CUDA, ``torch.compile``, a batch
without padding) it is transformers' ``sdpa_attention_forward`` itself, mask and all.

    register()                                   # once per process, before a model runs
    layer(x, attention_mask=None, packed_sequences=PackedSequences([12, 5], [None, None]), ...)

Tests: ``pytest tests/models/test_hf_family.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KERNEL = "shardserve_sdpa"


@dataclass(frozen=True)
class PackedSequences:
    """The sequences of a packed batch, in order: their lengths, and each one's own attention mask
    for one attention kind (None: no mask, as SDPA's causal flag or no padding allows)."""

    lengths: list[int]
    masks: list[torch.Tensor | None]


def packed_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    packed_sequences: PackedSequences | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, once per sequence of a packed batch.

    query: (B, heads, S, D); key, value: (B, kv_heads, S, D); B = 1 and S = R (the real tokens, then
    spare rows) when packed.
    Returns ((B, S, heads, D), None), as transformers' kernels do."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed_sequences is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    lengths = packed_sequences.lengths
    tokens = sum(lengths)  # the rows after them are spare (``shardserve.models.packing.packed_rows``): zeros out
    splits = (t[:, :, :tokens].split(lengths, dim=2) for t in (query, key, value))  # (1, heads, L, D) each
    per_sequence = zip(*splits, packed_sequences.masks, strict=True)
    outs = [sdpa_attention_forward(module, q, k, v, mask, **kwargs)[0] for q, k, v, mask in per_sequence]
    spare = query.new_zeros(1, query.shape[2] - tokens, *outs[0].shape[2:])
    return torch.cat([*outs, spare], dim=1), None  # (1, R, heads, D)


def register() -> None:
    """Register ``KERNEL`` with transformers (attention, and SDPA's masks under the same name)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(KERNEL, packed_sdpa)
    AttentionMaskInterface.register(KERNEL, sdpa_mask)
