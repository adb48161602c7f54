"""Loading Hugging Face checkpoints into the plain encoder: parity with transformers, bad input."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardserve.models.build import build_model
from shardserve.models.config import EncoderConfig
from shardserve.models.hf_weights import CheckpointError, save_hf_checkpoint, to_hf_state_dict
from shardserve.models.presets import TINY_PRESETS
from shardserve.models.registry import ModelSource, resolve_model
from shardserve.partitioner.stream.verify import sample_batches


def _reference_qa(path):
    from transformers import AutoModelForQuestionAnswering

    return AutoModelForQuestionAnswering.from_pretrained(path).eval()


@pytest.mark.parametrize("name", sorted(TINY_PRESETS))
def test_tiny_presets_match_transformers(name):
    source = resolve_model(name)
    model = build_model(source)
    ref = _reference_qa(source.checkpoint)
    for batch in sample_batches(source):
        with torch.no_grad():
            start, end = model.qa_logits(
                batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids")
            )
            want = ref(**batch)
        mask = batch["attention_mask"].bool()
        assert want.start_logits[mask].std() > 0.05  # logits carry signal, so the comparison bites
        assert (start - want.start_logits)[mask].abs().max() < 1e-5
        assert (end - want.end_logits)[mask].abs().max() < 1e-5


def test_minilm_encoder_matches_transformers_and_head_is_initialised(caplog):
    from transformers import AutoModel

    source = resolve_model("minilm")
    with caplog.at_level("WARNING"):
        model = build_model(source)
    assert "no QA head" in caplog.text
    assert model.qa_outputs is not None and model.qa_outputs.weight.abs().sum() > 0
    ref = AutoModel.from_pretrained(source.checkpoint).eval()
    batch = sample_batches(source)[0]
    model.qa_outputs = None  # compare hidden states
    with torch.no_grad():
        hidden = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        want = ref(**batch).last_hidden_state
    mask = batch["attention_mask"].bool()
    assert (hidden - want)[mask].abs().max() < 1e-4


def test_head_init_is_deterministic():
    a = build_model(resolve_model("minilm"), head_seed=7).qa_outputs.weight
    b = build_model(resolve_model("minilm"), head_seed=7).qa_outputs.weight
    c = build_model(resolve_model("minilm"), head_seed=8).qa_outputs.weight
    assert torch.equal(a, b) and not torch.equal(a, c)


def _copy_preset(tmp_path, name="tiny-bert"):
    src = resolve_model(name)
    dst = tmp_path / name
    shutil.copytree(src.checkpoint, dst)
    return ModelSource(name, dst, src.config, dst)


def test_pytorch_bin_loads_with_weights_only(tmp_path):
    source = _copy_preset(tmp_path)
    state = load_file(str(source.checkpoint / "model.safetensors"))
    (source.checkpoint / "model.safetensors").unlink()
    torch.save(state, source.checkpoint / "pytorch_model.bin")
    model = build_model(source)
    want = build_model(resolve_model("tiny-bert"))
    for (n, p), (_, q) in zip(model.named_parameters(), want.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_bin_with_arbitrary_pickle_is_refused(tmp_path):
    source = _copy_preset(tmp_path)
    (source.checkpoint / "model.safetensors").unlink()
    torch.save({"weights": object()}, source.checkpoint / "pytorch_model.bin")  # not loadable weights-only
    with pytest.raises(
        CheckpointError, match=r"pytorch_model.bin: cannot load with torch.load\(weights_only=True\)"
    ):
        build_model(source)


def test_missing_weights_file_is_named(tmp_path):
    source = _copy_preset(tmp_path)
    (source.checkpoint / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights found"):
        build_model(source)


def test_corrupt_safetensors_is_named(tmp_path):
    source = _copy_preset(tmp_path)
    path = source.checkpoint / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot"):
        build_model(source)


def test_missing_tensor_is_named(tmp_path):
    source = _copy_preset(tmp_path)
    path = source.checkpoint / "model.safetensors"
    state = load_file(str(path))
    del state["bert.encoder.layer.3.intermediate.dense.weight"]
    save_file(state, str(path))
    with pytest.raises(
        CheckpointError, match=r"layers.3.mlp.up.weight.*encoder.layer.3.intermediate.dense.weight"
    ):
        build_model(source)


def test_config_mismatch_names_shapes(tmp_path):
    source = _copy_preset(tmp_path)
    cfg = EncoderConfig.from_hf_dict({**TINY_PRESETS["tiny-bert"], "intermediate_size": 256})
    bad = ModelSource("bad", source.checkpoint, cfg, source.checkpoint)
    with pytest.raises(CheckpointError, match=r"has shape \[128, 64\], but the config expects \[256, 64\]"):
        build_model(bad)


def test_save_hf_checkpoint_round_trips_through_transformers(tmp_path):
    source = resolve_model("tiny-distilbert")
    model = build_model(source)
    out = save_hf_checkpoint(
        model.state_dict(),
        source.config,
        tmp_path / "out",
        base_config=source.checkpoint / "config.json",
        tokenizer_dir=source.tokenizer_dir,
    )
    ref = _reference_qa(out)
    batch = sample_batches(source)[0]
    with torch.no_grad():
        start, _ = model.qa_logits(batch["input_ids"], batch["attention_mask"])
        want = ref(**batch).start_logits
    assert (start - want)[batch["attention_mask"].bool()].abs().max() < 1e-5
    assert set(to_hf_state_dict("distilbert", model.state_dict())) == set(
        load_file(str(out / "model.safetensors"))
    )


def test_overlay_overrides_base_weights(tmp_path):
    base = resolve_model("tiny-bert")
    overlay = tmp_path / "overlay.safetensors"
    save_file(
        {"qa_outputs.weight": torch.full((2, 64), 0.5), "qa_outputs.bias": torch.tensor([1.0, -1.0])},
        str(overlay),
    )
    model = build_model(ModelSource("o", base.checkpoint, base.config, base.tokenizer_dir, (overlay,)))
    assert torch.equal(model.qa_outputs.bias, torch.tensor([1.0, -1.0]))
    assert torch.equal(model.qa_outputs.weight, torch.full((2, 64), 0.5))
