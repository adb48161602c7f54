"""The driver side of the forward stream: submit micro-batches to a gang, get span logits back.

``StreamGang`` is a ``Gang`` (``partitioner/runtime/gang.py``) running ``stream_rank``: ``submit()``
sends a ``Batch`` to every stage-0 rank and returns a future; a monitor thread resolves it from the
last stage's ``Result``. A gang holding several models (``stream_spec_multi``) takes each
micro-batch for the model it names (``submit(..., model=)``; default: the gang's first model).
When the core reports a lost rank (died, raised, or silent for ``heartbeat_timeout_s``) every
pending future fails at once with that ``GangError``; a stall (alive but no progress) is for the
owner to judge (serving's fleet), which ends the gang with ``fail()``.

    with StreamGang(stream_spec(source, plan)) as gang:
        logits = gang.submit(input_ids, attention_mask).result()   # (B, S, 2) float32 tensor
        outs = gang.run([(ids, mask), (ids2, mask2)], timeout_s=60)  # in order
    with StreamGang(stream_spec_multi({"bert": (bert, plan_b), "roberta": (roberta, plan_r)})) as gang:
        gang.models                                              # ("bert", "roberta")
        logits = gang.submit(ids, mask, model="roberta").result()

Run the tests: ``python -m pytest tests/partitioner/runtime/test_gang.py tests/partitioner/stream -q``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from shardserve.partitioner.runtime.channel import ChannelError
from shardserve.partitioner.runtime.gang import Gang, GangError
from shardserve.partitioner.runtime.messages import RankFailed
from shardserve.partitioner.stream.multiplex import gang_models
from shardserve.partitioner.stream.program import Batch, Result, Stop

logger = logging.getLogger(__name__)

MONITOR_WAIT_S = 0.25  # the monitor's longest sleep: it wakes at once for a result or a rank's exit


def _as_numpy(t: torch.Tensor | np.ndarray | None) -> np.ndarray | None:
    if t is None or isinstance(t, np.ndarray):
        return t
    return t.detach().cpu().numpy()


class StreamGang(Gang):
    """A gang that streams micro-batches (see module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: dict[int, tuple[Future, str]] = {}  # micro-batch id -> its result, its model
        self.models: tuple[str, ...] = tuple(m.name for m in gang_models(self.spec))  # the first: default
        self._lock = threading.Lock()
        self._next_id = 0
        self._monitor: threading.Thread | None = None
        self._stage0: list[int] = []  # the ranks that take the Batch messages
        self._lost_send: ChannelError | None = None  # submit() could not reach a rank: the monitor judges

    def start(self) -> StreamGang:
        dims = self.spec.plan.dims
        if dims.dp > 1:
            raise GangError(
                f"{self.name}: a serving gang is one replica (dp=1), got dp={dims.dp}; "
                "scale serving with more replicas instead"
            )
        self._stage0 = [dims.rank_of(0, t) for t in range(dims.tp)]
        super().start()
        self._monitor = threading.Thread(target=self._monitor_loop, name=f"{self.name}-monitor", daemon=True)
        self._monitor.start()
        return self

    def stop(self, *, timeout_s: float = 30.0) -> None:
        """Let the in-flight micro-batches finish (up to ``timeout_s``), then stop the ranks."""
        deadline = time.monotonic() + timeout_s
        while self._pending and self.error is None and time.monotonic() < deadline:
            time.sleep(self.poll_s)
        super().stop(timeout_s=timeout_s)

    @property
    def inflight(self) -> int:
        return len(self._pending)

    def submit(
        self,
        input_ids: torch.Tensor | np.ndarray,
        attention_mask: torch.Tensor | np.ndarray,
        token_type_ids: torch.Tensor | np.ndarray | None = None,
        *,
        model: str | None = None,
    ) -> Future:
        """Queue one micro-batch ((B, S) each) for ``model`` (one of ``models``; None: the first);
        the future resolves to (B, S, 2) float32 logits. ``ValueError`` for a model not on the gang."""
        name = self.models[0] if model is None else model
        if name not in self.models:
            raise ValueError(f"{self.name}: no model {model!r} on this gang; it holds {list(self.models)}")
        if self.error is not None:
            raise self.error
        if not self.healthy:
            raise GangError(f"{self.name}: not running")
        ids, mask, types = _as_numpy(input_ids), _as_numpy(attention_mask), _as_numpy(token_type_ids)
        fut: Future = Future()
        with self._lock:
            mb_id = self._next_id
            self._next_id += 1
            self._pending[mb_id] = (fut, name)
            self.stats.submitted += 1
            # under the lock: every stage-0 tp rank must see micro-batches in the same order
            try:
                for rank in self._stage0:
                    self.send(rank, Batch(mb_id, ids, mask, types, model=name))
            except ChannelError as err:
                if self._stopping:  # stop() closed the channel meanwhile: nobody would fail the future
                    del self._pending[mb_id]
                    raise GangError(f"{self.name}: gang stopped") from None
                # a stage-0 rank left, most often because a peer died and took it down: the future
                # stays pending, and the monitor fails it with the diagnosis that names the culprit
                self._lost_send = self._lost_send or err
        return fut

    def run(
        self, batches: list[tuple], *, timeout_s: float | None = None, model: str | None = None
    ) -> list[torch.Tensor]:
        """Submit every micro-batch for ``model`` (streamed through the pipeline), return logits in order."""
        futures = [self.submit(*b, model=model) for b in batches]
        return [f.result(timeout=timeout_s) for f in futures]

    # ------------------------------------------------------------------ the core's hooks
    def _farewell(self) -> None:
        for rank in self._stage0:
            with contextlib.suppress(ChannelError):
                self.send(rank, Stop())

    def _stopped(self) -> None:
        self._fail_pending(self.error or GangError(f"{self.name}: gang stopped"))
        monitor = self._monitor
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(timeout=5)

    # ------------------------------------------------------------------ monitor thread
    def _monitor_loop(self) -> None:
        while not self._stopping and self.error is None:
            if self._lost_send is not None:  # blame the rank that failed, else the one unreachable
                lost = GangError(f"{self.name}: {self._lost_send}")
                self.fail(self.diagnose(phase="", on_other=self._on_late) or lost)
                break
            # woken by a message or a rank's exit; the timeout only bounds how late a silent rank
            # (no process here: a remote one) or a failed send is judged
            msg = self.recv(MONITOR_WAIT_S, until_exit=True)
            if isinstance(msg, Result):
                self._resolve(msg)
                continue
            if msg is not None and not isinstance(msg, RankFailed):
                logger.debug("%s: ignored %s while streaming", self.name, type(msg).__name__)
            first = msg if isinstance(msg, RankFailed) else None
            err = self.diagnose(phase="", first=first, on_other=self._on_late)
            if err is not None:
                self.fail(err)

    def _resolve(self, result: Result) -> None:
        with self._lock:
            fut, model = self._pending.pop(result.mb_id, (None, None))
            self.stats.completed += 1
        if fut is None:
            return
        if result.model is not None and result.model != model:  # the tag got lost on the way
            fut.set_exception(
                GangError(
                    f"{self.name}: micro-batch {result.mb_id} was for {model!r}, {result.model!r} answered"
                )
            )
            return
        fut.set_result(torch.from_numpy(result.logits))  # (B, S, 2) float32

    def _on_late(self, msg: Any) -> None:
        """A message met while diagnosing: results still count."""
        if isinstance(msg, Result):
            self._resolve(msg)

    def _fail_pending(self, err: GangError) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut, _model in pending.values():
            if not fut.done():
                fut.set_exception(err)
