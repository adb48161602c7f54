"""Load-test report: from the request log and the scraped metrics to CSV, JSON, PNG plots and one
Markdown/HTML page.

Inputs in a run folder (written by ``loadtest/runner.py``): ``requests.csv`` (one row per request,
from the locustfile), ``metrics.csv`` (``/metrics`` scrapes) and ``run_config.json``. Outputs::

    timeseries.csv       per time bin: throughput, 429 rate, p50/p95/p99, SLO attainment,
                         queue depth and replicas (last scrape in the bin)
    summary.json         whole-run numbers (requests by outcome, percentiles, attainment, replicas)
    throughput.png latency.png shed_rate.png queue_depth.png replicas.png slo_attainment.png
    overview.png         the time series stacked on one time axis
    report.md / report.html   the page that ties them together

Rebuild a report without re-running: ``shardserve loadtest --report-only DIR``.
SLO attainment counts every request sent: shed (429) and failed requests miss the SLO
(as AlpaServe counts rejected requests). Tests: ``tests/loadtest/test_report.py``.
"""

from __future__ import annotations

import csv
import html
import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from shardserve.loadtest.data import read_json

logger = logging.getLogger(__name__)

PLOTS = ("throughput", "latency", "shed_rate", "queue_depth", "replicas", "slo_attainment", "overview")
MAX_BINS = 100_000  # time-series bins in one report (a tiny --bin would exhaust memory)
SLO_SCALES = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0)


@dataclass
class RequestLog:
    """Columns of ``requests.csv`` as arrays; times in epoch seconds, latency in ms."""

    start: np.ndarray
    latency_ms: np.ndarray
    status: np.ndarray
    outcome: np.ndarray  # "ok" | "shed" | "fail"
    lag_ms: np.ndarray
    errors: list[str]

    @property
    def end(self) -> np.ndarray:
        return self.start + self.latency_ms / 1000.0

    def __len__(self) -> int:
        return len(self.start)


