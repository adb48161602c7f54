"""Autograd-aware tensor-parallel collectives (Megatron's ``mappings``).

They come in conjugate pairs so that the same sharded layers serve and train:

    copy_to_tp(x)      forward: identity          backward: all-reduce(grad)
    reduce_from_tp(x)  forward: all-reduce(x)     backward: identity

A column-parallel layer reads ``copy_to_tp(x)`` (every rank needs the full input; the input's
gradient is the sum of every rank's partial gradient); a row-parallel layer ends with
``reduce_from_tp(partial)``. With ``group is None`` (tp == 1) both are the identity.

On CUDA tensors with the gloo backend (several ranks sharing one GPU) the all-reduce goes through
a CPU copy, since gloo's CUDA support is limited.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardserve.partitioner.host_copy import to_host


def all_reduce_(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` in place (through the CPU when gloo meets a CUDA tensor)."""
    if group is None:
        return tensor
    if tensor.is_cuda and dist.get_backend(group) == "gloo":
        staged = to_host(tensor.detach())
        dist.all_reduce(staged, group=group)
        tensor.copy_(staged)
    else:
        dist.all_reduce(tensor, group=group)
    return tensor


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce_(grad.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        return all_reduce_(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Identity forward, all-reduce backward."""
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-reduce forward, identity backward."""
    return x if group is None else _ReduceFromTP.apply(x, group)
