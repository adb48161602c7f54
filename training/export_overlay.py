"""Export a fine-tuning run as a small overlay for the embedded ``default`` model.

Parameter-efficient runs: copies ``CKPT/overlay.safetensors`` (LoRA factors with the scale folded into ``lora_B``, trained
biases / LayerNorms, QA head; canonical names) into ``DEST/`` together with the QA head bias
(frozen during training, so it is taken from the merged weights) and a ``default-model.json``
describing the run (command, data hash, steps, seed, metrics). ``shardserve.models.registry`` loads every
``models/default/*.safetensors`` as an overlay on the bundled MiniLM, and
``shardserve.models.hf_weights.load_weights`` merges the factors into the base weights, slice by slice.

Full fine-tuning runs (``--base MODEL``): every tensor that differs from ``MODEL`` goes into the
overlay; each projection's update ``W_ft - W_base`` is factored by truncated SVD into the same
``lora_A`` / ``lora_B`` form, with ranks chosen across all projections to keep the most singular
value energy per byte under the size budget (``low_rank_overlay``).

    shardserve export-overlay --checkpoint /tmp/ft/default-lora/final --dest models/default \\
        --metrics dev=eval.json --command "shardserve train ..."   # --checkpoint again for stacked runs
    shardserve export-overlay --checkpoint /tmp/ft/full/final --base minilm --fp16
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from shardserve.models.build import build_model
from shardserve.models.registry import resolve_model
from shardserve.partitioner.lora import lora_targets
from shardserve.training.checkpoint import OVERLAY_FILE, read_state

logger = logging.getLogger(__name__)

OVERLAY_NAME = "default-qa-overlay.safetensors"
MAX_BYTES = 8_000_000  # the "<= 8 MB", read strictly (decimal megabytes)
LARGE_MAX_BYTES = 24_000_000  # allowed only where it measurably buys >= 0.5 dev F1
HEADER_RESERVE = 64 * 1024  # safetensors JSON header and alignment, generously


def combine_overlays(checkpoints: list[Path]) -> dict[str, torch.Tensor]:
    """One overlay from runs trained one on top of the other (run k's --model = run k-1's merged
    output): LoRA factors are concatenated along the rank (``[B_1 B_2] [A_1; A_2] = B_1 A_1 + B_2 A_2``,
    scales already folded into B), every other tensor is taken from the latest run."""
    out: dict[str, torch.Tensor] = {}
    for ckpt_dir in checkpoints:
        src = ckpt_dir / OVERLAY_FILE
        if not src.is_file():
            raise FileNotFoundError(
                f"{src}: no overlay (was the run trained with --lora-rank / --freeze-layers?)"
            )
        tensors = load_file(str(src))
        merged = load_file(str(ckpt_dir / "model.safetensors"))
        for name in ("qa_outputs.weight", "qa_outputs.bias"):
            tensors.setdefault(name, merged[name])
        for name, t in tensors.items():
            if name in out and name.endswith(".lora_A"):
                out[name] = torch.cat([out[name], t], dim=0)  # (r1 + r2, in)
            elif name in out and name.endswith(".lora_B"):
                out[name] = torch.cat([out[name], t], dim=1)  # (out, r1 + r2)
            else:
                out[name] = t
    return out


@torch.no_grad()
def low_rank_overlay(
    checkpoint: Path, *, base: str, max_bytes: int, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The overlay of a fully fine-tuned ``checkpoint`` over ``base``, at most ``max_bytes``.

    Tensors that equal the base's are left out (unless the base only initialised them, like a
    missing QA head); changed projections (``lora_targets``) are stored as
    ``lora_B @ lora_A`` = their update's best rank-r approximation (truncated SVD, the factors sharing
    the singular values as ``U sqrt(S)`` and ``sqrt(S) V^T``); every other changed tensor is stored
    whole. Ranks: the rank-one terms of all projections are taken in order of ``sigma^2`` per byte
    (within one matrix that order is its own sigma order) until the budget is spent. Returns the
    tensors and a summary (ranks, retained energy fraction, worst absolute weight error).
    """
    ft = build_model(resolve_model(checkpoint)).state_dict()
    base_model = build_model(resolve_model(base))
    ref = base_model.state_dict()
    not_in_base = set(base_model.load_report.initialised)  # e.g. a base encoder's seeded QA head
    if ft.keys() != ref.keys():
        raise ValueError(
            f"{checkpoint} and {base} are different architectures: {sorted(ft.keys() ^ ref.keys())}"
        )
    projections = lora_targets(base_model)
    item = torch.empty((), dtype=dtype).element_size()
    whole: dict[str, torch.Tensor] = {}
    svds: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for name, w in ft.items():
        if torch.equal(w, ref[name]) and name not in not_in_base:
            continue
        owner = name.removesuffix(".weight")
        if name.endswith(".weight") and owner.endswith(projections):
            svds[owner] = torch.linalg.svd((w - ref[name]).double(), full_matrices=False)  # U, S, Vh
        else:
            whole[name] = w
    whole_bytes = sum(t.numel() * item for t in whole.values())
    budget = max_bytes - HEADER_RESERVE - whole_bytes
    if budget < 0:
        big = sorted(whole, key=lambda n: -whole[n].numel())[:3]
        raise ValueError(
            f"the changed non-projection tensors alone take {whole_bytes:,} bytes > the {max_bytes:,} "
            f"budget (largest: {big}); train with --freeze-embeddings"
        )
    # (sigma^2 per byte, owner, index): one candidate per rank-one term of every projection update
    terms = [
        (float(s_i) ** 2 / ((u.shape[0] + vh.shape[1]) * item), owner, i)
        for owner, (u, s, vh) in svds.items()
        for i, s_i in enumerate(s)
    ]
    ranks = dict.fromkeys(svds, 0)
    for _, owner, _ in sorted(terms, key=lambda t: -t[0]):
        u, _, vh = svds[owner]
        cost = (u.shape[0] + vh.shape[1]) * item
        if cost <= budget:
            ranks[owner] += 1
            budget -= cost
    out = dict(whole)
    kept = total = worst = 0.0
    for owner, (u, s, vh) in svds.items():
        r = ranks[owner]
        root = s[:r].sqrt()
        out[f"{owner}.lora_B"] = (u[:, :r] * root).float()  # (out, r)
        out[f"{owner}.lora_A"] = (root[:, None] * vh[:r]).float()  # (r, in)
        kept += float((s[:r] ** 2).sum())
        total += float((s**2).sum())
        approx = out[f"{owner}.lora_B"].to(dtype).float() @ out[f"{owner}.lora_A"].to(dtype).float()
        worst = max(worst, float((approx - (u * s) @ vh).abs().max()))
    summary = {
        "base": base,
        "ranks": ranks,
        "energy_kept": kept / total if total else 1.0,
        "max_abs_weight_error": worst,
    }
    logger.info(
        "low-rank overlay: ranks %d..%d, %.2f%% of the update's energy kept, max |error| %.2e",
        min(ranks.values(), default=0),
        max(ranks.values(), default=0),
        100 * summary["energy_kept"],
        worst,
    )
    return out, summary


