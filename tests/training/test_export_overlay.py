"""Overlay export: stacked LoRA runs and fully fine-tuned runs compressed to low rank.

- stacked runs' LoRA factors concatenate into one overlay whose ``B A`` is the sum of the runs';
- a full fine-tuning run (embeddings frozen) exported against its base: with room for every rank
  the overlay reproduces the checkpoint exactly; under a small budget it fits, keeps the
  highest-energy terms (at least as much energy as the best uniform rank) and loads as base + B A;
  changed embeddings that cannot fit are refused with the fix in the message.

    python -m pytest tests/training/test_export_overlay.py -q
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardserve.cli import main as shardserve_main
from shardserve.models.build import build_model
from shardserve.models.registry import resolve_model
from shardserve.training.driver import train
from shardserve.training.export_overlay import (
    LARGE_MAX_BYTES,
    combine_overlays,
    export_overlay,
    low_rank_overlay,
)
from tests.training.test_trainer_parity import base_config


def test_stacked_runs_combine_into_one_overlay(tmp_path):
    runs = []
    for k in range(2):
        d = tmp_path / f"run{k}"
        d.mkdir()
        g = torch.Generator().manual_seed(k)
        save_file(
            {
                "layers.0.mlp.up.lora_A": torch.randn(2, 3, generator=g),  # (r, in)
                "layers.0.mlp.up.lora_B": torch.randn(4, 2, generator=g),  # (out, r)
                "layers.0.mlp.up.bias": torch.full((4,), float(k)),
            },
            str(d / "overlay.safetensors"),
        )
        save_file(
            {"qa_outputs.weight": torch.full((2, 3), float(k)), "qa_outputs.bias": torch.zeros(2)},
            str(d / "model.safetensors"),
        )
        runs.append(d)
    parts = [load_file(str(d / "overlay.safetensors")) for d in runs]
    out = combine_overlays(runs)
    name = "layers.0.mlp.up"
    want = sum(p[f"{name}.lora_B"] @ p[f"{name}.lora_A"] for p in parts)
    assert torch.allclose(out[f"{name}.lora_B"] @ out[f"{name}.lora_A"], want)
    assert out[f"{name}.lora_A"].shape == (4, 3)
    assert torch.equal(out[f"{name}.bias"], parts[1][f"{name}.bias"])  # the later run wins
    assert torch.equal(out["qa_outputs.weight"], torch.ones(2, 3))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """A short full fine-tuning run of tiny-bert with the embeddings frozen (its final checkpoint)."""
    tmp = tmp_path_factory.mktemp("full")
    cfg = base_config(tmp, pp=1, tp=1, max_steps=3, lr=1e-2, freeze_embeddings=True)
    return train(cfg, show_progress=False).final_checkpoint


def _loaded(overlay_path):
    return build_model(dataclasses.replace(resolve_model("tiny-bert"), overlays=(overlay_path,))).state_dict()


def test_full_run_with_room_for_every_rank_is_exact(full_run, tmp_path):
    overlay = export_overlay(full_run, tmp_path, base="tiny-bert")  # fp32, 8 MB: tiny-bert fits whole
    tensors = load_file(str(overlay))
    assert not any(n.startswith("embeddings.") for n in tensors)
    assert any(n.endswith(".lora_A") for n in tensors)
    want = build_model(resolve_model(str(full_run))).state_dict()
    got = _loaded(overlay)
    worst = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert worst <= 1e-5, worst


def test_full_run_under_a_small_budget(full_run, tmp_path):
    budget = 200 * 1024
    tensors, summary = low_rank_overlay(full_run, base="tiny-bert", max_bytes=budget, dtype=torch.float32)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "o.safetensors"))
    assert (tmp_path / "o.safetensors").stat().st_size <= budget
    assert 0.0 < summary["energy_kept"] < 1.0
    ranks = summary["ranks"]
    assert min(ranks.values()) < max(ranks.values())  # allocated by energy, not uniformly
    # every projection loads as base + B A, and the greedy choice keeps at least the energy of the
    # best uniform rank that fits the same bytes
    ft = build_model(resolve_model(str(full_run))).state_dict()
    base = build_model(resolve_model("tiny-bert")).state_dict()
    got = _loaded(tmp_path / "o.safetensors")
    sigmas, per_rank_bytes = {}, 0
    for owner, r in ranks.items():
        w = f"{owner}.weight"
        b, a = tensors[f"{owner}.lora_B"], tensors[f"{owner}.lora_A"]
        assert b.shape[1] == a.shape[0] == r
        assert torch.allclose(got[w], base[w] + b @ a, atol=1e-5)
        sigmas[owner] = torch.linalg.svdvals((ft[w] - base[w]).double())
        per_rank_bytes += 4 * (b.shape[0] + a.shape[1])
    factor_bytes = sum(
        4 * (tensors[f"{o}.lora_B"].shape[0] + tensors[f"{o}.lora_A"].shape[1]) * r for o, r in ranks.items()
    )
    uniform = factor_bytes // per_rank_bytes
    total = sum(float((s**2).sum()) for s in sigmas.values())
    uniform_kept = sum(float((s[:uniform] ** 2).sum()) for s in sigmas.values()) / total
    assert summary["energy_kept"] >= uniform_kept - 1e-9
    assert summary["energy_kept"] == pytest.approx(
        sum(float((sigmas[o][:r] ** 2).sum()) for o, r in ranks.items()) / total, rel=1e-6
    )


def test_changed_embeddings_that_do_not_fit_are_refused(full_run, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(full_run, ckpt)
    state = load_file(str(ckpt / "model.safetensors"))
    name = next(k for k in state if k.endswith("word_embeddings.weight"))
    state[name] = state[name] + 0.01
    save_file(state, str(ckpt / "model.safetensors"))
    with pytest.raises(ValueError, match="--freeze-embeddings"):
        low_rank_overlay(ckpt, base="tiny-bert", max_bytes=200 * 1024, dtype=torch.float32)


def test_cli_records_named_metrics_and_its_size_budget(full_run, tmp_path):
    (tmp_path / "dev.json").write_text(json.dumps({"exact": 70.5, "f1": 80.25, "total": 8727}))
    argv = [
        "export-overlay",
        "--checkpoint",
        str(full_run),
        "--base",
        "tiny-bert",
        "--dest",
        str(tmp_path / "out"),
    ]
    assert (
        shardserve_main([*argv, "--max-bytes", "300000", "--metrics", f"dev_fp32={tmp_path / 'dev.json'}"])
        == 0
    )
    meta = json.loads((tmp_path / "out" / "default-model.json").read_text())
    assert meta["bytes"] <= meta["max_bytes"] == 300_000
    assert meta["metrics"] == {"dev_fp32": {"exact": 70.5, "f1": 80.25, "total": 8727}}
    with pytest.raises(SystemExit):  # one line from argparse, not a traceback
        shardserve_main([*argv, "--metrics", "no-equals-sign"])
    with pytest.raises(ValueError, match="24,000,000"):
        export_overlay(full_run, tmp_path / "big", base="tiny-bert", max_bytes=LARGE_MAX_BYTES + 1)
