"""How an inference batch runs on the CPU: padded and masked, or packed without its padding.

A batch of right-padded windows reaches the layers as (B, S, ...) with a (B, S) 1/0 mask.
``attention_layout`` chooses how the layers run it:

- ``PackedLayout`` (inference on the CPU, a padded, right-padded batch): the real tokens gathered
  to (T, ...), T the batch's real tokens; each sequence attends to itself alone, without a mask
  (``lengths``; ``positions`` for rotary models); ``unpack`` puts zeros at the padding positions;
- ``PaddedLayout(mask)`` everywhere else (training, CUDA: one attention call per sequence would be
  a kernel launch each; ``torch.compile``; left padding; inside ``padded_inference``, which int8
  calibration uses), and ``PaddedLayout(None)`` for a batch without padding (the unmasked kernel).

Unmasked attention is SDPA, except bf16 inference on a CPU with AVX512-BF16 and no AMX, from 64
tokens on. SDPA's CPU kernel runs its bf16 GEMMs through MKL, which converts them to fp32 on AMD's
Zen 4; there two oneDNN matmuls (``matmul_attention``) took 0.6-0.85x its time, and the server
answered 3 % more questions per second (docs/benchmarks.md, "Attention in bf16 without AMX").

On the server's micro-batches of the default model (7 % padding, AVX512 Zen 4) packing the Linear
layers alone gained nothing, attention per sequence 3 %, both 6 %; the server answered 7-9 % more
questions per second (docs/benchmarks.md, "Packed inference"). ``EncoderForQA`` runs its own layers
in either layout (``attend``); the families on transformers' modules pass ``lengths`` to their
attention kernel (``models/hf_family.py``).

    layout = attention_layout(attention_mask, training=model.training, dtype=x.dtype)
    y = layout.unpack(layers(layout.pack(x), layout))       # (B, S, C) -> (T, C) -> (B, S, C)

Tests: ``pytest tests/models/test_packing.py tests/models/test_encoder.py``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from shardserve.models.cpu import cpu_capabilities


class PaddedLayout:
    """Attention over a padded batch: tensors (B, S, ...) and ``mask`` (B, 1, 1, S) bool, True =
    attend, or None where no token is padding (the unmasked kernel)."""

    def __init__(self, mask: torch.Tensor | None) -> None:
        self.mask = mask

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int, dropout_p: float
    ) -> torch.Tensor:
        # q, k, v: (B, S, heads_local * D) -> (B, S, heads_local * D)
        b, s, _ = q.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, -1, head_dim).transpose(1, 2)  # (B, heads_local, S, D)

        if self.mask is None and not dropout_p and matmul_attention_wins(q):
            ctx = matmul_attention(heads(q), heads(k), heads(v))
        else:
            ctx = F.scaled_dot_product_attention(
                heads(q), heads(k), heads(v), attn_mask=self.mask, dropout_p=dropout_p
            )
        return ctx.transpose(1, 2).reshape(b, s, -1)


class PackedLayout:
    """Right-padded sequences packed without their padding: tensors (T, ...), T the real tokens of
    the batch; each sequence attends to itself alone (one unmasked attention call per sequence)."""

    def __init__(self, attention_mask: torch.Tensor, lengths: list[int], *, dtype: torch.dtype) -> None:
        self.shape = attention_mask.shape  # (B, S)
        self.keep = attention_mask.reshape(-1).nonzero().squeeze(1)  # (T,) real tokens of the flat batch
        self.lengths = lengths
        self.tokens = len(self.keep)  # T
        # rows R >= T the layers run: spare rows of zeros after the real tokens where oneDNN computes
        self.spare = packed_rows(self.tokens) - self.tokens if dtype in ONEDNN_DTYPES else 0

    def positions(self) -> torch.Tensor:
        """(R,) each row's position in its sequence (right padding: its column); 0 for spare rows."""
        return F.pad(self.keep.remainder(self.shape[1]), (0, self.spare))

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        # (B, S, C) -> (R, C): the T real tokens, then the spare rows (zeros)
        return F.pad(x.reshape(-1, x.shape[-1]).index_select(0, self.keep), (0, 0, 0, self.spare))

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        # (R, C) -> (B, S, C), zeros at padding positions
        full = x.new_zeros(self.shape.numel(), x.shape[-1]).index_copy_(0, self.keep, x[: self.tokens])
        return full.view(*self.shape, -1)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int, dropout_p: float
    ) -> torch.Tensor:
        # q, k, v: (R, heads_local * D) -> (R, heads_local * D); each sequence a padded batch of one,
        # the spare rows attend to nothing (zeros)
        unmasked = PaddedLayout(None)
        per_sequence = zip(*(t[: self.tokens].split(self.lengths) for t in (q, k, v)), strict=True)
        return torch.cat(
            [
                unmasked.attend(qs[None], ks[None], vs[None], head_dim, dropout_p)[0]
                for qs, ks, vs in per_sequence
            ]
            + [q.new_zeros(self.spare, q.shape[-1])]
        )


AttentionLayout = PaddedLayout | PackedLayout

