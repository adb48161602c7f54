"""Shared pytest fixtures: offline Hugging Face, the shared SQuAD data folder, and the default model's
fp32 answers to the first questions of the development pool (computed once per session: the slice
figure, the emulated-bf16 check and the int8 bound all score from them); and the markers of the
test tiers (registered in pyproject.toml):

- ``slow``: the modules that took 10 s or more in a whole run (2026-12-05, AMD EPYC Zen 3, 2 cores:
  29 modules, 22.2 of the suite's 24.1 min: rank processes, servers, training runs; a module split
  from one of them stays with it). The fast tier
  is the rest, ``python -m pytest -m "not slow"`` (about 3 min); re-measure with ``--durations=0``;
- ``netns``: network namespaces as hosts (root, iproute2); ``browser``: headless chromium."""

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

# a helper module the tests share reports its failed asserts as a test module does (pytest rewrites
# only test_*.py and conftest.py): tests/serving/engine/scheduler_helpers.py ``submit_all``
pytest.register_assert_rewrite("tests.serving.engine.scheduler_helpers")

# test modules (under tests/) by marker; tests/shardserve/test_tiers.py checks each one exists
TIERS: dict[str, frozenset[str]] = {
    "slow": frozenset(
        {
            "deploy/test_multihost_gang.py",
            "deploy/test_multihost_training.py",
            "loadtest/test_autoscaling.py",
            "loadtest/test_perf_analyzer.py",
            "loadtest/test_runner.py",
            "models/test_hf_weights.py",
            "partitioner/placement/test_search_scale.py",
            "partitioner/runtime/test_gang.py",
            "partitioner/runtime/test_remote.py",
            "partitioner/stream/test_multiplexed_gang.py",
            "partitioner/test_cli.py",
            "partitioner/test_compiled.py",
            "partitioner/test_int8.py",
            "partitioner/test_precision.py",
            "serving/frontend/test_api.py",
            "serving/frontend/test_api_admin.py",
            "serving/frontend/test_api_admission.py",
            "serving/frontend/test_api_failures.py",
            "serving/frontend/test_api_inputs.py",
            "serving/frontend/test_api_workers.py",
            "serving/frontend/http/test_openapi.py",
            "serving/frontend/test_serve_cli.py",
            "serving/frontend/test_serve_cli_signals.py",
            "serving/frontend/status/test_ui_browser.py",
            "serving/test_default_model.py",
            "serving/test_e2e.py",
            "serving/test_overload.py",
            "shardserve/test_packaging.py",
            "training/test_cli.py",
            "training/test_hybrid_parallel.py",
            "training/test_trainer_default.py",
            "training/test_trainer_parity.py",
            "training/test_trainer_resume.py",
        }
    ),
    "netns": frozenset(
        {"deploy/test_netns.py", "deploy/test_multihost_gang.py", "deploy/test_multihost_training.py"}
    ),
    "browser": frozenset({"serving/frontend/status/test_ui_browser.py", "docs/test_site.py"}),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test of a module in ``TIERS`` (see the module doc)."""
    tests = REPO_ROOT / "tests"
    for item in items:
        path = item.path.relative_to(tests).as_posix() if item.path.is_relative_to(tests) else ""
        for marker, modules in TIERS.items():
            if path in modules:
                item.add_marker(marker)


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
