"""Pipeline schedules, for serving, evaluation and training alike, over ``P2PCommunicator``.

``StageExecutor`` runs one rank's stage one micro-batch at a time; its steps are the only place
a micro-batch moves through a stage:

- ``recv_forward(mb)``: the stage's inputs. Stage 0 takes them from ``get_inputs(mb)`` (the
  driver's queue when serving, the features when training), the other stages receive
  ``(hidden (B, S, H), attention_mask (B, S))`` from the previous stage (``KIND_DATA``). ``mb``
  is the micro-batch a counted schedule expects (anything else is a ``ScheduleError``); ``None``
  in a stream, where a stop message (``KIND_STOP``, or ``None`` from ``get_inputs``) ends it,
  and ``IDLE`` (``KIND_KEEPALIVE``, or ``IDLE`` from ``get_inputs``) says nothing came for a while.
- ``forward_step(inputs)``: the stage's forward, then: the last stage hands its (B, S, 2) fp32
  span logits to ``on_logits(mb, logits)`` (``forward_only``) or turns them into a loss with
  ``compute_loss(mb, logits, mask)`` (already scaled by 1/n_micro); the others send their output
  on. ``forward(mb)`` is the two together.
- ``backward(mb)`` (training): the last stage back-propagates its loss; the others receive the
  gradient of their output (``KIND_GRAD``) from the next stage. A stage whose input needs a
  gradient (some earlier stage trains) sends ``d loss / d input`` back to the previous stage.

``forward_only=True`` (Megatron's flag) makes the executor keep nothing for a backward (forwards
run under ``no_grad``) and turns ``backward`` into a no-op, so every schedule below runs
evaluation unchanged. Tensor-parallel ranks of a stage run the same schedule on the same
micro-batches; rank ``(s, t)`` talks only to ``(s +- 1, t)``.

Schedules (``n`` micro-batches, ``p`` stages, this is stage ``s``):

- ``run_stream``: forward-only streaming (serving): micro-batches as they arrive until a stop,
  which is then passed down the pipeline behind the last micro-batch, so every rank drains and
  exits in order. Sends are asynchronous: stage i computes micro-batch j while i+1 computes j-1.
  An idle stage 0 sends keep-alives down the pipeline: the later stages wait for their next
  micro-batch in a receive that the process group's timeout would otherwise end.
- ``run_gpipe``: all ``n`` forwards, then all ``n`` backwards (activations of every micro-batch
  are alive at once). With ``forward_only``: evaluation of ``n`` micro-batches.
- ``run_1f1b``: Megatron's one-forward-one-backward: ``min(p - s - 1, n)`` warm-up forwards, then
  alternate one forward / one backward, then the remaining backwards (cool-down); at most
  ``p - s`` micro-batches' activations are alive on stage ``s``.

Gradients accumulate in ``.grad`` over the micro-batches; the optimizer step is the caller's.
The rank programs that build a stage and run these are the forward stream's ``stream_rank``
(``partitioner/stream/program.py``) and training's ``train_rank`` (``training/rank.py``).

    ex = StageExecutor(stage, comm, is_first=..., is_last=..., prev_rank=..., next_rank=...,
                       get_inputs=..., compute_loss=...)
    run_schedule(ex, "1f1b", n_micro, num_stages=pp, stage=s)

Run the tests: ``python -m pytest tests/partitioner/test_schedules.py -q``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from shardserve.partitioner.p2p import (
    KIND_DATA,
    KIND_GRAD,
    KIND_KEEPALIVE,
    KIND_STOP,
    Message,
    P2PCommunicator,
)

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")


@dataclass
class MicroBatch:
    """A stage's inputs for one micro-batch."""

    mb_id: int
    x: torch.Tensor  # input_ids (B, S) on stage 0, hidden (B, S, H) after
    mask: torch.Tensor  # attention_mask (B, S)
    types: torch.Tensor | None = None  # token_type_ids (B, S), stage 0 only


class Idle:
    """In a stream: nothing arrived for a while (``IDLE``, the one instance)."""


IDLE = Idle()

