"""Numeric precision: which dtype a gang computes in, picked per device, and why.

One home for the product's precision setting. Serving, ``verify``, ``eval``, ``plan`` and the
benchmarks take ``--dtype {auto,float32,bfloat16,float16,int8}`` (weights and activations in that
dtype, span logits in fp32; ``int8``: calibrated static int8 Linear layers, ``partitioner/int8.py``);
``train`` takes ``--precision {fp32,bf16,fp16}`` (autocast over fp32 master weights and fp32
optimizer state). ``auto`` asks torch what the device can do:

- CUDA: bf16 when ``torch.cuda.is_bf16_supported()`` (Ampere and newer), else fp32 (fp16 has too
  little range to be a safe default); ``float16`` stays available explicitly.
- CPU: bf16 when the CPU has bf16 units (Intel AMX or AVX512-BF16, as torch and oneDNN report
  them), else fp32. A CPU without them still *runs* bf16 (emulated, several times slower than fp32), so an
  explicit ``bfloat16`` is allowed with a warning; ``float16`` on a CPU without native fp16 units
  (AMX-FP16 / oneDNN fp16) is refused with an error naming the CPU. For a model calibrated with
  ``shardserve quantize``, on an x86 CPU with oneDNN's int8 kernels and no AMX (VNNI, or AVX2 /
  AVX512 without VNNI), ``auto`` is int8 (``int8_calibrated``); with AMX it stays bf16: int8 measured
  no faster there (0.94-1.04x bf16's forward, 1.00-1.03x its served answers/s; 0.87-0.97x before query,
  key and value shared one quantized input): quantizing the activations costs about what AMX-INT8
  saves over AMX-BF16 (docs/benchmarks.md, "Issue 30 on a fast AMX Xeon"). int8 is refused on GPUs.

    python -m shardserve.partitioner.precision            # what this machine would pick, and why
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardserve.models.cpu import cpu_capabilities

logger = logging.getLogger(__name__)

DTYPE_CHOICES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16", "int8")
PRECISION_CHOICES: tuple[str, ...] = ("auto", "fp32", "bf16", "fp16")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_PRECISION_TO_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "auto": "auto"}
_DTYPE_TO_PRECISION = {v: k for k, v in _PRECISION_TO_DTYPE.items()}


class PrecisionError(ValueError):
    """A dtype the device cannot run; the message names the device and what it supports."""


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a gang runs in, with the reason that is logged and shown."""

    name: str  # "float32" | "bfloat16" | "float16"
    reason: str

    @property
    def dtype(self) -> torch.dtype:
        """The float dtype of the tensors (int8: of all but the quantized Linear layers)."""
        return compute_dtype(self.name)

    @property
    def int8(self) -> bool:
        return self.name == "int8"

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def reduced(self) -> bool:
        return self.name != "float32"


def compute_dtype(name: str) -> torch.dtype:
    """The float dtype tensors are in under ``--dtype name``; ``int8`` (CPU only) keeps everything
    but its quantized Linear layers (``partitioner/int8.py``) in bf16 where the CPU has bf16 units,
    else in fp32."""
    if name == "int8":
        return torch.bfloat16 if cpu_capabilities().bf16 else torch.float32
    return DTYPES[name]


