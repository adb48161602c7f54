"""``P2PCommunicator``: point-to-point messages between pipeline stages.

A message is a fixed-size int64 header (kind, micro-batch id, tensor count, then dtype code,
rank and shape of each tensor) followed by the tensors themselves, so the receiver allocates
exactly what arrives: activations of any batch/sequence shape travel together with their
attention mask. ``kind`` marks data, a stop signal (the stream is over), a gradient, or a
keep-alive (an idle stream: a waiting receive would otherwise end at the process group's timeout).

Sends are asynchronous (``isend``) with at most ``max_pending`` outstanding, which lets stage i
start micro-batch j+1 while stage i+1 is still receiving j; receives are blocking. NCCL sends
device tensors directly; gloo with CUDA tensors stages them through the CPU.

    comm = P2PCommunicator(device="cpu", backend="gloo")
    comm.send(next_rank, Message(KIND_DATA, mb_id, [hidden, mask]))
    msg = comm.recv(prev_rank)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardserve.partitioner.host_copy import to_host

KIND_DATA = 1
KIND_STOP = 2
KIND_GRAD = 3
KIND_KEEPALIVE = 4

HEADER_LEN = 32
MAX_DIMS = 4
_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
    torch.float64,
]
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


@dataclass
class Message:
    kind: int
    mb_id: int
    tensors: list[torch.Tensor]


def encode_header(msg: Message) -> torch.Tensor:
    """Message -> (HEADER_LEN,) int64 header."""
    if len(msg.tensors) * (2 + MAX_DIMS) + 3 > HEADER_LEN:
        raise ValueError(f"{len(msg.tensors)} tensors do not fit a {HEADER_LEN}-slot header")
    fields = [msg.kind, msg.mb_id, len(msg.tensors)]
    for t in msg.tensors:
        if t.dim() > MAX_DIMS:
            raise ValueError(f"tensor of shape {tuple(t.shape)} has more than {MAX_DIMS} dims")
        fields += [_CODE[t.dtype], t.dim(), *t.shape, *([0] * (MAX_DIMS - t.dim()))]
    fields += [0] * (HEADER_LEN - len(fields))
    return torch.tensor(fields, dtype=torch.int64)


def decode_header(header: torch.Tensor) -> tuple[int, int, list[tuple[torch.dtype, tuple[int, ...]]]]:
    """(HEADER_LEN,) header -> kind, micro-batch id, [(dtype, shape)]."""
    h = header.tolist()
    kind, mb_id, n = h[0], h[1], h[2]
    specs, pos = [], 3
    for _ in range(n):
        code, ndim = h[pos], h[pos + 1]
        specs.append((_DTYPES[code], tuple(h[pos + 2 : pos + 2 + ndim])))
        pos += 2 + MAX_DIMS
    return kind, mb_id, specs


class P2PCommunicator:
    """Header-then-tensors messages between ranks of the default process group."""

    def __init__(self, *, device: str | torch.device, backend: str, max_pending: int = 4) -> None:
        self.device = torch.device(device)
        # The device tensors travel on: NCCL needs device tensors, gloo is happiest with CPU ones.
        self.wire = self.device if backend == "nccl" else torch.device("cpu")
        self.max_pending = max_pending
        self._pending: deque[tuple[dist.Work, list[torch.Tensor]]] = deque()

    def send(self, dst: int, msg: Message) -> None:
        header = encode_header(msg).to(self.wire)
        # gloo's wire is the CPU: a CUDA activation is copied there once the GPU has made it (asleep)
        move = to_host if self.wire.type == "cpu" else (lambda t: t.to(self.wire))
        payload = [header] + [move(t.detach()).contiguous() for t in msg.tensors]
        for t in payload:
            self._pending.append((dist.isend(t, dst), payload))
        while len(self._pending) > self.max_pending * len(payload):
            work, _ = self._pending.popleft()
            work.wait()

    def recv(self, src: int) -> Message:
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.wire)
        dist.recv(header, src)
        kind, mb_id, specs = decode_header(header.cpu())
        tensors = []
        for dtype, shape in specs:
            t = torch.empty(shape, dtype=dtype, device=self.wire)
            dist.recv(t, src)
            tensors.append(t.to(self.device))
        return Message(kind, mb_id, tensors)

    def flush(self) -> None:
        """Wait for every outstanding send."""
        while self._pending:
            work, _ = self._pending.popleft()
            work.wait()
