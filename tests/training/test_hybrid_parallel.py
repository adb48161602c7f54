"""Hybrid data x pipeline x tensor parallel training equals single-process training, and a run
checkpointed at one (dp, pp, tp) resumes at another (elastic resume).

- parity: (dp, pp, tp) in {(2, 1, 1), (2, 2, 1), (2, 1, 2)} give the parameters of the plain
  single-process loop on the same data (tiny-bert, fp32, dropout 0) within 1e-5 after 3 steps,
  and the same losses and gradient norms, with a clip norm low enough that clipping triggers
  at every step (asserted from the logged norms);
  the gradient all-reduce runs in several buckets, some launched during the backward;
- elastic: 4 steps at (2, 2, 1), then ``--resume --elastic`` at (1, 1, 1) for 4 more equals 8
  single-process steps, and the dp=2 checkpoint is the same files a dp=1 run writes;
- re-sharding in-process: a (pp, tp) = (2, 4) training state (parameters and AdamW moments, the
  vocabulary split unevenly) restores into one unsharded model exactly;
- pure pieces: ``ParallelDims`` rank layout and validation, bucketing, config round trip.

    python -m pytest tests/training/test_hybrid_parallel.py -q
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from shardserve.models.build import build_model
from shardserve.models.encoder import EncoderForQA
from shardserve.models.registry import resolve_model
from shardserve.partitioner.cost import InfeasiblePlanError, ring_allreduce_bytes
from shardserve.partitioner.data_parallel import make_buckets
from shardserve.partitioner.plan import ParallelDims, PartitionPlan, make_plan
from shardserve.partitioner.shard_loading import shard_specs_of
from shardserve.partitioner.stages import slice_stage
from shardserve.partitioner.tensor_parallel import apply_tensor_parallel
from shardserve.training.checkpoint import ResumeError, list_checkpoints, resume_point
from shardserve.training.checkpoint_shards import load_resharded, write_shard
from shardserve.training.config import TrainConfig, TrainConfigError
from shardserve.training.driver import train
from tests.training.test_trainer_parity import base_config, max_diff, reference_weights

TOL = 1e-5
CLIP = 0.5  # tiny-bert's gradient norm on this data is well above it: clipping triggers


def test_dims_layout_is_megatron_tp_then_pp_then_dp() -> None:
    dims = ParallelDims(dp=2, pp=2, tp=2)
    assert dims.world_size == 8 and dims.model_parallel_size == 4
    assert [dims.rank_of(s, t, d) for d in range(2) for s in range(2) for t in range(2)] == list(range(8))
    assert dims.coords(5) == (0, 1) and dims.dp_rank(5) == 1
    assert dims.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.model_parallel_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(InfeasiblePlanError, match=r"dp=2 x pp=2 x tp=2 = 8 ranks, but the world has 6"):
        dims.validate_world(6)
    with pytest.raises(InfeasiblePlanError, match=r"3 devices given for dp=2 x pp=2 x tp=2 = 8"):
        dims.validate_world(8, n_devices=3)
    with pytest.raises(InfeasiblePlanError, match="dp=0"):
        ParallelDims(dp=0)
    assert ring_allreduce_bytes(1000, 1) == 0 and ring_allreduce_bytes(1000, 4) == 1500


def test_buckets_reverse_order_and_cap() -> None:
    params = [nn.Parameter(torch.zeros(n)) for n in (10, 20, 30, 40)]  # 40..160 bytes
    params[1].requires_grad_(False)
    buckets = make_buckets(params, bucket_bytes=200)
    assert [[int(p.numel()) for p in b] for b in buckets] == [[40], [30, 10]]


def test_config_dp_is_validated_and_absent_on_disk_when_1(tmp_path) -> None:
    with pytest.raises(TrainConfigError, match=r"= 3 micro-batches cannot be split evenly over dp=2"):
        base_config(tmp_path, batch_size=6, micro_batch_size=2, dp=2)
    cfg = base_config(tmp_path)
    assert "dp" not in cfg.to_dict() and "elastic" not in cfg.to_dict()
    two = dataclasses.replace(cfg, dp=2)
    assert two.to_dict()["dp"] == 2 and TrainConfig.from_dict(json.loads(json.dumps(two.to_dict()))) == two
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))).dp == 1


def test_reshard_pp2_tp4_state_into_one_model(tmp_path) -> None:
    source = resolve_model("tiny-bert")
    gen = torch.Generator().manual_seed(0)
    full = {n: p.shape for n, p in build_model(source).named_parameters()}
    want = {
        f"{prefix}{n}{suffix}": torch.randn(shape, generator=gen)
        for n, shape in full.items()
        for prefix, suffix in (("", ""), ("optim.", ".exp_avg"), ("optim.", ".exp_avg_sq"))
    }
    plan = make_plan(source.config, ParallelDims(pp=2, tp=4))
    for rank in range(plan.dims.world_size):
        stage, tp_rank = plan.dims.coords(rank)
        with torch.device("meta"):
            model = EncoderForQA(source.config)
        slice_stage(model, plan, stage)
        apply_tensor_parallel(model, tp_rank=tp_rank, tp_size=4, group=None)
        specs = shard_specs_of(model)
        tensors: dict[str, torch.Tensor] = {}
        for n, _ in model.named_parameters():
            part = specs[n].take if n in specs else (lambda t: t)
            tensors[n] = part(want[n])
            tensors[f"optim.{n}.exp_avg"] = part(want[f"optim.{n}.exp_avg"])
            tensors[f"optim.{n}.exp_avg_sq"] = part(want[f"optim.{n}.exp_avg_sq"])
            tensors[f"optim.{n}.step"] = torch.tensor(3.0)
        write_shard(tmp_path / "training_state" / f"rank{rank}.safetensors", tensors, specs, tp_rank=tp_rank)
    assert source.config.vocab_size % 4  # an uneven vocabulary split is covered
    model = build_model(source)
    opt = torch.optim.AdamW(model.parameters())
    load_resharded(tmp_path, model, opt)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), want[n]), n
        state = opt.state[p]
        assert torch.equal(state["exp_avg"], want[f"optim.{n}.exp_avg"]), n
        assert torch.equal(state["exp_avg_sq"], want[f"optim.{n}.exp_avg_sq"]), n
        assert float(state["step"]) == 3.0


def test_reshard_albert_s_shared_layer_into_a_stage_of_another_layout(tmp_path) -> None:
    """ALBERT's one layer: each pp=3 stage writes its copy under the index of its first layer (0, 2,
    4); the last stage of a pp=2 layout (first layer 3) finds it under its own index."""
    source = resolve_model("tiny-albert")
    gen = torch.Generator().manual_seed(0)
    full = {n: p.shape for n, p in build_model(source).named_parameters()}  # the shared layer: layers.0
    want = {n: torch.randn(shape, generator=gen) for n, shape in full.items()}

    def canonical(name: str) -> str:
        return re.sub(r"^layers\.\d+\.", "layers.0.", name)

    def stage_of(plan: PartitionPlan, stage: int) -> EncoderForQA:
        with torch.device("meta"):
            model = EncoderForQA(source.config)
        return slice_stage(model, plan, stage)

    three = make_plan(source.config, ParallelDims(pp=3))
    for rank in range(3):
        model = stage_of(three, rank)
        tensors = {n: want[canonical(n)] for n, _ in model.named_parameters()}
        assert any(n.startswith(f"layers.{2 * rank}.") for n in tensors)  # its copy, under its index
        write_shard(tmp_path / "training_state" / f"rank{rank}.safetensors", tensors, {}, tp_rank=0)
    two = make_plan(source.config, ParallelDims(pp=2))
    last = stage_of(two, 1).to_empty(device="cpu")
    assert two.stages[1].layer_start == 3
    load_resharded(tmp_path, last, None)
    for n, p in last.named_parameters():
        assert torch.equal(p.detach(), want[canonical(n)]), n


def reference_with_norms(cfg: TrainConfig, monkeypatch) -> tuple[dict, list[float], list[float]]:
    """``reference_weights`` plus the single-process gradient norm before clipping, per step.

    Clipping at every step makes the update blind to a constant factor on the gradient (clipped
    g = g * clip / |g|), so the norms themselves are compared too: they catch a mean-instead-of-sum
    over the replicas and a norm counted once per replica."""
    norms: list[float] = []
    clip = torch.nn.utils.clip_grad_norm_

    def recording(*args, **kw):
        norm = clip(*args, **kw)
        norms.append(float(norm))
        return norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording)
    want, losses = reference_weights(cfg)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    return want, losses, norms


@pytest.mark.parametrize(
    ("dp", "pp", "tp"), [(2, 1, 1), (2, 2, 1), (2, 1, 2)], ids=["dp2", "dp2-pp2", "dp2-tp2"]
)
def test_hybrid_training_matches_single_process(tmp_path, monkeypatch, dp, pp, tp):
    # 64 KiB buckets: tiny-bert's gradients travel in several buckets, most during the backward
    cfg = base_config(tmp_path, dp=dp, pp=pp, tp=tp, max_grad_norm=CLIP, bucket_mb=1 / 16)
    want, ref_losses, ref_norms = reference_with_norms(cfg, monkeypatch)
    result = train(cfg, show_progress=False)
    got = load_file(str(result.final_checkpoint / "model.safetensors"))
    diff, where = max_diff(got, want)
    assert diff <= TOL, f"max |param diff| {diff:.3g} at {where}"
    steps = range(1, cfg.max_steps + 1)
    assert [result.losses[s] for s in steps] == pytest.approx(ref_losses, abs=1e-5)
    norms = [result.grad_norms[s] for s in steps]
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    assert min(norms) > CLIP, norms  # the norm before clipping: clipping acted at every step
    assert result.reduce_stats, "no all-reduce statistics reported"
    for stats in result.reduce_stats.values():
        assert stats["buckets"] >= 2 and stats["launched_in_backward"] >= 1, stats


def test_elastic_resume_dp2_pp2_to_single_process(tmp_path):
    common = dict(max_steps=8, max_grad_norm=CLIP)
    want, ref_losses = reference_weights(base_config(tmp_path / "ref", **common))
    first = base_config(tmp_path, dp=2, pp=2, tp=1, save_every=4, fail_at_step=4, **common)
    with pytest.raises(Exception, match="rank 3"):  # the last rank exits hard at step 4
        train(first, show_progress=False)
    out = tmp_path / "run"
    assert [s for s, _ in list_checkpoints(out)] == [4]
    ckpt = out / "checkpoint-4"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert (state["dp"], state["pp"], state["tp"]) == (2, 2, 1)
    # dp-free: replica 0's two ranks wrote the same files a dp=1 run writes
    assert sorted(p.name for p in (ckpt / "training_state").iterdir()) == [
        "rank0.safetensors",
        "rank1.safetensors",
    ]
    single = dataclasses.replace(first, dp=1, pp=1, tp=1, fail_at_step=None, resume=True)
    kw = dict(total_steps=8, data_sha256=state["data_sha256"], compute_dtype="float32")
    with pytest.raises(ResumeError, match="--elastic"):
        resume_point(single, **kw)
    resumed = train(dataclasses.replace(single, elastic=True), show_progress=False)
    assert sorted(resumed.losses) == [5, 6, 7, 8]
    got = load_file(str(resumed.final_checkpoint / "model.safetensors"))
    diff, where = max_diff(got, want)
    assert diff <= TOL, f"max |param diff| {diff:.3g} at {where}"
    assert [resumed.losses[s] for s in range(5, 9)] == pytest.approx(ref_losses[4:], abs=1e-5)
