"""Triton's perf_analyzer against shardserve: fetched from PyPI into a folder, run, its CSV read.

The ``tritonclient==2.41.0`` wheel carries the binary (``tritonclient-2.41.0.data/data/bin/``). It
links ``libcudart.so.12``, taken from PyPI's ``nvidia-cuda-runtime-cu12`` and put on
``LD_LIBRARY_PATH`` (over HTTP and gRPC it never touches a GPU), and Debian's ``libb64-0d``
(``apt-get install libb64-0d``). Nothing is installed into the environment: both wheels are
unpacked under ``folder``, once.

    binary = install(Path("~/.cache/shardserve/perf_analyzer").expanduser())
    rows = run(binary, "127.0.0.1:8000", "default", concurrency=[1, 4], pairs=[("Who?", "Ann.")])

Tests: ``pytest tests/loadtest/test_perf_analyzer.py``.
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

TRITONCLIENT = "tritonclient==2.41.0"
CUDA_RUNTIME = "nvidia-cuda-runtime-cu12"


class PerfAnalyzerUnavailable(RuntimeError):
    """perf_analyzer cannot be fetched or started here; the message says why."""


@dataclass(frozen=True)
class PerfAnalyzer:
    path: Path  # the binary
    lib_dir: Path  # holds libcudart.so.12

    def env(self) -> dict[str, str]:
        return {**os.environ, "LD_LIBRARY_PATH": f"{self.lib_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}"}


def install(folder: Path) -> PerfAnalyzer:
    """perf_analyzer unpacked under ``folder`` (fetched with pip the first time);
    PerfAnalyzerUnavailable with the reason when it cannot be fetched or does not start."""
    binary = folder / "tritonclient" / "tritonclient-2.41.0.data" / "data" / "bin" / "perf_analyzer"
    lib_dir = folder / "cudart" / "nvidia" / "cuda_runtime" / "lib"
    if not binary.exists() or not (lib_dir / "libcudart.so.12").exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as wheels:
            pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", wheels]
            try:
                got = subprocess.run(
                    [*pip, TRITONCLIENT, CUDA_RUNTIME], capture_output=True, text=True, timeout=600
                )
            except subprocess.TimeoutExpired as err:
                raise PerfAnalyzerUnavailable(
                    f"pip download {TRITONCLIENT}: no answer in {err.timeout:g} s"
                ) from err
            if got.returncode != 0:
                raise PerfAnalyzerUnavailable(
                    f"pip download {TRITONCLIENT} {CUDA_RUNTIME}: {got.stderr.strip()[-300:]}"
                )
            for wheel in Path(wheels).glob("*.whl"):
                into = "tritonclient" if wheel.name.startswith("tritonclient") else "cudart"
                with zipfile.ZipFile(wheel) as z:
                    z.extractall(folder / into)
        binary.chmod(0o755)
    pa = PerfAnalyzer(binary, lib_dir)
    try:
        probe = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, env=pa.env(), timeout=60
        )
    except OSError as err:  # e.g. not an x86-64 machine: the wheel's binary is
        raise PerfAnalyzerUnavailable(f"perf_analyzer does not start here: {err}") from err
    if "error while loading shared libraries" in probe.stderr:
        raise PerfAnalyzerUnavailable(
            f"perf_analyzer does not start: {probe.stderr.strip()} (apt-get install libb64-0d)"
        )
    return pa


def input_data(pairs: list[tuple[str, str]]) -> dict[str, list[dict[str, list[str]]]]:
    """perf_analyzer's --input-data for BYTES inputs: one request of one pair per entry."""
    return {"data": [{"question": [q], "context": [c]} for q, c in pairs]}


def run(
    pa: PerfAnalyzer,
    url: str,
    model: str,
    *,
    pairs: list[tuple[str, str]],
    concurrency: list[int],
    protocol: str = "http",
    binary_data: bool = True,
    window_ms: int = 2000,
    stability_pct: float = 10.0,
    headers: dict[str, str] | None = None,
    timeout_s: float = 300.0,
) -> list[dict[str, float]]:
    """perf_analyzer at each concurrency against ``url`` (host:port, ``protocol`` http or grpc), one run
    each: its CSV rows (latencies in microseconds, ``Inferences/Second``). It measures until three
    windows agree within ``stability_pct`` (its default 10; a loaded machine may need more).
    RuntimeError with its output when it fails."""
    fmt = "binary" if binary_data else "json"
    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        data, report = Path(tmp) / "qa.json", Path(tmp) / "report.csv"
        data.write_text(json.dumps(input_data(pairs)))
        for n in concurrency:
            cmd = [
                str(pa.path),
                *("-m", model, "-i", protocol, "-u", url, "--concurrency-range", str(n)),
                *("--input-data", str(data), "--shape", "question:1", "--shape", "context:1"),
                f"--input-tensor-format={fmt}",
                f"--output-tensor-format={fmt}",
                *("--measurement-interval", str(window_ms), "-s", f"{stability_pct:g}", "-f", str(report)),
            ]
            for key, value in (headers or {}).items():
                cmd += ["-H", f"{key}:{value}"]
            done = subprocess.run(cmd, capture_output=True, text=True, env=pa.env(), timeout=timeout_s)
            if done.returncode != 0:
                out = (done.stdout + done.stderr).strip()
                raise RuntimeError(
                    f"perf_analyzer ({protocol}, c={n}) exited {done.returncode}: {out[-1500:]}"
                )
            for row in csv.DictReader(io.StringIO(report.read_text())):
                rows.append({k: float(v) for k, v in row.items() if k and v not in ("", None)})
    return rows
