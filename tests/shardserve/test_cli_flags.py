"""Every command's flags come from its settings model, by the one generator (``shardserve/flags.py``);
that argparse lives in ``shardserve/`` only is ``test_layering.py``'s.

    python -m pytest tests/shardserve/test_cli_flags.py -q
"""

from __future__ import annotations

import argparse

import pytest

from shardserve.cli import COMMANDS, build_parser
from shardserve.flags import flag, nested_model


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _flags_of(model: type) -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        inner = nested_model(field)
        out += _flags_of(inner) if inner is not None else [flag(field.alias or name)]
    return out


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.name)
def test_every_settings_field_is_a_flag_with_its_description(command) -> None:
    parser = _subparsers()[command.name]
    actions = {s: a for a in parser._actions for s in a.option_strings}
    for name in _flags_of(command.settings):
        assert name in actions, f"{command.name}: {name} missing"
        assert actions[name].help and len(actions[name].help) > 10, f"{command.name} {name}: no help"


def test_literal_fields_are_choices_and_defaults_are_shown() -> None:
    parser = _subparsers()["train"]
    actions = {s: a for a in parser._actions for s in a.option_strings}
    assert actions["--schedule"].choices == ("gpipe", "1f1b")
    assert "(default: 1f1b)" in actions["--schedule"].help
    assert actions["--resume"].nargs == 0  # a switch
    assert "SHARDSERVE_GANG_PORT" in actions["--gang-port"].help  # the gang's flags read the environment


def test_a_bad_value_of_a_usage_checked_command_is_argparses_one_line(capsys) -> None:
    from shardserve.cli import main

    with pytest.raises(SystemExit) as info:
        main(["plan", "--boundaries", "1,x"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shardserve plan: error: argument --boundaries (item 2): ") and "\n" not in err
