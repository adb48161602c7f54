"""Tests for models/context_cache.py: the least-recently-used bound in bytes, the owner that empties it,
and its counts. Pure logic on stand-in encodings. Run: ``python -m pytest tests/models/test_context_cache.py -q``.
"""

from __future__ import annotations

import sys

import pytest

from shardserve.models.context_cache import BYTES_PER_TOKEN, ContextCache


class _Encoding:
    def __init__(self, tokens: int) -> None:
        self.ids = [0] * tokens


def _size(text: str, tokens: int) -> int:
    return tokens * BYTES_PER_TOKEN + sys.getsizeof(text)


def test_the_least_recently_used_text_goes_first_when_the_bytes_run_out() -> None:
    owner = object()
    cache = ContextCache(max_bytes=_size("a", 10) * 2)
    cache.store(owner, "a", _Encoding(10))
    cache.store(owner, "b", _Encoding(10))
    assert cache.lookup(owner, "a") is not None  # "a" is now the most recently used
    cache.store(owner, "c", _Encoding(10))
    assert len(cache) == 2 and cache.bytes == 2 * _size("a", 10)
    assert cache.lookup(owner, "b") is None  # evicted
    assert cache.lookup(owner, "a") is not None and cache.lookup(owner, "c") is not None
    assert cache.counts() == (3, 1)  # hits, misses


def test_a_text_bigger_than_the_cache_is_not_kept_and_evicts_nothing() -> None:
    owner = object()
    cache = ContextCache(max_bytes=_size("a", 10))
    cache.store(owner, "a", _Encoding(10))
    cache.store(owner, "huge", _Encoding(1_000))
    assert cache.lookup(owner, "huge") is None and cache.lookup(owner, "a") is not None
    assert cache.bytes == _size("a", 10)


def test_another_tokenizer_empties_it() -> None:
    first, second = object(), object()
    cache = ContextCache(max_bytes=1 << 20)
    cache.store(first, "a", _Encoding(10))
    assert cache.lookup(second, "a") is None  # a reload's new tokenizer never sees the old encodings
    assert len(cache) == 0 and cache.bytes == 0
    cache.store(second, "a", _Encoding(10))
    assert cache.lookup(second, "a") is not None


def test_a_text_stored_twice_is_counted_once() -> None:
    owner = object()
    cache = ContextCache(max_bytes=1 << 20)
    cache.store(owner, "a", _Encoding(10))
    cache.store(owner, "a", _Encoding(10))
    assert len(cache) == 1 and cache.bytes == _size("a", 10)


def test_a_negative_size_is_refused_with_the_number() -> None:
    with pytest.raises(ValueError, match="-1"):
        ContextCache(max_bytes=-1)
