"""A ModelProfile from the analytic cost model: anchored to the measured latency, hops and memory counted."""

from __future__ import annotations

import pytest

from shardserve.models.config import EncoderConfig
from shardserve.partitioner.cost import analytic_costs
from shardserve.partitioner.placement.cost_profile import (
    estimated_single_latency_s,
    parallel_configs,
    profile_from_cost_model,
)
from shardserve.partitioner.placement.latency import PlacementError

MINILM = EncoderConfig(
    arch="bert",
    vocab_size=30522,
    hidden_size=384,
    num_layers=6,
    num_heads=12,
    intermediate_size=1536,
    max_position_embeddings=512,
)


def test_pp1_batch1_is_the_measured_latency_and_stages_add_hops() -> None:
    prof = profile_from_cost_model(
        "a", MINILM, single_latency_s=0.020, max_devices=4, hop_s=0.001, seq_len=384
    )
    assert prof.latency.configs == ((1, 1), (2, 1), (3, 1), (4, 1))
    assert prof.latency.latency(1, 1, 1) == pytest.approx(0.020)
    two = prof.latency.stages(2, 1, 1)
    assert sum(two) == pytest.approx(0.020 + 2 * 0.001)  # the same compute, plus one hop per stage
    assert max(two) < 0.012  # the balanced split: no stage carries much more than half
    assert prof.latency.latency(1, 1, 8) == pytest.approx(8 * 0.020)  # fixed_share 0: no batching gain
    batched = profile_from_cost_model("a", MINILM, single_latency_s=0.020, fixed_share=0.5)
    assert batched.latency.latency(1, 1, 8) == pytest.approx(0.020 * (0.5 + 0.5 * 8))


def test_memory_is_the_parameters_with_stage_zero_holding_the_embeddings() -> None:
    prof = profile_from_cost_model("a", MINILM, single_latency_s=0.02, max_devices=2, dtype_bytes=2)
    params = sum(u.params for u in analytic_costs(MINILM, seq_len=384))
    assert prof.param_bytes == 2 * params
    first, last = prof.stage_bytes[(2, 1)]
    assert first > last and first + last == prof.param_bytes  # word embeddings sit in stage 0
    assert prof.weight_bytes(2, 1, 0) == first and prof.weight_bytes(1, 1, 0) == prof.param_bytes
    assert prof.activation_bytes > 0


def test_tensor_parallel_configs_only_when_asked_and_when_heads_divide() -> None:
    assert parallel_configs(MINILM, max_devices=4) == [(1, 1), (2, 1), (3, 1), (4, 1)]
    with_tp = parallel_configs(MINILM, max_devices=4, tensor_parallel=True)
    assert (1, 2) in with_tp and (2, 2) in with_tp and (1, 4) in with_tp and (1, 3) in with_tp
    assert (1, 5) not in parallel_configs(MINILM, max_devices=5, tensor_parallel=True)  # 12 heads
    prof = profile_from_cost_model(
        "a", MINILM, single_latency_s=0.02, configs=[(1, 1), (1, 2)], allreduce_s=0.0005
    )
    assert prof.latency.latency(1, 2, 1) == pytest.approx(0.01 + 2 * 6 * 0.0005)


def test_estimate_and_bad_values() -> None:
    # MiniLM at 384 tokens is about 9.6 GFLOP: ~0.19 s at the assumed 50 GFLOP/s of a CPU
    assert estimated_single_latency_s(MINILM, seq_len=384, device="cpu") == pytest.approx(0.19, rel=0.05)
    assert estimated_single_latency_s(MINILM, seq_len=384, device="cuda") < 0.01
    with pytest.raises(PlacementError, match=r"single_latency_s=0 must be > 0; hop_s=-1 must be >= 0"):
        profile_from_cost_model("a", MINILM, single_latency_s=0, hop_s=-1)
    with pytest.raises(PlacementError, match="pp=7 stages need at most num_layers=6"):
        profile_from_cost_model("a", MINILM, single_latency_s=0.01, configs=[(7, 1)])


