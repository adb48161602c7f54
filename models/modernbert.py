"""ModernBERT with a span (QA) head on transformers' own modules: rotary positions, GeGLU, and
global attention every few layers with local (sliding-window) attention between, over long windows.

``ModernBertForQA`` (``models/hf_family.py`` builds it from the family's data) holds transformers'
embeddings (token table + norm), its layers, and on the last stage the final norm, the prediction
head (dense, activation, norm) and the span classifier (``qa_outputs``). Each stage makes its own
bidirectional masks (global and sliding-window) and rotary angles per attention kind from the
padding mask, as transformers' model does (a packed batch, ``models/packing.py``: each sequence's
own masks and positions); a window may be as long as the model's positions (8192 for the released
checkpoints):

    model = ModernBertForQA(resolve_model("tiny-modernbert").config)
    logits = model(input_ids, attention_mask)         # (B, S, 2) fp32

Its query/key/value and gate/up projections are fused into one Linear each (``Wqkv``, ``Wi``): under
tensor parallelism each rank holds its slice of every block of them (its heads' queries, keys and
values; its units' inputs and gates), and transformers' own views split them as before.
"""

from __future__ import annotations

import torch
from torch import nn

from shardserve.models.hf_family import HFFamilyForQA
from shardserve.models.packing import attention_layout


class ModernBertForQA(HFFamilyForQA):
    """Embeddings -> ModernBERT layers (global / local attention) -> final norm, head -> span logits."""

    head_modules = ("final_norm", "head_transform", "qa_outputs")

    def take_parts(self, qa: nn.Module, base: nn.Module) -> None:
        self.embeddings: nn.Module | None = base.embeddings
        self.final_norm: nn.Module | None = base.final_norm
        self.head_transform: nn.Module | None = qa.head  # dense, activation, norm
        self.rotary = base.rotary_emb

    def fresh_buffers(self) -> None:
        self.fresh_rotary()  # one table per attention kind

    def masks(self, x: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor) -> dict:
        from transformers.masking_utils import (
            create_bidirectional_mask,
            create_bidirectional_sliding_window_mask,
        )

        makers = {
            "full_attention": create_bidirectional_mask,
            "sliding_attention": create_bidirectional_sliding_window_mask,
        }
        kinds = {block.attention_type for block in self.layers.values()}
        kw = dict(config=self.hf_config, inputs_embeds=x, attention_mask=attention_mask)
        return {kind: makers[kind](**kw) for kind in kinds}

    def forward(
        self, x: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: (B, S) token ids when ``embeddings`` is present, else (B, S, H) hidden states.
        Returns (B, S, 2) fp32 span logits when ``qa_outputs`` is present, else (B, S, H)."""
        if self.embeddings is not None:
            x = self.embeddings(input_ids=x)  # (B, S, H)
        layout = attention_layout(attention_mask, training=self.training, dtype=x.dtype)
        x, positions = self.pack(x, layout)  # (B, S, H), (1, S) or packed (1, T, H), (1, T)
        attention = self.attention_by_kind(x, attention_mask, positions, layout)
        angles = {kind: self.rotary(x, positions, kind) for kind in attention}  # (cos, sin), each (1, S|T, D)
        for block in self.layers.values():
            kind = block.attention_type
            x = block(x, position_embeddings=angles[kind], **attention[kind])
        if self.qa_outputs is not None:
            assert self.final_norm is not None and self.head_transform is not None
            x = self.head(self.head_transform(self.final_norm(x)))  # (..., 2) fp32
        return self.unpack(x, layout)  # (B, S, H|2)
