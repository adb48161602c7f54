"""The training objective: the span loss every micro-batch minimizes, the learning-rate schedule,
and which parameters AdamW decays.

The rank program (``training/rank.py``) calls these per step; a single-process reference (the
parity tests) calls the same functions, so both optimize the same thing::

    loss = span_loss(logits, attention_mask, start_positions, end_positions)   # (B, S, 2) logits
    opt = torch.optim.AdamW(param_groups(model, 0.01), lr=3e-5)
    for group in opt.param_groups:
        group["lr"] = lr_at(step, lr=3e-5, total_steps=1000, warmup_steps=100)
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MASK_FILL = -1e9  # logit given to padding positions before the span cross-entropy


def _span_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (B, S) logits against (B,) positions, or the marginal
    ``-log sum_k p(target_k)`` against (B, K) candidate positions padded with -1."""
    if targets.dim() == 1:
        return F.cross_entropy(logits, targets)
    logp = logits.log_softmax(dim=-1)  # (B, S)
    picked = logp.gather(1, targets.clamp(min=0)).masked_fill(targets.lt(0), -math.inf)  # (B, K)
    return -picked.logsumexp(dim=-1).mean()


def span_loss(
    logits: torch.Tensor, attention_mask: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor
) -> torch.Tensor:
    """(CE(start) + CE(end)) / 2, mean over the micro-batch; padding positions are masked out.

    logits: (B, S, 2) float; attention_mask: (B, S); starts/ends: (B,) token positions (0 = CLS),
    or (B, K) candidate positions (-1 padded): every occurrence of the answer text in the window,
    scored by the probability the model gives to any of them (Clark & Gardner, 2018).
    """
    pad = attention_mask.eq(0)  # (B, S)
    start_logits = logits[..., 0].masked_fill(pad, MASK_FILL)  # (B, S)
    end_logits = logits[..., 1].masked_fill(pad, MASK_FILL)
    return (_span_ce(start_logits, starts) + _span_ce(end_logits, ends)) / 2


def lr_at(step: int, *, lr: float, total_steps: int, warmup_steps: int) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then linear decay to 0 at ``total_steps``."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    return lr * max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def is_no_decay(name: str) -> bool:
    """Biases and LayerNorm parameters get no weight decay."""
    owner = name.rsplit(".", 2)[-2] if name.count(".") else name
    return name.endswith(".bias") or "norm" in owner.lower()


def param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups over the trainable parameters: decayed weights, undecayed biases/LayerNorms."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if p.requires_grad:
            (no_decay if is_no_decay(name) else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
