"""Shared pytest fixtures: offline Hugging Face, the shared SQuAD data folder, and the default model's
fp32 answers to the first questions of the development pool (computed once per session: the slice
figure, the emulated-bf16 check and the int8 bound all score from them)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parents[1]
SQUAD_DIR = REPO_ROOT.parent / "shared" / "data" / "squad"


@pytest.fixture(scope="session")
def squad_dir() -> Path:
    """The shared SQuAD folder; tests that need it skip when ``../shared`` is absent."""
    if not SQUAD_DIR.is_dir():
        pytest.skip(f"shared SQuAD data not found at {SQUAD_DIR}")
    return SQUAD_DIR


POOL_SLICE = 1000  # the development pool's first questions that fp32_pool_answers answers


@pytest.fixture(scope="session")
def pool_questions(squad_dir: Path) -> Callable[[int, str], Any]:
    """``pool_questions(n, dtype)``: the ``EvalConfig`` of the default model on the first ``n``
    questions of the development pool, in ``dtype``."""
    from shardserve.training.evaluate import EvalConfig

    data = str(squad_dir / "squad-v1.1-train-pool.json")
    return lambda n, dtype: EvalConfig(model="default", data=data, max_examples=n, dtype=dtype)


@pytest.fixture(scope="session")
def fp32_pool_answers(pool_questions: Callable[[int, str], Any]) -> tuple[list[Any], dict[str, str]]:
    """(examples, answers): fp32's answers to the first ``POOL_SLICE`` pool questions, one pass per
    session; a test scoring fewer scores ``examples[:n]``."""
    from shardserve.training.evaluate import predict_answers

    return predict_answers(pool_questions(POOL_SLICE, "float32"), show_progress=False)
