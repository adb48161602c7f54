"""Tests for training/squad_metrics.py against hand-computed values of the official SQuAD metrics.

Run: ``python -m pytest tests/training/test_squad_metrics.py -q``.
"""

from __future__ import annotations

import pytest

from shardserve.training.squad_data import SquadExample
from shardserve.training.squad_metrics import (
    compute_exact,
    compute_f1,
    evaluate,
    find_best_null_threshold,
    gold_answers,
    normalize_answer,
)


def _ex(qid: str, *answers: str, impossible: bool = False) -> SquadExample:
    return SquadExample(qid, "T", "q?", "ctx", tuple((a, 0) for a in answers), is_impossible=impossible)


@pytest.mark.parametrize(
    ("raw", "norm"),
    [
        ("The  Cat!", "cat"),
        ("a an the", ""),
        ("  Denver   Broncos. ", "denver broncos"),
        ("Theater, anthem", "theater anthem"),  # articles only as whole words
        ("Saint-Étienne's", "saintétiennes"),  # punctuation removed, accents kept (official)
        ("\tA\nB  c", "b c"),
    ],
)
def test_normalize_answer(raw, norm):
    assert normalize_answer(raw) == norm


def test_exact_and_f1_hand_values():
    assert compute_exact("the Cat", "cat") == 1
    assert compute_exact("cat", "cats") == 0
    assert compute_f1("the quick brown fox", "quick fox jumps") == pytest.approx(2 / 3)
    # repeated tokens count with multiplicity: common = {red: 1, blue: 1}
    assert compute_f1("red red blue", "red blue blue") == pytest.approx(2 / 3)
    # precision 2/3, recall 1 -> F1 = 0.8
    assert compute_f1("Carolina Panthers", "Panthers of Carolina") == pytest.approx(0.8)
    assert compute_f1("cat", "dog") == 0.0
    assert compute_f1("", "") == 1.0 and compute_f1("", "the") == 1.0  # "the" normalises to empty
    assert compute_f1("", "cat") == 0.0 and compute_f1("cat", "") == 0.0


def test_evaluate_v1_hand_computed():
    examples = [
        _ex("a", "Denver Broncos", "Broncos"),
        _ex("b", "Carolina Panthers"),
        _ex("c", "Super Bowl 50"),
    ]
    preds = {"a": "the Broncos", "b": "Panthers of Carolina", "zzz": "ignored"}  # "c" missing -> 0
    result = evaluate(examples, preds)
    assert result["exact"] == pytest.approx(100 * 1 / 3)
    assert result["f1"] == pytest.approx(100 * (1 + 0.8 + 0) / 3)
    assert result["total"] == 3 and result["missing"] == 1
    assert result["HasAns_total"] == 3 and "NoAns_total" not in result
    # max over gold answers: "Denver" matches neither exactly, best F1 is vs "Denver Broncos" (2/3)
    one = evaluate([examples[0]], {"a": "Denver"})
    assert one["exact"] == 0.0 and one["f1"] == pytest.approx(100 * 2 / 3)


def test_evaluate_v2_hasans_noans_breakdown():
    examples = [
        _ex("h1", "Normandy"),
        _ex("h2", "10th century"),
        _ex("n1", impossible=True),
        _ex("n2", impossible=True),
        _ex("n3", impossible=True),
    ]
    assert gold_answers(examples[2]) == [""]
    preds = {"h1": "Normandy", "h2": "", "n1": "", "n2": "France", "n3": "The"}
    result = evaluate(examples, preds)
    # h1: 1/1, h2: 0/0, n1: 1/1, n2: 0/0, n3: "The" normalises to "" -> 1/1
    assert result["HasAns_exact"] == pytest.approx(50.0) and result["HasAns_f1"] == pytest.approx(50.0)
    assert result["NoAns_exact"] == pytest.approx(100 * 2 / 3) and result["NoAns_f1"] == pytest.approx(
        100 * 2 / 3
    )
    assert result["exact"] == pytest.approx(60.0) and result["f1"] == pytest.approx(60.0)
    assert (result["HasAns_total"], result["NoAns_total"], result["total"]) == (2, 3, 5)
    partial = evaluate(examples[1:2], {"h2": "the 10th"})
    assert partial["exact"] == 0.0 and partial["f1"] == pytest.approx(100 * 2 * (1 * 0.5) / 1.5)


def test_evaluate_rejects_bad_inputs():
    with pytest.raises(ValueError, match="at least one"):
        evaluate([], {})
    with pytest.raises(TypeError, match="should be a str"):
        evaluate([_ex("a", "x")], {"a": None})


def test_find_best_null_threshold_hand_example():
    examples = [_ex("A", "cat"), _ex("B", "dog"), _ex("C", impossible=True), _ex("D", impossible=True)]
    spans = {"A": "cat", "B": "wolf", "C": "x", "D": "y"}
    diffs = {"A": -2.0, "B": 1.0, "C": 0.5, "D": 3.0}
    # all abstain: 2/4; answer A (+1) -> 3/4; then C (-1), B (+0), D (-1)
    thresh, best = find_best_null_threshold(examples, spans, diffs)
    assert thresh == -2.0 and best == pytest.approx(75.0)
    # applying the threshold with the serving rule (abstain iff diff > threshold) reproduces the score
    preds = {q: ("" if diffs[q] > thresh else spans[q]) for q in spans}
    assert evaluate(examples, preds)["f1"] == pytest.approx(best)
    # only answerable questions: answering B gains nothing, the first threshold reaching the best wins
    thresh2, best2 = find_best_null_threshold(examples[:2], spans, diffs, metric="exact")
    assert thresh2 == -2.0 and best2 == pytest.approx(50.0)
    # ties switch together: two questions with the same diff, one right and one wrong answer to a NoAns
    tied = [_ex("A", "cat"), _ex("C", impossible=True)]
    thresh3, best3 = find_best_null_threshold(tied, spans, {"A": 0.0, "C": 0.0})
    assert thresh3 == -1.0 and best3 == pytest.approx(50.0)
    with pytest.raises(ValueError, match="metric"):
        find_best_null_threshold(examples, spans, diffs, metric="em")
