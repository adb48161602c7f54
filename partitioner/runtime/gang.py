"""The gang core: ``pp * tp`` worker processes (``dp * pp * tp`` when training) that start, fail
and stop as one unit, and report what happens to them.

The caller (driver) is not a rank, and the core knows no program: ``GangSpec.program`` runs on
every rank (``rank.py``). Its two users are small: the forward stream
(``partitioner/stream/driver.py``: ``submit()`` micro-batches, futures resolved by a monitor thread)
and training, which starts a gang and ``join()``s it until every rank has finished, handed each of
the program's messages on the way.

Driver and ranks talk over ``channel.py`` (ZeroMQ over TCP, signed messages, a fresh key per gang;
bound to loopback for a gang on this machine). What the core reports (its ``error``, ``healthy``,
per-rank progress and busy time from the heartbeats):

- a rank that raises reports its traceback and exits;
- a rank that dies (``kill -9``) is seen through its process (``rank_process.py``: at once by a
  stream's monitor, within ``poll_s`` elsewhere), whether or not its fork server still lives;
- a rank that stops beating (killed, frozen by SIGSTOP, or cut off by the network) is seen after
  ``heartbeat_timeout_s``, the same rule for ranks spawned here and ranks on other hosts.

Either becomes one ``GangError`` naming the culprit (its traceback or exit signal). Whether a
gang that is alive but slow has stalled is its owner's decision (serving's fleet), which reads
``stuck_ranks()`` for the diagnosis and ends it with ``fail()``.

After a failure the remaining ranks are killed; ``stop()`` stops every rank and joins the
processes (the rendezvous store lives in the driver, so no port outlives the gang). The store and
the channel listen on loopback only (``bound_store``), unless ``GangNetwork`` names the host
address other hosts reach: then the ranks it lists as external are not spawned but joined by
``shardserve worker`` elsewhere (``remote.py``) and watched through their heartbeats alone.

    gang = Gang(GangSpec(source, plan, program=train_rank, extra=...)).start()
    gang.join(on_message=handle)                                   # handle(StepReport(...)), ...
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.context import BaseContext
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from shardserve.partitioner.runtime.channel import ENV_ENDPOINTS, ENV_KEY, DriverChannel
from shardserve.partitioner.runtime.messages import (
    RankFailed,
    RankReady,
    RankStopped,
)
from shardserve.partitioner.runtime.rank import GangSpec, worker_main
from shardserve.partitioner.runtime.rank_process import RankProcess
from shardserve.partitioner.runtime.remote import SPEC_KEY, GangNetwork, publish_spec
from shardserve.partitioner.runtime.wire import new_key

logger = logging.getLogger(__name__)

_LIVE: weakref.WeakSet[Gang] = weakref.WeakSet()  # started, not yet stopped


@atexit.register
def kill_live_gangs() -> None:
    """Kill the ranks of every gang still running. A gang never outlives its driver: this runs at
    interpreter exit, before multiprocessing's own exit hook (registered earlier), which terminates
    and then joins daemonic children and would wait for ever on ranks, as they ignore SIGTERM."""
    for gang in list(_LIVE):
        gang._kill_all()


def bound_store(
    world_size: int, *, timeout: timedelta, host: str = "127.0.0.1", port: int = 0
) -> dist.TCPStore:
    """A rendezvous store (master side) listening on ``host`` only (port 0: a free one).

    ``TCPStore("127.0.0.1", 0, is_master=True)`` listens on EVERY interface (the host name only
    tells clients where to connect) and the store has no authentication, so a local gang would
    expose it to the network. Instead we bind the listening socket ourselves to loopback and hand
    its descriptor to the store (``master_listen_fd``), which owns and closes it from then on.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a fixed port, right after a restart
        sock.bind((host, port))
        sock.listen(max(128, world_size))
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()  # the store closes it when it is destroyed
    try:
        return dist.TCPStore(
            host,
            port,
            world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=timeout,
            master_listen_fd=fd,
            use_libuv=True,
        )
    except BaseException:
        os.close(fd)
        raise


