"""``partitioner/fit.py``: ``--pp/--tp auto`` picks the fewest ranks that fit ``--max-memory-per-rank``,
a layout that does not fit is refused in one line with the numbers, and sizes parse. Pure logic (no
processes), plus each command refusing a too-small limit with exit 2 before any weight loads.

    python -m pytest tests/partitioner/test_fit.py -q
"""

from __future__ import annotations

import pytest

from shardserve.cli import main
from shardserve.models.registry import resolve_model
from shardserve.partitioner.fit import (
    AUTO,
    MAX_AUTO_RANKS,
    LayoutDoesNotFit,
    MemoryBudget,
    candidates,
    fit_layout,
    parse_size,
    rank_need,
)
from shardserve.partitioner.plan import ParallelDims
from shardserve.partitioner.precision import resolve_dtype

MIB = 2**20


@pytest.fixture(scope="module")
def tiny():  # 6 layers, 4 heads, hidden 64, intermediate 128
    return resolve_model("tiny-bert").config


def _budget(limit: int, *, training: bool = False) -> MemoryBudget:
    return MemoryBudget(limit, batch_size=8, seq_len=384, dtype="bfloat16", dtype_bytes=2, training=training)


def _need(config, pp: int, tp: int, budget: MemoryBudget) -> int:
    return rank_need(config, ParallelDims(pp=pp, tp=tp), budget).total_bytes


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4GiB", 4 * 2**30),
        ("4096MiB", 4 * 2**30),
        ("4G", 4 * 2**30),
        ("500M", 500 * MIB),
        ("1.5GB", 1_500_000_000),
        ("2 gi", 2 * 2**30),
        ("1048576", MIB),
        ("100B", 100),
    ],
)
def test_sizes_parse(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["x", "4X", "-1G", "4iB", "", "0", "GiB"])
def test_bad_sizes_are_refused_naming_the_text(text: str) -> None:
    with pytest.raises(ValueError, match="is not a size") as info:
        parse_size(text)
    assert repr(text) in str(info.value)


def test_candidates_are_fewest_ranks_first_then_pp_on_cpu_and_tp_on_cuda(tiny) -> None:
    cpu = [(d.pp, d.tp) for d in candidates([tiny], pp=AUTO, tp=AUTO, device="cpu")]
    assert cpu[:4] == [(1, 1), (2, 1), (1, 2), (3, 1)]
    assert {t for _, t in cpu} == {1, 2, 4}  # tp divides 4 heads and 128
    assert max(p for p, _ in cpu) == 6 and all(p * t <= MAX_AUTO_RANKS for p, t in cpu)
    cuda = [(d.pp, d.tp) for d in candidates([tiny], pp=AUTO, tp=AUTO, device="cuda")]
    assert cuda[:4] == [(1, 1), (1, 2), (2, 1), (3, 1)]
    assert [(d.pp, d.tp) for d in candidates([tiny], pp=AUTO, tp=2)] == [(p, 2) for p in range(1, 7)]


def test_auto_picks_the_smallest_layout_that_fits(tiny) -> None:
    whole = _need(tiny, 1, 1, _budget(1))
    choice = fit_layout({"t": tiny}, pp=AUTO, tp=AUTO, budget=_budget(whole))
    assert (choice.dims.pp, choice.dims.tp) == (1, 1) and choice.auto  # fits as one rank: no split
    limit = _need(tiny, 1, 2, _budget(1))  # tp=2 fits, one rank does not
    assert whole > limit
    choice = fit_layout({"t": tiny}, pp=AUTO, tp=AUTO, budget=_budget(limit))
    assert (choice.dims.pp, choice.dims.tp) == (1, 2)
    assert choice.need.total_bytes <= limit
    assert all(  # no layout of fewer ranks fits
        _need(tiny, d.pp, d.tp, _budget(1)) > limit
        for d in candidates([tiny], pp=AUTO, tp=AUTO)
        if d.model_parallel_size < 2
    )
    line = choice.line()
    assert "pp=1 x tp=2" in line and "chosen by auto" in line and "--max-memory-per-rank is" in line


def test_auto_with_the_other_degree_fixed(tiny) -> None:
    limit = _need(tiny, 2, 2, _budget(1))
    choice = fit_layout({"t": tiny}, pp=AUTO, tp=2, budget=_budget(limit))
    assert choice.dims.tp == 2 and choice.dims.pp <= 2
    choice = fit_layout({"t": tiny}, pp=1, tp=AUTO, budget=_budget(_need(tiny, 1, 4, _budget(1))))
    assert (choice.dims.pp, choice.dims.tp) == (1, 4)


