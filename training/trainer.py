"""The trainer: fine-tune a QA model over the SAME partitions and gang runtime that serve it.

``train(TrainConfig(...))`` (the driver, ``shardserve train``; settings in ``training/config.py``)
tokenizes the SQuAD data once into a feature file (``training/features.py``), builds the serving
``PartitionPlan`` and starts a gang whose ranks run ``train_rank``: ``dp`` copies of the
``pp x tp`` pipeline (Megatron layout, ``rank = dp_rank * pp * tp + stage * tp + tp_rank``).
Every rank builds its stage with ``build_stage`` (each loads only its shard), optionally adds
LoRA / freezes layers (``partitioner/lora.py``), restores its state on ``--resume`` (re-sharded
from another (pp, tp) with ``--elastic``), and then per optimizer step:

1. reads the step's global batch from the seeded permutation of the features (identical on every
   rank; stage 0 takes inputs, the last stage labels), split into ``n_micro`` micro-batches, of
   which data-parallel replica ``d`` runs the contiguous ``n_micro / dp`` starting at
   ``d * n_micro / dp`` (the same micro-batches a single process would run, whatever ``dp``);
2. runs GPipe or 1F1B (``partitioner/schedules.py``); loss = (CE(start) + CE(end)) / 2 per
   micro-batch, scaled by 1/n_micro (of the GLOBAL batch) so the accumulated gradient, summed over
   the replicas, is the global-batch mean; with ``dp > 1`` a ``GradReducer``
   (``partitioner/data_parallel.py``) sums the gradients over each shard's data-parallel group in
   buckets launched during the last micro-batch's backward;
3. clips by the global gradient norm over one replica (sharded tensors summed over the tp ranks,
   replicated ones counted once, one all-reduce over the replica's pp x tp ranks; the dp replicas
   hold identical reduced gradients, so they are not counted again);
4. AdamW step (no decay on biases and LayerNorms) at a linearly warmed-up / decayed LR, on every
   rank alike (AdamW state is replicated across dp, not ZeRO-sharded).

Dropout is reseeded from (seed, step, stage, dp rank) at every step, identically on the tp ranks of
a stage (their replicated activations must see the same masks), so a run is reproducible and a
resumed run continues exactly. Parity with single-process training holds at dropout 0 (different layouts draw
dropout masks differently). Precision (``--precision``): fp32, or bf16/fp16 autocast over fp32 master weights and fp32
AdamW state (``partitioner/precision.py``; fp16 with dynamic loss scaling); ``auto`` picks bf16
where the device has bf16 units.

Checkpoints are ``training/checkpoint.py``'s: its ``CheckpointManager`` restores a rank and writes
its part every ``save_every`` steps and at the end (``OUT/final``). Ranks may run on other hosts
(``train(..., network=GangNetwork(external_ranks=...))``, joined by ``shardserve worker``; the
spec they read is ``training/remote_program.py``'s): they get the feature file and resume state
from rank 0 and send it their checkpoint parts (``training/run_files.py``). The driver shows a
tqdm bar (step, loss, examples/s) and logs periodic evaluation (``training/evaluate.py`` metrics on logits computed by the gang itself).

    shardserve train --model tiny-bert --train-file data.json --pp 2 --tp 1 --output /tmp/run
    shardserve train --model tiny-bert --train-file data.json --dp 2 --pp 2 --output /tmp/run
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from models.registry import ModelSource, resolve_model
from partitioner.data_parallel import GradReducer
from partitioner.lora import LORA_TARGETS, apply_lora, freeze_for_peft
from partitioner.p2p import P2PCommunicator
from partitioner.plan import ParallelDims, PartitionPlan, default_devices, make_plan
from partitioner.precision import DTYPES, DynamicLossScale, autocast_for, resolve_dtype
from partitioner.runtime.gang import Gang
from partitioner.runtime.messages import CheckpointSaved, ControlMessage, EvalLogits, StepReport
from partitioner.runtime.rank import GangMode, GangSpec, RankContext
from partitioner.runtime.remote import GangNetwork
from partitioner.schedules import MicroBatch, run_gpipe, run_schedule
from partitioner.shard_loading import shard_specs_of
from partitioner.stages import build_stage
from training import checkpoint as ckpt
from training.config import RunInfo, TrainConfig, TrainConfigError
from training.curve import Curve
from training.features import EVAL_INPUTS, prepare_data, read_features
from training.run_files import RunFiles

logger = logging.getLogger(__name__)

MASK_FILL = -1e9  # logit given to padding positions before the span cross-entropy


@dataclass
class TrainResult:
    """What a finished run produced."""

    output: Path
    final_checkpoint: Path
    steps: int
    losses: dict[int, float] = field(default_factory=dict)  # step -> loss
    grad_norms: dict[int, float] = field(default_factory=dict)  # step -> global norm before clipping
    reduce_stats: dict[int, dict[str, int]] = field(default_factory=dict)  # dp > 1: step -> all-reduce
    evals: dict[int, dict[str, float]] = field(default_factory=dict)  # step -> SQuAD metrics
    examples_per_s: float = 0.0  # over the steps this run did (from its second step, when it did 2+)
    train_seconds: float = 0.0
    start_step: int = 0  # a resumed run's checkpoint step: this run did steps start_step+1 .. steps

    @property
    def steps_run(self) -> int:
        """Optimizer steps this run did (fewer than ``steps`` when it resumed)."""
        return self.steps - self.start_step


# ------------------------------------------------------------------------------------------------
# Pieces shared by the ranks and the single-process reference (tests)
# ------------------------------------------------------------------------------------------------


def _span_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (B, S) logits against (B,) positions, or the marginal
    ``-log sum_k p(target_k)`` against (B, K) candidate positions padded with -1."""
    if targets.dim() == 1:
        return F.cross_entropy(logits, targets)
    logp = logits.log_softmax(dim=-1)  # (B, S)
    picked = logp.gather(1, targets.clamp(min=0)).masked_fill(targets.lt(0), -math.inf)  # (B, K)
    return -picked.logsumexp(dim=-1).mean()


