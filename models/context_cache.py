"""A bounded cache of tokenized contexts: many questions about one text tokenize it once.

Owns the least-recently-used store of context encodings that ``models/qa_windows.py`` `encode_qa`
reads before it tokenizes a context: a hit skips the tokenizer's work on the context (about 0.27 ms
for an 800-character SQuAD paragraph on a Zen 4 core) and leaves only putting the windows together.
Documents asked several questions (SQuAD's paragraphs have five each; a form read field by field)
hit; a stream of distinct texts only misses, at the cost of one dictionary lookup each.

The size bound is in bytes, from the tokens held (``BYTES_PER_TOKEN``, measured) and the texts as keys.
A cache holds one tokenizer's encodings: ``lookup``/``store`` with another tokenizer (a reload
swapped the model) first empties it. Not thread-safe: its user serializes calls (the serving
``InputProcessor`` holds its tokenizer lock around every ``encode_qa``).

    cache = ContextCache(max_bytes=32 << 20)
    enc = encode_qa(tok, questions, contexts, window=window, context_cache=cache)
    cache.counts()            # (hits, misses) since it was made

Tested by ``pytest tests/models/test_context_cache.py``.
"""

from __future__ import annotations

import logging
import sys
from collections import OrderedDict
from typing import Any

logger = logging.getLogger(__name__)

# what one token of a cached encoding holds in memory (ids, type ids, offsets, masks, word ids and
# the token's string): 97 bytes measured as RSS growth over 5,120 SQuAD contexts (Zen 4, tokenizers 0.22)
BYTES_PER_TOKEN = 100


class ContextCache:
    """Least-recently-used context encodings (``tokenizers.Encoding``), at most ``max_bytes``."""

    def __init__(self, *, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"ContextCache max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = self.misses = 0
        self._owner: Any = None  # the Rust tokenizer that made the entries
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # text -> (encoding, bytes)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, owner: Any, text: str) -> Any | None:
        """The encoding ``owner`` made of ``text`` (now the most recently used), or None."""
        self._own(owner)
        found = self._entries.get(text)
        if found is None:
            self.misses += 1
            return None
        self._entries.move_to_end(text)
        self.hits += 1
        return found[0]

    def store(self, owner: Any, text: str, encoding: Any) -> None:
        """Keep ``owner``'s ``encoding`` of ``text``, dropping the least recently used to fit; a text
        bigger than the whole cache is not kept."""
        self._own(owner)
        size = len(encoding.ids) * BYTES_PER_TOKEN + sys.getsizeof(text)
        if size > self.max_bytes or text in self._entries:
            return
        while self.bytes + size > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.bytes -= dropped
        self._entries[text] = (encoding, size)
        self.bytes += size

    def counts(self) -> tuple[int, int]:
        """``(hits, misses)`` since it was made."""
        return self.hits, self.misses

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def _own(self, owner: Any) -> None:
        if owner is not self._owner:
            if self._entries:
                logger.debug("context cache emptied: %d entries of another tokenizer", len(self._entries))
            self.clear()
            self._owner = owner
