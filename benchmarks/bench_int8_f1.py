"""int8 judged the MLPerf way: SQuAD F1 on the development pool against fp32's, beside its speed, one run.

MLPerf Inference's BERT benchmark accepts any precision that keeps 99 % of the fp32 F1 on SQuAD
v1.1. This scores the unpartitioned model over the development pool (``../shared/data/squad``, the
42 dev articles) in each variant, windowed and decoded as ``shardserve eval`` does
(``shardserve.training.evaluate.eval_inputs`` / ``answers_of``), and times the forward over every window:

  fp32       the reference
  bf16       what ``--dtype auto`` picks on a CPU with bf16 units (skipped without them)
  int8       what ``--dtype int8`` serves (``partitioner/int8.py``): static int8 attention and FFN-up
             projections with SmoothQuant, calibrated as ``shardserve quantize`` does on
             ``--calibration`` training questions; FFN-down projections and the rest in bf16 (fp32
             on a CPU without bf16 units)
  int8-fp32  the same with the rest in fp32 whatever the CPU (what a CPU without bf16 units serves)
  int8-dyn   torch.ao dynamic quantization of the encoder's Linear layers, per-tensor weights
  int8-dyn-pc  the same with per-channel weights (``per_channel_dynamic_qconfig``)
  int8-static  static (calibrated) int8 of weights AND activations: each encoder Linear wrapped in
             quantize -> quantized linear (oneDNN: VNNI / AMX-INT8) -> dequantize, per-channel
             weights, activation ranges from a histogram over ``--calibration`` questions of the
             training set (not the scored pool)
  int8-static-ffn  the same but the FFN's output projections stay fp32 (their input, the GELU's
             output, has the widest range: where per-tensor activation int8 loses most)
  int8-sq, int8-sq-ffn  the two above with SmoothQuant (Xiao et al. 2023, ``--sq-alpha`` a): each
             Linear's input divided per channel by s = max|x|^a / max|w|^(1-a) (from the
             calibration), its weight columns multiplied by s: activation outliers move into the weights
  int8-sq-ffnbf16  int8-sq with the FFN's output projections in bf16 instead (fast and accurate)

    python benchmarks/bench_int8_f1.py                                   # the whole pool, ~20 min on 2 cores
    python benchmarks/bench_int8_f1.py --variants fp32,bf16,int8 --json int8.json    # the shipped path
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving_report import machine_info

from shardserve.models.build import build_model
from shardserve.models.registry import resolve_model
from shardserve.partitioner.int8 import calibrate, quantize_linears, smooth_factors
from shardserve.partitioner.precision import compute_dtype
from shardserve.training.evaluate import EvalConfig, EvalInputs, answers_of, eval_inputs
from shardserve.training.squad_metrics import evaluate

logger = logging.getLogger("bench_int8_f1")

VARIANTS = (
    "fp32",
    "bf16",
    "int8",
    "int8-fp32",
    "int8-dyn",
    "int8-dyn-pc",
    "int8-static",
    "int8-static-ffn",
    "int8-sq",
    "int8-sq-ffn",
    "int8-sq-ffnbf16",
)
SQUAD = Path(__file__).resolve().parents[2] / "shared" / "data" / "squad"
POOL = SQUAD / "squad-v1.1-train-pool.json"
TRAIN = SQUAD / "squad-v1.1-train.json"


def model_of(
    variant: str, source: object, calibration: EvalInputs | None = None, *, sq_alpha: float = 0.5
) -> nn.Module:
    """The unpartitioned model in ``variant`` (the QA head stays fp32 in every one)."""
    if variant in ("int8", "int8-fp32"):
        assert calibration is not None
        stats = calibrate(
            build_model(source, dtype=torch.float32).eval(), calibration.batches, alpha=sq_alpha
        )
        rest = torch.float32 if variant == "int8-fp32" else compute_dtype("int8")
        model = build_model(source, dtype=rest).eval()
        quantize_linears(model, stats)
        return model
    model = build_model(source, dtype=torch.bfloat16 if variant == "bf16" else torch.float32).eval()
    if variant in ("int8-dyn", "int8-dyn-pc"):
        from torch.ao.quantization import (
            default_dynamic_qconfig,
            per_channel_dynamic_qconfig,
            quantize_dynamic,
        )

        qconfig = per_channel_dynamic_qconfig if variant == "int8-dyn-pc" else default_dynamic_qconfig
        with warnings.catch_warnings():  # torch.ao's quantized tensors are deprecated in torch 2.13
            warnings.simplefilter("ignore", UserWarning)
            model.layers = quantize_dynamic(model.layers, {nn.Linear: qconfig}, dtype=torch.qint8)
    elif variant.startswith("int8-s"):
        assert calibration is not None
        smooth = sq_alpha if variant.startswith("int8-sq") else None
        keep = "fp32" if variant.endswith("-ffn") else "bf16" if variant.endswith("-ffnbf16") else None
        static_int8(model, calibration, keep_ffn_out=keep, smooth=smooth)
    return model


class _Bf16(nn.Module):
    """A Linear computed in bf16 inside an fp32 model (the layer int8 loses most on, kept fast)."""

    def __init__(self, inner: nn.Linear) -> None:
        super().__init__()
        self.inner = inner.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.to(torch.bfloat16)).float()


class _Smooth(nn.Module):
    """SmoothQuant's per-input-channel division of a Linear's input (its weight columns multiplied back)."""

    def __init__(self, inv_scale: torch.Tensor, inner: nn.Module) -> None:
        super().__init__()
        self.register_buffer("inv_scale", inv_scale)  # (in_features,)
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in_features)
        return self.inner(x * self.inv_scale)


def static_int8(
    model: nn.Module, calibration: EvalInputs, *, keep_ffn_out: bool, smooth: float | None
) -> None:
    """Replace the encoder's Linear layers by calibrated static int8 ones, in place (module doc);
    ``keep_ffn_out``: "fp32" / "bf16" for the FFN's down projections (None: int8 too); ``smooth``:
    SmoothQuant's alpha (None: none)."""
    from torch.ao import quantization as tq

    torch.backends.quantized.engine = "onednn"  # VNNI / AMX-INT8 kernels; full 8-bit activations
    qconfig = tq.QConfig(
        activation=tq.HistogramObserver.with_args(reduce_range=False),
        weight=tq.default_per_channel_weight_observer,
    )
    targets = [
        (module, child, sub)
        for module in list(model.layers.modules())
        for child, sub in list(module.named_children())
        if isinstance(sub, nn.Linear) and not (keep_ffn_out and child == "down")  # MLP.down
    ]
    if keep_ffn_out == "bf16":
        for module in list(model.layers.modules()):
            if isinstance(getattr(module, "down", None), nn.Linear):
                module.down = _Bf16(module.down)
    if smooth is not None:  # per input channel: max |x| over the calibration windows
        amax = {id(sub): torch.zeros(sub.in_features) for _, _, sub in targets}

        def record(sub: nn.Module, args: tuple) -> None:
            x = args[0].detach().abs().flatten(0, -2)  # (tokens, in_features)
            amax[id(sub)] = torch.maximum(amax[id(sub)], x.amax(dim=0))

        hooks = [sub.register_forward_pre_hook(record) for _, _, sub in targets]
        with torch.inference_mode():
            for ids, mask, types in calibration.batches:
                model(ids, mask, types)
        for h in hooks:
            h.remove()
    wrapped = []
    for module, child, sub in targets:
        wrapper = tq.QuantWrapper(sub)
        wrapper.qconfig = qconfig
        wrapped.append(wrapper)
        if smooth is not None:
            scale = smooth_factors(sub.weight, amax[id(sub)], smooth)  # (in_features,)
            with torch.no_grad():
                sub.weight.mul_(scale)  # (out, in) * (in,)
            setattr(module, child, _Smooth(1.0 / scale, wrapper))
        else:
            setattr(module, child, wrapper)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for w in wrapped:
            tq.prepare(w, inplace=True)
        with torch.inference_mode():
            for ids, mask, types in calibration.batches:
                model(ids, mask, types)
        for w in wrapped:
            tq.convert(w, inplace=True)
    logger.info("static int8: %d Linear layers quantized (SmoothQuant alpha %s)", len(wrapped), smooth)