def span_loss(
    logits: torch.Tensor, attention_mask: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor
) -> torch.Tensor:
    """(CE(start) + CE(end)) / 2, mean over the micro-batch; padding positions are masked out.

    logits: (B, S, 2) float; attention_mask: (B, S); starts/ends: (B,) token positions (0 = CLS),
    or (B, K) candidate positions (-1 padded): every occurrence of the answer text in the window,
    scored by the probability the model gives to any of them (Clark & Gardner, 2018).
    """
    pad = attention_mask.eq(0)  # (B, S)
    start_logits = logits[..., 0].masked_fill(pad, MASK_FILL)  # (B, S)
    end_logits = logits[..., 1].masked_fill(pad, MASK_FILL)
    return (_span_ce(start_logits, starts) + _span_ce(end_logits, ends)) / 2


def lr_at(step: int, *, lr: float, total_steps: int, warmup_steps: int) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then linear decay to 0 at ``total_steps``."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    return lr * max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def is_no_decay(name: str) -> bool:
    """Biases and LayerNorm parameters get no weight decay."""
    owner = name.rsplit(".", 2)[-2] if name.count(".") else name
    return name.endswith(".bias") or "norm" in owner.lower()


def param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups over the trainable parameters: decayed weights, undecayed biases/LayerNorms."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if p.requires_grad:
            (no_decay if is_no_decay(name) else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


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

    Tensors the loss cannot see are always frozen (``NULL_SPACE``): every attention key bias adds
    ``q . b_k``, the same for every key, to a softmax over keys; the QA head bias and the last
    layer's output LayerNorm bias add one constant to every start (end) logit, which the softmax
    over positions ignores. Their true gradient is exactly zero; AdamW would only turn round-off
    into lr-sized random steps (different for every summation order, i.e. every layout).
    """
    if cfg.lora_rank > 0:
        apply_lora(stage, rank=cfg.lora_rank, alpha=cfg.lora_alpha, targets=LORA_TARGETS, seed=cfg.seed)
    freeze_for_peft(
        stage,
        freeze_layers=cfg.freeze_layers,
        freeze_embeddings=cfg.freeze_embeddings,
        lora=cfg.lora_rank > 0,
    )
    last = f"layers.{stage.config.num_layers - 1}.mlp_norm.bias"
    for name, p in stage.named_parameters():
        if name.endswith("attention.key.bias") or name in ("qa_outputs.bias", last):
            p.requires_grad_(False)


def with_dropout(source: ModelSource, dropout: float | None) -> ModelSource:
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


# ------------------------------------------------------------------------------------------------
# The rank program
# ------------------------------------------------------------------------------------------------

LABELS: dict[str, tuple[str, str]] = {  # answer_occurrences -> (start, end) label tensors
    "first": ("start_positions", "end_positions"),
    "all": ("start_candidates", "end_candidates"),
}


def _global_grad_norm(stage: nn.Module, ctx: RankContext) -> torch.Tensor:
    """sqrt(sum of squared grads over the model): sharded tensors counted on every tp rank,
    replicated ones on tp rank 0 only, summed over this replica's pp x tp ranks with one
    all-reduce (after the data-parallel reduction every replica holds the same gradients)."""
    specs = shard_specs_of(stage)
    total = torch.zeros((), dtype=torch.float64)
    for name, p in stage.named_parameters():
        if p.grad is None:
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
    """One rank of a training gang (``GangSpec.program``, ``GangMode.RUN``): build, restore, then
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
    checkpoints = ckpt.CheckpointManager(ctx, stage, opt, cfg=cfg, run=run, files=files)
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


# ------------------------------------------------------------------------------------------------
# The driver
# ------------------------------------------------------------------------------------------------


def score_eval(eval_features: Any, logits: Any) -> dict[str, float]:
    """SQuAD EM/F1 of (N, S, 2) logits over the evaluation windows."""
    from training.squad_data import postprocess_eval_predictions, prediction_texts
    from training.squad_metrics import evaluate

    logits = torch.as_tensor(logits)
    preds = postprocess_eval_predictions(eval_features, logits[..., 0], logits[..., 1])
    return evaluate(eval_features.examples, prediction_texts(preds))


def train(
    cfg: TrainConfig,
    *,
    show_progress: bool = True,
    network: GangNetwork | None = None,
    overwrite: bool = False,
) -> TrainResult:
    """Run (or resume) a training run; returns the final checkpoint and the logged numbers.

    ``cfg.output`` holding another run's files (``checkpoint.run_artifacts``) is a `TrainConfigError`
    unless the run resumes it, or ``overwrite`` (they are removed once the settings and data are valid).

    ``network``: where the gang's store and channel listen and which ranks run on other hosts
    (``shardserve worker`` there, running ``training/remote_program.py``'s program; flags:
    ``partitioner/runtime/gang_flags.py``); default: every rank on this one.
    Rank 0 writes the run directory, so it is never external."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    network = network or GangNetwork()
    if network.external_ranks and network.program.program is not train_rank:
        raise TrainConfigError(
            f"ranks {list(network.external_ranks)} run elsewhere, so the network must say they run the "
            f"training program, not {network.program.name!r}: GangNetwork(program=training.remote_program.REMOTE_PROGRAM)"
        )
    source = with_dropout(resolve_model(cfg.model), cfg.dropout)
    if cfg.window.max_seq_len > source.config.max_seq_len:
        raise TrainConfigError(
            f"max_seq_len={cfg.window.max_seq_len} exceeds the model's {source.config.max_seq_len} positions"
        )
    dims = ParallelDims(pp=cfg.pp, tp=cfg.tp, dp=cfg.dp)
    external = sorted(network.external_ranks)
    if external and (external[0] <= 0 or external[-1] >= dims.world_size):
        raise TrainConfigError(
            f"external ranks {external}: a training gang's external ranks are 1..{dims.world_size - 1} "
            f"(rank 0 runs here and writes the run directory; dp={cfg.dp} x pp={cfg.pp} x tp={cfg.tp})"
        )
    plan = make_plan(
        source.config,
        dims,
        boundaries=list(cfg.boundaries) if cfg.boundaries else None,
        seq_len=cfg.window.max_seq_len,
        devices=default_devices(dims.world_size, device=cfg.device),
    )
    if cfg.freeze_layers > source.config.num_layers:
        raise TrainConfigError(f"freeze_layers={cfg.freeze_layers} > num_layers={source.config.num_layers}")
    precision = resolve_dtype(cfg.precision, plan.devices[0])  # PrecisionError names the device
    mode = "no autocast" if precision.name == "float32" else "autocast, fp32 master weights"
    logger.info("precision: %s %s (%s)", precision.name, mode, precision.reason)
    out = Path(cfg.output)
    choice = None
    if cfg.resume:  # nothing (intact) to resume from: say so before tokenizing the data
        choice = ckpt.choose_resume_checkpoint(out)
    elif not overwrite and (found := ckpt.run_artifacts(out)):
        names = ", ".join(p.name for p in found)
        raise TrainConfigError(
            f"--output {cfg.output} already holds a run ({names}); pass --resume to continue it, "
            "--overwrite to start again from scratch (its files are removed), or another --output"
        )
    data = prepare_data(cfg, source, show_progress=show_progress)  # creates OUTPUT once the data is valid
    per_epoch = data.n_train // cfg.batch_size
    if per_epoch < 1:
        raise TrainConfigError(f"batch_size={cfg.batch_size} exceeds the {data.n_train} training features")
    total = cfg.max_steps if cfg.max_steps is not None else max(1, math.floor(cfg.epochs * per_epoch))
    warmup = math.floor(cfg.warmup_ratio * total)
    start = ckpt.resume_point(
        cfg, total_steps=total, data_sha256=data.data_sha256, compute_dtype=precision.name, choice=choice
    )
    start_step = start.step
    if overwrite and not cfg.resume:
        ckpt.clear_run(out)
    if start_step >= total:  # --resume of a finished run: its final is the result
        logger.info("nothing to train: %s is at step %d of %d", start.path, start_step, total)
        return TrainResult(output=out, final_checkpoint=out / "final", steps=total, start_step=start_step)
    loss_scale = start.loss_scale if start.loss_scale is not None else DynamicLossScale().scale
    run = RunInfo(
        features=str(data.path),
        n_train=data.n_train,
        n_eval=data.n_eval,
        total_steps=total,
        warmup_steps=warmup,
        start_step=start_step,
        resume_from=start.path,
        data_sha256=data.data_sha256,
        base_model=str(source.checkpoint),
        tokenizer_dir=str(source.tokenizer_dir),
        compute_dtype=precision.name,
        loss_scale=loss_scale,
        remote_ranks=tuple(external),
        skipped_checkpoints=start.skipped,
    )
    threads = cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // dims.world_size)
    spec = GangSpec(
        source,
        plan,
        threads_per_rank=threads,
        collective_timeout_s=600.0,  # ranks wait at barriers while rank 0 merges a checkpoint
        program=train_rank,
        mode=GangMode.RUN,
        extra={"train": cfg, "run": run},
    )
    result = TrainResult(output=out, final_checkpoint=out / "final", steps=total, start_step=start_step)
    logger.info(
        "training %s: dp=%d pp=%d tp=%d %s, %d features, %d steps (batch %d = %d x %d), warm-up %d, lr %g",
        source.name, cfg.dp, cfg.pp, cfg.tp, cfg.schedule, data.n_train, total, cfg.batch_size,
        cfg.n_micro, cfg.micro_batch_size, warmup, cfg.lr,
    )  # fmt: skip
    bar = tqdm(
        total=total,
        initial=start_step,
        desc="train",
        unit="step",
        disable=not show_progress,
        dynamic_ncols=True,
    )
    t_ready: list[float] = []  # when every rank was built and restored (gang.start returned)
    t_start: list[float] = []
    seen = [0]

    def on_message(msg: ControlMessage) -> None:
        if isinstance(msg, StepReport):
            now = time.perf_counter()
            if not t_start:
                # the first step includes warm-up costs: the rate counts from its end on, and until a
                # second step arrives (a run of one step: a resumed run's last) over the first alone
                t_start.append(now)
                begin = t_ready[0] if t_ready else t0
                rate = msg.examples / (now - begin) if now > begin else 0.0
            else:
                seen[0] += msg.examples
                rate = seen[0] / (now - t_start[0]) if now > t_start[0] else 0.0
            result.losses[msg.step] = msg.loss
            result.grad_norms[msg.step] = msg.grad_norm
            if msg.allreduce is not None:
                result.reduce_stats[msg.step] = msg.allreduce
            result.examples_per_s = rate
            curve.step(msg.step, loss=msg.loss, lr=msg.lr, grad_norm=msg.grad_norm, examples_per_s=rate)
            bar.update(msg.step - bar.n)
            bar.set_postfix(loss=f"{msg.loss:.4f}", lr=f"{msg.lr:.2e}", ex_s=f"{rate:.1f}")
            if cfg.log_every and msg.step % cfg.log_every == 0:
                logger.info(
                    "step %d/%d loss %.4f lr %.3g grad_norm %.3f %.1f ex/s",
                    msg.step, total, msg.loss, msg.lr, msg.grad_norm, rate,
                )  # fmt: skip
        elif isinstance(msg, EvalLogits):
            metrics = score_eval(data.eval_features, msg.logits)
            result.evals[msg.step] = metrics
            logger.info(
                "eval step %d: exact %.2f f1 %.2f (%d questions)",
                msg.step, metrics["exact"], metrics["f1"], metrics["total"],
            )  # fmt: skip
            (out / "eval_results.json").write_text(
                json.dumps({str(k): v for k, v in result.evals.items()}, indent=2)
            )
            curve.evaluation(msg.step, exact=metrics["exact"], f1=metrics["f1"])
            curve.plot()
        elif isinstance(msg, CheckpointSaved):
            logger.info("checkpoint at step %d written", msg.step)

    curve = Curve(out, start_step=start_step)
    t0 = time.perf_counter()
    gang = Gang(spec, name="train", network=network)
    with logging_redirect_tqdm():
        try:
            gang.start()
            t_ready.append(time.perf_counter())
            gang.join(on_message=on_message)
        except BaseException:  # Ctrl-C, or a failure here: the ranks stop now, not after their run
            gang.kill()
            raise
        finally:
            gang.stop()
            bar.close()
            curve.plot()
    result.train_seconds = time.perf_counter() - t0
    return result
