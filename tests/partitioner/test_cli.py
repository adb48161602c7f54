"""`shardserve plan` and `shardserve verify` as a user runs them."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from shardserve.cli import main
from shardserve.loadtest.local_server import free_port
from shardserve.partitioner.cost import RANK_RUNTIME_BYTES
from shardserve.partitioner.stream.verify import verify_partitioned


def test_plan_table(capsys):
    assert (
        main(["plan", "--model", "minilm", "--pp", "2", "--tp", "2", "--batch-size", "4", "--seq-len", "128"])
        == 0
    )
    out = capsys.readouterr().out
    assert "pp=2 tp=2 (4 ranks)" in out
    lines = [line.split() for line in out.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert [(row[0], row[1], row[2]) for row in lines] == [("0", "0,1", "emb+0-2"), ("1", "2,3", "3-5+head")]


def test_plan_json_has_memory_and_ranks(capsys):
    assert main(["plan", "--model", "tiny-bert", "--pp", "3", "--tp", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["world_size"] == 6 and plan["model"]["name"] == "tiny-bert"
    assert [s["ranks"] for s in plan["stages"]] == [[0, 1], [2, 3], [4, 5]]
    assert all(s["training_bytes"] > s["serving_bytes"] > 0 for s in plan["stages"])


def test_plan_dp_shows_the_allreduce_volume_and_the_same_training_memory(capsys):
    """``--dp D``: each rank's ring all-reduce sends 2 (D-1)/D x 4 B per parameter of its shard; the
    training memory per rank (16 B/param rule, AdamW state replicated on every copy) does not move."""
    base = ["plan", "--model", "minilm", "--pp", "2", "--batch-size", "4", "--seq-len", "256", "--json"]
    assert main(base) == 0
    single = json.loads(capsys.readouterr().out)
    assert main([*base, "--dp", "2"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["dp"], plan["world_size"]) == (2, 4)
    for one, two in zip(single["stages"], plan["stages"], strict=True):
        assert (
            two["training_bytes"] == one["training_bytes"]
            and two["params_per_rank"] == one["params_per_rank"]
        )
        assert two["allreduce_bytes"] == 2 * (2 - 1) / 2 * 4 * two["params_per_rank"]
        assert one.get("allreduce_bytes", 0) == 0  # nothing to all-reduce with one copy
    assert main(["plan", "--model", "minilm", "--dp", "2", "--pp", "2"]) == 0
    assert "AR MB" in capsys.readouterr().out


def test_plan_manual_boundaries(capsys):
    assert main(["plan", "--model", "tiny-bert", "--pp", "2", "--boundaries", "1", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [(s["layer_start"], s["layer_end"]) for s in plan["stages"]] == [(0, 1), (1, 6)]
    assert plan["cost_source"] == "manual"


def test_plan_infeasible_prints_numbers_and_exits_2(capsys):
    assert main(["plan", "--model", "minilm", "--tp", "5"]) == 2
    assert "tp=5 does not divide num_attention_heads=12" in capsys.readouterr().err


def test_unknown_model_exits_2(capsys):
    assert main(["plan", "--model", "/nonexistent/model"]) == 2
    assert "neither a known name" in capsys.readouterr().err


def test_verify_fails_above_tolerance(capsys):
    """A tolerance no float computation meets makes verify fail with exit code 1 and say so."""
    assert main(["verify", "--model", "tiny-bert", "--pp", "2", "--tp", "1", "--tolerance", "1e-30"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL model=tiny-bert pp=2 tp=1")


def test_plan_memory_uses_the_dtype_bytes(capsys):
    def serving_bytes(dtype: str) -> list[int]:
        assert main(["plan", "--model", "minilm", "--pp", "2", "--dtype", dtype, "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["dtype"] == dtype
        return [s["serving_bytes"] for s in plan["stages"]]

    fp32, bf16 = serving_bytes("float32"), serving_bytes("bfloat16")
    run = RANK_RUNTIME_BYTES  # the rank process's own memory, the same in any dtype
    assert all((b - run) * 2 == f - run for b, f in zip(bf16, fp32, strict=True)), (fp32, bf16)


def test_fp16_on_a_cpu_without_fp16_units_is_one_line(capsys, monkeypatch):
    from shardserve.partitioner import precision

    caps = dataclasses.replace(precision.cpu_capabilities(), model="Test CPU", fp16=False)
    monkeypatch.setattr(precision, "cpu_capabilities", lambda: caps)
    assert main(["verify", "--model", "tiny-bert", "--dtype", "float16"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: float16 is not supported on cpu (Test CPU") and "\n" not in err


def _argparse_error(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    """``argv`` is refused by argparse: exit 2 and one line (no traceback), returned."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["plan", "--batch-size", "0"], "argument --batch-size: must be >= 1 (got 0)"),
        (["plan", "--seq-len", "-5"], "argument --seq-len: must be >= 1 (got -5)"),
        (["verify", "--threads-per-rank", "0"], "argument --threads-per-rank: must be >= 1 (got 0)"),
        (["verify", "--tolerance", "-1"], "argument --tolerance: must be a number > 0 (got -1)"),
        (["verify", "--tolerance", "0"], "argument --tolerance: must be a number > 0 (got 0)"),
        (["verify", "--tolerance", "nan"], "argument --tolerance: must be a number > 0 (got nan)"),
        (["worker", "--join-timeout-s", "0"], "argument --join-timeout-s: must be a number > 0"),
    ],
)
def test_out_of_range_numbers_are_one_line_errors(capsys, argv: list[str], needle: str) -> None:
    err = _argparse_error(
        capsys, [argv[0], "--model", "tiny-bert", *argv[1:]] if argv[0] != "worker" else argv
    )
    assert needle in err, err


