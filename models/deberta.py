"""DeBERTa-v2/v3 with a span (QA) head on transformers' own modules (disentangled relative attention).

``DebertaForQA`` (``models/hf_family.py`` builds it from the family's data) holds transformers'
embeddings (``embeddings.word_embeddings`` is the token table), its layers, the span head, and on
EVERY stage the relative-position table and its LayerNorm (``relative``: the encoder without its
layers, a few hundred thousand parameters every layer reads). Each stage makes the pairwise padding
mask and the relative positions from the padding mask, as transformers' encoder does:

    model = DebertaForQA(resolve_model("tiny-deberta-v2").config)
    logits = model(input_ids, attention_mask)         # (B, S, 2) fp32

Under tensor parallelism each rank's attention holds num_heads / tp heads, and projects the
relative-position table through its own slice of the key/query projections.

Inference runs padded, never packed (``models/packing.py``): transformers' attention module projects
the relative-position table (2 x 256 rows) through the key and query projections on every call, so
calling it once per sequence cost more than the padding it skips (11 % slower on the server's
micro-batches, docs/benchmarks.md, "Packed inference for the families").
"""

from __future__ import annotations

import torch
from torch import nn

from shardserve.models.hf_family import HFFamilyForQA


class DebertaForQA(HFFamilyForQA):
    """Embeddings -> DeBERTa layers (each reading the relative-position table) -> span head."""

    def take_parts(self, qa: nn.Module, base: nn.Module) -> None:
        self.embeddings: nn.Module | None = base.embeddings
        base.encoder.layer = nn.ModuleList()  # held in ``layers``
        self.relative = base.encoder  # rel_embeddings (+ LayerNorm), and the functions that read them

    def stage_copies(self) -> nn.Module:
        return self.relative

    def fresh_buffers(self) -> None:
        """The embeddings' position ids (a buffer no checkpoint holds)."""
        if self.embeddings is not None:
            ids = self.embeddings.position_ids
            self.embeddings.position_ids = torch.arange(ids.shape[1], device=ids.device).expand(1, -1)

    def forward(
        self, x: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: (B, S) token ids when ``embeddings`` is present, else (B, S, H) hidden states.
        Returns (B, S, 2) fp32 span logits when ``qa_outputs`` is present, else (B, S, H)."""
        if self.embeddings is not None:
            types = token_type_ids if self.config.uses_token_types else None
            x = self.embeddings(input_ids=x, token_type_ids=types, mask=attention_mask)  # (B, S, H)
        pairs = self.relative.get_attention_mask(attention_mask)  # (B, 1, S, S)
        positions = self.relative.get_rel_pos(x)  # (1, S, S) relative distances (bucketed)
        table = self.relative.get_rel_embedding()  # (2 * buckets, H)
        for block in self.layers.values():
            x = block(x, pairs, relative_pos=positions, rel_embeddings=table)[0]
        return x if self.qa_outputs is None else self.head(x)  # (B, S, 2) fp32
