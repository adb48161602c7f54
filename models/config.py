"""Model configuration: one dataclass for every supported family, read from a Hugging Face ``config.json``.

``EncoderConfig.from_hf_dict(json.load(...))`` maps BERT, RoBERTa, XLM-RoBERTa, ELECTRA, ALBERT
and DistilBERT configs (and their ``*ForQuestionAnswering`` variants) onto the one set of fields the
plain encoder in ``models/encoder.py`` needs: XLM-RoBERTa is RoBERTa's architecture (another
vocabulary: SentencePiece); ELECTRA is BERT's with embeddings of their own width
(``embedding_size``) projected to the hidden size; ALBERT is ELECTRA's shape with ONE layer's
weights applied ``num_hidden_layers`` times (``shares_layers``; one hidden group of one layer).
DeBERTa-v2/v3, ModernBERT and the decoders Llama, Qwen2 and Mistral (``DECODER_ARCHS``) keep their
whole config (``hf_config_json``: transformers builds their modules, ``models/hf_family.py``) beside
the shape fields the planner reads (grouped-query ``num_kv_heads``, gated MLP). Unsupported architectures or inconsistent numbers raise
``ModelConfigError`` naming the offending values.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

Arch = Literal[
    "bert",
    "roberta",
    "xlm-roberta",
    "electra",
    "albert",
    "distilbert",
    "deberta-v2",
    "modernbert",
    "llama",
    "qwen2",
    "mistral",
]
ENCODER_ARCHS: tuple[str, ...] = (
    "bert", "roberta", "xlm-roberta", "electra", "albert", "distilbert", "deberta-v2", "modernbert"
)  # fmt: skip
# decoders with a span head, run on transformers' own modules (``models/decoder.py``)
DECODER_ARCHS: tuple[str, ...] = ("llama", "qwen2", "mistral")
SUPPORTED_ARCHS: tuple[str, ...] = ENCODER_ARCHS + DECODER_ARCHS
# each architecture's classes in ``transformers`` (its config, its extractive-QA model): the reference
# forward of every parity check, and the ``architectures`` entry of a checkpoint written here
HF_CLASSES: dict[str, tuple[str, str]] = {
    "bert": ("BertConfig", "BertForQuestionAnswering"),
    "roberta": ("RobertaConfig", "RobertaForQuestionAnswering"),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaForQuestionAnswering"),
    "electra": ("ElectraConfig", "ElectraForQuestionAnswering"),
    "albert": ("AlbertConfig", "AlbertForQuestionAnswering"),
    "distilbert": ("DistilBertConfig", "DistilBertForQuestionAnswering"),
    "deberta-v2": ("DebertaV2Config", "DebertaV2ForQuestionAnswering"),
    "modernbert": ("ModernBertConfig", "ModernBertForQuestionAnswering"),
    "llama": ("LlamaConfig", "LlamaForQuestionAnswering"),
    "qwen2": ("Qwen2Config", "Qwen2ForQuestionAnswering"),
    "mistral": ("MistralConfig", "MistralForQuestionAnswering"),
}
# the architectures whose positions count from pad_token_id + 1 (RoBERTa's padding offset)
PADDING_OFFSET_ARCHS = ("roberta", "xlm-roberta")
_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")  # the encoder's (decoders: transformers')


def _shape_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields every family but DistilBERT names as BERT's ``config.json`` does."""
    return dict(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=int(cfg["num_attention_heads"]),
        intermediate_size=int(cfg["intermediate_size"]),
        max_position_embeddings=int(cfg["max_position_embeddings"]),
        initializer_range=float(cfg.get("initializer_range", 0.02)),
    )


class ModelConfigError(ValueError):
    """A model config is unsupported or inconsistent; the message names the file and numbers."""


