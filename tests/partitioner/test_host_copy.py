"""partitioner/host_copy.py: device -> host copies that wait for the GPU asleep."""

from __future__ import annotations

import pytest
import torch

from shardserve.partitioner.host_copy import to_host


def test_a_cpu_tensor_is_returned_as_it_is():
    t = torch.arange(6.0).reshape(2, 3)
    assert to_host(t) is t


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_cuda_tensor_arrives_with_the_work_queued_before_it():
    x = torch.randn(2048, 2048, device="cuda")
    y = x @ x  # queued: to_host must wait for it
    got = to_host(y)
    assert got.device.type == "cpu" and torch.equal(got, y.cpu())
