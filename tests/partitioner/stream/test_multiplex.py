"""A multiplexed gang's pieces without processes: the model table and its validation, the tag on the
micro-batch id, the executor that runs each micro-batch on its model's stage, the spec's JSON for
ranks on other hosts, and the one-model spec left as it was.

    python -m pytest tests/partitioner/stream/test_multiplex.py -q
"""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta

import numpy as np
import pytest
import torch
from torch import nn

from shardserve.models.registry import resolve_model
from shardserve.partitioner.plan import ParallelDims, make_plan
from shardserve.partitioner.runtime.gang import bound_store
from shardserve.partitioner.runtime.remote import JoinError, publish_spec, read_spec
from shardserve.partitioner.runtime.wire import decode, encode, new_key
from shardserve.partitioner.schedules import MicroBatch, ScheduleError, StageExecutor, run_stream
from shardserve.partitioner.stream.multiplex import (
    MODEL_SHIFT,
    MultiplexedExecutor,
    check_models,
    gang_models,
    models_from_json,
    models_to_json,
    tag,
    untag,
)
from shardserve.partitioner.stream.program import (
    STREAM_PROGRAM,
    Batch,
    stream_rank,
    stream_spec,
    stream_spec_multi,
)

BERT, ROBERTA = resolve_model("tiny-bert"), resolve_model("tiny-roberta")


def _plan(source, pp=2, tp=1, **kw):
    return make_plan(source.config, ParallelDims(pp=pp, tp=tp), **kw)


def test_one_model_spec_is_unchanged() -> None:
    plan = _plan(BERT)
    spec = stream_spec(BERT, plan, threads_per_rank=2)
    assert spec.extra == {"compile": False, "warmup_lengths": (128,)}  # nothing new for one model
    assert spec.program is stream_rank and spec.source is BERT and spec.plan is plan
    (only,) = gang_models(spec)
    assert (only.name, only.source, only.plan) == ("tiny-bert", BERT, plan)
    assert Batch(0, np.zeros((1, 2)), np.ones((1, 2))).model is None  # untagged: the gang's first model
    assert STREAM_PROGRAM.to_json(spec.extra) == {"compile": False, "warmup_lengths": [128]}


def test_multi_spec_holds_every_model_first_one_as_its_own() -> None:
    plan_b, plan_r = _plan(BERT), _plan(ROBERTA, boundaries=[2])
    spec = stream_spec_multi({"b": (BERT, plan_b), "r": (ROBERTA, plan_r)}, dtype="bfloat16")
    assert spec.source is BERT and spec.plan is plan_b and spec.dtype == "bfloat16"
    table = gang_models(spec)
    assert [(m.name, m.source.name) for m in table] == [("b", "tiny-bert"), ("r", "tiny-roberta")]
    assert [list(s.layers) for s in table[1].plan.stages] == [[0, 1], [2, 3, 4, 5]]  # its own split


@pytest.mark.parametrize(
    ("roberta_dims", "message"),
    [
        ((3, 1), r"agree on pp and tp: 'bert' is pp=2 tp=1, 'roberta' is pp=3 tp=1"),
        ((2, 2), r"agree on pp and tp: 'bert' is pp=2 tp=1, 'roberta' is pp=2 tp=2"),
    ],
)
def test_models_of_one_gang_agree_on_the_layout(roberta_dims, message) -> None:
    pp, tp = roberta_dims
    with pytest.raises(ValueError, match=message):
        stream_spec_multi({"bert": (BERT, _plan(BERT)), "roberta": (ROBERTA, _plan(ROBERTA, pp=pp, tp=tp))})


def test_table_refuses_what_cannot_share_a_gang() -> None:
    with pytest.raises(ValueError, match="at least one model, got none"):
        check_models({})
    with pytest.raises(ValueError, match="non-empty string, got ''"):
        check_models({"": (BERT, _plan(BERT))})
    four = dataclasses.replace(BERT.config, num_layers=4)
    with pytest.raises(ValueError, match=r"'r': its plan splits 4 layers, its config has 6"):
        check_models({"b": (BERT, _plan(BERT)), "r": (ROBERTA, make_plan(four, ParallelDims(pp=2)))})
    elsewhere = _plan(ROBERTA, devices=("cpu", "cuda:0"))
    with pytest.raises(ValueError, match=r"share its ranks' devices: 'b' is on \['cpu', 'cpu'\], 'r' on"):
        check_models({"b": (BERT, _plan(BERT)), "r": (ROBERTA, elsewhere)})


