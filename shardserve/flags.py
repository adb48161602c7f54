"""Command-line flags generated from a command's pydantic settings model, and its errors as one line.

The one flag generator of the console script: a ``shardserve.partitioner.command.Command``'s settings model
becomes a subparser with a flag per field (``max_seq_len`` -> ``--max-seq-len``), its help the
field's description (field names in it shown as their flags), ``Literal`` fields as choices, an
``int | Literal["auto"]`` field as an integer or that word (``--pp auto``), a ``bool`` as a switch,
a list as comma-separated items, and "(default: X)" where there is one; a pydantic-settings
model's flags also name their ``SHARDSERVE_<NAME>`` variable. A field that is itself a settings
model (``TrainSettings.gang``) is a section of flags of its own. A pydantic-settings model's flags
not given stay None, so the environment and then the field's default apply (``build_settings``).
A field several commands inherit (``partitioner/layout_flags.py``) has one description, true for
each; a model's ``flag_notes`` (field name -> a sentence) adds what is true of that command only:

    flag_notes: ClassVar[dict[str, str]] = {"max_memory_per_rank": "Estimated for training: ..."}

    add_command(subparsers, PLAN)                      # parser.parse_args -> args.shardserve_command
    settings = build_settings(vars(args), PlanSettings)  # InvalidSettings -> .line() / .usage()
"""

from __future__ import annotations

import argparse
import re
import types
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any

from pydantic import BaseModel, BeforeValidator, PlainValidator, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from shardserve.partitioner.command import Command

ENV_PREFIX = "SHARDSERVE_"


def flag(name: str) -> str:
    """``max_seq_len`` -> ``--max-seq-len``."""
    return "--" + name.replace("_", "-")


def _key(name: str, field: FieldInfo) -> str:
    """The flag's (and the model's input) name of a field: its alias, else its name."""
    return field.alias or name


def _base(annotation: Any) -> Any:
    """``int | None`` -> int, ``Annotated[int, ...]`` -> int."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = args[0] if len(args) == 1 else annotation
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def nested_model(field: FieldInfo) -> type[BaseModel] | None:
    """The settings model a field holds (its flags are a section of the parent's), or None."""
    base = _base(field.annotation)
    return base if isinstance(base, type) and issubclass(base, BaseModel) else None


def _shown(default: Any) -> str | None:
    """A default as the help shows it; None when there is none to show."""
    if default is None or isinstance(default, bool):
        return None
    if isinstance(default, list | tuple):
        return ",".join(map(str, default)) or "none"
    return str(default)


def _help(model: type[BaseModel], name: str, field: FieldInfo, snake: str) -> str:
    note = getattr(model, "flag_notes", {}).get(name)  # the command's own words on a shared field
    text = _flags_in(". ".join(filter(None, (field.description, note))), snake)
    default = None if field.is_required() else _shown(field.get_default(call_default_factory=True))
    if issubclass(model, BaseSettings):
        shown = "" if default is None else f"default: {default}; "
        text = f"{text} ({shown}env {ENV_PREFIX}{name.upper()})"
    elif default is not None and "default" not in text:
        text = f"{text} (default: {default})"
    return text.replace("%", "%%")


def _int_or_words(annotation: Any) -> tuple[str, ...]:
    """The words of an ``int | Literal["auto"]`` field (``("auto",)``); empty for any other type."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return ()
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    literals = [a for a in args if typing.get_origin(a) is typing.Literal]
    if int not in args or len(literals) + 1 != len(args):
        return ()
    return tuple(str(w) for lit in literals for w in typing.get_args(lit))


def _int_or(words: tuple[str, ...]) -> Callable[[str], int | str]:
    """argparse's type of an ``int | Literal[...]`` flag: one of ``words`` (``--pp auto``), or an int."""

    def convert(text: str) -> int | str:
        if text.strip().lower() in words:
            return text.strip().lower()
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"invalid int value: {text!r} (give an integer or {' or '.join(words)})"
            ) from None

    return convert


def _argument(model: type[BaseModel], name: str, field: FieldInfo, snake: str) -> dict[str, Any]:
    """``add_argument``'s keywords for one field."""
    base = _base(field.annotation)
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    kw: dict[str, Any] = {"dest": _key(name, field), "help": _help(model, name, field, snake)}
    if field.is_required():
        kw["required"] = True
    elif issubclass(model, BaseSettings):
        kw["default"] = None  # not given: the environment, then the field's default
    else:
        kw["default"] = field.get_default(call_default_factory=True)
    if base is bool:
        return {**kw, "action": "store_true"}
    if typing.get_origin(base) is typing.Literal:
        return {**kw, "choices": typing.get_args(base)}
    if words := _int_or_words(base):
        return {**kw, "type": _int_or(words), "metavar": extra.get("metavar") or f"{{N,{','.join(words)}}}"}
    item = typing.get_args(base)[0] if typing.get_origin(base) is list else None
    if extra.get("action") == "append":
        kw.update(action="append", type=_base(item) if item else str)
    elif "nargs" in extra:
        kw.update(nargs=extra["nargs"], type=_base(item) if item else str)
    elif item is not None:
        kw.update(type=str, metavar="N,N,...")
    else:  # a field with a before-validator reads the text itself (``--max-memory-per-rank 4GiB``)
        reads_text = any(isinstance(m, BeforeValidator | PlainValidator) for m in field.metadata)
        kw.update(type=base if base in (int, float) and not reads_text else str)
    kw.setdefault("metavar", extra.get("metavar") or _key(name, field).upper())
    return kw


