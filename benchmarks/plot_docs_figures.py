"""Draw the plots of ``docs/benchmarks.md`` from the figures typed in below.

Nothing here measures anything: every figure is a row of the benchmarks page, typed in with its
date, its hardware and the command that measured it, so the plots can be redrawn (or a row
replaced by a newer run) without re-running the benchmarks. Each figure is from the lab notebook
(``git show 7898363:docs/benchmarks.md``); the page names the section of each.

    python benchmarks/plot_docs_figures.py                   # writes docs/images/bench-*.png
    python benchmarks/plot_docs_figures.py --out /tmp/plots  # somewhere else

Needs matplotlib (in the ``test`` extra).
"""

from __future__ import annotations

import argparse
from pathlib import Path

SERVE = "python benchmarks/bench_serving.py --skip naive-bf16 --skip ort --skip best --duration-s 20"

# bench_serving, the newest run per CPU that has the raw limit, the naive server and shardserve with
# no flags in one run (questions/s, 32 clients, 2 cores). "limit" is the best raw row of that run.
SERVING = [
    {
        "date": "2026-12-03",
        "hardware": "AMD EPYC Zen 3, AVX2 only (family 25 model 1), 2 cores",
        "label": "Zen 3 (AVX2)\nint8, 12-03",
        "command": SERVE,
        "limit": 34.2,  # (a3) raw int8, batches of 8, 2 processes
        "shardserve": 30.8,
        "naive": 12.2,  # naive FastAPI fp32
    },
    {
        "date": "2026-12-03",
        "hardware": "AMD EPYC Zen 4 (family 25 model 17; AVX512, AVX512-BF16, VNNI), 2 cores",
        "label": "Zen 4\nbf16, 12-03",
        "command": SERVE,
        "limit": 57.5,  # (a') raw bf16, batches of 32, 2 processes
        "shardserve": 48.1,
        "naive": 11.0,
    },
    {
        "date": "2026-12-02",
        "hardware": "AMD EPYC Zen 4 (family 25 model 17), a VM half as fast, 2 cores",
        "label": "slow Zen 4\nbf16, 12-02",
        "command": "python benchmarks/bench_serving.py --skip naive-bf16 --skip best --duration-s 20",
        "limit": 47.9,  # (a3)
        "shardserve": 41.4,
        "naive": 9.3,
        "ort_int8": 34.0,  # ONNX Runtime dynamic int8, batch 1 (fails the accuracy bound)
        "ort_fp32": 25.6,  # ONNX Runtime fp32, batch 1 (its best accurate row)
    },
    {
        "date": "2026-12-02",
        "hardware": "AMD EPYC Zen 5 (family 26 model 2; AVX512, AVX512-BF16, VNNI), 2 cores",
        "label": "Zen 5\nbf16, 12-02",
        "command": "python benchmarks/bench_serving.py --skip naive-bf16 --skip ort --duration-s 20",
        "limit": 90.6,  # (a3)
        "shardserve": 93.3,
        "naive": 21.8,
    },
    {
        "date": "2026-12-04",
        "hardware": "Intel Xeon, AMX (family 6 model 167 stepping 1), 2 vCPUs",
        "label": "Xeon (AMX)\nbf16, 12-04",
        "command": SERVE,
        "limit": 162.7,  # (a3)
        "shardserve": 118.5,
        "naive": 23.3,
    },
]

# bench_frontend_floor: CPU per answer (ms) of the server process, median of 3 rounds.
FLOOR = {
    "date": "2026-12-04",
    "hardware": "Intel Xeon, AMX (family 6 model 167 stepping 1), 2 vCPUs",
    "command": "python benchmarks/bench_frontend_floor.py",
    "served": {"bare ASGI": 0.77, "FastAPI": 1.00, "shardserve front end": 1.46},
    "saturated": {"bare ASGI": 0.52, "FastAPI": 0.80, "shardserve front end": 1.24},
    # the real server (ranks on the same cores), same VM type, same night: two closed loops and
    # bench_serving (python benchmarks/bench_serving.py --skip naive --skip naive-bf16 --skip ort
    # --skip best --duration-s 20)
    "real_server": (1.72, 2.2),
    "target": 1.0,  # issue 30's target on an AMX Xeon
}

# bench_int8_f1: forward windows/s over the whole development pool (10,111 windows, 2 threads,
# batches of 32), each CPU's precisions from one run (Zen 3: see its command).
PRECISION = [
    {
        "date": "2026-11-28",
        "hardware": "AMD EPYC, AVX2 only (family 25 model 17 with AVX2 flags), 2 cores",
        "label": "Zen 3 (AVX2)\n11-28",
        "command": "python benchmarks/bench_int8_f1.py --variants fp32,int8 --calibration 512"
        " (int8 7-bit: --variants int8, after the fix, same day)",
        "fp32": 20.2,
        "bf16": None,  # no bf16 units: emulated bf16 is 0.16x fp32 (bench_kernels, 2026-11-25)
        "int8": 28.7,
    },
    {
        "date": "2026-11-28",
        "hardware": "AMD EPYC Zen 4 (family 25 model 17; AVX512, AVX512-BF16, VNNI), 2 cores",
        "label": "Zen 4\n11-28",
        "command": "python benchmarks/bench_int8_f1.py --variants fp32,bf16,int8,int8-fp32 --calibration 512",
        "fp32": 22.9,
        "bf16": 46.4,
        "int8": 61.5,
    },
    {
        "date": "2026-12-02",
        "hardware": "AMD EPYC Zen 5 (family 26 model 2; AVX512, AVX512-BF16, VNNI), 2 cores",
        "label": "Zen 5\n12-02",
        "command": "python benchmarks/bench_int8_f1.py --variants fp32,bf16,int8",
        "fp32": 32.8,
        "bf16": 95.8,
        "int8": 128.3,
    },
    {
        "date": "2026-12-04",
        "hardware": "Intel Xeon, AMX (family 6 model 167 stepping 1), 2 vCPUs",
        "label": "Xeon (AMX)\n12-04",
        "command": "python benchmarks/bench_int8_f1.py --variants fp32,bf16,int8"
        " (int8 with per-layer factors, before cb6f30c)",
        "fp32": 51.8,
        "bf16": 171.6,
        "int8": 160.4,
    },
]


