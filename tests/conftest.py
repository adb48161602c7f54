"""Shared pytest fixtures: offline Hugging Face, the shared SQuAD data folder."""

from __future__ import annotations

import os
from pathlib import Path

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
