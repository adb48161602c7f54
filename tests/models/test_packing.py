"""Which layout an inference batch runs in (``models/packing.py``); the models' numbers in each
layout: tests/models/test_encoder.py and tests/models/test_hf_family.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import shardserve.models.packing as packing
from shardserve.models.cpu import cpu_capabilities
from shardserve.models.packing import (
    PackedLayout,
    PaddedLayout,
    attention_layout,
    matmul_attention,
    matmul_attention_wins,
    packed_rows,
    padded_inference,
)
from tests.models.qa_fixtures import right_padded

FP32 = torch.float32  # Linear layers in MKL: no spare rows


def test_only_padded_right_padded_inference_batches_on_the_cpu_are_packed() -> None:
    _, mask = right_padded([7, 3, 10], 10)
    layout = attention_layout(mask, training=False, dtype=FP32)
    assert isinstance(layout, PackedLayout) and layout.lengths == [7, 3, 10]
    assert isinstance(attention_layout(mask, training=True, dtype=FP32), PaddedLayout)  # training: as ever
    with padded_inference():  # int8 calibration
        assert isinstance(attention_layout(mask, training=False, dtype=FP32), PaddedLayout)
    assert isinstance(attention_layout(mask, training=False, dtype=FP32), PackedLayout)
    left = attention_layout(mask.flip(1), training=False, dtype=FP32)  # a sequence's tokens are not a prefix
    assert isinstance(left, PaddedLayout) and left.mask is not None
    full = attention_layout(torch.ones(2, 10, dtype=torch.long), training=False, dtype=FP32)
    assert isinstance(full, PaddedLayout) and full.mask is None  # no padding: the unmasked kernel


def test_a_packed_batch_keeps_each_real_tokens_position_and_unpacks_zeros_at_padding() -> None:
    _, mask = right_padded([3, 1, 4], 4)
    layout = attention_layout(mask, training=False, dtype=FP32)
    assert isinstance(layout, PackedLayout)
    assert layout.positions().tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    x = torch.arange(12, dtype=FP32).view(3, 4, 1) + 1  # (B, S, 1), no zeros
    packed = layout.pack(x)  # (T, 1)
    assert packed.squeeze(1).tolist() == [1, 2, 3, 5, 9, 10, 11, 12]
    assert torch.equal(layout.unpack(packed), x * mask[..., None])


def test_packed_rows_land_on_16_sizes_per_doubling_with_under_a_sixteenth_spare() -> None:
    rows = {t: packed_rows(t) for t in range(1, 32 * 384 + 1)}
    assert all(t <= r < t * 17 / 16 for t, r in rows.items())
    assert [rows[t] for t in (1, 31, 33, 256, 257, 1000, 5000)] == [1, 31, 34, 256, 272, 1024, 5120]
    assert len({r for t, r in rows.items() if 1024 < t <= 2048}) == 16
    assert len(set(rows.values())) == 168  # oneDNN's primitive cache holds 1,024 kernels


def test_a_bf16_packed_batch_runs_on_the_row_grid_with_zero_spare_rows_that_attend_to_nothing() -> None:
    _, mask = right_padded([20, 13], 20)  # 33 real tokens -> 34 rows in bf16
    layout = attention_layout(mask, training=False, dtype=torch.bfloat16)
    assert isinstance(layout, PackedLayout) and (layout.tokens, layout.spare) == (33, 1)
    assert layout.positions().tolist() == [*range(20), *range(13), 0]
    x = torch.randn(2, 20, 8) + 3  # (B, S, C), no zeros
    packed = layout.pack(x)  # (R, C)
    assert packed.shape == (34, 8) and not packed[-1].any() and packed[:33].all()
    assert torch.equal(layout.unpack(packed), x * mask[..., None])  # the spare row is dropped
    q, k, v = (torch.randn(34, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    out = layout.attend(q, k, v, 4, 0.0)  # (R, C)
    fp32 = attention_layout(mask, training=False, dtype=FP32)  # fp32 (MKL): no spare rows
    assert fp32.spare == 0 and torch.equal(out[:33], fp32.attend(q[:33], k[:33], v[:33], 4, 0.0))
    assert not out[33].any()


@pytest.mark.parametrize("score_bytes", [1, 3 * 70 * 70 * 4, 1 << 30])  # one pair per call, 3, all
def test_matmul_attention_equals_sdpa_in_calls_of_any_size(monkeypatch, score_bytes: int) -> None:
    monkeypatch.setattr(packing, "MATMUL_ATTENTION_SCORE_BYTES", score_bytes)
    q, k, v = (torch.randn(2, 5, 70, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    expected = F.scaled_dot_product_attention(q, k, v)  # (B, heads, S, D)
    assert torch.allclose(matmul_attention(q, k, v), expected, atol=1e-5)


def test_matmul_attention_runs_only_for_long_unmasked_bf16_inference_without_amx(monkeypatch) -> None:
    zen4 = dataclasses.replace(cpu_capabilities(), avx512_bf16=True, amx=False)
    monkeypatch.setattr(packing, "cpu_capabilities", lambda: zen4)
    q = torch.randn(1, 64, 32, dtype=torch.bfloat16)  # (B, S, heads * D)
    with torch.inference_mode():
        assert matmul_attention_wins(q)
        assert not matmul_attention_wins(q[:, :63])  # short: SDPA
        assert not matmul_attention_wins(q.float())  # fp32: SDPA
    assert not matmul_attention_wins(q)  # gradients (training): SDPA
    for other in (dataclasses.replace(zen4, amx=True), dataclasses.replace(zen4, avx512_bf16=False)):
        monkeypatch.setattr(packing, "cpu_capabilities", lambda c=other: c)
        with torch.inference_mode():
            assert not matmul_attention_wins(q)  # AMX, or no bf16 units: SDPA

    calls = []
    monkeypatch.setattr(packing, "cpu_capabilities", lambda: zen4)
    monkeypatch.setattr(packing, "matmul_attention", lambda *t: calls.append(1) or matmul_attention(*t))
    q, k, v = (torch.randn(2, 80, 64, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with torch.inference_mode():
        sdpa = PaddedLayout(None).attend(q, k, v, 16, 0.0)  # fp32: SDPA
        assert not calls
        bf16 = PaddedLayout(None).attend(*(t.bfloat16() for t in (q, k, v)), 16, 0.0)
        masked = PaddedLayout(torch.ones(2, 1, 1, 80, dtype=torch.bool)).attend(
            *(t.bfloat16() for t in (q, k, v)), 16, 0.0
        )
    assert calls == [1]  # the unmasked bf16 batch alone
    assert (bf16.float() - sdpa).abs().max() < 0.05 and (masked.float() - sdpa).abs().max() < 0.05
