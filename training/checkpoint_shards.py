"""A checkpoint's per-rank shard files: each rank's tensors written with the slices it holds,
merged back into full tensors, and restored into a rank of the same or of another (pp, tp) layout.

``training/checkpoint.py`` (save / resume of a run) calls these: every rank writes
``training_state/rank{r}.safetensors`` (trainable parameters and AdamW moments,
``optim.{name}.exp_avg`` / ``.exp_avg_sq`` / ``.step``) and ``shards/rank{r}.safetensors`` (its
merged-LoRA weights); rank 0 merges the latter into the HF weights and, for parameter-efficient
runs, the former into the overlay. Everything is read back with safetensors only::

    write_shard(tmp / "training_state" / "rank0.safetensors", tensors, shard_specs_of(stage), tp_rank=0)
    full = merge_shards(sorted((tmp / "shards").glob("rank*.safetensors")))   # name -> full tensor
    load_rank_state(ckpt / "training_state" / "rank0.safetensors", stage, opt)   # same layout
    load_resharded(ckpt, stage, opt)                                             # another (pp, tp)
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from shardserve.partitioner.shard_loading import ShardSlice, shard_specs_of
from shardserve.training.config import TrainConfig


class ResumeError(RuntimeError):
    """A checkpoint cannot be resumed (missing, or written with a different layout); names the numbers."""


def write_shard(
    path: Path, tensors: dict[str, torch.Tensor], specs: dict[str, ShardSlice], *, tp_rank: int
) -> None:
    """One rank's tensors plus the slices they hold (in the safetensors metadata)."""
    meta = {
        "tp_rank": str(tp_rank),
        "shard_specs": json.dumps({k: s.to_list() for k, s in specs.items() if k in tensors}),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path), metadata=meta)


MOMENTS: tuple[str, ...] = ("exp_avg", "exp_avg_sq")  # AdamW state shaped like its parameter


def _with_moment_specs(specs: dict[str, list[int]]) -> dict[str, list[int]]:
    """A parameter's AdamW moments (``optim.{name}.exp_avg`` ...) are sliced like the parameter."""
    return specs | {f"optim.{name}.{m}": spec for name, spec in specs.items() for m in MOMENTS}