# Float dtypes whose Linear layers run in oneDNN on the CPU (fp32 runs in MKL). oneDNN compiles a
# kernel for every new shape (its primitive cache keeps 1,024): on an AMX Xeon a new row count cost
# 2-15 ms per bf16 Linear layer, about 11 ms per micro-batch of the default model, where every
# micro-batch of the server's brings a new count (docs/benchmarks.md, "A packed batch's rows on a grid").
ONEDNN_DTYPES = (torch.bfloat16, torch.float16)
ROW_GRID_STEPS = 16  # row counts per doubling: at most 1/16 of the rows spare


def packed_rows(tokens: int) -> int:
    """The row count a packed batch of ``tokens`` real tokens runs as where oneDNN computes: rounded
    up to a multiple of 2^floor(log2 tokens) / ROW_GRID_STEPS, so the counts between two powers of two
    land on 16 sizes and oneDNN's cached kernels serve them: 168 sizes up to 32 windows of 384 tokens,
    fewer spare rows than 1/16 of the tokens (2.3 % on average from 256 tokens on)."""
    grain = max(1, (1 << max(0, tokens.bit_length() - 1)) // ROW_GRID_STEPS)
    return -(-tokens // grain) * grain


# The scores of the (sequence, head) pairs one matmul call takes, at most. Larger calls turned slow
# on an AVX512 Zen 4 (oneDNN's bf16 matmul: 1.3-1.6x SDPA's time for 12 heads of 32 dims from about
# 1 MB of scores on); within it the two matmuls took 0.6-0.85x SDPA's time for 64-512 tokens.
MATMUL_ATTENTION_SCORE_BYTES = 768 << 10
MATMUL_ATTENTION_MIN_TOKENS = 64  # below it SDPA's kernel is as fast or faster


def matmul_attention_wins(q: torch.Tensor) -> bool:
    """Whether unmasked attention over q (B, S, C) runs as ``matmul_attention``: bf16 inference on a
    CPU with AVX512-BF16 and no AMX, S >= 64 (the module's docstring says why)."""
    return (
        q.dtype == torch.bfloat16
        and q.device.type == "cpu"
        and q.shape[-2] >= MATMUL_ATTENTION_MIN_TOKENS
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and _bf16_without_amx()
    )


def _bf16_without_amx() -> bool:
    """AVX512-BF16 but no AMX tiles (where AMX exists, SDPA's kernel uses the tiles)."""
    caps = cpu_capabilities()
    return caps.avx512_bf16 and not caps.amx


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unmasked softmax(q k^T / sqrt(D)) v as two matmuls, in calls of whole (sequence, head) pairs
    whose scores fit ``MATMUL_ATTENTION_SCORE_BYTES``. q, k, v: (B, heads, S, D) -> (B, heads, S, D)."""
    b, h, s, d = q.shape
    per_call = max(1, MATMUL_ATTENTION_SCORE_BYTES // (s * s * q.element_size()))
    qs, ks, vs = (t.reshape(b * h, s, d) for t in (q * d**-0.5, k, v))  # (B*heads, S, D)
    parts = [
        (qs[i : i + per_call] @ ks[i : i + per_call].transpose(1, 2)).softmax(-1) @ vs[i : i + per_call]
        for i in range(0, b * h, per_call)
    ]  # each (pairs, S, S) scores -> (pairs, S, D)
    return torch.cat(parts).view(b, h, s, d)


def expand_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, S) 1/0 padding mask -> (B, 1, 1, S) boolean mask for scaled_dot_product_attention."""
    return attention_mask.bool()[:, None, None, :]


_PACKING = contextvars.ContextVar("packing", default=True)


@contextlib.contextmanager
def padded_inference() -> Iterator[None]:
    """Inference in the padded layout inside this block. int8 calibration runs so: padding's hidden
    states widen the recorded ranges, and calibrated on real tokens alone the int8 model kept 97.7 %
    of fp32's F1 instead of 100.1 % (300 pool questions, docs/benchmarks.md, "Packed inference")."""
    token = _PACKING.set(False)
    try:
        yield
    finally:
        _PACKING.reset(token)


def attention_layout(attention_mask: torch.Tensor, *, training: bool, dtype: torch.dtype) -> AttentionLayout:
    """How a batch with this (B, S) 1/0 mask runs: packed for inference on the CPU when it has
    padding and every sequence is right-padded (one attention call per sequence costs little there),
    unmasked when it has no padding; else (training, CUDA, ``torch.compile``, left padding,
    ``padded_inference``) padded and masked, as a model without this choice would run it."""
    cpu = attention_mask.device.type == "cpu"
    if training or not cpu or torch.compiler.is_compiling() or not _PACKING.get():
        return PaddedLayout(expand_mask(attention_mask))
    real = attention_mask.bool()  # (B, S)
    if bool(real.all()):
        return PaddedLayout(None)
    lengths = real.sum(dim=1)  # (B,)
    if not torch.equal(real, torch.arange(real.shape[1]) < lengths[:, None]):  # not right-padded
        return PaddedLayout(expand_mask(attention_mask))
    return PackedLayout(attention_mask, lengths.tolist(), dtype=dtype)
