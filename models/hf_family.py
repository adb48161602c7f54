"""Families that run on transformers' own modules, described as data: where each keeps its parts.

A ``Family`` names, inside a family's ``transformers`` ``*ForQuestionAnswering`` class, the base
model's attribute, its embeddings, its list of layers, the Linear layers of a layer that tensor
parallelism makes column- and row-parallel (and which carry key/value heads), and the attribute an
attention keeps its head count in. ``HFFamilyForQA`` builds the family's own QA model (on the meta
device when the caller asks) and keeps its parts under the names the rest of shardserve speaks:
``embeddings`` (with ``word_embeddings``), ``layers`` (a ``ModuleDict`` keyed by global layer
index) and ``qa_outputs``; each family's subclass threads the hidden states through whichever parts
a pipeline stage still holds (``models/decoder.py``: Llama, Qwen2, Mistral; ``models/deberta.py``:
DeBERTa-v2/v3; ``models/modernbert.py``: ModernBERT). Checkpoint names follow from the same data (``Family.checkpoint_name``).

A packed batch (``models/packing.py``: inference on the CPU) reaches the layers as a batch of one,
(1, T, H), with each token's position in its own sequence; the decoders' and ModernBERT's attention
kernel (``models/hf_attention.py``) attends within each sequence with the mask the family's own
makers build for that sequence alone (``attention_by_kind``). DeBERTa runs padded
(``models/deberta.py`` says why).

    model = new_model(resolve_model("tiny-llama").config)    # shardserve.models.build
    model.layers["3"]                                          # transformers' LlamaDecoderLayer
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardserve.models.config import EncoderConfig
from shardserve.models.hf_attention import KERNEL, PackedSequences, register
from shardserve.models.packing import AttentionLayout, PackedLayout
from shardserve.models.span_model import SpanModel

_DECODER_COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")


@dataclass(frozen=True)
class Family:
    """Where a family keeps its parts, as names inside ``transformers``' modules."""

    qa_class: str
    prefix: str  # the base model's attribute in the QA class (and its checkpoint names' prefix)
    layers: str  # the base model's list of layers
    column: tuple[str, ...]  # inside a layer: column-parallel linears (their output split by heads/units)
    row: tuple[str, ...]  # inside a layer: row-parallel linears (an all-reduce after each)
    attention: str  # inside a layer: the attention module
    key_value: tuple[str, ...] = ()  # column linears carrying key/value heads (grouped-query attention)
    heads_attr: str = ""  # the attention's head-count attribute ("": transformers reads it off widths)
    fused: tuple[tuple[str, int], ...] = ()  # column linears holding several projections, and how many
    table: str = "word_embeddings"  # the token table's attribute inside shardserve's ``embeddings``
    names: tuple[tuple[str, str], ...] = ()  # shardserve's name prefix -> the checkpoint's (besides layers)
    qa_head: str = "qa_outputs"  # the span classifier's attribute in the QA class
    outside: tuple[str, ...] = ("qa_outputs.",)  # shardserve's prefixes of parts outside the base model
    kernel: str = KERNEL  # transformers' attention implementation ("eager": the family's own code)

    def checkpoint_name(self, canonical: str) -> str:
        """shardserve's parameter name -> the checkpoint's, without the base model's prefix."""
        for ours, theirs in (
            ("layers.", f"{self.layers}."),
            *self.names,
            ("qa_outputs.", f"{self.qa_head}."),
        ):
            if canonical.startswith(ours):
                return theirs + canonical.removeprefix(ours)
        raise KeyError(f"no Hugging Face name for parameter {canonical!r}")


def _decoder(qa_class: str, prefix: str) -> Family:
    return Family(
        qa_class, prefix, layers="layers", column=_DECODER_COLUMN, row=("self_attn.o_proj", "mlp.down_proj"),
        attention="self_attn", key_value=("self_attn.k_proj", "self_attn.v_proj"),
        names=(("embeddings.word_embeddings.", "embed_tokens."), ("final_norm.", "norm.")),
    )  # fmt: skip


FAMILIES: dict[str, Family] = {
    "llama": _decoder("LlamaForQuestionAnswering", "transformer"),
    "qwen2": _decoder("Qwen2ForQuestionAnswering", "transformer"),
    "mistral": _decoder("MistralForQuestionAnswering", "model"),
    "deberta-v2": Family(
        "DebertaV2ForQuestionAnswering", "deberta", layers="encoder.layer",
        column=("attention.self.query_proj", "attention.self.key_proj", "attention.self.value_proj",
                "intermediate.dense"),
        row=("attention.output.dense", "output.dense"), attention="attention.self",
        heads_attr="num_attention_heads",
        names=(("embeddings.", "embeddings."), ("relative.", "encoder.")), kernel="eager",
    ),
    "modernbert": Family(
        "ModernBertForQuestionAnswering", "model", layers="layers", column=("attn.Wqkv", "mlp.Wi"),
        row=("attn.Wo", "mlp.Wo"), attention="attn", fused=(("attn.Wqkv", 3), ("mlp.Wi", 2)),
        table="tok_embeddings",
        names=(("embeddings.", "embeddings."), ("final_norm.", "final_norm."), ("head_transform.", "head.")),
        qa_head="classifier", outside=("qa_outputs.", "head_transform."),
    ),
}  # fmt: skip


