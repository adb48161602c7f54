"""``shardserve quantize`` (training/quantize.py): it writes the calibration where ``eval`` and
``serve`` read it, and a mistake is one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardserve.cli import main
from shardserve.models.registry import resolve_model
from shardserve.partitioner.int8 import calibration_path, load_calibration
from tests.training.test_cli import _squad_file_of


def test_quantize_writes_the_calibration_that_eval_int8_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SHARDSERVE_CACHE", str(tmp_path / "cache"))
    data = _squad_file_of(tmp_path, 6)
    assert main(["quantize", "--model", "tiny-bert", "--data", str(data), "--questions", "4"]) == 0
    out = capsys.readouterr().out
    path = calibration_path(resolve_model("tiny-bert"))
    assert f"wrote {path}: 30 Linear layers of tiny-bert calibrated on 4 questions" in out, out
    assert len(load_calibration(path)) == 60  # smooth + amax of each layer (6 layers x 5)
    assert main(["eval", "--model", "tiny-bert", "--data", str(data), "--dtype", "int8", "--json"]) == 0
    assert '"f1"' in capsys.readouterr().out


def test_quantize_mistakes_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quantize", "--model", "tiny-bert", "--data", str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --data {tmp_path / 'none.json'}: no such file", err
    assert (
        main(["quantize", "--model", str(tmp_path / "nope"), "--data", str(_squad_file_of(tmp_path, 1))]) == 2
    )
    assert "neither a known name" in capsys.readouterr().err
