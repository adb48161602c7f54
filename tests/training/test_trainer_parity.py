"""Partitioned training equals single-process training.

A few optimizer steps of the trainer's gang at (pp, tp) = (2, 1), (1, 2), (2, 2) with GPipe and
1F1B (and with LoRA / frozen layers) give the same parameters, within 1e-5, as a plain
single-process PyTorch loop over the same data order (tiny-bert, fp32, dropout 0, gradient
clipping active). In bf16 autocast the bound is on the trajectory (losses and the direction and
size of the weight update; see the bf16 test). The final weights are read back from the run's Hugging Face checkpoint, so the
shard merge is checked too.

    python -m pytest tests/training/test_trainer_parity.py -q
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from shardserve.models.build import build_model
from shardserve.models.hf_weights import to_hf_state_dict
from shardserve.models.qa_windows import WindowConfig
from shardserve.models.registry import resolve_model
from shardserve.partitioner.lora import merged_state_dict
from shardserve.partitioner.precision import DTYPES, autocast_for, resolve_dtype
from shardserve.training.config import TrainConfig
from shardserve.training.driver import train
from shardserve.training.features import prepare_data
from shardserve.training.objective import lr_at, param_groups, span_loss
from shardserve.training.rank import apply_peft, batch_indices, trim, with_dropout

TOL = 1e-5
STEPS = 3

_CONTEXTS = [
    (
        "Normandy",
        "The Normans were the people who in the 10th and 11th centuries gave their name to Normandy, a region "
        "in France. They were descended from Norse raiders and pirates from Denmark, Iceland and Norway who, "
        "under their leader Rollo, agreed to swear fealty to King Charles III of West Francia.",
        [("Where is Normandy?", "France"), ("Who led the Norse?", "Rollo"), ("Which king?", "Charles III")],
    ),
    (
        "Physics",
        "Isaac Newton formulated the laws of motion and universal gravitation in 1687. Albert Einstein "
        "published the theory of general relativity in 1915, and Marie Curie won two Nobel prizes.",
        [
            ("When were the laws of motion formulated?", "1687"),
            ("Who published general relativity?", "Albert Einstein"),
            ("How many Nobel prizes did Curie win?", "two"),
        ],
    ),
    (
        "Rivers",
        "The Amazon is the largest river by discharge volume of water in the world. The Nile, in Africa, is "
        "often regarded as the longest river. The Danube flows through Vienna, Budapest and Belgrade.",
        [
            ("Which river has the largest discharge?", "The Amazon"),
            ("Where is the Nile?", "Africa"),
            ("Which cities does the Danube pass?", "Vienna, Budapest and Belgrade"),
        ],
    ),
]


def write_tiny_squad(path: Path, *, copies: int = 3) -> Path:
    """A small SQuAD v1.1 file: 3 articles x `copies` paragraphs x 3 questions."""
    data = []
    for title, context, qas in _CONTEXTS:
        paragraphs = []
        for c in range(copies):
            paragraphs.append(
                {
                    "context": context,
                    "qas": [
                        {
                            "id": f"{title}-{c}-{i}",
                            "question": q,
                            "answers": [{"text": a, "answer_start": context.index(a)}],
                        }
                        for i, (q, a) in enumerate(qas)
                    ],
                }
            )
        data.append({"title": title, "paragraphs": paragraphs})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": "1.1", "data": data}))
    return path


def base_config(tmp_path: Path, **kw) -> TrainConfig:
    args = dict(
        model="tiny-bert",
        train_file=str(write_tiny_squad(tmp_path / "train.json")),
        output=str(tmp_path / "run"),
        batch_size=8,
        micro_batch_size=2,
        max_steps=STEPS,
        lr=1e-3,
        warmup_ratio=0.34,
        weight_decay=0.01,
        max_grad_norm=0.5,
        dropout=0.0,
        window=WindowConfig(max_seq_len=64, doc_stride=24, max_question_len=16),
        seed=3,
        log_every=0,
        adam_eps=1e-6,
        precision="fp32",
    )
    args.update(kw)
    return TrainConfig(**args)


def reference_weights(cfg: TrainConfig) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain single-process training over the same data order; returns HF-named merged weights."""
    source = with_dropout(resolve_model(cfg.model), cfg.dropout)
    data = prepare_data(cfg, source)
    with safe_open(str(data.path), framework="pt", device="cpu") as f:
        t = {k.split(".", 1)[1]: f.get_tensor(k).long() for k in f.keys() if k.startswith("train.")}
    starts, ends = (
        (t["start_candidates"], t["end_candidates"])
        if cfg.answer_occurrences == "all"
        else (t["start_positions"], t["end_positions"])
    )
    autocast = autocast_for(torch.device("cpu"), DTYPES[resolve_dtype(cfg.precision).name])
    torch.manual_seed(cfg.seed)
    model = build_model(source).train()
    apply_peft(model, cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.adam_betas, eps=cfg.adam_eps
    )
    total = cfg.max_steps
    assert total is not None
    warmup = int(cfg.warmup_ratio * total)
    losses = []
    for step in range(total):
        idx = batch_indices(step, n_train=data.n_train, batch_size=cfg.batch_size, seed=cfg.seed)
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
        for mb in range(cfg.n_micro):
            rows = idx[mb * cfg.micro_batch_size : (mb + 1) * cfg.micro_batch_size]
            mask = t["attention_mask"][rows]
            ids, types, mask = trim(t["input_ids"][rows], t["token_type_ids"][rows], mask, mask=mask)
            with autocast():
                logits = model(ids, mask, types)  # (b, S, 2)
            loss = span_loss(logits, mask, starts[rows], ends[rows]) / cfg.n_micro
            loss.backward()
            step_loss += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr=cfg.lr, total_steps=total, warmup_steps=warmup)
        opt.step()
        losses.append(step_loss)
    return to_hf_state_dict(source.config.arch, merged_state_dict(model)), losses


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    worst, where = 0.0, ""
    for k in want:
        d = float((got[k] - want[k]).abs().max())
        if d > worst:
            worst, where = d, k
    return worst, where


