"""Static int8 Linear layers, calibrated: ``--dtype int8`` on CPUs (oneDNN's u8 x s8 kernels: VNNI, AMX-INT8).

What ``int8`` means here (measured in docs/benchmarks.md, "int8 judged by F1"):

- every Linear layer of the encoder's layers (attention projections, the FFN's up projection) runs as
  ``y = dequant(qlinear(quant(x * m), W_q)) + b``: weights int8 per output channel, the input uint8
  per tensor (zero point 128) from a calibrated range. Without VNNI / AMX the weights keep 7 bits
  (``weight_max``): oneDNN's AVX2 kernels sum u8 x s8 pairs in int16, which saturates on 8-bit weights;
- SmoothQuant (Xiao et al. 2023, alpha 0.5): ``m`` divides each input channel by
  ``s = max|x|^a / max|w|^(1-a)`` and the weight's columns are multiplied by ``s``, so activation
  outliers move into the weights; the division is folded into the quantizing multiply (free).
  Layers that read one tensor (query, key and value) are calibrated on one set of factors, from all
  their weights, and quantize that tensor once (``InputQuantizer``): on an AMX Xeon the int8 forward
  ran 1.05-1.11x faster so, at 99.9 % of fp32's F1 instead of 100.0 % (docs/benchmarks.md, "Issue 30
  on a fast AMX Xeon");
- the FFN's down projections (their input, the activation's output, has the widest range) stay in
  the float dtype, as does everything else (embeddings, attention, LayerNorm, the QA head): bf16 where
  the CPU has bf16 units, else fp32 (``shardserve.partitioner.precision.resolve_dtype``).

The ranges come from ``calibrate`` over real windows (``shardserve quantize``, training/quantize.py),
stored as one small safetensors file per model (``calibration_path``): per target layer its
SmoothQuant factors ``<name>.smooth`` (in_features,) and the smoothed input's largest magnitude
``<name>.amax`` (a scalar); siblings with equal entries share their input's quantizing (a file
calibrated before that rule quantizes per layer). ``quantize_linears`` swaps the layers of a built
model or a pipeline stage (names are the model's canonical ones, the same in every stage);
tensor-parallel Column/Row layers quantize their own shard (a row-parallel shard takes its slice of
the factors).

    stats = calibrate(model, batches)                 # model in fp32, batches of (ids, mask, types)
    save_calibration(stats, calibration_path(source), model=source.name)
    quantize_linears(stage, model_calibration(source))
"""

from __future__ import annotations

import json
import logging
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.models.bundled import cache_dir
from shardserve.models.cpu import cpu_capabilities
from shardserve.models.packing import packed_rows, padded_inference
from shardserve.models.registry import MODEL_NAMES, ModelSource
from shardserve.partitioner.collectives import reduce_from_tp
from shardserve.partitioner.shard_loading import ShardSlice
from shardserve.partitioner.tp_layers import ColumnParallelLinear, RowParallelLinear

logger = logging.getLogger(__name__)

CALIBRATION_FILE = "int8_calibration.safetensors"
FORMAT = "shardserve-int8-smoothquant-v1"
DEFAULT_ALPHA = 0.5
ZERO_POINT = 128  # uint8 activations: oneDNN's fast path (signed int8 inputs fell to a kernel 3,000x slower)
_LINEARS = (nn.Linear, ColumnParallelLinear, RowParallelLinear)
_MLP_NAMES = ("mlp", "feed_forward", "ffn")  # their last Linear (the down projection) stays float


def weight_max() -> int:
    """The largest int8 weight magnitude this CPU's kernels sum without overflow: 127 where VNNI or AMX
    accumulate u8 x s8 products in int32; 63 elsewhere, where AVX2 / AVX512 (``vpmaddubsw``) add each
    pair of products in int16 and saturate (2 x 255 x 127 > 32767 > 2 x 255 x 64), as fbgemm's
    ``reduce_range``. Measured on an AVX2-only CPU: 8-bit weights were off by 15 % of the output's
    range on a layer with an outlier channel, 7-bit ones match exact integer arithmetic."""
    return 127 if cpu_capabilities().int8_dot else 63


class CalibrationMissing(FileNotFoundError):
    """``--dtype int8`` for a model that was never calibrated; the message says how to calibrate."""


def calibration_path(source: ModelSource) -> Path:
    """Where ``source``'s int8 calibration lives: inside a model folder, or (the registry's models,
    which live in installed packages) in the shardserve cache."""
    if source.name in MODEL_NAMES:
        return cache_dir() / "int8" / f"{source.name}.safetensors"
    return source.checkpoint / CALIBRATION_FILE


