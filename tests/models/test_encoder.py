"""EncoderForQA's input handling (numerics against transformers: tests/models/test_hf_weights.py)."""

from __future__ import annotations

import torch

from models.build import build_model
from models.registry import resolve_model


def test_a_one_type_model_ignores_the_segment_ids_of_a_bert_tokenizer() -> None:
    """tiny-roberta has one token-type row but a BERT vocabulary, whose tokenizer marks the context
    with type 1: training and eval pass those ids, which indexed past the row (IndexError)."""
    source = resolve_model("tiny-roberta")
    assert source.config.type_vocab_size == 1
    model = build_model(source)
    ids = torch.randint(5, 100, (2, 12))  # (B, S)
    mask = torch.ones_like(ids)
    types = torch.zeros_like(ids)
    types[:, 6:] = 1  # the context segment
    with torch.inference_mode():
        assert torch.equal(model(ids, mask, types), model(ids, mask, None))
