"""Extractive-QA outputs: span decoding, from the start/end logits of a pair's windows to answers.

The way back of ``models/qa_windows.py`` (whose windows carry the character offsets used here).
The server and the trainer's evaluation both decode with it, so the scoring rules exist once.

    preds = decode_encoded(enc, start, end, [context], top_k=3, max_answer_length=30)
    preds[0].answers[0].text == context[preds[0].answers[0].start : preds[0].answers[0].end]

Conventions:

* **Score (calibrated across windows).** The start logits of ALL windows of one example are
  softmax-normalised together, as ONE distribution over every position a model may point at: the
  context tokens of every window (a token in the overlap of two windows is a position in each) plus
  a single null position, the CLS logit (index 0) of the window with the lowest null score; the end
  logits likewise. A span's ``score = p_start * p_end`` in ``[0, 1]`` is then comparable across
  windows and questions. As the normalisers are shared by every span of the example, spans rank by
  ``start_logit + end_logit`` (the Hugging Face ``run_qa`` rule), and a one-window context gets
  exactly the per-window softmax over its context tokens + CLS (the Hugging Face QA pipeline's).
  Normalising each window on its own instead lets a window without the answer sum to 1 and
  outscore the right span of another window: on long contexts (~14 windows) that costs 4 EM / 6 F1
  points (``benchmarks/bench_long_context.py``, ``docs/benchmarks.md``).
  The same character span found in several overlapping windows is reported once, with its best
  score.
* **No answer (SQuAD 2.0).** ``null_score`` = min over windows of ``start_logit[0] + end_logit[0]``
  (the CLS token), and ``best_span_logit`` = max over valid spans of ``start_logit + end_logit``
  (both in logit space, as in Hugging Face ``run_qa`` post-processing; the best span is the top
  answer). With a float ``null_threshold``, ``no_answer = null_score - best_span_logit >
  null_threshold``; ``None`` (the default) disables no-answer so a SQuAD-1.1 model always answers.
  The server takes its ``--null-threshold`` as the default and a request's ``null_threshold`` field
  (`validate_null_threshold`: finite, in ``NULL_THRESHOLD_RANGE``) overrides it. ``answers`` always
  holds the best non-null spans; ``no_answer`` says the model prefers to abstain.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shardserve.models.qa_windows import (
    EncodedBatch,
    QAWindow,
    validate_max_answer_length,
    validate_top_k,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Answer:
    """One answer span: ``context[start:end] == text``."""

    text: str
    score: float  # p_start * p_end in [0, 1], one softmax over all windows (module docstring)
    start: int  # character offset into the original context
    end: int  # exclusive character offset
    logit_score: float  # start_logit + end_logit (the space `null_score` lives in)


@dataclass(frozen=True)
class QAPrediction:
    """Decoded answers of one example (best first) plus the SQuAD-2.0 null decision."""

    answers: list[Answer]
    null_score: float  # min over windows of start_logit[0] + end_logit[0]
    no_answer: bool  # null_score - best_span_logit > null_threshold (never when threshold is None)
    best_span_logit: float = -math.inf  # max over valid spans of start_logit + end_logit

    @property
    def null_score_diff(self) -> float:
        """``null_score - best_span_logit``: compare with a null threshold (see `find_best_null_threshold`)."""
        return self.null_score - self.best_span_logit

    @property
    def text(self) -> str:
        """The SQuAD prediction string: ``""`` when abstaining, else the best answer's text."""
        return "" if self.no_answer or not self.answers else self.answers[0].text