def export_overlay(
    checkpoint: Path | list[Path],
    dest: Path,
    *,
    dtype: torch.dtype = torch.float32,
    info: dict[str, Any] | None = None,
    base: str | None = None,
    max_bytes: int = MAX_BYTES,
) -> Path:
    """Write ``dest/OVERLAY_NAME`` and ``dest/default-model.json``; returns the overlay path.

    ``checkpoint``: one run's checkpoint dir, or several stacked runs (see ``combine_overlays``);
    with ``base``, one fully fine-tuned run compressed against that model (``low_rank_overlay``)
    into at most ``max_bytes`` (8 MB; up to 24 MB where the larger file measurably buys accuracy).
    """
    if not 0 < max_bytes <= LARGE_MAX_BYTES:
        raise ValueError(f"max_bytes={max_bytes:,} must be in (0, {LARGE_MAX_BYTES:,}]")
    checkpoints = [checkpoint] if isinstance(checkpoint, Path) else list(checkpoint)
    info = dict(info or {})
    if base is None:
        tensors = combine_overlays(checkpoints)
    elif len(checkpoints) != 1:
        raise ValueError(f"--base takes one fully fine-tuned checkpoint, got {len(checkpoints)}")
    else:
        tensors, info["low_rank"] = low_rank_overlay(
            checkpoints[0], base=base, max_bytes=max_bytes, dtype=dtype
        )
    tensors = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / OVERLAY_NAME
    tmp = out.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt", "source": ",".join(map(str, checkpoints))})
    size = tmp.stat().st_size
    if size > max_bytes:
        tmp.unlink()
        raise ValueError(f"overlay is {size:,} bytes > {max_bytes:,}; use a lower LoRA rank or fp16")
    tmp.chmod(0o644)
    tmp.rename(out)
    runs = []
    for ckpt_dir in checkpoints:
        state = read_state(ckpt_dir)
        runs.append(
            {
                "trainer_state": {k: v for k, v in state.items() if k != "config"},
                "train_config": state.get("config"),
            }
        )
    meta = {
        "overlay": OVERLAY_NAME,
        "bytes": size,
        "max_bytes": max_bytes,
        "dtype": str(dtype).removeprefix("torch."),
        "tensors": len(tensors),
        "runs": runs,
        **info,
    }
    (dest / "default-model.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    logger.info("wrote %s (%.2f MiB, %d tensors)", out, size / 2**20, len(tensors))
    return out
