"""Export a parameter-efficient run as a small overlay for the embedded ``default`` model.

Copies ``CKPT/overlay.safetensors`` (LoRA factors with the scale folded into ``lora_B``, trained
biases / LayerNorms, QA head; canonical names) into ``DEST/`` together with the QA head bias
(frozen during training, so it is taken from the merged weights) and a ``default-model.json``
describing the run (command, data hash, steps, seed, metrics). ``models.registry`` loads every
``models/default/*.safetensors`` as an overlay on the bundled MiniLM, and
``models.hf_weights.load_weights`` merges the factors into the base weights, slice by slice.

    python -m training.export_overlay --checkpoint /tmp/ft/default-lora/final --dest models/default \\
        --metrics eval.json --command "shardserve train ..."   # --checkpoint again for stacked runs
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from training.checkpoint import OVERLAY_FILE, read_state

logger = logging.getLogger(__name__)

OVERLAY_NAME = "default-qa-overlay.safetensors"
MAX_BYTES = 8 * 1024 * 1024


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


def export_overlay(
    checkpoint: Path | list[Path],
    dest: Path,
    *,
    dtype: torch.dtype = torch.float32,
    info: dict[str, Any] | None = None,
) -> Path:
    """Write ``dest/OVERLAY_NAME`` and ``dest/default-model.json``; returns the overlay path.

    ``checkpoint``: one run's checkpoint dir, or several stacked runs (see ``combine_overlays``).
    """
    checkpoints = [checkpoint] if isinstance(checkpoint, Path) else list(checkpoint)
    tensors = {k: v.to(dtype).contiguous() for k, v in combine_overlays(checkpoints).items()}
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / OVERLAY_NAME
    tmp = out.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt", "source": ",".join(map(str, checkpoints))})
    size = tmp.stat().st_size
    if size > MAX_BYTES:
        tmp.unlink()
        raise ValueError(
            f"overlay is {size / 2**20:.2f} MiB > {MAX_BYTES / 2**20:.0f} MiB; use a lower LoRA rank or fp16"
        )
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
        "dtype": str(dtype).removeprefix("torch."),
        "tensors": len(tensors),
        "runs": runs,
        **(info or {}),
    }
    (dest / "default-model.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    logger.info("wrote %s (%.2f MiB, %d tensors)", out, size / 2**20, len(tensors))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--checkpoint",
        type=Path,
        action="append",
        required=True,
        help="a run's checkpoint dir (e.g. RUN/final); repeat for runs stacked on each other, in order",
    )
    p.add_argument("--dest", type=Path, default=Path("models/default"), help="where the overlay goes")
    p.add_argument("--fp16", action="store_true", help="store the overlay in float16 (half the size)")
    p.add_argument("--metrics", type=Path, default=None, help="JSON of `shardserve eval --json` to record")
    p.add_argument("--command", action="append", default=None, help="a training command, recorded verbatim")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    info: dict[str, Any] = {}
    if args.metrics is not None:
        info["heldout_metrics"] = json.loads(args.metrics.read_text())
    if args.command:
        info["commands"] = args.command
    export_overlay(args.checkpoint, args.dest, dtype=torch.float16 if args.fp16 else torch.float32, info=info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