def hf_config(config: EncoderConfig):
    """The ``transformers`` config object of ``config`` (its stored ``config.json``), with the
    family's attention kernel, this run's dropout and layer count."""
    import transformers

    fields = config.hf_fields
    model_type = fields.pop("model_type")
    fields.pop("architectures", None)
    fields.update(
        attention_dropout=config.attention_dropout,
        attention_probs_dropout_prob=config.attention_dropout,
        hidden_dropout_prob=config.hidden_dropout,
        num_hidden_layers=config.num_layers,
    )
    if isinstance(fields.get("layer_types"), list):
        fields["layer_types"] = fields["layer_types"][: config.num_layers]
    cfg = transformers.AutoConfig.for_model(model_type, **fields)
    register()
    cfg._attn_implementation = FAMILIES[config.arch].kernel
    return cfg


class HFFamilyForQA(SpanModel):
    """A family's own QA model, its parts renamed; subclasses run them (``forward``)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        import transformers

        self.config = config
        self.family = FAMILIES[config.arch]
        self.hf_config = hf_config(config)
        qa = getattr(transformers, self.family.qa_class)(self.hf_config)
        base = getattr(qa, self.family.prefix)
        blocks = list(base.get_submodule(self.family.layers))
        # registered in the model's order (embeddings first), which is the order weights load in: a
        # rank's peak memory is its weights plus the tensor being read, the token table read early
        self.take_parts(qa, base)
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})
        self.qa_outputs: nn.Linear | None = getattr(qa, self.family.qa_head)

    def take_parts(self, qa: nn.Module, base: nn.Module) -> None:
        """Keep the parts besides the layers and the span classifier (embeddings, norms, position
        tables) of the QA model ``qa`` and its base model ``base``."""
        raise NotImplementedError

    def masks(self, x: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor) -> dict:
        """Each attention kind's mask of a (B, S) padded batch, as the family's transformers model
        makes it (None where SDPA needs none); ``x`` (B, S, ...) gives the shape, dtype and device."""
        raise NotImplementedError

    def attention_by_kind(
        self, x: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor, layout: AttentionLayout
    ) -> dict[str, dict]:
        """Each attention kind's arguments to a layer: a padded batch's mask; for a packed batch no
        mask, and each sequence's own (``packed_sequences``, from ``masks`` of the sequence alone)."""
        if not isinstance(layout, PackedLayout):
            masks = self.masks(x, attention_mask, positions)
            return {kind: {"attention_mask": m} for kind, m in masks.items()}
        alone = {}
        for n in set(layout.lengths):
            ones = torch.ones(1, n, dtype=torch.long, device=x.device)
            alone[n] = self.masks(x.new_empty(1, n, 1), ones, torch.arange(n, device=x.device)[None])
        return {
            kind: {
                "attention_mask": None,
                "packed_sequences": PackedSequences(layout.lengths, [alone[n][kind] for n in layout.lengths]),
            }
            for kind in alone[layout.lengths[0]]
        }

    @staticmethod
    def pack(x: torch.Tensor, layout: AttentionLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S, H) -> the layers' input and positions: (B, S, H) and (1, S) padded, (1, T, H) and
        (1, T) packed (a batch of one holding every sequence's real tokens)."""
        if isinstance(layout, PackedLayout):
            return layout.pack(x)[None], layout.positions()[None]
        return x, torch.arange(x.shape[1], device=x.device)[None]  # windows are right-padded

    @staticmethod
    def unpack(x: torch.Tensor, layout: AttentionLayout) -> torch.Tensor:
        """The layers' output back to (B, S, C), zeros at the padding positions of a packed batch."""
        return layout.unpack(x[0]) if isinstance(layout, PackedLayout) else x

    def fresh_buffers(self) -> None:
        """Recompute the non-checkpoint buffers (position tables) after ``to_empty`` or a cast."""

    def fresh_rotary(self) -> None:
        """The rotary tables (a family's ``rotary`` module), computed afresh in fp32 on their device."""
        device = next(self.rotary.buffers()).device
        with torch.device("cpu"):
            self.rotary = type(self.rotary)(config=self.hf_config).to(device)

    @property
    def column_linears(self) -> tuple[str, ...]:
        return self.family.column

    @property
    def row_linears(self) -> tuple[str, ...]:
        return self.family.row

    @property
    def key_value_linears(self) -> tuple[str, ...]:
        return self.family.key_value

    @property
    def fused_linears(self) -> tuple[tuple[str, int], ...]:
        return self.family.fused

    @property
    def token_table(self) -> str:
        return self.family.table

    def shard_heads(self, layer: nn.Module, tp: int) -> None:
        """Tell a tensor-parallel layer's attention how many heads this rank holds."""
        attention, c = layer.get_submodule(self.family.attention), self.config
        if self.family.key_value:  # transformers repeats each key/value head this often
            attention.num_key_value_groups = (c.num_heads // tp) // max(1, c.num_kv_heads // tp)
        if self.family.heads_attr:
            setattr(attention, self.family.heads_attr, c.num_heads // tp)

    def to_compute_dtype(self, dtype: torch.dtype) -> HFFamilyForQA:
        """Cast the weights to ``dtype``, keeping the QA head in fp32 (and the position tables)."""
        super().to_compute_dtype(dtype)
        if not next(self.parameters()).is_meta:
            self.fresh_buffers()
        return self

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> HFFamilyForQA:
        """``nn.Module.to_empty``, then the buffers no checkpoint holds computed afresh."""
        super().to_empty(device=device, recurse=recurse)
        self.fresh_buffers()
        return self
