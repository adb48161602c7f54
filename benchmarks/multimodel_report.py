"""What ``bench_multimodel.py``'s sweep prints and draws: the table of measured against predicted
attainment per point, the highest rate each policy holds 99 % (and 90 %) at, the JSON, and the
plot (attainment vs rate, vs CV, vs SLO scale; measured solid, predicted dashed).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from shardserve.partitioner.placement.latency import MeasuredLatency
from shardserve.partitioner.placement.layout import MIB

POLICIES = ("dedicated", "multiplexed", "auto")


def max_rate(rows: list[dict[str, Any]], policy: str, *, threshold: float = 0.99) -> float | None:
    rates = [
        r["rate"]
        for r in rows
        if r["policy"] == policy and r["sweep"] == "rate" and r["measured"] >= threshold
    ]
    return max(rates) if rates else None


def report(
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    info: dict[str, Any],
    *,
    single: float,
    overhead: float,
    memory: int,
    measured: MeasuredLatency,
) -> int:
    print(
        f"\n{info['cpu']}, dtype {args.dtype}; {args.models} models, 2 devices of {memory / MIB:.0f} MiB; "
        f"single-request latency {1e3 * single:.1f} ms; {args.duration_s:g} s per point"
    )
    header = (
        f"{'policy':<11} {'sweep':<5} {'rate':>6} {'cv':>4} {'slo':>4} {'measured':>9} {'predicted':>9} "
        f"{'diff':>6} {'bound':>6}  placement"
    )
    print(header + "\n" + "-" * len(header))
    for r in rows:
        print(
            f"{r['policy']:<11} {r['sweep']:<5} {r['rate']:>6.1f} {r['cv']:>4g} {r['slo_scale']:>4g} "
            f"{r['measured']:>9.3f} {r['predicted']:>9.3f} {100 * (r['predicted'] - r['measured']):>+6.1f} "
            f"{r.get('bound', math.nan):>6.3f}  {r['placement']}"
        )
    worst = max((abs(r["predicted"] - r["measured"]) for r in rows), default=0.0)
    summary_ = {f"{p}_max_rate": max_rate(rows, p) for p in POLICIES}
    summary_.update({f"{p}_max_rate_90": max_rate(rows, p, threshold=0.9) for p in POLICIES})
    summary_["worst_prediction_error_points"] = round(100 * worst, 2)
    print("\n" + json.dumps(summary_))
    if args.json is not None:
        out = {
            **summary_,
            **json_header(args, info, single=single, memory=memory, measured=measured),
            "overhead_ms": round(1e3 * overhead, 3),
            "duration_s": args.duration_s,
            "max_batch_size": args.max_batch_size,
            "max_inflight": args.max_inflight,
            "admission_margin": args.admission_margin,
            "cv": args.cv,
            "slo_scale": args.slo_scale,
            "points": rows,
        }
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    if args.plots is not None:
        plot(rows, args, args.plots / "multimodel.png")
    return 0


def json_header(
    args: Any, info: dict[str, Any], *, single: float, memory: int, measured: MeasuredLatency
) -> dict[str, Any]:
    """The keys every ``--json`` of bench_multimodel starts with: machine, models, memory, latency, profile."""
    return {
        "machine": info,
        "models": args.models,
        "device_memory_bytes": memory,
        "single_latency_ms": round(1e3 * single, 3),
        "profile": measured.to_dict(),
    }


def plot(rows: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []  # (x key, x label, title, {policy: its rows}) of each curve with at least 2 points
    for sweep, key, label, title in (
        ("rate", "rate", "total rate (req/s)", f"CV {args.cv:g}, SLO {args.slo_scale:g}x"),
        ("cv", "cv", "CV of arrivals", f"{args.fixed_rate:g} req/s, SLO {args.slo_scale:g}x"),
        ("slo", "slo_scale", "SLO scale (x single latency)", f"{args.fixed_rate:g} req/s, CV {args.cv:g}"),
    ):
        curves = {
            policy: sorted(
                (
                    r
                    for r in rows
                    if r["policy"] == policy and (r["sweep"] == sweep or _on_curve(r, sweep, args))
                ),
                key=lambda r, key=key: r[key],
            )
            for policy in POLICIES
        }
        if max(map(len, curves.values())) >= 2:
            panels.append((key, label, title, curves))
    fig, axes = plt.subplots(1, len(panels), figsize=(max(7.5, 5 * len(panels)), 4.2), squeeze=False)
    for ax, (key, label, title, curves) in zip(axes[0], panels, strict=True):
        for k, (policy, mine) in enumerate(curves.items()):
            xs = [r[key] for r in mine]
            ax.plot(xs, [r["measured"] for r in mine], "-o", color=f"C{k}", label=f"{policy} measured")
            ax.plot(
                xs,
                [r["predicted"] for r in mine],
                "--",
                color=f"C{k}",
                alpha=0.7,
                label=f"{policy} predicted",
            )
        ax.axhline(0.99, color="grey", lw=0.8, ls=":")
        ax.set(title=title, xlabel=label, ylabel="SLO attainment", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes = axes[0]
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{args.models} models on 2 CPU devices: measured (solid) vs simulated (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _on_curve(r: dict[str, Any], sweep: str, args: argparse.Namespace) -> bool:
    """The rate sweep's point at the fixed rate also lies on the CV and SLO curves."""
    return r["sweep"] == "rate" and r["rate"] == args.fixed_rate and sweep in ("cv", "slo")
