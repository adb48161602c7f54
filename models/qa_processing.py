"""Extractive-QA text processing: validation, windowing of (question, context) pairs, span decoding.

This module owns everything between raw text and token ids on the way in, and between
start/end logits and answer strings on the way out. It runs no model and starts no process;
the HTTP server, the scheduler and the trainer all call it, so the windowing and decoding rules
exist exactly once.

Usage::

    tok = transformers.AutoTokenizer.from_pretrained(path)          # must be a *fast* tokenizer
    validate_qa_inputs(question, context, top_k=3, max_answer_length=30)   # raises QAInputError
    enc = encode_qa(tok, [question], [context], window=WindowConfig(max_seq_len=384, doc_stride=128))
    batch = pad_windows(enc.windows, pad_token_id=enc.pad_token_id)  # (n_windows, seq_len) tensors
    start, end = model(**batch.model_inputs())                       # (n_windows, seq_len) each
    preds = decode_encoded(enc, start, end, [context], top_k=3, max_answer_length=30)
    preds[0].answers[0].text == context[preds[0].answers[0].start : preds[0].answers[0].end]

Conventions (documented once, here):

* **Windows.** A context longer than the window is split into overlapping windows with the
  tokenizer's own ``truncation="only_second"`` / ``return_overflowing_tokens=True`` / ``stride``;
  ``doc_stride`` is the number of context tokens shared by two consecutive windows (Hugging Face
  ``stride`` semantics). Windows are returned *unpadded* (`QAWindow`) so that the scheduler can
  store them individually and batch windows of different requests; `pad_windows` pads a list of
  windows to a common length (right padding). ``num_tokens`` is the unpadded length (token budget).
* **Offsets.** ``QAWindow.offsets[i]`` is the ``(start, end)`` character span of token ``i`` in the
  ORIGINAL context string, or ``(-1, -1)`` for question, special, zero-width and padding tokens.
* **Long questions.** Questions longer than ``max_question_len`` tokens are truncated by default
  (``question_overflow="truncate"``): the question text is cut at the last whole word that fits, and
  ``EncodedBatch.question_truncated`` records it. ``question_overflow="reject"`` raises `QAInputError`.
* **Score (calibrated across windows).** The start logits of ALL windows of one example are
  softmax-normalised together, as ONE distribution over every position a model may point at: the
  context tokens of every window (a token in the overlap of two windows is a position in each) plus
  a single null position, the CLS logit (index 0) of the window with the lowest null score; the end
  logits likewise. A span's ``score = p_start * p_end`` in ``[0, 1]`` is then comparable across
  windows and questions. As the normalisers are shared by every span of the example, spans rank by
  ``start_logit + end_logit`` (the Hugging Face ``run_qa`` rule), and a one-window context gets
  exactly the per-window softmax over its context tokens + CLS (the Hugging Face QA pipeline's).
  Before issue 11 each window was normalised on its own, so a window without the answer still
  summed to 1 and its best span could outscore the right one from another window; on long
  contexts (~14 windows) that cost 4 EM / 6 F1 points (``benchmarks/bench_long_context.py``,
  ``docs/benchmarks.md``).
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
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

logger = logging.getLogger(__name__)

TOP_K_RANGE = (1, 20)
MAX_ANSWER_LENGTH_RANGE = (1, 512)
NULL_THRESHOLD_RANGE = (-1000.0, 1000.0)  # per-request bound (logit units; real diffs are within +-50)
DEFAULT_MAX_CONTEXT_CHARS = 100_000
DEFAULT_MAX_QUESTION_CHARS = 2_000

QuestionOverflow = Literal["truncate", "reject"]


# --------------------------------------------------------------------------------------------
# Errors and input validation
# --------------------------------------------------------------------------------------------


class QAInputError(ValueError):
    """A request input is invalid; ``field`` names it, ``reason`` says why, ``pair`` is the index of
    the (question, context) pair it belongs to when there are several (the HTTP layer -> 4xx)."""

    def __init__(self, field: str, reason: str, value: Any = None, *, pair: int | None = None) -> None:
        self.field = field
        self.reason = reason
        self.value = value
        self.pair = pair
        super().__init__(f"invalid {field}{'' if pair is None else f' of pair {pair}'}: {reason}")


def _check_int_range(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise QAInputError(name, f"must be an integer in {lo}..{hi}, got {value!r}", value)
    if not lo <= value <= hi:
        raise QAInputError(name, f"must be in {lo}..{hi}, got {value}", value)
    return value


def validate_top_k(top_k: Any) -> int:
    """Return ``top_k`` if it is an int in 1..20, else raise `QAInputError`."""
    return _check_int_range("top_k", top_k, *TOP_K_RANGE)


def validate_max_answer_length(max_answer_length: Any) -> int:
    """Return ``max_answer_length`` (tokens) if it is an int in 1..512, else raise `QAInputError`."""
    return _check_int_range("max_answer_length", max_answer_length, *MAX_ANSWER_LENGTH_RANGE)


def validate_null_threshold(null_threshold: Any) -> float | None:
    """Return ``null_threshold`` if it is ``None`` or a finite number in ``NULL_THRESHOLD_RANGE``.

    This is the bound of a *request's* threshold; ``decode_spans`` itself accepts any finite value
    (a server may configure e.g. ``-1e6`` to always abstain). Raises `QAInputError`.
    """
    if null_threshold is None:
        return None
    lo, hi = NULL_THRESHOLD_RANGE
    if isinstance(null_threshold, bool) or not isinstance(null_threshold, (int, float)):
        raise QAInputError(
            "null_threshold", f"must be a number or null, got {null_threshold!r}", null_threshold
        )
    if not math.isfinite(null_threshold) or not lo <= null_threshold <= hi:
        raise QAInputError(
            "null_threshold", f"must be in {lo:g}..{hi:g}, got {null_threshold}", null_threshold
        )
    return float(null_threshold)


def _check_text(name: str, text: Any, max_chars: int) -> str:
    if not isinstance(text, str):
        raise QAInputError(name, f"must be a string, got {type(text).__name__}", None)
    if not text.strip():
        raise QAInputError(name, f"is empty or whitespace only ({len(text)} chars)", text[:80])
    if len(text) > max_chars:
        raise QAInputError(name, f"has {len(text)} characters, the limit is {max_chars}", len(text))
    return text


def validate_qa_inputs(
    question: Any,
    context: Any,
    *,
    top_k: Any = 1,
    max_answer_length: Any = 30,
    max_context_chars: int = DEFAULT_MAX_CONTEXT_CHARS,
    max_question_chars: int = DEFAULT_MAX_QUESTION_CHARS,
    null_threshold: Any = None,
) -> None:
    """Validate one request; raise `QAInputError` (a ``ValueError``) naming the field and the reason."""
    _check_text("question", question, max_question_chars)
    _check_text("context", context, max_context_chars)
    validate_top_k(top_k)
    validate_max_answer_length(max_answer_length)
    validate_null_threshold(null_threshold)


# --------------------------------------------------------------------------------------------
# Windowing
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WindowConfig:
    """Windowing settings, validated on construction (and against a tokenizer by `check_tokenizer`)."""

    max_seq_len: int = 384  # tokens per window, special tokens included
    doc_stride: int = 128  # context tokens shared by consecutive windows (HF `stride`)
    max_question_len: int = 64  # question tokens (no specials); longer ones are truncated/rejected
    question_overflow: QuestionOverflow = "truncate"

    def __post_init__(self) -> None:
        for name in ("max_seq_len", "doc_stride", "max_question_len"):
            value = getattr(self, name)
            lowest = 0 if name == "doc_stride" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
                raise ValueError(f"WindowConfig.{name} must be an integer >= {lowest}, got {value!r}")
        if self.question_overflow not in ("truncate", "reject"):
            raise ValueError(
                f"WindowConfig.question_overflow must be 'truncate' or 'reject', got {self.question_overflow!r}"
            )

    def context_budget(self, num_special_tokens: int) -> int:
        """Context tokens per window in the worst case (longest allowed question)."""
        return self.max_seq_len - self.max_question_len - num_special_tokens

    def num_windows(self, context_tokens: int, *, question_tokens: int, num_special_tokens: int) -> int:
        """Windows a context of ``context_tokens`` tokens takes next to a question of ``question_tokens``
        (truncated to ``max_question_len``): the first holds ``max_seq_len - question - specials`` of
        them, and each further window ``doc_stride`` fewer new ones (the overlap)."""
        room = self.max_seq_len - min(question_tokens, self.max_question_len) - num_special_tokens
        if context_tokens <= room:
            return 1
        return 1 + -(-(context_tokens - room) // max(1, room - self.doc_stride))

    def min_windows(self, context_tokens: int, *, num_special_tokens: int) -> int:
        """Fewest windows a context of at least ``context_tokens`` tokens can take: those it takes next
        to the shortest question (one token). A lower bound known before tokenizing."""
        return self.num_windows(context_tokens, question_tokens=1, num_special_tokens=num_special_tokens)

    def check_tokenizer(self, tokenizer: Any) -> None:
        """Raise ``ValueError``/``TypeError`` if ``tokenizer`` cannot window with these settings."""
        if not getattr(tokenizer, "is_fast", False):
            raise TypeError(
                f"a fast (Rust) tokenizer with offset mapping is required, got {type(tokenizer).__name__}"
            )
        if getattr(tokenizer, "truncation_side", "right") != "right":
            raise ValueError(f"tokenizer.truncation_side must be 'right', got {tokenizer.truncation_side!r}")
        n_special = tokenizer.num_special_tokens_to_add(pair=True)
        budget = self.context_budget(n_special)
        if budget <= self.doc_stride:
            raise ValueError(
                f"windows too small: max_seq_len={self.max_seq_len} - max_question_len={self.max_question_len}"
                f" - {n_special} special tokens = {budget} context tokens, must exceed doc_stride={self.doc_stride}"
            )


DEFAULT_WINDOW = WindowConfig()


@dataclass(frozen=True, eq=False)
class QAWindow:
    """One unpadded model input window of one (question, context) pair, in ONE small int32 tensor.

    Compact on purpose: a server may hold hundreds of queued requests of up to
    ``max_windows_per_request`` windows each. As Python lists (ids, mask, types, offset tuples) a
    384-token window took ~66 KB; as one ``(num_tokens, 4)`` int32 tensor it takes ~6 KB.
    """

    data: torch.Tensor  # (num_tokens, 4) int32: input id, token type id, context char start, char end
    example_index: int  # which input pair of the `encode_qa` call this window belongs to
    window_index: int  # position of this window among its example's windows

    @property
    def num_tokens(self) -> int:
        return int(self.data.shape[0])

    @property
    def input_ids(self) -> torch.Tensor:
        return self.data[:, 0]  # (num_tokens,)

    @property
    def token_type_ids(self) -> torch.Tensor:
        return self.data[:, 1]  # (num_tokens,) zeros when the tokenizer returns none

    @property
    def offsets(self) -> torch.Tensor:
        """``(num_tokens, 2)`` character span of each token in the context, ``(-1, -1)`` if not context."""
        return self.data[:, 2:]

    @property
    def is_context(self) -> torch.Tensor:
        return self.data[:, 2] >= 0  # (num_tokens,) bool

    @property
    def context_token_range(self) -> tuple[int, int]:
        """``[first, last]`` token indices (inclusive) of the context part; ``(-1, -1)`` if none."""
        idx = torch.nonzero(self.is_context).flatten()
        return (int(idx[0]), int(idx[-1])) if len(idx) else (-1, -1)


@dataclass
class WindowBatch:
    """Windows padded (right) to a common length, as int64 tensors ready for the model."""

    input_ids: torch.Tensor  # (n_windows, seq_len) int64
    attention_mask: torch.Tensor  # (n_windows, seq_len) int64, 0 on padding
    token_type_ids: torch.Tensor  # (n_windows, seq_len) int64
    offsets: torch.Tensor  # (n_windows, seq_len, 2) int64, (-1, -1) on non-context tokens
    example_index: torch.Tensor  # (n_windows,) int64
    lengths: torch.Tensor  # (n_windows,) int64, unpadded lengths

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The keyword arguments of a BERT-family forward."""
        return {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "token_type_ids": self.token_type_ids,
        }


