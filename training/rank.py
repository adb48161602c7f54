"""The training rank program: what every rank of a training gang runs (``train_rank``), and the
same program as ranks on other hosts run it under the name ``train`` (``TRAIN_PROGRAM``).

The driver (``training/driver.py``) starts a gang of ``dp`` copies of the ``pp x tp`` pipeline
(Megatron layout, ``rank = dp_rank * pp * tp + stage * tp + tp_rank``) whose ranks run
``train_rank``. Every rank builds its stage with ``build_stage`` (each loads only its shard),
optionally adds LoRA / freezes layers (``partitioner/lora.py``), restores its state on
``--resume`` (``training/checkpoint.py``; re-sharded from another (pp, tp) with ``--elastic``),
and then per optimizer step:

1. reads the step's global batch from the seeded permutation of the features (identical on every
   rank; stage 0 takes inputs, the last stage labels), split into ``n_micro`` micro-batches, of
   which data-parallel replica ``d`` runs the contiguous ``n_micro / dp`` starting at
   ``d * n_micro / dp`` (the same micro-batches a single process would run, whatever ``dp``);
2. runs GPipe or 1F1B (``partitioner/schedules.py``) with the loss of ``training/objective.py``,
   scaled by 1/n_micro (of the GLOBAL batch) so the accumulated gradient, summed over the
   replicas, is the global-batch mean; with ``dp > 1`` a ``GradReducer``
   (``partitioner/data_parallel.py``) sums the gradients over each shard's data-parallel group in
   buckets launched during the last micro-batch's backward;
3. clips by the global gradient norm over one replica (sharded tensors summed over the tp ranks,
   replicated ones counted once, one all-reduce over the replica's pp x tp ranks; the dp replicas
   hold identical reduced gradients, so they are not counted again);
4. AdamW step (no decay on biases and LayerNorms) at a linearly warmed-up / decayed LR, on every
   rank alike (AdamW state is replicated across dp, not ZeRO-sharded).

Dropout is reseeded from (seed, step, stage, dp rank) at every step, identically on the tp ranks of
a stage (their replicated activations must see the same masks), so a run is reproducible and a
resumed run continues exactly. Parity with single-process training holds at dropout 0 (different
layouts draw dropout masks differently). Precision: fp32, or bf16/fp16 autocast over fp32 master
weights and fp32 AdamW state (``partitioner/precision.py``; fp16 with dynamic loss scaling).

Ranks report ``training/messages.py``'s ``StepReport`` / ``EvalLogits`` / ``CheckpointSaved`` to the
driver. Ranks on other hosts (``shardserve worker``, allowed ``TRAIN_PROGRAM``) read the spec's
``TrainConfig`` and ``RunInfo`` as JSON, get the feature file and resume state from rank 0 and send
it their checkpoint parts (``training/run_files.py``)::

    body = TRAIN_PROGRAM.to_json({"train": cfg, "run": run})       # on the driver
    extra, source = TRAIN_PROGRAM.from_json(body, resolve_model(cfg.model))   # on the worker
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardserve.models.registry import ModelSource
from shardserve.partitioner.data_parallel import GradReducer
from shardserve.partitioner.lora import apply_lora, freeze_for_peft
from shardserve.partitioner.p2p import P2PCommunicator
from shardserve.partitioner.plan import PartitionPlan
from shardserve.partitioner.precision import DTYPES, DynamicLossScale, autocast_for
from shardserve.partitioner.runtime.rank import RankContext
from shardserve.partitioner.runtime.remote import RemoteProgram
from shardserve.partitioner.schedules import MicroBatch, run_gpipe, run_schedule
from shardserve.partitioner.shard_loading import shard_specs_of
from shardserve.partitioner.stages import build_stage
from shardserve.training.checkpoint import CheckpointManager
from shardserve.training.config import RunInfo, TrainConfig
from shardserve.training.features import EVAL_INPUTS, read_features
from shardserve.training.messages import CheckpointSaved, EvalLogits, StepReport
from shardserve.training.objective import MASK_FILL, lr_at, param_groups, span_loss
from shardserve.training.run_files import RunFiles


def batch_indices(
    step: int,
    *,
    n_train: int,
    batch_size: int,
    seed: int,
    lengths: torch.Tensor | None = None,
    group: int = 16,
) -> torch.Tensor:
    """(batch_size,) feature indices of optimizer step ``step``: a seeded permutation per epoch
    (the incomplete last batch of an epoch is dropped).

    With ``lengths`` ((n_train,) real token counts), batches are grouped by length: the permutation
    is cut into chunks of ``group`` batches, each chunk sorted by length and split into batches,
    and the batch order shuffled again, so a batch holds windows of similar length (less padding
    after trimming) while the order stays a pure function of (seed, epoch).
    """
    per_epoch = n_train // batch_size
    epoch, pos = divmod(step, per_epoch)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n_train, generator=gen)[: per_epoch * batch_size]
    if lengths is not None:
        chunk = batch_size * group
        parts = []
        for start in range(0, len(perm), chunk):
            part = perm[start : start + chunk]
            order = torch.sort(lengths[part], descending=True, stable=True).indices
            parts.append(part[order])
        batches = torch.cat(parts).view(per_epoch, batch_size)  # (per_epoch, B)
        perm = batches[torch.randperm(per_epoch, generator=gen)].reshape(-1)
    return perm[pos * batch_size : (pos + 1) * batch_size]


def step_seed(seed: int, step: int, stage: int, dp_rank: int = 0) -> int:
    """Dropout seed of one (step, stage, replica); equal on the tp ranks of a stage."""
    return (seed * 1_000_003 + step * 1009 + stage * 7919 + dp_rank * 104_729 + 17) % (2**63 - 1)


def trim(*tensors: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Cut (B, S) tensors to the micro-batch's longest real sequence."""
    length = int(mask.sum(dim=1).max())
    return [t[:, :length] for t in tensors]