def rank_context(program_module: str) -> BaseContext:
    """How ranks start here: forked from multiprocessing's fork server, a clean process (started by
    exec, as ``spawn`` starts a rank; it never initialises CUDA) that imported torch, the rank's
    runtime and ``program_module`` once (1.5 s of CPU that each spawned rank spent). A 2 x 2 gang of
    a tiny model passed ``verify`` in 2.2 s instead of 4.7 s on 2 cores (docs/benchmarks.md). The
    first gang's program is the one preloaded. The fork server leaves with this process, and so do
    the ranks (``rank.py``: they watch it); where the fork server dies alone, running gangs go on
    (``rank_process.py``) and the next gang starts a new one."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([worker_main.__module__, program_module])  # read when the server starts
    return ctx


class GangError(RuntimeError):
    """A rank of the gang failed; ``rank`` names it (None when several or unknown)."""

    def __init__(self, message: str, *, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


@dataclass
class GangStats:
    submitted: int = 0  # units of work handed to the gang by its user (micro-batches)
    completed: int = 0
    ready_info: dict[int, dict[str, Any]] = field(default_factory=dict)


class Gang:
    """Driver-side handle on one gang of worker processes (the core; see module doc)."""

    def __init__(
        self,
        spec: GangSpec,
        *,
        name: str = "gang",
        start_timeout_s: float = 300.0,
        heartbeat_timeout_s: float = 10.0,
        poll_s: float = 0.05,
        network: GangNetwork | None = None,
    ) -> None:
        self.spec = spec
        self.name = name
        self.start_timeout_s = start_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.network = network or GangNetwork()
        self.poll_s = poll_s
        self.stats = GangStats()
        self.error: GangError | None = None
        self._ctx = rank_context(spec.program.__module__)
        self._procs: dict[int, RankProcess] = {}  # rank -> process, for the ranks started here
        self._started = False  # ranks spawned / awaited, until stop()
        self._stopping = False
        self._killed = threading.Event()  # kill(): a start() in progress gives up
        self._store: dist.TCPStore | None = None
        self._channel: DriverChannel | None = None
        self._backlog: list[Any] = []  # program messages met while starting, for join()
        self._finished: set[int] = set()  # ranks whose program returned (RankStopped)

    # ------------------------------------------------------------------ lifecycle
    @property
    def world_size(self) -> int:
        return self.spec.plan.dims.world_size

    def describe_rank(self, rank: int) -> str:
        dims = self.spec.plan.dims
        stage, tp_rank = dims.coords(rank)
        dp = f"dp {dims.dp_rank(rank)}, " if dims.dp > 1 else ""
        host = self.stats.ready_info.get(rank, {}).get("host")
        where = f" on {host}" if host and host != socket.gethostname() else ""
        return f"rank {rank} ({dp}stage {stage}, tp {tp_rank}){where}"

    def start(self) -> Gang:
        """Spawn every rank and wait until all report ready; raises GangError on any failure."""
        dims = self.spec.plan.dims
        net = self.network
        self._store = bound_store(
            dims.world_size,
            timeout=timedelta(seconds=self.start_timeout_s),
            host=net.host,
            port=net.store_port,
        )
        key = net.key or new_key()
        self._channel = DriverChannel(world_size=dims.world_size, key=key, host=net.host)
        if net.external_ranks:
            if net.program is None:
                raise ValueError(
                    f"ranks {list(net.external_ranks)} are external: GangNetwork names no program"
                )
            publish_spec(
                self._store, self.spec, endpoints=self._channel.endpoints, key=key, program=net.program
            )
            logger.info("%s: waiting for ranks %s to join at %s:%d", self.name, list(net.external_ranks),
                        net.host, self._store.port)  # fmt: skip
        ifname = os.environ.get("GLOO_SOCKET_IFNAME", "lo" if net.host == "127.0.0.1" else None)
        # A rank's OpenMP threads sleep when a parallel region ends instead of spinning: ranks share the
        # cores with the server's tokenizer and HTTP threads, and a spinning team whose thread was
        # descheduled ran 6-8x slower under a burst (the overload run in docs/benchmarks.md).
        # OpenMP reads it when torch loads, in the fork server the first gang starts, so it must be in
        # this process's environment by then (``base_env`` is applied later); a value the user set wins.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        base_env = {
            **os.environ,  # the driver's environment now: the fork server kept the one it started with
            ENV_ENDPOINTS: self._channel.endpoints,
            ENV_KEY: key.hex(),
            "MASTER_ADDR": net.host,
            "MASTER_PORT": str(self._store.port),
            "WORLD_SIZE": str(dims.world_size),
            "SHARDSERVE_DRIVER_STORE": "1",
            "SHARDSERVE_DRIVER_PID": str(os.getpid()),
            "OMP_NUM_THREADS": str(self.spec.threads_per_rank),
        } | ({"GLOO_SOCKET_IFNAME": ifname} if ifname else {})
        for rank in range(dims.world_size):
            if rank in net.external_ranks:
                continue
            env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            proc = self._ctx.Process(
                target=worker_main,
                args=(rank, self.spec, env),
                name=f"{self.name}-rank{rank}",
                daemon=True,
            )
            proc.start()
            self._procs[rank] = RankProcess(proc)
        self._started = True
        _LIVE.add(self)
        try:
            self._wait_ready()
        except BaseException:
            self._release()
            raise
        logger.info("%s ready: %d ranks", self.name, dims.world_size)
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        ready: set[int] = set()

        def on_ready(msg: Any) -> None:
            if isinstance(msg, RankReady):
                ready.add(msg.rank)
                self.stats.ready_info[msg.rank] = msg.info
            else:  # a program that finishes fast: for join()
                self._backlog.append(msg)

        while len(ready) < self.world_size:
            if self._killed.is_set():
                raise GangError(f"{self.name}: killed while starting")
            msg = self.recv(self.poll_s)
            if msg is not None and not isinstance(msg, RankFailed):
                on_ready(msg)
                continue
            err = self.diagnose(phase="while starting", first=msg, on_other=on_ready)
            if err is not None:
                raise err
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - ready)
                raise GangError(
                    f"{self.name}: ranks {missing} not ready after {self.start_timeout_s:.0f}s",
                    rank=missing[0] if len(missing) == 1 else None,
                )

    def stop(self, *, timeout_s: float = 30.0) -> None:
        """Stop every rank (``_farewell`` tells a program that runs until told), wait for them up to
        ``timeout_s``, kill what is left, release the rendezvous port."""
        if not self._started:
            return
        self._stopping = True
        self._unpublish()
        if self.error is None:
            self._farewell()
            for proc in self._procs.values():
                proc.join(timeout=max(0.1, timeout_s))
        self._kill_all()
        self._stopped()
        self._release()
        self._procs = {}
        self._started = False
        _LIVE.discard(self)
        self._store = None

    def _farewell(self) -> None:
        """Ask the program to end (a user that streams sends its stop message here)."""

    def _stopped(self) -> None:
        """The ranks are gone (a user fails what still waits for them here)."""

    def kill(self) -> None:
        """Kill the ranks now, from any thread: a ``start()`` waiting for them fails within a poll (a
        rank hung while loading would hold it until ``start_timeout_s``); ``stop()`` still cleans up."""
        self._killed.set()
        self._kill_all()

    def fail(self, err: GangError) -> None:
        """End the gang with ``err``: its owner decided it failed (a stall), or a rank was lost."""
        if self.error is not None:
            return
        logger.error("%s", err)
        self._unpublish()
        self.error = err
        self._kill_all()
        self._stopped()

    def __enter__(self) -> Gang:
        return self.start()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:  # nobody waits for the results (Ctrl-C, an error): no drain
            self.kill()
        self.stop()

    @property
    def healthy(self) -> bool:
        return self.error is None and self._started and not self._stopping

    def pids(self) -> list[int]:
        return [p.pid for _, p in sorted(self._procs.items())]

    def busy_seconds(self) -> list[float]:
        """Per rank: seconds spent inside micro-batches so far, as of its last heartbeat (<= 0.5 s
        old); empty when not started."""
        channel = self._channel
        return list(channel.busy_s) if channel is not None and self._started else []

    def layer_steps(self) -> list[int]:
        """Per rank: layers finished so far, as of its last heartbeat (progress inside a micro-batch;
        zeros from ranks that do not count them); empty when not started."""
        channel = self._channel
        return list(channel.steps) if channel is not None and self._started else []

    def rank_processes(self) -> list[tuple[str, int] | None]:
        """Per rank: (host name, pid) as the rank itself reports them in its heartbeats (None until
        it is heard: not spawned, or an external rank not joined yet); empty when not started."""
        channel = self._channel
        return list(channel.where) if channel is not None and self._started else []

    def stuck_ranks(self, after_s: float) -> tuple[list[int], str]:
        """The ranks holding the gang up, from their heartbeats: those inside one micro-batch for
        over ``after_s``, longest first (upstream ranks blocked sending to a hung rank started
        later); with none, those furthest behind. Returns them and a sentence naming them."""
        assert self._channel is not None
        counts = list(self._channel.progress)
        since = list(self._channel.busy_since)
        now = time.time()
        stuck = sorted((r for r, t in enumerate(since) if t and now - t > after_s), key=lambda r: since[r])
        behind = stuck or [r for r, c in enumerate(counts) if c == min(counts)]
        names = ", ".join(self.describe_rank(r) for r in behind)
        return (stuck or behind), f"stuck (longest first): {names}; micro-batches done per rank: {counts}"

    # ------------------------------------------------------------------ messages
    def send(self, rank: int, msg: Any) -> None:
        """Send one of the program's messages to ``rank`` (``ChannelError`` when unreachable)."""
        assert self._channel is not None
        self._channel.send(rank, msg)

    def recv(self, timeout_s: float, *, until_exit: bool = False) -> Any | None:
        """The next message from a rank within ``timeout_s``, or None; ``until_exit``: None as soon
        as a rank spawned here exits (its process sentinel), however long ``timeout_s`` is. A
        ``RankStopped`` is noted (``finished``) and a ``RankFailed`` handed on, for ``diagnose``."""
        assert self._channel is not None
        sentinels = (
            [p.sentinel for r, p in self._procs.items() if r not in self._finished] if until_exit else []
        )
        msg = self._channel.recv(timeout_s, wake_fds=sentinels)
        if isinstance(msg, RankStopped):
            self._finished.add(msg.rank)
        return msg

    def join(
        self, *, on_message: Callable[[Any], None] | None = None, timeout_s: float | None = None
    ) -> None:
        """Wait until every rank's program has returned (a program that runs to completion, as
        training's). The program's own messages go to ``on_message``; any failure raises GangError."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s

        def handle(msg: Any) -> None:
            if not isinstance(msg, RankReady | RankStopped | RankFailed) and on_message is not None:
                on_message(msg)

        backlog, self._backlog = self._backlog, []
        for msg in backlog:
            handle(msg)
        while len(self._finished) < self.world_size:
            msg = self.recv(self.poll_s)
            if msg is None or isinstance(msg, RankFailed):
                err = self.diagnose(phase="", first=msg, on_other=handle)
                if err is None and deadline is not None and time.monotonic() > deadline:
                    err = GangError(f"{self.name}: not finished after {timeout_s:.0f}s")
                if err is not None:
                    self.error = err
                    self._release()
                    raise err
                continue
            handle(msg)
        self._stopping = True
        for proc in self._procs.values():
            proc.join(timeout=30)
        self._release()

    # ------------------------------------------------------------------ health
    def diagnose(
        self,
        *,
        phase: str,
        first: RankFailed | None = None,
        on_other: Callable[[Any], None] | None = None,
    ) -> GangError | None:
        """Turn error reports, dead processes and silent ranks into one GangError naming the
        culprit, or None.

        A rank that died without reporting (killed, exited hard, or silent for
        ``heartbeat_timeout_s``) is blamed first: its peers then fail with connection errors that
        only echo its death. Otherwise the first rank that reported an error is blamed, with its
        traceback. Other messages met on the way go to ``on_other``.
        """
        reports: dict[int, str] = {first.rank: first.traceback} if first else {}  # rank -> traceback
        assert self._channel is not None
        channel = self._channel

        external = set(self.network.external_ranks)

        def survey(silent_after_s: float) -> list[int]:
            while (msg := self.recv(0)) is not None:
                if isinstance(msg, RankFailed):
                    reports.setdefault(msg.rank, msg.traceback)
                elif on_other is not None:
                    on_other(msg)
            exited = {r for r, p in self._procs.items() if p.exitcode is not None}
            silent = set(channel.silent_ranks(self.heartbeat_timeout_s))
            silent |= external & set(channel.silent_ranks(silent_after_s))
            return sorted((exited | silent) - self._finished)

        dead = survey(self.heartbeat_timeout_s)
        if self._stopping or (not reports and not dead):
            return None
        # A raiser's traceback or a killed peer's exit may lag a little. An external rank has no
        # process to watch: once something failed, three missed heartbeats make it the suspect
        # (its peers' connection errors only echo its death). A local rank that is alive but
        # silent (frozen, hung) is the culprit as it stands: its peers only wait for it.
        suspect_after = 3 * channel.heartbeat_s
        only_silent = not reports and all(self._exit_code(r) is None for r in dead)
        settle = time.monotonic() + (suspect_after + 0.2 if external else 0.0 if only_silent else 0.3)
        while time.monotonic() < settle:
            time.sleep(0.02)
            dead = survey(suspect_after)
        unreported = [r for r in dead if r not in reports]
        where = f" {phase}" if phase else ""
        if unreported:
            rank = min(unreported, key=self._blame_order)
            msg = f"{self.name}: {self.describe_rank(rank)} {self._how_lost(rank)}{where}"
        else:
            rank = next(iter(reports))
            msg = f"{self.name}: {self.describe_rank(rank)} failed{where}:\n{reports[rank]}"
        others = sorted(set(reports) | set(dead) - {rank})
        if others:
            msg += f"\n(then also down: {', '.join(self.describe_rank(r) for r in others)})"
        return GangError(msg, rank=rank)

    def _exit_code(self, rank: int) -> int | None:
        proc = self._procs.get(rank)
        return proc.exitcode if proc is not None else None

    def _blame_order(self, rank: int) -> int:
        """Among ranks lost without a report: killed by a signal first, then exited, then silent."""
        code = self._exit_code(rank)
        return 2 if code is None else 0 if code < 0 else 1

    def _how_lost(self, rank: int) -> str:
        code = self._exit_code(rank)
        if code is None:
            last = self._channel.last_seen[rank] if self._channel is not None else None
            quiet = f"{time.monotonic() - last:.1f}s" if last is not None else "ever"
            return f"sent no heartbeat for {quiet} (died, hung, frozen or unreachable)"
        return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"

    def _unpublish(self) -> None:
        """A restarted worker must not join this gang any more: withdraw its spec from the store."""
        if self.network.external_ranks and self._store is not None:
            with contextlib.suppress(Exception):
                self._store.delete_key(SPEC_KEY)

    def _kill_all(self) -> None:
        """Kill the ranks spawned here (external ranks exit when their peers or their driver are gone)."""
        for proc in self._procs.values():
            if proc.exitcode is None:
                proc.kill()
        for proc in self._procs.values():
            proc.join(timeout=5)

    def _release(self) -> None:
        """Kill what is left, close the channel (no thread may be reading it any more) and the
        processes' pidfds."""
        self._kill_all()
        for proc in self._procs.values():
            proc.close()
        if self._channel is not None:
            self._channel.close()
