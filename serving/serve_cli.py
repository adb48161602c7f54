"""``shardserve serve``: run the HTTP QA server (uvicorn) with settings from flags and SHARDSERVE_* vars.

    shardserve serve                                  # default model, 0.0.0.0:8000, 1 replica, pp=1 tp=1
    shardserve serve --model tiny-bert --pp 2 --min-replicas 1 --max-replicas 3 --admin-token s3cret
    SHARDSERVE_PORT=9000 shardserve serve             # every flag has a SHARDSERVE_<NAME> variable
    shardserve serve --help                           # every flag, its default and its variable

The flags are generated from ``serving.settings.ServeSettings`` (one source of truth): a flag given
on the command line wins over the environment, which wins over the default. SIGTERM/SIGINT flip
readiness to 503 at once, let admitted requests finish (bounded by --drain-timeout-s), stop the
gangs and exit 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import types
import typing
from typing import Any

import uvicorn
from pydantic import ValidationError

logger = logging.getLogger(__name__)


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


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ServeSettings field, with its description, default and environment variable."""
    from serving.settings import ServeSettings

    for name, field in ServeSettings.model_fields.items():
        kind, metavar = _flag_type(field.annotation)
        default = field.get_default(call_default_factory=True)
        if isinstance(default, list):
            default = ",".join(map(str, default))
        help_text = f"{field.description} (default: {default}; env SHARDSERVE_{name.upper()})"
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            type=kind,
            default=None,
            metavar=metavar or name.upper(),
            help=help_text.replace("%", "%%"),
        )


def settings_from_args(args: argparse.Namespace) -> Any:
    """ServeSettings from the flags that were given (the rest: environment, then defaults)."""
    from serving.settings import ServeSettings

    given = {k: v for k, v in vars(args).items() if k in ServeSettings.model_fields and v is not None}
    return ServeSettings(**given)


def cmd_serve(args: argparse.Namespace) -> int:
    from models.registry import resolve_model
    from serving.app import build_app

    try:
        settings = settings_from_args(args)
    except ValidationError as err:
        print(f"error: invalid serve settings:\n{err}", file=sys.stderr)
        return 2
    resolve_model(settings.model)  # fail fast on an unknown model (ModelConfigError -> exit 2)
    app = build_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower(),
        timeout_graceful_shutdown=int(settings.drain_timeout_s) or None,
        lifespan="on",
    )
    server = DrainingServer(config, app)
    server.run()
    if not server.started:
        logger.error("the server did not start (see the errors above)")
        return 1
    return 0


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose SIGTERM/SIGINT first flips readiness to 503, then shuts down gracefully
    and exits 0 (plain uvicorn re-raises the signal after shutdown: the process would end with -15)."""

    def __init__(self, config: uvicorn.Config, app: Any) -> None:
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig: int, frame: Any) -> None:
        state = self._app.state
        if not state.shutting_down:
            logger.warning("signal %d: readiness -> 503, draining", sig)
        state.shutting_down = True
        engine = getattr(state, "engine", None)
        if engine is not None:
            engine.begin_drain()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Register this package's ``shardserve`` subcommands."""
    p = sub.add_parser(
        "serve",
        help="run the HTTP question-answering server",
        description=(
            "Serve extractive question answering over HTTP (POST /v1/qa, /v1/qa/batch; GET /v1/models, "
            "/healthz, /readyz, /metrics; /admin/* with --admin-token; OpenAPI at /docs). Each replica is "
            "a gang of pp x tp worker processes. Defaults: the embedded default model on 0.0.0.0:8000, "
            "1 replica, pp=1, tp=1. Every flag also reads SHARDSERVE_<FLAG> from the environment."
        ),
    )
    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)
