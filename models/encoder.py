"""Plain single-device BERT-family encoder with an extractive-QA (start/end span) head.

One module covers BERT, RoBERTa, XLM-RoBERTa, ELECTRA, ALBERT and DistilBERT (all post-LayerNorm
encoders); the differences are in the embeddings (token types, RoBERTa's padding-offset positions,
ELECTRA's and ALBERT's narrower tables and their projection to the hidden size) and in ALBERT's one
layer shared by every index of ``layers`` (the same module under each key), driven by ``EncoderConfig``. Parameter names are this project's canonical names; ``models/hf_weights.py``
maps them to and from Hugging Face checkpoint names.

The model knows nothing about parallelism. ``partitioner/`` may set ``embeddings`` or
``qa_outputs`` to ``None`` and drop entries of ``layers`` (a ``ModuleDict`` keyed by the global
layer index) to make a pipeline stage, and may swap ``nn.Linear``/``nn.Embedding`` for sharded
versions; ``forward`` then maps whatever it receives through whatever parts it still has:

    model = EncoderForQA(config)
    start_logits, end_logits = model.qa_logits(input_ids, attention_mask)   # each (B, S)

Inference on the CPU runs a padded batch packed: the layers see only the real tokens, (T, H), and
each sequence attends to itself alone (``models/packing.py`` chooses and owns the layouts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.models.config import EncoderConfig
from shardserve.models.packing import AttentionLayout, attention_layout
from shardserve.models.span_model import SpanModel


def activation_fn(name: str):
    """The MLP activation named by a Hugging Face config."""
    if name == "gelu":
        return F.gelu
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu
    raise ValueError(f"unsupported activation {name!r}")


def _embedding(rows: int, config: EncoderConfig) -> nn.Embedding:
    """nn.Embedding whose random init is skipped on the meta device (it costs ~1 s of lazy imports there)."""
    weight = torch.empty(rows, config.embedding_size)
    if not weight.is_meta:
        nn.init.normal_(weight, 0.0, config.initializer_range)
    return nn.Embedding(rows, config.embedding_size, _weight=weight)


class Embeddings(nn.Module):
    """word + position (+ token type) embeddings, LayerNorm, dropout (+ ELECTRA's projection to the
    hidden size, ``project``)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.word_embeddings = _embedding(config.vocab_size, config)
        self.position_embeddings = _embedding(config.max_position_embeddings, config)
        self.token_type_embeddings = (
            _embedding(config.type_vocab_size, config) if config.type_vocab_size > 0 else None
        )
        self.LayerNorm = nn.LayerNorm(config.embedding_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.project = (
            nn.Linear(config.embedding_size, config.hidden_size) if config.projects_embeddings else None
        )

    def position_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, S) positions; RoBERTa counts non-pad tokens from pad_token_id + 1."""
        if self.config.padding_offset_positions:
            pad = self.config.pad_token_id
            mask = input_ids.ne(pad).long()  # (B, S)
            return torch.cumsum(mask, dim=1) * mask + pad
        seq_len = input_ids.shape[1]
        return torch.arange(seq_len, device=input_ids.device).unsqueeze(0).expand_as(input_ids)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        # input_ids: (B, S) -> (B, S, E) -> (B, S, H) (E = H but for ELECTRA)
        x = self.word_embeddings(input_ids) + self.position_embeddings(self.position_ids(input_ids))
        if self.token_type_embeddings is not None:
            # one type row (RoBERTa): the segment ids a BERT-style tokenizer emits mean nothing to it
            if token_type_ids is None or not self.config.uses_token_types:
                token_type_ids = torch.zeros_like(input_ids)
            x = x + self.token_type_embeddings(token_type_ids)
        x = self.dropout(self.LayerNorm(x))  # (B, S, E)
        return x if self.project is None else self.project(x)  # (B, S, H)


class SelfAttention(nn.Module):
    """Multi-head self-attention. The number of heads is read off the projection's output width,
    so a column-parallel ``query``/``key``/``value`` holding num_heads/tp heads just works."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.head_dim = config.head_dim
        self.dropout_p = config.attention_dropout
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)
        self.out = nn.Linear(h, h)

    def forward(self, x: torch.Tensor, layout: AttentionLayout) -> torch.Tensor:
        # x: (B, S, H) padded or (T, H) packed, as ``layout`` says -> the same shape
        dropout_p = self.dropout_p if self.training else 0.0
        ctx = layout.attend(self.query(x), self.key(x), self.value(x), self.head_dim, dropout_p)
        return self.out(ctx)


class MLP(nn.Module):
    """up-projection, activation, down-projection."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.hidden_size, config.intermediate_size)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation_fn(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))  # (..., H) -> (..., I_local) -> (..., H)


class EncoderLayer(nn.Module):
    """Post-LN transformer block: x = LN(x + attn(x)); x = LN(x + mlp(x))."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.attention = SelfAttention(config)
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = MLP(config)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, x: torch.Tensor, layout: AttentionLayout) -> torch.Tensor:
        # x: (B, S, H) padded or (T, H) packed
        x = self.attention_norm(x + self.dropout(self.attention(x, layout)))
        return self.mlp_norm(x + self.dropout(self.mlp(x)))


class EncoderForQA(SpanModel):
    """Embeddings -> encoder layers -> span head producing start/end logits."""

    # what tensor parallelism shards inside a layer (names relative to the layer)
    column_linears = ("attention.query", "attention.key", "attention.value", "mlp.up")
    row_linears = ("attention.out", "mlp.down")

    def stage_copies(self) -> nn.Module | None:
        """The part every pipeline stage holds a copy of: ALBERT's one layer (else none)."""
        return self.layers if self.config.shares_layers else None

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings: Embeddings | None = Embeddings(config)
        if config.shares_layers:  # ALBERT: one module under every index (its parameters are held once)
            shared = EncoderLayer(config)
            self.layers = nn.ModuleDict({str(i): shared for i in range(config.num_layers)})
        else:
            self.layers = nn.ModuleDict({str(i): EncoderLayer(config) for i in range(config.num_layers)})
        self.qa_dropout = nn.Dropout(config.hidden_dropout)
        self.qa_outputs: nn.Linear | None = nn.Linear(config.hidden_size, 2)

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the parts this module holds.

        x: (B, S) token ids when ``embeddings`` is present, else (B, S, H) hidden states.
        Returns (B, S, 2) span logits when ``qa_outputs`` is present, else (B, S, H) hidden states.
        In inference on the CPU a padded batch runs packed (``attention_layout``): the layers see
        only real tokens, and padding positions come back as zeros.
        """
        if self.embeddings is not None:
            x = self.embeddings(x, token_type_ids)  # (B, S, H)
        layout = attention_layout(attention_mask, training=self.training, dtype=x.dtype)
        return layout.unpack(self._layers_and_head(layout.pack(x), layout))  # (B, S, H|2)

    def _layers_and_head(self, x: torch.Tensor, layout: AttentionLayout) -> torch.Tensor:
        # x: (B, S, H) padded or (T, H) packed -> the same leading shape, last dim H or 2 (span logits)
        for layer in self.layers.values():
            x = layer(x, layout)
        if self.qa_outputs is not None:
            x = self.head(self.qa_dropout(x))  # (..., 2) fp32
        return x
