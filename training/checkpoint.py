"""Training checkpoints: per-rank shard files, their merge, the HF directory, and atomic publication.

A checkpoint directory ``OUT/checkpoint-{step}`` (and ``OUT/final``) holds:

- ``config.json``, ``model.safetensors`` (full merged weights, LoRA folded in), tokenizer files:
  a ``*ForQuestionAnswering`` directory that ``transformers`` and ``shardserve serve --model`` load;
- ``overlay.safetensors`` (parameter-efficient runs only): the trained tensors under canonical names
  (LoRA factors with the scale folded into ``lora_B``, biases, LayerNorms, QA head): an overlay
  that ``models.hf_weights.load_weights`` applies on top of the base model;
- ``trainer_state.json``: step, seed, layout, data hash, position in the data;
- ``training_state/rank{r}.safetensors``: that rank's trainable parameters and AdamW moments
  (``optim.{name}.exp_avg`` / ``.exp_avg_sq`` / ``.step``), for ``--resume``.

Every rank writes its files into ``OUT/.tmp-{name}``; after a barrier rank 0 merges the shards,
writes the HF files and renames the temporary directory into place, so a reader (or a resumed run)
never sees a half-written checkpoint. Everything is read back with safetensors only.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from models.hf_weights import ShardSlice

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
OVERLAY_FILE = "overlay.safetensors"
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


class ResumeError(RuntimeError):
    """A checkpoint cannot be resumed (missing, or written with a different layout); names the numbers."""


def shard_specs_of(module: nn.Module) -> dict[str, ShardSlice]:
    """Parameter name -> slice of the full tensor, for every sharded parameter of ``module``."""
    specs: dict[str, ShardSlice] = {}
    for name, _ in module.named_parameters():
        owner_name, _, local = name.rpartition(".")
        spec = getattr(module.get_submodule(owner_name), "shard_specs", {}).get(local)
        if spec is not None:
            specs[name] = spec
    return specs


def write_shard(
    path: Path, tensors: dict[str, torch.Tensor], specs: dict[str, ShardSlice], *, tp_rank: int
) -> None:
    """One rank's tensors plus the slices they hold (in the safetensors metadata)."""
    meta = {
        "tp_rank": str(tp_rank),
        "shard_specs": json.dumps({k: [s.dim, s.start, s.length] for k, s in specs.items() if k in tensors}),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path), metadata=meta)


def merge_shards(paths: list[Path]) -> dict[str, torch.Tensor]:
    """Full tensors from per-rank shard files: sharded names concatenated in slice order, replicated
    names taken from the lowest tensor-parallel rank that holds them."""
    pieces: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
    replicated: dict[str, tuple[int, torch.Tensor]] = {}
    for path in paths:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            specs = json.loads(meta.get("shard_specs", "{}"))
            tp_rank = int(meta.get("tp_rank", "0"))
            for name in f.keys():
                t = f.get_tensor(name)
                if name in specs:
                    dim, start, _length = specs[name]
                    pieces.setdefault(name, []).append((start, dim, t))
                elif name not in replicated or tp_rank < replicated[name][0]:
                    replicated[name] = (tp_rank, t)
    out = {k: t for k, (_, t) in replicated.items()}
    for name, parts in pieces.items():
        parts.sort(key=lambda p: p[0])
        out[name] = torch.cat([t for _, _, t in parts], dim=parts[0][1])
    return out


def list_checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete ``checkpoint-{step}`` under ``out_dir``, oldest first."""
    if not out_dir.is_dir():
        return []
    found = []
    for p in out_dir.iterdir():
        m = _CKPT_RE.match(p.name)
        if m and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(out_dir: Path) -> Path | None:
    ckpts = list_checkpoints(out_dir)
    return ckpts[-1][1] if ckpts else None


def read_state(ckpt: Path) -> dict[str, Any]:
    path = ckpt / STATE_FILE
    if not path.is_file():
        raise ResumeError(f"{ckpt}: no {STATE_FILE}; not a training checkpoint")
    return json.loads(path.read_text())


def publish(tmp: Path, final: Path) -> None:
    """Atomically replace ``final`` by ``tmp`` (rename; an older ``final`` is moved aside first).

    Files get the modes of ordinary files first (0644 / directories 0755 under the usual umask 022):
    safetensors writes 0600, and a checkpoint mounted into the container (user 10001) must be readable.
    """
    file_mode, dir_mode = 0o666 & ~_umask(), 0o777 & ~_umask()
    for path in [tmp, *tmp.rglob("*")]:
        if not path.is_symlink():
            path.chmod(dir_mode if path.is_dir() else file_mode)
    if final.exists():
        old = final.with_name(f".old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)


def _umask() -> int:
    """This process's umask (read without changing it where /proc allows)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def prune_checkpoints(out_dir: Path, *, keep: int) -> None:
    """Delete all but the newest ``keep`` ``checkpoint-*`` directories."""
    ckpts = list_checkpoints(out_dir)
    for _, path in ckpts[: max(0, len(ckpts) - keep)]:
        shutil.rmtree(path, ignore_errors=True)


def optimizer_tensors(opt: torch.optim.Optimizer, names: dict[nn.Parameter, str]) -> dict[str, torch.Tensor]:
    """AdamW state as flat named tensors (``optim.{param}.{exp_avg,exp_avg_sq,step}``)."""
    out: dict[str, torch.Tensor] = {}
    for p, state in opt.state.items():
        name = names[p]
        for key, value in state.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
            out[f"optim.{name}.{key}"] = t.detach().cpu()
    return out


def load_rank_state(path: Path, module: nn.Module, opt: torch.optim.Optimizer | None) -> None:
    """Restore one rank's trainable parameters and optimizer moments written by ``write_shard``."""
    if not path.is_file():
        raise ResumeError(f"{path}: missing rank training state")
    params = dict(module.named_parameters())
    with safe_open(str(path), framework="pt", device="cpu") as f:
        keys = set(f.keys())
        with torch.no_grad():
            for name, p in params.items():
                if name in keys:
                    t = f.get_tensor(name)
                    if t.shape != p.shape:
                        raise ResumeError(
                            f"{path}: {name} has shape {list(t.shape)}, this rank holds {list(p.shape)}"
                        )
                    p.copy_(t.to(p.dtype))
                elif p.requires_grad:
                    raise ResumeError(f"{path}: trainable parameter {name!r} not in the checkpoint")
        if opt is None:
            return
        for p in [q for group in opt.param_groups for q in group["params"]]:
            name = next(n for n, q in params.items() if q is p)
            state = {}
            for key in ("step", "exp_avg", "exp_avg_sq"):
                k = f"optim.{name}.{key}"
                if k in keys:
                    t = f.get_tensor(k)
                    state[key] = t.to(p.device) if key != "step" else t
            if state:
                opt.state[p] = state
