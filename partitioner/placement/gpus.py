"""Named GPUs for planning without one: their datasheet figures and a roofline micro-batch time.

Owns ``GpuSpec`` / ``GPUS`` and ``roofline_batch_time``: the time of one forward of a micro-batch
of ``b`` requests of ``seq_len`` tokens on ``tp`` GPUs (Megatron shards), the larger of its FLOPs at
``efficiency`` of the dense bf16 peak and one read of its weights from memory, both shared by the
shards, plus a kernel-launch cost per layer that every shard pays:

    t(b, tp) = max(b * flops_per_request / (peak_flops * efficiency), weight_bytes / memory_bandwidth) / tp
               + num_layers * launch_s

So a small model on a large GPU batches almost for free (memory- or launch-bound) and gains little
from tensor parallelism (the launches stay); a large one grows with the batch (compute-bound). The
all-reduces tensor parallelism adds (two a layer, ``allreduce_s`` each, within one node of
``max_tp`` GPUs) are the cost model's (``cost_profile.py``). An estimate from public figures, for ``shardserve plan
--placement ... --gpu NAME`` when no device was measured; a measured profile
(``--latency-profile``) replaces it. PURE LOGIC.

    batch_time = roofline_batch_time(config, GPUS["h100"], seq_len=384, dtype_bytes=2)
    batch_time(1), batch_time(32), batch_time(1, 4)  # one request, 32, one request over 4 shards
    python -m pytest tests/partitioner/placement/test_cost_profile.py -q
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from shardserve.models.config import EncoderConfig
from shardserve.partitioner.cost import analytic_costs

logger = logging.getLogger(__name__)

GB = 10**9


@dataclass(frozen=True)
class GpuSpec:
    """A GPU's datasheet figures (dense bf16 FLOP/s, HBM bytes/s and bytes) and the share of them a
    serving forward reaches (assumptions, stated: ``efficiency`` of the peak in the large matrix
    products, ``launch_s`` per layer for the dozen kernels an eager layer launches, ``usable`` of the
    memory left after the CUDA context and allocator slack)."""

    name: str
    peak_flops: float
    memory_bandwidth: float
    memory_bytes: int
    efficiency: float = 0.5
    launch_s: float = 40e-6
    usable: float = 0.9
    hop_s: float = 50e-6  # a stage boundary's activations over NVLink / PCIe, and its launch
    allreduce_s: float = 20e-6  # one all-reduce of a micro-batch's activations among a node's GPUs
    max_tp: int = 8  # GPUs sharing one NVLink domain: tensor parallelism stays inside a node

    @property
    def usable_memory_bytes(self) -> int:
        """What a placement may fill on one GPU."""
        return int(self.memory_bytes * self.usable)


GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("NVIDIA H100 SXM 80GB", 989e12, 3.35e12, 80 * GB),
    "h200": GpuSpec("NVIDIA H200 SXM 141GB", 989e12, 4.8e12, 141 * GB),
    "a100": GpuSpec("NVIDIA A100 SXM 80GB", 312e12, 2.039e12, 80 * GB),
    "l4": GpuSpec("NVIDIA L4 24GB", 121e12, 0.3e12, 24 * GB, hop_s=200e-6, allreduce_s=100e-6),  # PCIe
}


def roofline_batch_time(
    config: EncoderConfig, gpu: GpuSpec, *, seq_len: int, dtype_bytes: int
) -> Callable[[int, int], float]:
    """Seconds of one whole-model forward of a micro-batch of ``b`` requests on ``tp`` shards of
    ``gpu`` (module doc; all-reduces not included)."""
    units = analytic_costs(config, seq_len=seq_len)
    flops = sum(u.cost for u in units) * seq_len  # one request of seq_len tokens
    weights = sum(u.params for u in units) * dtype_bytes
    launch = config.num_layers * gpu.launch_s
    compute = flops / (gpu.peak_flops * gpu.efficiency)
    memory = weights / gpu.memory_bandwidth

    def batch_time(b: int, tp: int = 1) -> float:
        return max(b * compute, memory) / tp + launch

    return batch_time