def score(
    variant: str,
    source: object,
    cfg: EvalConfig,
    inputs: EvalInputs,
    calibration: EvalInputs | None,
    *,
    sq_alpha: float,
) -> dict[str, float]:
    model = model_of(variant, source, calibration, sq_alpha=sq_alpha)
    full, row = inputs.empty_logits(), 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for ids, mask, types in inputs.batches:
            full[row : row + ids.shape[0], : ids.shape[1]] = model(ids, mask, types).float()  # (b, s, 2)
            row += ids.shape[0]
    seconds = time.perf_counter() - t0
    metrics = evaluate(inputs.examples, answers_of(cfg, inputs, full))
    return {"windows_s": inputs.windows / seconds, "exact": metrics["exact"], "f1": metrics["f1"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="registry name or model folder")
    p.add_argument("--data", type=Path, default=POOL, help="SQuAD v1.1 file (default: the dev pool)")
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}"
    )
    p.add_argument("--max-examples", type=int, default=None, help="score only the first N questions")
    p.add_argument(
        "--calibration",
        type=int,
        default=512,
        help="int8 and the static variants: questions of the training set (--calibration-data) calibrated "
        "on (default: %(default)s)",
    )
    p.add_argument("--calibration-data", type=Path, default=TRAIN, help="SQuAD file calibrated on")
    p.add_argument("--sq-alpha", type=float, default=0.5, help="SmoothQuant's alpha (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    variants = [v for v in args.variants.split(",") if v]
    if unknown := [v for v in variants if v not in VARIANTS]:
        p.error(f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    if not args.data.is_file():
        p.error(f"{args.data}: no such file (the SQuAD data lives in ../shared/data/squad)")
    info = machine_info("auto")
    if "bf16" in variants and not info["bf16_units"]:
        logger.info("bf16 skipped: %s has no bf16 units", info["cpu"])
        variants.remove("bf16")
    source = resolve_model(args.model)
    cfg = EvalConfig(model=args.model, data=str(args.data), max_examples=args.max_examples)
    inputs = eval_inputs(cfg, source)
    calibration = None
    if any(v in ("int8", "int8-fp32") or v.startswith(("int8-static", "int8-sq")) for v in variants):
        calib_cfg = EvalConfig(
            model=args.model, data=str(args.calibration_data), max_examples=args.calibration
        )
        calibration = eval_inputs(calib_cfg, source)
    rows = []
    for variant in variants:
        row = {"variant": variant, **score(variant, source, cfg, inputs, calibration, sq_alpha=args.sq_alpha)}
        rows.append(row)
        logger.info(
            "%s: %.1f windows/s, EM %.2f, F1 %.2f", variant, row["windows_s"], row["exact"], row["f1"]
        )
    base = next((r["f1"] for r in rows if r["variant"] == "fp32"), None)
    print(f"\n{info['cpu']}, {torch.get_num_threads()} threads; {args.model} on {len(inputs.examples)} questions, "
          f"{inputs.windows} windows")  # fmt: skip
    print(
        f"{'variant':16} {'win/s':>7} {'EM':>6} {'F1':>6} {'F1/fp32':>8}  (MLPerf's bound: F1/fp32 >= 0.99)"
    )
    for r in rows:
        ratio = f"{r['f1'] / base:8.3f}" if base else f"{'-':>8}"
        print(f"{r['variant']:16} {r['windows_s']:7.1f} {r['exact']:6.2f} {r['f1']:6.2f} {ratio}")
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": info, "model": args.model, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
