"""Resume, loss, overlay and CLI behaviour of the trainer (tiny-bert, tiny SQuAD file).

- a run whose last rank crashes hard mid-run (after a checkpoint) and is then ``--resume``d ends
  with exactly the weights of an uninterrupted run (dropout on: the RNG is restored too);
- a short run shows the loss falling;
- a LoRA run's ``overlay.safetensors`` loads onto the base model (``load_weights`` merges the
  factors, slice-aware) equal to the merged checkpoint, single-process and in a tp=2 gang;
- ``shardserve train`` / ``shardserve eval`` work end to end, and a checkpoint trained at one
  (pp, tp) scores the same at another;
- ``--resume`` past a truncated newest checkpoint warns, continues from the older intact one, and
  its pruning neither deletes the damaged one nor lets it push out the new intact one.

    python -m pytest tests/training/test_trainer_resume.py -q
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from shardserve.cli import main as shardserve_main
from shardserve.models.build import build_model
from shardserve.models.hf_weights import to_hf_state_dict
from shardserve.models.registry import resolve_model
from shardserve.partitioner.lora import merged_state_dict
from shardserve.partitioner.plan import ParallelDims, make_plan
from shardserve.partitioner.runtime.gang import GangError
from shardserve.partitioner.stream.driver import StreamGang
from shardserve.partitioner.stream.program import stream_spec
from shardserve.training.checkpoint import list_checkpoints
from shardserve.training.driver import train
from shardserve.training.export_overlay import export_overlay
from tests.training.test_trainer_parity import base_config, write_tiny_squad


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_killed_then_resumed_run_equals_uninterrupted(tmp_path, precision):
    common = dict(pp=2, tp=1, schedule="1f1b", max_steps=6, save_every=2, dropout=0.1, precision=precision)
    full = train(base_config(tmp_path / "a", **common), show_progress=False)
    want = load_file(str(full.final_checkpoint / "model.safetensors"))

    crashed = base_config(tmp_path / "b", **common, fail_at_step=5)
    with pytest.raises(GangError):
        train(crashed, show_progress=False)
    out = tmp_path / "b" / "run"
    assert [s for s, _ in list_checkpoints(out)] == [2, 4]
    assert not (out / "final").exists()
    resumed = train(dataclasses.replace(crashed, fail_at_step=None, resume=True), show_progress=False)
    got = load_file(str(resumed.final_checkpoint / "model.safetensors"))
    assert sorted(resumed.losses) == [5, 6]
    assert resumed.losses[6] == pytest.approx(full.losses[6], abs=1e-6)
    worst = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert worst <= 1e-6, worst
    # the learning curve holds every step once (the crashed run's step 5 was dropped on resume)
    rows = (out / "curve.csv").read_text().splitlines()
    assert [int(r.split(",")[0]) for r in rows[1:] if ",train," in r] == [1, 2, 3, 4, 5, 6]
    assert (out / "curve.png").stat().st_size > 1000
    # and the runs did train, with dropout active: the weights moved from the base
    base = to_hf_state_dict("bert", merged_state_dict(build_model(resolve_model("tiny-bert"))))
    assert max(float((want[k] - base[k]).abs().max()) for k in base) > 1e-3


def test_loss_falls_on_a_short_run(tmp_path):
    cfg = base_config(tmp_path, pp=2, tp=1, max_steps=30, lr=3e-3, warmup_ratio=0.1, dropout=0.1)
    result = train(cfg, show_progress=False)
    losses = [result.losses[s] for s in sorted(result.losses)]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.5 * first, losses


def test_lora_overlay_loads_onto_the_base_model(tmp_path):
    cfg = base_config(tmp_path, pp=2, tp=2, lora_rank=4, lora_alpha=8.0, lr=1e-2, max_steps=3)
    result = train(cfg, show_progress=False)
    merged = load_file(str(result.final_checkpoint / "model.safetensors"))
    overlay = export_overlay(result.final_checkpoint, tmp_path / "default")  # what ships as models/default
    assert (
        json.loads((tmp_path / "default" / "default-model.json").read_text())["runs"][0]["trainer_state"][
            "step"
        ]
        == 3
    )
    names = set(load_file(str(overlay)))
    assert any(n.endswith(".lora_A") for n in names) and not any(n.startswith("embeddings.") for n in names)
    base = resolve_model("tiny-bert")
    source = dataclasses.replace(base, overlays=(overlay,))
    model = build_model(source)
    got = to_hf_state_dict("bert", model.state_dict())
    worst = max(float((got[k] - merged[k]).abs().max()) for k in merged)
    assert worst <= 1e-6, worst
    assert (
        max(
            float((got[k] - to_hf_state_dict("bert", build_model(base).state_dict())[k]).abs().max())
            for k in got
        )
        > 1e-4
    )
    # the same overlay, sliced at load by a (pp, tp) = (2, 2) serving gang, gives the same logits
    ids = torch.randint(1000, 2000, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    with torch.inference_mode():
        want = model(ids, mask)
    plan = make_plan(source.config, ParallelDims(pp=2, tp=2))
    with StreamGang(stream_spec(source, plan)) as gang:
        logits = gang.submit(ids, mask).result(timeout=60)
    assert float((logits - want).abs().max()) <= 1e-4


def test_albert_lora_overlay_serves_at_another_layout(tmp_path):
    """ALBERT's LoRA factors live in its one shared layer; the overlay a pp=2 run wrote (each stage's
    copy under its first layer's index) loads into a pp=3 gang, whose stages look for other indices."""
    cfg = base_config(
        tmp_path, model="tiny-albert", pp=2, tp=1, lora_rank=4, lora_alpha=8.0, lr=1e-2, max_steps=2
    )
    result = train(cfg, show_progress=False)
    overlay = export_overlay(result.final_checkpoint, tmp_path / "overlay")
    source = dataclasses.replace(resolve_model("tiny-albert"), overlays=(overlay,))
    model = build_model(source)
    ids = torch.randint(10, 1900, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    with torch.inference_mode():
        want = model(ids, mask)
        base = build_model(resolve_model("tiny-albert"))(ids, mask)
    assert float((want - base).abs().max()) > 1e-4  # the overlay changed the model
    plan = make_plan(source.config, ParallelDims(pp=3))
    with StreamGang(stream_spec(source, plan)) as gang:
        logits = gang.submit(ids, mask).result(timeout=60)
    assert float((logits - want).abs().max()) <= 1e-4


def test_cli_train_then_eval_at_other_layouts(tmp_path, capsys):
    data = write_tiny_squad(tmp_path / "train.json")
    out = tmp_path / "run"
    code = shardserve_main(
        [
            "train", "--model", "tiny-bert", "--train-file", str(data), "--output", str(out),
            "--pp", "2", "--tp", "1", "--batch-size", "4", "--micro-batch-size", "2", "--max-steps", "2",
            "--max-seq-len", "64", "--doc-stride", "24", "--max-question-len", "16", "--no-progress",
            "--eval-file", str(data),
        ]
    )  # fmt: skip
    assert code == 0
    assert "eval at step 2" in capsys.readouterr().out
    assert (out / "final" / "config.json").is_file() and (out / "final" / "model.safetensors").is_file()
    scores = []
    for pp, tp in [(1, 1), (2, 2)]:
        code = shardserve_main(
            [
                "eval", "--model", str(out / "final"), "--data", str(data), "--pp", str(pp), "--tp", str(tp),
                "--max-seq-len", "64", "--doc-stride", "24", "--max-question-len", "16", "--json",
            ]
        )  # fmt: skip
        assert code == 0
        scores.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert scores[0]["total"] == 27 and 0 <= scores[0]["f1"] <= 100
    assert scores[0]["f1"] == pytest.approx(scores[1]["f1"]) and scores[0]["exact"] == pytest.approx(
        scores[1]["exact"]
    )
    # the training run's own evaluation (through the training gang) agrees with `shardserve eval`
    in_run = json.loads((out / "eval_results.json").read_text())["2"]
    assert in_run["f1"] == pytest.approx(scores[0]["f1"])
    # and transformers itself loads the checkpoint, with the same logits
    from transformers import AutoModelForQuestionAnswering

    hf = AutoModelForQuestionAnswering.from_pretrained(str(out / "final")).eval()
    ours = build_model(dataclasses.replace(resolve_model("tiny-bert"), checkpoint=out / "final"))
    ids = torch.randint(1000, 2000, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    with torch.inference_mode():
        want = hf(input_ids=ids, attention_mask=mask).start_logits
        got = ours(ids, mask)[..., 0]
    assert float((got - want).abs().max()) <= 1e-4


def test_sigkilled_cli_run_resumes_to_the_same_weights(tmp_path):
    """`shardserve train` killed with SIGKILL once a checkpoint exists, then `--resume`d."""
    import os
    import signal
    import subprocess
    import sys
    import time

    cfg = base_config(tmp_path, pp=2, tp=1, max_steps=8, save_every=2, dropout=0.1, lr=1e-3)
    want = load_file(str(train(cfg, show_progress=False).final_checkpoint / "model.safetensors"))
    out = tmp_path / "killed"
    argv = [
        sys.executable, "-m", "shardserve.cli", "train", "--model", "tiny-bert", "--train-file", cfg.train_file,
        "--output", str(out), "--pp", "2", "--batch-size", "8", "--micro-batch-size", "2", "--max-steps", "8",
        "--lr", "1e-3", "--warmup-ratio", str(cfg.warmup_ratio), "--max-grad-norm", "0.5", "--dropout", "0.1",
        "--adam-eps", str(cfg.adam_eps), "--weight-decay", str(cfg.weight_decay),
        "--max-seq-len", "64", "--doc-stride", "24", "--max-question-len", "16", "--seed", "3",
        "--save-every", "2", "--no-progress", "--log-every", "0", "--precision", "fp32",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=os.getcwd(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list_checkpoints(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert list_checkpoints(out), "no checkpoint before the kill"
    assert not (out / "final").exists(), "the run finished before the kill"
    assert subprocess.run([*argv, "--resume"], cwd=os.getcwd(), timeout=300).returncode == 0
    got = load_file(str(out / "final" / "model.safetensors"))
    worst = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert worst <= 1e-6, worst


def test_cli_resume_summary_counts_only_this_runs_steps(tmp_path, capsys):
    """A resumed run reports the steps IT did and their rate (it used to say "trained 3 steps ...
    (0.0 examples/s)" after one 8-example step)."""
    data = write_tiny_squad(tmp_path / "train.json")
    argv = [
        "train", "--model", "tiny-bert", "--train-file", str(data), "--output", str(tmp_path / "run"),
        "--batch-size", "8", "--micro-batch-size", "4", "--max-steps", "3", "--save-every", "2",
        "--max-seq-len", "64", "--doc-stride", "24", "--max-question-len", "16", "--no-progress",
        "--precision", "fp32", "--log-every", "0",
    ]  # fmt: skip
    assert shardserve_main([*argv, "--fail-at-step", "2"]) == 1  # crashes after checkpoint-2
    capsys.readouterr()
    assert shardserve_main([*argv, "--resume"]) == 0
    summary = capsys.readouterr().out.splitlines()[0]
    assert summary.startswith("trained 1 step (resumed at step 2 of 3) in "), summary
    rate = float(summary.split("(")[2].split(" examples/s")[0])
    assert rate > 0, summary


def test_cli_resume_falls_back_past_a_truncated_checkpoint(tmp_path, capsys, caplog):
    """The newest checkpoint's rank file truncated (a disk filled up, a copy cut short): --resume
    failed on it although checkpoint-2 was intact. Now it warns, naming the damaged one, resumes from
    checkpoint-2, and its pruning (--keep-checkpoints 1) spares the damaged checkpoint-4 without
    letting it push out the new intact checkpoint-3."""
    import logging

    data = write_tiny_squad(tmp_path / "train.json")
    out = tmp_path / "run"
    argv = [
        "train", "--model", "tiny-bert", "--train-file", str(data), "--output", str(out),
        "--batch-size", "8", "--micro-batch-size", "4", "--max-steps", "6", "--save-every", "2",
        "--max-seq-len", "64", "--doc-stride", "24", "--max-question-len", "16", "--no-progress",
        "--precision", "fp32", "--log-every", "0",
    ]  # fmt: skip
    assert shardserve_main([*argv, "--fail-at-step", "4"]) == 1  # crashes after checkpoint-4
    assert [step for step, _ in list_checkpoints(out)] == [2, 4]
    damaged = out / "checkpoint-4" / "training_state" / "rank0.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-100])
    capsys.readouterr()
    with caplog.at_level(logging.WARNING, logger="shardserve.training.checkpoint"):
        assert shardserve_main([*argv, "--resume", "--save-every", "3", "--keep-checkpoints", "1"]) == 0
    summary = capsys.readouterr().out.splitlines()[0]
    assert summary.startswith("trained 4 steps (resumed at step 2 of 6) in "), summary
    warnings = [r.getMessage() for r in caplog.records if r.name == "shardserve.training.checkpoint"]
    assert len(warnings) == 1, warnings
    (line,) = warnings
    assert line.startswith(f"--resume: {out / 'checkpoint-4'} is damaged ({damaged}: unreadable ("), line
    assert f"resuming from {out / 'checkpoint-2'}," in line, line
    assert [step for step, _ in list_checkpoints(out)] == [3, 4] and (out / "final").is_dir()
    assert damaged.stat().st_size > 0  # left as it was
