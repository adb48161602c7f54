"""Which layout an inference batch runs in (``models/packing.py``); the models' numbers in each
layout: tests/models/test_encoder.py and tests/models/test_hf_family.py."""

from __future__ import annotations

import torch

from models.packing import PackedLayout, PaddedLayout, attention_layout, padded_inference
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
