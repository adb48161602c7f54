"""P2P message headers: shapes and dtypes survive the round trip."""

from __future__ import annotations

import pytest
import torch

from shardserve.partitioner.p2p import HEADER_LEN, KIND_DATA, KIND_STOP, Message, decode_header, encode_header


def test_header_round_trip():
    tensors = [
        torch.zeros(3, 17, 64),
        torch.ones(3, 17, dtype=torch.int64),
        torch.zeros(2, dtype=torch.bfloat16),
    ]
    header = encode_header(Message(KIND_DATA, 41, tensors))
    assert header.shape == (HEADER_LEN,) and header.dtype == torch.int64
    kind, mb_id, specs = decode_header(header)
    assert (kind, mb_id) == (KIND_DATA, 41)
    assert specs == [(torch.float32, (3, 17, 64)), (torch.int64, (3, 17)), (torch.bfloat16, (2,))]


def test_stop_message_has_no_tensors():
    assert decode_header(encode_header(Message(KIND_STOP, -1, []))) == (KIND_STOP, -1, [])


def test_too_many_dims_rejected():
    with pytest.raises(ValueError, match="more than 4 dims"):
        encode_header(Message(KIND_DATA, 0, [torch.zeros(1, 1, 1, 1, 1)]))
