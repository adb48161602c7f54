"""Build a whole single-device QA model from a ``ModelSource`` (the ``tp == pp == 1`` path), and
``new_model``: the one place that picks a family's module (shardserve's encoder, or a decoder or
DeBERTa or ModernBERT over transformers' modules).

from shardserve.models.build import build_model
from shardserve.models.registry import resolve_model
model = build_model(resolve_model("tiny-bert"))   # eval mode, fp32, CPU
"""

from __future__ import annotations

import torch

from shardserve.models.config import EncoderConfig
from shardserve.models.deberta import DebertaForQA
from shardserve.models.decoder import DecoderForQA
from shardserve.models.encoder import EncoderForQA
from shardserve.models.hf_weights import load_weights
from shardserve.models.modernbert import ModernBertForQA
from shardserve.models.registry import ModelSource

QAModel = EncoderForQA | DecoderForQA | DebertaForQA | ModernBertForQA
_ON_TRANSFORMERS = {"deberta-v2": DebertaForQA, "modernbert": ModernBertForQA}


def new_model(config: EncoderConfig) -> QAModel:
    """The family's module with fresh (or, under ``torch.device("meta")``, no) weights."""
    if config.is_decoder:
        return DecoderForQA(config)
    return _ON_TRANSFORMERS.get(config.arch, EncoderForQA)(config)


def build_model(
    source: ModelSource,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    head_seed: int = 0,
) -> QAModel:
    """Create the model on the meta device, materialise it on ``device`` and load its weights
    (``model.load_report`` says what was initialised rather than read, as for stages)."""
    with torch.device("meta"):
        model = new_model(source.config)
    model = model.to_compute_dtype(dtype).to_empty(device=device)  # never the fp32 copy of a bf16 model
    model.load_report = load_weights(model, source.weights(), source.config, head_seed=head_seed)
    return model.eval()
