"""A training gang's spec for ranks on other hosts, and ``shardserve train``'s gang flags (no processes).

- the published spec of a training gang reads back on the worker as the same program
  (``train_rank``), ``TrainConfig``, ``RunInfo`` and dropout-adjusted model;
- a worker whose ``WORLD_SIZE`` disagrees, or a spec naming a program outside its allow-list (a
  serve-only worker, or a name that is no program), is refused in one line; publishing a spec with
  another program than the gang's is a ValueError;
- ``train`` shares serve's gang flags and their validation: a bad external rank, a missing key or
  rank 0 as external is one ``error:`` line, exit 2.

    python -m pytest tests/training/test_remote_spec.py -q
"""

from __future__ import annotations

import hashlib
import hmac
import json
from datetime import timedelta
from pathlib import Path

import pytest

from shardserve.partitioner.runtime.gang import bound_store
from shardserve.partitioner.runtime.rank import GangSpec
from shardserve.partitioner.runtime.remote import SPEC_KEY, GangNetwork, JoinError, publish_spec, read_spec
from shardserve.partitioner.runtime.wire import new_key
from shardserve.partitioner.stream.program import STREAM_PROGRAM as SERVE
from shardserve.training.config import RunInfo, TrainConfigError
from shardserve.training.driver import train
from shardserve.training.rank import TRAIN_PROGRAM as TRAIN
from shardserve.training.rank import train_rank, with_dropout
from tests.training.test_cli import _one_line_error
from tests.training.test_trainer_parity import base_config, write_tiny_squad

PROGRAMS = {"serve": SERVE, "train": TRAIN}  # what `shardserve worker` runs


def _training_spec(tmp_path: Path) -> GangSpec:
    from shardserve.models.registry import resolve_model
    from shardserve.partitioner.plan import ParallelDims, make_plan

    cfg = base_config(tmp_path, pp=2, dropout=0.0)
    source = with_dropout(resolve_model("tiny-bert"), 0.0)
    run = RunInfo(
        features="/nowhere/features.safetensors", n_train=36, n_eval=0, total_steps=3, warmup_steps=1,
        start_step=0, resume_from=None, data_sha256="ab" * 32, base_model="/x", tokenizer_dir="/y",
        remote_ranks=(1,),
    )  # fmt: skip
    plan = make_plan(source.config, ParallelDims(pp=2))
    return GangSpec(source, plan, program=train_rank, extra={"train": cfg, "run": run})


def test_training_spec_round_trips_as_json(tmp_path: Path) -> None:
    store = bound_store(2, timeout=timedelta(seconds=5))
    key = new_key()
    spec = _training_spec(tmp_path)
    with pytest.raises(ValueError, match="not the remote program 'serve'"):
        publish_spec(store, spec, endpoints="tcp://127.0.0.1:1;tcp://127.0.0.1:2", key=key, program=SERVE)
    publish_spec(store, spec, endpoints="tcp://127.0.0.1:1;tcp://127.0.0.1:2", key=key, program=TRAIN)
    with pytest.raises(JoinError, match=r"names program 'train'; this worker runs only \['serve'\]"):
        read_spec(store, key=key, rank=1, programs={"serve": SERVE})  # a serve-only worker
    got, _ = read_spec(store, key=key, rank=1, world_size=2, programs=PROGRAMS)
    assert got.program is train_rank
    assert got.extra == spec.extra  # TrainConfig and RunInfo, equal field by field
    assert got.source.config.hidden_dropout == 0.0 and got.collective_timeout_s == spec.collective_timeout_s
    with pytest.raises(JoinError, match=r"^WORLD_SIZE=4, but the gang the driver published has 2 ranks"):
        read_spec(store, key=key, rank=1, world_size=4, programs=PROGRAMS)
    # a spec signed with our key but naming another program: refused, nothing imported
    body = json.loads(store.get(SPEC_KEY))["spec"] | {"program": "os:system"}
    sig = hmac.new(key, json.dumps(body, sort_keys=True).encode(), hashlib.sha256).hexdigest()
    store.set(SPEC_KEY, json.dumps({"spec": body, "sig": sig}))
    with pytest.raises(JoinError, match="names program 'os:system'"):
        read_spec(store, key=key, rank=1, programs=PROGRAMS)


def test_train_gang_flags_are_validated_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_tiny_squad(tmp_path / "train.json")
    base = ["train", "--model", "tiny-bert", "--train-file", str(data), "--output", str(tmp_path / "run"),
            "--pp", "2", "--no-progress", "--gang-host", "10.0.0.1", "--gang-port", "29500"]  # fmt: skip
    key = ["--gang-key", "ab" * 32]
    _one_line_error(
        capsys, [*base, *key, "--external-ranks", "2"], "external_ranks [2] are not ranks of a dp=1 x pp=2"
    )
    _one_line_error(capsys, [*base, "--external-ranks", "1"], "external_ranks need the gang key")
    _one_line_error(capsys, [*base, *key, "--external-ranks", "0"], "rank 0 runs here")


def test_train_refuses_a_network_whose_remote_ranks_would_run_another_program(tmp_path: Path) -> None:
    net = GangNetwork(store_port=29500, external_ranks=(1,), key=new_key(), program=SERVE)
    with pytest.raises(TrainConfigError, match="must say they run the training program, not 'serve'"):
        train(base_config(tmp_path, pp=2), show_progress=False, network=net)