def apply_peft(stage: nn.Module, cfg: TrainConfig) -> None:
    """LoRA factors and/or frozen layers, as the config asks (full fine-tuning otherwise).

    Tensors the loss cannot see are always frozen (``NULL_SPACE``): every encoder attention key bias adds
    ``q . b_k``, the same for every key, to a softmax over keys; the QA head bias and the last
    layer's output LayerNorm bias add one constant to every start (end) logit, which the softmax
    over positions ignores. Their true gradient is exactly zero; AdamW would only turn round-off
    into lr-sized random steps (different for every summation order, i.e. every layout). (A rotary
    model's key bias is rotated by each key's position, so the loss does see it: it trains.)
    """
    if cfg.lora_rank > 0:
        apply_lora(stage, rank=cfg.lora_rank, alpha=cfg.lora_alpha, seed=cfg.seed)
    freeze_for_peft(
        stage,
        freeze_layers=cfg.freeze_layers,
        freeze_embeddings=cfg.freeze_embeddings,
        lora=cfg.lora_rank > 0,
    )
    # the last layer's output LayerNorm bias: not when that layer is every layer (ALBERT)
    last = "" if stage.config.shares_layers else f"layers.{stage.config.num_layers - 1}.mlp_norm.bias"
    for name, p in stage.named_parameters():
        if name.endswith("attention.key.bias") or name in ("qa_outputs.bias", last):
            p.requires_grad_(False)


def with_dropout(source: ModelSource, dropout: float | None) -> ModelSource:
    """``source`` with its hidden and attention dropout set to ``dropout`` (None: unchanged)."""
    if dropout is None:
        return source
    config = dataclasses.replace(source.config, hidden_dropout=dropout, attention_dropout=dropout)
    return dataclasses.replace(source, config=config)


def stage_trains(plan: PartitionPlan, cfg: TrainConfig, stage: int) -> bool:
    """Whether stage ``stage`` holds any trainable parameter (same answer on every rank)."""
    spec = plan.stages[stage]
    if spec.has_head:
        return True
    if cfg.freeze_layers == 0:
        return True  # full fine-tuning, or LoRA on every layer
    return any(i >= cfg.freeze_layers for i in spec.layers)


LABELS: dict[str, tuple[str, str]] = {  # answer_occurrences -> (start, end) label tensors
    "first": ("start_positions", "end_positions"),
    "all": ("start_candidates", "end_candidates"),
}


def shared_layer_params(stage: nn.Module) -> list[nn.Parameter]:
    """The parameters every stage holds a copy of (ALBERT's one layer, DeBERTa's relative-position
    table), in a fixed order; none for other models."""
    part = stage.stage_copies()
    return [] if part is None else list(part.parameters())