def test_a_named_gpus_roofline_batches_small_models_almost_free_and_big_ones_not() -> None:
    from shardserve.models.shapes import shape_config
    from shardserve.partitioner.placement.cost_profile import cost_profiles
    from shardserve.partitioner.placement.gpus import GPUS, roofline_batch_time

    h100 = GPUS["h100"]
    small = roofline_batch_time(shape_config("minilm-l6"), h100, seq_len=128, dtype_bytes=2)
    big = roofline_batch_time(shape_config("qwen2-1.5b"), h100, seq_len=384, dtype_bytes=2)
    assert small(8) < 1.5 * small(1)  # launch- and memory-bound: batching is nearly free
    assert big(8) > 5 * big(1) > 0  # compute-bound: 8 requests take ~5.6 times one (launches are fixed)
    assert big(1) > 10 * small(1)
    configs = {"s": shape_config("minilm-l6"), "q": shape_config("qwen2-1.5b")}
    profiles, single, how = cost_profiles(
        configs, devices=2, seq_len=384, max_batch_size=8, dtype_bytes=2, gpu=h100
    )
    assert how.startswith("roofline of NVIDIA H100") and single["q"] == pytest.approx(big(1))
    q = {p.name: p for p in profiles}["q"]
    assert q.latency.stages(2, 1, 1) == pytest.approx((big(1) * 0.5 + h100.hop_s,) * 2, rel=0.1)
    assert q.param_bytes == pytest.approx(2 * 1.54e9, rel=0.01)  # bf16 weights of a 1.5 B model


def test_tensor_parallel_on_a_named_gpu_shares_the_compute_not_the_launches() -> None:
    from shardserve.models.shapes import shape_config
    from shardserve.partitioner.placement.cost_profile import cost_profiles
    from shardserve.partitioner.placement.gpus import GPUS, roofline_batch_time

    h100 = GPUS["h100"]
    large, qwen = shape_config("bert-large"), shape_config("qwen2-1.5b")
    big = roofline_batch_time(large, h100, seq_len=384, dtype_bytes=2)
    small = roofline_batch_time(shape_config("minilm-l6"), h100, seq_len=128, dtype_bytes=2)
    launches = large.num_layers * h100.launch_s
    assert big(8, 4) == pytest.approx((big(8) - launches) / 4 + launches)  # compute-bound: shared
    assert small(1, 4) > 0.9 * small(1)  # launch-bound: four shards gain almost nothing
    assert max_tp_configs(large, 8) == [(1, 2), (1, 4), (1, 8)]
    assert max_tp_configs(qwen, 8) == [(1, 2)]  # 2 key/value heads
    assert max_tp_configs(large, 4) == [(1, 2), (1, 4)]
    kw = {"devices": 8, "seq_len": 384, "max_batch_size": 8, "dtype_bytes": 2, "gpu": h100}
    profiles, _, _ = cost_profiles({"l": large, "q": qwen}, max_tp=8, **kw)
    lp = {p.name: p for p in profiles}["l"]
    assert lp.latency.has(2, 4) and lp.latency.has(1, 8)
    two_per_layer = 2 * large.num_layers * h100.allreduce_s
    assert lp.latency.stages(1, 4, 8) == pytest.approx((big(8, 4) + two_per_layer,))
    assert lp.weight_bytes(1, 4, 0) < lp.param_bytes / 3  # each shard holds about a quarter
    pipelines, _, _ = cost_profiles({"l": large, "q": qwen}, **kw)  # max_tp 1: pipelines only
    assert all(tp == 1 for p in pipelines for _, tp in p.latency.configs)


def max_tp_configs(config: EncoderConfig, max_tp: int) -> list[tuple[int, int]]:
    """The single-stage tensor-parallel configs over up to 8 devices."""
    got = parallel_configs(config, max_devices=8, tensor_parallel=True, max_tp=max_tp)
    return [c for c in got if c[0] == 1 and c[1] > 1]
