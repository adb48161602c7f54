"""``shardserve serve``: run the HTTP QA server (uvicorn) with settings from flags and SHARDSERVE_* vars.

    shardserve serve                                  # default model, 0.0.0.0:8000, 1 replica, pp=1 tp=1
    shardserve serve --model tiny-bert --pp 2 --min-replicas 1 --max-replicas 3 --admin-token s3cret
    shardserve serve --model default --pp auto --max-memory-per-rank 2GiB   # the fewest ranks that fit
    SHARDSERVE_PORT=9000 shardserve serve             # every flag has a SHARDSERVE_<NAME> variable
    shardserve serve --help                           # every flag, its default and its variable

``SERVE`` is the command as data; the console script generates its flags from
``shardserve.serving.frontend.settings.ServeSettings`` (one source of truth): a flag given
on the command line wins over the environment, which wins over the default. SIGTERM/SIGINT flip
readiness to 503 at once, let admitted requests finish (bounded by --drain-timeout-s), stop the
gangs and exit 0; a second signal stops now (admitted requests answered 503, exit 130).

A signal during start-up, before uvicorn serves (the imports, the model's checks, the app's start-up),
stops at once: one warning line, the ranks of any gang being started killed, exit 128 + the signal
(143 for SIGTERM, 130 for SIGINT), no traceback (``StartupSignals``). Once serving, a gang that was
never ready is killed at shutdown rather than waited for (``shardserve.serving.frontend.app``'s lifespan).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from types import FrameType, TracebackType
from typing import Any

import uvicorn

from shardserve.partitioner.command import Command
from shardserve.partitioner.layout_flags import LAYOUT_FIELDS, LAYOUT_SECTION
from shardserve.partitioner.runtime.gang_flags import GANG_FIELDS
from shardserve.serving.frontend.http.protocol import DrainingHttpServer, uvicorn_config
from shardserve.serving.frontend.layout import fit_serve_layout
from shardserve.serving.frontend.placement_flags import PLACEMENT_FIELDS
from shardserve.serving.frontend.scheduler_flags import SCHEDULER_FIELDS
from shardserve.serving.frontend.settings import ServeSettings
from shardserve.serving.redact import one_line

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StoppedDuringStartup(BaseException):
    """A SIGTERM/SIGINT before uvicorn serves: it unwinds ``cmd_serve`` from whatever start-up is
    doing, as KeyboardInterrupt would (a BaseException: no ``except Exception`` on the way stops it)."""

    def __init__(self, sig: int) -> None:
        super().__init__(sig)
        self.sig = sig


class StartupSignals:
    """``cmd_serve``'s SIGTERM/SIGINT handler, outside uvicorn's own (``DrainingServer.handle_exit``,
    installed while uvicorn runs; uvicorn puts this one back when it is done).

    Until the server has started, a signal raises ``StoppedDuringStartup`` in the main thread (the
    model's checks take seconds; the default SIGTERM ended the process silently with 143, SIGINT with
    a traceback); from then on (uvicorn's teardown) it is the server's, which counts it.

        with StartupSignals() as signals:
            ...                      # load: StoppedDuringStartup on a signal
            signals.server = server  # then server.run()
    """

    def __init__(self) -> None:
        self.server: DrainingServer | None = None
        self.caught: int | None = None  # the signal raised as StoppedDuringStartup
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StartupSignals:
        if threading.current_thread() is threading.main_thread():  # (signals reach the main thread only)
            self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def check(self) -> None:
        """Raise ``StoppedDuringStartup`` when a signal came whose exception something swallowed
        (raised while a finalizer ran, it is only printed): the last moment before uvicorn runs."""
        if self.caught is not None:
            raise StoppedDuringStartup(self.caught)

    def _handle(self, sig: int, frame: FrameType | None) -> None:
        server = self.server
        if server is not None and (server.started or server.startup_signal is not None):
            server.handle_exit(sig, frame)
        elif self.caught is None:  # (a second one while unwinding: already stopping)
            self.caught = sig
            raise StoppedDuringStartup(sig)


def stopped_during_startup(sig: int) -> int:
    """Kill the ranks of any gang being started, say so in one line; exit status 128 + ``sig``."""
    from shardserve.partitioner.runtime.gang import kill_live_gangs

    kill_live_gangs()  # (the lifespan killed the gangs it started; atexit would too, later)
    logger.warning("%s during start-up: stopped before serving", signal.Signals(sig).name)
    return 128 + sig


def cmd_serve(settings: ServeSettings) -> int:
    """``shardserve serve`` with its validated settings: serve until a signal stops it."""
    with StartupSignals() as signals:
        try:
            return _serve(settings, signals)
        except StoppedDuringStartup as stop:
            return stopped_during_startup(stop.sig)


def _serve(settings: ServeSettings, signals: StartupSignals) -> int:
    from shardserve.models.hf_weights import CheckpointError
    from shardserve.serving.engine.builder import load_model, replica_cap
    from shardserve.serving.frontend.app import build_app

    for flag, port in (("--port", settings.port), ("--grpc-port", settings.grpc_port)):
        if port is not None and (problem := bind_problem(settings.host, port, flag=flag)):
            print(f"error: {problem}", file=sys.stderr)  # before the model loads (seconds)
            return 2
    try:  # --pp/--tp auto chosen, and the layout checked against --max-memory-per-rank: no weights yet
        settings, chosen = fit_serve_layout(settings)
    except ValueError as err:  # LayoutDoesNotFit / InfeasiblePlanError, or the chosen layout's problems
        print(f"error: {err}", file=sys.stderr)  # one line of numbers, whole (one_line would cut it)
        return 2
    if chosen is not None:
        print(f"shardserve: {chosen}", flush=True)
    # fail fast, in one line, on what a user gets wrong: model, weights, partition, limits; of several
    # models, one that fails is reported and the others served (it fails only when none loads)
    fleet = settings.fleet_config()  # the models and the pool are checked at any dtype
    try:
        replica_cap(fleet)
    except ValueError as err:
        print(f"error: {one_line(err, scrub=False)}", file=sys.stderr)
        return 2
    models, failed = {}, []
    for name, ref in settings.models():
        logger.info("loading %s (%s)", name, ref)
        try:
            models[name] = load_model(fleet, ref, generation=0)
        except (ValueError, OSError, CheckpointError) as err:
            failed.append(
                f"{name}: {one_line(err, scrub=False)}"
                if len(settings.models()) > 1
                else one_line(err, scrub=False)
            )
    if not models:
        print(f"error: {'; '.join(failed)}", file=sys.stderr)
        return 2
    for line in failed:
        print(f"warning: model {line} (serving the others)", file=sys.stderr)
    app = build_app(settings, models=models)
    config = uvicorn_config(settings, app)
    sockets, reserved = None, []
    if settings.api_worker_count > 1:  # API processes listen; this process (the core) holds the ports
        from shardserve.serving.frontend.api_workers import hold_ports

        reserved, sockets = hold_ports(app, config), []
    server = DrainingServer(config, app)
    signals.check()
    signals.server = server
    try:
        server.run(sockets=sockets)
    finally:
        for sock in reserved:
            sock.close()
    if server.startup_signal is not None:
        return stopped_during_startup(server.startup_signal)
    if server.fatal_error is not None:
        print(f"error: {server.fatal_error}", file=sys.stderr)
        return 1
    if not server.started:
        logger.error("the server did not start (see the errors above)")
        return 1
    return 130 if server.signals > 1 else 0  # 130: stopped by a second signal without draining


def bind_problem(host: str, port: int, *, flag: str = "--port") -> str | None:
    """Why the server could not listen on ``host:port`` (a name that does not resolve, an address in
    use or not on this machine), as one line naming the flags (``flag``: the port's); None when it can."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as err:
        return f"--host {host}: {err.strerror}"
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as err:
            return f"--host {host} {flag} {port}: cannot listen there: {err.strerror}"
    return None


def startup_line(state: Any, url: str) -> str:
    """``shardserve: serving MODEL at URL (precision ..., compile ..., plan ..., replicas ...)``; with
    several models, ``NAME=MODEL`` for each (replicas are per model)."""
    settings, precision, engines = state.settings, state.precision, state.models.engines()
    if not engines:
        return f"shardserve: serving no model at {url} (none could be loaded; see the errors above)"
    plan = engines[0].model.plan()
    stages = ", ".join(f"stage {st.index}: layers {st.layer_start}-{st.layer_end - 1}" for st in plan.stages)
    lo, hi = settings.replica_bounds
    replicas = str(lo) if lo == hi else f"{lo}..{hi} (autoscaling)"
    if len(engines) == 1:
        served = engines[0].model.source.name
    else:
        served = ", ".join(f"{e.name}={e.model.source.name}" for e in engines)
        replicas += " per model"
    layout = f"plan pp={plan.dims.pp} tp={plan.dims.tp} [{stages}], replicas {replicas} x "
    placed = state.models.placement
    if placed is not None and placed.choice is not None:
        cfg = placed.config
        layout = (
            f"placement {cfg.policy} on {cfg.devices} devices: {placed.groups.placement.describe()}, "
            f"predicted SLO attainment {placed.choice.result.attainment:.1%} at {cfg.rate:g} req/s, "
            f"CV {cfg.cv:g}, SLO {cfg.slo_scale:g}x; "
        )
    n = settings.api_worker_count
    api = f"; {n} API processes on the port (--api-workers)" if n > 1 else ""
    if (grpc_port := getattr(state, "grpc_port", None)) is not None:
        host = url.rsplit(":", 1)[0].removeprefix("http://")
        url += f" and gRPC {host}:{grpc_port}"
    return (
        f"shardserve: serving {served} at {url} (precision {precision.name}: {precision.reason}; "
        f"{'compiled stages; ' if state.compile else ''}{layout}"
        f"{settings.rank_threads} thread(s) per rank, device {settings.device}"
        f"{api})"
    )


class DrainingServer(DrainingHttpServer):
    """uvicorn.Server whose SIGTERM/SIGINT first flips readiness to 503 and drains (the models and
    the HTTP connections, ``DrainingHttpServer``), then shuts down gracefully and exits 0 (plain
    uvicorn re-raises the signal after shutdown: the process would end with -15)."""

    def __init__(self, config: uvicorn.Config, app: Any) -> None:
        super().__init__(config, drain_timeout_s=app.state.settings.drain_timeout_s)
        self._app = app
        self.url: str | None = None
        self.fatal_error: str | None = None
        self._announced_ready = False
        self.signals = 0  # SIGTERM/SIGINT received (handle_exit)
        self.startup_signal: int | None = None  # the first one, when it came before uvicorn served
        self._t0 = time.monotonic()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Start as uvicorn does, then print the URL actually bound (``--port 0``: the real port)."""
        await super().startup(sockets=sockets)
        if not self.started or self.should_exit:
            return
        host, port = self.config.host, self.config.port
        for server in getattr(self, "servers", []):
            for sock in getattr(server, "sockets", None) or []:
                name = sock.getsockname()
                if isinstance(name, tuple):
                    host, port = name[0], name[1]
                    break
        shown = f"[{host}]" if ":" in str(host) else host
        self.url = f"http://{shown}:{port}"
        state = self._app.state
        print(startup_line(state, self.url), flush=True)

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's 0.1 s tick: print "ready" once, and stop when no model's first gang can start."""
        models = getattr(self._app.state, "models", None)
        if models is not None and not self.should_exit:
            if (fatal := models.fatal_error()) is not None and self.fatal_error is None:
                self.fatal_error = fatal
                self._app.state.shutting_down = True
                self.should_exit = True
            elif (pool := self._app.state.api_pool) is not None and (fatal := pool.fatal_error):
                self.fatal_error = fatal
                self._app.state.shutting_down = True
                self.should_exit = True
            elif not self._announced_ready and models.ready() and (pool is None or pool.connected()):
                self._announced_ready = True
                gangs = sum(e.manager.ready for e in models.engines())
                print(
                    f"shardserve: ready at {self.url} ({gangs} replica gang(s) ready, "
                    f"{time.monotonic() - self._t0:.1f} s after start)",
                    flush=True,
                )
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: Any) -> None:
        """First SIGTERM/SIGINT: drain. Second: stop now (admitted requests answered 503, the gangs
        stopped without waiting, exit 130). Third: kill the ranks and exit 130 at once.

        Before uvicorn serves (the app's start-up): stop without serving (nothing was admitted; the
        lifespan kills the gangs it started, none was ever ready) and exit 128 + the signal; a third
        signal kills the ranks and exits at once."""
        state = self._app.state
        models = getattr(state, "models", None)
        self.signals += 1
        if self.startup_signal is not None or not self.started:
            if self.startup_signal is None:
                self.startup_signal = sig
                state.shutting_down = True
            elif self.signals >= 3:
                self._kill_now(sig, 128 + self.startup_signal)
            self.should_exit = True
            return
        if self.signals == 1:
            if not state.shutting_down:
                logger.warning("signal %d: readiness -> 503, draining (send it again to stop now)", sig)
            state.shutting_down = True
            if models is not None:
                models.begin_drain(within_s=state.settings.drain_timeout_s)
            if (pool := getattr(state, "api_pool", None)) is not None:
                pool.begin_drain()  # the API processes drain their connections as this one does
            self.begin_drain()
            return
        if self.signals == 2:
            logger.warning("signal %d again: stopping now, admitted requests are answered 503", sig)
            if models is not None:
                models.abort()
        else:
            self._kill_now(sig, 130)
        self.should_exit = True

    @staticmethod
    def _kill_now(sig: int, code: int) -> None:
        from shardserve.partitioner.runtime.gang import kill_live_gangs

        logger.warning("signal %d a third time: killing the gangs' ranks and exiting now", sig)
        kill_live_gangs()
        os._exit(code)


SERVE = Command(
    "serve",
    help="run the HTTP question-answering server",
    description=(
        "Serve extractive question answering over HTTP and, with --grpc-port, gRPC (POST /v1/qa, /v1/qa/batch; GET /v1/models, "
        "/healthz, /readyz, /metrics; /admin/* with --admin-token; the Open Inference Protocol (KServe v2) "
        "under /v2 and as Triton's gRPC service; OpenAPI at /docs). Each replica is "
        "a gang of pp x tp worker processes. Defaults: the embedded default model on 0.0.0.0:8000, "
        "1 replica, pp=1, tp=1. Every flag also reads SHARDSERVE_<FLAG> from the environment."
    ),
    settings=ServeSettings,
    run=cmd_serve,
    groups={
        LAYOUT_SECTION: LAYOUT_FIELDS,
        "batching, the queue, admission and deadlines (docs: guides/serving)": SCHEDULER_FIELDS,
        "a gang across hosts (docs: guides/deployment)": GANG_FIELDS,
        "many models on shared devices (docs: guides/many-models)": ("placement", *PLACEMENT_FIELDS),
    },
    invalid="invalid serve settings",
)
