"""The ``shardserve`` console script: one entry point, a subcommand per job.

shardserve plan --model minilm --pp 2 --tp 2     # how the model is split
shardserve verify --model tiny-bert --pp 2 --tp 2  # parity with transformers
shardserve --help
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from loadtest import cli as loadtest_cli
from partitioner import cli as partitioner_cli
from serving import serve_cli
from training import cli as training_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardserve",
        description="Model-parallel (pipeline + tensor parallel) question-answering server and trainer.",
    )
    parser.add_argument(
        "--log-level",
        default=os.environ.get("SHARDSERVE_LOG_LEVEL", "WARNING"),
        help="logging level: DEBUG, INFO, WARNING, ERROR (default: %(default)s)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve_cli.add_subcommands(sub)
    partitioner_cli.add_subcommands(sub)
    training_cli.add_subcommands(sub)
    loadtest_cli.add_subcommands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return partitioner_cli.main_guard(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
