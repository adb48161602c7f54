"""torch.compile for serving stages: whether to compile (``--compile``), how, and the warm-up.

``shardserve serve --compile on`` (default ``off``) makes every serving rank compile its stage with
inductor: weights frozen, dynamic shapes, so one graph covers every batch size and length bucket.
Each length bucket then runs at batch 1 and 2 before the rank reports ready. The first call
compiles; dynamo specialises batch 1, so there are two graphs. No request waits for a compile.
``shardserve verify --compile on`` checks a compiled gang's numbers.

It is off by default because it measured slower where it counts. On a 2-core Intel AMX CPU in bf16
(docs/benchmarks.md, "Precision and kernels"), the compiled forward is 15-30 % faster in isolation.
Yet the same server with compiled ranks answered 2-8 % fewer questions per second than eager ranks,
in alternating runs, and each gang takes ~30 s instead of 2 s to turn ready. Its edge comes mostly
from shapes it has already run, and a server sees ~100 (batch, bucket) shapes. On AVX512-BF16 without
AMX and in fp32 it was no faster even in isolation. CUDA has not been measured. Tensor-parallel
stages cannot be compiled, because their layers all-reduce inside the region that would be
compiled. Inductor's CPU backend needs a C++ compiler.

    resolve_compile("on", device="cpu", tp=1)                   # True; PrecisionError where it cannot run
    stage = compile_stage(stage)                                # in the rank, after loading
    seconds = warm_up(stage, lengths=(64, 128, 384), dtype=torch.bfloat16)   # before ready()
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Iterable

import torch
from tqdm import tqdm

from shardserve.models.build import QAModel
from shardserve.partitioner.precision import PrecisionError

logger = logging.getLogger(__name__)

COMPILE_CHOICES: tuple[str, ...] = ("off", "on")


def _cxx_compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")


def resolve_compile(requested: str, *, device: str, tp: int) -> bool:
    """``--compile`` for ranks on ``device`` with ``tp`` tensor-parallel ranks: whether they compile.

    Raises ``PrecisionError`` for ``on`` where the stage cannot be compiled. The message says why.
    """
    if requested not in COMPILE_CHOICES:
        raise PrecisionError(f"compile {requested!r} unknown; choose from {', '.join(COMPILE_CHOICES)}")
    if requested == "off":
        return False
    if tp > 1:
        blocker = f"tensor-parallel stages (tp={tp}) all-reduce inside their layers"
    elif torch.device(device).type == "cpu" and _cxx_compiler() is None:
        blocker = "no C++ compiler found for inductor's CPU backend (install g++ or set CXX)"
    else:
        return True
    raise PrecisionError(f"--compile on is not possible here: {blocker}; use --compile off")


def compile_stage(stage: torch.nn.Module, *, dynamic: bool = True) -> torch.nn.Module:
    """Compile ``stage`` in place (inductor; weights frozen as constants, which is inference only)."""
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True  # constant-fold the weights, prepack them for oneDNN
    # compile in this process: no pool of compile-worker processes beside a rank that the device pool
    # counts as one core, and none left behind when a rank is killed
    inductor_config.compile_threads = 1
    # torch.fx's (disabled) progress bars make tqdm create its multiprocessing lock: a named semaphore
    # that a rank ending in os._exit never unlinks (the resource tracker warns). A thread lock does here.
    tqdm.set_lock(threading.RLock())
    stage.compile(dynamic=dynamic)
    return stage


def warm_up(
    stage: QAModel,
    *,
    lengths: Iterable[int],
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
) -> float:
    """Run ``stage`` on dummy inputs for every length at batch 1 and 2 (the two graphs dynamo makes)
    so that no request pays for a compile. Returns the seconds it took.

    Inputs are made the way a serving rank receives them: (B, S) int64 ids, mask and (for models
    that use them) token types for the stage with the embeddings; (B, S, H) hidden states in
    ``dtype`` for later stages.
    """
    t0 = time.perf_counter()
    seqs = sorted(set(lengths))
    hidden = stage.config.hidden_size
    first = stage.embeddings is not None
    with torch.inference_mode():
        for batch in (1, 2):
            for seq in seqs:
                mask = torch.ones(batch, seq, dtype=torch.long, device=device)  # (B, S)
                if first:
                    x = torch.zeros(batch, seq, dtype=torch.long, device=device)  # (B, S) ids
                else:
                    x = torch.zeros(batch, seq, hidden, dtype=dtype, device=device)  # (B, S, H)
                types = torch.zeros_like(mask) if first and stage.config.uses_token_types else None
                stage(x, mask, types)
    seconds = time.perf_counter() - t0
    logger.info("compiled stage warmed up over %d lengths in %.1f s", len(seqs), seconds)
    return seconds
