"""Text helpers the QA windowing and decoding tests share (their tokenizer fixture: conftest.py)."""

from __future__ import annotations

import unicodedata

from models.qa_windows import QAWindow


def _offs(window: QAWindow) -> list[tuple[int, int] | None]:
    """The window's offsets as Python tuples, None for tokens outside the context."""
    return [(s, e) if s >= 0 else None for s, e in window.offsets.tolist()]


def _strip_accents_lower(text: str) -> str:
    return "".join(
        ch for ch in unicodedata.normalize("NFD", text.lower()) if unicodedata.category(ch) != "Mn"
    )


def _long_context(n_sentences: int = 40) -> str:
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
    return " ".join(
        f"Sentence {i} mentions {words[i % 10]} and {words[(3 * i) % 10]}." for i in range(n_sentences)
    )
