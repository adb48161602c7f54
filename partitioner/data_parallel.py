"""Data-parallel gradient reduction: ``GradReducer`` sums gradients over a data-parallel group in
buckets, launched while the last backward of the step is still running (as DDP's Reducer does).

Every rank of a data-parallel group holds the same parameter shard (same stage, same tp rank, see
``ParallelDims.dp_groups``) and runs the same schedule on a different slice of the global batch.
The trainer scales each micro-batch's loss by ``1 / n_micro`` of the GLOBAL batch, so the SUM of
the replicas' accumulated gradients is exactly the single-process gradient: the reducer sums, it
never averages.

How:

- trainable parameters are packed, in reverse registration order (roughly the order backward
  produces their gradients), into buckets of at most ``bucket_bytes`` (one dtype and device each);
- ``start(n_backward)`` arms the reducer for a step in which each parameter receives
  ``n_backward`` gradient accumulations (one per local micro-batch); a post-accumulate-grad hook
  counts them, and once every parameter of a bucket has its final gradient the bucket is
  flattened and its ``all_reduce`` launched asynchronously, so communication overlaps the rest of
  the backward. Buckets are launched strictly in index order, identical on every replica (the
  replicas run the same graph), as collectives on one group must be;
- ``finish()`` launches whatever is left, waits for every bucket and copies the sums back into
  ``.grad`` (parameters without a gradient keep none, as in single-process training).

With gloo and CUDA tensors the buckets go through host memory synchronously in ``finish()``.

    reducer = GradReducer(list(stage.parameters()), group=ctx.dp_group)
    reducer.start(n_backward=n_local_micro)
    run_schedule(...)            # buckets start reducing during the last micro-batch's backward
    stats = reducer.finish()     # .grad now holds the sum over the data-parallel group

Tests: ``python -m pytest tests/training/test_hybrid_parallel.py -q``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardserve.partitioner.collectives import all_reduce_

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


@dataclass
class ReduceStats:
    """One step of reduction: buckets, bytes and how many buckets started during the backward."""

    buckets: int = 0
    bytes: int = 0
    launched_in_backward: int = 0


def make_buckets(params: list[nn.Parameter], *, bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Trainable ``params`` in reverse order, packed into buckets of <= ``bucket_bytes`` (a single
    larger tensor gets a bucket of its own), one dtype and device per bucket."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in reversed([p for p in params if p.requires_grad]):
        nbytes = p.numel() * p.element_size()
        cur = buckets[-1] if buckets else None
        fits = cur is not None and size + nbytes <= bucket_bytes
        if not fits or cur[0].dtype != p.dtype or cur[0].device != p.device:
            buckets.append([p])
            size = nbytes
        else:
            cur.append(p)
            size += nbytes
    return buckets


class GradReducer:
    """Bucketed, backward-overlapped sum of gradients over ``group`` (see the module docstring)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        *,
        group: dist.ProcessGroup | None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self.group = group
        self.buckets = make_buckets(params, bucket_bytes=bucket_bytes)
        self._bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}
        first = self.buckets[0][0] if self.buckets else None
        gloo_cuda = (
            first is not None and group is not None and first.is_cuda and dist.get_backend(group) == "gloo"
        )
        self._overlap = group is not None and not gloo_cuda
        self._armed = False
        self._n_backward = 0
        self._calls: dict[nn.Parameter, int] = {}
        self._missing: list[int] = []  # per bucket: parameters still without their final grad
        self._next = 0  # next bucket to launch (strict index order)
        self._inflight: list[tuple[int, torch.Tensor, dist.Work | None]] = []
        self.stats = ReduceStats()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._bucket_of]

    def remove(self) -> None:
        """Drop the gradient hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def start(self, *, n_backward: int) -> None:
        """Arm for one step in which every parameter receives ``n_backward`` accumulations."""
        self._armed = True
        self._n_backward = n_backward
        self._calls = dict.fromkeys(self._bucket_of, 0)
        self._missing = [len(b) for b in self.buckets]
        self._next = 0
        self._inflight = []
        self.stats = ReduceStats()

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._armed or not self._overlap:
            return
        self._calls[p] += 1
        if self._calls[p] != self._n_backward:
            return
        self._missing[self._bucket_of[p]] -= 1
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._launch(self._next)
            self.stats.launched_in_backward += 1

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket]
        )
        work = dist.all_reduce(flat, group=self.group, async_op=True) if self._overlap else None
        self._inflight.append((index, flat, work))
        self._next = index + 1
        self.stats.buckets += 1
        self.stats.bytes += flat.numel() * flat.element_size()

    def finish(self) -> ReduceStats:
        """Launch the remaining buckets, wait for all, write the sums back into ``.grad``."""
        self._armed = False
        if self.group is None:
            return self.stats
        while self._next < len(self.buckets):
            self._launch(self._next)
        for index, flat, work in self._inflight:
            if work is not None:
                work.wait()
            else:
                all_reduce_(flat, self.group)
            offset = 0
            for p in self.buckets[index]:
                n = p.numel()
                if p.grad is not None:
                    p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
        self._inflight = []
        return self.stats
