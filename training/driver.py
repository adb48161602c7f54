"""The training driver: ``train(cfg)`` (``shardserve train``) fine-tunes a QA model over the SAME
partitions and gang runtime that serve it, and shows its progress.

It validates the settings (``training/config.py``), tokenizes the SQuAD data once into a feature
file (``training/features.py``), finds where a ``--resume`` run starts (``training/checkpoint.py``),
builds the serving ``PartitionPlan`` and starts a gang whose ranks run ``training/rank.py``'s
``train_rank``. While the ranks train it handles their messages (``training/messages.py``): a
``StepReport`` moves the tqdm bar (step, loss, examples/s) and the curve (``training/curve.py``),
an ``EvalLogits`` is scored with the SQuAD metrics (``training/squad_metrics.py``) and written to
``OUT/eval_results.json``, a ``CheckpointSaved`` is logged. Ranks may run on other hosts
(``train(..., network=GangNetwork(external_ranks=..., program=TRAIN_PROGRAM))``, joined by
``shardserve worker``).

    shardserve train --model tiny-bert --train-file data.json --pp 2 --tp 1 --output /tmp/run
    shardserve train --model tiny-bert --train-file data.json --dp 2 --pp 2 --output /tmp/run
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardserve.models.registry import resolve_model
from shardserve.partitioner.plan import ParallelDims, default_devices, make_plan
from shardserve.partitioner.precision import DynamicLossScale, resolve_dtype
from shardserve.partitioner.runtime.gang import Gang
from shardserve.partitioner.runtime.rank import GangSpec
from shardserve.partitioner.runtime.remote import GangNetwork
from shardserve.training import checkpoint as ckpt
from shardserve.training import squad_metrics
from shardserve.training.config import RunInfo, TrainConfig, TrainConfigError
from shardserve.training.curve import Curve
from shardserve.training.features import (
    EvalFeatures,
    postprocess_eval_predictions,
    prediction_texts,
    prepare_data,
)
from shardserve.training.messages import CheckpointSaved, EvalLogits, StepReport
from shardserve.training.rank import train_rank, with_dropout

logger = logging.getLogger(__name__)


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


def score_eval(eval_features: EvalFeatures, logits: Any) -> dict[str, float]:
    """SQuAD EM/F1 of (N, S, 2) logits over the evaluation windows."""
    logits = torch.as_tensor(logits)  # (N, S, 2)
    preds = postprocess_eval_predictions(eval_features, logits[..., 0], logits[..., 1])
    return squad_metrics.evaluate(eval_features.examples, prediction_texts(preds))


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
    (``shardserve worker`` there, running ``training/rank.py``'s ``TRAIN_PROGRAM``; flags:
    ``partitioner/runtime/gang_flags.py``); default: every rank on this one.
    Rank 0 writes the run directory, so it is never external."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    network = network or GangNetwork()
    if network.external_ranks and network.program.program is not train_rank:
        raise TrainConfigError(
            f"ranks {list(network.external_ranks)} run elsewhere, so the network must say they run the "
            f"training program, not {network.program.name!r}: GangNetwork(program=shardserve.training.rank.TRAIN_PROGRAM)"
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
    if cfg.freeze_layers and source.config.shares_layers:
        raise TrainConfigError(
            f"freeze_layers={cfg.freeze_layers}: every layer of this {source.config.arch} model is the same "
            "shared layer; freeze it all with --lora-rank, or train it (freeze_embeddings freezes the rest)"
        )
    if cfg.freeze_layers and source.config.has_stage_copies:
        raise TrainConfigError(
            f"freeze_layers={cfg.freeze_layers}: every layer of this {source.config.arch} model reads its "
            "relative-position table, which trains with the layers; use --lora-rank or --freeze-embeddings"
        )
    if cfg.tp > source.config.num_kv_heads:
        raise TrainConfigError(
            f"tp={cfg.tp} > num_key_value_heads={source.config.num_kv_heads}: ranks sharing a key/value head "
            f"would each train their own copy of it; train at tp <= {source.config.num_kv_heads} (serving may "
            "use more)"
        )
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

    def on_message(msg: Any) -> None:
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
