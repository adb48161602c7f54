"""SQuAD v1.1 / v2.0 data: reading SQuAD-format JSON into `SquadExample`, and splitting it.

This module owns parsing (with validation of every answer label: a malformed record is a
`SquadFormatError` naming the file, article and question id, or is skipped and counted with
``strict=False``), the example types, and the deterministic train/eval split by article. Turning
examples into model features is the next step, ``training/features.py``, which imports this
module (never the reverse).

    examples = load_squad("../shared/data/squad/squad-v1.1-train-pool.json")
    train_ex, eval_ex = split_by_article(examples, eval_fraction=0.1, seed=0)
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
