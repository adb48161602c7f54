"""``shardserve eval``: SQuAD exact match / F1 of a model, single-process or through a serving gang.

The evaluation windows are exactly the serving windows (``shardserve.models.qa_windows.encode_qa``); the
logits come from ``build_model`` (pp = tp = 1) or from a gang of ``pp * tp`` ranks running the
serving schedule; answers are decoded like the server does and scored with the official SQuAD
normalisation (``training/squad_metrics.py``: HasAns / NoAns blocks on v2.0 data).

    shardserve eval --model default --data ../shared/data/squad/squad-v1.1-train-pool.json \\
        --holdout-articles 6 --json
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from shardserve.models.qa_windows import WindowConfig

if TYPE_CHECKING:
    from shardserve.training.squad_data import SquadExample

logger = logging.getLogger(__name__)

EVAL_WINDOW = WindowConfig(max_seq_len=256, doc_stride=128, max_question_len=64)  # the CLI defaults


class EvalConfigError(ValueError):
    """Inconsistent evaluation settings; the message names the numbers."""


@dataclass(frozen=True)
class EvalConfig:
    """What to score and how (validated once)."""

    model: str
    data: str
    holdout_articles: int = 0  # score only the articles a `train --holdout-articles N` run held out
    split_seed: int = 0
    pp: int = 1
    tp: int = 1
    window: WindowConfig = EVAL_WINDOW  # the serving windows scored (--max-seq-len, ...)
    batch_size: int = 32
    max_answer_length: int = 30
    null_threshold: float | None = None
    max_examples: int | None = None
    threads_per_rank: int | None = None
    dtype: str = "auto"  # compute dtype (partitioner/precision.py); span logits and decoding stay fp32

    def __post_init__(self) -> None:
        from shardserve.models.qa_windows import QAInputError, validate_max_answer_length

        if self.pp < 1 or self.tp < 1 or self.batch_size < 1:
            raise EvalConfigError(f"pp={self.pp}, tp={self.tp} and batch_size={self.batch_size} must be >= 1")
        if self.holdout_articles < 0:
            raise EvalConfigError(f"holdout_articles={self.holdout_articles} must be >= 0")
        if self.max_examples is not None and self.max_examples < 1:
            raise EvalConfigError(
                f"max_examples={self.max_examples} must be >= 1 (leave it unset to score every question)"
            )
        if not isinstance(self.window, WindowConfig):
            raise EvalConfigError(f"window={self.window!r} must be a shardserve.models.qa_windows.WindowConfig")
        w = self.window
        if w.doc_stride >= w.max_seq_len or w.max_question_len >= w.max_seq_len:
            raise EvalConfigError(
                f"doc_stride={w.doc_stride} and max_question_len={w.max_question_len} must be "
                f"< max_seq_len={w.max_seq_len}"
            )
        try:
            validate_max_answer_length(self.max_answer_length)
        except QAInputError as exc:
            raise EvalConfigError(f"max_answer_length={self.max_answer_length}: {exc.reason}") from exc
        if self.null_threshold is not None and not math.isfinite(self.null_threshold):
            raise EvalConfigError(f"null_threshold={self.null_threshold} must be a finite number")


def _examples(cfg: EvalConfig) -> list[SquadExample]:
    from shardserve.training.squad_data import load_squad, split_by_article

    examples = load_squad(cfg.data)
    if cfg.holdout_articles:
        titles = list(dict.fromkeys(ex.title for ex in examples))
        if cfg.holdout_articles >= len(titles):
            raise EvalConfigError(
                f"holdout_articles={cfg.holdout_articles} but the file has {len(titles)} articles"
            )
        _, examples = split_by_article(
            examples, eval_fraction=cfg.holdout_articles / len(titles), seed=cfg.split_seed
        )
    if cfg.max_examples is not None:
        examples = examples[: cfg.max_examples]
    if not examples:
        raise EvalConfigError(f"{cfg.data}: no questions to score")
    return examples


def evaluate_model(cfg: EvalConfig, *, show_progress: bool = True) -> dict[str, float]:
    """Run the model over ``cfg.data`` and return the SQuAD metrics (percent)."""
    from shardserve.training.squad_metrics import evaluate

    examples, answers = predict_answers(cfg, show_progress=show_progress)
    metrics = evaluate(examples, answers)
    logger.info("eval %s on %s: %s", cfg.model, cfg.data, metrics)
    return metrics


@dataclass
class EvalInputs:
    """The scored questions, their serving windows and the batches of those windows."""

    examples: list[SquadExample]
    feats: Any  # shardserve.training.features.EvalFeatures
    batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (ids, mask, types), each (b, s)

    @property
    def windows(self) -> int:
        return len(self.feats)

    def empty_logits(self) -> torch.Tensor:
        """(N, S, 2) span logits to fill, batch by batch in order (padding stays -1e9)."""
        return torch.full((self.windows, self.feats.batch.input_ids.shape[1], 2), -1e9)


def eval_inputs(cfg: EvalConfig, source: Any) -> EvalInputs:
    """The questions of ``cfg`` windowed with ``source``'s tokenizer, in batches trimmed to their
    longest window; EvalConfigError for a window the model or the tokenizer cannot take."""

    from shardserve.training.features import build_eval_features

    if cfg.window.max_seq_len > source.config.max_seq_len:
        raise EvalConfigError(
            f"max_seq_len={cfg.window.max_seq_len} exceeds the model's {source.config.max_seq_len} positions"
        )
    examples = _examples(cfg)
    tok = source.tokenizer()
    try:
        cfg.window.check_tokenizer(tok)
    except (ValueError, TypeError) as exc:
        raise EvalConfigError(str(exc)) from exc
    feats = build_eval_features(tok, examples, window=cfg.window)
    b = feats.batch
    batches = []
    for start in range(0, len(feats), cfg.batch_size):
        sl = slice(start, start + cfg.batch_size)
        length = int(b.attention_mask[sl].sum(dim=1).max())
        batches.append(
            (b.input_ids[sl, :length], b.attention_mask[sl, :length], b.token_type_ids[sl, :length])
        )
    return EvalInputs(examples, feats, batches)


def answers_of(cfg: EvalConfig, inputs: EvalInputs, full: torch.Tensor) -> dict[str, str]:
    """Each question's answer (id -> text, ``""`` = none) from the windows' span logits (N, S, 2),
    decoded as the server decodes."""
    from shardserve.training.features import postprocess_eval_predictions, prediction_texts

    if not bool(torch.isfinite(full).all()):  # (N, S, 2): padding is -1e9, finite
        raise EvalConfigError(
            f"{cfg.model}: the model's span logits are not finite (NaN or infinite weights?)"
        )
    preds = postprocess_eval_predictions(
        inputs.feats,
        full[..., 0],
        full[..., 1],
        max_answer_length=cfg.max_answer_length,
        null_threshold=cfg.null_threshold,
    )
    return prediction_texts(preds)


def predict_answers(
    cfg: EvalConfig, *, show_progress: bool = True
) -> tuple[list[SquadExample], dict[str, str]]:
    """The scored questions and the model's answer to each (question id -> text, ``""`` = none)."""
    import os

    from tqdm import tqdm

    from shardserve.models.build import build_model
    from shardserve.models.registry import resolve_model
    from shardserve.partitioner.int8 import calibration_path, model_calibration, quantize_linears
    from shardserve.partitioner.plan import ParallelDims, make_plan
    from shardserve.partitioner.precision import resolve_dtype
    from shardserve.partitioner.stream.driver import StreamGang
    from shardserve.partitioner.stream.program import stream_spec

    # Everything that can be refused is checked before any slow work and before the progress bar,
    # so an error is one line of its own: dtype, model, partition, window length, data, tokenizer.
    source = resolve_model(cfg.model)
    calibration = calibration_path(source)
    choice = resolve_dtype(cfg.dtype, "cpu", int8_calibrated=calibration.is_file())
    logger.info("eval in %s (%s)", choice.name, choice.reason)
    int8 = model_calibration(source) if choice.int8 else None
    dims = ParallelDims(pp=cfg.pp, tp=cfg.tp)
    plan = make_plan(source.config, dims, seq_len=cfg.window.max_seq_len) if dims.world_size > 1 else None
    inputs = eval_inputs(cfg, source)
    n, full = inputs.windows, inputs.empty_logits()

    def progress() -> tqdm:  # started once the model is loaded (or the gang is up)
        return tqdm(total=n, desc="eval", unit="win", disable=not show_progress, dynamic_ncols=True)

    row = 0
    if plan is None:
        model = build_model(source, dtype=choice.dtype).eval()
        if int8 is not None:
            quantize_linears(model, int8)
        with torch.inference_mode(), progress() as bar:
            for ids, mask, types in inputs.batches:
                logits = model(ids, mask, types)  # (b, s, 2)
                full[row : row + ids.shape[0], : ids.shape[1]] = logits
                row += ids.shape[0]
                bar.update(ids.shape[0])
    else:
        threads = cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // dims.world_size)
        spec = stream_spec(source, plan, threads_per_rank=threads, dtype=choice.name)
        with StreamGang(spec, name="eval") as gang, progress() as bar:
            futures = [gang.submit(*batch) for batch in inputs.batches]
            for (ids, _, _), fut in zip(inputs.batches, futures, strict=True):
                logits = fut.result()  # (b, s, 2)
                full[row : row + ids.shape[0], : ids.shape[1]] = logits
                row += ids.shape[0]
                bar.update(ids.shape[0])
    return inputs.examples, answers_of(cfg, inputs, full)
