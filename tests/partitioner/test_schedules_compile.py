"""Experimental ``GangSpec.compile``: a compiled serving stage gives the eager logits, warmed up first.

Uses tiny-bert and the ``eager`` backend (dynamo capture with dynamic shapes, the
warm-up and the plumbing, without inductor's minutes of C++ compilation on a 2-core machine); the
inductor numerics and throughput are measured by ``benchmarks/bench_kernels.py`` (figures, not tests).
"""

from __future__ import annotations

import torch

from models.build import build_model
from models.registry import resolve_model
from partitioner.gang import Gang
from partitioner.plan import ParallelDims, make_plan
from partitioner.schedules import compile_stage, warm_up
from partitioner.stages import build_stage
from partitioner.worker import GangSpec, RankContext


def _spec(pp: int = 1, **kw) -> GangSpec:
    source = resolve_model("tiny-bert")
    return GangSpec(source, make_plan(source.config, ParallelDims(pp=pp, tp=1)), **kw)


def _batch(n: int = 3, s: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 2000, (n, s), generator=gen)
    mask = torch.ones(n, s, dtype=torch.long)
    mask[1, 15:] = 0  # padding
    return ids, mask


def test_compiled_stage_matches_eager_after_warm_up():
    spec = _spec(warmup_lengths=(16, 20))
    stage = build_stage(spec.source, spec.plan, rank=0, tp_group=None)
    ctx = RankContext(0, 0, 0, spec, torch.device("cpu"), "gloo", None, None, None)
    run = compile_stage(stage, backend="eager")
    warm_up(run, ctx, spec.warmup_lengths)
    ids, mask = _batch()
    with torch.inference_mode():
        want = stage(ids, mask)
        got = run(ids, mask)
    assert got.shape == want.shape == (3, 20, 2)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_gang_with_compile_warms_up_and_matches_the_eager_model():
    ids, mask = _batch()
    spec = _spec(pp=2, compile=True, compile_backend="eager", warmup_lengths=(20,))
    with torch.inference_mode():
        want = build_model(spec.source)(ids, mask)
    with Gang(spec) as gang:
        assert all(info["compile_warmup_s"] > 0 for info in gang.stats.ready_info.values())
        (got,) = gang.run([(ids, mask, None)], timeout_s=120)
    torch.testing.assert_close(torch.as_tensor(got), want, atol=1e-4, rtol=1e-4)
