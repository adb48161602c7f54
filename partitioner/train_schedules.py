"""Training pipeline schedules: GPipe and 1F1B over ``P2PCommunicator`` (forward + backward).

``StageExecutor`` runs one micro-batch's forward or backward on one rank's stage:

- forward: stage 0 takes its inputs from ``get_inputs(mb)``, other stages receive
  ``(hidden (B, S, H), attention_mask (B, S))`` from the previous stage (``KIND_DATA``); the last
  stage turns its span logits into a loss with ``compute_loss(mb, logits, mask)`` (already scaled
  by 1/n_micro), the others send their output on.
- backward: the last stage back-propagates its loss; the others receive the gradient of their
  output (``KIND_GRAD``) from the next stage. A stage whose input needs a gradient (some earlier
  stage trains) sends ``d loss / d input`` back to the previous stage.

Tensor-parallel ranks of a stage run the same schedule on the same micro-batches; rank ``(s, t)``
talks only to ``(s +- 1, t)``, and the activations and their gradients are replicated across ``t``.

Schedules (``n`` micro-batches, ``p`` stages, this is stage ``s``):

- ``run_gpipe``: all ``n`` forwards, then all ``n`` backwards (activations of every micro-batch
  are alive at once).
- ``run_1f1b``: Megatron's one-forward-one-backward: ``min(p - s - 1, n)`` warm-up forwards, then
  alternate one forward / one backward, then the remaining backwards (cool-down); at most
  ``p - s`` micro-batches' activations are alive on stage ``s``.
- ``run_forward_only``: evaluation, no autograd.

Gradients accumulate in ``.grad`` over the micro-batches; the optimizer step is the caller's.
Run the tests: ``python -m pytest tests/partitioner/test_train_schedules.py -q``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from partitioner.p2p import KIND_DATA, KIND_GRAD, Message, P2PCommunicator

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")

# (mb) -> (input_ids (B, S), attention_mask (B, S), token_type_ids (B, S) | None)
InputsFn = Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
# (mb, logits (B, S, 2), attention_mask (B, S)) -> scalar loss already divided by n_micro
LossFn = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


class ScheduleError(RuntimeError):
    """A message arrived out of the order the schedule expects (a bug or a desynchronised peer)."""


@dataclass
class StageExecutor:
    """One rank's forward/backward steps for the pipeline schedules."""

    module: nn.Module
    comm: P2PCommunicator | None
    is_first: bool
    is_last: bool
    prev_rank: int | None
    next_rank: int | None
    get_inputs: InputsFn
    compute_loss: LossFn | None
    backward_needed: bool = True  # False: nothing on this stage or before it trains
    send_input_grad: bool = False  # True: an earlier stage trains, so d loss / d input goes back
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    _saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)

    def _recv(self, src: int | None, kind: int, mb: int) -> list[torch.Tensor]:
        assert self.comm is not None and src is not None
        msg = self.comm.recv(src)
        if msg.kind != kind or msg.mb_id != mb:
            raise ScheduleError(
                f"expected kind={kind} mb={mb} from rank {src}, got kind={msg.kind} mb={msg.mb_id}"
            )
        return msg.tensors

    def _stage_inputs(self, mb: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if self.is_first:
            return self.get_inputs(mb)
        x, mask = self._recv(self.prev_rank, KIND_DATA, mb)  # (B, S, H), (B, S)
        if self.send_input_grad:
            x.requires_grad_(True)
        return x, mask, None

    def forward(self, mb: int) -> None:
        """Forward micro-batch ``mb`` (keeping what its backward needs)."""
        x, mask, types = self._stage_inputs(mb)
        grad_ctx = contextlib.nullcontext() if self.backward_needed else torch.no_grad()
        with grad_ctx, self.autocast():
            out = self.module(x, mask, types)  # (B, S, H) hidden or (B, S, 2) logits
        if self.is_last:
            assert self.compute_loss is not None
            loss = self.compute_loss(mb, out.float(), mask)  # scalar, scaled by 1/n_micro
            self.losses.append(float(loss.detach()))
            out = loss
        else:
            assert self.comm is not None and self.next_rank is not None
            self.comm.send(self.next_rank, Message(KIND_DATA, mb, [out.detach(), mask]))
        if self.backward_needed:
            self._saved[mb] = (x if self.send_input_grad else None, out)

    def backward(self, mb: int) -> None:
        """Backward micro-batch ``mb`` (a no-op on a stage that needs none)."""
        if not self.backward_needed:
            return
        x, out = self._saved.pop(mb)
        if self.is_last:
            out.backward()
        else:
            (grad,) = self._recv(self.next_rank, KIND_GRAD, mb)  # (B, S, H)
            out.backward(grad.to(out.dtype))
        if self.send_input_grad:
            assert x is not None and x.grad is not None and self.comm is not None
            assert self.prev_rank is not None
            self.comm.send(self.prev_rank, Message(KIND_GRAD, mb, [x.grad]))


def run_gpipe(ex: StageExecutor, n_micro: int) -> None:
    """GPipe: every forward, then every backward."""
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


@torch.no_grad()
def run_forward_only(
    module: nn.Module,
    comm: P2PCommunicator | None,
    *,
    is_first: bool,
    is_last: bool,
    prev_rank: int | None,
    next_rank: int | None,
    get_inputs: InputsFn,
    n_micro: int,
    on_logits: Callable[[int, torch.Tensor], None],
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> None:
    """Evaluation: stream ``n_micro`` micro-batches forward; the last stage hands (B, S, 2) logits
    to ``on_logits(mb, logits)``."""
    for mb in range(n_micro):
        if is_first:
            x, mask, types = get_inputs(mb)
        else:
            assert comm is not None and prev_rank is not None
            msg = comm.recv(prev_rank)
            if msg.kind != KIND_DATA or msg.mb_id != mb:
                raise ScheduleError(
                    f"eval: expected mb={mb} from rank {prev_rank}, got {msg.kind}/{msg.mb_id}"
                )
            (x, mask), types = msg.tensors, None
        with autocast():
            out = module(x, mask, types)
        if is_last:
            on_logits(mb, out.float())
        else:
            assert comm is not None and next_rank is not None
            comm.send(next_rank, Message(KIND_DATA, mb, [out, mask]))
    if comm is not None:
        comm.flush()
