"""The API processes of ``shardserve serve --api-workers N`` (N >= 2), kept alive by the engine core.

vLLM's ``--api-server-count``: one Python process cannot answer HTTP fast enough for a fast model
(docs/benchmarks.md: 4 ms of CPU per answer capped an H200 at 0.03x its forward). With N >= 2 the
server process becomes the *core* (the repository, the engines, the gangs, metrics and status;
``serving/engine/core_server.py``) and starts N API processes (``run_api_worker``), each running the
server's app in its API role (``serving/frontend/api_role.py``) on its own ``SO_REUSEPORT`` socket
of the server's port.

Each process is started with the ``spawn`` method (the core has torch, ZeroMQ and gRPC threads: no
fork) and watched: one that dies is replaced (its requests given back in the core,
``CoreServer.forget_worker``; other processes' requests never notice), after a back-off that
doubles from ``RESTART_MIN_S`` to ``RESTART_MAX_S``. A process that dies ``GIVE_UP_AFTER`` times
in a row before it connects is not restarted again; when none is left, ``fatal_error`` stops the
server. ``begin_drain`` (the server's first signal) sends each a SIGTERM, once: it drains its
connections as the server does (``DrainingHttpServer``); ``stop`` kills what is left after ``timeout_s``.

    held = hold_ports(app, config)      # the CLI, before uvicorn runs the core without a socket
    pool = ApiWorkerPool(count=4, settings=settings, core=core, host="0.0.0.0", port=8000, metrics=metrics)
    await pool.start(); pool.connected(); pool.describe(); await pool.stop(timeout_s=5)

Tests: ``pytest tests/serving/frontend/test_api_workers.py``.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from shardserve.serving.engine.core_server import CoreServer
from shardserve.serving.frontend.api_role import CoreLink, reuseport_socket
from shardserve.serving.frontend.http.protocol import DrainingHttpServer, uvicorn_config
from shardserve.serving.metrics import ServingMetrics

logger = logging.getLogger(__name__)

WATCH_S = 0.1
RESTART_MIN_S = 0.5
RESTART_MAX_S = 10.0
STABLE_S = 60.0  # alive this long: the back-off starts over
GIVE_UP_AFTER = 3  # deaths in a row before connecting
STOP_TIMEOUT_S = 5.0  # SIGTERM, then this long to finish writing answers, then SIGKILL


@dataclass(frozen=True)
class WorkerSpec:
    """What a spawned API process needs (pickled by multiprocessing: the key never on argv or in the
    environment)."""

    settings: Any  # ServeSettings without the admin token
    link: CoreLink
    host: str
    port: int
    log_level: int


def run_api_worker(spec: WorkerSpec) -> None:
    """An API process (spawned): the server's app in its API role, uvicorn on its own reuseport socket;
    SIGTERM: its connections drained as the server's (``DrainingHttpServer``), then uvicorn's stop."""
    from shardserve.serving.frontend.app import build_app

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the core decides
    fmt = f"%(asctime)s {spec.link.identity} %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=spec.log_level, format=fmt)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(1)  # tokenizing and decoding: the cores are the ranks'
    app = build_app(spec.settings, core=spec.link)
    sock = reuseport_socket(spec.host, spec.port, listen=True)
    config = uvicorn_config(spec.settings, app)
    DrainingHttpServer(config, drain_timeout_s=spec.settings.drain_timeout_s).run(sockets=[sock])


@dataclass
class _Slot:
    index: int
    incarnation: int = -1
    process: Any = None
    started_at: float = 0.0
    connected: bool = False
    early_deaths: int = 0  # in a row, before connecting
    backoff_s: float = RESTART_MIN_S
    restart_at: float | None = None
    given_up: bool = False
    restarts: int = 0
    history: list[int] = field(default_factory=list)  # exit codes

    @property
    def identity(self) -> str:
        return f"w{self.index}.{self.incarnation}"


class ApiWorkerPool:
    """See module doc."""

    def __init__(
        self,
        *,
        count: int,
        settings: Any,
        core: CoreServer,
        host: str,
        port: int,
        metrics: ServingMetrics,
    ) -> None:
        self.settings = settings.model_copy(update={"admin_token": None})  # admin routes run in the core
        self.core, self.host, self.port, self.metrics = core, host, port, metrics
        self.slots = [_Slot(i) for i in range(count)]
        self._ctx = multiprocessing.get_context("spawn")
        self._stopping = False
        self._terminated: set[int] = set()  # pids sent SIGTERM (a second one would cut their drain short)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        for slot in self.slots:
            self._spawn(slot)
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="shardserve-api-workers")

    def connected(self) -> bool:
        """Every live API process has connected to the core (the server answers on its port)."""
        self._note_connected()
        return all(s.connected for s in self.slots if not s.given_up) and not self.fatal_error

    @property
    def fatal_error(self) -> str | None:
        if self.slots and all(s.given_up for s in self.slots):
            codes = self.slots[0].history[-GIVE_UP_AFTER:]
            return f"no API process could start (exit codes {codes}; the log above has the reason)"
        return None

    def describe(self) -> list[dict[str, Any]]:
        """Each API process: index, pid, alive, connected, restarts."""
        return [
            {
                "index": s.index,
                "pid": s.process.pid if s.process is not None else None,
                "alive": s.process is not None and s.process.is_alive(),
                "connected": s.connected,
                "restarts": s.restarts,
            }
            for s in self.slots
        ]

    def begin_drain(self) -> None:
        """The server drains (signal-safe): none is restarted from now on, and each drains its
        connections (SIGTERM: their answers under way go out, then they exit)."""
        self._stopping = True
        for s in self.slots:
            if s.process is not None and s.process.pid not in self._terminated and s.process.is_alive():
                self._terminated.add(s.process.pid)
                s.process.terminate()  # SIGTERM

    async def stop(self, *, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Drain (``begin_drain``, once) and wait ``timeout_s`` for the processes to exit; kill the rest."""
        self.begin_drain()
        if self._task is not None:
            self._task.cancel()
        live = [s.process for s in self.slots if s.process is not None and s.process.pid in self._terminated]
        deadline = time.monotonic() + timeout_s
        while any(p.is_alive() for p in live) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for p in live:
            if p.is_alive():
                logger.warning("API process %d did not stop within %.1f s: killed", p.pid, timeout_s)
                p.kill()
            p.join(timeout=1.0)

    # ------------------------------------------------------------------ internals
    def _spawn(self, slot: _Slot) -> None:
        slot.incarnation += 1
        slot.connected = False
        link = CoreLink(
            endpoint=self.core.endpoint,
            key=self.core.key,
            identity=slot.identity,
            parent_pid=os.getpid(),
            grpc_address=self.core.grpc_address if self.settings.grpc_port is not None else None,
        )
        spec = WorkerSpec(
            settings=self.settings,
            link=link,
            host=self.host,
            port=self.port,
            log_level=logging.getLogger().getEffectiveLevel(),
        )
        slot.process = self._ctx.Process(
            target=run_api_worker, args=(spec,), name=f"shardserve-api-{slot.identity}", daemon=True
        )
        slot.process.start()
        slot.started_at = time.monotonic()
        slot.restart_at = None
        self._gauge()
        logger.info("API process %s started (pid %d)", slot.identity, slot.process.pid)

    def _note_connected(self) -> None:
        known = set(self.core.workers)
        for s in self.slots:
            if not s.connected and s.identity in known and s.process is not None and s.process.is_alive():
                s.connected, s.early_deaths = True, 0
                self._gauge()

    def _gauge(self) -> None:
        alive = sum(1 for s in self.slots if s.process is not None and s.process.is_alive())
        self.metrics.api_workers.set(alive)

    async def _watch(self) -> None:
        while not self._stopping:
            self._note_connected()
            now = time.monotonic()
            for slot in self.slots:
                p = slot.process
                if slot.given_up or p is None:
                    continue
                if slot.restart_at is None and not p.is_alive():
                    self._died(slot, now)
                elif slot.restart_at is not None and now >= slot.restart_at and not self._stopping:
                    slot.restarts += 1
                    self.metrics.api_worker_restarts.inc()
                    self._spawn(slot)
                elif slot.connected and now - slot.started_at > STABLE_S:
                    slot.backoff_s = RESTART_MIN_S
            await asyncio.sleep(WATCH_S)

    def _died(self, slot: _Slot, now: float) -> None:
        code = slot.process.exitcode
        slot.history.append(code)
        dropped = self.core.forget_worker(slot.identity)
        self._gauge()
        if self.core.stopping():  # the server drains (a SIGTERM to the whole group reached it too)
            slot.given_up = True
            return
        if not slot.connected:
            slot.early_deaths += 1
        if slot.early_deaths >= GIVE_UP_AFTER:
            slot.given_up = True
            logger.error(
                "API process %s died %d times before it connected: not restarted",
                slot.identity,
                slot.early_deaths,
            )
            return
        logger.error(
            "API process %s (pid %d) exited with %s (%d requests of it dropped): restarting in %.1f s",
            slot.identity,
            slot.process.pid,
            code,
            dropped,
            slot.backoff_s,
        )
        slot.restart_at = now + slot.backoff_s
        slot.backoff_s = min(RESTART_MAX_S, 2 * slot.backoff_s)


def hold_ports(app: Any, config: uvicorn.Config) -> list[socket.socket]:
    """The core's side of ``--api-workers`` before uvicorn runs: hold the HTTP (and gRPC) port with
    bound, non-listening ``SO_REUSEPORT`` sockets (``--port 0``: the port is chosen here; no other
    server can take it; the API processes join it) and give the app the pool to start. The caller
    runs uvicorn with no socket of its own and closes these after."""
    settings = app.state.settings
    held = [reuseport_socket(settings.host, settings.port, listen=False)]
    config.port = port = held[0].getsockname()[1]
    if settings.grpc_port is not None:  # the API processes serve it too (grpc/forward.py)
        held.append(reuseport_socket(settings.host, settings.grpc_port, listen=False))
        app.state.settings = settings.model_copy(update={"grpc_port": held[-1].getsockname()[1]})
    app.state.api_pool_factory = lambda core: ApiWorkerPool(
        count=settings.api_worker_count,
        settings=app.state.settings,
        core=core,
        host=settings.host,
        port=port,
        metrics=app.state.metrics,
    )
    return held
