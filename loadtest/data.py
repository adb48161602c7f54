"""Questions and contexts for the load generator: a SQuAD-format file, else a small generated set.

Pure Python (no torch), because the locust process imports it::

    items = load_qa_items("../shared/data/squad/squad-v1.1-train-pool.json", limit=500)
    items = load_qa_items(None)   # the shared SQuAD pool when present, else generated items

Each item is a ``QAItem(question, context)``; the generated fallback writes sentences with a known
fact so answers are plausible, but any answer the server returns is checked only for offsets
(``context[start:end] == text``), never for correctness.

Tests: ``tests/loadtest/test_data.py``.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# ../shared/data/squad next to the repository (never copied into it)
DEFAULT_SQUAD = (
    Path(__file__).resolve().parents[1].parent / "shared" / "data" / "squad" / "squad-v1.1-train-pool.json"
)


@dataclass(frozen=True)
class QAItem:
    question: str
    context: str


def read_json(path: str | Path) -> Any:
    """A JSON file's content; ``ValueError`` naming the file when it cannot be read, is not UTF-8
    or is not valid JSON (with where the parser stopped)."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None


def read_squad(path: str | Path, *, limit: int | None = None) -> list[QAItem]:
    """(question, context) pairs from a SQuAD v1.1/v2.0 JSON file, in file order, up to ``limit``.

    ``ValueError`` naming the file when it cannot be read, is not JSON, is not SQuAD-shaped, or
    holds no question with a context (``data[].paragraphs[].context`` and ``.qas[].question``)."""
    doc = read_json(path)
    articles = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(articles, list):
        raise ValueError(f"{path}: not SQuAD format (top-level 'data' list missing)")
    items: list[QAItem] = []
    for article in articles:
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        for para in paragraphs if isinstance(paragraphs, list) else []:
            context = para.get("context") if isinstance(para, dict) else None
            qas = para.get("qas") if isinstance(para, dict) else None
            if not isinstance(context, str) or not context or not isinstance(qas, list):
                continue
            for qa in qas:
                question = qa.get("question") if isinstance(qa, dict) else None
                if isinstance(question, str) and question.strip():
                    items.append(QAItem(question=question, context=context))
                    if limit is not None and len(items) >= limit:
                        return items
    if not items:
        raise ValueError(
            f"{path}: no questions found (SQuAD format: data[].paragraphs[] with a 'context' and "
            "'qas'[].'question')"
        )
    return items


def check_data_file(path: str | Path) -> None:
    """Refuse (``ValueError`` naming the file) a question file the load generator could not use,
    before any load is sent: the locust process reads it with :func:`read_squad`."""
    read_squad(path, limit=1)


_SUBJECTS = ["The river", "The old bridge", "The museum", "The observatory", "The library", "The harbour"]
_PLACES = ["Lisbon", "Kraków", "Osaka", "Montréal", "Nairobi", "Valparaíso", "Tromsø", "Hobart"]
_FILLER = (
    "Visitors often arrive in the early morning, when the light is soft and the streets are quiet. "
    "Local guides describe its history at length, including several restorations and a fire. "
)


def generate_items(n: int = 64, *, seed: int = 0) -> list[QAItem]:
    """``n`` synthetic SQuAD-like items (deterministic for a seed), of varied context lengths."""
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        subject = rng.choice(_SUBJECTS)
        place = rng.choice(_PLACES)
        year = rng.randint(1700, 2020)
        fact = f"{subject} in {place} was completed in {year}. "
        context = _FILLER * rng.randint(0, 6) + fact + _FILLER * rng.randint(0, 6)
        question = rng.choice(
            [
                f"When was {subject.lower()} in {place} completed?",
                f"Where is {subject.lower()} built in {year}?",
            ]
        )
        items.append(QAItem(question=question, context=context.strip()))
    return items


def load_qa_items(path: str | Path | None, *, limit: int | None = 2000, seed: int = 0) -> list[QAItem]:
    """Items from ``path``; with None, the shared SQuAD pool if present, else :func:`generate_items`."""
    if path is not None:
        return read_squad(path, limit=limit)
    if DEFAULT_SQUAD.is_file():
        logger.info("load-test questions from %s", DEFAULT_SQUAD)
        return read_squad(DEFAULT_SQUAD, limit=limit)
    logger.info("no SQuAD file at %s: using generated questions", DEFAULT_SQUAD)
    return generate_items(64 if limit is None else min(64, limit), seed=seed)
