"""The transport between a gang's driver and its ranks: ZeroMQ over TCP, both ends in one place.

The driver (the HTTP server or the trainer; never a rank) binds two sockets on ``host``:
127.0.0.1 for a gang on this machine, the address the other hosts reach for a gang that spans
hosts. Every rank connects to both, wherever it runs:

    driver ROUTER  --Batch / Stop / Heartbeat-->  rank DEALER (identity: its rank)
    driver PULL    <--Result / control / Heartbeat--  rank PUSH

Messages are ``partitioner/runtime/messages.py`` dataclasses, signed with the gang's key
(``partitioner/runtime/wire.py``; unsigned or foreign frames are dropped with a warning). Input ids and
logits are small; activations never pass here (they go rank to rank over torch.distributed).

Threads: on the driver, any thread may ``send`` (a lock guards the ROUTER) and ONE thread at a
time reads with ``recv``; a heartbeat thread beats. On a rank, a receiver thread owns the DEALER
(driver messages go to ``get()``), any thread may ``send`` (a lock guards the PUSH), and a
heartbeat thread beats with the rank's ``progress`` / ``busy_since`` / ``busy_s`` / ``steps`` and
where it runs (host name, pid: the driver's ``where``, right even for a rank on another host).

Health without process handles: both ends send a ``Heartbeat`` every ``heartbeat_s``. The driver
keeps each rank's last sign of life (``silent_ranks``); a rank that hears nothing from its driver
for ``driver_timeout_s`` calls ``on_driver_lost`` (by default: exit), so a remote worker whose
frontend disappeared does not linger.

    driver = DriverChannel(world_size=2, key=key, host="127.0.0.1")
    env = {"SHARDSERVE_DRIVER": driver.endpoints, "SHARDSERVE_GANG_KEY": key.hex()}   # to the ranks
    link = RankChannel.from_env(rank=1)              # on the rank
    link.send(RankReady(1, {...})); driver.recv(timeout_s=5.0)   # -> RankReady(rank=1, ...)
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from shardserve.partitioner.runtime.messages import DRIVER, Heartbeat
from shardserve.partitioner.runtime.wire import WireError, decode, encode

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.5  # both ends beat this often
DRIVER_TIMEOUT_S = 15.0  # a rank that hears nothing from its driver this long exits
ENV_ENDPOINTS = "SHARDSERVE_DRIVER"  # "tcp://HOST:ROUTER_PORT;tcp://HOST:PULL_PORT"
ENV_KEY = "SHARDSERVE_GANG_KEY"  # the gang key, hex


class ChannelError(RuntimeError):
    """A message could not be sent (the rank is not connected, or the channel is closed)."""


def _identity(rank: int) -> bytes:
    return str(rank).encode()


class DriverChannel:
    """The driver's end: a ROUTER to the ranks and a PULL from them (see module doc)."""

    def __init__(
        self, *, world_size: int, key: bytes, host: str = "127.0.0.1", heartbeat_s: float = HEARTBEAT_S
    ) -> None:
        self.world_size = world_size
        self.key = key
        self.heartbeat_s = heartbeat_s
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a rank not connected: an error, not a drop
        self._router.setsockopt(zmq.LINGER, 0)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        try:
            router_port = self._router.bind_to_random_port(f"tcp://{host}")
            pull_port = self._pull.bind_to_random_port(f"tcp://{host}")
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self.endpoints = f"tcp://{host}:{router_port};tcp://{host}:{pull_port}"
        self._lock = threading.Lock()  # guards the ROUTER (senders: submit, stop, the heartbeat thread)
        self._closed = False
        # per rank: monotonic time of its last message (None: not heard yet), progress, busy since
        self.last_seen: list[float | None] = [None] * world_size
        self.progress = [0] * world_size
        self.busy_since = [0.0] * world_size
        self.busy_s = [0.0] * world_size  # seconds each rank spent inside micro-batches (cumulative)
        self.steps = [0] * world_size  # layers each rank has finished (progress inside a micro-batch)
        self.where: list[tuple[str, int] | None] = [None] * world_size  # (host, pid) each rank reports
        self._read_at: float | None = None  # when the reader last came for messages (silence is judged then)
        self._beater = threading.Thread(target=self._beat_loop, name="gang-driver-heartbeat", daemon=True)
        self._beater.start()

    def send(self, rank: int, msg: Any) -> None:
        """Send ``msg`` to ``rank``; ``ChannelError`` when it is not connected (or the channel is closed)."""
        frames = encode(msg, self.key)
        with self._lock:
            if self._closed:
                raise ChannelError("the gang's channel is closed")
            try:
                self._router.send_multipart([_identity(rank), *frames])
            except zmq.ZMQError as exc:
                raise ChannelError(f"rank {rank} is not connected: {exc}") from None

    def recv(self, timeout_s: float, *, wake_fds: Sequence[int] = ()) -> Any | None:
        """The next message from any rank, or None after ``timeout_s`` or as soon as one of
        ``wake_fds`` is readable (a process sentinel: a rank exited). Heartbeats are consumed here
        (they update ``last_seen`` / ``progress`` / ``busy_since``); one reader at a time."""
        self._read_at = time.monotonic()
        deadline = self._read_at + timeout_s
        poller = None
        if wake_fds:
            poller = zmq.Poller()
            poller.register(self._pull, zmq.POLLIN)
            for fd in wake_fds:
                poller.register(fd, zmq.POLLIN)
        while True:
            wait_ms = max(0, int(1000 * (deadline - time.monotonic())))
            if self._closed:
                return None
            if poller is None:
                if not self._pull.poll(wait_ms):
                    return None
            elif dict(poller.poll(wait_ms)).get(self._pull) is None:
                return None  # timed out, or a wake fd is readable
            frames = self._pull.recv_multipart()
            try:
                msg = decode(frames, self.key)
            except WireError as exc:
                logger.warning("dropped a message on the gang channel: %s", exc)
                continue
            rank = getattr(msg, "rank", None)
            if isinstance(rank, int) and 0 <= rank < self.world_size:
                self.last_seen[rank] = time.monotonic()
            if isinstance(msg, Heartbeat):
                if 0 <= msg.rank < self.world_size:
                    self.progress[msg.rank] = msg.progress
                    self.busy_since[msg.rank] = msg.busy_since
                    self.busy_s[msg.rank] = msg.busy_s
                    self.steps[msg.rank] = msg.steps
                    if msg.pid:
                        self.where[msg.rank] = (msg.host, msg.pid)
                continue
            return msg

    def silent_ranks(self, timeout_s: float) -> list[int]:
        """Ranks heard from before but not for ``timeout_s`` (dead, frozen, or unreachable), as of
        the reader's last visit: a reader that came late (a busy driver) finds beats still queued,
        not silent ranks."""
        ref = self._read_at if self._read_at is not None else time.monotonic()
        return [r for r, t in enumerate(self.last_seen) if t is not None and ref - t > timeout_s]

    def _beat_loop(self) -> None:
        beat = encode(Heartbeat(DRIVER), self.key)
        while not self._closed:
            time.sleep(self.heartbeat_s)
            with self._lock:
                if self._closed:
                    return
                for rank in range(self.world_size):
                    try:
                        self._router.send_multipart([_identity(rank), *beat], flags=zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass  # not connected (yet, or any more): the recv side judges liveness

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._beater.join(timeout=2 * self.heartbeat_s + 1)
        self._ctx.destroy(linger=0)


class RankChannel:
    """A rank's end: a DEALER from the driver (read by a receiver thread) and a PUSH to it."""

    def __init__(
        self,
        *,
        rank: int,
        endpoints: str,
        key: bytes,
        heartbeat_s: float = HEARTBEAT_S,
        driver_timeout_s: float = DRIVER_TIMEOUT_S,
        on_driver_lost: Callable[[], None] | None = None,
    ) -> None:
        router_ep, _, pull_ep = endpoints.partition(";")
        if not router_ep.startswith("tcp://") or not pull_ep.startswith("tcp://"):
            raise ValueError(f"driver endpoints must be 'tcp://HOST:PORT;tcp://HOST:PORT', got {endpoints!r}")
        self.rank = rank
        self.key = key
        self.heartbeat_s = heartbeat_s
        self.driver_timeout_s = driver_timeout_s
        self.on_driver_lost = on_driver_lost or (lambda: os._exit(4))
        self.progress = 0  # micro-batches finished (RankContext.micro_batch keeps it)
        self.busy_since = 0.0  # wall time the current micro-batch started, 0 when idle
        self.busy_s = 0.0  # seconds spent inside micro-batches so far
        self.steps = 0  # layers finished (RankContext.count_layers keeps it)
        self._where = (socket.gethostname(), os.getpid())  # sent with every heartbeat
        self._ctx = zmq.Context()
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.IDENTITY, _identity(rank))
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.connect(router_ep)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.connect(pull_ep)
        self._lock = threading.Lock()  # guards the PUSH
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._heard = threading.Event()  # the driver reached us: both directions work
        self._last_heard = time.monotonic()
        self._closing = threading.Event()
        self._threads = [
            threading.Thread(target=self._receive_loop, name=f"rank{rank}-receiver", daemon=True),
            threading.Thread(target=self._beat_loop, name=f"rank{rank}-heartbeat", daemon=True),
        ]
        for t in self._threads:
            t.start()

    @classmethod
    def from_env(cls, rank: int, **kwargs: Any) -> RankChannel:
        """The channel named by ``SHARDSERVE_DRIVER`` and keyed by ``SHARDSERVE_GANG_KEY``."""
        missing = [k for k in (ENV_ENDPOINTS, ENV_KEY) if not os.environ.get(k)]
        if missing:
            raise RuntimeError(f"rank {rank}: {' and '.join(missing)} not set: who is the gang's driver?")
        return cls(
            rank=rank, endpoints=os.environ[ENV_ENDPOINTS], key=bytes.fromhex(os.environ[ENV_KEY]), **kwargs
        )

    def send(self, msg: Any) -> None:
        """Queue ``msg`` for the driver (delivered in order; blocks only when far behind)."""
        frames = encode(msg, self.key)
        with self._lock:
            self._push.send_multipart(frames)

    def get(self, timeout_s: float | None = None) -> Any:
        """The next message from the driver (``Batch`` / ``Stop``); ``queue.Empty`` after ``timeout_s``."""
        return self._inbox.get(timeout=timeout_s)

    def wait_connected(self, timeout_s: float) -> bool:
        """True once the driver's first message arrived (it can reach us, we can reach it)."""
        return self._heard.wait(timeout_s)

    def _receive_loop(self) -> None:
        while not self._closing.is_set():
            if self._dealer.poll(100):
                try:
                    msg = decode(self._dealer.recv_multipart(), self.key)
                except WireError as exc:
                    logger.warning("rank %d dropped a message: %s", self.rank, exc)
                    continue
                self._last_heard = time.monotonic()
                self._heard.set()
                if not isinstance(msg, Heartbeat):
                    self._inbox.put(msg)
            elif time.monotonic() - self._last_heard > self.driver_timeout_s:
                logger.error(
                    "rank %d: nothing from the driver for %.0f s: it is gone; exiting",
                    self.rank,
                    self.driver_timeout_s,
                )
                self.on_driver_lost()
                return

    def _beat_loop(self) -> None:
        while not self._closing.wait(self.heartbeat_s):
            try:
                self.send(
                    Heartbeat(
                        self.rank, self.progress, self.busy_since, self.busy_s, *self._where, steps=self.steps
                    )
                )
            except zmq.ZMQError:
                return  # closing

    def close(self, *, linger_s: float = 5.0) -> None:
        """Stop the threads, deliver what was sent (up to ``linger_s``), release the sockets."""
        self._closing.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=1.0)
        self._dealer.close(linger=0)
        with self._lock:
            self._push.close(linger=int(1000 * linger_s))
        self._ctx.term()