@contextlib.contextmanager
def open_shard(path: Path) -> Iterator[Any]:
    """``safe_open`` of a rank's shard file; a damaged one is a `ResumeError` naming it."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            yield f
    except SafetensorError as exc:
        raise ResumeError(f"{path}: unreadable ({exc}); resume from an earlier checkpoint") from exc


def merge_shards(paths: list[Path]) -> dict[str, torch.Tensor]:
    """Full tensors from per-rank shard files: sharded names (and their AdamW moments)
    concatenated in slice order, replicated names taken from the lowest tensor-parallel rank that
    holds them."""
    pieces: dict[str, list[tuple[int, ShardSlice, torch.Tensor]]] = {}
    replicated: dict[str, tuple[int, torch.Tensor]] = {}
    for path in paths:
        with open_shard(path) as f:
            meta = f.metadata() or {}
            specs = _with_moment_specs(json.loads(meta.get("shard_specs", "{}")))
            tp_rank = int(meta.get("tp_rank", "0"))
            for name in f.keys():
                t = f.get_tensor(name)
                if name in specs:
                    spec = ShardSlice(*specs[name])
                    pieces.setdefault(name, []).append((spec.start, spec, t))
                elif name not in replicated or tp_rank < replicated[name][0]:
                    replicated[name] = (tp_rank, t)
    out = {k: t for k, (_, t) in replicated.items()}
    for name, parts in pieces.items():
        parts.sort(key=lambda p: p[0])
        dim, blocks = parts[0][1].dim, parts[0][1].blocks
        # each piece holds its slice of every block (a fused projection): join block by block
        per_block = [t.chunk(blocks, dim=dim) for _, _, t in parts]
        out[name] = torch.cat([torch.cat([p[b] for p in per_block], dim=dim) for b in range(blocks)], dim=dim)
    return out


def optimizer_tensors(opt: torch.optim.Optimizer, names: dict[nn.Parameter, str]) -> dict[str, torch.Tensor]:
    """AdamW state as flat named tensors (``optim.{param}.{exp_avg,exp_avg_sq,step}``)."""
    out: dict[str, torch.Tensor] = {}
    for p, state in opt.state.items():
        name = names[p]
        for key, value in state.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
            out[f"optim.{name}.{key}"] = t.detach().cpu()
    return out


def _restore(
    get: Callable[[str], torch.Tensor],
    keys: set[str],
    module: nn.Module,
    opt: torch.optim.Optimizer | None,
    *,
    where: str,
    specs: dict[str, ShardSlice] | None = None,
) -> None:
    """Copy trainable parameters and AdamW state named in ``keys`` (read with ``get``) into
    ``module``/``opt``; with ``specs``, the tensors are full and this rank takes its slices."""

    def fetch(key: str, name: str) -> torch.Tensor:
        t = get(key)
        spec = specs.get(name) if specs is not None else None
        return spec.take(t) if spec is not None and t.dim() > 0 else t

    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if name in keys:
                t = fetch(name, name)
                if t.shape != p.shape:
                    raise ResumeError(
                        f"{where}: {name} has shape {list(t.shape)}, this rank holds {list(p.shape)}"
                    )
                p.copy_(t.to(p.dtype))
            elif p.requires_grad:
                raise ResumeError(f"{where}: trainable parameter {name!r} not in the checkpoint")
    if opt is None:
        return
    for p in [q for group in opt.param_groups for q in group["params"]]:
        name = next(n for n, q in params.items() if q is p)
        state = {}
        for key in ("step", *MOMENTS):
            k = f"optim.{name}.{key}"
            if k in keys:
                t = fetch(k, name)
                state[key] = t.to(p.device).contiguous() if key != "step" else t
        if state:
            opt.state[p] = state


def load_rank_state(path: Path, module: nn.Module, opt: torch.optim.Optimizer | None) -> None:
    """Restore one rank's trainable parameters and optimizer moments written by ``write_shard``."""
    if not path.is_file():
        raise ResumeError(f"{path}: missing rank training state")
    with open_shard(path) as f:
        _restore(f.get_tensor, set(f.keys()), module, opt, where=str(path))


def load_resharded(ckpt: Path, module: nn.Module, opt: torch.optim.Optimizer | None) -> None:
    """Restore a rank of ANOTHER (pp, tp) layout: merge every rank's training state of ``ckpt``
    into full tensors (parameters and AdamW moments), then take this rank's slices."""
    paths = sorted((ckpt / "training_state").glob("rank*.safetensors"))
    if not paths:
        raise ResumeError(f"{ckpt}: no training_state/rank*.safetensors to re-shard")
    full = merge_shards(paths)
    config = getattr(module, "config", None)
    if config is not None and config.shares_layers:
        full = _alias_shared_layer(full, config.num_layers)
    _restore(full.__getitem__, set(full), module, opt, where=str(ckpt), specs=shard_specs_of(module))


_LAYER_KEY = re.compile(r"^(optim\.)?layers\.\d+\.(.+)$")


def _alias_shared_layer(full: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """A shared layer (ALBERT) under every layer index: each stage wrote its copy under the index of
    its first layer, and a stage of another layout looks for the index of ITS first layer."""
    out = dict(full)
    for key, t in full.items():
        if m := _LAYER_KEY.match(key):
            for i in range(num_layers):
                out.setdefault(f"{m.group(1) or ''}layers.{i}.{m.group(2)}", t)
    return out


def overlay_tensors(training_state: dict[str, torch.Tensor], cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """The trained tensors of a parameter-efficient run (optimizer moments dropped), the LoRA scale
    folded into ``lora_B`` so that the overlay's update is plainly ``B A``."""
    overlay = {k: v for k, v in training_state.items() if not k.startswith("optim.")}
    for k in [k for k in overlay if k.endswith(".lora_B")]:
        overlay[k] = overlay[k] * (cfg.lora_alpha / cfg.lora_rank)
    return {k: v.contiguous() for k, v in overlay.items()}