def read_requests(path: str | Path) -> RequestLog:
    start, lat, status, outcome, lag, errors = [], [], [], [], [], []
    with open(path, newline="", encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            start.append(float(row["start"]))
            lat.append(float(row["latency_ms"]))
            status.append(int(row["status"]))
            outcome.append(row["outcome"])
            lag.append(float(row.get("lag_ms") or 0.0))
            if row.get("error"):
                errors.append(row["error"])
    return RequestLog(
        np.asarray(start, dtype=float),
        np.asarray(lat, dtype=float),
        np.asarray(status, dtype=int),
        np.asarray(outcome, dtype=object),
        np.asarray(lag, dtype=float),
        errors,
    )


def read_metrics(path: str | Path) -> dict[str, np.ndarray]:
    """``metrics.csv`` as {column: array}; a missing file gives empty series."""
    p = Path(path)
    if not p.is_file():
        return {"time": np.zeros(0), "ok": np.zeros(0)}
    with open(p, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
        fields = list(rows[0]) if rows else ["time", "ok"]
    out = {}
    for name in fields:
        out[name] = np.asarray([float(r[name]) if r[name] not in ("", None) else math.nan for r in rows])
    return out


def percentile(values: np.ndarray, q: float) -> float:
    """q-th percentile (0..100) or NaN for an empty array."""
    return float(np.percentile(values, q)) if len(values) else math.nan


@dataclass
class WindowStats:
    requests: int
    ok: int
    shed: int
    failed: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    slo_attainment: float


def window_stats(log: RequestLog, *, t_from: float, t_to: float, slo_ms: float) -> WindowStats:
    """Stats of the requests that COMPLETED in [t_from, t_to) (epoch seconds)."""
    sel = (log.end >= t_from) & (log.end < t_to)
    outcome = log.outcome[sel]
    ok_lat = log.latency_ms[sel][outcome == "ok"]
    n = int(sel.sum())
    met = int((ok_lat <= slo_ms).sum())
    return WindowStats(
        requests=n,
        ok=int((outcome == "ok").sum()),
        shed=int((outcome == "shed").sum()),
        failed=int((outcome == "fail").sum()),
        p50_ms=percentile(ok_lat, 50),
        p95_ms=percentile(ok_lat, 95),
        p99_ms=percentile(ok_lat, 99),
        slo_attainment=met / n if n else math.nan,
    )


def build_timeseries(
    log: RequestLog, metrics: dict[str, np.ndarray], *, t0: float, t_end: float, bin_s: float, slo_ms: float
) -> list[dict[str, float]]:
    """One row per ``bin_s`` bin from t0 to t_end (seconds since t0 in column ``t``)."""
    if not bin_s > 0:
        raise ValueError(f"bin_s={bin_s} must be > 0")
    n_bins = max(1, math.ceil((t_end - t0) / bin_s))
    metric_names = [k for k in metrics if k not in ("time", "ok")]
    rows = []
    for b in range(n_bins):
        lo, hi = t0 + b * bin_s, t0 + (b + 1) * bin_s
        w = window_stats(log, t_from=lo, t_to=hi, slo_ms=slo_ms)
        row = {
            "t": round(b * bin_s, 3),
            "requests": w.requests,
            "throughput_rps": w.ok / bin_s,
            "shed_rps": w.shed / bin_s,
            "fail_rps": w.failed / bin_s,
            "shed_rate": w.shed / w.requests if w.requests else math.nan,
            "p50_ms": w.p50_ms,
            "p95_ms": w.p95_ms,
            "p99_ms": w.p99_ms,
            "slo_attainment": w.slo_attainment,
        }
        in_bin = (metrics["time"] >= lo) & (metrics["time"] < hi) if len(metrics["time"]) else None
        for name in metric_names:
            vals = metrics[name][in_bin] if in_bin is not None else np.zeros(0)
            vals = vals[~np.isnan(vals)]
            row[name] = float(vals[-1]) if len(vals) else math.nan
        rows.append(row)
    return rows


def _finite(values: np.ndarray) -> np.ndarray:
    return values[~np.isnan(values)] if len(values) else values


def summarize(
    log: RequestLog, metrics: dict[str, np.ndarray], *, t0: float, t_end: float, slo_ms: float
) -> dict[str, object]:
    """Whole-run numbers for ``summary.json``."""
    w = window_stats(log, t_from=-math.inf, t_to=math.inf, slo_ms=slo_ms)
    duration = max(t_end - t0, 1e-9)
    ok_lat = log.latency_ms[log.outcome == "ok"]
    starts = np.sort(log.start)
    gaps = np.diff(starts)
    arrival_cv = float(gaps.std(ddof=1) / gaps.mean()) if len(gaps) > 1 and gaps.mean() > 0 else math.nan
    summary: dict[str, object] = {
        **asdict(w),
        "duration_s": round(duration, 3),
        "throughput_rps": w.ok / duration,
        "mean_ms": float(ok_lat.mean()) if len(ok_lat) else math.nan,
        "max_ms": float(ok_lat.max()) if len(ok_lat) else math.nan,
        "shed_rate": w.shed / w.requests if w.requests else math.nan,
        "slo_ms": slo_ms,
        "slo_attainment_by_scale": {
            str(s): float((ok_lat <= s * slo_ms).sum() / w.requests) if w.requests else math.nan
            for s in SLO_SCALES
        },
        "arrival_cv": arrival_cv,
        "late_arrivals": int((log.lag_ms > 0).sum()),
        "first_errors": sorted(set(log.errors))[:5],
        "scrapes": len(metrics["time"]),
        "scrapes_failed": int((metrics["ok"] == 0).sum()) if len(metrics["ok"]) else 0,
    }
    for name in (k for k in metrics if k not in ("time", "ok")):
        vals = _finite(metrics[name])
        summary[f"{name}_min"] = float(vals.min()) if len(vals) else math.nan
        summary[f"{name}_max"] = float(vals.max()) if len(vals) else math.nan
        summary[f"{name}_last"] = float(vals[-1]) if len(vals) else math.nan
    return summary


def _json_safe(obj: object) -> object:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


def _plots(
    out: Path,
    rows: list[dict[str, float]],
    metrics: dict[str, np.ndarray],
    *,
    t0: float,
    slo_ms: float,
    bin_s: float,
    summary: dict[str, object],
    title: str,
    markers: list[float],
) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    t = np.asarray([r["t"] for r in rows], dtype=float) + bin_s / 2  # plot each bin at its middle

    def col(name: str) -> np.ndarray:
        return np.asarray([r.get(name, math.nan) for r in rows], dtype=float)

    mt = metrics["time"] - t0 if len(metrics["time"]) else np.zeros(0)

    def draw_throughput(ax) -> None:
        ax.plot(t, col("throughput_rps"), "-o", ms=3, label="answered (200)")
        ax.plot(t, col("shed_rps"), "-s", ms=3, color="tab:orange", label="shed (429)")
        ax.plot(t, col("fail_rps"), "-x", ms=4, color="tab:red", label="failed")
        ax.set_ylabel("requests / s")
        ax.set_title("Throughput")

    def draw_latency(ax) -> None:
        for q, style in (("p50", "-o"), ("p95", "-s"), ("p99", "-^")):
            ax.plot(t, col(f"{q}_ms"), style, ms=3, label=q)
        ax.axhline(slo_ms, color="k", ls="--", lw=1, label=f"SLO {slo_ms:g} ms")
        worst = col("p99_ms")
        top = max(slo_ms, float(np.nanmax(worst)) if np.isfinite(worst).any() else 0.0)
        ax.set_ylim(0, top * 1.3)  # head room for the legend above the SLO line
        ax.set_ylabel("latency (ms)")
        ax.set_title("Latency of answered requests")

    def draw_shed(ax) -> None:
        ax.plot(t, 100 * col("shed_rate"), "-o", ms=3, color="tab:orange", label="429 share")
        ax.set_ylabel("429 (% of requests)")
        shed = 100 * col("shed_rate")
        top = float(np.nanmax(shed)) if np.isfinite(shed).any() else 0.0
        ax.set_ylim(0, max(5.0, top * 1.15))
        ax.set_title("Load shedding (429 rate)")

    def draw_metric(ax, name: str, label: str, color: str) -> None:
        vals = metrics.get(name, np.zeros(0))
        if len(vals) and np.isfinite(vals).any():
            ax.step(mt, vals, where="post", color=color, label=label)
            ax.set_ylim(bottom=0, top=max(1.0, float(np.nanmax(vals))) * 1.15)
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        else:
            ax.text(
                0.5,
                0.5,
                f"{label}: not exported by /metrics",
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="gray",
            )
        ax.set_ylabel(label)
        ax.set_title(label.capitalize() + " (scraped from /metrics)")

    def draw_attainment(ax) -> None:
        ax.plot(t, 100 * col("slo_attainment"), "-o", ms=3, color="tab:green", label="within SLO")
        ax.set_ylim(0, 105)
        ax.set_ylabel("SLO attainment (%)")
        ax.set_title(f"Requests answered within {slo_ms:g} ms")

    def finish(ax, legend: bool = True) -> None:
        for i, m in enumerate(markers):
            ax.axvline(m, color="gray", ls=":", lw=1, label="load step" if i == 0 else None)
        ax.grid(alpha=0.3)
        ax.set_xlabel("time since start (s)")
        if legend and ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8, framealpha=0.8)

    panels = {
        "throughput": draw_throughput,
        "latency": draw_latency,
        "shed_rate": draw_shed,
        "queue_depth": lambda ax: draw_metric(ax, "queue_depth", "queue depth", "tab:purple"),
        "replicas": lambda ax: draw_metric(ax, "replicas", "ready replicas", "tab:brown"),
    }
    written = []
    for name, draw in panels.items():
        fig, ax = plt.subplots(figsize=(9, 3.4), dpi=110)
        draw(ax)
        finish(ax)
        fig.suptitle(title, fontsize=9, x=0.01, ha="left")
        fig.tight_layout()
        fig.savefig(out / f"{name}.png")
        plt.close(fig)
        written.append(f"{name}.png")

    # SLO attainment: over time, and over SLO scale (AlpaServe's figure)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.6), dpi=110, gridspec_kw={"width_ratios": [3, 2]})
    draw_attainment(a1)
    finish(a1)
    by_scale = summary["slo_attainment_by_scale"]
    scales = [float(s) for s in by_scale]
    a2.plot(
        scales, [100 * (v if v is not None else math.nan) for v in by_scale.values()], "-o", color="tab:green"
    )
    a2.axvline(1.0, color="k", ls="--", lw=1)
    a2.set_xlabel(f"SLO scale (× {slo_ms:g} ms)")
    a2.set_ylabel("SLO attainment (%)")
    a2.set_ylim(0, 105)
    a2.set_title("Whole run: attainment vs SLO")
    a2.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9, x=0.01, ha="left")
    fig.tight_layout()
    fig.savefig(out / "slo_attainment.png")
    plt.close(fig)
    written.append("slo_attainment.png")

    order = ["throughput", "latency", "shed_rate", "queue_depth", "replicas"]
    fig, axes = plt.subplots(len(order) + 1, 1, figsize=(9, 2.3 * (len(order) + 1)), dpi=100, sharex=True)
    for ax, name in zip(axes, order, strict=False):
        panels[name](ax)
        finish(ax)
    draw_attainment(axes[-1])
    finish(axes[-1])
    for ax in axes[:-1]:
        ax.set_xlabel("")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "overview.png")
    plt.close(fig)
    written.append("overview.png")
    return written


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return "n/a" if not math.isfinite(v) else f"{v:.4g}"
    return str(v)


