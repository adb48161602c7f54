"""Files from one rank to another over torch.distributed, for ranks that share no filesystem.

A batch of files is a count, then per file its name (relative to a root, UTF-8) and its bytes, each
a length-prefixed uint8 tensor sent with ``dist.send`` (no pickle: the receiver only writes bytes
under its own root, and refuses names that would leave it). With NCCL the tensors travel on the
rank's CUDA device; with gloo on the CPU. Both ranks must call the pair at the same point of their
programs (like any point-to-point exchange).

    send_files(root, ["trainer_state.json", "training_state/rank1.safetensors"], dst=1)   # rank 0
    paths = recv_files(scratch, src=0)                                                     # rank 1
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import torch
import torch.distributed as dist


def _device(device: torch.device | None) -> torch.device:
    return device if device is not None else torch.device("cpu")


def _send_bytes(data: bytes, dst: int, device: torch.device) -> None:
    dist.send(torch.tensor([len(data)], dtype=torch.int64, device=device), dst)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), dst)


def _recv_bytes(src: int, device: torch.device) -> bytes:
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src)
    if int(size) == 0:
        return b""
    buf = torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.recv(buf, src)
    return buf.cpu().numpy().tobytes()


def send_files(root: Path, names: list[str], *, dst: int, device: torch.device | None = None) -> None:
    """Send ``root/name`` for each of ``names`` (POSIX paths relative to ``root``) to rank ``dst``."""
    dev = _device(device)
    dist.send(torch.tensor([len(names)], dtype=torch.int64, device=dev), dst)
    for name in names:
        _send_bytes(name.encode(), dst, dev)
        _send_bytes((root / name).read_bytes(), dst, dev)


def recv_files(root: Path, *, src: int, device: torch.device | None = None) -> list[Path]:
    """Receive what rank ``src`` sends with ``send_files``; writes each file under ``root`` (parents
    created) and returns their paths, in the order sent."""
    dev = _device(device)
    count = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.recv(count, src)
    out = []
    for _ in range(int(count)):
        name = _recv_bytes(src, dev).decode()
        rel = PurePosixPath(name)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise ValueError(f"rank {src} sent a file named {name!r}, outside the receiving directory")
        path = root.joinpath(*rel.parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_recv_bytes(src, dev))
        out.append(path)
    return out
