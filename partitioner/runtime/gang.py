"""The gang runtime: ``pp * tp`` worker processes (``dp * pp * tp`` when training) that start,
serve, fail and stop as one unit.

The caller (driver) is not a rank. What the gang does is ``GangSpec.mode``
(``partitioner/runtime/rank.py``):

- ``GangMode.STREAM`` (serving): ``submit()`` sends ``Batch`` messages to stage 0 and a monitor
  thread resolves each future from the last stage's ``Result``, while activations travel
  rank-to-rank over torch.distributed (gloo on CPU, NCCL on CUDA);
- ``GangMode.RUN`` (training): the program runs to completion; ``join()`` waits for it and hands
  the program's own control messages (``partitioner/runtime/messages.py``) to a callback.

Driver and ranks talk over ``partitioner/runtime/channel.py`` (ZeroMQ over TCP, signed messages, a fresh
key per gang; bound to loopback for a gang on this machine). Either way any rank failure becomes
a ``GangError`` that names the rank (with its traceback or exit signal) and fails every pending
future at once:

- a rank that raises reports its traceback and exits;
- a rank that dies (``kill -9``) is seen through its process sentinel within ``poll_s``;
- a rank that stops beating (killed, frozen by SIGSTOP, or cut off by the network) is seen after
  ``heartbeat_timeout_s``;
- a rank that stalls is detected when no micro-batch completes for ``stall_timeout_s`` while work
  is in flight; the per-rank progress counters name the ranks that are behind.

After a failure the remaining ranks are killed; ``stop()`` drains in-flight work, sends ``Stop``
down the pipeline and joins the processes (the rendezvous store lives in the driver, so
no port outlives the gang). The store and the channel listen on loopback only (``bound_store``),
unless ``GangNetwork`` names the host address other hosts reach: then the ranks it lists as
external are not spawned but joined by ``shardserve worker`` elsewhere (``partitioner/runtime/remote.py``)
and watched through their heartbeats alone.

    with Gang(GangSpec(source, plan)) as gang:                   # serve_rank, GangMode.STREAM
        logits = gang.submit(input_ids, attention_mask).result()   # (B, S, 2) float32 tensor

    gang = Gang(GangSpec(source, plan, program=train_rank, mode=GangMode.RUN, extra=...)).start()
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
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from partitioner.runtime.channel import ENV_ENDPOINTS, ENV_KEY, ChannelError, DriverChannel
from partitioner.runtime.messages import (
    Batch,
    ControlMessage,
    RankFailed,
    RankReady,
    RankStopped,
    Result,
    Stop,
)
from partitioner.runtime.rank import GangMode, GangSpec, worker_main
from partitioner.runtime.remote import SPEC_KEY, GangNetwork, publish_spec
from partitioner.runtime.wire import new_key

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


class GangError(RuntimeError):
    """A rank of the gang failed; ``rank`` names it (None when several or unknown)."""

    def __init__(self, message: str, *, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


@dataclass
class GangStats:
    submitted: int = 0
    completed: int = 0
    ready_info: dict[int, dict[str, Any]] = field(default_factory=dict)


def _as_numpy(t: torch.Tensor | np.ndarray | None) -> np.ndarray | None:
    if t is None or isinstance(t, np.ndarray):
        return t
    return t.detach().cpu().numpy()


class Gang:
    """Driver-side handle on one gang of worker processes."""

    def __init__(
        self,
        spec: GangSpec,
        *,
        name: str = "gang",
        start_timeout_s: float = 300.0,
        stall_timeout_s: float = 60.0,
        heartbeat_timeout_s: float = 10.0,
        poll_s: float = 0.05,
        network: GangNetwork | None = None,
    ) -> None:
        self.spec = spec
        self.name = name
        self.start_timeout_s = start_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.network = network or GangNetwork()
        self.poll_s = poll_s
        self.stats = GangStats()
        self.error: GangError | None = None
        self._ctx = mp.get_context("spawn")
        self._procs: dict[int, Any] = {}  # rank -> process, for the ranks spawned here
        self._pending: dict[int, Future] = {}  # micro-batch id -> its result
        self._lock = threading.Lock()
        self._next_id = 0
        self._started = False  # ranks spawned / awaited, until stop()
        self._stopping = False
        self._killed = threading.Event()  # kill(): a start() in progress gives up
        self._monitor: threading.Thread | None = None
        self._last_progress = time.monotonic()
        self._store: dist.TCPStore | None = None
        self._channel: DriverChannel | None = None
        self._stage0: list[int] = []  # the ranks that take the Batch messages
        self._backlog: list[ControlMessage] = []  # met while starting, for join() (a fast RUN program)
        self._lost_send: ChannelError | None = None  # submit() could not reach a rank: the monitor judges

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
        if dims.dp > 1 and self.spec.mode is GangMode.STREAM:
            raise GangError(
                f"{self.name}: a serving gang is one replica (dp=1), got dp={dims.dp}; "
                "scale serving with more replicas instead"
            )
        net = self.network
        self._store = bound_store(
            dims.world_size,
            timeout=timedelta(seconds=self.start_timeout_s),
            host=net.host,
            port=net.store_port,
        )
        key = net.key or new_key()
        self._channel = DriverChannel(world_size=dims.world_size, key=key, host=net.host)
        self._stage0 = [dims.rank_of(0, t) for t in range(dims.tp)]
        if net.external_ranks:
            publish_spec(
                self._store, self.spec, endpoints=self._channel.endpoints, key=key, program=net.program
            )
            logger.info("%s: waiting for ranks %s to join at %s:%d", self.name, list(net.external_ranks),
                        net.host, self._store.port)  # fmt: skip
        ifname = os.environ.get("GLOO_SOCKET_IFNAME", "lo" if net.host == "127.0.0.1" else None)
        # A rank's OpenMP threads sleep when a parallel region ends instead of spinning: ranks share the
        # cores with the server's tokenizer and HTTP threads, and a spinning team whose thread was
        # descheduled ran 6-8x slower under a burst (docs/benchmarks.md, issue 11's overload run).
        # OpenMP reads it when the rank loads torch, so it must be in the environment the spawned
        # rank inherits (``base_env`` is applied later); a value the user set wins.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        base_env = {
            ENV_ENDPOINTS: self._channel.endpoints,
            ENV_KEY: key.hex(),
            "MASTER_ADDR": net.host,
            "MASTER_PORT": str(self._store.port),
            "WORLD_SIZE": str(dims.world_size),
            "SHARDSERVE_DRIVER_STORE": "1",
            "SHARDSERVE_PARENT_PID": str(os.getpid()),
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
            self._procs[rank] = proc
        self._started = True
        _LIVE.add(self)
        try:
            self._wait_ready()
        except BaseException:
            self._release()
            raise
        self._last_progress = time.monotonic()
        if self.spec.mode is GangMode.STREAM:  # results come back through the monitor thread
            self._monitor = threading.Thread(
                target=self._monitor_loop, name=f"{self.name}-monitor", daemon=True
            )
            self._monitor.start()
        logger.info("%s ready: %d ranks", self.name, dims.world_size)
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        ready: set[int] = set()
        stopped: set[int] = set()  # a RUN program may finish on one rank before another is ready

        def on_ready(msg: ControlMessage) -> None:
            if isinstance(msg, RankReady):
                ready.add(msg.rank)
                self.stats.ready_info[msg.rank] = msg.info
            else:  # for join()
                self._backlog.append(msg)
                if isinstance(msg, RankStopped):
                    stopped.add(msg.rank)

        while len(ready) < self.world_size:
            if self._killed.is_set():
                raise GangError(f"{self.name}: killed while starting")
            msg = self._channel_recv(self.poll_s)
            if msg is not None and not isinstance(msg, RankFailed):
                on_ready(msg)
                continue
            err = self._diagnose(
                phase="while starting",
                first=msg if isinstance(msg, RankFailed) else None,
                finished=stopped,
                on_other=on_ready,
            )
            if err is not None:
                raise err
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - ready)
                raise GangError(
                    f"{self.name}: ranks {missing} not ready after {self.start_timeout_s:.0f}s",
                    rank=missing[0] if len(missing) == 1 else None,
                )

    def stop(self, *, timeout_s: float = 30.0) -> None:
        """Drain in-flight micro-batches, stop every rank, release the rendezvous port."""
        if not self._started:
            return
        if self.error is None:
            deadline = time.monotonic() + timeout_s
            while self._pending and self.error is None and time.monotonic() < deadline:
                time.sleep(self.poll_s)
        self._stopping = True
        self._unpublish()
        if self.error is None:
            for rank in self._stage0:
                with contextlib.suppress(ChannelError):
                    self._send(rank, Stop())
            for proc in self._procs.values():
                proc.join(timeout=max(0.1, timeout_s))
        self._kill_all()
        self._fail_pending(self.error or GangError(f"{self.name}: gang stopped"))
        if self._monitor is not None:
            self._monitor.join(timeout=5)
        self._release()
        self._procs = {}
        self._started = False
        _LIVE.discard(self)
        self._store = None

    def kill(self) -> None:
        """Kill the ranks now, from any thread: a ``start()`` waiting for them fails within a poll (a
        rank hung while loading would hold it until ``start_timeout_s``); ``stop()`` still cleans up."""
        self._killed.set()
        self._kill_all()

    def __enter__(self) -> Gang:
        return self.start()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:  # nobody waits for the results (Ctrl-C, an error): no drain
            self.kill()
        self.stop()

    @property
    def healthy(self) -> bool:
        return self.error is None and self._started and not self._stopping

    @property
    def inflight(self) -> int:
        return len(self._pending)

    def pids(self) -> list[int]:
        return [p.pid for _, p in sorted(self._procs.items())]

    def busy_seconds(self) -> list[float]:
        """Per rank: seconds spent inside micro-batches so far, as of its last heartbeat (<= 0.5 s
        old); empty when not started."""
        channel = self._channel
        return list(channel.busy_s) if channel is not None and self._started else []

    def rank_processes(self) -> list[tuple[str, int] | None]:
        """Per rank: (host name, pid) as the rank itself reports them in its heartbeats (None until
        it is heard: not spawned, or an external rank not joined yet); empty when not started."""
        channel = self._channel
        return list(channel.where) if channel is not None and self._started else []

    # ------------------------------------------------------------------ work
    def submit(
        self,
        input_ids: torch.Tensor | np.ndarray,
        attention_mask: torch.Tensor | np.ndarray,
        token_type_ids: torch.Tensor | np.ndarray | None = None,
    ) -> Future:
        """Queue one micro-batch ((B, S) each); the future resolves to (B, S, 2) float32 logits."""
        if self.spec.mode is not GangMode.STREAM:
            raise RuntimeError(f"{self.name}: submit() is for GangMode.STREAM gangs, not {self.spec.mode}")
        if self.error is not None:
            raise self.error
        if not self.healthy:
            raise GangError(f"{self.name}: not running")
        ids, mask, types = _as_numpy(input_ids), _as_numpy(attention_mask), _as_numpy(token_type_ids)
        fut: Future = Future()
        with self._lock:
            mb_id = self._next_id
            self._next_id += 1
            if not self._pending:
                self._last_progress = time.monotonic()
            self._pending[mb_id] = fut
            self.stats.submitted += 1
            # under the lock: every stage-0 tp rank must see micro-batches in the same order
            try:
                for rank in self._stage0:
                    self._send(rank, Batch(mb_id, ids, mask, types))
            except ChannelError as err:
                if self._stopping:  # stop() closed the channel meanwhile: nobody would fail the future
                    del self._pending[mb_id]
                    raise GangError(f"{self.name}: gang stopped") from None
                # a stage-0 rank left, most often because a peer died and took it down: the future
                # stays pending, and the monitor fails it with the diagnosis that names the culprit
                self._lost_send = self._lost_send or err
        return fut

    def run(self, batches: list[tuple], *, timeout_s: float | None = None) -> list[torch.Tensor]:
        """Submit every micro-batch (streamed through the pipeline), return logits in order."""
        futures = [self.submit(*b) for b in batches]
        return [f.result(timeout=timeout_s) for f in futures]

    def join(
        self,
        *,
        on_message: Callable[[ControlMessage], None] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """For ``GangMode.RUN`` programs (training): wait until every rank has finished.

        Control messages other than the lifecycle ones (``RankReady`` / ``RankStopped`` /
        ``RankFailed``), e.g. training's ``StepReport``, are handed to ``on_message``. Any failure
        raises GangError.
        """
        if self.spec.mode is not GangMode.RUN:
            raise RuntimeError(
                f"{self.name}: join() is for GangMode.RUN gangs; this one answers through submit()"
            )
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        stopped: set[int] = set()

        def handle(msg: ControlMessage) -> None:
            if isinstance(msg, RankStopped):
                stopped.add(msg.rank)
            elif not isinstance(msg, RankReady) and on_message is not None:
                on_message(msg)

        backlog, self._backlog = self._backlog, []
        for msg in backlog:
            handle(msg)
        while len(stopped) < self.world_size:
            msg = self._channel_recv(self.poll_s)
            if msg is None or isinstance(msg, RankFailed):
                err = self._diagnose(phase="", first=msg, finished=stopped, on_other=handle)
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

    # ------------------------------------------------------------------ monitoring
    def _monitor_loop(self) -> None:
        while not self._stopping and self.error is None:
            if self._lost_send is not None:  # blame the rank that failed, else the one unreachable
                lost = GangError(f"{self.name}: {self._lost_send}")
                self._fail(self._diagnose(phase="", on_other=self._on_late) or lost)
                break
            msg = self._channel_recv(self.poll_s)
            if isinstance(msg, Result):
                self._resolve(msg)
            elif isinstance(msg, RankFailed):
                self._check_health(first=msg)
            elif msg is None:
                self._check_health()
            else:
                logger.debug("%s: ignored %s while serving", self.name, type(msg).__name__)

    def _resolve(self, result: Result) -> None:
        with self._lock:
            fut = self._pending.pop(result.mb_id, None)
            self._last_progress = time.monotonic()
            self.stats.completed += 1
        if fut is not None:
            fut.set_result(torch.from_numpy(result.logits))

    def _send(self, rank: int, msg: Any) -> None:
        assert self._channel is not None
        self._channel.send(rank, msg)

    def _channel_recv(self, timeout_s: float) -> Any | None:
        assert self._channel is not None
        return self._channel.recv(timeout_s)

    def _check_health(self, *, first: RankFailed | None = None) -> None:
        err = self._diagnose(phase="", first=first, on_other=self._on_late)
        if err is not None:
            self._fail(err)
            return
        assert self._channel is not None
        if self._pending and time.monotonic() - self._last_progress > self.stall_timeout_s:
            counts = list(self._channel.progress)
            now = time.time()
            # Ranks stuck inside a micro-batch are the culprits; else those furthest behind.
            # Ranks stuck inside a micro-batch, longest first (upstream ranks blocked sending to a
            # hung rank started later); with none, the ranks furthest behind.
            since = list(self._channel.busy_since)
            stuck = sorted(
                (r for r, t in enumerate(since) if t and now - t > self.stall_timeout_s),
                key=lambda r: since[r],
            )
            behind = stuck or [r for r, c in enumerate(counts) if c == min(counts)]
            names = ", ".join(self.describe_rank(r) for r in behind)
            self._fail(
                GangError(
                    f"{self.name}: stalled: no micro-batch completed for {self.stall_timeout_s:.0f}s with "
                    f"{len(self._pending)} in flight; stuck (longest first): {names}; "
                    f"micro-batches done per rank: {counts}",
                    rank=behind[0] if stuck or len(behind) == 1 else None,
                )
            )

    def _diagnose(
        self,
        *,
        phase: str,
        first: RankFailed | None = None,
        finished: set[int] | frozenset[int] = frozenset(),
        on_other: Callable[[ControlMessage], None] | None = None,
    ) -> GangError | None:
        """Turn error reports and dead processes into one GangError naming the culprit, or None.

        A rank that died without reporting (killed, or exited hard) is blamed first: its peers
        then fail with connection errors that only echo its death. Otherwise the first rank that
        reported an error is blamed, with its traceback. Other control messages met on the way go
        to ``on_other``.
        """
        reports: dict[int, str] = {first.rank: first.traceback} if first else {}  # rank -> traceback
        assert self._channel is not None
        channel = self._channel

        external = set(self.network.external_ranks)

        def survey(silent_after_s: float) -> list[int]:
            while (msg := channel.recv(0)) is not None:
                if isinstance(msg, RankFailed):
                    reports.setdefault(msg.rank, msg.traceback)
                elif on_other is not None:
                    on_other(msg)
            exited = {r for r, p in self._procs.items() if p.exitcode is not None}
            silent = set(channel.silent_ranks(self.heartbeat_timeout_s))
            silent |= external & set(channel.silent_ranks(silent_after_s))
            return sorted((exited | silent) - set(finished))

        dead = survey(self.heartbeat_timeout_s)
        if self._stopping or (not reports and not dead):
            return None
        # A raiser's traceback or a killed peer's exit may lag a little. An external rank has no
        # process to watch: once something failed, three missed heartbeats make it the suspect
        # (its peers' connection errors only echo its death).
        suspect_after = 3 * channel.heartbeat_s
        settle = time.monotonic() + (suspect_after + 0.2 if external else 0.3)
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

    def _on_late(self, msg: ControlMessage | Result) -> None:
        """A message met while diagnosing a serving gang: results still count."""
        if isinstance(msg, Result):
            self._resolve(msg)

    def _unpublish(self) -> None:
        """A restarted worker must not join this gang any more: withdraw its spec from the store."""
        if self.network.external_ranks and self._store is not None:
            with contextlib.suppress(Exception):
                self._store.delete_key(SPEC_KEY)

    def _fail(self, err: GangError) -> None:
        logger.error("%s", err)
        self._unpublish()
        self.error = err
        self._kill_all()
        self._fail_pending(err)

    def _fail_pending(self, err: GangError) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(err)

    def _kill_all(self) -> None:
        """Kill the ranks spawned here (external ranks exit when their peers or their driver are gone)."""
        for proc in self._procs.values():
            if proc.exitcode is None:
                proc.kill()
        for proc in self._procs.values():
            proc.join(timeout=5)

    def _release(self) -> None:
        """Kill what is left and close the channel (no thread may be reading it any more)."""
        self._kill_all()
        if self._channel is not None:
            self._channel.close()
