"""In-process fake gangs for the API / engine tests and the front-end benchmark (no worker processes,
starts in milliseconds).

``FakeGang`` has the interface of ``shardserve.partitioner.runtime.gang.Gang`` the server uses (start, submit ->
concurrent Future of (B, S, 2) logits, healthy, inflight, stop, pids, rank_processes: its one rank
reports ``host`` and a made-up pid, as a real rank's heartbeats do; busy_seconds, when asked to:
the time spent in ``batch_s``). One worker thread answers
micro-batches in order, like a pipeline; ``gate`` (a threading.Event shared by the factory) holds
every batch but the warm-up (micro-batch 0) until set, so tests can fill queues deterministically. ``kill()`` fails every pending
future with GangError at once, as a real gang does when a rank dies.

    factory = FakeFactory()
    app = build_app(settings, backend_factory=factory)
    factory.gangs[0].kill()
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any

import torch

from shardserve.partitioner.runtime.gang import GangError

_pids = itertools.count(100000)


def fake_logits(input_ids: torch.Tensor) -> torch.Tensor:
    """Deterministic (B, S, 2) logits from the token ids (any span decoding works on them)."""
    ids = torch.as_tensor(input_ids).long()
    start = ((ids * 7919) % 13).float() / 3.0
    end = ((ids * 104729) % 11).float() / 3.0
    return torch.stack([start, end], dim=-1)  # (B, S, 2)


class FakeGang:
    """A gang lookalike (see module doc)."""

    def __init__(
        self,
        name: str,
        *,
        gate: threading.Event,
        start_s: float = 0.0,
        fail_start: bool = False,
        start_error: str | None = None,
        batch_s: float = 0.0,
        host: str = "fake-host",
        report_busy: bool = False,
        report_steps: bool = False,
        models: tuple[str, ...] = ("model",),
    ) -> None:
        self.name = name
        self.models = list(models)  # the models it holds (submit(model=) names one; the first: default)
        self.submitted_models: list[str] = []  # the model of every micro-batch submitted
        self.host = host
        self.gate = gate
        self.start_s = start_s
        self.fail_start = fail_start
        self.start_error = start_error
        self.batch_s = batch_s  # compute time of every micro-batch after the warm-up
        self.report_busy = report_busy  # busy_seconds() answers, as a real gang's heartbeats do
        self.busy_s = 0.0
        self.report_steps = report_steps  # layer_steps() answers: the layers its batches finished
        self.steps = 0
        self.hung = threading.Event()  # set: no micro-batch completes any more (a SIGSTOPped rank)
        self.error: GangError | None = None
        self.batches: list[tuple[int, int]] = []  # (batch size, padded length) of every batch after warm-up
        self.token_types_seen: list[bool] = []
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._q: queue.Queue = queue.Queue()
        self._running = False
        self._stopped = False
        self._pids = [next(_pids)]
        self._killed = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> FakeGang:
        if self._killed.wait(self.start_s):  # kill() while starting: the start fails at once
            raise GangError(f"{self.name}: rank 0 was killed by signal 9 while starting", rank=0)
        if self.fail_start:
            raise GangError(self.start_error or f"{self.name}: injected start failure", rank=0)
        self._running = True
        self._thread = threading.Thread(target=self._work, daemon=True)
        self._thread.start()
        return self

    @property
    def healthy(self) -> bool:
        return self.error is None and self._running and not self._stopped

    @property
    def inflight(self) -> int:
        return len(self._pending)

    def pids(self) -> list[int]:
        return list(self._pids)

    def rank_processes(self) -> list[tuple[str, int] | None]:
        return [(self.host, pid) for pid in self._pids] if self._running else []

    def busy_seconds(self) -> list[float]:
        return [self.busy_s] if self.report_busy and self._running else []

    def layer_steps(self) -> list[int]:
        return [self.steps] if self.report_steps and self._running else []

    def submit(
        self, input_ids: Any, attention_mask: Any, token_type_ids: Any = None, *, model: str | None = None
    ) -> Future:
        name = self.models[0] if model is None else model
        if name not in self.models:
            raise ValueError(f"{self.name}: no model {model!r} on this gang; it holds {self.models}")
        if self.error is not None:
            raise self.error
        if not self.healthy:
            raise GangError(f"{self.name}: not running")
        fut: Future = Future()
        with self._lock:
            mb = next(self._ids)
            self._pending[mb] = fut
        self.token_types_seen.append(token_type_ids is not None)
        self.submitted_models.append(name)
        self._q.put((mb, torch.as_tensor(input_ids)))
        return fut

    def _work(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            mb, ids = item
            while mb > 0 and (not self.gate.wait(0.01) or self.hung.is_set()):  # mb 0: warm-up
                if self.error is not None or self._stopped:
                    break
            if mb > 0 and self.batch_s:
                layers = max(1, round(self.batch_s / 0.1))  # a layer finishes about every 0.1 s
                for _ in range(layers):
                    time.sleep(self.batch_s / layers)
                    self.steps += 1
                self.busy_s += self.batch_s
            if self.error is not None:
                continue
            with self._lock:
                fut = self._pending.pop(mb, None)
            if fut is not None:
                if mb > 0:
                    self.batches.append((int(ids.shape[0]), int(ids.shape[1])))
                fut.set_result(fake_logits(ids))

    def hang(self) -> None:
        """As if a rank were SIGSTOPped: the gang stays "healthy" but never answers again."""
        self.hung.set()

    def kill(self, rank: int = 0) -> None:
        """As if ``kill -9`` hit a rank: every pending future fails at once, the gang is down."""
        self._killed.set()
        self.fail(GangError(f"{self.name}: rank {rank} was killed by signal 9", rank=rank))

    def fail(self, err: GangError) -> None:
        """The owner decided the gang failed (a stall): every pending future fails with ``err``."""
        self.error = err
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            fut.set_exception(err)

    def stop(self, *, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self._pending and self.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        self._stopped = True
        self._q.put(None)
        if self.error is None:
            self.error = GangError(f"{self.name}: gang stopped")
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            fut.set_exception(self.error)


class FakeFactory:
    """backend_factory for build_app: records every gang it made (``gangs``) and its models' sources'
    names (``models``: one entry per gang, the names joined with '+' for a gang of several)."""

    def __init__(self, *, start_s: float = 0.0) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.start_s = start_s
        self.fail_start_models: set[str] = set()
        self.start_error: str | None = None  # the failing gangs' GangError text (default: one line)
        self.batch_s = 0.0  # compute time of every micro-batch of the gangs made from now on
        self.report_busy = False  # their rank reports its busy seconds
        self.report_steps = False  # ... and the layers it finished
        self.host = "fake-host"  # the host the gangs' ranks report
        self.gangs: list[FakeGang] = []
        self.models: list[str] = []

    def __call__(self, models: Any, name: str) -> FakeGang:
        sources = [source.name for source, _plan in models.values()]
        gang = FakeGang(
            name,
            gate=self.gate,
            start_s=self.start_s,
            fail_start=bool(self.fail_start_models.intersection(sources)),
            start_error=self.start_error,
            batch_s=self.batch_s,
            host=self.host,
            report_busy=self.report_busy,
            report_steps=self.report_steps,
            models=tuple(models),
        )
        self.gangs.append(gang)
        self.models.append("+".join(sources))
        return gang

    def batches(self) -> list[tuple[int, int]]:
        return [b for g in self.gangs for b in g.batches]