def _as_logit_rows(logits: Any, windows: Sequence[QAWindow], name: str) -> list[np.ndarray]:
    rows = [logits[i] for i in range(len(logits))] if isinstance(logits, torch.Tensor) else list(logits)
    if len(rows) != len(windows):
        raise ValueError(f"{name}: got {len(rows)} rows for {len(windows)} windows")
    out = []
    for i, (row, w) in enumerate(zip(rows, windows, strict=True)):
        if isinstance(row, torch.Tensor):
            row = row.detach().to("cpu", torch.float32).numpy()
        t = np.asarray(row, dtype=np.float32).reshape(-1)  # (>= num_tokens,)
        if t.size < w.num_tokens:
            raise ValueError(f"{name}[{i}] has {t.size} values, the window has {w.num_tokens} tokens")
        t = t[: w.num_tokens]
        if not np.isfinite(t).all():
            raise ValueError(f"{name}[{i}] contains non-finite values")
        out.append(t)
    return out


def _log_sum_exp(x: np.ndarray) -> float:
    """``log(sum(exp(x)))`` of a 1-D array, without overflow."""
    top = float(x.max())
    return top + math.log(float(np.exp(x - top).sum()))


def decode_spans(
    windows: Sequence[QAWindow],
    start_logits: Any,
    end_logits: Any,
    context: str,
    *,
    top_k: int = 1,
    max_answer_length: int = 30,
    null_threshold: float | None = None,
) -> QAPrediction:
    """Best ``top_k`` answer spans over all windows of ONE example.

    ``start_logits``/``end_logits``: one 1-D row per window (tensor, array or list; a 2-D padded
    tensor ``(n_windows, >= seq_len)`` also works, rows are cut to each window's length). Spans obey
    ``start <= end``, ``end - start + 1 <= max_answer_length`` tokens, both ends on context tokens;
    identical character spans from overlapping windows are kept once (best score). See the module
    docstring for the score and no-answer conventions.
    """
    validate_top_k(top_k)
    validate_max_answer_length(max_answer_length)
    if null_threshold is not None and not math.isfinite(null_threshold):
        raise ValueError(f"null_threshold must be finite or None, got {null_threshold!r}")
    if not windows:
        raise ValueError("decode_spans needs at least one window, got 0")
    if len({w.example_index for w in windows}) != 1:
        raise ValueError(
            f"decode_spans decodes one example; got windows of examples {sorted({w.example_index for w in windows})}"
        )
    s_rows = _as_logit_rows(start_logits, windows, "start_logits")
    e_rows = _as_logit_rows(end_logits, windows, "end_logits")

    n_win = len(windows)
    seq = max(w.num_tokens for w in windows)
    neg_inf = -math.inf
    # numpy, not torch: these arrays are small, and a torch op costs several times a numpy one
    start = np.full((n_win, seq), neg_inf, dtype=np.float32)  # (W, L)
    end = np.full((n_win, seq), neg_inf, dtype=np.float32)  # (W, L)
    chars = np.full((n_win, seq, 2), -1, dtype=np.int64)  # (W, L, 2) context character span of each token
    for i, w in enumerate(windows):
        k = w.num_tokens
        start[i, :k] = s_rows[i]
        end[i, :k] = e_rows[i]
        chars[i, :k] = w.offsets.numpy()  # (k, 2)
    if int(chars[:, :, 1].max()) > len(context):
        i = int((chars[:, :, 1].max(axis=1) > len(context)).argmax())  # the first such window
        raise ValueError(
            f"window {i} has offsets up to {int(chars[i, :, 1].max())}, outside the context ({len(context)} chars)"
        )
    is_ctx = chars[:, :, 0] >= 0  # (W, L)

    null_per_window = start[:, 0] + end[:, 0]  # (W,)
    null_window = int(null_per_window.argmin())
    null_score = float(null_per_window[null_window])

    # One distribution over all windows: every window's context tokens + ONE null position (the
    # CLS of the min-null window), so scores compare across windows (see the module docstring). A
    # span's log p_start + log p_end is its logit sum less the two normalisers.
    pointable = is_ctx.copy()  # (W, L)
    pointable[null_window, 0] = True
    log_norm = _log_sum_exp(start[pointable]) + _log_sum_exp(end[pointable])

    # Band of spans (s, s + a) with a in [0, A): the end logits seen through a sliding window of a
    # right-padded row; -inf wherever either end is not a context token (so the span is not valid).
    band = min(max_answer_length, seq)
    start_ctx = np.where(is_ctx, start, neg_inf)  # (W, L)
    end_padded = np.full((n_win, seq + band - 1), neg_inf, dtype=np.float32)  # (W, L + A - 1)
    end_padded[:, :seq] = np.where(is_ctx, end, neg_inf)
    row, col = end_padded.strides
    end_band = np.ndarray((n_win, seq, band), np.float32, end_padded, strides=(row, col, col))  # (W, L, A)
    logit = start_ctx[:, :, None] + end_band  # (W, L, A)
    flat = logit.reshape(-1)  # (W * L * A,)

    n_valid = int(np.count_nonzero(flat > neg_inf))
    if n_valid == 0:
        logger.debug("no valid span in %d windows", n_win)
        return QAPrediction(answers=[], null_score=null_score, no_answer=True)
    best_span_logit = float(flat.max())

    k = min(n_valid, top_k * n_win)
    while True:
        if k == 1:
            top = np.array([flat.argmax()])  # (1,)
        else:
            top = np.argpartition(flat, flat.size - k)[flat.size - k :]  # (k,) the k largest, unordered
            top = top[np.argsort(-flat[top], kind="stable")]  # best first
        answers: list[Answer] = []
        seen: set[tuple[int, int]] = set()
        for value, index in zip(flat[top].tolist(), top.tolist(), strict=True):
            w, rem = divmod(index, seq * band)
            s, a = divmod(rem, band)
            cs, ce = int(chars[w, s, 0]), int(chars[w, s + a, 1])
            while cs < ce - 1 and context[cs].isspace():  # byte-level BPE: a token's span holds its space
                cs += 1
            if (cs, ce) in seen:
                continue
            seen.add((cs, ce))
            answers.append(
                Answer(
                    text=context[cs:ce],
                    score=min(1.0, math.exp(value - log_norm)),
                    start=cs,
                    end=ce,
                    logit_score=value,
                )
            )
            if len(answers) == top_k:
                break
        if len(answers) == top_k or k == n_valid:
            break
        k = min(n_valid, 2 * k)

    no_answer = null_threshold is not None and null_score - best_span_logit > null_threshold
    return QAPrediction(
        answers=answers, null_score=null_score, no_answer=no_answer, best_span_logit=best_span_logit
    )


