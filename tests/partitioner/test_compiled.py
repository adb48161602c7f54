"""torch.compile of serving stages (``partitioner/compiled.py``): the choice, parity, the warm-up.

- ``resolve_compile``: ``off`` by default; ``on`` is refused, with the reason, for tensor-parallel
  stages and without a C++ compiler.
- A compiled stage (the whole model, and a later pipeline stage fed hidden states) equals eager in
  fp32 within 1e-4, and after ``warm_up`` a new batch size and an unwarmed length compile nothing
  more (requests never pay for a compile).
- A compiled pp=2 gang passes ``verify`` against the transformers reference in fp32 (1e-4), and the
  CLI refuses ``--compile on`` with tensor parallelism in one line.

    python -m pytest tests/partitioner/test_compiled.py -q
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

from shardserve.models.build import build_model
from shardserve.models.registry import resolve_model
from shardserve.partitioner import compiled
from shardserve.partitioner.compiled import compile_stage, resolve_compile, warm_up
from shardserve.partitioner.plan import ParallelDims, make_plan
from shardserve.partitioner.precision import PrecisionError
from shardserve.partitioner.stages import slice_stage
from shardserve.partitioner.stream.verify import verify_partitioned


@pytest.fixture
def cxx(monkeypatch):
    def use(path: str | None) -> None:
        monkeypatch.setattr(compiled, "_cxx_compiler", lambda: path)

    return use


def test_on_is_obeyed_or_refused_with_the_reason(cxx):
    cxx("/usr/bin/c++")
    assert resolve_compile("on", device="cpu", tp=1) is True
    assert resolve_compile("off", device="cpu", tp=2) is False
    with pytest.raises(PrecisionError, match=r"--compile on is not possible here: tensor-parallel .*tp=2"):
        resolve_compile("on", device="cpu", tp=2)
    with pytest.raises(PrecisionError, match="compile 'auto' unknown; choose from off, on"):
        resolve_compile("auto", device="cpu", tp=1)
    cxx(None)
    with pytest.raises(PrecisionError, match="no C\\+\\+ compiler"):
        resolve_compile("on", device="cpu", tp=1)


def _inputs(stage, batch: int, seq: int) -> tuple:
    g = torch.Generator().manual_seed(batch * 1000 + seq)
    mask = torch.ones(batch, seq, dtype=torch.long)  # (B, S)
    mask[0, seq // 2 :] = 0  # padding in one row
    if stage.embeddings is not None:
        ids = torch.randint(5, stage.config.vocab_size, (batch, seq), generator=g)  # (B, S)
        types = torch.zeros_like(mask) if stage.config.uses_token_types else None
        return ids, mask, types
    return torch.randn(batch, seq, stage.config.hidden_size, generator=g), mask, None  # (B, S, H)


@pytest.mark.parametrize("stage_index", [None, 1], ids=["whole-model", "later-stage"])
def test_compiled_stage_equals_eager_and_warm_up_covers_new_shapes(stage_index):
    source = resolve_model("tiny-bert")
    eager, stage = build_model(source).eval(), build_model(source).eval()  # the same checkpoint
    if stage_index is not None:
        plan = make_plan(source.config, ParallelDims(pp=2, tp=1))
        slice_stage(eager, plan, stage_index)
        slice_stage(stage, plan, stage_index)
    torch._dynamo.reset()
    compile_stage(stage)
    warm_up(stage, lengths=(32, 64), dtype=torch.float32)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1  # the warm-up compiled
    with torch.inference_mode():
        for batch, seq in ((3, 48), (1, 80), (5, 64)):  # batch 3 / 5 and length 48 / 80 were not warmed up
            x = _inputs(stage, batch, seq)
            real = x[1].bool()  # (B, S): eager packs the batch and returns zeros at padding positions
            torch.testing.assert_close(stage(*x)[real], eager(*x)[real], atol=1e-4, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == graphs, "a request shape compiled a new graph"


def test_compiled_gang_passes_verify_in_fp32():
    result = verify_partitioned(resolve_model("tiny-bert"), ParallelDims(pp=2, tp=1), compile=True)
    assert result.passed and result.max_abs < 1e-4 and result.span_changes == 0, result


def test_verify_cli_refuses_compile_with_tensor_parallelism_in_one_line():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardserve.cli",
            "verify",
            "--model",
            "tiny-bert",
            "--tp",
            "2",
            "--compile",
            "on",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --compile on is not possible here: tensor")
    assert "Traceback" not in proc.stderr
