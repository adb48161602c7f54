"""Families on transformers' modules (``models/hf_family.py``): the parts keep the model's order,
and every parameter has a checkpoint name."""

from __future__ import annotations

import pytest
import torch

from shardserve.models.build import new_model
from shardserve.models.config import EncoderConfig
from shardserve.models.hf_family import FAMILIES
from shardserve.models.hf_weights import hf_name
from shardserve.models.presets import TINY_PRESETS

ON_TRANSFORMERS = sorted(n for n, spec in TINY_PRESETS.items() if spec["model_type"] in FAMILIES)


@pytest.mark.parametrize("name", ON_TRANSFORMERS)
def test_parameters_load_in_the_models_order_token_table_first(name):
    """Weights load in registration order; a rank's peak is its weights plus the tensor being read, so
    the (largest) token table must come first, not after every layer is already resident."""
    with torch.device("meta"):
        model = new_model(EncoderConfig.from_hf_dict(TINY_PRESETS[name]))
    names = [n for n, _ in model.named_parameters()]
    assert names[0].startswith("embeddings.") and names[-1].startswith("qa_outputs."), names[:2] + names[-1:]


def test_every_family_names_its_checkpoint_tensors():
    assert hf_name("llama", "embeddings.word_embeddings.weight") == "embed_tokens.weight"
    assert hf_name("mistral", "final_norm.weight") == "norm.weight"
    assert hf_name("deberta-v2", "layers.3.attention.self.query_proj.weight") == (
        "encoder.layer.3.attention.self.query_proj.weight"
    )
    assert hf_name("deberta-v2", "relative.rel_embeddings.weight") == "encoder.rel_embeddings.weight"
    assert hf_name("modernbert", "head_transform.dense.weight") == "head.dense.weight"
    assert hf_name("modernbert", "qa_outputs.weight") == "classifier.weight"
    with pytest.raises(KeyError, match="no Hugging Face name"):
        hf_name("llama", "rotary.inv_freq")


def test_modernbert_reads_a_long_window_in_one_piece():
    """A window as long as ModernBERT's positions allow (1,000 of the tiny preset's 1,024 tokens,
    past its 32-token local windows), equal to transformers' forward."""
    from transformers import AutoModelForQuestionAnswering

    from shardserve.models.build import build_model
    from shardserve.models.registry import resolve_model

    source = resolve_model("tiny-modernbert")
    assert source.config.max_seq_len == 1024
    ids = torch.randint(5, 2000, (1, 1000), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, 900:] = 0  # padded tail
    with torch.inference_mode():
        got = build_model(source)(ids, mask)
        ref = AutoModelForQuestionAnswering.from_pretrained(source.checkpoint)(
            input_ids=ids, attention_mask=mask
        )
    real = mask.bool()[0]
    assert (got[0, real, 0] - ref.start_logits[0, real]).abs().max() < 1e-4
    assert (got[0, real, 1] - ref.end_logits[0, real]).abs().max() < 1e-4


@pytest.mark.parametrize("name", ON_TRANSFORMERS)
def test_a_packed_batch_gives_the_padded_batchs_logits(name, monkeypatch):
    """Inference packs a padded batch: attention runs once per sequence and layer, and each
    sequence's logits are the padded forward's (fp32) and those of the sequence alone, past the
    presets' 32-token sliding windows too; padding positions are zeros; spare rows after the real
    tokens (oneDNN's row grid, forced here in fp32) change nothing. DeBERTa runs padded (its
    attention module projects the relative-position table on every call: packed was slower)."""
    import transformers.integrations.sdpa_attention as sdpa
    from transformers.models.deberta_v2.modeling_deberta_v2 import DisentangledSelfAttention

    from shardserve.models.build import build_model
    from shardserve.models.packing import padded_inference
    from shardserve.models.registry import resolve_model
    from tests.models.qa_fixtures import right_padded, spare_rows

    calls = []
    real_sdpa = sdpa.sdpa_attention_forward
    monkeypatch.setattr(sdpa, "sdpa_attention_forward", lambda *a, **k: calls.append(1) or real_sdpa(*a, **k))
    real_deberta = DisentangledSelfAttention.forward  # DeBERTa's own (eager) attention
    monkeypatch.setattr(
        DisentangledSelfAttention, "forward", lambda *a, **k: calls.append(1) or real_deberta(*a, **k)
    )
    torch.manual_seed(0)
    model = build_model(resolve_model(name)).eval()
    lengths = [70, 5, 41, 1]
    ids, mask = right_padded(lengths, 70)
    with torch.inference_mode():
        packed = model(ids, mask)  # (B, S, 2)
        packs = model.config.arch != "deberta-v2"
        assert len(calls) == (len(lengths) if packs else 1) * len(model.layers)
        with padded_inference():
            padded = model(ids, mask)
        alone = [model(ids[i : i + 1, :n], mask[i : i + 1, :n])[0] for i, n in enumerate(lengths)]
        with spare_rows(monkeypatch):
            calls.clear()
            spared = model(ids, mask)
        assert len(calls) == (len(lengths) if packs else 1) * len(model.layers)  # spare rows: no call
    assert torch.allclose(spared, packed, atol=1e-5, rtol=0)
    real = mask.bool()
    assert padded[real].std() > 0.05  # logits carry signal, so the comparison bites
    assert (packed - padded)[real].abs().max().item() < 1e-5
    if packs:
        assert packed[~real].abs().max().item() == 0.0
    for i, want in enumerate(alone):
        assert (packed[i, : want.shape[0]] - want).abs().max().item() < 1e-5
