"""GPipe / 1F1B orderings, the forward-only stream, and the stage executor's message discipline
(pure logic, no processes).

The numerical equivalence of the training schedules with single-process training over real gloo
ranks is ``tests/training/test_trainer_parity.py``; of the serving stream with ``transformers``,
``tests/partitioner/runtime/test_gang.py``.

    python -m pytest tests/partitioner/test_schedules.py -q
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from shardserve.partitioner.p2p import KIND_DATA, KIND_GRAD, KIND_KEEPALIVE, KIND_STOP, Message
from shardserve.partitioner.schedules import (
    IDLE,
    MicroBatch,
    ScheduleError,
    StageExecutor,
    run_1f1b,
    run_gpipe,
    run_schedule,
    run_stream,
)


class Recorder:
    """Stands in for a StageExecutor: records the order of forward/backward calls."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, int]] = []
        self.comm = None
        self.alive = 0
        self.peak = 0

    def forward(self, mb: int) -> None:
        self.ops.append(("F", mb))
        self.alive += 1
        self.peak = max(self.peak, self.alive)

    def backward(self, mb: int) -> None:
        self.ops.append(("B", mb))
        self.alive -= 1


@pytest.mark.parametrize(("p", "n"), [(2, 4), (3, 8), (4, 4), (4, 2)])
def test_1f1b_phases_and_memory_bound(p, n):
    for s in range(p):
        rec = Recorder()
        run_1f1b(rec, n, num_stages=p, stage=s)
        warm = min(p - s - 1, n)
        assert rec.ops[:warm] == [("F", i) for i in range(warm)]  # warm-up
        steady = rec.ops[warm : warm + 2 * (n - warm)]
        assert steady == [op for i in range(n - warm) for op in (("F", warm + i), ("B", i))]  # 1F1B
        assert rec.ops[warm + 2 * (n - warm) :] == [("B", i) for i in range(n - warm, n)]  # cool-down
        assert sorted(rec.ops) == sorted([("F", i) for i in range(n)] + [("B", i) for i in range(n)])
        assert rec.peak == min(p - s, n)  # at most p - s micro-batches alive on stage s


def test_gpipe_all_forward_then_all_backward():
    rec = Recorder()
    run_gpipe(rec, 4)
    assert rec.ops == [("F", i) for i in range(4)] + [("B", i) for i in range(4)]
    assert rec.peak == 4
    with pytest.raises(ValueError, match="unknown schedule"):
        run_schedule(rec, "zigzag", 4, num_stages=2, stage=0)


class FakeComm:
    """Scripted receives; records sends."""

    def __init__(self, incoming: list[Message]) -> None:
        self.incoming = list(incoming)
        self.sent: list[tuple[int, Message]] = []

    def recv(self, src: int) -> Message:
        return self.incoming.pop(0)

    def send(self, dst: int, msg: Message) -> None:
        self.sent.append((dst, msg))

    def flush(self) -> None:
        pass


class Middle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, mask, types):
        return self.lin(x)  # (B, S, 4)


def _middle_stage(incoming: list[Message]) -> tuple[StageExecutor, FakeComm]:
    comm = FakeComm(incoming)
    ex = StageExecutor(
        module=Middle(),
        comm=comm,
        is_first=False,
        is_last=False,
        prev_rank=0,
        next_rank=2,
        get_inputs=lambda mb: (_ for _ in ()).throw(AssertionError("not stage 0")),
        compute_loss=None,
        send_input_grad=True,
    )
    return ex, comm


def test_middle_stage_sends_activations_forward_and_input_grads_back():
    x = torch.randn(2, 3, 4)
    mask = torch.ones(2, 3, dtype=torch.long)
    g = torch.randn(2, 3, 4)
    ex, comm = _middle_stage([Message(KIND_DATA, 0, [x, mask]), Message(KIND_GRAD, 0, [g])])
    run_1f1b(ex, 1, num_stages=3, stage=1)
    (dst_f, fwd), (dst_b, bwd) = comm.sent
    assert (dst_f, fwd.kind, fwd.mb_id) == (2, KIND_DATA, 0)
    assert (dst_b, bwd.kind, bwd.mb_id) == (0, KIND_GRAD, 0)
    w = ex.module.lin.weight
    assert torch.allclose(bwd.tensors[0], g @ w)  # d(x W^T + b)/dx applied to g
    assert torch.allclose(w.grad, (g.reshape(-1, 4).t() @ x.reshape(-1, 4)))


def test_out_of_order_message_is_an_error():
    x = torch.randn(2, 3, 4)
    mask = torch.ones(2, 3, dtype=torch.long)
    ex, _ = _middle_stage([Message(KIND_DATA, 1, [x, mask])])
    with pytest.raises(ScheduleError, match="expected kind=1 mb=0"):
        ex.forward(0)


