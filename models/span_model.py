"""``SpanModel``: what every QA model of shardserve shares, whichever code runs its layers.

The span head (``qa_outputs``, kept in fp32 whatever the compute dtype, with autocast off for it),
the cast to a compute dtype, the whole-model ``qa_logits`` convenience, and the defaults the
partitioner reads: which parts only the last stage holds, and, for tensor parallelism, no
grouped-query, fused or head-count specifics and no part every stage copies. ``EncoderForQA``
(``models/encoder.py``) and ``HFFamilyForQA`` (``models/hf_family.py``) build on it:

    logits = model.head(hidden)                    # (B, S, H) -> (B, S, 2) fp32
    start, end = model.qa_logits(input_ids, attention_mask)
"""

from __future__ import annotations

from typing import Self

import torch
from torch import nn


class SpanModel(nn.Module):
    """Shared by every QA model: the fp32 span head and the partitioner's defaults."""

    qa_outputs: nn.Linear | None
    head_modules: tuple[str, ...] = ("qa_outputs",)  # the parts only the last stage holds
    key_value_linears: tuple[str, ...] = ()  # as many key/value heads as query heads
    fused_linears: tuple[tuple[str, int], ...] = ()  # column linears holding several projections
    token_table = "word_embeddings"  # the vocabulary-parallel table, inside ``embeddings``

    def shard_heads(self, layer: nn.Module, tp: int) -> None:
        """Tell a tensor-parallel layer's attention how many heads this rank holds (nothing, when it
        reads them off its projections' widths)."""

    def stage_copies(self) -> nn.Module | None:
        """The part every pipeline stage holds a copy of, or None."""
        return None

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, H) -> (B, S, 2) span logits in fp32 whatever the compute dtype (the head is fp32)."""
        assert self.qa_outputs is not None
        with torch.autocast(x.device.type, enabled=False):
            return self.qa_outputs(x.float())

    def to_compute_dtype(self, dtype: torch.dtype) -> Self:
        """Cast the weights to ``dtype`` (activations follow), keeping the QA head in fp32."""
        self.to(dtype)
        if self.qa_outputs is not None:
            self.qa_outputs.float()
        return self

    def qa_logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole-model convenience: (B, S) ids -> start, end logits, each (B, S)."""
        logits = self(input_ids, attention_mask, token_type_ids)
        return logits[..., 0], logits[..., 1]