def _sync_shared_grads(stage: nn.Module, ctx: RankContext) -> None:
    """Sum the shared parameters' gradients over the stages (each copy saw only its stage's layers),
    so every copy takes the same step as the one of the unpartitioned model."""
    params = [p for p in shared_layer_params(stage) if p.requires_grad]
    if ctx.shared_group is None or not params:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
    dist.all_reduce(flat, group=ctx.shared_group)
    at = 0
    for p in params:
        p.grad = flat[at : at + p.numel()].view_as(p).clone()
        at += p.numel()


def _global_grad_norm(stage: nn.Module, ctx: RankContext) -> torch.Tensor:
    """sqrt(sum of squared grads over the model): sharded tensors counted on every tp rank,
    replicated ones on tp rank 0 only, parameters every stage holds a copy of on stage 0 only,
    summed over this replica's pp x tp ranks with one all-reduce (after the data-parallel
    reduction every replica holds the same gradients)."""
    specs = shard_specs_of(stage)
    shared = {id(p) for p in shared_layer_params(stage)} if ctx.stage > 0 else set()
    total = torch.zeros((), dtype=torch.float64)
    for name, p in stage.named_parameters():
        if p.grad is None or id(p) in shared:
            continue
        if name in specs or ctx.tp_rank == 0:
            total += p.grad.detach().double().pow(2).sum().cpu()
    if ctx.plan.dims.model_parallel_size > 1:
        dist.all_reduce(total, group=ctx.mp_group)  # mp_group None: the world is one replica
    return total.sqrt()


def _build_trainable_stage(
    ctx: RankContext, cfg: TrainConfig
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """This rank's stage (its shard only), PEFT applied, in train mode, and its AdamW (None: frozen)."""
    torch.manual_seed(cfg.seed)
    stage = build_stage(
        ctx.spec.source, ctx.plan, rank=ctx.rank, tp_group=ctx.tp_group, head_seed=ctx.spec.head_seed
    )
    apply_peft(stage, cfg)
    stage.train()
    if not any(p.requires_grad for p in stage.parameters()):
        return stage, None
    groups = param_groups(stage, cfg.weight_decay)
    return stage, torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.adam_betas, eps=cfg.adam_eps)


class TrainingDiverged(RuntimeError):
    """The loss or gradients became NaN / infinite (without fp16's loss scaling to skip the step)."""


def _clip_and_step(
    stage: nn.Module,
    opt: torch.optim.Optimizer | None,
    ctx: RankContext,
    cfg: TrainConfig,
    *,
    lr: float,
    scaler: DynamicLossScale | None,
) -> float:
    """Unscale (fp16), clip by the global gradient norm, AdamW step at ``lr``; returns the norm.

    A non-finite fp16 norm skips the step on every rank alike (the norm is all-reduced)."""
    _sync_shared_grads(stage, ctx)
    trainable = [p for p in stage.parameters() if p.requires_grad and p.grad is not None]
    if scaler is not None:
        for p in trainable:
            p.grad.div_(scaler.scale)
    norm = float(_global_grad_norm(stage, ctx))
    if scaler is None and not math.isfinite(norm):  # every rank alike (the norm is all-reduced)
        raise TrainingDiverged(
            f"the gradients are not finite (norm {norm}): the run diverged; lower --lr, keep "
            f"--max-grad-norm > 0 (now {cfg.max_grad_norm:g}), or resume from an earlier checkpoint"
        )
    apply = scaler.update(norm) if scaler is not None else True  # same on every rank
    if cfg.max_grad_norm > 0 and apply:
        coef = cfg.max_grad_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in trainable:
                p.grad.mul_(coef)
    if opt is not None and apply:
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
    return norm


def train_rank(ctx: RankContext, *, ready: Callable[[dict], None]) -> None:
    """One rank of a training gang (``GangSpec.program``, run to completion): build, restore, then
    the step loop; reports ``StepReport`` / ``EvalLogits`` / ``CheckpointSaved`` to the driver."""
    cfg: TrainConfig = ctx.spec.extra["train"]
    stage, opt = _build_trainable_stage(ctx, cfg)
    reducer = (
        GradReducer(list(stage.parameters()), group=ctx.dp_group, bucket_bytes=int(cfg.bucket_mb * 2**20))
        if ctx.plan.dims.dp > 1 and opt is not None
        else None
    )
    # ranks on other hosts: the run's files come and go through rank 0
    files = RunFiles(ctx, ctx.spec.extra["run"])
    try:
        _train_steps(ctx, stage, opt, reducer, files, ready=ready)
    finally:
        files.close()


