"""The ``shardserve`` console script: one entry point, a subcommand per job (each package adds its own).

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

from loadtest import cli as loadtest_cli
from partitioner import cli as partitioner_cli
from partitioner.runtime.remote import SERVE
from serving.frontend import cli as serve_cli
from training import cli as training_cli
from training.remote_program import REMOTE_PROGRAM as TRAIN

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (not the whole usage block) pointing at --help."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="shardserve",
        description="Model-parallel (pipeline + tensor parallel) question-answering server and trainer.",
    )
    _add_log_level(parser, default=os.environ.get("SHARDSERVE_LOG_LEVEL", "WARNING").upper())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve_cli.add_subcommands(sub)
    partitioner_cli.add_subcommands(sub, worker_programs=(SERVE, TRAIN))  # what `shardserve worker` may run
    training_cli.add_subcommands(sub)
    loadtest_cli.add_subcommands(sub)
    for subparser in sub.choices.values():  # `shardserve serve --log-level INFO` works too
        if "--log-level" not in subparser._option_string_actions:
            _add_log_level(subparser, default=argparse.SUPPRESS)  # unset: the top-level value stands
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


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    if args.log_level not in LOG_LEVELS:  # from SHARDSERVE_LOG_LEVEL (argparse checks the flag)
        print(
            f"error: SHARDSERVE_LOG_LEVEL={args.log_level!r}: choose from {', '.join(LOG_LEVELS)}",
            file=sys.stderr,
        )
        return 2
    os.environ["SHARDSERVE_LOG_LEVEL"] = args.log_level  # worker ranks log at the same level
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return partitioner_cli.main_guard(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
