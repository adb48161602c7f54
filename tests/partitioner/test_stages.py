"""Pipeline stages chained in one process reproduce the whole model (tp == 1, no processes)."""

from __future__ import annotations

import pytest
import torch

from shardserve.models.build import build_model
from shardserve.models.registry import resolve_model
from shardserve.partitioner.plan import ParallelDims, make_plan
from shardserve.partitioner.stages import build_stage
from shardserve.partitioner.stream.verify import sample_batches


@pytest.mark.parametrize("name", ["tiny-bert", "tiny-distilbert"])
@pytest.mark.parametrize("pp", [2, 3, 6])
def test_chained_stages_equal_whole_model(name, pp):
    source = resolve_model(name)
    plan = make_plan(source.config, ParallelDims(pp=pp, tp=1))
    stages = [build_stage(source, plan, rank=r, tp_group=None) for r in range(pp)]
    whole = build_model(source)
    assert stages[0].embeddings is not None and stages[-1].qa_outputs is not None
    assert all(s.embeddings is None for s in stages[1:]) and all(s.qa_outputs is None for s in stages[:-1])
    assert sorted(int(k) for s in stages for k in s.layers) == list(range(source.config.num_layers))
    for batch in sample_batches(source):
        x = batch["input_ids"]
        with torch.no_grad():
            for s in stages:
                x = s(x, batch["attention_mask"], batch.get("token_type_ids"))
            want = whole(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
        assert torch.allclose(x, want, atol=1e-6)
