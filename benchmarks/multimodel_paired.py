"""The paired protocol of ``bench_multimodel.py --paired``: two placements measured in alternating
pairs on the same seeded trace, so the VM's drift (1-11 attainment points within an hour, issue 28)
shows as spread between pairs instead of as a difference between policies.

Pure parts, no server: the run order (A B, B A, A B, ...: each pair's two runs adjacent, the order
flipped every pair so a steady drift favours neither), the choice of rates from the simulator's
predictions (the widest predicted gap, and one with none), the per-pair differences and their
spread, the JSON entry and the table, and the plot of measured against predicted.

    python -m pytest tests/benchmarks/test_bench_helpers.py -q -k paired
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from multimodel_report import json_header

from shardserve.partitioner.placement.latency import MeasuredLatency


def run_order(pairs: int) -> list[int]:
    """Which of the two policies (0: a, 1: b) each of the ``2 * pairs`` runs measures: 0 1 1 0 0 1 ..."""
    return [side if k % 2 == 0 else 1 - side for k in range(pairs) for side in (0, 1)]


def choose_rates(
    predict: Callable[[float], tuple[float, float]], candidates: Sequence[float], *, flat_points: float = 1.0
) -> tuple[float, float]:
    """(the rate whose predicted gap b - a is widest, a rate where it predicts none): ``predict(rate)``
    gives (attainment of a, of b). "None": the lowest rate whose gap is under ``flat_points`` points,
    else the one with the smallest gap."""
    if len(candidates) < 2:
        raise ValueError(f"two rates are needed to choose from, got {list(candidates)}: lower --min-requests")
    gaps = {r: (lambda ab: ab[1] - ab[0])(predict(r)) for r in candidates}
    widest = max(candidates, key=lambda r: (gaps[r], -r))
    flat = [r for r in sorted(candidates) if r != widest and abs(gaps[r]) * 100 < flat_points]
    none = flat[0] if flat else min((r for r in candidates if r != widest), key=lambda r: abs(gaps[r]))
    return widest, none


def pair_differences(att_a: Sequence[float], att_b: Sequence[float]) -> list[float]:
    """Per pair, b's attainment minus a's, in points (run k of a with run k of b)."""
    return [round(100 * (b - a), 2) for a, b in zip(att_a, att_b, strict=True)]


def paired_entry(
    *,
    slo_scale: float,
    cv: float,
    rate: float,
    a: str,
    b: str,
    runs: Sequence[tuple[int, dict[str, Any]]],
) -> dict[str, Any]:
    """The JSON entry of one point from its runs ((side, row of bench_multimodel's ``record``), in the
    order measured): per-run attainment and prediction of each side as fractions, the per-pair
    differences and their spread."""
    side = {0: [r for s, r in runs if s == 0], 1: [r for s, r in runs if s == 1]}
    att_a, att_b = [r["measured"] for r in side[0]], [r["measured"] for r in side[1]]
    diffs = pair_differences(att_a, att_b)
    return {
        "slo_scale": slo_scale,
        "cv": cv,
        "rate": rate,
        "a": a,
        "b": b,
        "att_a": att_a,
        "att_b": att_b,
        "pred_a": [r["predicted"] for r in side[0]],
        "pred_b": [r["predicted"] for r in side[1]],
        "requests_a": [r["requests"] for r in side[0]],
        "requests_b": [r["requests"] for r in side[1]],
        "placement_a": side[0][0]["placement"] if side[0] else None,
        "placement_b": side[1][0]["placement"] if side[1] else None,
        "diff_points": diffs,
        "diff_mean_points": round(statistics.fmean(diffs), 2) if diffs else None,
        "diff_spread_points": round(max(diffs) - min(diffs), 2) if diffs else None,
    }


def prediction_errors(entry: dict[str, Any]) -> dict[str, float]:
    """Points between each side's mean prediction and its mean measurement."""
    out = {}
    for s in ("a", "b"):
        att, pred = entry[f"att_{s}"], entry[f"pred_{s}"]
        out[entry[s]] = round(100 * (statistics.fmean(pred) - statistics.fmean(att)), 2) if att else 0.0
    return out


def paired_table(entries: Sequence[dict[str, Any]]) -> str:
    """One line per point: the pairs' differences, their mean and spread, and the predictions."""
    lines = [
        f"{'slo':>4} {'cv':>3} {'rate':>6}  {'b - a per pair (points)':<28} {'mean':>6} {'spread':>6}  "
        f"{'a measured / predicted':<24} {'b measured / predicted':<24}"
    ]
    for e in entries:
        diffs = " ".join(f"{d:+.1f}" for d in e["diff_points"])

        def side(s: str, e: dict[str, Any] = e) -> str:
            att, pred = e[f"att_{s}"], e[f"pred_{s}"]
            return f"{e[s]} {statistics.fmean(att):.3f} / {statistics.fmean(pred):.3f}"

        lines.append(
            f"{e['slo_scale']:>4g} {e['cv']:>3g} {e['rate']:>6.1f}  {diffs:<28} {e['diff_mean_points']:>+6.1f} "
            f"{e['diff_spread_points']:>6.1f}  {side('a'):<24} {side('b'):<24}"
        )
    return "\n".join(lines)


def plot_paired(entries: Sequence[dict[str, Any]], path: Path) -> None:
    """Measured (each run a dot, the mean a line) against predicted (dashed) attainment by rate, one
    panel per SLO scale, one colour per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slos = sorted({e["slo_scale"] for e in entries})
    fig, axes = plt.subplots(1, len(slos), figsize=(5.5 * len(slos), 4.2), squeeze=False)
    for ax, slo in zip(axes[0], slos, strict=True):
        mine = sorted((e for e in entries if e["slo_scale"] == slo), key=lambda e: e["rate"])
        for k, s in enumerate(("a", "b")):
            name = mine[0][s]
            rates = [e["rate"] for e in mine]
            for e in mine:
                ax.plot([e["rate"]] * len(e[f"att_{s}"]), e[f"att_{s}"], "o", color=f"C{k}", alpha=0.5, ms=4)
            ax.plot(
                rates,
                [statistics.fmean(e[f"att_{s}"]) for e in mine],
                "-",
                color=f"C{k}",
                label=f"{name} measured",
            )
            ax.plot(
                rates,
                [statistics.fmean(e[f"pred_{s}"]) for e in mine],
                "--",
                color=f"C{k}",
                label=f"{name} predicted",
            )
        ax.set(
            title=f"SLO {slo:g}x, CV {mine[0]['cv']:g}", xlabel="total rate (req/s)", ylabel="SLO attainment"
        )
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("paired runs: measured (dots: runs, line: mean)\nvs simulated (dashed)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


Measure = Callable[[str, float, float, float, int, float], dict[str, Any]]  # policy, rate, cv, slo, seed, s
Predict = Callable[[str, float, float, float, int], float]  # policy, rate, cv, slo, seed -> attainment
Count = Callable[[float, int, float], int]  # rate, seed, seconds -> requests in that trace


def run_length(
    rate: float, seed: int, *, min_requests: int, max_run_s: float, count: Count | None = None
) -> float:
    """Seconds a run at ``rate`` lasts: ``min_requests`` at the mean rate (20 s at least), grown by
    10 % steps while the seeded trace (``count``) holds fewer (a bursty draw can fall short), never
    past ``max_run_s``."""
    duration = min(max_run_s, max(20.0, min_requests / rate))
    while count is not None and duration < max_run_s and count(rate, seed, duration) < min_requests:
        duration = min(max_run_s, duration * 1.1)
    return duration


def run_paired(
    args: Any, *, measure: Measure, predict: Predict, capacity: float, count: Count | None = None
) -> list[dict[str, Any]]:
    """Every paired point: for each SLO scale, the rate of the widest predicted gap between
    ``args.paired_policies`` and one of none (or ``args.paired_rates``), each measured in
    ``args.pairs`` alternating pairs on one seeded trace of at least ``args.min_requests`` requests
    (``run_length``; ``count`` draws the trace to check)."""
    a, b = args.paired_policies
    entries = []
    for k, slo in enumerate(args.paired_slos):
        seed = args.seed + k
        rates = args.paired_rates
        if rates is None:
            candidates = [round(f * capacity, 1) for f in (0.05, 0.1, 0.15, 0.2, 0.3, 0.45, 0.6)]
            candidates = [r for r in candidates if args.min_requests / r <= args.max_run_s]
            rates = list(
                choose_rates(
                    lambda r, slo=slo, seed=seed: (
                        predict(a, r, args.cv, slo, seed),
                        predict(b, r, args.cv, slo, seed),
                    ),
                    candidates,
                )
            )
        for rate in rates:
            duration_s = run_length(
                rate, seed, min_requests=args.min_requests, max_run_s=args.max_run_s, count=count
            )
            runs = []
            for side in run_order(args.pairs):
                runs.append((side, measure((a, b)[side], rate, args.cv, slo, seed, duration_s)))
            entries.append(paired_entry(slo_scale=slo, cv=args.cv, rate=rate, a=a, b=b, runs=runs))
            print(paired_table(entries[-1:]), flush=True)
    return entries


def report_paired(
    entries: list[dict[str, Any]],
    args: Any,
    info: dict[str, Any],
    *,
    single: float,
    memory: int,
    measured: MeasuredLatency,
) -> int:
    """The paired points' table, prediction errors, JSON (``"paired"``) and plot."""
    print(f"\n{info['cpu']}, dtype {args.dtype}; single-request latency {1e3 * single:.1f} ms; paired runs")
    print(paired_table(entries))
    errors = [prediction_errors(e) for e in entries]
    print("prediction - measurement (points): " + json.dumps(errors))
    if args.json is not None:
        out = {
            **json_header(args, info, single=single, memory=memory, measured=measured),
            "pairs": args.pairs,
            "min_requests": args.min_requests,
            "paired": entries,
        }
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    if args.plots is not None:
        plot_paired(entries, args.plots / "multimodel-paired.png")
    return 0
