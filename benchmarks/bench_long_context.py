"""Cross-window span scoring on long contexts: EM/F1 of candidate scorings, one run (issue 11).

A question asked about a long context is answered from many overlapping windows; how a span's
score is compared ACROSS windows decides which window wins. This script builds long contexts from
SQuAD: each question's own paragraph placed among the neighbouring paragraphs of its article (the
article order kept, neighbours added at random on either side until --context-words words), runs
the model once per window (``encode_qa`` + a plain ``build_model`` forward, as ``shardserve eval``
does), caches the logits, and then decodes the SAME logits with every scoring:

  window-softmax     per-window softmax over context + CLS, score = p_start * p_end (the scoring
                     before issue 11: every window's distribution sums to 1, answer or not)
  joint-softmax      one softmax over the start positions of ALL windows (and one over the ends);
                     a span's score is p_start * p_end. Its ranking equals raw-logit-sum's
                     (the normalisers are shared by every span of the example)
  joint-softmax-sum  joint softmax, and the probabilities of the same character span found in
                     several overlapping windows are ADDED instead of max-ed
  raw-logit-sum      start_logit + end_logit (Hugging Face ``run_qa`` post-processing)
  cls-relative       start_logit + end_logit - (start_logit[CLS] + end_logit[CLS]) of the span's window
  raw-sum-max-ctx    raw logit sum, counting a start token only in the window where it has the most
                     context on both sides (BERT ``run_squad``'s ``token_is_max_context``)
  decode_spans       the shipped ``shardserve.models.qa_windows.decode_spans`` (checks the library agrees)

plus ``paragraph-alone``: the shipped decoder on the question's own paragraph (the upper bound the
long context should approach). EM/F1 use the official SQuAD normalisation; ``AUC`` is the area
under the ROC curve of the top answer's score as a predictor of an exact match across questions
(how usable the score is as a confidence; raw logit scores are not comparable across questions).

The default data are the 6 articles the default model never trained on (``--holdout-articles 6
--split-seed 0``, as in ``models/default/README.md``).

    python benchmarks/bench_long_context.py                      # default model, 200 questions
    python benchmarks/bench_long_context.py --questions 50 --context-words 1500 --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardserve.models.cpu import cpu_capabilities
from shardserve.models.qa_decoding import decode_spans
from shardserve.models.qa_windows import QAWindow, WindowConfig, encode_qa

logger = logging.getLogger("bench_long_context")

DEFAULT_DATA = "/work/shared/data/squad/squad-v1.1-train-pool.json"
NEG_INF = -math.inf


@dataclass
class LongExample:
    """One question over a long context built around its own paragraph."""

    qid: str
    question: str
    paragraph: str
    context: str
    golds: list[str]


def build_long_examples(
    data: str, *, holdout_articles: int, split_seed: int, n_questions: int, context_words: int, seed: int
) -> list[LongExample]:
    """Sample answerable questions and embed each one's paragraph among its article's neighbours."""
    from shardserve.training.squad_data import load_squad, split_by_article
    from shardserve.training.squad_metrics import gold_answers

    examples = load_squad(data)
    if holdout_articles:
        titles = list(dict.fromkeys(ex.title for ex in examples))
        _, examples = split_by_article(
            examples, eval_fraction=holdout_articles / len(titles), seed=split_seed
        )
    examples = [ex for ex in examples if not ex.is_impossible and ex.answers]
    paragraphs: dict[str, list[str]] = {}
    for ex in examples:
        paras = paragraphs.setdefault(ex.title, [])
        if not paras or paras[-1] != ex.context:
            if ex.context not in paras:
                paras.append(ex.context)
    rng = random.Random(seed)
    chosen = rng.sample(examples, min(n_questions, len(examples)))
    out = []
    for ex in chosen:
        paras = paragraphs[ex.title]
        lo = hi = paras.index(ex.context)
        words = len(ex.context.split())
        while words < context_words and (lo > 0 or hi < len(paras) - 1):
            left = lo > 0 and (hi == len(paras) - 1 or rng.random() < 0.5)
            if left:
                lo -= 1
                words += len(paras[lo].split())
            else:
                hi += 1
                words += len(paras[hi].split())
        out.append(
            LongExample(
                qid=ex.id,
                question=ex.question,
                paragraph=ex.context,
                context="\n\n".join(paras[lo : hi + 1]),
                golds=gold_answers(ex),
            )
        )
    return out


def run_model(
    model: torch.nn.Module,
    tok: object,
    questions: Sequence[str],
    contexts: Sequence[str],
    *,
    window: WindowConfig,
    batch_size: int,
) -> list[tuple[list[QAWindow], list[torch.Tensor], list[torch.Tensor]]]:
    """Per example: its windows and one (start, end) fp32 logit row per window."""
    enc = encode_qa(tok, list(questions), list(contexts), window=window)
    rows: list[torch.Tensor] = []
    with torch.inference_mode():
        for i in range(0, len(enc.windows), batch_size):
            from shardserve.models.qa_windows import pad_windows

            batch = pad_windows(enc.windows[i : i + batch_size], pad_token_id=enc.pad_token_id)
            logits = model(batch.input_ids, batch.attention_mask, batch.token_type_ids).float()  # (b, s, 2)
            rows.extend(logits[j, : int(batch.lengths[j])] for j in range(logits.shape[0]))
    out: list[tuple[list[QAWindow], list[torch.Tensor], list[torch.Tensor]]] = [
        ([], [], []) for _ in questions
    ]
    for w, r in zip(enc.windows, rows, strict=True):
        ws, ss, es = out[w.example_index]
        ws.append(w)
        ss.append(r[:, 0].clone())
        es.append(r[:, 1].clone())
    return out


# ------------------------------------------------------------------ candidate scorings
@dataclass
class SpanTable:
    """All valid spans of one example: (W, L, A) tensors, span (w, s, s + a)."""

    start: torch.Tensor  # (W, L) start logits, -inf beyond each window
    end: torch.Tensor  # (W, L)
    pointable: torch.Tensor  # (W, L) bool: context tokens + CLS
    valid: torch.Tensor  # (W, L, A) bool
    char_start: torch.Tensor  # (W, L)
    char_end: torch.Tensor  # (W, L)
    max_ctx: torch.Tensor  # (W, L) bool: the token has its maximum context in this window
    band: int

    def band_of(self, x: torch.Tensor, fill: float | bool) -> torch.Tensor:
        padded = torch.nn.functional.pad(x, (0, self.band - 1), value=fill)  # (W, L + A - 1)
        return padded.unfold(1, self.band, 1)  # (W, L, A)


def span_table(windows: Sequence[QAWindow], starts, ends, max_answer_length: int) -> SpanTable:
    n, seq = len(windows), max(w.num_tokens for w in windows)
    start = torch.full((n, seq), NEG_INF)
    end = torch.full((n, seq), NEG_INF)
    is_ctx = torch.zeros((n, seq), dtype=torch.bool)
    cs = torch.full((n, seq), -1, dtype=torch.long)
    ce = torch.full((n, seq), -1, dtype=torch.long)
    ctx_score = torch.full((n, seq), -1, dtype=torch.long)
    for i, w in enumerate(windows):
        k = w.num_tokens
        start[i, :k], end[i, :k] = starts[i], ends[i]
        first, last = w.context_token_range
        for j, (s, e) in enumerate(w.offsets.tolist()):
            if s >= 0:
                is_ctx[i, j] = True
                cs[i, j], ce[i, j] = s, e
                ctx_score[i, j] = min(j - first, last - j)
    best_ctx: dict[int, tuple[int, int]] = {}  # char start -> (score, window)
    for i in range(n):
        for j in torch.nonzero(is_ctx[i]).flatten().tolist():
            key, sc = int(cs[i, j]), int(ctx_score[i, j])
            if key not in best_ctx or sc > best_ctx[key][0]:
                best_ctx[key] = (sc, i)
    max_ctx = torch.zeros((n, seq), dtype=torch.bool)
    for i in range(n):
        for j in torch.nonzero(is_ctx[i]).flatten().tolist():
            max_ctx[i, j] = best_ctx[int(cs[i, j])][1] == i
    pointable = is_ctx.clone()
    pointable[:, 0] = True
    band = min(max_answer_length, seq)
    t = SpanTable(start, end, pointable, torch.zeros(0, dtype=torch.bool), cs, ce, max_ctx, band)
    t.valid = is_ctx[:, :, None] & t.band_of(is_ctx, False)
    return t


def _pairs(t: SpanTable, s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """(W, L, A) span values s[w, i] + e[w, i + a], -inf where invalid."""
    return (s[:, :, None] + t.band_of(e, NEG_INF)).masked_fill(~t.valid, NEG_INF)


def _joint_log_softmax(x: torch.Tensor, pointable: torch.Tensor) -> torch.Tensor:
    flat = x.masked_fill(~pointable, NEG_INF).reshape(-1)
    return torch.log_softmax(flat, 0).reshape(x.shape)


def score_window_softmax(t: SpanTable) -> torch.Tensor:
    ls = torch.log_softmax(t.start.masked_fill(~t.pointable, NEG_INF), 1)
    le = torch.log_softmax(t.end.masked_fill(~t.pointable, NEG_INF), 1)
    return _pairs(t, ls, le)


def score_joint_softmax(t: SpanTable) -> torch.Tensor:
    return _pairs(t, _joint_log_softmax(t.start, t.pointable), _joint_log_softmax(t.end, t.pointable))


def score_joint_one_null(t: SpanTable) -> torch.Tensor:
    """Joint softmax over all context tokens plus ONE null position (the min-null window's CLS)."""
    null_w = int(torch.argmin(t.start[:, 0] + t.end[:, 0]))
    mask = t.pointable.clone()
    mask[:, 0] = False
    mask[null_w, 0] = True
    return _pairs(t, _joint_log_softmax(t.start, mask), _joint_log_softmax(t.end, mask))


def score_raw(t: SpanTable) -> torch.Tensor:
    return _pairs(t, t.start, t.end)


def score_cls_relative(t: SpanTable) -> torch.Tensor:
    null = (t.start[:, 0] + t.end[:, 0])[:, None, None]  # (W, 1, 1)
    return _pairs(t, t.start, t.end) - null


def score_raw_max_ctx(t: SpanTable) -> torch.Tensor:
    return _pairs(t, t.start.masked_fill(~t.max_ctx, NEG_INF), t.end)


def best_span(t: SpanTable, scores: torch.Tensor, *, aggregate: str = "max") -> tuple[int, int, float]:
    """Best character span; ``aggregate="sum"`` adds the probabilities of duplicates (log scores)."""
    if aggregate == "max":
        idx = int(scores.reshape(-1).argmax())
        w, rem = divmod(idx, scores.shape[1] * scores.shape[2])
        s, a = divmod(rem, scores.shape[2])
        return int(t.char_start[w, s]), int(t.char_end[w, s + a]), float(scores[w, s, a])
    ok = torch.isfinite(scores)  # (W, L, A)
    w_idx, s_idx, a_idx = torch.nonzero(ok, as_tuple=True)
    keys = t.char_start[w_idx, s_idx] * (1 << 32) + t.char_end[w_idx, s_idx + a_idx]  # (n,)
    vals = scores[ok]  # (n,)
    uniq, inv = torch.unique(keys, return_inverse=True)
    top = torch.full((len(uniq),), NEG_INF).scatter_reduce(0, inv, vals, reduce="amax")
    total = top + torch.log(torch.zeros(len(uniq)).scatter_add(0, inv, torch.exp(vals - top[inv])))
    best = int(total.argmax())
    key = int(uniq[best])
    return key >> 32, key & ((1 << 32) - 1), float(total[best])


def auc(scores: Sequence[float], labels: Sequence[int]) -> float:
    """Area under the ROC curve (Mann-Whitney), ties counted half."""
    pos = [s for s, y in zip(scores, labels, strict=True) if y]
    neg = [s for s, y in zip(scores, labels, strict=True) if not y]
    if not pos or not neg:
        return float("nan")
    wins = sum((p > q) + 0.5 * (p == q) for p in pos for q in neg)
    return wins / (len(pos) * len(neg))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--data", default=DEFAULT_DATA)
    p.add_argument("--holdout-articles", type=int, default=6, help="0: every article of --data")
    p.add_argument("--split-seed", type=int, default=0)
    p.add_argument("--questions", type=int, default=200)
    p.add_argument("--context-words", type=int, default=2500, help="words per long context (about)")
    p.add_argument("--max-seq-len", type=int, default=384, help="the server's default window")
    p.add_argument("--doc-stride", type=int, default=128)
    p.add_argument("--max-answer-length", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--dtype", default="auto", help="compute dtype: auto (the server's default), float32, bfloat16"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", default=None, help="save/load the logits here (a .pt file)")
    p.add_argument("--json", default=None, help="also write the table as JSON here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)

    from shardserve.models.build import build_model
    from shardserve.models.registry import resolve_model
    from shardserve.partitioner.precision import resolve_dtype
    from shardserve.training.squad_metrics import compute_exact, compute_f1

    exs = build_long_examples(
        args.data,
        holdout_articles=args.holdout_articles,
        split_seed=args.split_seed,
        n_questions=args.questions,
        context_words=args.context_words,
        seed=args.seed,
    )
    window = WindowConfig(max_seq_len=args.max_seq_len, doc_stride=args.doc_stride)
    source = resolve_model(args.model)
    tok = source.tokenizer()
    cache = Path(args.cache) if args.cache else None
    t0 = time.perf_counter()
    if cache is not None and cache.exists():
        long_out, para_out = torch.load(cache, weights_only=False)  # our own file, written below
        logger.info("logits loaded from %s", cache)
    else:
        model = build_model(source, dtype=resolve_dtype(args.dtype, "cpu").dtype)
        qs = [e.question for e in exs]
        para_out = run_model(
            model, tok, qs, [e.paragraph for e in exs], window=window, batch_size=args.batch_size
        )
        long_out = []
        for i in range(0, len(exs), 10):
            long_out += run_model(
                model,
                tok,
                qs[i : i + 10],
                [e.context for e in exs[i : i + 10]],
                window=window,
                batch_size=args.batch_size,
            )
            logger.info("%d/%d questions (%.0f s)", len(long_out), len(exs), time.perf_counter() - t0)
        if cache is not None:
            torch.save((long_out, para_out), cache)
    n_windows = [len(w) for w, _, _ in long_out]
    n_words = [len(e.context.split()) for e in exs]

    scorers: dict[str, tuple[Callable[[SpanTable], torch.Tensor], str, bool]] = {
        # name: (scores, duplicate aggregation, score is a log-probability)
        "window-softmax (before)": (score_window_softmax, "max", True),
        "joint-softmax": (score_joint_softmax, "max", True),
        "joint-softmax, one null": (score_joint_one_null, "max", True),
        "joint-softmax-sum": (score_joint_softmax, "sum", True),
        "raw-logit-sum": (score_raw, "max", False),
        "cls-relative": (score_cls_relative, "max", False),
        "raw-sum-max-ctx": (score_raw_max_ctx, "max", False),
    }
    results: dict[str, dict[str, list[float]]] = {
        name: {"em": [], "f1": [], "score": []}
        for name in [*scorers, "decode_spans (shipped)", "paragraph-alone"]
    }

    def record(name: str, pred: str, score: float, golds: list[str]) -> None:
        results[name]["em"].append(max(compute_exact(g, pred) for g in golds))
        results[name]["f1"].append(max(compute_f1(g, pred) for g in golds))
        results[name]["score"].append(score)

    for ex, (ws, ss, es), (pw, ps, pe) in zip(exs, long_out, para_out, strict=True):
        t = span_table(ws, ss, es, args.max_answer_length)
        for name, (fn, agg, _) in scorers.items():
            cs, ce, sc = best_span(t, fn(t), aggregate=agg)
            record(name, ex.context[cs:ce], sc, ex.golds)
        pred = decode_spans(ws, ss, es, ex.context, max_answer_length=args.max_answer_length)
        record("decode_spans (shipped)", pred.answers[0].text, pred.answers[0].score, ex.golds)
        pred = decode_spans(pw, ps, pe, ex.paragraph, max_answer_length=args.max_answer_length)
        record("paragraph-alone", pred.answers[0].text, pred.answers[0].score, ex.golds)

    n = len(exs)
    table = []
    for name, r in results.items():
        table.append(
            {
                "scoring": name,
                "EM": 100 * sum(r["em"]) / n,
                "F1": 100 * sum(r["f1"]) / n,
                "AUC": auc(r["score"], r["em"]),
            }
        )
    cpu = cpu_capabilities().model
    print(
        f"\n{n} questions, long contexts of {min(n_words)}-{max(n_words)} words "
        f"(mean {sum(n_words) / n:.0f}), {min(n_windows)}-{max(n_windows)} windows (mean "
        f"{sum(n_windows) / n:.1f}) of {args.max_seq_len} tokens, stride {args.doc_stride}; model "
        f"{args.model} ({args.dtype}); {os.cpu_count()} x {cpu}, torch {torch.__version__}; "
        f"{time.perf_counter() - t0:.0f} s\n"
    )
    print("| scoring | EM | F1 | AUC (score -> EM) |\n|---|---:|---:|---:|")
    for row in table:
        print(f"| {row['scoring']} | {row['EM']:.1f} | {row['F1']:.1f} | {row['AUC']:.3f} |")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "mean_windows": sum(n_windows) / n, "table": table}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