def target_linears(model: nn.Module) -> dict[str, nn.Module]:
    """Canonical name -> Linear layer that int8 quantizes: those under ``model.layers`` but each FFN's
    last one (its down projection)."""
    out: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if not name.startswith("layers.") or not isinstance(module, _LINEARS):
            continue
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        if parent.rsplit(".", 1)[-1] in _MLP_NAMES:
            linears = [n for n, m in owner.named_children() if isinstance(m, _LINEARS)]
            if child == linears[-1]:
                continue
        out[name] = module
    return out


def smooth_factors(
    weight: torch.Tensor | list[torch.Tensor], amax_in: torch.Tensor, alpha: float
) -> torch.Tensor:
    # weight: (out, in), or the weights of every layer that reads this input; amax_in: (in,) -> s: (in,);
    # the input is divided by s, the weights' columns multiplied
    weights = weight if isinstance(weight, list) else [weight]
    w_max = torch.stack([w.detach().float().abs().amax(dim=0) for w in weights]).amax(dim=0).clamp(min=1e-5)
    return (amax_in.clamp(min=1e-5) ** alpha / w_max ** (1 - alpha)).clamp(min=1e-5)


@torch.inference_mode()
def calibrate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, ...]],
    *,
    alpha: float = DEFAULT_ALPHA,
    on_batch: Callable[[int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """SmoothQuant factors and smoothed input ranges of ``model``'s target Linear layers over
    ``batches`` (two passes: the per-channel ranges, then the per-tensor range after smoothing);
    ``on_batch(windows)`` after each forward (a progress bar). Layers that read one tensor (query,
    key and value) get one set of factors, from all their weights, and so one range: at run time
    they quantize that tensor once (``InputQuantizer``)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"SmoothQuant alpha must be in [0, 1] (got {alpha:g})")
    batches = list(batches)
    targets = target_linears(model)
    if not targets:
        raise ValueError(f"{type(model).__name__} has no Linear layers under .layers to quantize")
    channel = {name: torch.zeros(lin.weight.shape[1]) for name, lin in targets.items()}
    tensor = dict.fromkeys(targets, 0.0)
    factors: dict[str, torch.Tensor] = {}

    readers: list[list[str]] = []  # layers that read one tensor in a row (query, key, value), in order
    seen: set[str] = set()
    last_read: weakref.ref | None = None  # the tensor the last new layer read, not kept alive

    def per_channel(name: str):
        def hook(_m: nn.Module, args: tuple) -> None:
            nonlocal last_read
            if name not in seen:  # the layer's first call
                seen.add(name)
                if last_read is not None and last_read() is args[0]:
                    readers[-1].append(name)
                else:
                    readers.append([name])
                    last_read = weakref.ref(args[0])
            x = args[0].detach().float().abs().flatten(0, -2)  # (tokens, in)
            channel[name] = torch.maximum(channel[name], x.amax(dim=0))

        return hook

    def per_tensor(name: str):
        def hook(_m: nn.Module, args: tuple) -> None:
            tensor[name] = max(tensor[name], float((args[0].detach().float() / factors[name]).abs().max()))

        return hook

    for make in (per_channel, per_tensor):
        hooks = [lin.register_forward_pre_hook(make(name)) for name, lin in targets.items()]
        try:
            for batch in batches:
                with padded_inference():  # the ranges as padded batches see them (models/packing.py)
                    model(*batch)
                if on_batch is not None:
                    on_batch(int(batch[0].shape[0]))
        finally:
            for h in hooks:
                h.remove()
        if make is per_channel:
            for group in readers:
                joint = smooth_factors([targets[n].weight for n in group], channel[group[0]], alpha)
                factors.update(dict.fromkeys(group, joint))
            for n in targets.keys() - factors.keys():  # never run: its own factors
                factors[n] = smooth_factors(targets[n].weight, channel[n], alpha)
    stats: dict[str, torch.Tensor] = {}
    for name in targets:
        stats[f"{name}.smooth"] = factors[name].clone()  # one tensor per name (safetensors)
        stats[f"{name}.amax"] = torch.tensor(max(tensor[name], 1e-8))
    return stats


def save_calibration(stats: dict[str, torch.Tensor], path: Path, *, model: str, **meta: object) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    info = {"format": FORMAT, "model": model, **{k: json.dumps(v) for k, v in meta.items()}}
    save_file({k: v.contiguous() for k, v in stats.items()}, str(tmp), metadata=info)
    tmp.replace(path)
    return path


def load_calibration(path: Path, *, model: str = "") -> dict[str, torch.Tensor]:
    """The stats ``save_calibration`` wrote; ``CalibrationMissing`` (with the command to run) if none."""
    from safetensors import safe_open

    if not path.is_file():
        raise CalibrationMissing(
            f"--dtype int8: model {model or path.parent.name!r} has no int8 calibration ({path}); "
            f"run `shardserve quantize --model {model or '<model>'} --data <SQuAD json>` first"
        )
    with safe_open(str(path), framework="pt") as f:
        if (f.metadata() or {}).get("format") != FORMAT:
            raise ValueError(f"{path}: not a {FORMAT} calibration file")
        return {k: f.get_tensor(k) for k in f.keys()}


def model_calibration(source: ModelSource) -> dict[str, torch.Tensor]:
    """``source``'s calibration, from ``calibration_path``; ``CalibrationMissing`` names the command."""
    return load_calibration(calibration_path(source), model=source.name)


class InputQuantizer:
    """A float input (..., in) -> (R, in) uint8 rows on oneDNN's row grid (``packed_rows``), divided by
    the SmoothQuant factors and quantized per tensor (zero point 128). Layers that read one tensor
    and were calibrated on one set of factors (query, key and value) share one: the first of its
    ``readers`` to get the tensor quantizes it, the others are handed that result (one quantizing
    instead of three: the pass cost as much as AMX-INT8's kernel, docs/benchmarks.md), and it is
    dropped once every reader had it. Inference only, one forward at a time (as a rank runs it)."""

    def __init__(self, smooth: torch.Tensor, amax: float, *, readers: int = 1) -> None:
        self.act_scale = float(amax) / 127  # uint8 step; zero point 128 covers [-amax, amax]
        self.in_mul = 1.0 / (smooth.float() * self.act_scale)  # (in,) fp32
        self.readers = readers
        self._held: tuple[torch.Tensor, torch.Tensor, int] | None = None  # (input, rows, readers left)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._held is not None and self._held[0] is x:
            _, q, left = self._held
            self._held = (x, q, left - 1) if left > 1 else None
            return q
        q = self._quantize(x)
        self._held = (x, q, self.readers - 1) if self.readers > 1 else None
        return q

    def _quantize(self, x: torch.Tensor) -> torch.Tensor:
        # Quantizing in fp32 is 3x faster than in bf16 on CPUs (vectorised in-place ops), and int8 ->
        # uint8 (+ the zero point 128) is one XOR of a byte. A packed bf16 batch is on the row grid
        # already; an fp32 one (CPUs without bf16 units) gets spare rows (zeros) here.
        rows = x.shape[:-1].numel()
        y = x.new_empty(packed_rows(rows), x.shape[-1], dtype=torch.float32)  # (R, in), a copy of x
        y[:rows] = x.reshape(rows, -1)
        y[rows:] = 0
        y.mul_(self.in_mul).round_().clamp_(-128, 127)
        return y.to(torch.int8).view(torch.uint8).bitwise_xor_(ZERO_POINT)  # (R, in) uint8


class Int8Linear(nn.Module):
    """A Linear layer (or one rank's shard of a tensor-parallel one) in static int8; ``reduce``: the
    row-parallel all-reduce of the partial products before the bias (None: none); ``gelu``: the
    exact GELU that follows it, fused into oneDNN's kernel (3x faster with fp32 outputs). Inference only."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        smooth: torch.Tensor,
        amax: float,
        reduce: object = None,
        gelu: bool = False,
        quantizer: InputQuantizer | None = None,
    ) -> None:
        super().__init__()
        w = weight.detach().float() * smooth  # (out, in): the columns carry the factors
        levels = weight_max()
        w_scale = (w.abs().amax(dim=1) / levels).clamp(min=1e-8)  # (out,) per output channel
        w_q = torch.round(w / w_scale[:, None]).clamp(-levels, levels).to(torch.int8)
        # the input's quantizer: its own, or one shared with the layers that read the same tensor
        self.quantizer = quantizer or InputQuantizer(smooth, amax)
        self.register_buffer("w_scale", w_scale)
        self.register_buffer("w_zero", torch.zeros(w_scale.shape[0], dtype=torch.long))
        self.packed = torch.ops.onednn.qlinear_prepack(w_q, None)  # oneDNN's blocked int8 layout
        self.weight_bytes = w_q.numel()  # what the packed weight holds (for the gang's ready info)
        self.bias = None if bias is None else bias.detach().float()
        self.reduce = reduce
        self.post_op = "gelu" if gelu else "none"
        if gelu and reduce is not None:
            raise ValueError("a GELU cannot follow a row-parallel layer before its all-reduce")
        self.in_features, self.out_features = int(w.shape[1]), int(w.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (..., in) float -> (..., out) in x's dtype. The rows go to oneDNN on its row grid
        # (``packed_rows``: a kernel per new row count costs ~1 ms); the spare rows are cut off after.
        rows = x.shape[:-1].numel()
        q = self.quantizer(x)  # (R, in) uint8
        bias = self.bias if self.reduce is None else None
        y = torch.ops.onednn.qlinear_pointwise(
            q, self.quantizer.act_scale, ZERO_POINT, self.packed, self.w_scale, self.w_zero, bias,
            1.0, 0, x.dtype, self.post_op, [None], "none",
        )[:rows].view(*x.shape[:-1], -1)  # fmt: skip
        if self.reduce is not None:
            y = reduce_from_tp(y, self.reduce)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        post = ", gelu" if self.post_op == "gelu" else ""
        shared = f", input shared by {self.quantizer.readers}" if self.quantizer.readers > 1 else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"act_scale={self.quantizer.act_scale:.3g}{post}{shared}"
        )


def _int8_of(
    layer: nn.Module, smooth: torch.Tensor, amax: float, *, gelu: bool, quantizer: InputQuantizer | None
) -> Int8Linear:
    if isinstance(layer, RowParallelLinear):  # the input arrives sharded: this shard's slice of the factors
        spec = layer.shard_specs["weight"]  # along dim 1 of the (out, in) weight
        smooth = ShardSlice(0, spec.start, spec.length, spec.blocks).take(smooth)
        return Int8Linear(layer.weight, layer.bias, smooth=smooth, amax=amax, reduce=layer.group)
    # nn.Linear, or a column-parallel shard (input replicated; copy_to_tp is the identity forward)
    return Int8Linear(layer.weight, layer.bias, smooth=smooth, amax=amax, gelu=gelu, quantizer=quantizer)


def _shared_quantizers(
    targets: dict[str, nn.Module], stats: dict[str, torch.Tensor]
) -> dict[str, InputQuantizer]:
    """One ``InputQuantizer`` for each set of sibling layers calibrated on one input (the same factors
    and range: ``calibrate`` gives them to the layers that read one tensor), by layer name."""
    groups: dict[tuple[str, float, bytes], list[str]] = {}  # (parent, range, factors) -> names
    for name, layer in targets.items():
        if isinstance(layer, RowParallelLinear):  # a sharded input of its own
            continue
        smooth, amax = stats[f"{name}.smooth"], float(stats[f"{name}.amax"])
        groups.setdefault((name.rpartition(".")[0], amax, smooth.float().numpy().tobytes()), []).append(name)
    out: dict[str, InputQuantizer] = {}
    for group in groups.values():
        if len(group) > 1:
            first = group[0]
            shared = InputQuantizer(
                stats[f"{first}.smooth"].float(), float(stats[f"{first}.amax"]), readers=len(group)
            )
            out.update(dict.fromkeys(group, shared))
    return out


def quantize_linears(model: nn.Module, stats: dict[str, torch.Tensor]) -> int:
    """Swap ``model``'s target Linear layers for ``Int8Linear`` ones, in place; the number swapped.
    A stage holds some of the calibrated layers; a target with no stats is an error (a stale file)."""
    if model.training:
        raise ValueError("int8 Linear layers are for inference: call model.eval() first")
    targets = target_linears(model)
    for name in targets:
        if f"{name}.smooth" not in stats:
            raise ValueError(f"the int8 calibration has no entry for {name}: recalibrate the model")
    shared = _shared_quantizers(targets, stats)
    count = 0
    for name, layer in targets.items():
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        # the encoder's MLP computes down(act(up(x))): an exact GELU after ``up`` goes into its kernel
        gelu = child == "up" and getattr(owner, "act", None) is F.gelu
        smooth, amax = stats[f"{name}.smooth"].float(), float(stats[f"{name}.amax"])
        q = _int8_of(layer, smooth, amax, gelu=gelu, quantizer=shared.get(name))
        setattr(owner, child, q)
        if gelu:
            owner.act = nn.Identity()
        count += 1
    logger.debug("int8: %d Linear layers quantized", count)
    return count
