"""Shard-at-load: every tensor-parallel rank reads exactly its slice of the checkpoint (one process)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from shardserve.models.build import build_model
from shardserve.models.encoder import EncoderForQA
from shardserve.models.hf_weights import CheckpointError
from shardserve.models.registry import ModelSource, resolve_model
from shardserve.partitioner.shard_loading import ShardSlice, load_shard, shard_spec
from shardserve.partitioner.tensor_parallel import apply_tensor_parallel


def _sharded(source: ModelSource, *, tp_rank: int, tp_size: int) -> EncoderForQA:
    with torch.device("meta"):
        model = EncoderForQA(source.config)
    apply_tensor_parallel(model, tp_rank=tp_rank, tp_size=tp_size, group=None)
    return model.to_empty(device="cpu")


def _lora_overlay(tmp_path, source: ModelSource) -> ModelSource:
    gen = torch.Generator().manual_seed(0)
    h, i, r = source.config.hidden_size, source.config.intermediate_size, 4
    factors = {
        "layers.0.attention.query.lora_A": torch.randn(r, h, generator=gen),  # column-parallel base
        "layers.0.attention.query.lora_B": torch.randn(h, r, generator=gen),
        "layers.1.mlp.down.lora_A": torch.randn(r, i, generator=gen),  # row-parallel base
        "layers.1.mlp.down.lora_B": torch.randn(h, r, generator=gen),
    }
    save_file(factors, str(tmp_path / "overlay.safetensors"))
    return ModelSource(
        "lora", source.checkpoint, source.config, source.tokenizer_dir, (tmp_path / "overlay.safetensors",)
    )


@pytest.mark.parametrize("with_lora", [False, True])
def test_each_rank_loads_its_slice_of_the_whole_model(tmp_path, with_lora):
    source = resolve_model("tiny-bert")
    if with_lora:
        source = _lora_overlay(tmp_path, source)
    whole = dict(build_model(source).named_parameters())
    whole_bytes = sum(p.numel() * p.element_size() for p in whole.values())
    for tp_rank in range(2):
        model = _sharded(source, tp_rank=tp_rank, tp_size=2)
        report = load_shard(model, source.weights(), source.config)
        assert report.bytes_read < whole_bytes  # sharded tensors were read in part
        for name, param in model.named_parameters():
            spec = shard_spec(model, name)
            want = whole[name] if spec is None else whole[name].narrow(spec.dim, spec.start, spec.length)
            assert torch.allclose(param, want, atol=1e-6), name
    assert shard_spec(model, "layers.0.attention.query.weight") == ShardSlice(0, 32, 32)
    assert shard_spec(model, "layers.0.attention.out.weight") == ShardSlice(1, 32, 32)
    assert shard_spec(model, "layers.0.attention.out.bias") is None


def test_shard_outside_the_stored_tensor_is_refused():
    source = resolve_model("tiny-bert")
    model = _sharded(source, tp_rank=1, tp_size=2)
    model.layers["0"].mlp.up.shard_specs["weight"] = ShardSlice(0, 100, 64)  # rows 100..163 of 128
    with pytest.raises(CheckpointError, match=r"intermediate.dense.weight.*has shape \[128, 64\]"):
        load_shard(model, source.weights(), source.config)


def test_a_fused_projection_is_split_block_by_block_and_joins_back(tmp_path):
    """ModernBERT's Wqkv: three blocks (q, k, v) of 8 rows, two ranks: each holds rows 0-3 or 4-7 of
    every block; the training checkpoint's merge puts them back in place."""
    from shardserve.training.checkpoint_shards import merge_shards, write_shard

    full = torch.arange(24 * 2, dtype=torch.float32).reshape(24, 2)  # (3 blocks x 8 rows, 2)
    specs = [ShardSlice(0, 4 * r, 4, blocks=3) for r in range(2)]
    parts = [s.take(full) for s in specs]
    assert parts[1][:, 0].tolist() == [8, 10, 12, 14, 24, 26, 28, 30, 40, 42, 44, 46]  # rows 4-7 of each
    for r, (spec, part) in enumerate(zip(specs, parts, strict=True)):
        write_shard(tmp_path / f"rank{r}.safetensors", {"w": part}, {"w": spec}, tp_rank=r)
    assert torch.equal(merge_shards(sorted(tmp_path.glob("rank*.safetensors")))["w"], full)