@dataclass
class EncodedBatch:
    """All windows of one `encode_qa` call, in example order."""

    windows: list[QAWindow]
    num_examples: int
    pad_token_id: int
    questions: list[str]  # the questions as encoded (possibly truncated)
    question_truncated: list[bool] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Unpadded tokens over all windows (the scheduler's token budget)."""
        return sum(w.num_tokens for w in self.windows)

    def windows_of(self, example_index: int) -> list[QAWindow]:
        return [w for w in self.windows if w.example_index == example_index]

    def pad(self, *, pad_to_multiple_of: int | None = None) -> WindowBatch:
        return pad_windows(
            self.windows, pad_token_id=self.pad_token_id, pad_to_multiple_of=pad_to_multiple_of
        )


def pad_windows(
    windows: Sequence[QAWindow],
    *,
    pad_token_id: int,
    pad_to_multiple_of: int | None = None,
    pad_to_length: int | None = None,
) -> WindowBatch:
    """Right-pad ``windows`` (possibly from different requests) to the longest one into a `WindowBatch`.

    ``pad_to_multiple_of`` rounds the length up; ``pad_to_length`` forces a length (>= longest).
    """
    if not windows:
        raise ValueError("pad_windows needs at least one window, got 0")
    longest = max(w.num_tokens for w in windows)
    length = longest
    if pad_to_length is not None:
        if pad_to_length < longest:
            raise ValueError(f"pad_to_length={pad_to_length} is shorter than the longest window ({longest})")
        length = pad_to_length
    if pad_to_multiple_of is not None:
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    data = torch.zeros((len(windows), length, 4), dtype=torch.long)  # (n, L, 4)
    data[:, :, 0] = pad_token_id
    data[:, :, 2:] = -1
    for i, w in enumerate(windows):
        data[i, : w.num_tokens] = w.data
    lengths = torch.tensor([w.num_tokens for w in windows], dtype=torch.long)  # (n,)
    return WindowBatch(
        input_ids=data[:, :, 0].contiguous(),  # (n, L)
        attention_mask=(torch.arange(length)[None, :] < lengths[:, None]).long(),  # (n, L)
        token_type_ids=data[:, :, 1].contiguous(),  # (n, L)
        offsets=data[:, :, 2:].contiguous(),  # (n, L, 2)
        example_index=torch.tensor([w.example_index for w in windows], dtype=torch.long),
        lengths=lengths,
    )


def _truncate_question(tokenizer: Any, question: str, max_question_len: int) -> str:
    """Cut ``question`` to at most ``max_question_len`` tokens, at a word boundary when possible."""
    enc = tokenizer(question, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    word_ids = enc.word_ids()
    keep = max_question_len
    while keep > 0 and word_ids[keep] is not None and word_ids[keep] == word_ids[keep - 1]:
        keep -= 1
    if keep == 0:  # a single word longer than the limit: cut inside it
        keep = max_question_len
    while keep > 0:
        cut = question[: offsets[keep - 1][1]].rstrip()
        if len(tokenizer(cut, add_special_tokens=False)["input_ids"]) <= max_question_len:
            return cut
        keep -= 1
    raise QAInputError("question", f"cannot be truncated to {max_question_len} tokens", question[:80])


def encode_qa(
    tokenizer: Any,
    questions: Sequence[str],
    contexts: Sequence[str],
    *,
    window: WindowConfig = DEFAULT_WINDOW,
) -> EncodedBatch:
    """Tokenize (question, context) pairs into overlapping, unpadded windows with context offsets.

    ``tokenizer`` must be a Hugging Face *fast* tokenizer. Raises `QAInputError` for an empty
    question/context, a context that yields no tokens, or (``window.question_overflow="reject"``) a
    question over ``window.max_question_len`` tokens; ``ValueError`` for inconsistent settings.
    """
    window.check_tokenizer(tokenizer)
    if len(questions) != len(contexts):
        raise ValueError(f"got {len(questions)} questions but {len(contexts)} contexts")
    if not questions:
        return EncodedBatch(windows=[], num_examples=0, pad_token_id=_pad_id(tokenizer), questions=[])
    for i, (q, c) in enumerate(zip(questions, contexts, strict=True)):
        for name, text in (("question", q), ("context", c)):
            if not isinstance(text, str) or not text.strip():
                raise QAInputError(name, "is empty or not a string", text, pair=i)

    # Questions: enforce max_question_len before windowing (the tokenizer cannot truncate them here).
    q_lens = [len(ids) for ids in tokenizer(list(questions), add_special_tokens=False)["input_ids"]]
    enc_questions = list(questions)
    truncated = [False] * len(questions)
    for i, n in enumerate(q_lens):
        if n == 0:  # e.g. only zero-width or combining characters: the tokenizer keeps none of them
            raise QAInputError("question", "yields no tokens", questions[i][:80], pair=i)
        if n <= window.max_question_len:
            continue
        if window.question_overflow == "reject":
            raise QAInputError(
                "question",
                f"has {n} tokens, max_question_len is {window.max_question_len}",
                n,
                pair=i,
            )
        enc_questions[i] = _truncate_question(tokenizer, questions[i], window.max_question_len)
        truncated[i] = True
        logger.debug("question %d truncated from %d to <= %d tokens", i, n, window.max_question_len)

    enc = tokenizer(
        enc_questions,
        list(contexts),
        truncation="only_second",
        max_length=window.max_seq_len,
        stride=window.doc_stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        padding=False,
    )
    sample_map = enc["overflow_to_sample_mapping"]
    has_types = "token_type_ids" in enc
    windows: list[QAWindow] = []
    seen_per_example = [0] * len(questions)
    has_context = [False] * len(questions)
    for w, ex in enumerate(sample_map):
        n = len(enc["input_ids"][w])
        data = torch.empty((n, 4), dtype=torch.int32)  # (n, 4)
        data[:, 0] = torch.tensor(enc["input_ids"][w], dtype=torch.int32)
        data[:, 1] = torch.tensor(enc["token_type_ids"][w], dtype=torch.int32) if has_types else 0
        data[:, 2:] = torch.tensor(enc["offset_mapping"][w], dtype=torch.int32).reshape(n, 2)
        seq_ids = enc.sequence_ids(w)
        not_context = torch.tensor([sid != 1 for sid in seq_ids]) | (data[:, 3] <= data[:, 2])  # (n,)
        data[not_context, 2:] = -1
        has_context[ex] = has_context[ex] or not bool(not_context.all())
        windows.append(QAWindow(data=data, example_index=ex, window_index=seen_per_example[ex]))
        seen_per_example[ex] += 1
    for ex, ok in enumerate(has_context):
        if not ok:
            raise QAInputError("context", "yields no tokens", contexts[ex][:80], pair=ex)
    return EncodedBatch(
        windows=windows,
        num_examples=len(questions),
        pad_token_id=_pad_id(tokenizer),
        questions=enc_questions,
        question_truncated=truncated,
    )


def _pad_id(tokenizer: Any) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad) if pad is not None else 0


# --------------------------------------------------------------------------------------------
# Span decoding
# --------------------------------------------------------------------------------------------


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


def _as_logit_rows(logits: Any, windows: Sequence[QAWindow], name: str) -> list[torch.Tensor]:
    rows = [logits[i] for i in range(len(logits))] if isinstance(logits, torch.Tensor) else list(logits)
    if len(rows) != len(windows):
        raise ValueError(f"{name}: got {len(rows)} rows for {len(windows)} windows")
    out = []
    for i, (row, w) in enumerate(zip(rows, windows, strict=True)):
        t = torch.as_tensor(row).detach().to("cpu", torch.float32).reshape(-1)  # (>= num_tokens,)
        if t.numel() < w.num_tokens:
            raise ValueError(f"{name}[{i}] has {t.numel()} values, the window has {w.num_tokens} tokens")
        t = t[: w.num_tokens]
        if not torch.isfinite(t).all():
            raise ValueError(f"{name}[{i}] contains non-finite values")
        out.append(t)
    return out


def _joint_log_softmax(logits: torch.Tensor, pointable: torch.Tensor) -> torch.Tensor:
    """Log-softmax of ``logits`` (W, L) over the ``pointable`` positions of ALL rows together; -inf elsewhere."""
    flat = logits.masked_fill(~pointable, -math.inf).reshape(-1)  # (W * L,)
    return torch.log_softmax(flat, dim=0).reshape(logits.shape)  # (W, L)


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
    start = torch.full((n_win, seq), neg_inf)  # (W, L)
    end = torch.full((n_win, seq), neg_inf)  # (W, L)
    is_ctx = torch.zeros((n_win, seq), dtype=torch.bool)  # (W, L)
    char_start = torch.full((n_win, seq), -1, dtype=torch.long)  # (W, L)
    char_end = torch.full((n_win, seq), -1, dtype=torch.long)  # (W, L)
    for i, w in enumerate(windows):
        k = w.num_tokens
        start[i, :k] = s_rows[i]
        end[i, :k] = e_rows[i]
        offs = w.offsets.long()  # (k, 2)
        if int(offs[:, 1].max()) > len(context):
            raise ValueError(
                f"window {i} has offsets up to {int(offs[:, 1].max())}, outside the context ({len(context)} chars)"
            )
        is_ctx[i, :k] = offs[:, 0] >= 0
        char_start[i, :k] = offs[:, 0]
        char_end[i, :k] = offs[:, 1]

    null_per_window = start[:, 0] + end[:, 0]  # (W,)
    null_window = int(null_per_window.argmin())
    null_score = float(null_per_window[null_window])

    # One distribution over all windows: every window's context tokens + ONE null position (the
    # CLS of the min-null window), so scores compare across windows (see the module docstring).
    pointable = is_ctx.clone()  # (W, L)
    pointable[null_window, 0] = True
    log_p_start = _joint_log_softmax(start, pointable)  # (W, L)
    log_p_end = _joint_log_softmax(end, pointable)  # (W, L)

    # Band of spans (s, s + a) with a in [0, A): gather end-side values by unfolding a padded row.
    band = min(max_answer_length, seq)

    def _band(x: torch.Tensor, fill: float | bool) -> torch.Tensor:
        padded = torch.nn.functional.pad(x, (0, band - 1), value=fill)  # (W, L + A - 1)
        return padded.unfold(1, band, 1)  # (W, L, A)

    valid = is_ctx[:, :, None] & _band(is_ctx, False)  # (W, L, A)
    log_p = (log_p_start[:, :, None] + _band(log_p_end, neg_inf)).masked_fill(~valid, neg_inf)  # (W, L, A)
    logit = (start[:, :, None] + _band(end, neg_inf)).masked_fill(~valid, neg_inf)  # (W, L, A)

    n_valid = int(valid.sum())
    if n_valid == 0:
        logger.debug("no valid span in %d windows", n_win)
        return QAPrediction(answers=[], null_score=null_score, no_answer=True)
    best_span_logit = float(logit.max())

    flat = log_p.reshape(-1)  # (W * L * A,)
    k = min(n_valid, top_k * n_win)
    while True:
        values, indices = flat.topk(k)
        answers: list[Answer] = []
        seen: set[tuple[int, int]] = set()
        for value, index in zip(values.tolist(), indices.tolist(), strict=True):
            w, rem = divmod(index, seq * band)
            s, a = divmod(rem, band)
            cs, ce = int(char_start[w, s]), int(char_end[w, s + a])
            if (cs, ce) in seen:
                continue
            seen.add((cs, ce))
            answers.append(
                Answer(
                    text=context[cs:ce],
                    score=min(1.0, math.exp(value)),
                    start=cs,
                    end=ce,
                    logit_score=float(logit[w, s, a]),
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
