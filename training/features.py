"""SQuAD examples -> model features: labelled training windows, evaluation windows and their
decoding, and the training run's feature file (``OUT/.cache/features-*.safetensors``).

The examples come from ``training/squad_data.py`` (parse, split); this module tokenizes them.
Windowing is NOT implemented here: it is `shardserve.models.qa_windows.encode_qa`, the same code the server
runs, so training and serving see identical windows and offsets.

Labels: the first gold answer (as Hugging Face ``run_qa`` does), whitespace-trimmed, is mapped to
the first context token ending after its first character and the last context token starting
before its end. A window that does not contain the whole answer, and every window of an
unanswerable (v2.0) question, is labelled with position 0 (CLS).

The driver calls `prepare_data`; the ranks read the tensors they need with `read_features`. The
file holds ``train.*`` tensors (token ids int32, masks / token types uint8, labels int16, every
window padded to ``max_seq_len``) and, when the run evaluates, ``eval.*`` model inputs. Its name is
a hash of everything that shapes it (`features_key`): the data files' contents, the tokenizer,
the window and the example selection, so a resumed run (or a second run on the same data) reuses
it without reading or tokenizing the training set again. The driver's `EvalFeatures` (windows with
character offsets, for scoring) are built only when the first evaluation is scored.

    train = build_train_features(tok, train_ex, window=window)       # map-style dataset of dicts
    ev = build_eval_features(tok, eval_ex, window=window)
    start, end = model(**ev.batch.model_inputs())                    # (n_windows, seq_len) each
    preds = postprocess_eval_predictions(ev, start, end, max_answer_length=30)   # id -> QAPrediction
    shardserve.training.squad_metrics.evaluate(eval_ex, prediction_texts(preds))

    data = prepare_data(cfg, resolve_model(cfg.model))        # PreparedData(path, n_train, n_eval, ...)
    t = read_features(str(data.path), "train", ("input_ids", "attention_mask"))
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from shardserve.models.context_cache import ContextCache
from shardserve.models.qa_decoding import QAPrediction, decode_encoded
from shardserve.models.qa_windows import (
    DEFAULT_WINDOW,
    EncodedBatch,
    QAWindow,
    WindowBatch,
    WindowConfig,
    encode_qa,
)
from shardserve.models.registry import ModelSource
from shardserve.training.config import TrainConfig, TrainConfigError
from shardserve.training.squad_data import SquadExample, load_squad, split_by_article

logger = logging.getLogger(__name__)

FEATURE_CHUNK = 2048  # questions tokenized at a time when building the feature file
FEATURES_FORMAT = 2  # bump when the feature file's tensors change (part of the cache key)
FEATURE_CONTEXT_CACHE_BYTES = 16 << 20  # contexts kept while windowing (a paragraph's questions are neighbours)
EVAL_INPUTS: tuple[str, ...] = ("input_ids", "attention_mask", "token_type_ids")


@dataclass
class TrainFeatures:
    """Labelled training windows; a map-style dataset (``features[i]`` is a dict of tensors)."""

    input_ids: torch.Tensor  # (n_features, seq_len) int64
    attention_mask: torch.Tensor  # (n_features, seq_len) int64
    token_type_ids: torch.Tensor  # (n_features, seq_len) int64
    start_positions: torch.Tensor  # (n_features,) int64, 0 = CLS (no answer in this window)
    end_positions: torch.Tensor  # (n_features,) int64
    example_index: torch.Tensor  # (n_features,) int64, index into the `examples` given
    example_ids: list[str]  # (n_features,) SQuAD id of each feature's example
    windows: list[QAWindow]  # (n_features,) the unpadded windows (offsets for checks/debugging)
    # (n_features, K) int64: every occurrence of the answer text inside the window (the labelled
    # one first when inside), -1 padded; (0, 0) alone when none is inside. For the marginal loss.
    start_candidates: torch.Tensor | None = None
    end_candidates: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids[i],
            "attention_mask": self.attention_mask[i],
            "token_type_ids": self.token_type_ids[i],
            "start_positions": self.start_positions[i],
            "end_positions": self.end_positions[i],
        }


def _answer_char_span(example: SquadExample) -> tuple[int, int] | None:
    """``[start, end)`` of the first gold answer with surrounding whitespace trimmed."""
    if example.is_impossible or not example.answers:
        return None
    text, start = example.answers[0]
    lead = len(text) - len(text.lstrip())
    return start + lead, start + len(text.rstrip())


def _occurrence_spans(example: SquadExample) -> list[tuple[int, int]]:
    """``[start, end)`` of every occurrence of the first answer's (trimmed) text in the context,
    the annotated one first. SQuAD labels one occurrence; where the text repeats, the annotation
    may be arbitrary (the shared training file marks the first), so training can learn from all."""
    span = _answer_char_span(example)
    if span is None:
        return []
    text = example.context[span[0] : span[1]]
    spans = [span]
    pos = example.context.find(text)
    while pos >= 0:
        if pos != span[0]:
            spans.append((pos, pos + len(text)))
        pos = example.context.find(text, pos + 1)
    return spans


def label_window(window: QAWindow, char_span: tuple[int, int] | None) -> tuple[int, int]:
    """Token ``(start, end)`` of ``char_span`` in ``window``, or ``(0, 0)`` (CLS) if not fully inside."""
    if char_span is None:
        return 0, 0
    a_start, a_end = char_span
    ctx = torch.nonzero(window.is_context).flatten()  # (c,) context token indices
    if not len(ctx):
        return 0, 0
    starts, ends = window.offsets[ctx, 0], window.offsets[ctx, 1]  # (c,) each
    if int(starts[0]) > a_start or int(ends[-1]) < a_end:
        return 0, 0
    start_tok = int(ctx[torch.nonzero(ends > a_start)[0]])  # first token ending after the answer starts
    end_tok = int(ctx[torch.nonzero(starts < a_end)[-1]])  # last token starting before it ends
    if start_tok > end_tok:
        return 0, 0
    return start_tok, end_tok


def _encode(tokenizer: Any, examples: Sequence[SquadExample], window: WindowConfig) -> EncodedBatch:
    """The serving windows of ``examples`` (one `encode_qa` call for train and eval features alike).
    A paragraph's questions follow each other, so a small context cache tokenizes each paragraph
    once: 8,727 pool questions (1,683 paragraphs) in 1.5 s instead of 2.0 (Zen 4, 2 cores)."""
    return encode_qa(
        tokenizer,
        [ex.question for ex in examples],
        [ex.context for ex in examples],
        window=window,
        context_cache=ContextCache(max_bytes=FEATURE_CONTEXT_CACHE_BYTES),
    )


def build_train_features(
    tokenizer: Any,
    examples: Sequence[SquadExample],
    *,
    window: WindowConfig = DEFAULT_WINDOW,
    pad_to_multiple_of: int | None = None,
) -> TrainFeatures:
    """Window every example with `encode_qa` and label start/end token positions (CLS = 0)."""
    encoded = _encode(tokenizer, examples, window)
    spans = [_answer_char_span(ex) for ex in examples]
    labels = [label_window(w, spans[w.example_index]) for w in encoded.windows]
    occurrences = [_occurrence_spans(ex) for ex in examples]
    candidates = []
    for w, label in zip(encoded.windows, labels, strict=True):
        found = [label] if label != (0, 0) else []
        for span in occurrences[w.example_index][1:]:
            other = label_window(w, span)
            if other != (0, 0) and other not in found:
                found.append(other)
        candidates.append(found or [(0, 0)])
    k = max(len(c) for c in candidates)
    padded = [c + [(-1, -1)] * (k - len(c)) for c in candidates]
    batch = encoded.pad(pad_to_multiple_of=pad_to_multiple_of)
    n_labelled = sum(s > 0 for s, _ in labels)
    logger.info(
        "%d examples -> %d train features (%d with an answer span, %d CLS)",
        len(examples),
        len(labels),
        n_labelled,
        len(labels) - n_labelled,
    )
    return TrainFeatures(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        token_type_ids=batch.token_type_ids,
        start_positions=torch.tensor([s for s, _ in labels], dtype=torch.long),
        end_positions=torch.tensor([e for _, e in labels], dtype=torch.long),
        example_index=batch.example_index,
        example_ids=[examples[w.example_index].id for w in encoded.windows],
        windows=encoded.windows,
        start_candidates=torch.tensor([[s for s, _ in c] for c in padded], dtype=torch.long),  # (n, K)
        end_candidates=torch.tensor([[e for _, e in c] for c in padded], dtype=torch.long),
    )


@dataclass
class EvalFeatures:
    """Evaluation windows: run ``batch`` through the model, then `postprocess_eval_predictions`."""

    examples: list[SquadExample]
    encoded: EncodedBatch  # windows + offsets, in example order
    batch: WindowBatch  # padded model inputs, rows follow ``encoded.windows``

    def __len__(self) -> int:
        return len(self.encoded.windows)


def build_eval_features(
    tokenizer: Any,
    examples: Sequence[SquadExample],
    *,
    window: WindowConfig = DEFAULT_WINDOW,
    pad_to_multiple_of: int | None = None,
) -> EvalFeatures:
    """Window examples for evaluation (same windows as serving), keeping offsets for decoding."""
    encoded = _encode(tokenizer, examples, window)
    batch = encoded.pad(pad_to_multiple_of=pad_to_multiple_of)
    return EvalFeatures(examples=list(examples), encoded=encoded, batch=batch)


def postprocess_eval_predictions(
    features: EvalFeatures,
    start_logits: Any,
    end_logits: Any,
    *,
    top_k: int = 1,
    max_answer_length: int = 30,
    null_threshold: float | None = None,
) -> dict[str, QAPrediction]:
    """Decode per-window logits (``(n_windows, seq_len)``, rows as ``features.batch``) to id -> prediction."""
    preds = decode_encoded(
        features.encoded,
        start_logits,
        end_logits,
        [ex.context for ex in features.examples],
        top_k=top_k,
        max_answer_length=max_answer_length,
        null_threshold=null_threshold,
    )
    return {ex.id: pred for ex, pred in zip(features.examples, preds, strict=True)}


def prediction_texts(predictions: Mapping[str, QAPrediction]) -> dict[str, str]:
    """id -> SQuAD answer string (``""`` for no answer), the input of `squad_metrics.evaluate`."""
    return {qid: pred.text for qid, pred in predictions.items()}


def null_score_diffs(predictions: Mapping[str, QAPrediction]) -> dict[str, float]:
    """id -> ``null_score - best_span_logit`` (``+inf`` when no span was possible), for threshold tuning."""
    return {qid: p.null_score_diff for qid, p in predictions.items()}


# ----------------------------------------------------------------------------------------------
# The run's feature file
# ----------------------------------------------------------------------------------------------


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class PreparedData:
    """The feature file written for the ranks, plus the driver's evaluation windows (built on demand)."""

    path: Path
    n_train: int
    n_eval: int  # evaluation windows in the file (0: the run does not evaluate)
    data_sha256: str
    _build_eval: Callable[[], EvalFeatures | None] = field(repr=False, default=lambda: None)
    _eval: EvalFeatures | None = field(repr=False, default=None)

    @property
    def eval_features(self) -> EvalFeatures | None:
        """The evaluation windows with their offsets (the rows of the file's ``eval.*`` tensors)."""
        if self._eval is None and self.n_eval:
            self._eval = self._build_eval()
            got = len(self._eval) if self._eval is not None else 0
            if got != self.n_eval:
                raise RuntimeError(f"{self.path}: {self.n_eval} eval windows in the file, {got} rebuilt")
        return self._eval


