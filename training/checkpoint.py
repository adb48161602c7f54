"""Training checkpoints: save and resume of a run (`CheckpointManager`, as torchtitan's), the
checkpoint directories (listing, checking, pruning), the HF directory and atomic publication. The
per-rank shard files and their merge are ``training/checkpoint_shards.py``'s.

A checkpoint directory ``OUT/checkpoint-{step}`` (and ``OUT/final``) holds:

- ``config.json``, ``model.safetensors`` (full merged weights, LoRA folded in), tokenizer files:
  a ``*ForQuestionAnswering`` directory that ``transformers`` and ``shardserve serve --model`` load;
- ``overlay.safetensors`` (parameter-efficient runs only): the trained tensors under canonical names
  (LoRA factors with the scale folded into ``lora_B``, biases, LayerNorms, QA head): an overlay
  that ``shardserve.models.hf_weights.load_weights`` applies on top of the base model;
- ``trainer_state.json``: step, seed, layout, data hash, position in the data;
- ``training_state/rank{r}.safetensors``: that rank's trainable parameters and AdamW moments
  (``optim.{name}.exp_avg`` / ``.exp_avg_sq`` / ``.step``), for ``--resume``.

The checkpoint does not depend on the data-parallel degree: the replicas hold identical
parameters and (replicated, not ZeRO-sharded) AdamW state, so only replica 0's ``pp * tp`` ranks
write (ranks ``0 .. pp*tp-1``, the same files a ``dp = 1`` run writes) and any ``dp`` resumes from
them. Parameter names are the full model's (``layers.7.mlp.up.weight``) and every sharded tensor
records its slice, so the files are layout-free as well: ``--resume --elastic`` at another
(pp, tp) merges every rank's file into full tensors (moments sliced like their parameter) and
each new rank cuts out its own slices (``checkpoint_shards.load_resharded``). Without ``--elastic`` a (pp, tp) change
is refused, and each rank reads just its own file.

Every rank writes its files into ``OUT/.tmp-{name}``; after a barrier rank 0 merges the shards,
writes the HF files and renames the temporary directory into place, so a reader (or a resumed run)
never sees a half-written checkpoint. Everything is read back with safetensors only. A rank on
another host (``shardserve worker``) shares no filesystem with rank 0: it writes its files in a
scratch directory and sends them to rank 0, and on resume rank 0 sends it the files it reads
(``training/run_files.py``, over torch.distributed).

The driver asks `resume_point` where a ``--resume`` run starts (the newest checkpoint, refused if
its layout, seed, length or data differ; one whose trainer state or rank files are missing or do not
open is skipped for the newest intact one, with a warning, and left in place:
`choose_resume_checkpoint`); each rank owns a `CheckpointManager` that restores its
state (`load`) and writes its part of every checkpoint (`save`, when `due`)::

    manager = CheckpointManager(ctx, stage, opt, cfg=cfg, run=run, files=RunFiles(ctx, run))
    manager.load()
    for step in ...:
        ...
        if manager.due(step + 1):
            manager.save(step + 1, loss_scale=1.0)
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from shardserve.models.hf_weights import save_hf_checkpoint
from shardserve.partitioner.lora import merged_state_dict
from shardserve.partitioner.runtime.rank import RankContext
from shardserve.partitioner.shard_loading import shard_specs_of
from shardserve.training.checkpoint_shards import (
    ResumeError,
    load_rank_state,
    load_resharded,
    merge_shards,
    optimizer_tensors,
    overlay_tensors,
    write_shard,
)
from shardserve.training.config import RunInfo, TrainConfig
from shardserve.training.run_files import RunFiles

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
OVERLAY_FILE = "overlay.safetensors"
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


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
    """A checkpoint's ``trainer_state.json``; a `ResumeError` naming the file when it is missing,
    unreadable or not a JSON object with an integer ``step``."""
    path = ckpt / STATE_FILE
    if not path.is_file():
        raise ResumeError(f"{ckpt}: no {STATE_FILE}; not a training checkpoint")
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ResumeError(f"{path}: cannot be read: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ResumeError(f"{path}: not valid JSON ({exc}); the checkpoint is damaged") from exc
    if (
        not isinstance(state, dict)
        or isinstance(state.get("step"), bool)
        or not isinstance(state.get("step"), int)
    ):
        raise ResumeError(f"{path}: not a trainer state (a JSON object with an integer 'step')")
    return state


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _rank_file_problem(path: Path) -> str | None:
    """Why a rank's training-state file cannot be resumed from, or None: it must exist and open as
    safetensors, whose header parse checks that the data covers the file exactly (a truncated or
    padded file fails), with readable shard metadata. No tensor is read."""
    if not path.is_file():
        return f"{path}: missing"
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
        specs = json.loads(meta.get("shard_specs", "{}"))
        int(meta.get("tp_rank", "0"))
    except (SafetensorError, OSError) as exc:
        return f"{path}: unreadable ({_one_line(str(exc))})"
    except ValueError as exc:  # json.JSONDecodeError too
        return f"{path}: damaged shard metadata ({_one_line(str(exc))})"
    if not isinstance(specs, dict):
        return f"{path}: damaged shard metadata (shard_specs is not a JSON object)"
    return None


def checkpoint_problem(ckpt: Path, *, rank_files: bool = True) -> str | None:
    """Why ``ckpt`` cannot be resumed from, or None when it can: its trainer state reads, and (with
    ``rank_files``) the training state of each of its ``pp * tp`` ranks (and any other
    ``rank*.safetensors`` there, which an elastic resume merges) exists and opens
    (`_rank_file_problem`: headers only, cheap)."""
    try:
        state = read_state(ckpt)
    except ResumeError as exc:
        return _one_line(str(exc))
    if not rank_files:
        return None
    pp, tp = state.get("pp"), state.get("tp")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (pp, tp)):
        return f"{ckpt / STATE_FILE}: no pp / tp layout (pp={pp!r}, tp={tp!r})"
    folder = ckpt / "training_state"
    names = {f"rank{r}.safetensors" for r in range(pp * tp)}
    names |= {p.name for p in folder.glob("rank*.safetensors")}
    for name in sorted(names, key=lambda n: (len(n), n)):  # rank2 before rank10
        problem = _rank_file_problem(folder / name)
        if problem is not None:
            return problem
    return None


@dataclass(frozen=True)
class ResumeChoice:
    """The checkpoint a ``--resume`` run continues, and the newer ones it skipped as damaged."""

    path: Path
    skipped: tuple[tuple[Path, str], ...] = ()  # (damaged checkpoint, why), newest first


def _resume_candidates(out_dir: Path) -> list[Path]:
    """Newest first: ``final`` when it is newer than every ``checkpoint-*`` (or its state is
    unreadable: it is written last), then each ``checkpoint-*`` directory by step (also one without
    a trainer state: published checkpoints always have one, so it is a damaged one)."""
    if not out_dir.is_dir():
        return []
    ckpts = sorted(
        ((int(m.group(1)), p) for p in out_dir.iterdir() if (m := _CKPT_RE.match(p.name)) and p.is_dir()),
        reverse=True,
    )
    found = [p for _, p in ckpts]
    final = out_dir / "final"
    if (final / STATE_FILE).is_file():
        try:
            newer = not ckpts or read_state(final)["step"] > ckpts[0][0]
        except ResumeError:
            newer = True
        if newer:
            found.insert(0, final)
    return found


def choose_resume_checkpoint(out_dir: Path) -> ResumeChoice:
    """What ``--resume`` continues: the newest ``checkpoint-*`` of ``out_dir``, or its ``final`` when
    that is newer (a finished run: nothing is left to train), provided it is intact
    (`checkpoint_problem`; of ``final``, only its trainer state is read). A damaged one is skipped
    with a warning naming it, why, and the older checkpoint resumed instead; it is left in place (a
    resumed run's pruning spares it too). None intact, or none at all: a `ResumeError` naming each
    damaged checkpoint."""
    candidates = _resume_candidates(out_dir)
    if not candidates:
        raise ResumeError(f"--resume: no checkpoint-* with {STATE_FILE} under {out_dir}")
    skipped: list[tuple[Path, str]] = []
    for path in candidates:
        # a finished run's final: resuming it reads its trainer state alone (nothing is left to train)
        problem = checkpoint_problem(path, rank_files=path.name != "final")
        if problem is None:
            for bad, why in skipped:
                logger.warning(
                    "--resume: %s is damaged (%s); resuming from %s, the newest intact checkpoint, "
                    "instead (the damaged one is left in place)",
                    bad, why, path,
                )  # fmt: skip
            return ResumeChoice(path, tuple(skipped))
        skipped.append((path, problem))
    damaged = "; ".join(f"{bad.name} ({why})" for bad, why in skipped)
    raise ResumeError(f"--resume: no checkpoint under {out_dir} is intact, nothing to resume from: {damaged}")


def resumable_checkpoint(out_dir: Path) -> Path:
    """The path of `choose_resume_checkpoint`'s choice."""
    return choose_resume_checkpoint(out_dir).path


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


def prune_checkpoints(out_dir: Path, *, keep: int, spare: Collection[str] = ()) -> None:
    """Delete all but the newest ``keep`` ``checkpoint-*`` directories. Those named in ``spare`` (the
    damaged ones a ``--resume`` skipped) are neither deleted nor counted: a damaged newer checkpoint
    must not push out the intact ones."""
    ckpts = [(step, path) for step, path in list_checkpoints(out_dir) if path.name not in spare]
    for _, path in ckpts[: max(0, len(ckpts) - keep)]:
        shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------------------
# Save and resume of a run
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResumePoint:
    """Where a run starts: step 0 from the base model, or the step of a checkpoint."""

    step: int = 0
    path: str | None = None  # the checkpoint directory resumed from
    loss_scale: float | None = None  # fp16 runs: the checkpoint's dynamic loss scale
    skipped: tuple[str, ...] = ()  # newer checkpoints found damaged and passed over


# settings a resumed run may change: where and how it runs, what it logs and keeps; every other
# setting shapes what is trained (data, windows, batch, optimizer, model) and must be the checkpoint's
RESUME_MAY_CHANGE = frozenset({
    "train_file", "output", "eval_file", "max_eval_examples", "pp", "tp", "dp", "bucket_mb", "boundaries",
    "schedule", "micro_batch_size", "epochs", "max_steps", "eval_every", "eval_batch_size", "save_every",
    "keep_checkpoints", "resume", "elastic", "device", "precision", "threads_per_rank", "log_every",
    "fail_at_step",
})  # fmt: skip
RUN_FILES = ("final", "curve.csv", "curve.png", "eval_results.json")  # besides checkpoint-* and .tmp-*


def run_artifacts(out_dir: Path) -> list[Path]:
    """What a training run wrote into ``out_dir`` (its feature cache aside), sorted."""
    if not out_dir.is_dir():
        return []
    return sorted(
        p
        for p in out_dir.iterdir()
        if p.name in RUN_FILES or p.name.startswith(".tmp-") or _CKPT_RE.fullmatch(p.name) is not None
    )


def clear_run(out_dir: Path) -> None:
    """Remove a previous run's checkpoints, final model, curve and results (``--overwrite``)."""
    for path in run_artifacts(out_dir):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        logger.info("--overwrite: removed %s", path)


def _changed_settings(state: dict[str, Any], cfg: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """(checkpoint, now) of each setting that shapes the training and differs from the checkpoint's."""
    then = TrainConfig.from_dict(state["config"]).to_dict() if "config" in state else {}
    now = cfg.to_dict()
    return {
        k: (then.get(k), v)
        for k, v in now.items()
        if k not in RESUME_MAY_CHANGE and k in then and then[k] != v
    }


def resume_point(
    cfg: TrainConfig,
    *,
    total_steps: int,
    data_sha256: str,
    compute_dtype: str,
    choice: ResumeChoice | None = None,
) -> ResumePoint:
    """The newest intact ``checkpoint-*`` of ``cfg.output`` when ``cfg.resume`` (else step 0; ``choice``:
    `choose_resume_checkpoint`'s, when the caller made it already); a checkpoint
    written with another seed, length or data is a `ResumeError` naming the differences, and so is
    another (pp, tp) unless ``cfg.elastic``. The data-parallel degree may always change (the
    checkpoint does not depend on it)."""
    if not cfg.resume:
        return ResumePoint()
    choice = choice or choose_resume_checkpoint(Path(cfg.output))
    latest = choice.path
    state = read_state(latest)
    now = {
        "pp": cfg.pp,
        "tp": cfg.tp,
        "seed": cfg.seed,
        "total_steps": total_steps,
        "data_sha256": data_sha256,
    }
    mismatch = {k: (state.get(k), v) for k, v in now.items() if state.get(k) != v}
    mismatch.update(_changed_settings(state, cfg))
    if cfg.elastic:
        moved = {k: mismatch.pop(k) for k in ("pp", "tp") if k in mismatch}
        if moved:
            logger.info("elastic resume: re-sharding (checkpoint, now) %s", moved)
    if mismatch:
        hint = " (pass --elastic to re-shard to another pp/tp)" if {"pp", "tp"} & set(mismatch) else ""
        raise ResumeError(f"{latest}: cannot resume, (checkpoint, now) differ: {mismatch}{hint}")
    if state.get("dp", 1) != cfg.dp:
        logger.info("resuming a dp=%s checkpoint at dp=%d", state.get("dp", 1), cfg.dp)
    scale = None
    if state.get("compute_dtype") == "float16" and compute_dtype == "float16":
        scale = float(state["loss_scale"])
    logger.info("resuming from %s at step %d of %d", latest, int(state["step"]), total_steps)
    skipped = tuple(str(path) for path, _ in choice.skipped)
    return ResumePoint(step=int(state["step"]), path=str(latest), loss_scale=scale, skipped=skipped)


def trainer_state(cfg: TrainConfig, run: RunInfo, step: int, *, loss_scale: float) -> dict[str, Any]:
    """The ``trainer_state.json`` of a checkpoint at ``step`` (keys and order are the on-disk format)."""
    per_epoch = run.n_train // cfg.batch_size
    dp = {"dp": cfg.dp} if cfg.dp != 1 else {}  # added field: absent means 1
    return {
        "step": step,
        "total_steps": run.total_steps,
        "epoch": step // per_epoch,
        "batch_in_epoch": step % per_epoch,
        "examples_seen": step * cfg.batch_size,
        "seed": cfg.seed,
        "pp": cfg.pp,
        "tp": cfg.tp,
        **dp,
        "schedule": cfg.schedule,
        "compute_dtype": run.compute_dtype,
        "loss_scale": loss_scale,
        "lora_rank": cfg.lora_rank,
        "freeze_layers": cfg.freeze_layers,
        "data_sha256": run.data_sha256,
        "config": cfg.to_dict(),
    }


class CheckpointManager:
    """One rank's side of a run's checkpoints: restore on resume, write every ``save_every`` steps
    and at the end (rank 0 assembles and publishes; the others wait at barriers)."""

    def __init__(
        self,
        ctx: RankContext,
        stage: nn.Module,
        opt: torch.optim.Optimizer | None,
        *,
        cfg: TrainConfig,
        run: RunInfo,
        files: RunFiles,
    ) -> None:
        self.ctx, self.stage, self.opt, self.cfg, self.run = ctx, stage, opt, cfg, run
        self.files = files
        self.names = {p: n for n, p in stage.named_parameters()}
        self.world = ctx.plan.dims.world_size
        self.writes = ctx.dp_rank == 0  # replica 0 writes the (dp-free) checkpoint files
        # damaged checkpoints this (resumed) run skipped: pruning spares them until one is rewritten
        self.spare = {Path(p).name for p in run.skipped_checkpoints}

    def _needed(self, ckpt: Path, rank: int) -> list[str]:
        """The files of ``ckpt`` that ``rank`` reads in ``load`` (its own training state, or every
        rank's when re-sharding), relative to ``ckpt``."""
        state = read_state(ckpt)
        dims = self.ctx.plan.dims
        if (state.get("pp"), state.get("tp")) == (dims.pp, dims.tp):
            names = [f"training_state/rank{rank % dims.model_parallel_size}.safetensors"]
        else:
            names = sorted(
                p.relative_to(ckpt).as_posix() for p in (ckpt / "training_state").glob("rank*.safetensors")
            )
        return [STATE_FILE, *names]

    def load(self) -> None:
        """Restore this rank's trainable parameters and AdamW moments (a no-op for a fresh run):
        from its own file when the checkpoint has this (pp, tp), else re-sharded from all files."""
        if self.run.resume_from is None:
            return
        ckpt = Path(self.run.resume_from)
        ckpt = self.files.fetch(ckpt, lambda rank: self._needed(ckpt, rank))  # a copy on remote ranks
        state = read_state(ckpt)
        dims = self.ctx.plan.dims
        if (state.get("pp"), state.get("tp")) == (dims.pp, dims.tp):
            mp_rank = self.ctx.rank % dims.model_parallel_size  # the same shard in every replica
            load_rank_state(ckpt / "training_state" / f"rank{mp_rank}.safetensors", self.stage, self.opt)
        else:
            logger.info(
                "re-sharding %s from pp=%s tp=%s to pp=%d tp=%d",
                ckpt, state.get("pp"), state.get("tp"), dims.pp, dims.tp,
            )  # fmt: skip
            load_resharded(ckpt, self.stage, self.opt)

    def due(self, step: int) -> bool:
        """Whether a checkpoint is written once ``step`` optimizer steps are done."""
        every = self.cfg.save_every
        return bool(every and step % every == 0) or step == self.run.total_steps

    def save(self, step: int, *, loss_scale: float) -> None:
        """Write ``OUT/checkpoint-{step}`` (``OUT/final`` at the last step); collective over the gang."""
        final = step == self.run.total_steps
        out = Path(self.cfg.output)
        name = "final" if final else f"checkpoint-{step}"
        tmp = out / f".tmp-{name}"
        if self.ctx.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier()
        if self.writes:
            self._write_rank_files(self.files.writable(tmp))  # remote ranks: scratch, sent on below
        writers = [r for r in range(self.world) if self.ctx.plan.dims.dp_rank(r) == 0]
        self.files.collect(tmp, senders=writers)
        self._barrier()
        if self.ctx.rank == 0:
            self._assemble(tmp, step, loss_scale=loss_scale)
            publish(tmp, out / name)  # replaces a damaged checkpoint of the same step
            self.spare.discard(name)
            if not final:
                prune_checkpoints(out, keep=self.cfg.keep_checkpoints, spare=self.spare)
        self._barrier()

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def _write_rank_files(self, tmp: Path) -> None:
        """This rank's resume state (trainable tensors + AdamW moments) and its merged-LoRA weights."""
        rank, tp_rank = self.ctx.rank, self.ctx.tp_rank
        specs = shard_specs_of(self.stage)
        state = {n: p.detach() for n, p in self.stage.named_parameters() if p.requires_grad}
        if self.opt is not None:
            state.update(optimizer_tensors(self.opt, self.names))
        write_shard(tmp / "training_state" / f"rank{rank}.safetensors", state, specs, tp_rank=tp_rank)
        weights = merged_state_dict(self.stage)
        write_shard(tmp / "shards" / f"rank{rank}.safetensors", weights, specs, tp_rank=tp_rank)

    def _assemble(self, tmp: Path, step: int, *, loss_scale: float) -> None:
        """Rank 0: the HF directory from the merged shards, the overlay (PEFT runs), the trainer state."""
        full = merge_shards(sorted((tmp / "shards").glob("rank*.safetensors")))
        save_hf_checkpoint(
            full,
            self.ctx.spec.source.config,
            tmp,
            base_config=Path(self.run.base_model) / "config.json",
            tokenizer_dir=Path(self.run.tokenizer_dir),
        )
        shutil.rmtree(tmp / "shards")
        if self.cfg.peft:
            trained = merge_shards(sorted((tmp / "training_state").glob("rank*.safetensors")))
            save_file(overlay_tensors(trained, self.cfg), str(tmp / OVERLAY_FILE), metadata={"format": "pt"})
        state = trainer_state(self.cfg, self.run, step, loss_scale=loss_scale)
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2, default=str))