# (mb expected, or None in a stream) -> stage 0's inputs, None: the stream is over, or IDLE
InputsFn = Callable[[int | None], MicroBatch | Idle | None]
# (mb, logits (B, S, 2), attention_mask (B, S)) -> scalar loss already divided by n_micro
LossFn = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
# (mb, logits (B, S, 2) float32) -> None
LogitsFn = Callable[[int, torch.Tensor], None]


class ScheduleError(RuntimeError):
    """A message arrived out of the order the schedule expects (a bug or a desynchronised peer)."""


@dataclass
class StageExecutor:
    """One rank's forward/backward steps for the pipeline schedules."""

    module: nn.Module
    comm: P2PCommunicator | None  # None: pp == 1
    is_first: bool
    is_last: bool
    prev_rank: int | None
    next_rank: int | None
    get_inputs: InputsFn | None = None  # stage 0
    compute_loss: LossFn | None = None  # last stage, training
    on_logits: LogitsFn | None = None  # last stage, forward_only
    forward_only: bool = False  # serving / evaluation: no autograd, backward() is a no-op
    backward_needed: bool = True  # False: nothing on this stage or before it trains
    send_input_grad: bool = False  # True: an earlier stage trains, so d loss / d input goes back
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    _saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)

    @property
    def keeps_activations(self) -> bool:
        return self.backward_needed and not self.forward_only

    def _recv(self, src: int | None, kind: int, mb: int | None) -> Message | None:
        """The next message from ``src``: of ``kind`` and (unless None) micro-batch ``mb``; in a
        stream (``mb is None``) also a keep-alive, and None when a stop arrives."""
        assert self.comm is not None and src is not None
        msg = self.comm.recv(src)
        if mb is None and msg.kind == KIND_STOP:
            return None
        if mb is None and msg.kind == KIND_KEEPALIVE:
            return msg
        if msg.kind != kind or (mb is not None and msg.mb_id != mb):
            raise ScheduleError(
                f"expected kind={kind} mb={'any' if mb is None else mb} from rank {src}, "
                f"got kind={msg.kind} mb={msg.mb_id}"
            )
        return msg

    def recv_forward(self, mb: int | None = None) -> MicroBatch | Idle | None:
        """This stage's inputs for micro-batch ``mb`` (the next one when None; None: stream over;
        ``IDLE``: a stream's keep-alive)."""
        if self.is_first:
            assert self.get_inputs is not None
            return self.get_inputs(mb)
        msg = self._recv(self.prev_rank, KIND_DATA, mb)
        if msg is None:
            return None
        if msg.kind == KIND_KEEPALIVE:
            return IDLE
        x, mask = msg.tensors  # (B, S, H), (B, S)
        if self.send_input_grad and not self.forward_only:
            x.requires_grad_(True)
        return MicroBatch(msg.mb_id, x, mask)

    def forward_step(self, inputs: MicroBatch) -> None:
        """Compute one micro-batch on this stage, then send it on / hand over logits / keep the loss."""
        mb = inputs.mb_id
        grad_ctx = contextlib.nullcontext() if self.keeps_activations else torch.no_grad()
        with grad_ctx, self.autocast():
            out = self.module(inputs.x, inputs.mask, inputs.types)  # (B, S, H) hidden or (B, S, 2) logits
        if self.is_last and self.forward_only:
            assert self.on_logits is not None
            self.on_logits(mb, out.float())
            return
        if self.is_last:
            assert self.compute_loss is not None
            loss = self.compute_loss(mb, out.float(), inputs.mask)  # scalar, scaled by 1/n_micro
            self.losses.append(float(loss.detach()))
            out = loss
        else:
            assert self.comm is not None and self.next_rank is not None
            self.comm.send(self.next_rank, Message(KIND_DATA, mb, [out.detach(), inputs.mask]))
        if self.keeps_activations:
            self._saved[mb] = (inputs.x if self.send_input_grad else None, out)

    def forward(self, mb: int) -> None:
        """Receive and forward micro-batch ``mb`` (keeping what its backward needs)."""
        inputs = self.recv_forward(mb)
        if not isinstance(inputs, MicroBatch):
            raise ScheduleError(f"expected micro-batch {mb}, the input stream ended")
        self.forward_step(inputs)

    def backward(self, mb: int) -> None:
        """Backward micro-batch ``mb`` (a no-op on a stage that needs none, and when forward_only)."""
        if not self.keeps_activations:
            return
        x, out = self._saved.pop(mb)
        if self.is_last:
            out.backward()
        else:
            msg = self._recv(self.next_rank, KIND_GRAD, mb)
            assert msg is not None
            (grad,) = msg.tensors  # (B, S, H)
            out.backward(grad.to(out.dtype))
        if self.send_input_grad:
            assert x is not None and x.grad is not None and self.comm is not None
            assert self.prev_rank is not None
            self.comm.send(self.prev_rank, Message(KIND_GRAD, mb, [x.grad]))

    def send_stop(self) -> None:
        """Tell the next stage the stream is over."""
        self._signal_next(KIND_STOP)

    def send_keepalive(self) -> None:
        """Tell the next stage the stream is idle (it passes it on)."""
        self._signal_next(KIND_KEEPALIVE)

    def _signal_next(self, kind: int) -> None:
        if not self.is_last:
            assert self.comm is not None and self.next_rank is not None
            self.comm.send(self.next_rank, Message(kind, -1, []))