@dataclass(frozen=True)
class EncoderConfig:
    """Shape and numerics of a post-LayerNorm BERT-family encoder with a span (QA) head."""

    arch: Arch
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2  # 0: no token-type embedding (DistilBERT)
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0
    initializer_range: float = 0.02
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    sinusoidal_positions: bool = False
    embedding_size: int = 0  # width of the embedding tables (ELECTRA: may differ); 0: hidden_size
    num_kv_heads: int = 0  # key/value heads (grouped-query attention); 0: num_heads
    head_size: int = 0  # width of one head where a config sets it; 0: hidden_size // num_heads
    qkv_bias: bool = True  # the query/key/value projections have biases
    gated_mlp: bool = False  # gate and up projections (SwiGLU: three MLP matrices)
    hf_config_json: str = ""  # a decoder's whole config.json: transformers builds its modules from it

    def __post_init__(self) -> None:
        if self.embedding_size == 0:
            object.__setattr__(self, "embedding_size", self.hidden_size)
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.arch not in SUPPORTED_ARCHS:
            raise ModelConfigError(f"unsupported architecture {self.arch!r}; supported: {SUPPORTED_ARCHS}")
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "intermediate_size",
            "max_position_embeddings",
            "embedding_size",
        ):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"{name}={getattr(self, name)} must be positive")
        if self.hidden_size % self.num_heads and not self.head_size:
            raise ModelConfigError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if self.is_decoder:
            return
        if self.hidden_act not in _ACTIVATIONS:
            raise ModelConfigError(f"hidden_act={self.hidden_act!r} unsupported; supported: {_ACTIVATIONS}")
        if self.arch in PADDING_OFFSET_ARCHS and self.max_position_embeddings <= self.pad_token_id + 1:
            raise ModelConfigError(
                f"{self.arch} max_position_embeddings={self.max_position_embeddings} must exceed "
                f"pad_token_id+1={self.pad_token_id + 1}"
            )

    @property
    def padding_offset_positions(self) -> bool:
        """Positions count non-pad tokens from pad_token_id + 1 (RoBERTa, XLM-RoBERTa)."""
        return self.arch in PADDING_OFFSET_ARCHS

    @property
    def shares_layers(self) -> bool:
        """One layer's weights serve every layer (ALBERT): a stage holds them once."""
        return self.arch == "albert"

    @property
    def has_stage_copies(self) -> bool:
        """Every pipeline stage holds a copy of some parameters (ALBERT's one layer, DeBERTa's
        relative-position table): training sums their gradients over the stages."""
        return self.shares_layers or self.arch == "deberta-v2"

    @property
    def projects_embeddings(self) -> bool:
        """The embeddings are narrower or wider than the hidden states: a Linear maps them (ELECTRA)."""
        return self.embedding_size != self.hidden_size

    @property
    def is_decoder(self) -> bool:
        """A causal decoder with a span head, built from transformers' modules (``models/decoder.py``)."""
        return self.arch in DECODER_ARCHS

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

    @property
    def hf_fields(self) -> dict[str, Any]:
        """A family on transformers' modules: its stored ``config.json`` as read (a fresh dict each
        time); empty for the encoders on shardserve's own code."""
        return json.loads(self.hf_config_json) if self.hf_config_json else {}

    @property
    def uses_token_types(self) -> bool:
        """Whether segment ids mean anything to the model (BERT: two types; RoBERTa's one row: no)."""
        return self.type_vocab_size >= 2

    @property
    def max_seq_len(self) -> int:
        """Longest input the position table allows (RoBERTa reserves pad_token_id+1 slots)."""
        if self.padding_offset_positions:
            return self.max_position_embeddings - self.pad_token_id - 1
        return self.max_position_embeddings

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], *, source: str = "config") -> EncoderConfig:
        """Map a Hugging Face config dict (BERT / RoBERTa / XLM-RoBERTa / ELECTRA / DistilBERT) onto an
        EncoderConfig."""
        model_type = cfg.get("model_type")
        try:
            if model_type == "albert":
                groups = (int(cfg.get("num_hidden_groups", 1)), int(cfg.get("inner_group_num", 1)))
                if groups != (1, 1):
                    raise ModelConfigError(
                        f"{source}: ALBERT with num_hidden_groups={groups[0]}, inner_group_num={groups[1]} "
                        "is unsupported (only 1 and 1: one layer shared by all, as every released ALBERT)"
                    )
            if model_type in ("bert", "roberta", "xlm-roberta", "electra", "albert"):
                if cfg.get("position_embedding_type", "absolute") != "absolute":
                    raise ModelConfigError(
                        f"{source}: position_embedding_type={cfg['position_embedding_type']!r} unsupported "
                        "(only 'absolute')"
                    )
                return cls(
                    arch=model_type,
                    **_shape_fields(cfg),
                    type_vocab_size=int(cfg.get("type_vocab_size", 2)),
                    layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
                    hidden_act=str(cfg.get("hidden_act", "gelu")),
                    pad_token_id=int(
                        cfg.get("pad_token_id", 1 if model_type in PADDING_OFFSET_ARCHS else 0) or 0
                    ),
                    hidden_dropout=float(cfg.get("hidden_dropout_prob", 0.1)),
                    attention_dropout=float(cfg.get("attention_probs_dropout_prob", 0.1)),
                    embedding_size=int(cfg.get("embedding_size") or cfg["hidden_size"]),
                )
            if model_type == "distilbert":
                return cls(
                    arch="distilbert",
                    vocab_size=int(cfg["vocab_size"]),
                    hidden_size=int(cfg["dim"]),
                    num_layers=int(cfg["n_layers"]),
                    num_heads=int(cfg["n_heads"]),
                    intermediate_size=int(cfg["hidden_dim"]),
                    max_position_embeddings=int(cfg["max_position_embeddings"]),
                    type_vocab_size=0,
                    layer_norm_eps=1e-12,
                    hidden_act=str(cfg.get("activation", "gelu")),
                    pad_token_id=int(cfg.get("pad_token_id", 0) or 0),
                    initializer_range=float(cfg.get("initializer_range", 0.02)),
                    hidden_dropout=float(cfg.get("dropout", 0.1)),
                    attention_dropout=float(cfg.get("attention_dropout", 0.1)),
                    sinusoidal_positions=bool(cfg.get("sinusoidal_pos_embds", False)),
                )
            if model_type in DECODER_ARCHS:
                return cls._from_decoder_dict(cfg)
            if model_type == "deberta-v2":
                return cls._from_deberta_dict(cfg)
            if model_type == "modernbert":
                return cls._from_modernbert_dict(cfg)
        except KeyError as exc:
            raise ModelConfigError(
                f"{source}: missing field {exc.args[0]!r} for model_type={model_type!r}"
            ) from exc
        except ModelConfigError as exc:
            raise ModelConfigError(f"{source}: {exc}") from None
        raise ModelConfigError(
            f"{source}: unsupported model_type={model_type!r} (architectures={cfg.get('architectures')}); "
            f"supported: {SUPPORTED_ARCHS}"
        )

    @classmethod
    def _on_transformers(cls, cfg: dict[str, Any], **fields: Any) -> EncoderConfig:
        """A family on transformers' modules: the shape fields they all name alike, the whole config
        for transformers to build the modules from, and the family's own ``fields``."""
        return cls(
            arch=cfg["model_type"],
            **_shape_fields(cfg),
            pad_token_id=int(cfg.get("pad_token_id") or 0),
            hf_config_json=json.dumps(cfg, sort_keys=True),
            **fields,
        )

    @classmethod
    def _from_decoder_dict(cls, cfg: dict[str, Any]) -> EncoderConfig:
        """Llama / Qwen2 / Mistral: grouped-query attention, a gated MLP, RMSNorm, no token types."""
        return cls._on_transformers(
            cfg,
            num_kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
            head_size=int(cfg.get("head_dim") or 0),
            type_vocab_size=0,
            layer_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            hidden_dropout=0.0,
            attention_dropout=float(cfg.get("attention_dropout", 0.0)),
            qkv_bias=cfg["model_type"] == "qwen2" or bool(cfg.get("attention_bias", False)),
            gated_mlp=True,
        )

    @classmethod
    def _from_deberta_dict(cls, cfg: dict[str, Any]) -> EncoderConfig:
        """DeBERTa-v2/v3: BERT's shape (token types only where the config has them)."""
        if int(cfg.get("conv_kernel_size", 0) or 0) > 0:
            raise ModelConfigError(
                f"DeBERTa with conv_kernel_size={cfg['conv_kernel_size']} is unsupported (its convolution "
                "after the first layer reads the embeddings: DeBERTa-v3 has none)"
            )
        return cls._on_transformers(
            cfg,
            type_vocab_size=int(cfg.get("type_vocab_size", 0)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-7)),
            hidden_act=str(cfg.get("hidden_act", "gelu")),
            hidden_dropout=float(cfg.get("hidden_dropout_prob", 0.1)),
            attention_dropout=float(cfg.get("attention_probs_dropout_prob", 0.1)),
            embedding_size=int(cfg.get("embedding_size") or cfg["hidden_size"]),
        )

    @classmethod
    def _from_modernbert_dict(cls, cfg: dict[str, Any]) -> EncoderConfig:
        """ModernBERT: a gated MLP, no biases, no token types."""
        return cls._on_transformers(
            cfg,
            type_vocab_size=0,
            layer_norm_eps=float(cfg.get("norm_eps", 1e-5)),
            hidden_act=str(cfg.get("hidden_activation", "gelu")),
            hidden_dropout=float(cfg.get("mlp_dropout", 0.0)),
            attention_dropout=float(cfg.get("attention_dropout", 0.0)),
            qkv_bias=bool(cfg.get("attention_bias", False)),
            gated_mlp=True,
        )

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> EncoderConfig:
        """Read ``config.json`` from a local Hugging Face model directory."""
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ModelConfigError(f"{cfg_path}: no config.json in the model directory")
        try:
            data = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelConfigError(f"{cfg_path}: unreadable config ({exc})") from exc
        if not isinstance(data, dict):
            raise ModelConfigError(f"{cfg_path}: expected a JSON object, got {type(data).__name__}")
        return cls.from_hf_dict(data, source=str(cfg_path))
