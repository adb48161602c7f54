"""Training settings: ``TrainSettings`` (train's flags), ``TrainConfig`` (validated once, sent to every rank), ``RunInfo``.

``TrainSettings`` is the ``shardserve train`` command line (the console script generates its flags
from the fields; the defaults are ``TrainConfig``'s), ``train_config()`` the ``TrainConfig`` it
describes: what the user asked for; ``RunInfo`` is what the
driver derived from it and the data (feature file, step counts, resume point) for the ranks. Both
are picklable. The windowing settings are one ``shardserve.models.qa_windows.WindowConfig``; on disk
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
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from shardserve.models.qa_windows import WindowConfig
from shardserve.partitioner.command import Settings
from shardserve.partitioner.layout_flags import SplitFlags
from shardserve.partitioner.precision import PRECISION_CHOICES
from shardserve.partitioner.runtime.gang_flags import GangFlags
from shardserve.partitioner.schedules import SCHEDULES

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
            bad(f"window={self.window!r} must be a shardserve.models.qa_windows.WindowConfig")
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


def _default(name: str) -> Any:
    """``TrainConfig``'s default of the field ``name`` (one home for the defaults of train's flags)."""
    return TrainConfig.__dataclass_fields__[name].default


def dataclass_values(settings: BaseModel, cls: type) -> dict[str, Any]:
    """The fields of the dataclass ``cls`` that the settings model has too, by name."""
    names = [f.name for f in dataclasses.fields(cls) if f.name in type(settings).model_fields]
    return {name: getattr(settings, name) for name in names}


class WindowSettings(Settings):
    """The windowing flags of ``train`` and ``eval``: ``window()`` is the one window they make."""

    max_seq_len: int = Field(
        TRAIN_WINDOW.max_seq_len, description="window length in tokens (at most the model's positions)"
    )
    doc_stride: int = Field(
        TRAIN_WINDOW.doc_stride, description="overlap between consecutive windows (tokens)"
    )
    max_question_len: int = Field(
        TRAIN_WINDOW.max_question_len, description="questions are truncated to this many tokens"
    )

    def window(self) -> WindowConfig:
        """The windowing flags as one window (``ValueError`` when they do not make one)."""
        return WindowConfig(
            max_seq_len=self.max_seq_len, doc_stride=self.doc_stride, max_question_len=self.max_question_len
        )


class TrainSettings(WindowSettings, SplitFlags):
    """``shardserve train``'s flags: a ``TrainConfig`` (``train_config()``; it checks the numbers,
    ``TrainConfigError``), the gang across hosts (``gang``) and how the driver runs; the layout
    (``pp``, ``tp``, ``max_memory_per_rank``, ``device``) is ``SplitFlags``', shared with serve, plan
    and verify (``partitioner/layout_flags.py``; their defaults are ``TrainConfig``'s)."""

    flag_notes: ClassVar[dict[str, str]] = {  # train's own words on the layout flags (shardserve/flags.py)
        "max_memory_per_rank": "Estimated for training: weights, gradients and AdamW state (16 B/param, "
        "full fine-tuning: an overestimate with LoRA or frozen layers) + the activations 1F1B keeps of "
        "micro_batch_size x max_seq_len windows. With resume, auto must pick the checkpoint's layout "
        "unless elastic",
    }

    # ---- model and data
    model: str = Field(description="registry name (default, minilm, tiny-bert, ...) or HF model dir")
    train_file: str = Field(description="SQuAD v1.1/v2.0 JSON to train on")
    eval_file: str | None = Field(None, description="SQuAD JSON to evaluate on (else the held-out articles)")
    holdout_articles: int = Field(
        _default("holdout_articles"), description="hold out this many whole articles of --train-file for eval"
    )
    split_seed: int = Field(_default("split_seed"), description="seed of the by-article train/eval split")
    max_train_examples: int | None = Field(None, description="use only the first N (>= 1) training questions")
    max_eval_examples: int | None = Field(None, description="evaluate only the first N (>= 1) questions")
    output: str = Field(
        description="run directory for checkpoints, features cache and eval results (created once the data "
        "has been read and checked)"
    )
    # ---- parallelism
    dp: int = Field(
        _default("dp"),
        description="data-parallel copies of the pp x tp pipeline (dp*pp*tp ranks); each runs batch/micro/dp "
        "micro-batches of every global batch, gradients are all-reduced (AdamW state replicated)",
    )
    bucket_mb: float = Field(
        _default("bucket_mb"), description="dp > 1: gradient all-reduce bucket size in MiB"
    )
    boundaries: list[int] | None = Field(
        None, description="manual split: first layer of stages 1..pp-1", json_schema_extra={"nargs": "*"}
    )
    schedule: Literal[SCHEDULES] = Field(_default("schedule"), description="pipeline schedule")  # type: ignore[valid-type]
    precision: Literal[PRECISION_CHOICES] = Field(  # type: ignore[valid-type]
        _default("precision"),
        description="compute precision: fp32, or bf16/fp16 autocast over fp32 master weights and optimizer "
        "state (fp16 with dynamic loss scaling; refused on a CPU without fp16 units); auto: bf16 on "
        "GPUs and CPUs with bf16 units (AMX / AVX512-BF16), else fp32",
    )
    threads_per_rank: int | None = Field(None, description="torch threads per rank (default: cores/world)")
    gang: GangFlags = Field(default_factory=GangFlags, description="a gang across hosts")
    # ---- optimisation
    batch_size: int = Field(_default("batch_size"), description="global batch: examples per optimizer step")
    micro_batch_size: int = Field(
        _default("micro_batch_size"), description="examples per pipeline micro-batch (gradient accumulation)"
    )
    epochs: float = Field(_default("epochs"), description="passes over the training features")
    max_steps: int | None = Field(None, description="optimizer steps (overrides --epochs)")
    lr: float = Field(_default("lr"), description="peak learning rate (AdamW)")
    weight_decay: float = Field(
        _default("weight_decay"), description="AdamW decay (not on biases / LayerNorms)"
    )
    warmup_ratio: float = Field(_default("warmup_ratio"), description="share of steps of linear LR warm-up")
    max_grad_norm: float = Field(
        _default("max_grad_norm"), description="global gradient-norm clip over all ranks (0: off)"
    )
    adam_eps: float = Field(_default("adam_eps"), description="AdamW epsilon")
    seed: int = Field(_default("seed"), description="seed of the data order, dropout and LoRA init")
    dropout: float | None = Field(None, description="override the model's dropout (0: deterministic)")
    group_by_length: bool = Field(False, description="batch windows of similar length (less padding)")
    answer_occurrences: Literal[ANSWER_OCCURRENCES] = Field(  # type: ignore[valid-type]
        _default("answer_occurrences"),
        description="first: learn the labelled occurrence of the answer only; all: every occurrence of the "
        "answer text in the window (marginal likelihood; SQuAD labels one of several at random)",
    )
    # ---- parameter-efficient fine-tuning
    lora_rank: int = Field(
        _default("lora_rank"), description="LoRA rank on attention/MLP projections (0: off)"
    )
    lora_alpha: float = Field(
        _default("lora_alpha"), description="LoRA scale numerator (update = alpha/rank * B A)"
    )
    freeze_layers: int = Field(
        _default("freeze_layers"), description="freeze the embeddings and the lowest N layers"
    )
    freeze_embeddings: bool = Field(
        False,
        description="freeze the embeddings only (full fine-tuning of every layer; export_overlay --base "
        "compresses it)",
    )
    # ---- evaluation, checkpoints, logs
    eval_every: int = Field(_default("eval_every"), description="evaluate every N steps (0: at the end only)")
    eval_batch_size: int = Field(
        _default("eval_batch_size"), description="windows per evaluation micro-batch"
    )
    save_every: int = Field(_default("save_every"), description="checkpoint every N steps (0: final only)")
    keep_checkpoints: int = Field(
        _default("keep_checkpoints"), description="newest checkpoint-* directories kept"
    )
    resume: bool = Field(
        False,
        description="continue from the newest OUTPUT/checkpoint-* with the settings that shape the training "
        "unchanged (steps, --seed, data, split, windows, batch, optimizer, model; without --elastic also "
        "--pp/--tp); how it runs, logs and saves may change; not with --overwrite. A damaged checkpoint "
        "(a rank file missing or cut short) is skipped with a warning for the newest intact one",
    )
    elastic: bool = Field(
        False,
        description="with --resume: allow another --pp/--tp than the checkpoint's (weights and AdamW state "
        "are re-sharded); --dp may always change",
    )
    overwrite: bool = Field(
        False,
        description="train from scratch into an OUTPUT that already holds a run: its checkpoints, final "
        "model, curve and eval results are removed first (other files stay); not with --resume",
    )
    log_every: int = Field(_default("log_every"), description="log a line every N steps (0: never)")
    no_progress: bool = Field(False, description="hide the progress bar")
    fail_at_step: int | None = Field(
        None, description="testing only: the last rank crashes when it reaches step N"
    )

    def train_config(self) -> TrainConfig:
        """The ``TrainConfig`` these flags describe (``ValueError`` / ``TrainConfigError`` if not valid)."""
        values = dataclass_values(self, TrainConfig)
        values["boundaries"] = tuple(self.boundaries) if self.boundaries else None
        return TrainConfig(**values, window=self.window())


TRAIN_GROUPS: dict[str, tuple[str, ...]] = {  # train's help sections
    "model and data": (
        "model", "train_file", "eval_file", "holdout_articles", "split_seed", "max_train_examples",
        "max_eval_examples", "max_seq_len", "doc_stride", "max_question_len", "output",
    ),
    "parallelism": ("pp", "tp", "max_memory_per_rank", "dp", "bucket_mb", "boundaries", "schedule", "device", "precision", "threads_per_rank"),
    "a gang across hosts (the same flags as serve's; each external rank runs `shardserve worker` on its "
    "host; rank 0 stays here)": ("gang",),
    "optimisation": (
        "batch_size", "micro_batch_size", "epochs", "max_steps", "lr", "weight_decay", "warmup_ratio",
        "max_grad_norm", "adam_eps", "seed", "dropout", "group_by_length", "answer_occurrences",
    ),
    "parameter-efficient fine-tuning": ("lora_rank", "lora_alpha", "freeze_layers", "freeze_embeddings"),
    "evaluation, checkpoints, logs": (
        "eval_every", "eval_batch_size", "save_every", "keep_checkpoints", "resume", "elastic", "overwrite",
        "log_every", "no_progress", "fail_at_step",
    ),
}  # fmt: skip
