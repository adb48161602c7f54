"""Command-line flags from a pydantic-settings model, and its validation errors as one line.

One home for what ``shardserve serve`` (``serving.frontend.settings.ServeSettings``) and the gang flags of
``serve``/``train`` (``partitioner.runtime.gang_flags.GangFlags``) share: a flag per field, with the field's
description, its default (when it has one) and its ``SHARDSERVE_<NAME>`` variable; comma-separated
lists; and a ``ValidationError`` turned into one line that names what the user typed: ``--pp`` for a
flag, ``SHARDSERVE_PP`` for a value that came from the environment. ``DefaultsHelpFormatter`` is the
help formatter of the hand-written parsers (train, eval): "(default: X)" only where there is one.

    add_settings_arguments(parser, ServeSettings, skip=GANG_FIELDS)
    settings = ServeSettings(**given_flags(args, ServeSettings))     # ValidationError ->
    print("error: " + error_line(err, model=ServeSettings, given=given_flags(args, ServeSettings)))
"""

from __future__ import annotations

import argparse
import re
import types
import typing
from collections.abc import Collection
from typing import Any

from pydantic import ValidationError

ENV_PREFIX = "SHARDSERVE_"


def flag(name: str) -> str:
    """``max_seq_len`` -> ``--max-seq-len``."""
    return "--" + name.replace("_", "-")


def _flag_type(annotation: Any) -> tuple[type, str | None]:
    """argparse type and metavar of a settings field."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = (
        args[0] if args and (typing.get_origin(annotation) in (typing.Union, types.UnionType)) else annotation
    )
    if typing.get_origin(base) is typing.Annotated:
        base = typing.get_args(base)[0]
    if typing.get_origin(base) is list:
        return str, "N,N,..."
    if base in (int, float):
        return base, None
    return str, None


def add_settings_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    model: type,
    *,
    skip: Collection[str] = (),
) -> None:
    """One flag per field of the pydantic-settings ``model`` (but ``skip``), default None (not
    given: the environment, then the field's default apply); its help ends with the default when the
    field has one and with its environment variable."""
    # field names in the descriptions ("not together with admin_token") become their flags
    snake = "|".join(sorted((n for n in model.model_fields if "_" in n), key=len, reverse=True))
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        kind, metavar = _flag_type(field.annotation)
        default = field.get_default(call_default_factory=True)
        if isinstance(default, list):
            default = ",".join(map(str, default)) or "none"
        shown = "" if default is None else f"default: {default}; "
        parser.add_argument(
            flag(name),
            dest=name,
            type=kind,
            default=None,
            metavar=metavar or name.upper(),
            help=f"{_flags_in(field.description or '', snake)} ({shown}env {ENV_PREFIX}{name.upper()})".replace(
                "%", "%%"
            ),
        )


def _flags_in(text: str, names: str) -> str:
    """``names`` (a regex alternation of field names) in ``text`` as their flags."""
    return re.sub(rf"(?<![\w-])({names})(?!\w)", lambda m: flag(m.group(1)), text) if names else text


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: X)`` after a flag's help, unless it has no default (None) or its help says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or "default" in text:
            return text
        return super()._get_help_string(action)


def given_flags(args: argparse.Namespace, model: type) -> dict[str, Any]:
    """The fields of ``model`` given on the command line (not None)."""
    return {k: v for k, v in vars(args).items() if k in model.model_fields and v is not None}


def split_list(data: Any, *names: str) -> Any:
    """A model validator's (mode="before") step: comma-separated strings (a flag or an environment
    variable) of the list fields ``names`` become lists of their items, which the field then
    validates one by one (so ``64,x`` is an error naming its second item, not a crash)."""
    if not isinstance(data, dict):
        return data
    for name in names:
        if isinstance(data.get(name), str):
            raw = data[name].strip().strip("[]")
            data = {**data, name: [x.strip() for x in raw.split(",") if x.strip()]}
    return data


def error_line(err: ValidationError, *, model: type, given: Collection[str]) -> str:
    """A ``ValidationError`` of the settings ``model`` as one line: each problem with the flag (when
    it was given on the command line) or the environment variable (else) it came from, and the value;
    the model's field names in its own messages (``min_replicas=3``) become their flags."""
    parts = []
    for e in err.errors():
        loc = [str(x) for x in e.get("loc", ())]
        msg = str(e.get("msg", "")).removeprefix("Value error, ").removeprefix("invalid settings: ")
        if not loc:
            parts.append(msg)
            continue
        name = loc[0]
        where = flag(name) if name in given else f"{ENV_PREFIX}{name.upper()}"
        item = f" (item {int(loc[1]) + 1})" if len(loc) > 1 and loc[1].isdigit() else ""
        value = e.get("input")
        shown = f" (got {value!r})" if isinstance(value, int | float | str) and len(repr(value)) < 60 else ""
        parts.append(f"{where}{item}: {msg}{shown}")
    line = "; ".join(parts)
    return _flags_in(line, "|".join(sorted(model.model_fields, key=len, reverse=True)))
