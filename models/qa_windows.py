"""Extractive-QA inputs: validation of (question, context) pairs and their windowing into token ids.

Everything between raw text and token ids on the way in (the way out is ``models/qa_decoding.py``).
It runs no model and starts no process; the HTTP server, the scheduler and the trainer all call it,
so the windowing rules exist exactly once.

Usage::

    tok = transformers.AutoTokenizer.from_pretrained(path)          # must be a *fast* tokenizer
    validate_qa_inputs(question, context, top_k=3, max_answer_length=30)   # raises QAInputError
    enc = encode_qa(tok, [question], [context], window=WindowConfig(max_seq_len=384, doc_stride=128))
    batch = pad_windows(enc.windows, pad_token_id=enc.pad_token_id)  # (n_windows, seq_len) tensors
    start, end = model(**batch.model_inputs())                       # (n_windows, seq_len) each
    preds = decode_encoded(enc, start, end, [context], top_k=3, max_answer_length=30)
    preds[0].answers[0].text == context[preds[0].answers[0].start : preds[0].answers[0].end]

Conventions:

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
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Literal

import numpy as np
import torch

from shardserve.models.context_cache import ContextCache

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
    context_cache: ContextCache | None = None,
) -> EncodedBatch:
    """Tokenize (question, context) pairs into overlapping, unpadded windows with context offsets.

    ``tokenizer`` must be a Hugging Face *fast* tokenizer. With ``context_cache``
    (``models/context_cache.py``), a context is tokenized once while the cache keeps it. Raises
    `QAInputError` for an empty question/context, a context that yields no tokens, or
    (``window.question_overflow="reject"``) a question over ``window.max_question_len`` tokens;
    ``ValueError`` for inconsistent settings.
    """
    rust = _rust_encoders(tokenizer, window)
    if len(questions) != len(contexts):
        raise ValueError(f"got {len(questions)} questions but {len(contexts)} contexts")
    if not questions:
        return EncodedBatch(windows=[], num_examples=0, pad_token_id=_pad_id(tokenizer), questions=[])
    for i, (q, c) in enumerate(zip(questions, contexts, strict=True)):
        for name, text in (("question", q), ("context", c)):
            if not isinstance(text, str) or not text.strip():
                raise QAInputError(name, "is empty or not a string", text, pair=i)

    # Questions: enforce max_question_len before windowing (the tokenizer cannot truncate them here).
    q_encodings = rust.questions.encode_batch(list(questions), add_special_tokens=False)
    enc_questions = list(questions)
    truncated = [False] * len(questions)
    for i, n in enumerate(len(e.ids) for e in q_encodings):
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
        q_encodings[i] = rust.questions.encode(enc_questions[i], add_special_tokens=False)
        truncated[i] = True
        logger.debug("question %d truncated from %d to <= %d tokens", i, n, window.max_question_len)

    windows: list[QAWindow] = []
    has_context = [False] * len(questions)
    cache = context_cache if rust.joins else None  # a tokenizer whose parts do not join: pairs whole
    for ex, first in enumerate(_pair_encodings(rust, q_encodings, enc_questions, contexts, cache)):
        context_type = _context_type(first) if cache is not None and rust.has_types else None
        for i, e in enumerate((first, *first.overflowing)):
            data = _window_data(e, has_types=rust.has_types, context_type=context_type)  # (n, 4)
            has_context[ex] = has_context[ex] or bool((data[:, 2] >= 0).any())
            windows.append(QAWindow(data=torch.from_numpy(data), example_index=ex, window_index=i))
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


def _pair_encodings(
    rust: _RustEncoders,
    q_encodings: list[Any],
    questions: list[str],
    contexts: Sequence[str],
    cache: ContextCache | None,
) -> list[Any]:
    """One Rust encoding per pair, its further windows in ``overflowing`` in the order transformers'
    wrapper lists them (the Rust tokenizer straight: the wrapper added 0.1 ms to each pair's 0.55).

    With a ``cache``, what the tokenizer's own pair encoding does, in its parts: the questions'
    encodings (made already, to count their tokens) and each distinct context's (from the cache when
    it holds it) are joined, truncated into windows and given special tokens by ``post_process``.
    The one difference: there the context is encoded as the second text, and its tokens keep type
    id 1 into the further windows, where a joined pair's keep the context's own 0 (`_window_data`
    sets them as in the first window). Without a cache (none given, or a tokenizer whose parts did
    not join into its own pair encoding: ``_RustEncoders.joins``), the pairs are encoded whole: 3 %
    faster than the parts on a miss."""
    if cache is None:
        return rust.pairs.encode_batch(list(zip(questions, contexts, strict=True)))
    owner = rust.questions
    found = {c: cache.lookup(owner, c) for c in dict.fromkeys(contexts)}
    missing = [c for c, e in found.items() if e is None]
    encoded = owner.encode_batch(missing, add_special_tokens=False) if missing else []
    for c, e in zip(missing, encoded, strict=True):
        found[c] = e
        cache.store(owner, c, e)
    return [rust.pairs.post_process(q, found[c]) for q, c in zip(q_encodings, contexts, strict=True)]


def _window_data(e: Any, *, has_types: bool, context_type: int | None) -> np.ndarray:
    """One window's rows, (n, 4) int32: token id, type id, and the token's (start, end) characters
    in the context, (-1, -1) off it. ``context_type``: the type id of every context token (a joined
    encoding's further windows keep the context's own zeros; see `_pair_encodings`)."""
    # the Rust encodings' lists straight into numpy: half the time of torch.tensor on each list; the
    # offsets (a list of tuples) flattened first: under half the time of numpy's own conversion
    n = len(e.ids)
    data = np.empty((n, 4), dtype=np.int32)  # (n, 4)
    data[:, 0] = e.ids
    data[:, 1] = e.type_ids if has_types else 0
    data[:, 2:] = np.fromiter(chain.from_iterable(e.offsets), dtype=np.int32, count=2 * n).reshape(n, 2)
    in_context = np.array(e.sequence_ids, dtype=np.float32) == 1  # (n,) None (a special token) -> nan
    if context_type is not None:
        data[in_context, 1] = context_type
    data[~in_context | (data[:, 3] <= data[:, 2]), 2:] = -1
    return data


def _context_type(first: Any) -> int | None:
    """The type id the post-processor gave the context's tokens in a pair's first window."""
    sequence_ids = first.sequence_ids
    return first.type_ids[sequence_ids.index(1)] if 1 in sequence_ids else None


@dataclass(frozen=True)
class _RustEncoders:
    """Copies of a fast tokenizer's Rust tokenizer set up once for a window: ``pairs`` truncates the
    context into overlapping windows, ``questions`` tokenizes questions and contexts alone.
    transformers' wrapper sets truncation on its one Rust tokenizer before every call; these are
    never changed after, so threads may share them."""

    pairs: Any  # tokenizers.Tokenizer
    questions: Any
    has_types: bool  # the model reads token type ids (else they are zeros)
    joins: bool  # a question's and a context's encodings join into the pair's (`_joins_like_pairs`)


def _joins_like_pairs(pairs: Any, questions: Any, *, has_types: bool, window: WindowConfig) -> bool:
    """Whether a question and a context encoded apart, joined by ``pairs.post_process``, give the
    windows ``pairs`` makes of them together: the ids, the offsets, which tokens are the context's
    and (``has_types``) the type ids of every window, on a probe that spans several. The tokenizers
    library's pair encoding is these same steps, but a post-processor may treat parts encoded apart
    otherwise: checked once per tokenizer and window."""
    question = "Who, and why?"  # short: a window's question room is checked against max_question_len
    context = " ".join(
        f"Sentence {i}: Zoë met Bob at 10:3{i % 10} in Köln, with 3.5 kg of golf balls."
        for i in range(window.max_seq_len // 8 + 4)
    )
    try:
        whole = pairs.encode(question, context)
        joined = pairs.post_process(*questions.encode_batch([question, context], add_special_tokens=False))
    except Exception as e:  # e.g. a window too small for the probe's question: no cache, pairs whole
        logger.info("contexts are not cached: the tokenizer's probe failed: %s", e)
        return False
    want = [_window_data(e, has_types=has_types, context_type=None) for e in (whole, *whole.overflowing)]
    context_type = _context_type(joined) if has_types else None
    got = [_window_data(e, has_types=has_types, context_type=context_type) for e in (joined, *joined.overflowing)]
    same = len(want) == len(got) and all(np.array_equal(a, b) for a, b in zip(want, got, strict=False))
    if not same:
        logger.info("this tokenizer's pair encoding is not its parts joined: contexts are not cached")
    return same


_ENCODERS: weakref.WeakKeyDictionary[Any, dict[WindowConfig, _RustEncoders]] = weakref.WeakKeyDictionary()
_ENCODERS_LOCK = threading.Lock()


def _rust_encoders(tokenizer: Any, window: WindowConfig) -> _RustEncoders:
    """The `_RustEncoders` of ``tokenizer`` for ``window`` (checked against it once, then kept)."""
    with _ENCODERS_LOCK:
        found = _ENCODERS.setdefault(tokenizer, {}).get(window)
    if found is not None:
        return found
    window.check_tokenizer(tokenizer)
    from tokenizers import Tokenizer

    state = tokenizer.backend_tokenizer.to_str()
    pairs, questions = Tokenizer.from_str(state), Tokenizer.from_str(state)
    for rust in (pairs, questions):
        rust.no_padding()
        rust.no_truncation()
        rust.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
    pairs.enable_truncation(window.max_seq_len, stride=window.doc_stride, strategy="only_second")
    has_types = "token_type_ids" in getattr(tokenizer, "model_input_names", ())
    found = _RustEncoders(
        pairs=pairs,
        questions=questions,
        has_types=has_types,
        joins=_joins_like_pairs(pairs, questions, has_types=has_types, window=window),
    )
    with _ENCODERS_LOCK:
        _ENCODERS[tokenizer][window] = found
    return found


def _pad_id(tokenizer: Any) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad) if pad is not None else 0