CASES = [
    pytest.param(dict(pp=2, tp=1, schedule="gpipe"), id="pp2-gpipe"),
    pytest.param(dict(pp=2, tp=1, schedule="1f1b"), id="pp2-1f1b"),
    pytest.param(dict(pp=1, tp=2, schedule="1f1b"), id="tp2"),
    pytest.param(dict(pp=2, tp=2, schedule="gpipe"), id="pp2-tp2-gpipe"),
    pytest.param(dict(pp=2, tp=2, schedule="1f1b"), id="pp2-tp2-1f1b"),
    pytest.param(dict(pp=2, tp=2, schedule="1f1b", lora_rank=4, lora_alpha=8.0, lr=3e-3), id="pp2-tp2-lora"),
    pytest.param(dict(pp=3, tp=1, schedule="1f1b", freeze_layers=3), id="pp3-freeze3"),
    pytest.param(dict(pp=2, tp=1, schedule="1f1b", model="tiny-xlm-roberta"), id="xlm-roberta-pp2"),
    pytest.param(dict(pp=2, tp=1, schedule="1f1b", model="tiny-electra"), id="electra-pp2"),
    # ALBERT: each stage's copy of the one shared layer takes the sum of every stage's gradients
    pytest.param(dict(pp=2, tp=1, schedule="1f1b", model="tiny-albert"), id="albert-pp2"),
    pytest.param(dict(pp=3, tp=2, schedule="gpipe", model="tiny-albert"), id="albert-pp3-tp2"),
    pytest.param(dict(pp=2, tp=1, schedule="1f1b", model="tiny-deberta-v2"), id="deberta-v2-pp2"),
    # ModernBERT's fused projections: each tp rank holds its slice of every block; the checkpoint joins them
    pytest.param(dict(pp=2, tp=2, schedule="gpipe", model="tiny-modernbert"), id="modernbert-pp2-tp2"),
    pytest.param(dict(pp=2, tp=1, schedule="1f1b", model="tiny-llama"), id="llama-pp2"),
    pytest.param(dict(pp=2, tp=2, schedule="1f1b", model="tiny-qwen2"), id="qwen2-pp2-tp2"),
    pytest.param(dict(pp=2, tp=1, schedule="gpipe", model="tiny-mistral"), id="mistral-pp2"),
    pytest.param(
        dict(pp=2, tp=2, schedule="1f1b", model="tiny-llama", lora_rank=4, lora_alpha=8.0, lr=3e-3),
        id="llama-pp2-tp2-lora",
    ),
]


