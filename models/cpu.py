"""What this CPU offers the model's kernels for reduced precision, as torch and oneDNN report it.

One home for the CPU's facts: ``shardserve.partitioner.precision`` picks a gang's dtype from them, ``models/packing.py``
its bf16 attention kernel, ``partitioner/int8.py`` its int8 weight range, and the benchmarks print them.

    python -m shardserve.partitioner.precision            # these facts, and the dtype this machine would pick
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CpuCapabilities:
    """What this CPU offers for reduced precision, as torch / oneDNN report it."""

    model: str
    isa: str  # torch's vectorisation level: "AVX512", "AVX2", "DEFAULT", ...
    amx: bool  # Intel AMX tiles (bf16 and int8 matrix units)
    avx512_bf16: bool
    vnni: bool  # int8 dot products (AVX512-VNNI / AVX-VNNI)
    fp16: bool  # native fp16 compute (AMX-FP16 / AVX512-FP16 through oneDNN)

    @property
    def bf16(self) -> bool:
        return self.amx or self.avx512_bf16

    @property
    def int8_dot(self) -> bool:
        """int8 dot products accumulated in int32 (AMX-INT8, VNNI): no int16 intermediate sums."""
        return self.amx or self.vnni

    @property
    def int8(self) -> bool:
        """oneDNN's int8 matmul kernels run fast here: AMX-INT8, VNNI, or AVX2 / AVX512 without VNNI
        (u8 x s8 pairs summed in int16, 7-bit weights: 1.42x fp32 at 99.9 % of its F1 on an AVX2-only Zen 3)."""
        return self.int8_dot or self.isa in ("AVX2", "AVX512")

    @property
    def int8_unit(self) -> str:
        """What runs int8 here, in words ("" where nothing known does)."""
        if self.int8_dot:
            return "AMX" if self.amx else "VNNI"
        return f"{self.isa} (oneDNN's int8 kernels without VNNI)" if self.int8 else ""

    def describe(self) -> str:
        units = [
            n for n, ok in (("AMX", self.amx), ("AVX512-BF16", self.avx512_bf16), ("VNNI", self.vnni)) if ok
        ]
        return f"{self.model} ({self.isa}; {', '.join(units) or 'no bf16 or int8 units'})"


def _probe(name: str) -> bool:
    fn = getattr(torch.cpu, name, None)
    try:
        return bool(fn()) if fn is not None else False
    except Exception:  # a private probe missing or failing means "not known to be there"
        return False


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def cpu_capabilities() -> CpuCapabilities:
    """Probe the CPU once (torch's own ISA probes, which oneDNN's kernel choice follows)."""
    try:
        mkldnn_fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:
        mkldnn_fp16 = False
    return CpuCapabilities(
        model=_cpu_model(),
        isa=torch.backends.cpu.get_cpu_capability(),
        amx=_probe("_is_amx_tile_supported"),
        avx512_bf16=_probe("_is_avx512_bf16_supported"),
        vnni=_probe("_is_vnni_supported"),
        fp16=mkldnn_fp16 or _probe("_is_amx_fp16_supported"),
    )