def _save(plt, fig, path: Path) -> Path:
    """Lay out, write at the docs' resolution and close one figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_serving(plt, out: Path) -> Path:
    """shardserve, the naive server and ONNX Runtime as a share of the raw limit, per CPU."""
    fig, ax = plt.subplots(figsize=(9, 4.2))
    labels = [r["label"] for r in SERVING]
    x = range(len(SERVING))
    width = 0.26
    series = [
        ("shardserve, no flags", "shardserve", -width, "tab:blue"),
        ("naive FastAPI fp32", "naive", 0.0, "tab:gray"),
        ("ONNX Runtime int8, batch 1 (fails the accuracy bound)", "ort_int8", width, "tab:orange"),
    ]
    for name, key, dx, color in series:
        xs, ys, qs = [], [], []
        for i, row in enumerate(SERVING):
            if row.get(key) is not None:
                xs.append(i + dx)
                ys.append(row[key] / row["limit"])
                qs.append(row[key])
        bars = ax.bar(xs, ys, width, label=name, color=color)
        for bar, q in zip(bars, qs, strict=True):
            ax.annotate(
                f"{q:g}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(0.9, color="tab:red", linewidth=0.8, linestyle=":", label="issue 30's target: 0.9x")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("questions/s / raw forward's limit")
    ax.set_ylim(0, 1.25)
    ax.set_title("bench_serving: 32 clients, 2 cores, one run per CPU (bar labels: questions/s)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    ax.grid(axis="y", alpha=0.3)
    return _save(plt, fig, out / "bench-serving-vs-raw.png")


def plot_floor(plt, out: Path) -> Path:
    """What a bare ASGI app, FastAPI and shardserve's front end spend per answer."""
    fig, ax = plt.subplots(figsize=(8, 3.6))
    servers = list(FLOOR["served"])
    colors = ["tab:gray", "tab:green", "tab:blue"]
    width = 0.25
    for j, load in enumerate(("served", "saturated")):
        for k, server in enumerate(servers):
            ms = FLOOR[load][server]
            bar = ax.bar(j + (k - 1) * width, ms, width, color=colors[k], label=server if j == 0 else None)
            ax.annotate(f"{ms:.2f}", (bar[0].get_x() + width / 2, ms), ha="center", va="bottom", fontsize=8)
    low, high = FLOOR["real_server"]
    ax.fill_between(
        [-0.45, 0.45],
        low,
        high,
        color="tab:blue",
        alpha=0.15,
        label=f"the real server, ranks beside it: {low}-{high} ms",
    )
    ax.axhline(
        FLOOR["target"], color="tab:red", linestyle=":", linewidth=0.8, label="issue 30's AMX target: 1.0 ms"
    )
    ax.set_xticks([0, 1], ["served (~140 answers/s)", "saturated (no compute)"])
    ax.set_ylabel("server CPU per answer (ms)")
    ax.set_ylim(0, 2.5)
    ax.set_title("bench_frontend_floor, Intel Xeon with AMX, 2 vCPUs, 2026-12-04", fontsize=10)
    ax.legend(fontsize=7, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    return _save(plt, fig, out / "bench-frontend-floor.png")


def plot_precision(plt, out: Path) -> Path:
    """Forward speed of bf16 and int8 against fp32 in the same run, per CPU."""
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.26
    keys = [("fp32", "tab:gray", -width), ("bf16", "tab:blue", 0.0), ("int8", "tab:orange", width)]
    for key, color, dx in keys:
        xs, ys, rates = [], [], []
        for i, row in enumerate(PRECISION):
            if row[key] is not None:
                xs.append(i + dx)
                ys.append(row[key] / row["fp32"])
                rates.append(row[key])
        bars = ax.bar(xs, ys, width, color=color, label=key)
        for bar, rate in zip(bars, rates, strict=True):
            ax.annotate(
                f"{rate:g}", (bar.get_x() + width / 2, bar.get_height()), ha="center", va="bottom", fontsize=7
            )
    ax.set_xticks(range(len(PRECISION)), [r["label"] for r in PRECISION], fontsize=8)
    ax.set_ylabel("windows/s / fp32's, same run")
    ax.set_title(
        "bench_int8_f1: forward over the development pool, 2 threads (bar labels: windows/s)", fontsize=10
    )
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    return _save(plt, fig, out / "bench-precision-speed.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = Path(__file__).resolve().parent.parent / "docs" / "images"
    parser.add_argument("--out", type=Path, default=default_out, help="folder for the PNG files")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    for draw in (plot_serving, plot_floor, plot_precision):
        print(draw(plt, args.out))


if __name__ == "__main__":
    main()