def _train_steps(
    ctx: RankContext,
    stage: nn.Module,
    opt: torch.optim.Optimizer | None,
    reducer: GradReducer | None,
    files: RunFiles,
    *,
    ready: Callable[[dict], None],
) -> None:
    """``train_rank`` once its stage is built: restore, read the data, then the step loop."""
    cfg: TrainConfig = ctx.spec.extra["train"]
    run: RunInfo = ctx.spec.extra["run"]
    report = ctx.link.send  # StepReport / EvalLogits / CheckpointSaved to the driver
    plan = ctx.plan
    pp, world = plan.dims.pp, plan.dims.world_size
    dp, n_local = plan.dims.dp, cfg.n_micro_per_replica
    features = Path(run.features)
    features = files.fetch(features.parent, lambda rank: [features.name]) / features.name
    checkpoints = CheckpointManager(ctx, stage, opt, cfg=cfg, run=run, files=files)
    checkpoints.load()
    labels = LABELS[cfg.answer_occurrences]
    want = ("attention_mask",) + (("input_ids", "token_type_ids") if ctx.is_first else ())
    data = read_features(str(features), "train", want + (labels if ctx.is_last else ()))
    lengths = data["attention_mask"].sum(dim=1) if cfg.group_by_length else None  # (n_train,)
    evaluates = run.n_eval > 0 and ctx.dp_rank == 0  # replica 0 evaluates, the others go on
    eval_data = read_features(str(features), "eval", EVAL_INPUTS) if ctx.is_first and evaluates else None
    comm = P2PCommunicator(device=ctx.device, backend=ctx.backend) if pp > 1 else None
    autocast = autocast_for(ctx.device, DTYPES[run.compute_dtype])
    # fp16 needs loss scaling (its range underflows small gradients); fp32/bf16 train unscaled.
    scaler = DynamicLossScale(scale=run.loss_scale) if run.compute_dtype == "float16" else None
    backward_needed = any(stage_trains(plan, cfg, s) for s in range(ctx.stage + 1))
    send_input_grad = not ctx.is_first and any(stage_trains(plan, cfg, s) for s in range(ctx.stage))
    ready(
        {
            "trainable": sum(p.numel() for p in stage.parameters() if p.requires_grad),
            "params": sum(p.numel() for p in stage.parameters()),
        }
    )

    dev = ctx.device
    micro = cfg.micro_batch_size
    for step in range(run.start_step, run.total_steps):
        if cfg.fail_at_step is not None and step == cfg.fail_at_step and ctx.rank == world - 1:
            os._exit(3)  # deliberate hard crash (tests of --resume)
        torch.manual_seed(step_seed(cfg.seed, step, ctx.stage, ctx.dp_rank))
        idx = batch_indices(
            step, n_train=run.n_train, batch_size=cfg.batch_size, seed=cfg.seed, lengths=lengths
        )  # (B,)
        lr = lr_at(step, lr=cfg.lr, total_steps=run.total_steps, warmup_steps=run.warmup_steps)

        share = n_local * micro  # this replica's micro-batches of the global batch, in order
        local = idx[ctx.dp_rank * share : (ctx.dp_rank + 1) * share]  # (B / dp,)

        def get_inputs(mb: int, idx: torch.Tensor = local) -> MicroBatch:
            rows = idx[mb * micro : (mb + 1) * micro]
            mask = data["attention_mask"][rows]  # (b, S)
            ids, types, mask = trim(data["input_ids"][rows], data["token_type_ids"][rows], mask, mask=mask)
            return MicroBatch(mb, ids.long().to(dev), mask.long().to(dev), types.long().to(dev))

        def compute_loss(
            mb: int, logits: torch.Tensor, mask: torch.Tensor, idx: torch.Tensor = local
        ) -> torch.Tensor:
            rows = idx[mb * micro : (mb + 1) * micro]
            starts = data[labels[0]][rows].long().to(dev)  # (b,) or (b, K)
            ends = data[labels[1]][rows].long().to(dev)
            scale = scaler.scale if scaler is not None else 1.0
            return span_loss(logits, mask, starts, ends) * (scale / cfg.n_micro)

        ex = ctx.stage_executor(
            stage,
            comm,
            get_inputs=get_inputs,
            compute_loss=compute_loss,
            backward_needed=backward_needed,
            send_input_grad=send_input_grad,
            autocast=autocast,
        )
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        if reducer is not None:
            reducer.start(n_backward=n_local)
        run_schedule(ex, cfg.schedule, n_local, num_stages=pp, stage=ctx.stage)
        reduced = reducer.finish() if reducer is not None else None  # .grad: sum over the replicas
        loss_scale = scaler.scale if scaler is not None else 1.0  # the scale this step's loss carried
        norm = _clip_and_step(stage, opt, ctx, cfg, lr=lr, scaler=scaler)
        done = step + 1
        ctx.link.progress = done
        loss = sum(ex.losses) / loss_scale
        if ctx.is_last and dp > 1:  # the dp group of a last-stage shard: every replica's last stage
            total = torch.tensor(loss, dtype=torch.float64)
            dist.all_reduce(total, group=ctx.dp_group)
            loss = float(total)
        if ctx.is_last and ctx.tp_rank == 0 and ctx.dp_rank == 0:
            allreduce = dataclasses.asdict(reduced) if reduced is not None else None
            report(StepReport(ctx.rank, done, loss, lr, norm, len(idx), allreduce))
        final = done == run.total_steps
        if checkpoints.due(done):  # before evaluating: a failing evaluation loses no training
            checkpoints.save(done, loss_scale=scaler.scale if scaler is not None else 1.0)
            if ctx.rank == 0:
                report(CheckpointSaved(ctx.rank, done, final))
        if evaluates and ((cfg.eval_every and done % cfg.eval_every == 0) or final):
            _evaluate_in_gang(ctx, stage, comm, eval_data, run, cfg, done, autocast)
    if comm is not None:
        comm.flush()


