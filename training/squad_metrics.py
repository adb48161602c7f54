"""Official SQuAD v1.1 / v2.0 evaluation: answer normalisation, exact match, F1, null-threshold tuning.

This module owns the metric definitions of the official ``evaluate-v2.0.py`` script (which agrees
with ``evaluate-v1.1.py`` on answerable questions): answers are lower-cased, stripped of
punctuation, of the articles a/an/the and of extra whitespace; EM and F1 take the max over the
gold answers; an unanswerable question's only gold answer is the empty string (so a prediction
scores 1 on it exactly when it is ``""``). Scores are percentages, as in the official script.

Usage::

    from shardserve.training.squad_metrics import evaluate
    result = evaluate(examples, {"56be4db0acb8001400a502ec": "Denver Broncos", ...})
    result["exact"], result["f1"], result["total"]      # + HasAns_* / NoAns_* (v2.0 data)

A question without a prediction scores 0 and is counted in ``result["missing"]`` (the v1.1
script does the same; the v2.0 script silently drops it, which inflates the score).
"""

from __future__ import annotations

import collections
import logging
import math
import re
import string
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardserve.training.squad_data import SquadExample

logger = logging.getLogger(__name__)

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower, remove punctuation, remove articles (a/an/the), collapse whitespace (official order)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def get_tokens(text: str) -> list[str]:
    return normalize_answer(text).split() if text else []


def compute_exact(gold: str, pred: str) -> int:
    """1 if the normalised strings are equal, else 0."""
    return int(normalize_answer(gold) == normalize_answer(pred))


def compute_f1(gold: str, pred: str) -> float:
    """Token-overlap F1 of normalised answers; if either is empty, 1.0 iff both are empty."""
    gold_toks = get_tokens(gold)
    pred_toks = get_tokens(pred)
    if not gold_toks or not pred_toks:
        return float(gold_toks == pred_toks)
    common = collections.Counter(gold_toks) & collections.Counter(pred_toks)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_toks)
    recall = num_same / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def gold_answers(example: SquadExample) -> list[str]:
    """Gold strings of an example; ``[""]`` for unanswerable ones (official v2.0 rule)."""
    golds = [text for text, _ in example.answers if normalize_answer(text)]
    return golds or [""]


def raw_scores(
    examples: Sequence[SquadExample], predictions: Mapping[str, str]
) -> tuple[dict[str, float], dict[str, float]]:
    """Per-question ``(exact, f1)`` in [0, 1], max over gold answers; missing predictions score 0."""
    exact: dict[str, float] = {}
    f1: dict[str, float] = {}
    for ex in examples:
        if ex.id not in predictions:
            exact[ex.id] = f1[ex.id] = 0.0
            continue
        pred = predictions[ex.id]
        if not isinstance(pred, str):
            raise TypeError(f"prediction for {ex.id!r} should be a str, got {type(pred).__name__}: {pred!r}")
        golds = gold_answers(ex)
        exact[ex.id] = float(max(compute_exact(g, pred) for g in golds))
        f1[ex.id] = max(compute_f1(g, pred) for g in golds)
    return exact, f1


def _has_answer(example: SquadExample) -> bool:
    return gold_answers(example) != [""]


def evaluate(examples: Sequence[SquadExample], predictions: Mapping[str, str]) -> dict[str, float]:
    """Official SQuAD metrics over ``examples``: ``exact``, ``f1`` (percent), ``total``, ``missing``,
    plus ``HasAns_exact/f1/total`` when some gold is answerable and ``NoAns_*`` when some is not.

    ``predictions`` maps question id -> answer text (``""`` = no answer).
    """
    if not examples:
        raise ValueError("evaluate needs at least one example, got 0")
    ids = [ex.id for ex in examples]
    missing = [qid for qid in ids if qid not in predictions]
    if missing:
        logger.warning(
            "%d of %d questions have no prediction (scored 0), e.g. %s", len(missing), len(ids), missing[:3]
        )
    extra = len(set(predictions) - set(ids))
    if extra:
        logger.debug("%d predictions for unknown question ids ignored", extra)
    exact, f1 = raw_scores(examples, predictions)

    def block(qids: list[str]) -> tuple[float, float, int]:
        n = len(qids)
        return 100.0 * sum(exact[q] for q in qids) / n, 100.0 * sum(f1[q] for q in qids) / n, n

    result: dict[str, float] = {}
    result["exact"], result["f1"], result["total"] = block(ids)
    result["missing"] = len(missing)
    has_ans = [ex.id for ex in examples if _has_answer(ex)]
    no_ans = [ex.id for ex in examples if not _has_answer(ex)]
    if has_ans:
        result["HasAns_exact"], result["HasAns_f1"], result["HasAns_total"] = block(has_ans)
    if no_ans:
        result["NoAns_exact"], result["NoAns_f1"], result["NoAns_total"] = block(no_ans)
    return result


def find_best_null_threshold(
    examples: Sequence[SquadExample],
    span_predictions: Mapping[str, str],
    null_score_diffs: Mapping[str, float],
    *,
    metric: str = "f1",
) -> tuple[float, float]:
    """Null threshold maximising ``metric`` ("f1" or "exact"), as the official v2.0 script's search.

    ``span_predictions``: id -> best non-null span text; ``null_score_diffs``: id ->
    ``null_score - best_span_logit``. A question is answered "" when its diff > threshold (the
    `shardserve.models.qa_windows` convention). Returns ``(threshold, best score in percent)``.
    """
    if metric not in ("f1", "exact"):
        raise ValueError(f"metric must be 'f1' or 'exact', got {metric!r}")
    if not examples:
        raise ValueError("find_best_null_threshold needs at least one example, got 0")
    exact, f1 = raw_scores(examples, span_predictions)
    span_score = f1 if metric == "f1" else exact
    diffs = {ex.id: float(null_score_diffs.get(ex.id, math.inf)) for ex in examples}
    has_ans = {ex.id: _has_answer(ex) for ex in examples}
    # Start with every question abstaining (threshold below every diff), then answer questions in
    # increasing order of diff; a tie group switches together so the threshold reproduces the score.
    score = float(sum(not h for h in has_ans.values()))
    finite = [d for d in diffs.values() if math.isfinite(d)]
    best_score, best_thresh = score, (min(finite) - 1.0 if finite else 0.0)
    order = sorted((d, qid) for qid, d in diffs.items() if math.isfinite(d))
    i = 0
    while i < len(order):
        d = order[i][0]
        while i < len(order) and order[i][0] == d:
            qid = order[i][1]
            if has_ans[qid]:
                score += span_score[qid]
            elif span_predictions.get(qid, ""):
                score -= 1.0
            i += 1
        if score > best_score:
            best_score, best_thresh = score, d
    return best_thresh, 100.0 * best_score / len(examples)
