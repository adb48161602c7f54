"""Pipeline schedules run by every rank of a gang.

``forward_stream`` (serving) streams micro-batches through the stages: stage 0 reads batches from
the driver's queue, every stage sends its output to the next one asynchronously and immediately
takes the next micro-batch, so stage i computes micro-batch j while stage i+1 computes j-1. The
last stage returns span logits to the driver. A stop message from the driver flows down the
pipeline behind the last micro-batch, so every rank drains and exits in order.

Driver -> stage 0 items: ``("batch", mb_id, input_ids, attention_mask, token_type_ids | None)``
(numpy arrays) or ``("stop",)``. Last stage -> driver: ``("result", mb_id, logits (B, S, 2))``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from partitioner.p2p import KIND_DATA, KIND_STOP, Message, P2PCommunicator
from partitioner.precision import DTYPES
from partitioner.stages import build_stage
from partitioner.worker import RankContext


def forward_stream(ctx: RankContext, queues: dict[str, Any], *, ready: Callable[[dict], None]) -> None:
    """Forward-only streaming schedule (serving)."""
    t0 = time.perf_counter()
    stage = build_stage(
        ctx.spec.source,
        ctx.plan,
        rank=ctx.rank,
        tp_group=ctx.tp_group,
        dtype=DTYPES[ctx.spec.dtype],
        head_seed=ctx.spec.head_seed,
    )
    param_bytes = sum(p.numel() * p.element_size() for p in stage.parameters())
    ready(
        {
            "param_bytes": param_bytes,
            "layer_param_bytes": sum(p.numel() * p.element_size() for p in stage.layers.parameters()),
            "checkpoint_bytes_read": stage.load_report.bytes_read,
            "load_s": time.perf_counter() - t0,
            "layers": [int(k) for k in stage.layers],
        }
    )
    comm = P2PCommunicator(device=ctx.device, backend=ctx.backend)
    done = 0
    with torch.inference_mode():
        while True:
            if ctx.is_first:
                item = queues["in"].get()
                if item[0] == "stop":
                    break
                _, mb_id, ids, mask, types = item
                x = torch.from_numpy(ids).to(ctx.device)  # (B, S) int64
                attn = torch.from_numpy(mask).to(ctx.device)  # (B, S)
                tt = torch.from_numpy(types).to(ctx.device) if types is not None else None
            else:
                msg = comm.recv(ctx.prev_rank())
                if msg.kind == KIND_STOP:
                    break
                mb_id, (x, attn), tt = msg.mb_id, msg.tensors, None  # x: (B, S, H)
            ctx.busy_since[ctx.rank] = time.time()
            ctx.maybe_fault(done)
            out = stage(x, attn, tt)
            if ctx.is_last:
                if ctx.tp_rank == 0:
                    queues["out"].put(("result", mb_id, out.float().cpu().numpy()))  # (B, S, 2)
            else:
                comm.send(ctx.next_rank(), Message(KIND_DATA, mb_id, [out, attn]))
            done += 1
            ctx.progress[ctx.rank] = done
            ctx.busy_since[ctx.rank] = 0.0
    if not ctx.is_last:
        comm.send(ctx.next_rank(), Message(KIND_STOP, -1, []))
    comm.flush()