def run_stream(
    ex: StageExecutor,
    *,
    around_step: Callable[[int], contextlib.AbstractContextManager] | None = None,
) -> int:
    """Forward-only streaming (serving): forward micro-batches as they arrive until the stream
    stops, pass the stop on, wait for the sends; returns how many micro-batches were done.

    ``around_step(n)`` wraps the computation of the n-th micro-batch (0-based; not the wait for it):
    the rank's busy/progress bookkeeping and fault injection."""
    done = 0
    while (inputs := ex.recv_forward()) is not None:
        if isinstance(inputs, Idle):
            ex.send_keepalive()
            continue
        with around_step(done) if around_step is not None else contextlib.nullcontext():
            ex.forward_step(inputs)
        done += 1
    ex.send_stop()
    if ex.comm is not None:
        ex.comm.flush()
    return done


def run_gpipe(ex: StageExecutor, n_micro: int) -> None:
    """GPipe: every forward, then every backward (with ``forward_only``: n_micro forwards)."""
    # Phase 1: forward all micro-batches (stage s starts micro-batch j once s-1 has sent it).
    for mb in range(n_micro):
        ex.forward(mb)
    # Phase 2: backward all micro-batches in the same order (the last stage starts at once).
    for mb in range(n_micro):
        ex.backward(mb)
    if ex.comm is not None:
        ex.comm.flush()


def run_1f1b(ex: StageExecutor, n_micro: int, *, num_stages: int, stage: int) -> None:
    """1F1B (PipeDream-flush): warm-up forwards, steady one-forward-one-backward, cool-down backwards."""
    num_warmup = min(num_stages - stage - 1, n_micro)
    num_steady = n_micro - num_warmup
    # Warm-up: fill the pipeline; the last stage has no warm-up.
    for mb in range(num_warmup):
        ex.forward(mb)
    # Steady state: forward micro-batch (warm-up + i), then backward the oldest in flight (i).
    for i in range(num_steady):
        ex.forward(num_warmup + i)
        ex.backward(i)
    # Cool-down: drain the backwards of the warm-up micro-batches.
    for mb in range(num_steady, n_micro):
        ex.backward(mb)
    if ex.comm is not None:
        ex.comm.flush()


def run_schedule(ex: StageExecutor, name: str, n_micro: int, *, num_stages: int, stage: int) -> None:
    """Dispatch on the schedule name (``gpipe`` or ``1f1b``)."""
    if name == "gpipe":
        run_gpipe(ex, n_micro)
    elif name == "1f1b":
        run_1f1b(ex, n_micro, num_stages=num_stages, stage=stage)
    else:
        raise ValueError(f"unknown schedule {name!r}; choose from {SCHEDULES}")
