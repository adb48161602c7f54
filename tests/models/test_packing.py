"""Which layout an inference batch runs in (``models/packing.py``); the models' numbers in each
layout: tests/models/test_encoder.py and tests/models/test_hf_family.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import models.packing as packing
from models.cpu import cpu_capabilities
from models.packing import (
    PackedLayout,
    PaddedLayout,
    attention_layout,
    matmul_attention,
    matmul_attention_wins,
    padded_inference,
)
from tests.models.qa_fixtures import right_padded


def test_only_padded_right_padded_inference_batches_on_the_cpu_are_packed() -> None:
    _, mask = right_padded([7, 3, 10], 10)
    layout = attention_layout(mask, training=False)
    assert isinstance(layout, PackedLayout) and layout.lengths == [7, 3, 10]
    assert isinstance(attention_layout(mask, training=True), PaddedLayout)  # training: as ever
    with padded_inference():  # int8 calibration
        assert isinstance(attention_layout(mask, training=False), PaddedLayout)
    assert isinstance(attention_layout(mask, training=False), PackedLayout)
    left = attention_layout(mask.flip(1), training=False)  # a sequence's tokens are not a prefix
    assert isinstance(left, PaddedLayout) and left.mask is not None
    full = attention_layout(torch.ones(2, 10, dtype=torch.long), training=False)
    assert isinstance(full, PaddedLayout) and full.mask is None  # no padding: the unmasked kernel


def test_a_packed_batch_keeps_each_real_tokens_position_and_unpacks_zeros_at_padding() -> None:
    _, mask = right_padded([3, 1, 4], 4)
    layout = attention_layout(mask, training=False)
    assert isinstance(layout, PackedLayout)
    assert layout.positions().tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    x = torch.arange(12, dtype=torch.float32).view(3, 4, 1) + 1  # (B, S, 1), no zeros
    packed = layout.pack(x)  # (T, 1)
    assert packed.squeeze(1).tolist() == [1, 2, 3, 5, 9, 10, 11, 12]
    assert torch.equal(layout.unpack(packed), x * mask[..., None])


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
