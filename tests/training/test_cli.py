"""``shardserve train`` / ``eval`` user mistakes: one line on stderr, exit 2, no traceback (issue 11.6),
and a finished run's ``final`` is never replaced silently (issue 11.12); Ctrl-C (exit 130) and
SIGTERM (exit 143) stop a run in one line, its ranks killed."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from shardserve.cli import main
from tests.procs import alive, all_gone

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


def test_train_refuses_a_layout_over_max_memory_per_rank_before_any_weight_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardserve.models import hf_weights

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights were opened before the layout was refused")

    monkeypatch.setattr(hf_weights.CheckpointReader, "__init__", refuse)
    squad = tmp_path / "squad.json"
    squad.write_text('{"data": []}')
    argv = ["train", "--model", "tiny-bert", "--train-file", str(squad), "--output", str(tmp_path / "run")]
    argv += ["--no-progress", "--max-memory-per-rank", "1MiB"]
    err = _one_line_error(capsys, argv, "pp=1 x tp=1 needs ", "weights, gradients and AdamW state")
    assert "micro-batch 8 x seq 256" in err and "--max-memory-per-rank is 1.0 MiB" in err, err
    _one_line_error(capsys, [*argv, "--tp", "auto"], "no layout of pp=1 x tp=1,2,4 ", "the leanest")
    assert not (tmp_path / "run").exists()


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
    _one_line_error(capsys, argv, "already holds a run (final)", "--resume", "--overwrite")
    assert (out / "final" / "model.safetensors").read_bytes() == b"trained weights"
    # with --overwrite the check passes (the run then fails on the empty data set, one line too)
    err = _one_line_error(capsys, [*argv, "--overwrite", "--no-progress"])
    assert "already holds" not in err


@pytest.fixture
def cpu_without_fp16(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine's CPU as one without fp16 units, named "Test CPU" (as tests/partitioner/test_cli.py)."""
    from shardserve.partitioner import precision

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
        (
            ["--null-threshold", "nan"],
            ["null_threshold=nan", "finite"],
        ),  # was a traceback after the model ran
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
        # non-finite numbers passed every range check and trained to NaN weights (or crashed)
        (["--lr", "inf"], ["lr=inf must be a finite number"]),
        (["--weight-decay", "nan"], ["weight_decay=nan"]),
        (["--max-grad-norm", "nan"], ["max_grad_norm=nan"]),  # silently turned clipping off
        (["--epochs", "nan"], ["epochs=nan"]),
        (["--epochs", "inf"], ["epochs=inf"]),
        (["--lora-rank", "4", "--lora-alpha", "nan"], ["lora_alpha=nan"]),
        (["--adam-eps", "0"], ["adam_eps=0.0 must be > 0"]),
        (["--eval-batch-size", "0"], ["eval_batch_size=0"]),  # a ZeroDivisionError after the last step
        (["--threads-per-rank", "0"], ["threads_per_rank=0"]),  # silently meant "the default"
        (["--log-every", "-1"], ["log_every=-1"]),
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


def _fake_checkpoint(out: Path, step: int, state: str, *, ranks: int = 0) -> Path:
    """A checkpoint directory with the trainer state ``state`` and ``ranks`` (tiny) rank files."""
    from safetensors.torch import save_file

    ckpt = out / f"checkpoint-{step}"
    (ckpt / "training_state").mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(state)
    for rank in range(ranks):
        save_file({"w": torch.zeros(2)}, str(ckpt / "training_state" / f"rank{rank}.safetensors"))
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
    _fake_checkpoint(tmp_path / "other", 2, json.dumps(state), ranks=1)
    argv = _train_argv(
        tmp_path, tmp_path / "other", "--resume", "--batch-size", "1", "--micro-batch-size", "1"
    )
    _one_line_error(capsys, [*argv, "--max-steps", "5"], "cannot resume", "'total_steps': (3, 5)")
    _one_line_error(capsys, [*argv, "--max-steps", "3", "--pp", "2"], "'pp': (1, 2)", "--elastic")
    # every checkpoint damaged (a rank file truncated, one missing): one line naming each and why
    newer = _fake_checkpoint(tmp_path / "all-damaged", 4, json.dumps(state), ranks=1)
    rank0 = newer / "training_state" / "rank0.safetensors"
    rank0.write_bytes(rank0.read_bytes()[:-3])
    older = _fake_checkpoint(tmp_path / "all-damaged", 2, json.dumps(state))
    argv = _train_argv(
        tmp_path, tmp_path / "all-damaged", "--resume", "--batch-size", "1", "--micro-batch-size", "1"
    )
    _one_line_error(
        capsys,
        argv,
        "no checkpoint under",
        f"checkpoint-4 ({rank0}: unreadable (",
        f"checkpoint-2 ({older / 'training_state' / 'rank0.safetensors'}: missing)",
    )
    assert not (tmp_path / "all-damaged" / ".cache").exists()  # refused before tokenizing