def select_examples(cfg: TrainConfig) -> tuple[list[SquadExample], list[SquadExample]]:
    """``(train, eval)`` examples: the train file (less held-out articles), and the held-out articles
    or the eval file, each cut to the configured maximum."""
    examples = load_squad(cfg.train_file)
    eval_examples: list[SquadExample] = []
    if cfg.holdout_articles:
        titles = list(dict.fromkeys(ex.title for ex in examples))
        if cfg.holdout_articles >= len(titles):
            raise TrainConfigError(
                f"holdout_articles={cfg.holdout_articles} leaves no training article (file has {len(titles)})"
            )
        frac = cfg.holdout_articles / len(titles)
        examples, eval_examples = split_by_article(examples, eval_fraction=frac, seed=cfg.split_seed)
    if cfg.eval_file:
        eval_examples = load_squad(cfg.eval_file)
    if cfg.max_train_examples is not None:
        examples = examples[: cfg.max_train_examples]
    if cfg.max_eval_examples is not None:
        eval_examples = eval_examples[: cfg.max_eval_examples]
    if not examples:
        raise TrainConfigError(f"{cfg.train_file}: no training questions left to train on")
    return examples, eval_examples


def create_output_dir(output: str | Path) -> Path:
    """``output`` as a directory (made with its parents if missing); a `TrainConfigError` saying why
    when it cannot be (a file of that name, a parent that is a file, no permission, ...)."""
    out = Path(output)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        reason = "a file of that name exists" if out.exists() and not out.is_dir() else exc.strerror or exc
        raise TrainConfigError(f"--output {output}: cannot create directory: {reason}") from exc
    if not os.access(out, os.W_OK | os.X_OK):
        raise TrainConfigError(f"--output {output}: directory not writable")
    return out


