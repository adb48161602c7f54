"""EncoderForQA's input handling (numerics against transformers: tests/models/test_hf_weights.py)."""

from __future__ import annotations

import pytest
import torch

from shardserve.models.build import build_model
from shardserve.models.packing import PaddedLayout, expand_mask
from shardserve.models.registry import resolve_model
from tests.models.qa_fixtures import right_padded, spare_rows


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


@pytest.mark.parametrize("name", ["tiny-bert", "tiny-roberta", "tiny-albert"])
def test_a_packed_batch_gives_the_padded_batchs_logits(name: str, monkeypatch) -> None:
    """Inference packs a padded batch (no padding reaches the layers); each sequence's logits are
    those of the padded forward (fp32), and of the sequence alone; padding positions are zeros.
    Spare rows after the real tokens (oneDNN's row grid, forced here in fp32) change nothing."""
    torch.manual_seed(0)
    model = build_model(resolve_model(name)).eval()
    ids, mask = right_padded([12, 5, 9, 1], 12)
    with torch.inference_mode():
        packed = model(ids, mask)  # (B, S, 2)
        with spare_rows(monkeypatch):
            spared = model(ids, mask)
        assert torch.allclose(spared, packed, atol=1e-5, rtol=0)
        padded = model._layers_and_head(model.embeddings(ids), PaddedLayout(expand_mask(mask)))
        alone = [model(ids[i : i + 1, :n], mask[i : i + 1, :n])[0] for i, n in enumerate([12, 5, 9, 1])]
    real = mask.bool()
    assert (packed - padded)[real].abs().max().item() < 1e-5
    assert packed[~real].abs().max().item() == 0.0
    for i, want in enumerate(alone):
        assert (packed[i, : want.shape[0]] - want).abs().max().item() < 1e-5
