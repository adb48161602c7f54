"""Shapes of well-known public checkpoints, without their weights: what ``shardserve plan`` needs to
plan models this machine cannot hold or download (a placement over 64 GPUs, a 1.5 B decoder).

Owns ``SHAPES`` (name -> the architecture fields of the model's published ``config.json``) and
``shape_config``. Only planning reads them: nothing here can be served or trained.

    shape_config("qwen2-1.5b").num_layers          # 28
    shardserve plan --placement auto --models minilm:8,bert-large:8,qwen2-1.5b:8 --devices 64 --gpu h100
"""

from __future__ import annotations

from typing import Any

from shardserve.models.config import EncoderConfig, ModelConfigError

_BERT_VOCAB = {"vocab_size": 30522, "max_position_embeddings": 512, "type_vocab_size": 2}
_QWEN2: dict[str, Any] = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
}

SHAPES: dict[str, dict[str, Any]] = {
    # sentence-transformers/all-MiniLM-L6-v2: 22.7 M parameters
    "minilm-l6": {
        "model_type": "bert",
        **_BERT_VOCAB,
        "hidden_size": 384,
        "num_hidden_layers": 6,
        "num_attention_heads": 12,
        "intermediate_size": 1536,
    },
    # google-bert/bert-base-uncased: 110 M
    "bert-base": {
        "model_type": "bert",
        **_BERT_VOCAB,
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
    },
    # google-bert/bert-large-uncased: 335 M
    "bert-large": {
        "model_type": "bert",
        **_BERT_VOCAB,
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "intermediate_size": 4096,
    },
    # FacebookAI/roberta-large: 355 M
    "roberta-large": {
        "model_type": "roberta",
        "vocab_size": 50265,
        "max_position_embeddings": 514,
        "type_vocab_size": 1,
        "pad_token_id": 1,
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "intermediate_size": 4096,
    },
    # Qwen/Qwen2-0.5B: 0.49 B
    "qwen2-0.5b": {
        **_QWEN2,
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
    },
    # Qwen/Qwen2-1.5B: 1.5 B
    "qwen2-1.5b": {
        **_QWEN2,
        "hidden_size": 1536,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "intermediate_size": 8960,
    },
}


def shape_config(name: str) -> EncoderConfig:
    """The ``EncoderConfig`` of shape ``name`` (``ModelConfigError`` naming the known shapes)."""
    if name not in SHAPES:
        raise ModelConfigError(f"no model shape {name!r} (known shapes: {', '.join(SHAPES)})")
    return EncoderConfig.from_hf_dict(SHAPES[name], source=f"shape {name}")
