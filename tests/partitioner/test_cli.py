"""`shardserve plan` and `shardserve verify` as a user runs them."""

from __future__ import annotations

import dataclasses
import json

from shardserve.cli import main


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
    assert main(["verify", "--model", "tiny-bert", "--pp", "2", "--tp", "1", "--tolerance", "0"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL model=tiny-bert pp=2 tp=1")


def test_plan_memory_uses_the_dtype_bytes(capsys):
    def serving_bytes(dtype: str) -> list[int]:
        assert main(["plan", "--model", "minilm", "--pp", "2", "--dtype", dtype, "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["dtype"] == dtype
        return [s["serving_bytes"] for s in plan["stages"]]

    fp32, bf16 = serving_bytes("float32"), serving_bytes("bfloat16")
    assert all(b * 2 == f for b, f in zip(bf16, fp32, strict=True)), (fp32, bf16)


def test_fp16_on_a_cpu_without_fp16_units_is_one_line(capsys, monkeypatch):
    from partitioner import precision

    caps = dataclasses.replace(precision.cpu_capabilities(), model="Test CPU", fp16=False)
    monkeypatch.setattr(precision, "cpu_capabilities", lambda: caps)
    assert main(["verify", "--model", "tiny-bert", "--dtype", "float16"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: float16 is not supported on cpu (Test CPU") and "\n" not in err
