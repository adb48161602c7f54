"""The feature file cache (training/features.py): written once, reused without re-reading the data.

- a second ``prepare_data`` with the same settings is a cache hit: it neither reads the SQuAD
  files nor tokenizes anything, and builds the evaluation windows only when they are first used
  (then equal to the ``eval.*`` rows of the file);
- the cache key is the one older versions of the code computed (a resumed run reuses its file);
- the ranks' reader returns exactly the stored tensors.

    python -m pytest tests/training/test_features.py -q
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

import shardserve.training.features as features
from shardserve.models.qa_windows import WindowConfig
from shardserve.models.registry import resolve_model
from shardserve.training.config import TrainConfig
from shardserve.training.features import (
    FEATURES_FORMAT,
    features_key,
    prepare_data,
    read_features,
    sha256_file,
)
from tests.training.test_trainer_parity import write_tiny_squad


def _config(tmp_path, **kw) -> TrainConfig:
    data = write_tiny_squad(tmp_path / "train.json")
    args = dict(
        model="tiny-bert",
        train_file=str(data),
        output=str(tmp_path / "run"),
        holdout_articles=1,
        window=WindowConfig(max_seq_len=64, doc_stride=24, max_question_len=16),
    )
    args.update(kw)
    return TrainConfig(**args)


def test_cache_hit_reads_no_data_and_builds_eval_windows_on_demand(tmp_path, monkeypatch):
    cfg = _config(tmp_path)
    source = resolve_model("tiny-bert")
    first = prepare_data(cfg, source)
    assert first.n_train > 0 and first.n_eval > 0
    want = first.eval_features
    assert want is not None and len(want) == first.n_eval

    calls: list[str] = []
    real_load, real_build = features.load_squad, features.build_eval_features

    def counting_load(*a, **kw):
        calls.append("load_squad")
        return real_load(*a, **kw)

    def counting_build(*a, **kw):
        calls.append("build_eval_features")
        return real_build(*a, **kw)

    monkeypatch.setattr(features, "load_squad", counting_load)
    monkeypatch.setattr(features, "build_eval_features", counting_build)
    monkeypatch.setattr(features, "build_train_features", lambda *a, **kw: pytest.fail("re-tokenized"))
    again = prepare_data(cfg, source)
    assert (again.path, again.n_train, again.n_eval) == (first.path, first.n_train, first.n_eval)
    assert calls == []  # a cache hit reads only the file's header
    got = again.eval_features
    assert calls == ["load_squad", "build_eval_features"]
    assert got is not None and [w.input_ids.tolist() for w in got.encoded.windows] == [
        w.input_ids.tolist() for w in want.encoded.windows
    ]
    stored = read_features(str(again.path), "eval", ("input_ids",))["input_ids"]
    assert torch.equal(stored.long(), got.batch.input_ids)
    assert again.eval_features is got  # built once


def test_run_without_evaluation_has_no_eval_windows(tmp_path):
    cfg = _config(tmp_path, holdout_articles=0)
    data = prepare_data(cfg, resolve_model("tiny-bert"))
    assert data.n_eval == 0 and data.eval_features is None
    t = read_features(str(data.path), "train", ("input_ids", "start_candidates"))
    assert t["input_ids"].shape == (data.n_train, 64) and t["input_ids"].dtype == torch.int32
    assert t["start_candidates"].dtype == torch.int16


def test_cache_key_is_the_one_older_code_wrote(tmp_path):
    """The key of ``features-{key}.safetensors`` as the trainer has always computed it (the list
    below is the pre-WindowConfig code's), so a run resumed with this code finds its file."""
    cfg = _config(tmp_path, eval_file=str(tmp_path / "train.json"), max_eval_examples=5)
    source = resolve_model("tiny-bert")
    sha = sha256_file(cfg.train_file)
    old = [
        FEATURES_FORMAT, sha, sha256_file(cfg.eval_file), str(source.tokenizer_dir), 64, 24, 16,
        cfg.holdout_articles, cfg.split_seed, cfg.max_train_examples, cfg.max_eval_examples,
    ]  # fmt: skip
    assert FEATURES_FORMAT == 2
    assert (
        features_key(cfg, source, train_sha256=sha)
        == hashlib.sha256(json.dumps(old).encode()).hexdigest()[:16]
    )