def _evaluate_in_gang(
    ctx: RankContext,
    stage: nn.Module,
    comm: P2PCommunicator | None,
    eval_data: dict[str, torch.Tensor] | None,
    run: RunInfo,
    cfg: TrainConfig,
    step: int,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> None:
    """Forward the evaluation windows through the pipeline (the training schedule, forward only);
    the last stage sends (N, S, 2) logits."""
    stage.eval()
    bs = cfg.eval_batch_size
    n_micro = -(-run.n_eval // bs)
    full_len = cfg.window.max_seq_len
    chunks: list[torch.Tensor] = []

    def get_inputs(mb: int) -> MicroBatch:
        assert eval_data is not None
        sl = slice(mb * bs, (mb + 1) * bs)
        mask = eval_data["attention_mask"][sl]
        ids, types, mask = trim(eval_data["input_ids"][sl], eval_data["token_type_ids"][sl], mask, mask=mask)
        dev = ctx.device
        return MicroBatch(mb, ids.long().to(dev), mask.long().to(dev), types.long().to(dev))

    def on_logits(mb: int, logits: torch.Tensor) -> None:
        out = torch.full((logits.shape[0], full_len, 2), MASK_FILL)  # (b, S_full, 2)
        out[:, : logits.shape[1]] = logits.cpu()
        chunks.append(out)

    ex = ctx.stage_executor(
        stage, comm, get_inputs=get_inputs, on_logits=on_logits, forward_only=True, autocast=autocast
    )
    run_gpipe(ex, n_micro)  # forward_only: the n_micro forwards, no backward
    if ctx.is_last and ctx.tp_rank == 0:
        ctx.link.send(EvalLogits(ctx.rank, step, torch.cat(chunks).numpy()))
    stage.train()


def to_json(extra: dict[str, Any]) -> dict[str, Any]:
    """``{"train": TrainConfig, "run": RunInfo}`` as JSON-ready dicts."""
    cfg: TrainConfig = extra["train"]
    run: RunInfo = extra["run"]
    return {"train": cfg.to_dict(), "run": dataclasses.asdict(run)}


def from_json(body: dict[str, Any], source: ModelSource) -> tuple[dict[str, Any], ModelSource]:
    """The inverse of ``to_json``, and ``source`` with the run's dropout."""
    cfg = TrainConfig.from_dict(body["train"])
    run_fields = dict(body["run"])
    run_fields["remote_ranks"] = tuple(run_fields.get("remote_ranks", ()))
    run_fields["skipped_checkpoints"] = tuple(run_fields.get("skipped_checkpoints", ()))
    run = RunInfo(**run_fields)
    return {"train": cfg, "run": run}, with_dropout(source, cfg.dropout)


TRAIN_PROGRAM = RemoteProgram("train", train_rank, to_json=to_json, from_json=from_json)