def decode_encoded(
    encoded: EncodedBatch,
    start_logits: Any,
    end_logits: Any,
    contexts: Sequence[str],
    *,
    top_k: int = 1,
    max_answer_length: int = 30,
    null_threshold: float | None = None,
) -> list[QAPrediction]:
    """Decode every example of an `EncodedBatch`; logits rows follow ``encoded.windows`` order.

    ``start_logits``/``end_logits``: ``(n_windows, >= seq_len)`` tensor or a sequence of 1-D rows.
    """
    if len(contexts) != encoded.num_examples:
        raise ValueError(f"got {len(contexts)} contexts for {encoded.num_examples} examples")
    n = len(encoded.windows)
    if len(start_logits) != n or len(end_logits) != n:
        raise ValueError(f"got {len(start_logits)}/{len(end_logits)} logit rows for {n} windows")
    rows: list[list[int]] = [[] for _ in range(encoded.num_examples)]
    for i, w in enumerate(encoded.windows):
        rows[w.example_index].append(i)
    return [
        decode_spans(
            [encoded.windows[i] for i in idx],
            [start_logits[i] for i in idx],
            [end_logits[i] for i in idx],
            contexts[ex],
            top_k=top_k,
            max_answer_length=max_answer_length,
            null_threshold=null_threshold,
        )
        for ex, idx in enumerate(rows)
    ]
