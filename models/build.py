"""Build a whole single-device ``EncoderForQA`` from a ``ModelSource`` (the ``tp == pp == 1`` path).

from models.build import build_model
from models.registry import resolve_model
model = build_model(resolve_model("tiny-bert"))   # eval mode, fp32, CPU
"""

from __future__ import annotations

import torch

from models.encoder import EncoderForQA
from models.hf_weights import load_weights
from models.registry import ModelSource


def build_model(
    source: ModelSource,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    head_seed: int = 0,
) -> EncoderForQA:
    """Create the model on the meta device, materialise it on ``device`` and load its weights
    (``model.load_report`` says what was initialised rather than read, as for stages)."""
    with torch.device("meta"):
        model = EncoderForQA(source.config)
    model = model.to_empty(device=device).to_compute_dtype(dtype)
    model.load_report = load_weights(model, source.weights(), source.config, head_seed=head_seed)
    return model.eval()
