"""Input processing: QA pairs -> tokenized, windowed ``EncodedBatch`` (the engine's first part).

Owns tokenization for serving: the windowing settings (``WindowConfig``) and the one tokenizer
thread. ``encode`` runs on the calling thread; ``encode_async`` runs it on the tokenizer thread so
that long contexts never stall the event loop, short text (``INLINE_CHARS``) right on the loop
while the thread is idle (and says how long the tokenizing took: a request's ``compute_input``
phase). Contexts it has tokenized are kept in a bounded cache when ``context_cache_bytes`` allows
(``models/context_cache.py``): a question about a text seen before skips tokenizing it, and
``on_lookups(hits, misses)`` hears of each request's lookups (the ``shardserve_context_cache_lookups``
counter). Admission (queue places, limits) is not here: it belongs to the scheduler, and the engine
asks for a place before it asks for tokens.

    inputs = InputProcessor(tokenizer=lambda: manager.model.tokenizer, window=WindowConfig(),
                            context_cache_bytes=32 << 20)
    encoded, seconds = await inputs.encode_async([QAPair("Who?", "Ann met Bob.")])  # QAInputError / ValueError
    inputs.estimate_windows(pairs)   # before tokenizing: windows expected from the text length
    inputs.min_windows(pairs, above=128)  # and the fewest it can take (413 at once when over a limit)
    inputs.expected_wait_s(pairs)    # and seconds until they would be tokenized (queue + own)
    inputs.admission(pairs, above=128)  # the three, as the engine's ``reserve`` asks for them
    inputs.shutdown()
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardserve.models.context_cache import ContextCache
from shardserve.models.qa_windows import EncodedBatch, WindowConfig, encode_qa
from shardserve.serving.engine.qa_types import QAPair
from shardserve.serving.metrics import ModelMetrics

logger = logging.getLogger(__name__)

# text (questions + contexts, characters) tokenized on the event loop when the tokenizer is free:
# about a millisecond at most; longer text goes to the tokenizer thread
INLINE_CHARS = 4096
EWMA_ALPHA = 0.2  # weight of the newest request in the characters-per-token/-second estimates
# the start of each whitespace-separated chunk holding a word character: BERT-family tokenizers split
# on whitespace first and keep every word character, so each such chunk is at least one token
_WORDY_CHUNK = re.compile(r"(?<!\S)(?=\S*\w)")


@dataclass(frozen=True)
class AdmissionAsk:
    """What admission needs to know of a request before it is tokenized (``Engine.reserve``)."""

    floor: int  # the fewest windows it can take
    hint: int  # the windows it will probably take
    tokenize_wait_s: float  # seconds until it would be tokenized


class InputProcessor:
    """Tokenize and window QA pairs, off the event loop when asked (see module doc)."""

    def __init__(
        self,
        *,
        tokenizer: Callable[[], Any],
        window: WindowConfig,
        context_cache_bytes: int = 0,
        on_lookups: Callable[[int, int], None] | None = None,
    ) -> None:
        # a callable: the tokenizer of the model generation being served (a reload may swap it)
        self.tokenizer = tokenizer
        self.window = window
        self.context_cache = ContextCache(max_bytes=context_cache_bytes) if context_cache_bytes else None
        self.on_lookups = on_lookups
        # One thread: a fast tokenizer is not safe to call from several threads at once
        # ("Already borrowed"); one is enough to keep tokenization off the event loop. The lock is
        # held around every use of the tokenizer: short text tokenized on the loop takes it too.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardserve-tokenize")
        self._lock = threading.Lock()
        # admission estimates (EWMAs over encoded requests) and the text waiting for the thread
        self._chars_per_token: float | None = None
        self._chars_per_s: float | None = None
        self._pending_chars = 0

    def encode(self, pairs: list[QAPair]) -> EncodedBatch:
        """Tokenize ``pairs`` into windows on the calling thread; raises ``QAInputError`` /
        ``ValueError`` for text the tokenizer refuses."""
        t0 = time.perf_counter()
        cache = self.context_cache
        with self._lock:
            before = cache.counts() if cache is not None else (0, 0)
            encoded = encode_qa(
                self.tokenizer(),
                [p.question for p in pairs],
                [p.context for p in pairs],
                window=self.window,
                context_cache=cache,
            )
            after = cache.counts() if cache is not None else (0, 0)
        hits, misses = (a - b for a, b in zip(after, before, strict=True))
        if tokens := _context_tokens(encoded):
            self._chars_per_token = _ewma(self._chars_per_token, sum(len(p.context) for p in pairs) / tokens)
        # every character, those of contexts found in the cache too: the waits ahead are in the same mix
        self._chars_per_s = _ewma(self._chars_per_s, _chars(pairs) / max(time.perf_counter() - t0, 1e-6))
        if self.on_lookups is not None and hits + misses:
            self.on_lookups(hits, misses)
        return encoded

    def encode_timed(self, pairs: list[QAPair]) -> tuple[EncodedBatch, float]:
        """``encode``, and the seconds it took."""
        t0 = time.perf_counter()
        encoded = self.encode(pairs)
        return encoded, time.perf_counter() - t0

    def estimate_windows(self, pairs: list[QAPair]) -> int:
        """Windows ``pairs`` will probably need: their lengths in tokens at the characters per token
        seen so far, windowed as ``encode`` would (one per pair before any was seen); an estimate
        for admission only."""
        per = self._chars_per_token
        if per is None:
            return len(pairs)
        specials = self.tokenizer().num_special_tokens_to_add(pair=True)
        return sum(
            self.window.num_windows(
                math.ceil(len(p.context) / per),
                question_tokens=math.ceil(len(p.question) / per),
                num_special_tokens=specials,
            )
            for p in pairs
        )

    def min_windows(self, pairs: list[QAPair], *, above: int) -> int:
        """The fewest windows ``pairs`` can take (a lower bound, before tokenizing): each context has
        at least as many tokens as whitespace-separated chunks holding a word character. Contexts are
        scanned only when the bound could exceed ``above`` (a C-character context has at most
        (C+1)/2 chunks), so ordinary requests cost nothing; otherwise one window per pair."""
        specials = self.tokenizer().num_special_tokens_to_add(pair=True)

        def bound(tokens: int) -> int:
            return self.window.min_windows(tokens, num_special_tokens=specials)

        if sum(bound((len(p.context) + 1) // 2) for p in pairs) <= above:
            return len(pairs)
        return sum(bound(len(_WORDY_CHUNK.findall(p.context))) for p in pairs)

    def expected_wait_s(self, pairs: list[QAPair]) -> float:
        """Seconds until ``pairs`` would be tokenized by ``encode_async``: the text already waiting
        for the thread plus their own, at the measured speed (0 before any was measured)."""
        if self._chars_per_s is None:
            return 0.0
        return (self._pending_chars + _chars(pairs)) / self._chars_per_s

    def admission(self, pairs: list[QAPair], *, above: int) -> AdmissionAsk:
        """``min_windows`` (scanning only past ``above``), ``estimate_windows`` and ``expected_wait_s``."""
        return AdmissionAsk(
            floor=self.min_windows(pairs, above=above),
            hint=self.estimate_windows(pairs),
            tokenize_wait_s=self.expected_wait_s(pairs),
        )

    async def encode_async(self, pairs: list[QAPair]) -> tuple[EncodedBatch, float]:
        """``encode`` on the tokenizer thread (the event loop keeps running meanwhile), and the seconds
        the tokenizing itself took (not the wait for the thread). Text of at most ``INLINE_CHARS``
        is tokenized right here when the tokenizer is free: a hand-off to the thread and back costs
        more CPU than tokenizing it."""
        chars = _chars(pairs)
        if chars <= INLINE_CHARS and not self._pending_chars and not self._lock.locked():
            return self.encode_timed(pairs)  # the thread has nothing to do: the lock is free
        self._pending_chars += chars
        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread, self.encode_timed, pairs)
        finally:
            self._pending_chars -= chars

    def shutdown(self) -> None:
        """Stop the tokenizer thread; queued tokenizations are dropped."""
        self._thread.shutdown(wait=False, cancel_futures=True)


def record_context_cache(metrics: ModelMetrics, hits: int, misses: int) -> None:
    """A request's context cache lookups in ``metrics`` (the core's own, and API processes' relayed)."""
    metrics.context_cache.labels(result="hit").inc(hits)
    metrics.context_cache.labels(result="miss").inc(misses)


def _context_tokens(encoded: EncodedBatch) -> int:
    """Distinct context tokens over the pairs: a pair's windows come in order, and a token shared by
    overlapping windows (the stride) is counted in the first only."""
    last: dict[int, int] = {}  # pair -> char start of its last context token counted
    n = 0
    for w in encoded.windows:
        starts = w.data.numpy()[:, 2]  # (num_tokens,) char start of each token, -1 off the context
        n += int(np.count_nonzero(starts > last.get(w.example_index, -1)))
        last[w.example_index] = int(starts.max())
    return n


def _chars(pairs: list[QAPair]) -> int:
    return sum(len(p.question) + len(p.context) for p in pairs)


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + EWMA_ALPHA * (new - old)