def test_training_uses_the_training_estimate(tiny) -> None:
    serving = _need(tiny, 1, 1, _budget(1))
    training = _need(tiny, 1, 1, _budget(1, training=True))
    assert training > serving
    fit_layout({"t": tiny}, pp=1, tp=1, budget=_budget(serving))
    with pytest.raises(LayoutDoesNotFit, match="weights, gradients and AdamW state"):
        fit_layout({"t": tiny}, pp=1, tp=1, budget=_budget(serving, training=True))


def test_an_explicit_layout_over_the_limit_is_refused_with_the_numbers_and_a_hint(tiny) -> None:
    limit = _need(tiny, 1, 2, _budget(1))
    with pytest.raises(LayoutDoesNotFit) as info:
        fit_layout({"t": tiny}, pp=1, tp=1, budget=_budget(limit))
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("pp=1 x tp=1 needs ") and " on rank 0 (" in msg and " weights " in msg
    assert "+ activations " in msg and "at batch 8 x seq 384, bfloat16)" in msg
    assert "but --max-memory-per-rank is " in msg and msg.endswith("try --tp 2 (or --pp auto --tp auto)")


def test_no_layout_fits_says_the_leanest_and_what_to_change(tiny) -> None:
    with pytest.raises(LayoutDoesNotFit) as info:
        fit_layout({"t": tiny}, pp=AUTO, tp=AUTO, budget=_budget(MIB), remedy="raise it")
    msg = str(info.value)
    assert msg.startswith("no layout of pp=1..6 x tp=1,2,4 (at most 64 ranks) fits: the leanest, pp=")
    assert "but --max-memory-per-rank is 1.0 MiB" in msg and msg.endswith("; raise it")
    with pytest.raises(LayoutDoesNotFit, match="no layout of at most 64 ranks fits either"):
        fit_layout({"t": tiny}, pp=1, tp=1, budget=_budget(MIB))


def test_several_models_share_the_layout_that_fits_them_all(tiny) -> None:
    default = resolve_model("default").config  # 12 heads: tp in 1, 2, 4 is common to both
    limit = _need(default, 1, 2, _budget(1))
    choice = fit_layout({"a": tiny, "b": default}, pp=AUTO, tp=AUTO, budget=_budget(limit))
    assert choice.need.model == "b" and choice.dims.model_parallel_size >= 2
    with pytest.raises(LayoutDoesNotFit, match="model b: pp=1 x tp=1 needs"):
        fit_layout({"a": tiny, "b": default}, pp=1, tp=1, budget=_budget(limit))


def test_an_explicit_layout_that_cannot_split_keeps_its_own_message(tiny) -> None:
    with pytest.raises(ValueError, match="tp=3 does not divide num_attention_heads=4"):
        fit_layout({"t": tiny}, pp=1, tp=3, budget=_budget(2**40))
    with pytest.raises(ValueError, match="--boundaries needs a fixed --pp"):
        fit_layout({"t": tiny}, pp=AUTO, tp=1, budget=_budget(2**40), boundaries=[2])


# -- plan and verify: a too-small --max-memory-per-rank is exit 2 and one line, before any weight loads
# (serve's and train's: tests/serving/frontend/test_serve_cli.py, tests/training/test_cli.py)


@pytest.fixture
def no_weight_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if anything opens a checkpoint's weights."""
    from shardserve.models import hf_weights

    def refuse(*args, **kwargs):
        raise AssertionError("weights were opened before the layout was refused")

    monkeypatch.setattr(hf_weights.CheckpointReader, "__init__", refuse)


@pytest.mark.usefixtures("no_weight_loads")
@pytest.mark.parametrize("command", ["plan", "verify"])
def test_plan_and_verify_refuse_a_layout_over_the_limit(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [command, "--model", "tiny-bert", "--max-memory-per-rank", "1MiB"]
    for extra, start in (
        ([], "error: pp=1 x tp=1 needs "),
        (["--pp", "auto"], "error: no layout of pp=1..6 "),
    ):
        assert main([*argv, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(start) and "\n" not in err, err
        assert "on rank 0 (" in err and " weights " in err and "--max-memory-per-rank is 1.0 MiB" in err, err


def test_plan_auto_prints_the_layout_it_chose_and_why(tiny, capsys: pytest.CaptureFixture[str]) -> None:
    dtype = resolve_dtype("auto", "cpu")  # as plan resolves it on this machine
    budget = MemoryBudget(1, batch_size=8, seq_len=384, dtype=dtype.name, dtype_bytes=dtype.itemsize)
    limit = rank_need(tiny, ParallelDims(pp=1, tp=2), budget).total_bytes  # tp=2 fits, one rank does not
    argv = [
        "plan",
        "--model",
        "tiny-bert",
        "--pp",
        "auto",
        "--tp",
        "auto",
        "--max-memory-per-rank",
        str(limit),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "pp=1 tp=2 (2 ranks)" in out
    assert (
        "layout chosen by auto" in out and "pp=1 x tp=2 needs " in out and "--max-memory-per-rank is " in out
    )
