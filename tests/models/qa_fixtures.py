"""Helpers the model tests share: text for the QA windowing and decoding tests (their tokenizer
fixture: conftest.py), and right-padded batches (and forced spare rows) for the packing tests."""

from __future__ import annotations

import contextlib
import unicodedata
from collections.abc import Iterator

import pytest
import torch

from shardserve.models.qa_windows import QAWindow


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


def right_padded(lengths: list[int], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids (B, S) and their right-padded attention mask (B, S)."""
    ids = torch.randint(5, 100, (len(lengths), seq_len))
    mask = (torch.arange(seq_len) < torch.tensor(lengths)[:, None]).long()
    return ids.masked_fill(mask.eq(0), 0), mask


@contextlib.contextmanager
def spare_rows(monkeypatch: pytest.MonkeyPatch, extra: int = 3) -> Iterator[None]:
    """Packed fp32 batches run with ``extra`` spare rows after their real tokens inside this block, as
    oneDNN's row grid gives bf16 ones (``shardserve.models.packing.packed_rows``), so fp32 logits can check them."""
    import shardserve.models.packing as packing
    with monkeypatch.context() as grid:
        grid.setattr(packing, "ONEDNN_DTYPES", (torch.float32,))
        grid.setattr(packing, "packed_rows", lambda tokens: tokens + extra)
        yield
