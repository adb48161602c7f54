"""Decoders with a span (QA) head on transformers' own modules: Llama, Qwen2, Mistral.

``DecoderForQA`` (``models/hf_family.py`` builds it from the family's data) holds the token table
as ``embeddings.word_embeddings``, transformers' decoder layers, and, on the last stage, the final
norm and the span head. Each pipeline stage makes its own causal (or sliding-window, as the config
says per layer) mask and rotary angles from the padding mask, as transformers' model does (a packed
batch, ``models/packing.py``: each sequence's own mask and positions):

    model = DecoderForQA(resolve_model("tiny-llama").config)
    logits = model(input_ids, attention_mask)         # (B, S, 2) fp32

Under tensor parallelism query heads are split ``tp`` ways, key/value heads too when ``tp`` divides
them, else each rank keeps the one key/value head its query heads read.
"""

from __future__ import annotations

import torch
from torch import nn

from shardserve.models.hf_family import HFFamilyForQA
from shardserve.models.packing import attention_layout


class TokenEmbeddings(nn.Module):
    """The token table under the name every model of shardserve gives it (``word_embeddings``)."""

    def __init__(self, table: nn.Embedding) -> None:
        super().__init__()
        self.word_embeddings = table

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings(input_ids)  # (B, S) -> (B, S, H)


class DecoderForQA(HFFamilyForQA):
    """Token embeddings -> decoder layers (causal) -> final norm -> span head."""

    head_modules = ("final_norm", "qa_outputs")

    def take_parts(self, qa: nn.Module, base: nn.Module) -> None:
        self.embeddings: TokenEmbeddings | None = TokenEmbeddings(base.embed_tokens)
        self.final_norm: nn.Module | None = base.norm
        self.rotary = base.rotary_emb
        types = getattr(self.hf_config, "layer_types", None)
        sliding = getattr(self.hf_config, "sliding_window", None) is not None
        self.attention_kinds = {
            i: types[i] if types else ("sliding_attention" if sliding else "full_attention")
            for i in range(self.config.num_layers)
        }

    def fresh_buffers(self) -> None:
        self.fresh_rotary()

    def masks(self, x: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor) -> dict:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        makers = {
            "full_attention": create_causal_mask,
            "sliding_attention": create_sliding_window_causal_mask,
        }
        kinds = {self.attention_kinds[int(k)] for k in self.layers}
        # (config, inputs_embeds, attention_mask, cache) by position: the cache argument was named
        # past_key_values until transformers 5.2x, cache after
        args = (self.hf_config, x, attention_mask, None)
        return {kind: makers[kind](*args, position_ids=positions) for kind in kinds}

    def forward(
        self, x: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: (B, S) token ids when ``embeddings`` is present, else (B, S, H) hidden states.
        Returns (B, S, 2) fp32 span logits when ``qa_outputs`` is present, else (B, S, H)."""
        if self.embeddings is not None:
            x = self.embeddings(x)  # (B, S, H)
        layout = attention_layout(attention_mask, training=self.training, dtype=x.dtype)
        x, positions = self.pack(x, layout)  # (B, S, H), (1, S) or packed (1, T, H), (1, T)
        attention = self.attention_by_kind(x, attention_mask, positions, layout)
        angles = self.rotary(x, positions)  # (cos, sin), each (1, S|T, D)
        for key, block in self.layers.items():
            x = block(
                x, position_embeddings=angles, position_ids=positions, **attention[self.attention_kinds[int(key)]]
            )  # fmt: skip
        if self.qa_outputs is not None:
            assert self.final_norm is not None
            x = self.head(self.final_norm(x))  # (..., 2) fp32
        return self.unpack(x, layout)  # (B, S, H|2)