@pytest.mark.parametrize("overrides", CASES)
def test_partitioned_training_matches_single_process(tmp_path, overrides):
    cfg = base_config(tmp_path, **overrides)
    want, ref_losses = reference_weights(cfg)
    result = train(cfg, show_progress=False)
    got = load_file(str(result.final_checkpoint / "model.safetensors"))
    diff, where = max_diff(got, want)
    assert diff <= TOL, f"max |param diff| {diff:.3g} at {where}"
    losses = [result.losses[s + 1] for s in range(STEPS)]
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    # The weights moved (so the comparison has teeth), by far more than the tolerance.
    source = resolve_model(cfg.model)
    base = to_hf_state_dict(source.config.arch, merged_state_dict(build_model(source)))
    moved, _ = max_diff(got, base)
    assert moved > 100 * TOL
    if cfg.tp == 2:
        # Replicated tensors (LayerNorms, row-parallel biases, head) stay identical on the tp ranks.
        states = [
            load_file(str(p)) for p in sorted((result.final_checkpoint / "training_state").glob("rank*"))
        ]
        for a, b in zip(states[0::2], states[1::2], strict=True):
            for k in a:
                if k.endswith(("norm.weight", "norm.bias", "out.bias", "down.bias")) or k.startswith(
                    "qa_outputs."
                ):
                    assert torch.equal(a[k], b[k]), k


def _flat_update(weights: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([(weights[k] - base[k]).flatten() for k in sorted(base)])


@pytest.mark.parametrize(("pp", "tp"), [(1, 1), (2, 1), (1, 2)], ids=["single", "pp2", "tp2"])
def test_bf16_partitioned_training_tracks_single_process_bf16(tmp_path, pp, tp):
    """bf16 autocast (fp32 master weights and AdamW state) at (pp, tp) against the single-process
    bf16 loop. bf16 sums in another order differ by ~1e-3 relative, so the stated bound is on the
    training trajectory: losses within 1e-2, and the weight update of the run (final - initial)
    within 3 % of the reference's in norm and with cosine similarity >= 0.99."""
    cfg = base_config(tmp_path, pp=pp, tp=tp, schedule="1f1b", precision="bf16")
    want, ref_losses = reference_weights(cfg)
    result = train(cfg, show_progress=False)
    got = load_file(str(result.final_checkpoint / "model.safetensors"))
    source = resolve_model(cfg.model)
    base = to_hf_state_dict(source.config.arch, merged_state_dict(build_model(source)))
    u_got, u_want = _flat_update(got, base), _flat_update(want, base)
    cosine = float(torch.nn.functional.cosine_similarity(u_got, u_want, dim=0))
    assert cosine >= 0.99, cosine
    assert float(u_got.norm()) == pytest.approx(float(u_want.norm()), rel=0.03)
    assert [result.losses[s + 1] for s in range(STEPS)] == pytest.approx(ref_losses, abs=1e-2)
    # bf16 really ran: an fp32 run of the same config ends elsewhere by far more than fp32's 1e-5
    fp32, _ = reference_weights(dataclasses.replace(cfg, precision="fp32", output=str(tmp_path / "fp32")))
    assert max_diff(got, fp32)[0] > 100 * TOL


@pytest.mark.parametrize(
    "freeze", [dict(freeze_layers=4), dict(freeze_embeddings=True)], ids=["layers-0-3", "embeddings"]
)
def test_frozen_layers_do_not_move(tmp_path, freeze):
    cfg = base_config(tmp_path, pp=1, tp=1, max_steps=2, **freeze)
    result = train(cfg, show_progress=False)
    got = load_file(str(result.final_checkpoint / "model.safetensors"))
    source = resolve_model(cfg.model)
    base = to_hf_state_dict(source.config.arch, merged_state_dict(build_model(source)))
    null_space = ("self.key.bias", "qa_outputs.bias", "layer.5.output.LayerNorm.bias")  # always frozen
    for k, v in base.items():
        frozen = k.startswith("bert.embeddings.") or any(f"layer.{i}." in k for i in range(cfg.freeze_layers))
        assert torch.equal(got[k], v) == (frozen or k.endswith(null_space)), k