def test_verify_partitioned_refuses_bad_threads_and_tolerance_before_starting_ranks() -> None:
    with pytest.raises(ValueError, match="threads_per_rank=0 must be an integer >= 1"):
        verify_partitioned(None, None, threads_per_rank=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"tolerance=-1\.0 must be > 0"):
        verify_partitioned(None, None, tolerance=-1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--master-port", "99999", "--rank", "1"], "error: master port 99999 is outside 1..65535"),
        (["--master-port", "0", "--rank", "1"], "error: master port 0 is outside 1..65535"),
        (["--master-port", "29500", "--rank", "-1"], "error: rank -1 must be >= 0"),
        (["--master-port", "29500", "--rank", "2", "--world-size", "2"], "error: rank 2 is outside a gang"),
    ],
)
def test_worker_refuses_bad_port_and_rank_at_once(capsys, tmp_path, flags: list[str], needle: str) -> None:
    key = tmp_path / "key.hex"
    key.write_text("00" * 32)
    t0 = time.monotonic()
    assert main(["worker", "--master-addr", "127.0.0.1", *flags, "--key-file", str(key)]) == 2
    assert time.monotonic() - t0 < 5  # no wait for a driver
    err = capsys.readouterr().err.strip()
    assert err.startswith(needle) and "\n" not in err, err


def test_worker_env_values_are_checked_too(capsys, monkeypatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "70000")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("SHARDSERVE_GANG_KEY", "00" * 32)
    assert main(["worker"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: master port 70000 is outside 1..65535 (--master-port / MASTER_PORT)"
    )
    monkeypatch.setenv("MASTER_PORT", "abc")
    assert main(["worker"]) == 2
    assert "MASTER_PORT='abc' is not an integer" in capsys.readouterr().err


def test_worker_join_timeout_says_where_it_waits_and_ends_in_one_line(capfd, tmp_path) -> None:
    """Nothing listens at the port: the worker says where it waits, then after the join timeout one
    error line; c10d's retry warnings (C++ stack frames on fd 2) stay out of the terminal."""
    key = tmp_path / "key.hex"
    key.write_text("00" * 32)
    port = free_port()  # nothing listens there: every connection attempt is refused
    argv = ["worker", "--master-addr", "127.0.0.1", "--master-port", str(port), "--rank", "1"]
    assert main([*argv, "--key-file", str(key), "--join-timeout-s", "2"]) == 2
    lines = capfd.readouterr().err.strip().splitlines()
    assert lines[0] == f"waiting for the driver at 127.0.0.1:{port} (join timeout 2 s)", lines
    assert len(lines) == 2 and lines[1].startswith(f"error: no gang spec at 127.0.0.1:{port} after 2s"), lines


def test_plan_placement_auto_prints_groups_and_attainment(capsys) -> None:
    """Steady light load: one device per model meets every SLO; auto prefers the smaller groups."""
    argv = ["plan", "--placement", "auto", "--models", "a=tiny-bert,b=tiny-bert", "--devices", "2"]
    argv += ["--device-memory-mb", "64", "--single-latency-ms", "20", "--rate", "10", "--duration-s", "20"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("placement auto: 2 devices of 64 MiB; 2 models at 10 req/s")
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert [(r[1], r[2], r[3], r[4]) for r in rows] == [("0", "1", "1", "a"), ("1", "1", "1", "b")]
    models = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("a ", "b "))}
    assert models["a"][1:3] == ["20.0", "100.0"] and models["a"][4] == "100.0%"  # latency, SLO 5x
    assert "predicted SLO attainment 100.0%" in out