def test_forward_only_runs_the_training_schedule_without_keeping_activations():
    """Evaluation is the training schedule with forward_only: every forward in order, no gradient
    messages, nothing kept, no autograd graph."""
    x = torch.randn(2, 3, 4)
    mask = torch.ones(2, 3, dtype=torch.long)
    comm = FakeComm([Message(KIND_DATA, mb, [x + mb, mask]) for mb in range(3)])
    ex = StageExecutor(
        module=Middle(), comm=comm, is_first=False, is_last=False, prev_rank=0, next_rank=2,
        send_input_grad=True, forward_only=True,
    )  # fmt: skip
    run_1f1b(ex, 3, num_stages=3, stage=1)
    assert [(dst, m.kind, m.mb_id) for dst, m in comm.sent] == [(2, KIND_DATA, mb) for mb in range(3)]
    assert not ex._saved and not comm.sent[0][1].tensors[0].requires_grad


class Last(nn.Module):
    def forward(self, x, mask, types):
        return x[..., :2] * 2  # (B, S, 2)


def test_stream_stage0_reads_the_driver_until_stop_and_passes_the_stop_on():
    batches = [MicroBatch(7 + k, torch.randn(1, 5, 4), torch.ones(1, 5, dtype=torch.long)) for k in range(3)]
    feed = [*batches, None]
    comm = FakeComm([])
    ex = StageExecutor(
        module=Middle(), comm=comm, is_first=True, is_last=False, prev_rank=None, next_rank=1,
        get_inputs=lambda mb: feed.pop(0), forward_only=True,
    )  # fmt: skip
    steps: list[int] = []

    @contextlib.contextmanager
    def around(n):
        yield
        steps.append(n)

    assert run_stream(ex, around_step=around) == 3
    assert steps == [0, 1, 2]
    sent = [(m.kind, m.mb_id) for _, m in comm.sent]
    assert sent == [(KIND_DATA, 7), (KIND_DATA, 8), (KIND_DATA, 9), (KIND_STOP, -1)]


def test_an_idle_stream_passes_keepalives_down_without_counting_them():
    """Stage 0 idle (``IDLE`` from the driver) sends a keep-alive; a middle stage passes on the one
    it receives; neither is a micro-batch, and a counted schedule refuses one."""
    mb = MicroBatch(3, torch.randn(1, 5, 4), torch.ones(1, 5, dtype=torch.long))
    feed = [IDLE, mb, IDLE, IDLE, None]
    first = StageExecutor(
        module=Middle(), comm=FakeComm([]), is_first=True, is_last=False, prev_rank=None, next_rank=1,
        get_inputs=lambda _: feed.pop(0), forward_only=True,
    )  # fmt: skip
    assert run_stream(first) == 1
    sent = [(m.kind, m.mb_id) for _, m in first.comm.sent]
    assert sent == [(KIND_KEEPALIVE, -1), (KIND_DATA, 3), (KIND_KEEPALIVE, -1), (KIND_KEEPALIVE, -1), (KIND_STOP, -1)]
    middle, comm = _middle_stage([m for _, m in first.comm.sent])
    middle.forward_only = True
    assert run_stream(middle) == 1
    assert [(m.kind, m.mb_id) for _, m in comm.sent] == sent
    counted, _ = _middle_stage([Message(KIND_KEEPALIVE, -1, [])])
    with pytest.raises(ScheduleError, match="expected kind=1 mb=0"):
        counted.forward(0)


def test_stream_last_stage_hands_fp32_logits_until_stop():
    x = torch.randn(2, 3, 4, dtype=torch.bfloat16)
    mask = torch.ones(2, 3, dtype=torch.long)
    comm = FakeComm([Message(KIND_DATA, 4, [x, mask]), Message(KIND_STOP, -1, [])])
    got: list[tuple[int, torch.Tensor]] = []
    ex = StageExecutor(
        module=Last(), comm=comm, is_first=False, is_last=True, prev_rank=1, next_rank=None,
        on_logits=lambda mb, logits: got.append((mb, logits)), forward_only=True,
    )  # fmt: skip
    assert run_stream(ex) == 1
    assert [mb for mb, _ in got] == [4] and got[0][1].dtype == torch.float32
    assert torch.equal(got[0][1], (x[..., :2] * 2).float()) and comm.sent == []


def test_a_stop_inside_a_counted_schedule_is_an_error():
    ex, _ = _middle_stage([Message(KIND_STOP, -1, [])])
    with pytest.raises(ScheduleError, match="expected kind=1 mb=0"):
        ex.forward(0)
