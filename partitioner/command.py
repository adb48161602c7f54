"""A console-script command as data, and the field validators its settings models share.

Each package describes its ``shardserve`` subcommands as ``Command`` records (name, help texts, one
pydantic settings model, the function that runs it); ``shardserve/cli.py`` turns them into
subparsers, one flag per settings field (``shardserve/flags.py``). This module knows nothing of
argparse: a settings model says what it needs through its fields (type, default, description,
``Literal`` choices) and ``json_schema_extra`` hints (``nargs``, ``action``, ``metavar``).

    PLAN = Command("plan", help="...", description="...", settings=PlanSettings, run=cmd_plan)
    batch_size: Annotated[int, AfterValidator(at_least(1))] = Field(8, description="...")
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

logger = logging.getLogger(__name__)


class Settings(BaseModel):
    """The base of a command's settings model: frozen, and an unknown field is an error."""

    model_config = ConfigDict(frozen=True, extra="forbid")


@dataclass(frozen=True)
class Command:
    """One ``shardserve`` subcommand.

    ``groups``: help-section title -> the fields listed under it (the others under "options"; a
    field that is itself a settings model is a section of its own, titled by its description).
    ``invalid``: how a settings ``ValidationError`` is reported: None, as a usage mistake
    (``shardserve plan: error: argument --batch-size: must be >= 1 (got 0)``); else the words before
    the problems (``error: invalid serve settings: --pp: ...``). Both exit 2."""

    name: str
    help: str
    description: str
    settings: type[BaseModel]
    run: Callable[[Any], int]
    groups: Mapping[str, Sequence[str]] = field(default_factory=dict)
    invalid: str | None = None


def at_least(minimum: int) -> Callable[[int], int]:
    """A field validator: an integer >= ``minimum`` ("must be >= 1 (got 0)")."""

    def check(value: int) -> int:
        if value < minimum:
            raise ValueError(f"must be >= {minimum} (got {value})")
        return value

    return check


def positive_number(value: float) -> float:
    """A field validator: a finite number > 0 ("must be a number > 0 (got nan)")."""
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"must be a number > 0 (got {value:g})")
    return value


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