def test_plan_placement_json_and_memory_that_does_not_fit(capsys) -> None:
    base = ["plan", "--models", "a=tiny-bert,b=tiny-bert", "--single-latency-ms", "20", "--duration-s", "10"]
    assert (
        main(
            [*base, "--placement", "multiplexed", "--device-memory-mb", "64", "--dtype", "float32", "--json"]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "multiplexed" and out["device_memory_bytes"] == 64 * 2**20
    assert out["groups"] == [
        {
            "devices": [0, 1],
            "pp": 2,
            "tp": 1,
            "models": ["a", "b"],
            "device_bytes": out["groups"][0]["device_bytes"],
        }
    ]
    stage0, stage1 = out["groups"][0]["device_bytes"].values()
    assert stage0 > stage1 > 0  # stage 0 holds both models' word embeddings
    assert out["slo_ms"] == {"a": 100.0, "b": 100.0} and out["prediction"]["attainment"] == 1.0
    assert set(out["prediction"]["models"]) == {"a", "b"}
    # a whole tiny-bert (fp32 weights + one micro-batch's activations, ~33 MiB) does not fit 10 MiB
    assert main([*base, "--placement", "dedicated", "--device-memory-mb", "10", "--dtype", "float32"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("error: dedicated placement holds a whole model per device: a needs ")
        and "\n" not in err
    )
    assert "> 10.0 MiB per device" in err


def test_plan_without_placement_ignores_the_placement_flags(capsys) -> None:
    assert main(["plan", "--model", "tiny-bert", "--pp", "2", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["plan", "--model", "tiny-bert", "--pp", "2", "--json", "--devices", "4", "--rate", "9"]) == 0
    assert json.loads(capsys.readouterr().out) == plain and "groups" not in plain


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--devices", "0"], "argument --devices: must be >= 1 (got 0)"),
        (["--rate", "0"], "argument --rate: must be a number > 0 (got 0)"),
        (["--cv", "-2"], "argument --cv: must be a number > 0 (got -2)"),
        (["--slo-scale", "nan"], "argument --slo-scale: must be a number > 0 (got nan)"),
        (["--duration-s", "0"], "argument --duration-s: must be a number > 0 (got 0)"),
        (["--device-memory-mb", "0"], "argument --device-memory-mb: must be a number > 0 (got 0)"),
        (["--single-latency-ms", "-1"], "argument --single-latency-ms: must be a number > 0 (got -1)"),
        (["--hop-ms", "-1"], "argument --hop-ms: must be a number >= 0 (got -1)"),
        (
            ["--models", "a=default,b="],
            "argument --models (item 2): must be NAME=MODEL, a model name, or either with :COUNT >= 1 (got 'b=')",
        ),
        (
            ["--models", "a=default,a=minilm"],
            "argument --models: model names must be distinct (a given twice)",
        ),
        (["--placement", "best"], "argument --placement: invalid choice: 'best'"),
        (["--placement-max-tp", "0"], "argument --placement-max-tp: must be >= 1 (got 0)"),
        (
            ["--placement-max-tp", "4", "--latency-profile", "p.json"],
            "--placement-max-tp 4 applies to the cost model's times, not with --latency-profile",
        ),
    ],
)
def test_placement_flags_bad_values_are_one_line_errors(capsys, flags: list[str], needle: str) -> None:
    err = _argparse_error(capsys, ["plan", "--placement", "auto", *flags])
    assert needle in err, err


def test_plan_placement_for_a_named_gpu_with_model_copies_skew_and_the_gain(capsys) -> None:
    argv = [
        "plan",
        "--placement",
        "auto",
        "--devices",
        "8",
        "--gpu",
        "h100",
        "--models",
        "minilm-l6:2,q=qwen2-1.5b:2",
    ]
    argv += ["--rate", "400", "--cv", "2", "--skew", "1", "--duration-s", "5", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["models"] == {
        "minilm-l6-1": "minilm-l6",
        "minilm-l6-2": "minilm-l6",
        "q-1": "qwen2-1.5b",
        "q-2": "qwen2-1.5b",
    }
    assert out["device_memory_bytes"] == int(0.9 * 80e9) and out["workload"]["skew"] == 1.0
    assert out["single_latency_source"].startswith("roofline of NVIDIA H100")
    assert out["single_latency_ms"]["q-1"] > 10 * out["single_latency_ms"]["minilm-l6-1"]
    gain = out["gain"]
    assert gain["target"] == 0.99 and set(gain["dedicated"]) == {
        "placement",
        "attainment",
        "max_rate",
        "max_cv",
    }
    assert gain["auto"]["attainment"] == out["prediction"]["attainment"]
    assert (
        gain["max_rate_gain"] is None
        or gain["max_rate_gain"] == gain["auto"]["max_rate"] / gain["dedicated"]["max_rate"]
    )
    # the table form ends with the gain over dedicated
    assert main([*argv[:-1], "--no-gain"]) == 0 and "gain over dedicated" not in capsys.readouterr().out
    assert main(argv[:-1]) == 0
    assert "gain over dedicated at 99% attainment" in capsys.readouterr().out


def test_plan_placement_on_a_gpu_searches_tensor_parallel_groups_up_to_the_flag(capsys) -> None:
    """Qwen2-1.5B over 2,048 tokens on an H100 is compute-bound (~14 ms a request alone): an SLO of
    0.7x that is met only by tp = 2 groups (~8.6 ms: the FLOPs shared, the launches and 56
    all-reduces not); with --placement-max-tp 1 nothing meets it."""
    argv = "plan --placement auto --devices 8 --gpu h100 --models q=qwen2-1.5b:2 --seq-len 2048".split()
    argv += "--slo-scale 0.7 --rate 40 --duration-s 3 --no-gain --json".split()
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert {g["tp"] for g in out["groups"] if g["models"]} == {2}, out["groups"]
    assert out["prediction"]["attainment"] > 0.9
    assert main([*argv, "--placement-max-tp", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {g["tp"] for g in out["groups"]} == {1} and out["prediction"]["attainment"] < 0.1