def resolve_dtype(
    requested: str, device: str | torch.device = "cpu", *, int8_calibrated: bool = False
) -> DtypeChoice:
    """``--dtype`` (or a ``--precision`` alias) on ``device`` -> the dtype to run, with the reason.

    Raises ``PrecisionError`` for a dtype the device cannot run (fp16 on a CPU without fp16 units,
    bf16 on a GPU without bf16 support, int8 off the CPU), naming the device and the alternatives in
    the words of the request (``--precision bf16 or fp32`` for a ``--precision`` name, else
    ``bfloat16 or float32``). ``int8_calibrated``: every model to run has an int8 calibration, so
    ``auto`` picks int8 on a CPU with oneDNN's int8 kernels (``CpuCapabilities.int8``) and no AMX,
    where it measured faster than bf16 (VNNI) and fp32 (AVX2) within MLPerf's accuracy bound; on AMX
    int8 measured no faster than bf16 (the module's docstring).
    """
    as_precision = requested in _PRECISION_TO_DTYPE and requested != "auto"
    requested = _PRECISION_TO_DTYPE.get(requested, requested)

    def use(*dtypes: str) -> str:
        if as_precision:
            return "use --precision " + " or ".join(_DTYPE_TO_PRECISION[d] for d in dtypes)
        return "use " + " or ".join(dtypes)

    if requested not in DTYPE_CHOICES:
        raise PrecisionError(f"dtype {requested!r} unknown; choose from {', '.join(DTYPE_CHOICES)}")
    dev = torch.device(device)
    if requested == "int8" and dev.type != "cpu":
        raise PrecisionError(
            f"int8 runs on CPUs (oneDNN's int8 kernels), not on {dev}; {use('bfloat16', 'float32')}"
        )
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise PrecisionError(f"device {dev} requested but CUDA is not available")
        name = torch.cuda.get_device_name(dev)
        bf16_ok = torch.cuda.is_bf16_supported()
        if requested == "auto":
            if bf16_ok:
                return DtypeChoice("bfloat16", f"auto: {name} supports bf16")
            return DtypeChoice(
                "float32", f"auto: {name} has no bf16 support (fp16 only with --dtype float16)"
            )
        if requested == "bfloat16" and not bf16_ok:
            raise PrecisionError(f"bfloat16 is not supported on {dev} ({name}); {use('float16', 'float32')}")
        return DtypeChoice(requested, f"requested on {name}")
    if dev.type != "cpu":
        raise PrecisionError(f"device {dev} unsupported (cpu or cuda)")
    caps = cpu_capabilities()
    if requested == "auto" and int8_calibrated and caps.int8 and not caps.amx:
        return DtypeChoice(
            "int8", f"auto: the models are int8-calibrated and CPU {caps.model} has {caps.int8_unit}"
        )
    if requested == "int8":
        rest = "bf16" if caps.bf16 else "fp32"
        units = "" if caps.int8 else f"; {caps.isa}: no known fast int8 kernels, expect it slower"
        return DtypeChoice("int8", f"requested: static int8 Linear layers, the rest in {rest}{units}")
    if requested == "auto":
        if caps.bf16:
            unit = "AMX" if caps.amx else "AVX512-BF16"
            why = (
                " (int8 is no faster there; --dtype int8 uses the calibration)"
                if int8_calibrated and caps.amx
                else ""
            )
            return DtypeChoice("bfloat16", f"auto: CPU {caps.model} has {unit}{why}")
        return DtypeChoice(
            "float32", f"auto: CPU {caps.model} has no bf16 units (AMX/AVX512-BF16), bf16 would be emulated"
        )
    if requested == "float16" and not caps.fp16:
        raise PrecisionError(
            f"float16 is not supported on cpu ({caps.describe()}): no native fp16 units; "
            + use("bfloat16", "float32")
        )
    if requested == "bfloat16" and not caps.bf16:
        logger.warning(
            "bfloat16 on cpu %s without bf16 units: emulated, several times slower than float32", caps.model
        )
        return DtypeChoice(requested, f"requested; emulated on {caps.describe()}")
    return DtypeChoice(requested, f"requested on cpu {caps.model}")


def autocast_for(device: torch.device, dtype: torch.dtype) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of autocast contexts for mixed-precision training (a no-op at fp32)."""
    if dtype == torch.float32:
        return contextlib.nullcontext
    return functools.partial(torch.autocast, device.type, dtype=dtype)


@dataclass
class DynamicLossScale:
    """fp16 loss scaling across a gang (as ``torch.amp.GradScaler``, but decided from the global
    gradient norm that every rank already all-reduces, so all ranks skip or step together).

    The loss is multiplied by ``scale`` before backward and the gradients divided by it after; a
    non-finite global norm skips the step and halves the scale, ``growth_interval`` finite steps
    in a row double it.
    """

    scale: float = 2.0**16
    growth_interval: int = 2000
    good_steps: int = 0

    def update(self, grad_norm: float) -> bool:
        """Record one step's (unscaled) global gradient norm; True: the step may be applied."""
        if not math.isfinite(grad_norm):
            self.scale /= 2.0
            self.good_steps = 0
            return False
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2.0
        return True


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    caps = cpu_capabilities()
    logger.info("cpu: %s (int8 kernels: %s)", caps.describe(), caps.int8_unit or "none")
    logger.info("auto on cpu -> %s (%s)", *vars(resolve_dtype("auto", "cpu")).values())
    if torch.cuda.is_available():
        logger.info("auto on cuda -> %s (%s)", *vars(resolve_dtype("auto", "cuda")).values())


if __name__ == "__main__":
    main()
