"""``shardserve serve`` as a user meets it (issue 11): one-line errors for every mistake, a start-up
line with the real URL, model, precision and plan, a "ready" line, ``--log-level`` after the
subcommand, and a non-zero exit with one clear line when the first gang cannot load.

Run: python -m pytest tests/serving/frontend/test_serve_cli.py -q   (two tests start real servers: ~30 s)
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from shardserve.cli import build_parser, main
from shardserve.models.registry import resolve_model
from shardserve.partitioner.precision import resolve_dtype


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def _model_without_weights(tmp_path: Path) -> Path:
    d = tmp_path / "no-weights"
    d.mkdir()
    shutil.copy(resolve_model("tiny-bert").checkpoint / "config.json", d)
    return d


def test_values_from_the_environment_are_named_by_their_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SHARDSERVE_PORT", "abc")
    monkeypatch.setenv("SHARDSERVE_EXTERNAL_RANKS", "1,a")
    err = _one_line_error(capsys, ["serve"], "SHARDSERVE_PORT: ", "SHARDSERVE_EXTERNAL_RANKS (item 2): ")
    assert "--port" not in err and "invalid settings: invalid" not in err


def test_help_names_flags_and_no_default_of_none(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: None" not in text and "not together with --admin-token" in text
    assert "CRITICAL" in text  # every --log-level choice is listed


def test_serve_mistakes_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _one_line_error(capsys, ["serve", "--model", "tiny-bert", "--tp", "5"], "tp=5", "num_attention_heads=4")
    _one_line_error(capsys, ["serve", "--pp", "0"], "--pp:", "greater than or equal to 1", "(got 0)")
    _one_line_error(
        capsys, ["serve", "--min-replicas", "3", "--max-replicas", "2"], "--min-replicas=3 > --max-"
    )
    _one_line_error(capsys, ["serve", "--length-buckets", "64,x"], "--length-buckets (item 2): ", "(got 'x')")
    _one_line_error(capsys, ["serve", "--null-threshold", "nan"], "--null-threshold: ", "finite number")
    _one_line_error(capsys, ["serve", "--host", "256.1.1.1"], "--host 256.1.1.1: ")
    _one_line_error(capsys, ["serve", "--model", str(tmp_path / "nope")], "neither a known name")
    _one_line_error(capsys, ["serve", "--model", str(_model_without_weights(tmp_path))], "no weights found")
    _one_line_error(capsys, ["serve", "--admin-token-file", str(tmp_path / "missing")], "cannot be read")
    with socket.socket() as busy:  # a port in use: said before the model loads, naming the flags
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        _one_line_error(
            capsys, ["serve", "--host", "127.0.0.1", "--port", port], f"--port {port}: cannot listen"
        )
        _one_line_error(
            capsys,
            ["serve", "--host", "127.0.0.1", "--port", "0", "--grpc-port", port],
            f"--grpc-port {port}: cannot listen",
        )
    with pytest.raises(SystemExit) as exit_info:  # argparse mistakes: one line too, pointing at --help
        main(["serve", "--pp", "two"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "invalid int value" in err and "--help" in err


def test_serve_float16_on_a_cpu_without_fp16_units_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardserve.partitioner import precision
    from shardserve.serving.frontend import cli as serve_cli

    caps = dataclasses.replace(precision.cpu_capabilities(), model="Test CPU", fp16=False)
    monkeypatch.setattr(precision, "cpu_capabilities", lambda: caps)
    monkeypatch.setattr(serve_cli.DrainingServer, "run", lambda *a, **k: pytest.fail("the server started"))
    err = _one_line_error(capsys, ["serve", "--model", "tiny-bert", "--dtype", "float16"], "Test CPU")
    assert err.startswith("error: float16 is not supported on cpu (Test CPU"), err


def test_serve_int8_without_a_calibration_is_one_line_naming_the_command(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from shardserve.models.registry import resolve_model
    from shardserve.serving.frontend import cli as serve_cli

    monkeypatch.setenv("SHARDSERVE_CACHE", str(tmp_path))
    resolve_model("tiny-bert")  # the preset written into the fresh cache first
    capsys.readouterr()  # (its progress bar)
    monkeypatch.setattr(serve_cli.DrainingServer, "run", lambda *a, **k: pytest.fail("the server started"))
    err = _one_line_error(capsys, ["serve", "--model", "tiny-bert", "--dtype", "int8"], "no int8 calibration")
    assert "shardserve quantize --model tiny-bert" in err, err


def test_auto_serves_int8_only_where_every_model_is_calibrated(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from shardserve.models.registry import resolve_model
    from shardserve.partitioner import precision
    from shardserve.partitioner.int8 import calibration_path, save_calibration
    from shardserve.serving.frontend.layout import serve_precision
    from shardserve.serving.frontend.settings import ServeSettings

    # a CPU where int8 wins (VNNI, no AMX: which CPUs those are is tests/partitioner/test_int8.py's)
    vnni = dataclasses.replace(precision.cpu_capabilities(), isa="AVX512", amx=False, vnni=True)
    monkeypatch.setattr(precision, "cpu_capabilities", lambda: vnni)
    monkeypatch.setenv("SHARDSERVE_CACHE", str(tmp_path))
    one = ServeSettings(model=["tiny-bert"])
    two = ServeSettings(model=["a=tiny-bert", "b=tiny-roberta"])
    assert not serve_precision(one).int8
    save_calibration({}, calibration_path(resolve_model("tiny-bert")), model="tiny-bert")
    assert serve_precision(one).int8
    assert not serve_precision(two).int8  # tiny-roberta has none: auto keeps the float dtype


def test_serve_refuses_a_layout_over_max_memory_per_rank_before_any_weight_loads(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardserve.models import hf_weights

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights were opened before the layout was refused")

    monkeypatch.setattr(hf_weights.CheckpointReader, "__init__", refuse)
    argv = ["serve", "--model", "tiny-bert", "--host", "127.0.0.1", "--port", "0"]
    argv += ["--max-memory-per-rank", "1MiB"]
    err = _one_line_error(capsys, argv, "on rank 0 (", " weights ", "--max-memory-per-rank is 1.0 MiB")
    assert err.startswith("error: pp=1 x tp=1 needs ") and "at batch 21 x seq 384" in err, err
    err = _one_line_error(capsys, [*argv, "--pp", "auto"], "no layout of pp=1..6 x tp=1 ", "the leanest")
    assert err.endswith("lower --max-batch-size / --max-batch-tokens / --max-seq-len"), err


def test_log_level_is_accepted_after_the_subcommand() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve", "--log-level", "info"]).log_level == "INFO"
    assert parser.parse_args(["--log-level", "DEBUG", "serve"]).log_level == "DEBUG"
    assert parser.parse_args(["--log-level", "DEBUG", "plan", "--log-level", "error"]).log_level == "ERROR"
    assert parser.parse_args(["train", "--model", "m", "--train-file", "f", "--output", "o"]).log_level
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--log-level", "LOUD"])


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "shardserve.cli", "serve", "--host", "127.0.0.1", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )


def test_startup_and_ready_lines_name_the_real_url_model_precision_and_plan() -> None:
    proc = _serve(
        "--model", "tiny-bert", "--pp", "2", "--replicas", "1", "--log-level", "WARNING", "--grpc-port", "0"
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        start = proc.stdout.readline()
        m = re.match(
            r"shardserve: serving tiny-bert at (http://127\.0\.0\.1:(\d+)) and gRPC 127\.0\.0\.1:(\d+) \((.*)\)$",
            start.strip(),
        )
        assert m, start
        url, port, grpc_port, rest = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        assert port != 0 and grpc_port not in (0, port) and "pp=2 tp=1" in rest and "stage 1: layers" in rest
        want = resolve_dtype("auto")  # what --dtype auto picks on this machine, and why
        assert f"precision {want.name}: {want.reason}" in rest, rest
        ready = proc.stdout.readline()  # printed once the first gang is warm
        assert ready.startswith(f"shardserve: ready at {url}"), ready
        assert httpx.get(f"{url}/readyz", timeout=5).status_code == 200
        _grpc_answers_as_rest(url, f"127.0.0.1:{grpc_port}")  # the real gang, over both protocols
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _grpc_answers_as_rest(url: str, grpc_url: str) -> None:
    grpcclient = pytest.importorskip("tritonclient.grpc")
    question, context = "Who met Bob?", "Ann met Bob in Paris in 1999."
    rest = httpx.post(f"{url}/v1/qa", json={"question": question, "context": context}, timeout=30).json()
    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        inputs = [grpcclient.InferInput(n, [1], "BYTES") for n in ("question", "context")]
        inputs[0].set_data_from_numpy(np.array([question.encode()], dtype=np.object_))
        inputs[1].set_data_from_numpy(np.array([context.encode()], dtype=np.object_))
        result = client.infer("tiny-bert", inputs)
        assert result.as_numpy("answer")[0, 0].decode() == rest["answers"][0]["text"]
        assert abs(float(result.as_numpy("score")[0, 0]) - rest["answers"][0]["score"]) < 1e-6
    finally:
        client.close()


def test_first_gang_that_cannot_load_exits_non_zero_with_one_line(tmp_path: Path) -> None:
    """config.json and a weights file without the model's tensors: the preflight passes, every rank
    fails to load; the server must not retry forever (issue 11.4)."""
    model = _model_without_weights(tmp_path)
    save_file({"unrelated": torch.zeros(2)}, str(model / "model.safetensors"))
    t0 = time.monotonic()
    proc = _serve("--model", str(model), "--replicas", "1", "--restart-backoff-s", "0.1")
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 1, (out, err)
    assert time.monotonic() - t0 < 120
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: the first replica gang could not start: "), err
    assert "not found" in last and str(model) in last  # the operator's own terminal keeps the path
    assert out.startswith("shardserve: serving no-weights at http://127.0.0.1:")
    assert json.dumps("ready") not in out and "ready at" not in out
