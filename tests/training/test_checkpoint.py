"""Checkpoints: publication (files readable like ordinary files, issue 11.12) and the on-disk format.

``trainer_state.json`` written by this code is, key for key and in order, what older code wrote
(``OLD_STATE`` is a real run's checkpoint-1200), and older configs read back; `resume_point`
finds and vets the checkpoint a ``--resume`` run continues; PEFT overlays carry the folded LoRA
scale. The full write-then-resume round trip through a gang is tests/training/test_trainer_resume.py.

    python -m pytest tests/training/test_checkpoint.py -q
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shardserve.models.qa_windows import WindowConfig
from shardserve.training.checkpoint import (
    STATE_FILE,
    ResumeError,
    clear_run,
    publish,
    resume_point,
    run_artifacts,
    trainer_state,
)
from shardserve.training.checkpoint_shards import overlay_tensors
from shardserve.training.config import RunInfo, TrainConfig, TrainConfigError

# trainer_state.json of /work/runs/squad-full/checkpoint-1200, written by the pre-CheckpointManager code
OLD_STATE = json.loads(
    """{"step": 1200, "total_steps": 6088, "epoch": 0, "batch_in_epoch": 1200, "examples_seen": 38400,
    "seed": 0, "pp": 2, "tp": 1, "schedule": "1f1b", "compute_dtype": "bfloat16", "loss_scale": 1.0,
    "lora_rank": 0, "freeze_layers": 0,
    "data_sha256": "faf4d664c32024e9ee88a093b4f1ef2bc51453d7df6214614866a95e8f50d1eb",
    "config": {"model": "minilm", "train_file": "../shared/data/squad/squad-v1.1-train.json",
    "output": "/work/runs/squad-full", "eval_file": "../shared/data/squad/squad-v1.1-train-pool.json",
    "holdout_articles": 0, "split_seed": 0, "max_train_examples": null, "max_eval_examples": 1000,
    "pp": 2, "tp": 1, "boundaries": null, "schedule": "1f1b", "batch_size": 32, "micro_batch_size": 4,
    "epochs": 2.0, "max_steps": null, "lr": 0.0001, "weight_decay": 0.01, "warmup_ratio": 0.1,
    "max_grad_norm": 1.0, "adam_betas": [0.9, 0.999], "adam_eps": 1e-08, "seed": 0, "dropout": null,
    "max_seq_len": 256, "doc_stride": 128, "max_question_len": 64, "lora_rank": 0, "lora_alpha": 16.0,
    "freeze_layers": 0, "freeze_embeddings": true, "eval_every": 500, "eval_batch_size": 32,
    "save_every": 100, "keep_checkpoints": 2, "resume": true, "device": "cpu", "precision": "bf16",
    "threads_per_rank": null, "log_every": 20, "group_by_length": true, "answer_occurrences": "all",
    "fail_at_step": null}}"""
)


def _run_info(cfg: TrainConfig, **kw) -> RunInfo:
    args = dict(
        features="f.safetensors",
        n_train=97408,  # 3044 batches of 32 per epoch: 2 epochs = 6088 steps
        n_eval=1000,
        total_steps=6088,
        warmup_steps=608,
        start_step=0,
        resume_from=None,
        data_sha256=OLD_STATE["data_sha256"],
        base_model="base",
        tokenizer_dir="base",
        compute_dtype="bfloat16",
    )
    args.update(kw)
    return RunInfo(**args)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_published_checkpoint_files_are_world_readable(tmp_path: Path) -> None:
    """safetensors writes 0600; a published checkpoint is 0644 / 0755 under umask 022, so a server
    running as another user (the container's 10001) can read a mounted checkpoint."""
    old_umask = os.umask(0o022)
    try:
        tmp = tmp_path / ".tmp-final"
        (tmp / "training_state").mkdir(parents=True)
        save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
        save_file({"w": torch.zeros(2)}, str(tmp / "training_state" / "rank0.safetensors"))
        (tmp / "config.json").write_text("{}")
        assert _mode(tmp / "model.safetensors") & 0o044 == 0  # what safetensors gives us
        final = tmp_path / "final"
        publish(tmp, final)
        assert _mode(final / "model.safetensors") == 0o644
        assert _mode(final / "training_state" / "rank0.safetensors") == 0o644
        assert _mode(final / "config.json") == 0o644
        assert _mode(final) == 0o755 and _mode(final / "training_state") == 0o755
        # a stricter umask is honoured
        os.umask(0o077)
        tmp2 = tmp_path / ".tmp-final2"
        tmp2.mkdir()
        save_file({"w": torch.zeros(2)}, str(tmp2 / "model.safetensors"))
        publish(tmp2, final)
        assert _mode(final / "model.safetensors") == 0o600
    finally:
        os.umask(old_umask)


def test_old_config_reads_back_and_serializes_to_the_same_keys() -> None:
    cfg = TrainConfig.from_dict(OLD_STATE["config"])
    assert cfg.window == WindowConfig(max_seq_len=256, doc_stride=128, max_question_len=64)
    assert cfg.adam_betas == (0.9, 0.999) and cfg.freeze_embeddings and cfg.group_by_length
    again = json.loads(json.dumps(cfg.to_dict()))
    assert list(again) == list(OLD_STATE["config"])  # same keys, same order
    assert again == OLD_STATE["config"]
    with pytest.raises(TrainConfigError, match="unknown"):
        TrainConfig.from_dict({**OLD_STATE["config"], "window": {}})
    with pytest.raises(TrainConfigError, match="doc_stride=128"):
        TrainConfig.from_dict({**OLD_STATE["config"], "max_seq_len": 100})


def test_trainer_state_is_the_on_disk_format() -> None:
    cfg = TrainConfig.from_dict(OLD_STATE["config"])
    state = json.loads(json.dumps(trainer_state(cfg, _run_info(cfg), 1200, loss_scale=1.0), default=str))
    assert list(state) == list(OLD_STATE)
    assert state == OLD_STATE


def _write_checkpoint(out: Path, step: int, *, ranks: int = 2, **changes) -> Path:
    """A checkpoint's trainer state (``OLD_STATE``: pp=2, tp=1) and ``ranks`` rank files."""
    ckpt = out / f"checkpoint-{step}"
    (ckpt / "training_state").mkdir(parents=True)
    (ckpt / STATE_FILE).write_text(json.dumps({**OLD_STATE, "step": step, **changes}))
    for rank in range(ranks):
        save_file(
            {"layers.0.mlp.up.weight": torch.zeros(3, 2)},
            str(ckpt / "training_state" / f"rank{rank}.safetensors"),
            metadata={"tp_rank": "0", "shard_specs": "{}"},
        )
    return ckpt


def _truncate(path: Path, n: int = 10) -> None:
    path.write_bytes(path.read_bytes()[:-n])


def test_resume_point_takes_the_newest_matching_checkpoint(tmp_path: Path) -> None:
    cfg = dataclasses.replace(TrainConfig.from_dict(OLD_STATE["config"]), output=str(tmp_path))
    kw = dict(total_steps=6088, data_sha256=OLD_STATE["data_sha256"], compute_dtype="bfloat16")
    with pytest.raises(ResumeError, match="no checkpoint"):
        resume_point(cfg, **kw)
    _write_checkpoint(tmp_path, 1100)
    newest = _write_checkpoint(tmp_path, 1200)
    point = resume_point(cfg, **kw)
    assert (point.step, point.path, point.loss_scale) == (1200, str(newest), None)
    assert resume_point(dataclasses.replace(cfg, resume=False), **kw).step == 0
    with pytest.raises(ResumeError, match="'pp': \\(2, 1\\)"):
        resume_point(dataclasses.replace(cfg, pp=1), **kw)
    with pytest.raises(ResumeError, match="total_steps"):
        resume_point(cfg, **{**kw, "total_steps": 100})
    _write_checkpoint(tmp_path, 1300, compute_dtype="float16", loss_scale=1024.0)
    assert resume_point(cfg, **{**kw, "compute_dtype": "float16"}).loss_scale == 1024.0
    assert resume_point(cfg, **kw).loss_scale is None  # bf16 now: the fp16 scale does not carry over


def test_resume_refuses_settings_that_shape_the_training_and_allows_the_rest(tmp_path: Path) -> None:
    """A resumed run with another batch, lr, window or held-out split would continue another run
    (with --holdout-articles, on questions it trained on): refused, naming each difference. How it
    runs, logs and keeps checkpoints may change."""
    cfg = dataclasses.replace(TrainConfig.from_dict(OLD_STATE["config"]), output=str(tmp_path))
    kw = dict(total_steps=6088, data_sha256=OLD_STATE["data_sha256"], compute_dtype="bfloat16")
    _write_checkpoint(tmp_path, 1200)
    changed = dataclasses.replace(
        cfg, lr=cfg.lr * 2, batch_size=cfg.batch_size * 2, holdout_articles=3, max_train_examples=100
    )
    with pytest.raises(ResumeError) as info:
        resume_point(changed, **kw)
    for name in ("lr", "batch_size", "holdout_articles", "max_train_examples"):
        assert f"'{name}': (" in str(info.value)
    window = dataclasses.replace(cfg.window, doc_stride=cfg.window.doc_stride // 2)
    with pytest.raises(ResumeError, match="'doc_stride': \\(128, 64\\)"):
        resume_point(dataclasses.replace(cfg, window=window), **kw)
    allowed = dataclasses.replace(
        cfg, micro_batch_size=cfg.micro_batch_size // 2, log_every=1, eval_batch_size=7, precision="fp32",
        keep_checkpoints=5, save_every=10, threads_per_rank=1, train_file="/elsewhere/same-bytes.json",
    )  # fmt: skip
    assert resume_point(allowed, **kw).step == 1200


def test_resume_of_a_finished_run_points_at_its_final(tmp_path: Path) -> None:
    """A finished run's final is newer than its checkpoints (or the only one, with --save-every 0):
    --resume takes it, and train() then has nothing left to do (it retrained the last steps)."""
    cfg = dataclasses.replace(TrainConfig.from_dict(OLD_STATE["config"]), output=str(tmp_path))
    kw = dict(total_steps=6088, data_sha256=OLD_STATE["data_sha256"], compute_dtype="bfloat16")
    final = tmp_path / "final"
    final.mkdir()
    (final / STATE_FILE).write_text(json.dumps({**OLD_STATE, "step": 6088}))
    assert resume_point(cfg, **kw).step == 6088  # no checkpoint-* at all
    _write_checkpoint(tmp_path, 6000)
    assert resume_point(cfg, **kw).path == str(final)


def test_resume_skips_damaged_newer_checkpoints_for_the_newest_intact_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A truncated or missing rank file (or a damaged trainer state) in the newest checkpoint: --resume
    failed on it (naming the file) and never said that an older one was intact. Now it resumes from
    the newest intact checkpoint, with a warning naming each damaged one and why; they stay in place."""
    cfg = dataclasses.replace(TrainConfig.from_dict(OLD_STATE["config"]), output=str(tmp_path))
    kw = dict(total_steps=6088, data_sha256=OLD_STATE["data_sha256"], compute_dtype="bfloat16")
    _write_checkpoint(tmp_path, 1000)
    intact = _write_checkpoint(tmp_path, 1100)
    truncated = _write_checkpoint(tmp_path, 1200)
    _truncate(truncated / "training_state" / "rank1.safetensors")
    missing = _write_checkpoint(tmp_path, 1300, ranks=1)  # rank1's file never arrived
    bad_state = _write_checkpoint(tmp_path, 1400)
    (bad_state / STATE_FILE).write_text('{"step": 14')
    no_state = _write_checkpoint(tmp_path, 1500)
    (no_state / STATE_FILE).unlink()
    with caplog.at_level(logging.WARNING, logger="shardserve.training.checkpoint"):
        point = resume_point(cfg, **kw)
    assert (point.step, point.path) == (1100, str(intact))
    assert point.skipped == tuple(str(p) for p in (no_state, bad_state, missing, truncated))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 4, warnings
    for ckpt, why in (
        (no_state, f"no {STATE_FILE}"),
        (bad_state, "not valid JSON"),
        (missing, f"{missing / 'training_state' / 'rank1.safetensors'}: missing"),
        (truncated, f"{truncated / 'training_state' / 'rank1.safetensors'}: unreadable"),
    ):
        line = next(w for w in warnings if w.startswith(f"--resume: {ckpt} is damaged ("))
        assert why in line and f"resuming from {intact}," in line, line
    assert (truncated / "training_state" / "rank1.safetensors").is_file()  # nothing was deleted
    assert (bad_state / STATE_FILE).is_file() and no_state.is_dir()


def test_resume_with_no_intact_checkpoint_is_one_error_naming_each(tmp_path: Path) -> None:
    cfg = dataclasses.replace(TrainConfig.from_dict(OLD_STATE["config"]), output=str(tmp_path))
    kw = dict(total_steps=6088, data_sha256=OLD_STATE["data_sha256"], compute_dtype="bfloat16")
    older = _write_checkpoint(tmp_path, 1100, ranks=1)
    newer = _write_checkpoint(tmp_path, 1200)
    _truncate(newer / "training_state" / "rank0.safetensors")
    with pytest.raises(ResumeError) as info:
        resume_point(cfg, **kw)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"--resume: no checkpoint under {tmp_path} is intact"), msg
    assert f"checkpoint-1100 ({older / 'training_state' / 'rank1.safetensors'}: missing)" in msg, msg
    assert f"checkpoint-1200 ({newer / 'training_state' / 'rank0.safetensors'}: unreadable (" in msg, msg
    assert msg.index("checkpoint-1200") < msg.index("checkpoint-1100")  # newest first


def test_resume_past_a_damaged_final_takes_the_newest_intact_checkpoint(tmp_path: Path) -> None:
    """A finished run's final is resumed on its trainer state alone (nothing is left to train); an
    unreadable one is damaged like any checkpoint."""
    cfg = dataclasses.replace(TrainConfig.from_dict(OLD_STATE["config"]), output=str(tmp_path))
    kw = dict(total_steps=6088, data_sha256=OLD_STATE["data_sha256"], compute_dtype="bfloat16")
    intact = _write_checkpoint(tmp_path, 6000)
    final = tmp_path / "final"
    final.mkdir()
    (final / STATE_FILE).write_text('{"step": 60')
    point = resume_point(cfg, **kw)
    assert (point.path, point.skipped) == (str(intact), (str(final),))


@pytest.mark.parametrize(
    "damage",
    ["none", "extra rank file truncated", "shard_specs not JSON", "no layout", "header garbage", "empty"],
)
def test_checkpoint_problem_reads_headers_of_every_rank_file(tmp_path: Path, damage: str) -> None:
    from shardserve.training.checkpoint import checkpoint_problem

    ckpt = _write_checkpoint(tmp_path, 5, ranks=3)  # pp*tp = 2, and an extra rank2 an elastic resume merges
    rank = ckpt / "training_state" / "rank2.safetensors"
    if damage == "extra rank file truncated":
        _truncate(rank, 1)
    elif damage == "shard_specs not JSON":
        save_file({"w": torch.zeros(1)}, str(rank), metadata={"shard_specs": "{"})
    elif damage == "no layout":
        (ckpt / STATE_FILE).write_text(json.dumps({**OLD_STATE, "pp": None}))
    elif damage == "header garbage":
        rank.write_bytes(rank.read_bytes()[:8] + b"\xff" * 16 + rank.read_bytes()[24:])
    elif damage == "empty":
        rank.write_bytes(b"")
    problem = checkpoint_problem(ckpt)
    if damage == "none":
        assert problem is None
    else:
        where = ckpt / STATE_FILE if damage == "no layout" else rank
        assert problem is not None and problem.startswith(f"{where}: ") and "\n" not in problem, problem


def test_pruning_spares_the_damaged_checkpoints_a_resume_skipped(tmp_path: Path) -> None:
    """Resumed from checkpoint-2 past a damaged checkpoint-4, a run keeping 1 checkpoint wrote
    checkpoint-3 and pruned it with checkpoint-2 (the damaged 4 counted as the newest), leaving no
    intact checkpoint. The damaged one is neither counted nor deleted."""
    from shardserve.training.checkpoint import prune_checkpoints

    for step in (2, 3, 4):
        _write_checkpoint(tmp_path, step)
    prune_checkpoints(tmp_path, keep=1, spare={"checkpoint-4"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-4"]
    prune_checkpoints(tmp_path, keep=1)  # once rewritten it is no longer spared
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]


def test_run_artifacts_are_the_runs_own_files_and_clear_run_removes_only_them(tmp_path: Path) -> None:
    for name in ("checkpoint-2", "checkpoint-10", ".tmp-checkpoint-12", "final", ".cache"):
        (tmp_path / name).mkdir()
    for name in ("curve.csv", "curve.png", "eval_results.json", "notes.txt"):
        (tmp_path / name).write_text("x")
    (tmp_path / "checkpoint-best").mkdir()  # not a step: the user's own
    found = [p.name for p in run_artifacts(tmp_path)]
    assert found == sorted(
        [
            ".tmp-checkpoint-12",
            "checkpoint-10",
            "checkpoint-2",
            "curve.csv",
            "curve.png",
            "eval_results.json",
            "final",
        ]
    )
    clear_run(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".cache", "checkpoint-best", "notes.txt"]
    assert run_artifacts(tmp_path / "missing") == []


def test_overlay_folds_the_lora_scale_and_drops_optimizer_state() -> None:
    cfg = dataclasses.replace(TrainConfig.from_dict(OLD_STATE["config"]), lora_rank=4, lora_alpha=8.0)
    a, b = torch.randn(4, 6), torch.randn(5, 4)
    state = {
        "layers.0.mlp.up.lora_A": a,
        "layers.0.mlp.up.lora_B": b,
        "layers.0.mlp.up.bias": torch.ones(5),
        "optim.layers.0.mlp.up.lora_B.exp_avg": torch.zeros(5, 4),
    }
    overlay = overlay_tensors(state, cfg)
    assert set(overlay) == {"layers.0.mlp.up.lora_A", "layers.0.mlp.up.lora_B", "layers.0.mlp.up.bias"}
    assert torch.equal(overlay["layers.0.mlp.up.lora_B"] @ overlay["layers.0.mlp.up.lora_A"], (b @ a) * 2.0)
