"""EncoderConfig: mapping Hugging Face configs, and errors that name the problem."""

from __future__ import annotations

import json

import pytest

from shardserve.models.bundled import minilm_dir
from shardserve.models.config import EncoderConfig, ModelConfigError
from shardserve.models.presets import TINY_PRESETS


def test_minilm_config_maps_fields():
    cfg = EncoderConfig.from_pretrained_dir(minilm_dir())
    assert (cfg.arch, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.intermediate_size) == (
        "bert",
        384,
        6,
        12,
        1536,
    )
    assert cfg.head_dim == 32 and cfg.type_vocab_size == 2 and cfg.max_seq_len == 512


@pytest.mark.parametrize("name", sorted(TINY_PRESETS))
def test_tiny_presets_map(name):
    cfg = EncoderConfig.from_hf_dict(TINY_PRESETS[name])
    assert cfg.hidden_size == 64 and cfg.num_layers == 6 and cfg.num_heads == 4
    types = {"tiny-roberta": 1, "tiny-xlm-roberta": 1, "tiny-distilbert": 0}
    types |= dict.fromkeys(
        ("tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-deberta-v2", "tiny-modernbert"), 0
    )
    assert cfg.type_vocab_size == types.get(name, 2)
    assert cfg.is_decoder == (name in ("tiny-llama", "tiny-qwen2", "tiny-mistral"))
    assert cfg.num_kv_heads == (2 if cfg.is_decoder else 4)
    assert cfg.gated_mlp == (cfg.is_decoder or name == "tiny-modernbert")
    assert cfg.projects_embeddings == (name in ("tiny-electra", "tiny-albert"))
    assert cfg.embedding_size == (32 if cfg.projects_embeddings else 64)
    assert cfg.shares_layers == (name == "tiny-albert")


def test_decoder_configs_keep_their_whole_config_for_transformers():
    cfg = EncoderConfig.from_hf_dict(TINY_PRESETS["tiny-qwen2"])
    assert cfg.qkv_bias and cfg.max_seq_len == 512 and not cfg.uses_token_types
    assert json.loads(cfg.hf_config_json)["num_key_value_heads"] == 2
    assert not EncoderConfig.from_hf_dict(TINY_PRESETS["tiny-llama"]).qkv_bias
    with pytest.raises(
        ModelConfigError, match="num_attention_heads=4 is not a multiple of num_key_value_heads=3"
    ):
        EncoderConfig.from_hf_dict({**TINY_PRESETS["tiny-llama"], "num_key_value_heads": 3})
    with pytest.raises(ModelConfigError, match="missing field 'intermediate_size' for model_type='mistral'"):
        EncoderConfig.from_hf_dict(
            {k: v for k, v in TINY_PRESETS["tiny-mistral"].items() if k != "intermediate_size"}
        )


def test_deberta_with_a_convolution_is_refused_with_its_number():
    with pytest.raises(ModelConfigError, match="conv_kernel_size=3 is unsupported"):
        EncoderConfig.from_hf_dict({**TINY_PRESETS["tiny-deberta-v2"], "conv_kernel_size": 3})


def test_roberta_max_seq_len_reserves_padding_offset():
    cfg = EncoderConfig.from_hf_dict(TINY_PRESETS["tiny-roberta"])
    assert cfg.max_seq_len == 514 - 0 - 1
    xlmr = EncoderConfig.from_hf_dict(TINY_PRESETS["tiny-xlm-roberta"])
    assert xlmr.arch == "xlm-roberta" and xlmr.padding_offset_positions and xlmr.max_seq_len == 514 - 1 - 1


def test_electra_embeddings_of_their_own_width_must_be_positive():
    with pytest.raises(ModelConfigError, match="embedding_size=-1 must be positive"):
        EncoderConfig.from_hf_dict({**TINY_PRESETS["tiny-electra"], "embedding_size": -1})


def test_unsupported_architecture_is_named():
    with pytest.raises(ModelConfigError, match="unsupported model_type='gpt2'"):
        EncoderConfig.from_hf_dict({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


def test_heads_not_dividing_hidden_prints_numbers():
    bad = {**TINY_PRESETS["tiny-bert"], "num_attention_heads": 5}
    with pytest.raises(ModelConfigError, match="hidden_size=64 is not divisible by num_attention_heads=5"):
        EncoderConfig.from_hf_dict(bad)


def test_missing_field_is_named(tmp_path):
    bad = dict(TINY_PRESETS["tiny-bert"])
    del bad["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ModelConfigError, match=r"config.json: missing field 'hidden_size'"):
        EncoderConfig.from_pretrained_dir(tmp_path)


def test_missing_and_corrupt_config_files(tmp_path):
    with pytest.raises(ModelConfigError, match=r"no config\.json"):
        EncoderConfig.from_pretrained_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="unreadable config"):
        EncoderConfig.from_pretrained_dir(tmp_path)


def test_albert_with_several_layer_groups_is_refused_with_the_numbers():
    with pytest.raises(ModelConfigError, match="num_hidden_groups=2, inner_group_num=1 is unsupported"):
        EncoderConfig.from_hf_dict({**TINY_PRESETS["tiny-albert"], "num_hidden_groups": 2})
