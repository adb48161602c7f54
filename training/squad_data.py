"""SQuAD v1.1 / v2.0 data: JSON -> `SquadExample` -> training and evaluation features.

This module owns reading SQuAD-format files (with validation of every answer label), the
deterministic train/eval split by article, and turning examples into model features. Windowing is
NOT implemented here: it is `models.qa_processing.encode_qa`, the same code the server runs, so
training and serving see identical windows and offsets.

Usage::

    examples = load_squad("../shared/data/squad/squad-v1.1-train-pool.json")
    train_ex, eval_ex = split_by_article(examples, eval_fraction=0.1, seed=0)
    window = WindowConfig(max_seq_len=384, doc_stride=128, max_question_len=64)
    train = build_train_features(tok, train_ex, window=window)
    loader = torch.utils.data.DataLoader(train, batch_size=32, shuffle=True)   # dicts of tensors
    ev = build_eval_features(tok, eval_ex, window=window)
    start, end = model(**ev.batch.model_inputs())                    # (n_windows, seq_len) each
    preds = postprocess_eval_predictions(ev, start, end, max_answer_length=30)   # id -> QAPrediction
    training.squad_metrics.evaluate(eval_ex, prediction_texts(preds))

Labels: the first gold answer (as Hugging Face ``run_qa`` does), whitespace-trimmed, is mapped to
the first context token ending after its first character and the last context token starting
before its end. A window that does not contain the whole answer, and every window of an
unanswerable (v2.0) question, is labelled with position 0 (CLS).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from models.qa_processing import (
    DEFAULT_WINDOW,
    EncodedBatch,
    QAPrediction,
    QAWindow,
    WindowBatch,
    WindowConfig,
    decode_encoded,
    encode_qa,
)

logger = logging.getLogger(__name__)


class SquadFormatError(ValueError):
    """A SQuAD file or record is malformed; the message names the file, article and question id."""


@dataclass(frozen=True)
class SquadExample:
    """One question over one paragraph. ``answers`` are ``(text, answer_start)``, empty if impossible."""

    id: str
    title: str
    question: str
    context: str
    answers: tuple[tuple[str, int], ...]
    is_impossible: bool = False

    @property
    def answer_texts(self) -> list[str]:
        return [text for text, _ in self.answers]


@dataclass
class SquadLoadStats:
    """What `load_squad_with_stats` read, skipped and why."""

    path: str
    version: str | None = None
    n_articles: int = 0
    n_questions: int = 0  # questions in the file
    n_loaded: int = 0
    n_impossible: int = 0  # among loaded
    n_skipped: int = 0
    answer_start_mismatches: int = 0  # gold answers whose text is not at answer_start
    skipped: list[str] = field(default_factory=list)  # "id: reason"


def _skip(stats: SquadLoadStats, exc: SquadFormatError, n_questions: int) -> None:
    stats.n_skipped += n_questions
    stats.skipped.append(str(exc))
    logger.warning("skipping %d question(s): %s", n_questions, exc)


def _require(record: Mapping[str, Any], key: str, kind: type, where: str, path: str) -> Any:
    if not isinstance(record, Mapping) or key not in record:
        raise SquadFormatError(f"{path}: {where}: missing field {key!r}")
    value = record[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise SquadFormatError(f"{path}: {where}: field {key!r} should be {kind.__name__}, got {value!r:.80}")
    return value


def _parse_question(
    qa: Any, title: str, context: str, stats: SquadLoadStats
) -> SquadExample:  # raises SquadFormatError
    path = stats.path
    qid = qa.get("id") if isinstance(qa, Mapping) else None
    where = f"article {title!r} question id={qid!r}"
    qid = _require(qa, "id", str, where, path)
    question = _require(qa, "question", str, where, path)
    if not question.strip():
        raise SquadFormatError(f"{path}: {where}: empty question")
    is_impossible = qa.get("is_impossible", False)
    if not isinstance(is_impossible, bool):
        raise SquadFormatError(f"{path}: {where}: is_impossible should be a bool, got {is_impossible!r}")
    raw_answers = qa.get("answers", [] if is_impossible else None)
    if not isinstance(raw_answers, list):
        raise SquadFormatError(f"{path}: {where}: missing or malformed field 'answers'")
    answers = []
    mismatches = []
    for j, ans in enumerate(raw_answers):
        text = _require(ans, "text", str, f"{where} answer {j}", path)
        start = _require(ans, "answer_start", int, f"{where} answer {j}", path)
        if not text.strip():
            raise SquadFormatError(f"{path}: {where}: answer {j} has empty text")
        if start < 0 or context[start : start + len(text)] != text:
            mismatches.append(
                f"answer {j} text {text!r} is not at answer_start={start}"
                f" (context there: {context[max(start, 0) : max(start, 0) + len(text)]!r};"
                f" first occurrence at {context.find(text)})"
            )
        answers.append((text, start))
    if mismatches:
        stats.answer_start_mismatches += len(mismatches)
        raise SquadFormatError(f"{path}: {where}: " + "; ".join(mismatches))
    if is_impossible and answers:
        raise SquadFormatError(f"{path}: {where}: is_impossible but has {len(answers)} answers")
    if not is_impossible and not answers:
        raise SquadFormatError(f"{path}: {where}: answerable question without answers")
    return SquadExample(
        id=qid,
        title=title,
        question=question,
        context=context,
        answers=tuple(answers),
        is_impossible=is_impossible,
    )


def _count_questions(article: Any) -> int:
    paragraphs = article.get("paragraphs") if isinstance(article, Mapping) else None
    if not isinstance(paragraphs, list):
        return 0
    return sum(len(p["qas"]) for p in paragraphs if isinstance(p, Mapping) and isinstance(p.get("qas"), list))


def load_squad_with_stats(
    path: str | Path, *, strict: bool = True
) -> tuple[list[SquadExample], SquadLoadStats]:
    """Read a SQuAD v1.1/v2.0 JSON file; see `load_squad`. Also returns what was read and skipped."""
    path = Path(path)
    stats = SquadLoadStats(path=str(path))
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise SquadFormatError(f"{path}: empty file")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SquadFormatError(f"{path}: not valid JSON: {exc}") from exc
    data = _require(doc, "data", list, "top level", str(path))
    stats.version = str(doc.get("version")) if isinstance(doc, Mapping) and "version" in doc else None
    examples: list[SquadExample] = []
    seen_ids: set[str] = set()
    # strict: the first problem raises. Otherwise the smallest bad record (question, paragraph or
    # article) is skipped, and its questions are counted in stats.n_skipped.
    for a, article in enumerate(data):
        n_in_article = _count_questions(article)
        stats.n_questions += n_in_article
        try:
            title = _require(article, "title", str, f"article #{a}", str(path))
            paragraphs = _require(article, "paragraphs", list, f"article {title!r}", str(path))
        except SquadFormatError as exc:
            if strict:
                raise
            _skip(stats, exc, n_in_article)
            continue
        stats.n_articles += 1
        for p, para in enumerate(paragraphs):
            where = f"article {title!r} paragraph {p}"
            try:
                context = _require(para, "context", str, where, str(path))
                qas = _require(para, "qas", list, where, str(path))
                if not context.strip():
                    raise SquadFormatError(f"{path}: {where}: empty context")
            except SquadFormatError as exc:
                if strict:
                    raise
                _skip(stats, exc, _count_questions({"paragraphs": [para]}))
                continue
            for qa in qas:
                try:
                    ex = _parse_question(qa, title, context, stats)
                    if ex.id in seen_ids:
                        raise SquadFormatError(
                            f"{path}: article {title!r} question id={ex.id!r}: duplicate id"
                        )
                except SquadFormatError as exc:
                    if strict:
                        raise
                    _skip(stats, exc, 1)
                    continue
                seen_ids.add(ex.id)
                examples.append(ex)
    if not examples:
        raise SquadFormatError(
            f"{path}: no usable questions ({stats.n_questions} read, {stats.n_skipped} skipped)"
        )
    stats.n_loaded = len(examples)
    stats.n_impossible = sum(ex.is_impossible for ex in examples)
    if stats.n_skipped:
        logger.warning(
            "%s: skipped %d of %d questions (%d answer_start mismatches)",
            path,
            stats.n_skipped,
            stats.n_questions,
            stats.answer_start_mismatches,
        )
    logger.info(
        "%s: %d articles, %d questions loaded (%d unanswerable)",
        path,
        stats.n_articles,
        stats.n_loaded,
        stats.n_impossible,
    )
    return examples, stats


def load_squad(path: str | Path, *, strict: bool = True) -> list[SquadExample]:
    """Read a SQuAD v1.1 or v2.0 JSON file into examples (``plausible_answers`` are ignored).

    Every gold answer must sit at its ``answer_start``. With ``strict=True`` any malformed record
    raises `SquadFormatError` naming the article title and question id; with ``strict=False`` the
    bad question is skipped, counted and logged (see `load_squad_with_stats`). Never mislabels.
    """
    return load_squad_with_stats(path, strict=strict)[0]


def split_by_article(
    examples: Sequence[SquadExample],
    *,
    eval_fraction: float | None = None,
    eval_titles: Sequence[str] | None = None,
    seed: int = 0,
) -> tuple[list[SquadExample], list[SquadExample]]:
    """Deterministic ``(train, eval)`` split by article title; no article is in both parts.

    Give exactly one of ``eval_fraction`` (share of *articles*, rounded, at least one article in
    each part) or ``eval_titles``. The article order is shuffled with ``random.Random(seed)`` over
    the titles in first-seen order, so the split depends only on the data and the seed.
    """
    if (eval_fraction is None) == (eval_titles is None):
        raise ValueError(
            f"give exactly one of eval_fraction={eval_fraction!r} or eval_titles={eval_titles!r}"
        )
    titles = list(dict.fromkeys(ex.title for ex in examples))
    if eval_titles is not None:
        chosen = set(eval_titles)
        unknown = sorted(chosen - set(titles))
        if unknown:
            raise ValueError(f"eval_titles not in the data: {unknown}")
    else:
        assert eval_fraction is not None
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        if len(titles) < 2:
            raise ValueError(f"cannot split {len(titles)} article(s) into two non-empty parts")
        order = titles[:]
        random.Random(seed).shuffle(order)
        n_eval = min(len(titles) - 1, max(1, round(eval_fraction * len(titles))))
        chosen = set(order[:n_eval])
    train = [ex for ex in examples if ex.title not in chosen]
    evals = [ex for ex in examples if ex.title in chosen]
    logger.info(
        "split %d articles: %d train (%d questions), %d eval (%d questions)",
        len(titles),
        len(titles) - len(chosen),
        len(train),
        len(chosen),
        len(evals),
    )
    return train, evals


# --------------------------------------------------------------------------------------------
# Features
# --------------------------------------------------------------------------------------------


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
    """The serving windows of ``examples`` (one `encode_qa` call for train and eval features alike)."""
    return encode_qa(
        tokenizer, [ex.question for ex in examples], [ex.context for ex in examples], window=window
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
