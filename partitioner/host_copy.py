"""Device -> host copies that wait for the GPU without spinning a CPU core.

A blocking copy from CUDA (``tensor.cpu()``) waits the CUDA runtime's default way: with one context
per process on a host with more cores than contexts, the waiting thread spins for as long as the
kernels before the copy run, on cores the HTTP front end needs. ``to_host`` first waits on an event
made with ``blocking=True`` (``cudaEventBlockingSync``: the thread sleeps until the GPU reaches it),
then copies; on the CPU it is ``tensor.cpu()`` (the tensor itself: no copy). (On the first H200 a
loaded GPU rank's process took about one core; how much of it was such spinning is to be measured:
``benchmarks/gpu_session.sh run profile``.)

    pytest tests/partitioner/test_host_copy.py
"""

from __future__ import annotations

import torch


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU; a CUDA tensor after the work queued before it has finished, waited for
    asleep rather than spinning."""
    if tensor.is_cuda:
        done = torch.cuda.Event(blocking=True)
        done.record(torch.cuda.current_stream(tensor.device))
        done.synchronize()
    return tensor.cpu()
