"""Pipeline schedules run by every rank of a gang.

``forward_stream`` (serving) streams micro-batches through the stages: stage 0 reads batches from
the driver's queue, every stage sends its output to the next one asynchronously and immediately
takes the next micro-batch, so stage i computes micro-batch j while stage i+1 computes j-1. The
last stage returns span logits to the driver. A stop message from the driver flows down the
pipeline behind the last micro-batch, so every rank drains and exits in order.

With ``GangSpec.compile`` (experimental, off by default) each rank runs its stage through
``torch.compile`` and warms it up at ``GangSpec.warmup_lengths`` before it reports ready, so no
request pays for a compilation.

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
    run: Callable[..., torch.Tensor] = stage
    warmup_s = 0.0
    if ctx.spec.compile:
        t1 = time.perf_counter()
        run = compile_stage(stage, backend=ctx.spec.compile_backend)
        warm_up(run, ctx, ctx.spec.warmup_lengths or (128,))
        warmup_s = time.perf_counter() - t1
    ready(
        {
            "param_bytes": param_bytes,
            "layer_param_bytes": sum(p.numel() * p.element_size() for p in stage.layers.parameters()),
            "checkpoint_bytes_read": stage.load_report.bytes_read,
            "load_s": time.perf_counter() - t0,
            "layers": [int(k) for k in stage.layers],
            "compile_warmup_s": warmup_s,
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
            out = run(x, attn, tt)
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


def compile_stage(stage: torch.nn.Module, *, backend: str = "inductor") -> Callable[..., torch.Tensor]:
    """``torch.compile`` for a serving stage: frozen weights (constant-folded, prepacked for oneDNN
    on CPU) and dynamic shapes, so every batch size and length bucket shares one graph (batch 1 gets
    its own: torch specializes sizes 0/1)."""
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    return torch.compile(stage, backend=backend, dynamic=True)


def warm_up(run: Callable[..., torch.Tensor], ctx: RankContext, lengths: tuple[int, ...]) -> None:
    """Run ``run`` at every length in ``lengths`` with batch 1 and 2 on dummy inputs shaped as this
    rank receives them (ids on stage 0, (B, S, H) hidden states in the compute dtype after), so the
    graphs are compiled before the rank reports ready. Tensor-parallel peers run the same sequence,
    so their collectives pair up."""
    config = ctx.spec.source.config
    dtype = DTYPES[ctx.spec.dtype]
    with torch.inference_mode():
        for length in sorted(set(lengths)):
            for batch in (1, 2):
                mask = torch.ones(batch, length, dtype=torch.long, device=ctx.device)  # (B, S)
                if ctx.is_first:
                    x = torch.full(
                        (batch, length), config.pad_token_id + 1, dtype=torch.long, device=ctx.device
                    )
                    tt = torch.zeros_like(x) if config.type_vocab_size >= 2 else None
                else:
                    x = torch.zeros(batch, length, config.hidden_size, dtype=dtype, device=ctx.device)
                    tt = None
                run(x, mask, tt)
