"""PartitionPlan, cost model and balanced split: pure logic, no processes."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from shardserve.models.build import new_model
from shardserve.models.bundled import minilm_dir
from shardserve.models.config import EncoderConfig
from shardserve.models.presets import TINY_PRESETS
from shardserve.partitioner.cost import (
    InfeasiblePlanError,
    UnitCost,
    analytic_costs,
    balanced_split,
    stage_costs,
    training_memory_bytes,
)
from shardserve.partitioner.plan import ParallelDims, make_plan
from shardserve.partitioner.stages import slice_stage
from shardserve.partitioner.tensor_parallel import apply_tensor_parallel

MINILM = EncoderConfig.from_pretrained_dir(minilm_dir())
TINY = EncoderConfig.from_hf_dict(TINY_PRESETS["tiny-bert"])


def test_tp_must_divide_heads():
    with pytest.raises(InfeasiblePlanError, match="tp=5 does not divide num_attention_heads=12"):
        make_plan(MINILM, ParallelDims(pp=1, tp=5))


def test_pp_larger_than_layers_rejected():
    with pytest.raises(
        InfeasiblePlanError, match="pp=7 stages need at least one layer each, but num_layers=6"
    ):
        make_plan(MINILM, ParallelDims(pp=7, tp=1))


def test_nonpositive_degrees_rejected():
    with pytest.raises(InfeasiblePlanError, match="pp=0 and tp=1"):
        ParallelDims(pp=0, tp=1)


@pytest.mark.parametrize("bounds", [[3, 3], [0, 2], [2, 6], [4]])
def test_bad_manual_boundaries_rejected(bounds):
    with pytest.raises(InfeasiblePlanError, match="boundaries="):
        make_plan(MINILM, ParallelDims(pp=3, tp=1), boundaries=bounds)


def test_manual_boundaries_respected():
    plan = make_plan(MINILM, ParallelDims(pp=3, tp=2), boundaries=[1, 5])
    assert [(s.layer_start, s.layer_end) for s in plan.stages] == [(0, 1), (1, 5), (5, 6)]
    assert plan.cost_source == "manual"
    assert [s.ranks for s in plan.stages] == [(0, 1), (2, 3), (4, 5)]
    assert plan.dims.coords(3) == (1, 1) and plan.stage_of(5).has_head


def test_even_layers_split_evenly():
    plan = make_plan(MINILM, ParallelDims(pp=2, tp=1))
    assert [(s.layer_start, s.layer_end) for s in plan.stages] == [(0, 3), (3, 6)]
    assert plan.stages[0].has_embeddings and not plan.stages[0].has_head and plan.stages[1].has_head
    assert sum(s.cost_share for s in plan.stages) == pytest.approx(1.0)


def test_heavy_embeddings_shift_layers_to_later_stage():
    costs = analytic_costs(MINILM, seq_len=128)
    heavy = [UnitCost("embeddings", 2.5 * costs[1].cost, 0, 0), *costs[1:]]
    plan = make_plan(MINILM, ParallelDims(pp=2, tp=1), costs=heavy)
    assert [(s.layer_start, s.layer_end) for s in plan.stages] == [(0, 2), (2, 6)]


def _brute_force(costs: list[UnitCost], pp: int) -> float:
    n = len(costs) - 2
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), pp - 1):
        edges = [0, *cuts, n]
        best = min(best, max(stage_costs(costs, list(itertools.pairwise(edges)))))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_balanced_split_is_optimal(seed):
    rng = random.Random(seed)
    n, pp = rng.randint(2, 9), 0
    pp = rng.randint(1, n)
    costs = [UnitCost(f"u{i}", rng.uniform(0.1, 5.0), 0, 0) for i in range(n + 2)]
    bounds = balanced_split(costs, pp)
    assert len(bounds) == pp and bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in itertools.pairwise(bounds))
    assert max(stage_costs(costs, bounds)) == pytest.approx(_brute_force(costs, pp))


ALBERT = EncoderConfig.from_hf_dict(TINY_PRESETS["tiny-albert"])
LLAMA = EncoderConfig.from_hf_dict(TINY_PRESETS["tiny-llama"])
QWEN2 = EncoderConfig.from_hf_dict(TINY_PRESETS["tiny-qwen2"])
MODERNBERT = EncoderConfig.from_hf_dict(TINY_PRESETS["tiny-modernbert"])
DEBERTA = EncoderConfig.from_hf_dict(TINY_PRESETS["tiny-deberta-v2"])
ELECTRA = EncoderConfig.from_hf_dict(TINY_PRESETS["tiny-electra"])


@pytest.mark.parametrize(
    ("config", "pp", "tp"),
    [(MINILM, 1, 1), (MINILM, 2, 1), (MINILM, 3, 1), (MINILM, 1, 2), (MINILM, 2, 2), (MINILM, 3, 4),
     (ALBERT, 1, 1), (ALBERT, 2, 1), (ALBERT, 3, 2), (LLAMA, 1, 1), (LLAMA, 2, 2), (QWEN2, 3, 2),
     (MODERNBERT, 2, 2), (QWEN2, 1, 4), (LLAMA, 2, 4), (DEBERTA, 1, 1), (DEBERTA, 3, 2), (ELECTRA, 2, 2)],
    ids=["1-1", "2-1", "3-1", "1-2", "2-2", "3-4", "albert-1-1", "albert-2-1", "albert-3-2", "llama-1-1",
         "llama-2-2", "qwen2-3-2", "modernbert-2-2", "qwen2-1-4", "llama-2-4", "deberta-1-1", "deberta-3-2",
         "electra-2-2"],
)  # fmt: skip
def test_params_per_rank_match_built_stages(config, pp, tp):
    """The plan's parameter count per rank equals what the largest rank actually materialises (ALBERT:
    its one shared layer once in each stage; the decoders' grouped-query projections, whole key/value
    heads when tp exceeds them, Qwen2's q/k/v biases and final norm; DeBERTa-v3's relative-position
    table on every stage and no absolute one; ELECTRA's narrower vocabulary rows)."""
    plan = make_plan(config, ParallelDims(pp=pp, tp=tp))
    for stage in plan.stages:
        for tp_rank in range(tp):
            with torch.device("meta"):
                model = new_model(config)
            slice_stage(model, plan, stage.index)
            apply_tensor_parallel(model, tp_rank=tp_rank, tp_size=tp, group=None)
            held = sum(p.numel() for p in model.parameters())
            # an uneven vocabulary split leaves the last tp rank a few rows short
            assert held == stage.params_per_rank if tp_rank == 0 else held <= stage.params_per_rank