def add_settings_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    model: type[BaseModel],
    *,
    groups: Mapping[str, Collection[str]] = {},
) -> None:
    """One flag per field of ``model``: those in no group first, then each of ``groups``' sections
    in its order (a nested settings model listed there gives its flags to that section; one in no
    group is a section titled by the field's description)."""
    snake = "|".join(sorted((n for n in _all_names(model) if "_" in n), key=len, reverse=True))
    grouped = {name for names in groups.values() for name in names}
    fields = model.model_fields
    for name, field in fields.items():
        if name not in grouped:
            _add_field(parser, model, name, field, snake, title=field.description or name)
    for title, names in groups.items():
        section = parser.add_argument_group(title)
        for name in names:
            _add_field(section, model, name, fields[name], snake, title=None)


def _add_field(
    parser: Any, model: type[BaseModel], name: str, field: FieldInfo, snake: str, *, title: str | None
) -> None:
    """The flag of one field; a nested settings model's flags (in a section ``title`` when given)."""
    inner = nested_model(field)
    if inner is None:
        parser.add_argument(flag(_key(name, field)), **_argument(model, name, field, snake))
    else:
        add_settings_arguments(parser.add_argument_group(title) if title else parser, inner)


def _all_names(model: type[BaseModel]) -> list[str]:
    """The field names of ``model`` and of the settings models it nests."""
    names = []
    for name, field in model.model_fields.items():
        inner = nested_model(field)
        names += _all_names(inner) if inner is not None else [name]
    return names


def _flags_in(text: str, names: str) -> str:
    """``names`` (a regex alternation of field names) in ``text`` as their flags."""
    return re.sub(rf"(?<![\w-])({names})(?!\w)", lambda m: flag(m.group(1)), text) if names else text


class InvalidSettings(Exception):
    """A settings model's ``ValidationError``, with what the user typed to say it in one line."""

    def __init__(self, err: ValidationError, *, model: type[BaseModel], given: Collection[str]) -> None:
        super().__init__(str(err))
        self.err, self.model, self.given = err, model, given

    def line(self) -> str:
        """Every problem, each named by its flag or environment variable (``error_line``)."""
        return error_line(self.err, model=self.model, given=self.given)

    def usage(self) -> str:
        """The first problem as argparse says a bad value: ``argument --seq-len: must be >= 1 (got -5)``."""
        e = self.err.errors()[0]
        loc = [str(x) for x in e.get("loc", ())]
        where = f"argument {flag(loc[0])}{_item(loc)}: " if loc else ""
        return where + _message(e)


def build_settings(values: Mapping[str, Any], model: type[BaseModel]) -> BaseModel:
    """``model`` from the flags given in ``values`` (None: not given), nested settings models built
    first from their own flags; ``InvalidSettings`` when it does not validate."""
    given: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        inner = nested_model(field)
        if inner is not None:
            given[name] = build_settings(values, inner)
        elif values.get(_key(name, field)) is not None:
            given[_key(name, field)] = values[_key(name, field)]
    try:
        return model(**given)
    except ValidationError as err:
        raise InvalidSettings(err, model=model, given=given) from None


def _item(loc: list[str]) -> str:
    """`` (item 2)`` when the error is about one item of a list field (its location's index 1)."""
    return f" (item {int(loc[1]) + 1})" if len(loc) > 1 and loc[1].isdigit() else ""


def _message(e: Any) -> str:
    return str(e.get("msg", "")).removeprefix("Value error, ").removeprefix("invalid settings: ")


def error_line(err: ValidationError, *, model: type[BaseModel], given: Collection[str]) -> str:
    """A ``ValidationError`` of the settings ``model`` as one line: each problem with the flag (when
    it was given on the command line) or the environment variable (else) it came from, and the value;
    the model's field names in its own messages (``min_replicas=3``) become their flags."""
    parts = []
    for e in err.errors():
        loc = [str(x) for x in e.get("loc", ())]
        msg = _message(e)
        if not loc:
            parts.append(msg)
            continue
        name = loc[0]
        where = flag(name) if name in given else f"{ENV_PREFIX}{name.upper()}"
        value = e.get("input")
        shown = f" (got {value!r})" if isinstance(value, int | float | str) and len(repr(value)) < 60 else ""
        parts.append(f"{where}{_item(loc)}: {msg}{shown}")
    line = "; ".join(parts)
    return _flags_in(line, "|".join(sorted(model.model_fields, key=len, reverse=True)))


def add_command(sub: argparse._SubParsersAction, command: Command) -> argparse.ArgumentParser:
    """``command`` as a subparser of ``sub``: its flags, and ``args.shardserve_command`` set to it
    (a name no settings field takes: export-overlay has a ``--command`` flag)."""
    parser = sub.add_parser(command.name, help=command.help, description=command.description)
    add_settings_arguments(parser, command.settings, groups=command.groups)
    parser.set_defaults(shardserve_command=command, shardserve_parser=parser)
    return parser
