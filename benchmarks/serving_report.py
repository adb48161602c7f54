"""What ``bench_serving.py`` reports: its rows (``Result``), the machine they ran on (the CPU, its
reduced-precision units, the GPU, the dtype ``--dtype`` resolves to, the packages' versions), the
table, and the ratios of the shardserve rows to the other parts with the issue-9 targets and the
ceiling the server process's own CPU puts on them.

    python -m pytest tests/benchmarks/test_bench_helpers.py -q -k "ratio or machine_info or cuda"
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
from dataclasses import dataclass
from typing import Any

FRAMEWORKS = (  # (e), (f): --skip part, row letter, name, server script in servers/
    ("litserve", "e", "LitServe", "litserve_qa.py"),
    ("mosec", "f", "Mosec", "mosec_qa.py"),
)


@dataclass
class Result:
    name: str
    questions_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    completed: int
    errors: int
    note: str = ""
    server_cpu_ms: float | None = None  # server-process CPU per answer (HTTP, tokenizing, decoding)


def machine_info(dtype: str, device: str = "cpu", *, model: str | None = None) -> dict[str, Any]:
    """CPU, its reduced-precision units, the GPU on cuda, and the dtype ``dtype`` resolves to on ``device``
    (for ``model``: auto picks int8 where it is calibrated, as the server does; printed with the table)."""
    import torch

    from shardserve.models.cpu import cpu_capabilities
    from shardserve.partitioner.precision import resolve_dtype

    caps = cpu_capabilities()
    calibrated = False
    if model is not None:
        from shardserve.models.registry import resolve_model
        from shardserve.partitioner.int8 import calibration_path

        calibrated = calibration_path(resolve_model(model)).is_file()
    choice = resolve_dtype(dtype, device, int8_calibrated=calibrated)
    try:
        import onnxruntime

        ort_version = onnxruntime.__version__
    except ImportError:
        ort_version = None
    return {
        "cpu": caps.describe(),
        "bf16_units": caps.bf16,
        "amx": caps.amx,
        "int8_kernels": caps.int8_unit or None,
        "dtype_requested": dtype,
        "dtype": choice.name,
        "dtype_reason": choice.reason,
        "torch": torch.__version__,
        "onnxruntime": ort_version,
        **{part: _version(part) for part, *_ in FRAMEWORKS},  # litserve, mosec: None when not installed
        "cores": os.cpu_count(),
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
    }


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def ratio_lines(results: list[Result], *, cores: int | None = None) -> list[str]:
    """The ratios of the shardserve rows to the other parts, with the issue-9 targets; with
    ``cores``, also the ceiling its server process's own CPU per answer puts on the default row."""

    def best(prefix: tuple[str, ...]) -> Result | None:
        rows = [r for r in results if r.name.startswith(prefix) and r.questions_per_s > 0]
        return max(rows, key=lambda r: r.questions_per_s) if rows else None

    default = best(("(c) shardserve default",))
    explicit = best(("(c) shardserve flags",))
    limit = best(("(a) ", "(a') ", "(a2) ", "(a3) "))
    naive = best(("(b) ",))
    naive16 = best(("(b2) ",))
    frameworks = [  # (e), (e2), (f), (f2)
        (best((f"({letter}{suffix}) ",)), f"{title} {short} server ({letter}{suffix})")
        for _, letter, title, _ in FRAMEWORKS
        for suffix, short in (("", "fp32"), ("2", "bf16"))
    ]
    ort = best(("(d) ",))
    ort_fp32 = best(("(d) ONNX Runtime fp32",))  # int8 is faster but breaks the accuracy bound
    lines = []
    for label, c in (("default flags", default), ("best flags", explicit)):
        if c is None:
            continue
        lines.append(f"shardserve {label} [{c.name}]: {c.questions_per_s:.1f} q/s")
        for other, what, target in (
            (limit, "raw forward limit (a)", 0.9),
            (naive, "naive fp32 server (b)", 4.0),
            (naive16, "naive bf16 server (b2)", None),
            *((row, what, None) for row, what in frameworks),
            (ort, "ONNX Runtime best raw (d)", 2.0),
            (ort_fp32, "ONNX Runtime best accurate raw (d, fp32)", None),
        ):
            if other is None or (other is ort_fp32 and ort is ort_fp32):
                continue
            ratio = c.questions_per_s / other.questions_per_s
            goal = (
                ""
                if target is None or label != "default flags"
                else (f"  (target >= {target:g}x: {'met' if ratio >= target else 'NOT met'})")
            )
            lines.append(f"  / {what} [{other.name}]: {ratio:.2f}x{goal}")
    if default is not None and default.server_cpu_ms and limit is not None and cores:
        # the server process shares the cores: at q answers/s it leaves cores - q * f to the model,
        # which at best computes limit/cores answers per core-second: q = L / (1 + f * L / cores)
        ceiling = limit.questions_per_s / (1 + default.server_cpu_ms / 1000 * limit.questions_per_s / cores)
        lines.append(
            f"  ceiling from the server process's {default.server_cpu_ms:.1f} ms CPU per answer on {cores} "
            f"cores, batching as good as the limit's: {ceiling:.1f} q/s = "
            f"{ceiling / limit.questions_per_s:.2f}x the limit"
        )
    return lines


def shared_cores(args: argparse.Namespace) -> int | None:
    """The cores the front end shares with the model (None on cuda: the model computes on the GPU)."""
    return None if args.device == "cuda" else args.cores


def print_table(results: list[Result], args: argparse.Namespace, info: dict[str, Any]) -> None:
    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    print(
        f"\nmodel={args.model} clients={args.clients} duration={args.duration_s:g}s cores={info['cores']} "
        f"questions={args.questions} torch={info['torch']} onnxruntime={info['onnxruntime'] or 'not installed'} "
        + " ".join(f"{part}={info.get(part) or 'not installed'}" for part, *_ in FRAMEWORKS)
    )
    print(
        f"cpu: {info['cpu']}; bf16 units: {info['bf16_units']}, AMX: {info['amx']}, "
        f"int8 kernels: {info['int8_kernels'] or 'none'}"
    )
    if info["gpu"]:
        print(f"gpu: {info['gpu']} (the raw rows, the naive servers and shardserve compute on it)")
    print(f"--dtype {info['dtype_requested']} -> {info['dtype']} ({info['dtype_reason']})")
    print(f"{'':36} {'q/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'ok':>6} {'err':>5}  note")
    for r in results:
        print(
            f"{r.name:36} {r.questions_per_s:8.1f} {fmt(r.p50_ms):>8} {fmt(r.p99_ms):>8} {r.completed:6d} "
            f"{r.errors:5d}  {r.note}"
        )
    for line in ratio_lines(results, cores=shared_cores(args)):
        print(line)
