"""The layout flags are declared once (``partitioner/layout_flags.py``) and every command that takes
them inherits them: the same flag names, defaults, types and (serve only) environment variables.

    python -m pytest tests/partitioner/test_layout_flags.py -q
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from shardserve.cli import build_parser
from shardserve.models.registry import resolve_model
from shardserve.partitioner.cli import PLAN, PartitionSettings, PlanSettings
from shardserve.partitioner.fit import AUTO
from shardserve.partitioner.layout_flags import (
    LAYOUT_FIELDS,
    MEMORY_HELP,
    DtypeFlag,
    LayoutFlags,
    SplitFlags,
)
from shardserve.partitioner.precision import resolve_dtype
from shardserve.partitioner.stream.verify_command import VERIFY
from shardserve.serving.frontend.cli import SERVE
from shardserve.serving.frontend.settings import ServeSettings
from shardserve.training.cli import EVAL, TRAIN
from shardserve.training.config import TrainConfig, TrainSettings

ROOT = Path(__file__).resolve().parents[2]
SHARED = {
    "serve": LayoutFlags,
    "plan": LayoutFlags,
    "verify": LayoutFlags,
    "train": SplitFlags,
    "eval": DtypeFlag,
}
COMMANDS = {c.name: c for c in (SERVE, PLAN, VERIFY, TRAIN, EVAL)}


@pytest.fixture(autouse=True)
def _no_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in [n for n in os.environ if n.startswith("SHARDSERVE_")]:
        monkeypatch.delenv(name)


def _actions(command: str) -> dict[str, argparse.Action]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {s: a for a in sub.choices[command]._actions for s in a.option_strings}


def test_each_layout_field_is_declared_once_in_the_source() -> None:
    """The acceptance check of the issue: one ``max_memory_per_rank:`` (and one of each layout field
    in a settings model) in the packages."""
    found: dict[str, list[str]] = {}
    for pkg in ("models", "partitioner", "serving", "training", "shardserve"):
        for path in (ROOT / pkg).rglob("*.py"):
            for name in re.findall(
                r"^\s+(max_memory_per_rank|device|dtype): \S+ = Field\(", path.read_text(), re.M
            ):
                found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert found == {
        name: ["partitioner/layout_flags.py"] for name in ("max_memory_per_rank", "device", "dtype")
    }


@pytest.mark.parametrize("command", SHARED)
def test_every_command_inherits_the_same_fields(command: str) -> None:
    settings = COMMANDS[command].settings
    mixin = SHARED[command]
    assert issubclass(settings, mixin)
    for name, field in mixin.model_fields.items():
        own = settings.model_fields[name]
        assert (own.annotation, own.default, own.description, own.metadata) == (
            field.annotation,
            field.default,
            field.description,
            field.metadata,
        ), f"{command}: {name}"


@pytest.mark.parametrize("command", SHARED)
def test_the_flags_keep_their_names_types_and_defaults(command: str) -> None:
    actions = _actions(command)
    fields = SHARED[command].model_fields
    for name in fields:
        assert f"--{name.replace('_', '-')}" in actions, f"{command}: --{name} missing"
    if "pp" in fields:
        assert actions["--pp"].metavar == actions["--tp"].metavar == "{N,auto}"
        assert actions["--max-memory-per-rank"].metavar == "SIZE"
        assert actions["--device"].choices == ("cpu", "cuda")
    if "dtype" in fields:
        assert actions["--dtype"].choices == ("auto", "float32", "bfloat16", "float16", "int8")
    env = "env SHARDSERVE_" in actions["--dtype" if "dtype" in fields else "--pp"].help
    assert env == (command == "serve")  # only serve's settings read the environment


def test_eval_keeps_its_own_fixed_gang() -> None:
    """eval's --pp / --tp take no auto and it has no memory limit or device: not the shared fields."""
    actions = _actions("eval")
    assert (
        actions["--pp"].type is int and "--max-memory-per-rank" not in actions and "--device" not in actions
    )


def test_train_defaults_are_its_configs() -> None:
    for name in SplitFlags.model_fields:
        if name in TrainConfig.__dataclass_fields__:
            assert TrainSettings.model_fields[name].default == TrainConfig.__dataclass_fields__[name].default


def test_serve_reads_the_layout_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDSERVE_PP", "auto")
    monkeypatch.setenv("SHARDSERVE_TP", "2")
    monkeypatch.setenv("SHARDSERVE_MAX_MEMORY_PER_RANK", "4GiB")
    monkeypatch.setenv("SHARDSERVE_DTYPE", "float32")
    s = ServeSettings()
    assert (s.pp, s.tp, s.max_memory_per_rank, s.dtype, s.auto_layout) == (
        AUTO,
        2,
        4 * 2**30,
        "float32",
        True,
    )
    assert PlanSettings().pp == 1  # plan's settings do not read the environment
    monkeypatch.setenv("SHARDSERVE_DEVICE", "gpu")
    with pytest.raises(ValidationError, match="device"):
        ServeSettings()


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"pp": 0}, "must be an integer greater than or equal to 1, or auto"),
        ({"tp": "two"}, "must be an integer greater than or equal to 1, or auto"),
        ({"max_memory_per_rank": "4 lots"}, "must be a size"),
        ({"device": "tpu"}, "Input should be 'cpu' or 'cuda'"),
        ({"dtype": "int4"}, "Input should be 'auto'"),
    ],
)
def test_one_validation_for_every_command(values: dict[str, object], needle: str) -> None:
    for model in (ServeSettings, PartitionSettings, LayoutFlags):
        with pytest.raises(ValidationError, match=needle):
            model(**values)


def test_a_commands_own_words_are_added_to_the_shared_help() -> None:
    """``flag_notes``: serve and train say what their memory estimate is for; plan says the shared text."""
    plan, serve, train = (_actions(c)["--max-memory-per-rank"].help for c in ("plan", "serve", "train"))
    shared = MEMORY_HELP.replace("pp/tp", "--pp/--tp")[:80]
    assert all(h.startswith(shared) for h in (plan, serve, train))
    assert (
        "Estimated for training" in train
        and "--micro-batch-size" in train
        and "--max-batch-size" not in train
    )
    assert "--max-batch-size windows" in serve and "--ranks-per-gpu" in serve and "training" not in serve
    assert "Estimated" not in plan


def test_choose_layout_fits_the_memory_limit() -> None:
    config = resolve_model("tiny-bert").config
    dtype = resolve_dtype("float32", "cpu")
    explicit = PartitionSettings(model="tiny-bert", pp=2).choose_layout(
        {"tiny-bert": config}, batch_size=1, seq_len=64, dtype=dtype
    )
    assert (explicit.dims.pp, explicit.dims.tp, explicit.auto) == (2, 1, False)
    chosen = PartitionSettings(pp="auto").choose_layout({"m": config}, batch_size=1, seq_len=64, dtype=dtype)
    assert (chosen.dims.pp, chosen.dims.tp, chosen.auto) == (1, 1, True)  # the fewest ranks fit
    assert set(LAYOUT_FIELDS) == {"pp", "tp", "max_memory_per_rank", "device", "dtype"}
