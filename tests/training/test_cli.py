"""``shardserve train`` / ``eval`` user mistakes: one line on stderr, exit 2, no traceback (issue 11.6),
and a finished run's ``final`` is never replaced silently (issue 11.12)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from shardserve.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("error: "), err
    for needle in needles:
        assert needle in err, err
    return err


def test_train_with_a_missing_or_non_squad_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "run")
    base = ["train", "--model", "tiny-bert", "--output", out, "--no-progress"]
    _one_line_error(
        capsys, [*base, "--train-file", str(tmp_path / "nope.json")], "--train-file", "no such file"
    )
    _one_line_error(capsys, [*base, "--train-file", str(tmp_path)], "not a file")
    _one_line_error(capsys, [*base, "--train-file", str(ROOT / "README.md")], "README.md", "not valid JSON")
    squad = tmp_path / "ok.json"
    squad.write_text('{"data": []}')
    _one_line_error(
        capsys, [*base, "--train-file", str(squad), "--eval-file", str(tmp_path / "x.json")], "--eval-file"
    )


def test_eval_with_a_missing_or_non_squad_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _one_line_error(
        capsys,
        ["eval", "--model", "tiny-bert", "--data", str(tmp_path / "nope.json")],
        "--data",
        "no such file",
    )
    _one_line_error(
        capsys, ["eval", "--model", "tiny-bert", "--data", str(ROOT / "README.md")], "not valid JSON"
    )


def test_train_refuses_to_replace_a_final_checkpoint_without_resume_or_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    (out / "final" / "model.safetensors").write_bytes(b"trained weights")
    squad = tmp_path / "train.json"
    squad.write_text('{"data": []}')
    argv = ["train", "--model", "tiny-bert", "--train-file", str(squad), "--output", str(out)]
    _one_line_error(capsys, argv, "already holds a final checkpoint", "--resume", "--overwrite")
    assert (out / "final" / "model.safetensors").read_bytes() == b"trained weights"
    # with --overwrite the check passes (the run then fails on the empty data set, one line too)
    err = _one_line_error(capsys, [*argv, "--overwrite", "--no-progress"])
    assert "already holds" not in err


@pytest.fixture
def cpu_without_fp16(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine's CPU as one without fp16 units, named "Test CPU" (as tests/partitioner/test_cli.py)."""
    from partitioner import precision

    caps = dataclasses.replace(precision.cpu_capabilities(), model="Test CPU", fp16=False)
    monkeypatch.setattr(precision, "cpu_capabilities", lambda: caps)


def _squad_file(tmp_path: Path) -> Path:
    squad = tmp_path / "squad.json"
    context = "Ann met Bob in Paris."
    qa = {"id": "q1", "question": "Where?", "answers": [{"text": "Paris", "answer_start": 15}]}
    squad.write_text(
        json.dumps({"data": [{"title": "t", "paragraphs": [{"context": context, "qas": [qa]}]}]})
    )
    return squad


@pytest.mark.usefixtures("cpu_without_fp16")
def test_eval_float16_on_a_cpu_without_fp16_units_is_one_line_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _squad_file(tmp_path)
    err = _one_line_error(
        capsys, ["eval", "--model", "tiny-bert", "--data", str(data), "--dtype", "float16"], "Test CPU"
    )
    assert err.startswith("error: float16 is not supported on cpu (Test CPU"), err
    assert "eval" not in err.split("error:")[0] and "%|" not in err  # no progress bar was started


@pytest.mark.usefixtures("cpu_without_fp16")
def test_train_fp16_on_a_cpu_without_fp16_units_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--model", "tiny-bert", "--train-file", str(_squad_file(tmp_path))]
    argv += ["--output", str(tmp_path / "run"), "--no-progress", "--precision", "fp16"]
    err = _one_line_error(capsys, argv, "Test CPU")
    assert err.startswith("error: float16 is not supported on cpu (Test CPU"), err
    assert not (tmp_path / "run").exists()  # refused before the run directory was made
