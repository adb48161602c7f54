"""``shardserve quantize``: calibrate a model's int8 Linear layers on SQuAD questions, for ``--dtype int8``.

Windows ``--questions`` questions of ``--data`` as serving does, runs them through the model in fp32,
and writes its SmoothQuant factors and input ranges (``partitioner/int8.py``) where ``serve``,
``eval`` and ``verify`` find them (``shardserve.partitioner.int8.calibration_path``: inside a model folder, or the
cache for registry names). Then it scores the calibration windows in int8 against fp32 and says
how far the logits moved. Calibrate on training data, never on what you score.

    shardserve quantize --model default --data ../shared/data/squad/squad-v1.1-train.json
    shardserve eval --model default --data ../shared/data/squad/squad-v1.1-train-pool.json --dtype int8
    shardserve serve --model default --dtype int8       # auto picks it on x86 CPUs with AVX2 and no AMX
"""

from __future__ import annotations

import logging
import sys
import time

import torch
from pydantic import Field
from tqdm import tqdm

from shardserve.partitioner.command import Command
from shardserve.partitioner.int8 import DEFAULT_ALPHA
from shardserve.training.config import WindowSettings

logger = logging.getLogger(__name__)


class QuantizeSettings(WindowSettings):
    """``shardserve quantize``: the model, the calibration questions and SmoothQuant's alpha."""

    model: str = Field("default", description="registry name (default, ...) or HF model dir (e.g. RUN/final)")
    data: str = Field(description="SQuAD-format JSON calibrated on: training data, not the set you score")
    questions: int = Field(
        512,
        ge=1,
        description="questions of --data calibrated on (the first N; with 64 the development F1 fell 0.8-1.4 "
        "points against 128 or more)",
    )
    alpha: float = Field(
        DEFAULT_ALPHA,
        ge=0.0,
        le=1.0,
        description="SmoothQuant's migration strength (0: none, 1: all to weights)",
    )
    batch_size: int = Field(32, ge=1, description="windows per calibration forward")


def cmd_quantize(args: QuantizeSettings) -> int:
    from shardserve.models.build import build_model
    from shardserve.models.registry import ModelConfigError, resolve_model
    from shardserve.partitioner.int8 import calibrate, calibration_path, quantize_linears, save_calibration
    from shardserve.training.cli import input_file_error
    from shardserve.training.evaluate import EvalConfig, EvalConfigError, eval_inputs
    from shardserve.training.squad_data import SquadFormatError

    problem = input_file_error(args.data, "--data")
    try:
        if problem:
            raise ValueError(problem)
        source = resolve_model(args.model)
        cfg = EvalConfig(
            model=args.model, data=args.data, max_examples=args.questions, batch_size=args.batch_size,
            window=args.window(), dtype="float32",
        )  # fmt: skip
        inputs = eval_inputs(cfg, source)
    except (ValueError, ModelConfigError, EvalConfigError, SquadFormatError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    model = build_model(source, dtype=torch.float32).eval()
    with tqdm(total=2 * inputs.windows, desc="calibrate", unit="win", dynamic_ncols=True) as bar:
        stats = calibrate(model, inputs.batches, alpha=args.alpha, on_batch=bar.update)
    try:
        out = save_calibration(
            stats, calibration_path(source), model=source.name, questions=len(inputs.examples),
            windows=inputs.windows, alpha=args.alpha, data=args.data,
        )  # fmt: skip
    except OSError as exc:  # a read-only model folder or cache
        print(f"error: cannot write the calibration: {exc}", file=sys.stderr)
        return 2
    # how far int8 moves the logits on the windows it was calibrated on (the F1 is eval's verdict)
    quantized = build_model(source, dtype=torch.float32).eval()
    layers = quantize_linears(quantized, stats)
    worst = 0.0
    with (
        torch.inference_mode(),
        tqdm(total=inputs.windows, desc="check", unit="win", dynamic_ncols=True) as bar,
    ):
        for ids, mask, types in inputs.batches:
            diff = (quantized(ids, mask, types) - model(ids, mask, types)).abs()  # (b, s, 2)
            worst = max(worst, float(diff[mask.bool()].max()))  # over real tokens
            bar.update(ids.shape[0])
    print(
        f"wrote {out}: {layers} Linear layers of {source.name} calibrated on {len(inputs.examples)} questions "
        f"({inputs.windows} windows) in {time.perf_counter() - t0:.0f} s; max |logit diff| int8 vs fp32 "
        f"on them {worst:.2f}. Check F1: shardserve eval --model {args.model} --data <dev set> --dtype int8"
    )
    return 0


QUANTIZE = Command(
    "quantize",
    help="calibrate a model for --dtype int8 (static int8 Linear layers, SmoothQuant)",
    description="Run SQuAD questions through the model in fp32, record each Linear layer's input ranges, "
    "and write the model's int8 calibration, which serve, eval and verify read with --dtype int8 (and "
    "--dtype auto in serve and eval on x86 CPUs with AVX2 or better and no AMX, where int8 is faster than bf16). Calibrate on training data, not on what you score.",
    settings=QuantizeSettings,
    run=cmd_quantize,
)