def test_tag_rides_in_the_high_bits_and_zero_changes_nothing() -> None:
    assert tag(17, 0) == 17 and untag(17) == (17, 0)
    assert untag(tag(17, 3)) == (17, 3) and tag(17, 3) == 3 * 2**MODEL_SHIFT + 17
    big = (1 << MODEL_SHIFT) - 1
    assert untag(tag(big, 5)) == (big, 5)
    assert torch.tensor([tag(big, 5)], dtype=torch.int64).item() == tag(big, 5)  # fits the p2p header
    with pytest.raises(ValueError, match=f"ids must be < 2\\*\\*{MODEL_SHIFT}"):
        tag(1 << MODEL_SHIFT, 1)


class _Const(nn.Module):
    """A stand-in stage: (B, S) ids -> (B, S, 2) logits filled with ``value``."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def forward(self, x: torch.Tensor, mask: torch.Tensor, types: torch.Tensor | None) -> torch.Tensor:
        return torch.full((*x.shape, 2), self.value)  # (B, S, 2)


def test_executor_runs_each_micro_batch_on_its_models_stage() -> None:
    order = [0, 1, 1, 0, 2]  # model index per micro-batch
    inputs = [
        MicroBatch(tag(mb, m), torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3))
        for mb, m in enumerate(order)
    ]
    queue = iter([*inputs, None])
    seen: list[tuple[int, int, float]] = []

    def on_logits(mb: int, logits: torch.Tensor) -> None:
        seen.append((*untag(mb), logits[0, 0, 0].item()))

    stages = [_Const(10.0), _Const(20.0), _Const(30.0)]
    ex = StageExecutor(stages[0], None, is_first=True, is_last=True, prev_rank=None, next_rank=None,
                       get_inputs=lambda _mb: next(queue), on_logits=on_logits,
                       forward_only=True)  # fmt: skip
    mx = MultiplexedExecutor.over(ex, stages)
    assert mx.on_logits is on_logits and mx.forward_only and mx.is_first and mx.stages == tuple(stages)
    assert run_stream(mx) == len(order)
    assert seen == [(mb, m, 10.0 * (m + 1)) for mb, m in enumerate(order)]
    with pytest.raises(ScheduleError, match="micro-batch 9 is tagged for model 3, this stage holds 3"):
        mx.forward_step(MicroBatch(tag(9, 3), torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3)))


def test_tagged_messages_cross_the_wire() -> None:
    key = new_key()
    ids = np.arange(6, dtype=np.int64).reshape(2, 3)
    batch = decode(encode(Batch(4, ids, np.ones_like(ids), None, model="r"), key), key)
    assert batch.model == "r" and batch.mb_id == 4 and np.array_equal(batch.input_ids, ids)


def test_remote_ranks_read_every_model_of_the_spec() -> None:
    store = bound_store(2, timeout=timedelta(seconds=5))
    key = new_key()
    plan_b, plan_r = _plan(BERT), _plan(ROBERTA, boundaries=[2])
    spec = stream_spec_multi({"bert": (BERT, plan_b), "roberta": (ROBERTA, plan_r)}, compile=True)
    publish_spec(
        store, spec, endpoints="tcp://127.0.0.1:1;tcp://127.0.0.1:2", key=key, program=STREAM_PROGRAM
    )
    got, _ = read_spec(store, key=key, rank=1, programs={"serve": STREAM_PROGRAM})
    assert got.extra["compile"] is True and got.extra["model"] == "bert"
    table = gang_models(got)
    assert [(m.name, m.source.name) for m in table] == [("bert", "tiny-bert"), ("roberta", "tiny-roberta")]
    assert [s.layers for s in table[1].plan.stages] == [s.layers for s in plan_r.stages]
    assert table[1].plan.devices == plan_b.devices
    # an older driver's body (no models in it) is one model, as before
    assert STREAM_PROGRAM.from_json({"compile": False, "warmup_lengths": [128]}, BERT)[0] == {
        "compile": False,
        "warmup_lengths": (128,),
    }


def test_a_model_that_splits_differently_on_the_worker_is_refused() -> None:
    extra = stream_spec_multi({"bert": (BERT, _plan(BERT)), "roberta": (ROBERTA, _plan(ROBERTA))}).extra
    body = json.loads(json.dumps(models_to_json(extra)))
    assert models_from_json(body)["more_models"][0].name == "roberta"
    body["more_models"][0]["stage_layers"] = [[0, 1], [2, 3, 4, 5]]
    with pytest.raises(
        JoinError, match=r"'roberta' \(tiny-roberta\) splits differently here: stages \[\[0, 1, 2\]"
    ):
        models_from_json(body)