def check_window(tokenizer: Any, cfg: TrainConfig) -> None:
    """Refuse windows the tokenizer cannot cut (too little room for ``doc_stride``) as a `TrainConfigError`."""
    try:
        cfg.window.check_tokenizer(tokenizer)
    except (ValueError, TypeError) as exc:
        raise TrainConfigError(str(exc)) from exc


def _eval_examples(cfg: TrainConfig) -> list[SquadExample]:
    """The evaluation examples alone (the train file is read only when articles are held out of it)."""
    if cfg.eval_file:
        examples = load_squad(cfg.eval_file)
        return examples[: cfg.max_eval_examples] if cfg.max_eval_examples is not None else examples
    return select_examples(cfg)[1] if cfg.holdout_articles else []


def features_key(cfg: TrainConfig, source: ModelSource, *, train_sha256: str) -> str:
    """The cache key of a feature file (unchanged across versions of the code that write the same tensors)."""
    w = cfg.window
    parts = [
        FEATURES_FORMAT,
        train_sha256,
        cfg.eval_file and sha256_file(cfg.eval_file),
        str(source.tokenizer_dir),
        w.max_seq_len,
        w.doc_stride,
        w.max_question_len,
        cfg.holdout_articles,
        cfg.split_seed,
        cfg.max_train_examples,
        cfg.max_eval_examples,
    ]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def prepare_data(cfg: TrainConfig, source: ModelSource, *, show_progress: bool = False) -> PreparedData:
    """Tokenize train (and eval) examples once into ``OUT/.cache/features-{key}.safetensors``.

    On a cache hit nothing is read but the file's header; the evaluation windows are rebuilt only
    when ``eval_features`` is first used. Otherwise the data is read and checked before
    ``cfg.output`` is created (`create_output_dir`), so a bad data file leaves no empty run directory.
    """

    sha = sha256_file(cfg.train_file)
    out = Path(cfg.output) / ".cache" / f"features-{features_key(cfg, source, train_sha256=sha)}.safetensors"

    def tokenizer() -> Any:
        return source.tokenizer()

    if out.is_file():
        with safe_open(str(out), framework="pt", device="cpu") as f:
            n_train = int(f.get_slice("train.input_ids").get_shape()[0])
            n_eval = int(f.get_slice("eval.input_ids").get_shape()[0]) if "eval.input_ids" in f.keys() else 0
        logger.info("%d cached train features, %d eval windows: %s", n_train, n_eval, out)

        def build_eval() -> EvalFeatures | None:
            examples = _eval_examples(cfg)
            return build_eval_features(tokenizer(), examples, window=cfg.window) if examples else None

        return PreparedData(out, n_train, n_eval, sha, _build_eval=build_eval)
    tok = tokenizer()
    check_window(tok, cfg)
    examples, eval_examples = select_examples(cfg)  # the data is valid before OUTPUT is made
    create_output_dir(cfg.output)
    eval_features = build_eval_features(tok, eval_examples, window=cfg.window) if eval_examples else None
    tensors = _train_feature_tensors(tok, examples, cfg, show_progress=show_progress)
    if eval_features is not None:
        b = eval_features.batch
        tensors.update(
            {
                "eval.input_ids": b.input_ids.int(),
                "eval.attention_mask": b.attention_mask.to(torch.uint8),
                "eval.token_type_ids": b.token_type_ids.to(torch.uint8),
            }
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    tmp.rename(out)
    n_train = len(tensors["train.input_ids"])
    n_eval = len(eval_features) if eval_features is not None else 0
    logger.info("%d train features, %d eval windows -> %s", n_train, n_eval, out)
    return PreparedData(out, n_train, n_eval, sha, _eval=eval_features)


def _train_feature_tensors(
    tok: Any, examples: list[SquadExample], cfg: TrainConfig, *, show_progress: bool
) -> dict[str, torch.Tensor]:
    """Labelled training windows, tokenized ``FEATURE_CHUNK`` questions at a time (the windows'
    offsets of one chunk are dropped before the next, so memory stays at the compact tensors):
    token ids int32, masks / token types uint8, every window padded to ``max_seq_len``."""
    from tqdm import tqdm

    parts: dict[str, list[torch.Tensor]] = {}
    with tqdm(
        total=len(examples), desc="features", unit="q", disable=not show_progress, dynamic_ncols=True
    ) as bar:
        for i in range(0, len(examples), FEATURE_CHUNK):
            chunk = build_train_features(
                tok,
                examples[i : i + FEATURE_CHUNK],
                window=cfg.window,
                pad_to_multiple_of=cfg.window.max_seq_len,
            )
            for name, t, dtype in (
                ("input_ids", chunk.input_ids, torch.int32),
                ("attention_mask", chunk.attention_mask, torch.uint8),
                ("token_type_ids", chunk.token_type_ids, torch.uint8),
                ("start_positions", chunk.start_positions, torch.int16),
                ("end_positions", chunk.end_positions, torch.int16),
                ("start_candidates", chunk.start_candidates, torch.int16),
                ("end_candidates", chunk.end_candidates, torch.int16),
            ):
                parts.setdefault(name, []).append(t.to(dtype))
            bar.update(min(FEATURE_CHUNK, len(examples) - i))
    width = max(t.shape[1] for t in parts["start_candidates"])  # K: most occurrences in one window
    for name in ("start_candidates", "end_candidates"):
        parts[name] = [F.pad(t, (0, width - t.shape[1]), value=-1) for t in parts[name]]
    return {f"train.{name}": torch.cat(ts) for name, ts in parts.items()}


def read_features(path: str, prefix: str, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of the ``{prefix}.{name}`` tensors of a feature file (a rank's share)."""
    with safe_open(path, framework="pt", device="cpu") as f:
        return {n: f.get_tensor(f"{prefix}.{n}") for n in names}
