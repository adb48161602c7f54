"""Training settings: ``TrainConfig`` (validated once, sent to every rank) and ``RunInfo``.

``TrainConfig`` is what the user asked for (``shardserve train`` flags); ``RunInfo`` is what the
driver derived from it and the data (feature file, step counts, resume point) for the ranks. Both
are picklable. The windowing settings are one ``models.qa_processing.WindowConfig``; on disk
(``trainer_state.json``'s ``config``) ``to_dict`` writes them as the flat ``max_seq_len`` /
``doc_stride`` / ``max_question_len`` keys checkpoints have always had, and ``from_dict`` reads
such a dict back. Fields added since that format was fixed (``ADDED_FIELDS``: ``dp``,
``bucket_mb``, ``elastic``) are written only when they differ from their default, so a run that
does not use them writes exactly the old format, and a missing key reads back as the default
(``dp`` missing = 1).

    cfg = TrainConfig(model="tiny-bert", train_file="data.json", output="/tmp/run",
                      window=WindowConfig(max_seq_len=128, doc_stride=48, max_question_len=32))
    TrainConfig.from_dict(json.loads(Path("run/checkpoint-100/trainer_state.json").read_text())["config"])
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from models.qa_processing import WindowConfig
from partitioner.precision import PRECISION_CHOICES
from partitioner.schedules import SCHEDULES

logger = logging.getLogger(__name__)

ANSWER_OCCURRENCES: tuple[str, ...] = ("first", "all")
TRAIN_WINDOW = WindowConfig(max_seq_len=256, doc_stride=128, max_question_len=64)  # the CLI defaults
WINDOW_KEYS: tuple[str, ...] = ("max_seq_len", "doc_stride", "max_question_len")  # as serialized
ADDED_FIELDS: tuple[str, ...] = ("dp", "bucket_mb", "elastic")  # on disk only when not at their default
FLOAT_FIELDS: tuple[str, ...] = (
    "bucket_mb", "epochs", "lr", "weight_decay", "warmup_ratio", "max_grad_norm", "adam_eps", "dropout", "lora_alpha"
)  # fmt: skip


class TrainConfigError(ValueError):
    """Inconsistent training settings; the message names the offending numbers."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs (validated once; picklable, sent to every rank)."""

    model: str
    train_file: str
    output: str
    eval_file: str | None = None
    holdout_articles: int = 0  # hold out this many whole articles of the train file for evaluation
    split_seed: int = 0
    max_train_examples: int | None = None  # use only the first N training questions (tests)
    max_eval_examples: int | None = None
    pp: int = 1
    tp: int = 1
    dp: int = 1  # data-parallel copies of the pipeline; the global batch is split across them
    bucket_mb: float = 25.0  # dp > 1: gradient all-reduce bucket size (MiB)
    boundaries: tuple[int, ...] | None = None
    schedule: str = "1f1b"
    batch_size: int = 32  # global batch (examples per optimizer step)
    micro_batch_size: int = 8
    epochs: float = 1.0
    max_steps: int | None = None  # overrides epochs
    lr: float = 5e-5
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    max_grad_norm: float = 1.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    seed: int = 0
    dropout: float | None = None  # override the model's hidden/attention dropout
    window: WindowConfig = TRAIN_WINDOW  # train and eval windows (--max-seq-len, --doc-stride, ...)
    lora_rank: int = 0  # 0: no LoRA
    lora_alpha: float = 16.0
    freeze_layers: int = 0  # freeze the embeddings and layers [0, k)
    freeze_embeddings: bool = False  # freeze the embeddings only (implied by freeze_layers > 0)
    eval_every: int = 0  # steps; 0: only at the end
    eval_batch_size: int = 32
    save_every: int = 0  # steps; 0: only the final checkpoint
    keep_checkpoints: int = 2
    resume: bool = False
    elastic: bool = False  # --resume may change pp/tp: the optimizer state is re-sharded
    device: str = "cpu"
    precision: str = "auto"  # fp32 | bf16 | fp16 | auto (bf16 where the device has bf16 units)
    threads_per_rank: int | None = None
    log_every: int = 10
    group_by_length: bool = False  # batches of similar-length windows (less padding)
    answer_occurrences: str = "all"  # "first": the labelled occurrence only; "all": every occurrence
    fail_at_step: int | None = None  # testing: the last rank exits hard when it reaches this step

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise TrainConfigError(msg)

        for name in FLOAT_FIELDS:  # NaN passes every comparison below; inf trains to NaN weights
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                bad(f"{name}={value} must be a finite number")
        if not all(math.isfinite(b) and 0 <= b < 1 for b in self.adam_betas):
            bad(f"adam_betas={self.adam_betas} must each be in [0, 1)")
        if not self.adam_eps > 0:
            bad(f"adam_eps={self.adam_eps} must be > 0")
        if self.pp < 1 or self.tp < 1 or self.dp < 1:
            bad(f"dp={self.dp}, pp={self.pp} and tp={self.tp} must be >= 1")
        if self.schedule not in SCHEDULES:
            bad(f"schedule={self.schedule!r} unknown; choose from {SCHEDULES}")
        if self.batch_size < 1 or self.micro_batch_size < 1 or self.batch_size % self.micro_batch_size:
            bad(
                f"batch_size={self.batch_size} must be a positive multiple of "
                f"micro_batch_size={self.micro_batch_size}"
            )
        if not self.bucket_mb > 0:
            bad(f"bucket_mb={self.bucket_mb} must be > 0")
        if self.n_micro % self.dp:
            bad(
                f"batch_size={self.batch_size} / micro_batch_size={self.micro_batch_size} = "
                f"{self.n_micro} micro-batches cannot be split evenly over dp={self.dp} replicas"
            )
        if not self.lr > 0:
            bad(f"lr={self.lr} must be > 0")
        if self.weight_decay < 0 or not 0 <= self.warmup_ratio < 1:
            bad(
                f"weight_decay={self.weight_decay} must be >= 0 and warmup_ratio={self.warmup_ratio} in [0, 1)"
            )
        if self.max_grad_norm < 0:
            bad(f"max_grad_norm={self.max_grad_norm} must be >= 0 (0 disables clipping)")
        if self.max_steps is not None and self.max_steps < 1:
            bad(f"max_steps={self.max_steps} must be >= 1")
        if self.epochs <= 0:
            bad(f"epochs={self.epochs} must be > 0")
        if self.dropout is not None and not 0 <= self.dropout < 1:
            bad(f"dropout={self.dropout} must be in [0, 1)")
        if not isinstance(self.window, WindowConfig):
            bad(f"window={self.window!r} must be a models.qa_processing.WindowConfig")
        w = self.window
        if w.doc_stride >= w.max_seq_len or w.max_question_len >= w.max_seq_len:
            bad(
                f"doc_stride={w.doc_stride} and max_question_len={w.max_question_len} must be "
                f"< max_seq_len={w.max_seq_len}"
            )
        if w.question_overflow != "truncate":
            bad(f"window.question_overflow={w.question_overflow!r}: training truncates long questions")
        if self.lora_rank < 0 or self.freeze_layers < 0:
            bad(f"lora_rank={self.lora_rank} and freeze_layers={self.freeze_layers} must be >= 0")
        if self.holdout_articles < 0:
            bad(f"holdout_articles={self.holdout_articles} must be >= 0")
        for name in ("max_train_examples", "max_eval_examples"):
            limit = getattr(self, name)
            if limit is not None and limit < 1:
                bad(f"{name}={limit} must be >= 1 (leave it unset to use every question)")
        if (
            self.eval_every < 0
            or self.save_every < 0
            or self.keep_checkpoints < 1
            or self.eval_batch_size < 1
        ):
            bad(
                f"eval_every={self.eval_every}, save_every={self.save_every} must be >= 0, "
                f"keep_checkpoints={self.keep_checkpoints} and eval_batch_size={self.eval_batch_size} >= 1"
            )
        if self.threads_per_rank is not None and self.threads_per_rank < 1:
            bad(
                f"threads_per_rank={self.threads_per_rank} must be >= 1 (leave it unset for the cores / ranks)"
            )
        if self.log_every < 0 or (self.fail_at_step is not None and self.fail_at_step < 1):
            bad(f"log_every={self.log_every} must be >= 0 and fail_at_step={self.fail_at_step} >= 1")
        if self.device not in ("cpu", "cuda"):
            bad(f"device={self.device!r} must be 'cpu' or 'cuda'")
        if self.answer_occurrences not in ANSWER_OCCURRENCES:
            bad(f"answer_occurrences={self.answer_occurrences!r} unknown; choose from {ANSWER_OCCURRENCES}")
        if self.precision not in PRECISION_CHOICES:
            bad(f"precision={self.precision!r} unknown; choose from {PRECISION_CHOICES}")

    @property
    def n_micro(self) -> int:
        return self.batch_size // self.micro_batch_size

    @property
    def n_micro_per_replica(self) -> int:
        """Micro-batches each data-parallel replica runs per optimizer step."""
        return self.n_micro // self.dp

    @property
    def peft(self) -> bool:
        return self.lora_rank > 0 or self.freeze_layers > 0

    def to_dict(self) -> dict[str, Any]:
        """The fields in order, the window flattened in place to ``WINDOW_KEYS`` (the on-disk layout);
        ``ADDED_FIELDS`` only where they differ from their default."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ADDED_FIELDS and value == f.default:
                continue
            if f.name == "window":
                out.update({k: getattr(value, k) for k in WINDOW_KEYS})
            else:
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
        """Inverse of `to_dict` (JSON lists become tuples); unknown keys are a `TrainConfigError`."""
        names = {f.name for f in dataclasses.fields(cls)} - {"window"}
        unknown = sorted(set(data) - names - set(WINDOW_KEYS))
        if unknown:
            raise TrainConfigError(f"unknown training config keys {unknown}")
        kw: dict[str, Any] = {k: v for k, v in data.items() if k in names}
        for k in ("boundaries", "adam_betas"):
            if isinstance(kw.get(k), list):
                kw[k] = tuple(kw[k])
        window = {k: data[k] for k in WINDOW_KEYS if k in data}
        try:
            kw["window"] = dataclasses.replace(TRAIN_WINDOW, **window)
        except ValueError as exc:
            raise TrainConfigError(str(exc)) from exc
        return cls(**kw)


@dataclass(frozen=True)
class RunInfo:
    """What the driver computed for the ranks (picklable)."""

    features: str  # safetensors file with train.* and eval.* tensors
    n_train: int
    n_eval: int
    total_steps: int
    warmup_steps: int
    start_step: int
    resume_from: str | None
    data_sha256: str
    base_model: str  # the model's checkpoint dir (config.json for the HF output)
    tokenizer_dir: str
    compute_dtype: str = "float32"  # autocast dtype ("float32": none); master weights stay fp32
    loss_scale: float = 1.0  # fp16: the dynamic loss scale to start from (resumed runs continue it)
    # ranks joined with `shardserve worker` on other hosts: they get and give run files through
    # rank 0 (training/run_files.py), assuming no shared filesystem
    remote_ranks: tuple[int, ...] = ()
    # --resume: newer checkpoints found damaged and passed over; rank 0's pruning spares them
    skipped_checkpoints: tuple[str, ...] = ()