def test_memory_estimates_follow_16_bytes_rule():
    plan = make_plan(MINILM, ParallelDims(pp=2, tp=2))
    mem = plan.memory_estimates(MINILM, batch_size=8, seq_len=128)
    for s, m in zip(plan.stages, mem, strict=True):
        assert m["training_bytes"] > 16 * s.params_per_rank
        assert m["serving_bytes"] > 4 * s.params_per_rank
    # activations of a stage scale with the micro-batches 1F1B keeps in flight (pp - stage)
    act0 = training_memory_bytes(0, MINILM, n_layers=3, batch_size=8, seq_len=128, tp=2, stage_index=0, pp=2)
    act1 = training_memory_bytes(0, MINILM, n_layers=3, batch_size=8, seq_len=128, tp=2, stage_index=1, pp=2)
    assert act0 == 2 * act1


def test_plan_to_dict_is_json_ready():
    import json

    d = make_plan(TINY, ParallelDims(pp=3, tp=2)).to_dict()
    again = json.loads(json.dumps(d))
    assert again["world_size"] == 6 and [s["ranks"] for s in again["stages"]] == [[0, 1], [2, 3], [4, 5]]
    assert [(s["layer_start"], s["layer_end"]) for s in again["stages"]] == [(0, 2), (2, 4), (4, 6)]
