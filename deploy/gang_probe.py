"""Rendezvous probe for a gang that spans hosts: each rank joins with torchrun-style environment
variables (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK; ``init_method="env://"``, the
same path ``partitioner/runtime/rank.py`` takes when launched by torchrun), then checks an all-reduce and
a pipeline-style p2p ring (rank r sends to r+1, as stage r hands activations to stage r+1).

Run by ``deploy/gang-two-hosts.yaml`` (one rank per host). Locally, on loopback::

    MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 WORLD_SIZE=2 RANK=0 python deploy/gang_probe.py &
    MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 WORLD_SIZE=2 RANK=1 python deploy/gang_probe.py
    torchrun --nnodes=2 --nproc-per-node=1 --node-rank=0 --master-addr=HOST0 --master-port=29500 \
        deploy/gang_probe.py     # the same with torchrun (node-rank 1 on the second host)

Prints one JSON line per rank and exits 0 when both checks pass. Tests:
``tests/deploy/test_gang_probe.py``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def probe(*, timeout_s: float = 120.0) -> dict[str, object]:
    """Join the group from the environment, run the checks, leave; the result as a dict."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    use_nccl = os.environ.get("SHARDSERVE_DEVICE") == "cuda" and torch.cuda.is_available()
    backend = "nccl" if use_nccl else "gloo"
    device = (
        torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}") if use_nccl else torch.device("cpu")
    )
    if use_nccl:
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method="env://", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    try:
        total = torch.tensor([float(rank + 1)], device=device)
        dist.all_reduce(total)
        expected_total = world * (world + 1) / 2

        # pipeline handoff: stage r sends to stage r+1 (the last one closes the ring to stage 0)
        send = torch.full((4, 8), float(rank), device=device)
        recv = torch.empty((4, 8), device=device)
        ops = [
            dist.P2POp(dist.isend, send, (rank + 1) % world),
            dist.P2POp(dist.irecv, recv, (rank - 1) % world),
        ]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        got_from_prev = float(recv[0, 0])
        ok = float(total) == expected_total and got_from_prev == float((rank - 1) % world)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {
        "host": socket.gethostname(),
        "rank": rank,
        "world_size": world,
        "backend": backend,
        "all_reduce": float(total),
        "expected_all_reduce": expected_total,
        "received_from_previous_stage": got_from_prev,
        "ok": ok,
    }


def main() -> int:
    logging.basicConfig(level=os.environ.get("SHARDSERVE_LOG_LEVEL", "WARNING"))
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK") if k not in os.environ]
    if missing:
        print(f"error: torchrun-style variables missing: {', '.join(missing)}", file=sys.stderr)
        return 2
    result = probe(timeout_s=float(os.environ.get("GANG_PROBE_TIMEOUT_S", "120")))
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