@pytest.mark.parametrize("command", ["train", "eval"])
def test_help_shows_a_default_only_where_there_is_one(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: None" not in text and text.count("(default:") >= 5  # ints, floats, choices keep theirs


def _squad_file_of(tmp_path: Path, n: int) -> Path:
    """``n`` answerable questions over one short context each."""
    paragraphs = []
    for i in range(n):
        context = f"Ann met Bob number {i} in Paris on day {i}."
        start = context.index("Paris")
        qa = {
            "id": f"q{i}",
            "question": f"Where did Ann meet Bob {i}?",
            "answers": [{"text": "Paris", "answer_start": start}],
        }
        paragraphs.append({"context": context, "qas": [qa]})
    squad = tmp_path / f"squad{n}.json"
    squad.write_text(json.dumps({"data": [{"title": "t", "paragraphs": paragraphs}]}))
    return squad


def _tiny_run(tmp_path: Path, out: Path, *flags: str) -> list[str]:
    return [
        "train", "--model", "tiny-bert", "--train-file", str(_squad_file_of(tmp_path, 8)), "--output", str(out),
        "--no-progress", "--batch-size", "4", "--micro-batch-size", "2", "--max-seq-len", "64",
        "--doc-stride", "16", "--max-question-len", "16", "--precision", "fp32", *flags,
    ]  # fmt: skip


def test_overwrite_removes_the_previous_runs_files_and_a_crashed_run_is_protected_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An old run's higher-numbered checkpoints outlived --overwrite: pruning then deleted the new
    run's own, and --resume continued the OLD run. A crashed run (checkpoints, no final) is a run."""
    out = tmp_path / "run"
    old = out / "checkpoint-6"
    old.mkdir(parents=True)
    (old / "trainer_state.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    _one_line_error(
        capsys, _tiny_run(tmp_path, out, "--max-steps", "1"), "already holds a run (checkpoint-6)"
    )
    assert main(_tiny_run(tmp_path, out, "--max-steps", "1", "--overwrite")) == 0
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "curve.csv", "curve.png", "final", "notes.txt"
    ]  # fmt: skip


def test_a_diverging_run_stops_with_one_line_and_publishes_no_final(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """lr 1e4 without clipping: the loss went NaN and the run reported success with NaN weights."""
    out = tmp_path / "run"
    argv = _tiny_run(
        tmp_path, out, "--max-steps", "6", "--lr", "1e4", "--warmup-ratio", "0", "--max-grad-norm", "0"
    )
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "diverged" in err and "--lr" in err, err
    assert not (out / "final").exists()


def _stop_a_pipelined_run(tmp_path: Path, stop: Callable[[int], None]) -> tuple[int, float, str, list[int]]:
    """Start a long pipelined ``shardserve train`` in a session of its own, wait for its
    checkpoint-2, then ``stop(driver pid)``: (exit code, seconds it took to exit, its stderr, the
    pids of the driver and its ranks)."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    argv = _tiny_run(tmp_path, out, "--max-steps", "100000", "--save-every", "2", "--pp", "2")
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardserve.cli", *argv],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as from a terminal
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoint-2").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert (out / "checkpoint-2").exists()
        pids = [
            int(p)
            for p in subprocess.run(
                ["pgrep", "-g", str(proc.pid)], capture_output=True, text=True
            ).stdout.split()
        ]
        t0 = time.monotonic()
        stop(proc.pid)
        _, err = proc.communicate(timeout=60)
        return proc.returncode, time.monotonic() - t0, err, pids
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _alive_after_a_while(pids: list[int]) -> list[str]:
    """The command lines of the processes in ``pids`` still alive 5 s on (or as soon as none is)."""
    all_gone(pids, within_s=5)  # the driver and its ranks (its process group)
    out = []
    for pid in alive(pids):
        with contextlib.suppress(OSError):  # gone meanwhile
            out.append(Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:120])
    return out


def test_ctrl_c_stops_a_pipelined_run_at_once_with_one_line(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the process group): the ranks ignore it and ran on for a minute while the
    driver waited to drain them, then a 33-line traceback. Now: killed, one line naming the newest
    checkpoint, exit 130, no rank left."""
    import signal

    code, took, err, pids = _stop_a_pipelined_run(tmp_path, lambda pid: os.killpg(pid, signal.SIGINT))
    assert code == 130 and took < 15, (code, took, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("interrupted: the newest checkpoint is") and "--resume" in lines[0], err
    assert not _alive_after_a_while(pids)


def test_sigterm_stops_a_pipelined_run_at_once_with_one_line(tmp_path: Path) -> None:
    """SIGTERM to the driver alone (``kill PID``, Kubernetes stopping the pod): it died at once with
    no word (exit -15 here, 143 in a shell) while the checkpoints were resumable. Now as Ctrl-C: the
    ranks killed, one line naming the newest checkpoint and --resume, exit 143, no rank left."""
    import signal

    code, took, err, pids = _stop_a_pipelined_run(tmp_path, lambda pid: os.kill(pid, signal.SIGTERM))
    assert code == 143 and took < 15, (code, took, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("terminated (SIGTERM): the newest checkpoint is"), err
    assert str(tmp_path / "run" / "checkpoint-") in lines[0] and "--resume" in lines[0], err
    assert not _alive_after_a_while(pids)


@pytest.fixture
def sigterm_caught() -> Iterator[list[int]]:
    """A SIGTERM handler that only counts, so a test may signal its own process (the default
    action would end pytest); restored afterwards."""
    import signal

    got: list[int] = []

    def count(signum: int, frame: object) -> None:
        got.append(signum)

    previous = signal.signal(signal.SIGTERM, count)
    try:
        yield got
    finally:
        signal.signal(signal.SIGTERM, previous)


def _sigterm_self_then_wait(*_args: object, **_kwargs: object) -> dict[str, float]:
    """Stands in for the training / evaluation: SIGTERM to this process, then 5 s of work."""
    import signal
    import time

    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    return {"exact": 0.0}


@pytest.mark.parametrize("command", ["train", "eval"])
def test_sigterm_during_train_or_eval_is_one_line_and_exit_143(
    command: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    sigterm_caught: list[int],
) -> None:
    """In-process (the gang-free part of the SIGTERM handling): the command stops at once with one
    line and exit 143, and the process's previous SIGTERM handler is back afterwards."""
    import signal
    import time

    from shardserve.training import driver, evaluate

    monkeypatch.setattr(driver, "train", _sigterm_self_then_wait)
    monkeypatch.setattr(evaluate, "evaluate_model", _sigterm_self_then_wait)
    out = tmp_path / "run"
    if command == "train":
        _fake_checkpoint(out, 2, "{}")
        argv = _tiny_run(tmp_path, out, "--max-steps", "4")
        want = f"terminated (SIGTERM): the newest checkpoint is {out / 'checkpoint-2'}; "
    else:
        argv = ["eval", "--model", "tiny-bert", "--data", str(_squad_file_of(tmp_path, 2)), "--pp", "2"]
        want = "terminated (SIGTERM): the evaluation was stopped"
    handler = signal.getsignal(signal.SIGTERM)
    t0 = time.monotonic()
    assert main(argv) == 143
    assert time.monotonic() - t0 < 4 and not sigterm_caught  # our handler ran, not the test's
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and err.startswith(want) and not captured.out, err
    assert signal.getsignal(signal.SIGTERM) is handler


def test_stopped_run_hint_without_a_checkpoint_does_not_promise_a_resume(tmp_path: Path) -> None:
    from shardserve.training.cli import stopped_run_hint

    out = tmp_path / "run"
    assert stopped_run_hint(out) == "no checkpoint was written yet"
    out.mkdir()
    (out / "curve.csv").write_text("step\n")  # what a run writes once its gang is up
    assert "--overwrite" in stopped_run_hint(out) and "--resume" not in stopped_run_hint(out)