def _write_pages(out: Path, summary: dict[str, object], run: dict[str, object], plots: list[str]) -> None:
    keys = [
        "requests", "ok", "shed", "failed", "shed_rate", "throughput_rps", "p50_ms", "p95_ms", "p99_ms",
        "mean_ms", "max_ms", "slo_ms", "slo_attainment", "arrival_cv", "late_arrivals",
        "queue_depth_max", "replicas_min", "replicas_max", "replicas_last", "scrapes", "scrapes_failed",
    ]  # fmt: skip
    rows = [(k, _fmt(summary.get(k, math.nan))) for k in keys if k in summary]
    sc = run.get("scenario", {})
    title = f"shardserve load test: {sc.get('name', '?')} against {run.get('host', '?')}"
    cmd = run.get("command", "")
    md = [f"# {title}", "", f"Reproduce: `{cmd}`", "", f"Scenario: `{json.dumps(sc)}`", "",
          "| metric | value |", "|---|---|"]  # fmt: skip
    md += [f"| {k} | {v} |" for k, v in rows]
    if summary.get("first_errors"):
        md += ["", "First errors:", ""] + [f"- `{e}`" for e in summary["first_errors"]]
    md += ["", "Files: `requests.csv` (one row per request), `metrics.csv` (scrapes), "
           "`timeseries.csv` (per bin), `summary.json`.", ""]  # fmt: skip
    for p in plots:
        md += [f"![{p[:-4]}]({p})", ""]
    (out / "report.md").write_text("\n".join(md), encoding="utf-8")

    table = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in rows)
    imgs = "".join(f'<p><img src="{p}" alt="{p[:-4]}" style="max-width:100%"></p>' for p in plots)
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
        f"<body style='font-family:sans-serif;max-width:1100px;margin:auto'><h1>{html.escape(title)}</h1>"
        f"<p>Reproduce: <code>{html.escape(str(cmd))}</code></p>"
        f"<table border='1' cellpadding='4' style='border-collapse:collapse'>{table}</table>{imgs}</body></html>"
    )
    (out / "report.html").write_text(page, encoding="utf-8")


