"""A multiplexed gang over real gloo worker processes: one gang holding its stage of tiny-bert and
tiny-roberta (each split by its own plan) answers interleaved micro-batches of both with exactly
the logits each model's own one-model gang gives, and with transformers' reference; a model it
does not hold is refused; ``verify_multiplexed`` at tp=2; a rank on another host (``shardserve
worker``) builds every model from the spec's JSON.

    python -m pytest tests/partitioner/stream/test_multiplexed_gang.py -q
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from shardserve.loadtest.local_server import free_port
from shardserve.models.registry import resolve_model
from shardserve.partitioner.plan import ParallelDims, make_plan
from shardserve.partitioner.runtime.remote import GangNetwork
from shardserve.partitioner.runtime.wire import new_key
from shardserve.partitioner.stream.driver import StreamGang
from shardserve.partitioner.stream.program import STREAM_PROGRAM, stream_spec, stream_spec_multi
from shardserve.partitioner.stream.verify import (
    compare,
    reference_dir,
    reference_logits,
    sample_batches,
    verify_multiplexed,
)

TOLERANCE = 1e-4  # against transformers (fp32), as verify's
SAME = 0.0  # a multiplexed gang against a one-model gang: same shards, same kernels, same numbers


def _models(pp: int, tp: int) -> dict:
    bert, roberta = resolve_model("tiny-bert"), resolve_model("tiny-roberta")
    dims = ParallelDims(pp=pp, tp=tp)
    boundaries = [2] if pp == 2 else None  # roberta split unlike bert's balanced [3]
    return {
        "tiny-bert": (bert, make_plan(bert.config, dims)),
        "tiny-roberta": (roberta, make_plan(roberta.config, dims, boundaries=boundaries)),
    }


def _args(batch: dict[str, torch.Tensor]) -> tuple:
    return batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids")


@pytest.mark.parametrize(("pp", "tp"), [(2, 1), (2, 2)])
def test_interleaved_models_answer_as_their_own_gangs_and_the_reference(pp: int, tp: int) -> None:
    models = _models(pp, tp)
    batches = {name: sample_batches(src) for name, (src, _) in models.items()}
    with tempfile.TemporaryDirectory() as tmp:
        want = {
            name: reference_logits(reference_dir(src, Path(tmp)), batches[name])
            for name, (src, _) in models.items()
        }
    with contextlib.ExitStack() as stack:
        multi = stack.enter_context(StreamGang(stream_spec_multi(models), name="multi"))
        alone = {
            name: stack.enter_context(StreamGang(stream_spec(src, plan), name=f"alone-{name}"))
            for name, (src, plan) in models.items()
        }
        assert multi.models == ("tiny-bert", "tiny-roberta")
        # interleaved: bert 0, roberta 0, bert 1, ... all in flight together
        futures: dict[str, list] = {name: [] for name in models}
        for k in range(3):
            for name in models:
                futures[name].append(multi.submit(*_args(batches[name][k]), model=name))
        default = multi.submit(*_args(batches["tiny-bert"][0]))  # no model named: the first
        got = {name: [f.result(timeout=60) for f in futs] for name, futs in futures.items()}
        for name, gang in alone.items():
            own = gang.run([_args(b) for b in batches[name]], timeout_s=60)
            for g, o in zip(got[name], own, strict=True):
                torch.testing.assert_close(g, o, rtol=0, atol=SAME)
            result = compare(got[name], want[name], batches[name], tolerance=TOLERANCE)
            assert result.passed, f"{name}: max |diff| {result.max_abs:.3g} > {TOLERANCE}"
        torch.testing.assert_close(default.result(timeout=60), got["tiny-bert"][0], rtol=0, atol=0)

        with pytest.raises(
            ValueError,
            match=r"no model 'tiny-distilbert' on this gang; it holds \['tiny-bert', 'tiny-roberta'\]",
        ):
            multi.submit(*_args(batches["tiny-bert"][1]), model="tiny-distilbert")
        assert multi.healthy and multi.inflight == 0 and multi.stats.completed == 7
        with pytest.raises(
            ValueError, match=r"no model 'tiny-roberta' on this gang; it holds \['tiny-bert'\]"
        ):
            alone["tiny-bert"].submit(*_args(batches["tiny-bert"][1]), model="tiny-roberta")

        # every rank holds its stage of both models, each its own layers; the totals add them up
        for rank, info in multi.stats.ready_info.items():
            held = info["models"]
            stage = rank // tp
            for name, (_, plan) in models.items():
                assert held[name]["layers"] == list(plan.stages[stage].layers)
                assert held[name]["param_bytes"] == alone[name].stats.ready_info[rank]["param_bytes"]
            assert info["param_bytes"] == sum(h["param_bytes"] for h in held.values())
            assert info["layers"] == held["tiny-bert"]["layers"]


def test_verify_multiplexed_at_tp2() -> None:
    sources = {name: resolve_model(name) for name in ("tiny-bert", "tiny-roberta", "tiny-distilbert")}
    results = verify_multiplexed(sources, ParallelDims(pp=1, tp=2), tolerance=TOLERANCE)
    assert list(results) == list(sources)
    for name, result in results.items():
        assert result.passed, f"{name}: max |diff| {result.max_abs:.3g} > {TOLERANCE}"
        assert result.windows == 11 and len(result.batch_shapes) == 3


def test_a_rank_on_another_host_builds_every_model_from_the_json() -> None:
    models = _models(2, 1)
    batches = {name: sample_batches(src)[1] for name, (src, _) in models.items()}
    with StreamGang(stream_spec_multi(models)) as local:  # the reference: both ranks spawned here
        want = {name: local.submit(*_args(b), model=name).result(timeout=60) for name, b in batches.items()}
    key, port = new_key(), free_port()
    net = GangNetwork(host="127.0.0.1", store_port=port, external_ranks=(1,), key=key, program=STREAM_PROGRAM)
    gang = StreamGang(stream_spec_multi(models), network=net, heartbeat_timeout_s=5.0, start_timeout_s=120)
    errors: list[BaseException] = []
    starting = threading.Thread(target=lambda: _catch(gang.start, errors), daemon=True)
    starting.start()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "1",
           "SHARDSERVE_GANG_KEY": key.hex(), "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    worker = subprocess.Popen([sys.executable, "-m", "shardserve", "worker"], env=env, start_new_session=True)
    try:
        starting.join(timeout=120)
        assert not errors, errors
        assert gang.stats.ready_info[1]["models"]["tiny-roberta"]["layers"] == [2, 3, 4, 5]
        for name, b in batches.items():
            got = gang.submit(*_args(b), model=name).result(timeout=60)
            torch.testing.assert_close(got, want[name], rtol=0, atol=0)
    finally:
        gang.stop()
        if worker.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.wait(timeout=30)  # the stop flowed through: the worker exits by itself
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)
    assert worker.returncode == 0


def _catch(fn, errors: list[BaseException]) -> None:
    try:
        fn()
    except BaseException as exc:  # reported by the test
        errors.append(exc)
