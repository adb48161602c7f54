"""The ``shardserve`` console script: one entry point, a subcommand per job (each package adds its own).

Every package describes its commands as data (``shardserve.partitioner.command.Command``); this module makes
them subparsers (flags generated from each command's settings model, ``shardserve/flags.py``),
builds the settings from the flags given, and runs the command under the error policy
(``shardserve/errors.py``). It also composes the programs ``shardserve worker`` may run.

    shardserve plan --model minilm --pp 2 --tp 2     # how the model is split
    shardserve verify --model tiny-bert --pp 2 --tp 2  # parity with transformers
    shardserve --help
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import typing

from shardserve import __version__
from shardserve.errors import main_guard, print_error
from shardserve.flags import InvalidSettings, add_command, add_settings_arguments, build_settings
from shardserve.loadtest.cli import LOADTEST
from shardserve.partitioner.cli import PLAN
from shardserve.partitioner.command import Command
from shardserve.partitioner.runtime.worker_command import worker_command
from shardserve.partitioner.stream.program import STREAM_PROGRAM
from shardserve.partitioner.stream.verify_command import VERIFY
from shardserve.serving.frontend.cli import SERVE
from shardserve.training.cli import EVAL, EXPORT_OVERLAY, TRAIN
from shardserve.training.quantize import QUANTIZE
from shardserve.training.rank import TRAIN_PROGRAM

logger = logging.getLogger(__name__)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
WORKER = worker_command((STREAM_PROGRAM, TRAIN_PROGRAM))  # what `shardserve worker` may run
COMMANDS: tuple[Command, ...] = (
    SERVE, PLAN, VERIFY, WORKER, TRAIN, EVAL, QUANTIZE, EXPORT_OVERLAY, LOADTEST,
)  # fmt: skip


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (not the whole usage block) pointing at --help."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The console script's parser: ``--log-level`` and a subparser per command of ``COMMANDS``."""
    parser = OneLineErrorParser(
        prog="shardserve",
        description="Model-parallel (pipeline + tensor parallel) question-answering server and trainer.",
    )
    parser.add_argument("--version", action="version", version=f"shardserve {__version__}")
    _add_log_level(parser, default=os.environ.get("SHARDSERVE_LOG_LEVEL", "WARNING").upper())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        # `shardserve serve --log-level INFO` works too; unset, the top-level value stands
        _add_log_level(add_command(sub, command), default=argparse.SUPPRESS)
    return parser


def _add_log_level(parser: argparse.ArgumentParser, *, default: str) -> None:
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=default,
        help=f"logging level: {', '.join(LOG_LEVELS)} (default: WARNING, or SHARDSERVE_LOG_LEVEL); "
        "accepted before or after the command",
    )


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """``shardserve serve``'s flags on ``parser`` (for a parser of one's own, e.g. to read its help)."""
    add_settings_arguments(parser, SERVE.settings, groups=SERVE.groups)


def settings_from_args(args: argparse.Namespace) -> typing.Any:
    """The parsed command's settings model from the flags given (``InvalidSettings`` if not valid)."""
    return build_settings(vars(args), args.shardserve_command.settings)


def main(argv: list[str] | None = None) -> int:
    """Run ``shardserve ARGV``; its exit status."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    if args.log_level not in LOG_LEVELS:  # from SHARDSERVE_LOG_LEVEL (argparse checks the flag)
        return print_error(f"SHARDSERVE_LOG_LEVEL={args.log_level!r}: choose from {', '.join(LOG_LEVELS)}")
    os.environ["SHARDSERVE_LOG_LEVEL"] = args.log_level  # worker ranks log at the same level
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    command: Command = args.shardserve_command
    try:
        settings = settings_from_args(args)
    except InvalidSettings as err:
        if command.invalid is None:  # as argparse says a bad value (exit 2)
            args.shardserve_parser.error(err.usage())
        return print_error(f"{command.invalid}: {err.line()}")
    return main_guard(command.run, settings)


if __name__ == "__main__":
    sys.exit(main())