class ReportError(ValueError):
    """A run folder the report cannot be built from: missing, not a run, or corrupt inputs."""


def _read_run_config(out: Path) -> dict:
    if not out.is_dir():
        raise ReportError(f"{out}: no such folder")
    path = out / "run_config.json"
    if not path.is_file():
        raise ReportError(f"{out} is not a load-test run folder (no run_config.json)")
    try:
        run = read_json(path)
    except ValueError as exc:
        raise ReportError(str(exc)) from None
    if not isinstance(run, dict):
        raise ReportError(f"{path}: not a run config (a JSON object is expected)")
    return run


def build_report(run_dir: str | Path, *, slo_ms: float | None = None, bin_s: float | None = None) -> dict:
    """Read a run folder, write every report file into it, return the summary. ``ReportError``
    (one line naming the file) when the folder or its inputs are missing or corrupt, or when
    ``slo_ms`` / ``bin_s`` (given, else the run's) are not > 0."""
    out = Path(run_dir)
    run = _read_run_config(out)
    try:
        slo_ms = float(slo_ms if slo_ms is not None else run.get("slo_ms", 500.0))
        bin_s = float(bin_s if bin_s is not None else run.get("bin_s", 2.0))
    except (TypeError, ValueError):
        raise ReportError(f"{out / 'run_config.json'}: slo_ms / bin_s are not numbers") from None
    for name, value in (("slo_ms", slo_ms), ("bin_s", bin_s)):
        if not (value > 0 and math.isfinite(value)):
            raise ReportError(f"{name}={value:g} must be > 0")
    requests_csv = out / "requests.csv"
    if not requests_csv.is_file():
        raise ReportError(f"{out}: no requests.csv (the run did not get to send load)")
    try:
        log = read_requests(requests_csv)
    except (KeyError, ValueError, TypeError, csv.Error, UnicodeDecodeError) as exc:
        raise ReportError(f"{requests_csv}: not a request log written by the load test ({exc!r})") from None
    try:
        metrics = read_metrics(out / "metrics.csv")
    except (KeyError, ValueError, TypeError, csv.Error, UnicodeDecodeError) as exc:
        raise ReportError(
            f"{out / 'metrics.csv'}: not a metrics log written by the load test ({exc!r})"
        ) from None
    shape_start = out / "shape_start.txt"
    try:
        if shape_start.is_file():  # written by the locustfile at its first tick: the scenario's t = 0
            t0 = float(shape_start.read_text().strip())
        elif len(log):
            t0 = float(log.start.min())
        else:
            t0 = float(run.get("started_at") or 0.0)
        ends = [float(run.get("finished_at") or t0)]
    except (TypeError, ValueError, UnicodeDecodeError):
        raise ReportError(f"{out}: shape_start.txt or run_config.json times are not numbers") from None
    ends += [float(log.end.max())] if len(log) else []
    ends += [float(metrics["time"].max())] if len(metrics["time"]) else []
    t_end = max(ends)
    n_bins = math.ceil((t_end - t0) / bin_s)
    if n_bins > MAX_BINS:
        raise ReportError(
            f"bin_s={bin_s:g} cuts the {t_end - t0:.0f} s run into {n_bins} bins (at most {MAX_BINS}): "
            "use a wider --bin"
        )

    rows = build_timeseries(log, metrics, t0=t0, t_end=t_end, bin_s=bin_s, slo_ms=slo_ms)
    with open(out / "timeseries.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    summary = summarize(log, metrics, t0=t0, t_end=t_end, slo_ms=slo_ms)
    (out / "summary.json").write_text(json.dumps(_json_safe(summary), indent=2), encoding="utf-8")

    sc = run.get("scenario", {})
    markers = [float(m) for m in run.get("phase_times", [])]
    title = f"{sc.get('name', '?')} scenario, peak {sc.get('peak_users', '?')} users, SLO {slo_ms:g} ms"
    plots = _plots(
        out, rows, metrics, t0=t0, slo_ms=slo_ms, bin_s=bin_s, summary=summary, title=title, markers=markers
    )
    _write_pages(out, summary, run, plots)
    logger.info("report written to %s", out / "report.md")
    return summary
