"""``shardserve train`` / ``eval`` user mistakes: one line on stderr, exit 2, no traceback (issue 11.6),
and a finished run's ``final`` is never replaced silently (issue 11.12)."""

from __future__ import annotations

import dataclasses
import json
import os
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
    assert not Path(out).exists()  # the data is checked before the run directory is made
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
    assert err.endswith("use --precision bf16 or fp32"), err  # train's choices, not eval's --dtype names
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


# ------------------------------------------------------------------------------------------------
# CLI audit: every mistake below used to be a traceback (or was silently accepted)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--max-examples", "0"], ["max_examples=0", ">= 1"]),
        (["--max-examples", "-1"], ["max_examples=-1", ">= 1"]),  # used to score every question
        (["--batch-size", "0"], ["batch_size=0"]),
        (["--pp", "0"], ["pp=0"]),
        (["--holdout-articles", "-1"], ["holdout_articles=-1"]),
        (["--doc-stride", "300"], ["doc_stride=300", "max_seq_len=256"]),
        (["--doc-stride", "200"], ["windows too small", "doc_stride=200"]),  # passes the simple check
        (["--max-answer-length", "0"], ["max_answer_length=0", "1..512"]),
        (["--max-seq-len", "1000"], ["max_seq_len=1000 exceeds the model's 512 positions"]),
        (["--tp", "3"], ["tp=3"]),
    ],
)
def test_eval_bad_numbers_are_one_line_without_a_progress_bar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], needles: list[str]
) -> None:
    argv = ["eval", "--model", "tiny-bert", "--data", str(_squad_file(tmp_path)), *flags]
    err = _one_line_error(capsys, argv, *needles)  # one line: no "eval:   0%|" bar before the error
    assert "%|" not in err and "eval:" not in err, err


def _train_argv(tmp_path: Path, out: Path, *flags: str) -> list[str]:
    data = str(_squad_file(tmp_path))
    return [
        "train",
        "--model",
        "tiny-bert",
        "--train-file",
        data,
        "--output",
        str(out),
        "--no-progress",
        *flags,
    ]


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--max-train-examples", "0"], ["max_train_examples=0", ">= 1"]),
        (["--max-eval-examples", "0"], ["max_eval_examples=0"]),
        (["--max-seq-len", "1000"], ["max_seq_len=1000 exceeds the model's 512 positions"]),
        (["--doc-stride", "200"], ["windows too small", "doc_stride=200"]),
        (["--resume", "--overwrite"], ["--resume", "--overwrite"]),
        (["--elastic"], ["--elastic", "--resume"]),  # --elastic only means something with --resume
        (["--resume"], ["--resume: no checkpoint-*"]),
    ],
)
def test_train_bad_settings_are_one_line_and_leave_no_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], needles: list[str]
) -> None:
    out = tmp_path / "run"
    _one_line_error(
        capsys, _train_argv(tmp_path, out, "--batch-size", "1", "--micro-batch-size", "1", *flags), *needles
    )
    assert not out.exists()  # refused before the run directory (or its feature cache) was made


def test_train_with_bad_data_leaves_no_output_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    base = ["train", "--model", "tiny-bert", "--output", str(out), "--no-progress", "--train-file"]
    bad = tmp_path / "bad.json"
    for text, needle in [
        ("{", "not valid JSON"),
        ('{"data": [{"title": "t", "paragraphs": [{}]}]}', "context"),
    ]:
        bad.write_text(text)
        _one_line_error(capsys, [*base, str(bad)], needle)
        assert not out.exists()
    _one_line_error(capsys, [*base, str(_squad_file(tmp_path)), "--holdout-articles", "1"], "holdout")
    assert not out.exists()


def test_train_output_that_cannot_be_created_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    err = _one_line_error(
        capsys, _train_argv(tmp_path, a_file), f"--output {a_file}: cannot create directory:"
    )
    assert "file of that name exists" in err
    _one_line_error(capsys, _train_argv(tmp_path, a_file / "run"), "cannot create directory: Not a directory")
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        try:
            _one_line_error(
                capsys, _train_argv(tmp_path, locked / "run"), "cannot create directory: Permission denied"
            )
        finally:
            locked.chmod(0o700)


def _fake_checkpoint(out: Path, step: int, state: str) -> Path:
    ckpt = out / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(state)
    return ckpt


def test_train_resume_problems_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a damaged trainer_state.json: named, before the data is tokenized
    damaged = _fake_checkpoint(tmp_path / "damaged", 2, '{"step": 2,')
    argv = _train_argv(
        tmp_path, tmp_path / "damaged", "--resume", "--batch-size", "1", "--micro-batch-size", "1"
    )
    _one_line_error(capsys, argv, str(damaged / "trainer_state.json"), "not valid JSON")
    assert not (tmp_path / "damaged" / ".cache").exists()
    # a checkpoint of another length / layout: ResumeError's own message, as one line
    state = {"step": 2, "total_steps": 3, "pp": 1, "tp": 1, "seed": 0, "data_sha256": "x"}
    _fake_checkpoint(tmp_path / "other", 2, json.dumps(state))
    argv = _train_argv(
        tmp_path, tmp_path / "other", "--resume", "--batch-size", "1", "--micro-batch-size", "1"
    )
    _one_line_error(capsys, [*argv, "--max-steps", "5"], "cannot resume", "'total_steps': (3, 5)")
    _one_line_error(capsys, [*argv, "--max-steps", "3", "--pp", "2"], "'pp': (1, 2)", "--elastic")


@pytest.mark.parametrize("command", ["train", "eval"])
def test_help_shows_a_default_only_where_there_is_one(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: None" not in text and text.count("(default:") >= 5  # ints, floats, choices keep theirs
