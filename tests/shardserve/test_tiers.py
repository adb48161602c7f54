"""The test tiers' module lists (tests/conftest.py ``TIERS``) name modules that exist, and the markers
reach their tests: ``-m "not slow"`` leaves a slow module's tests out."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO_ROOT, TIERS


def test_every_listed_module_exists() -> None:
    missing = [
        f"{marker}: {m}"
        for marker, mods in TIERS.items()
        for m in mods
        if not (REPO_ROOT / "tests" / m).is_file()
    ]
    assert not missing, f"stale entries in tests/conftest.py TIERS: {missing}"


def test_the_fast_tier_leaves_the_slow_modules_out() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow", "tests/training/test_trainer_parity.py", "tests/shardserve/test_tiers.py"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (
        "test_trainer_parity.py" not in out.stdout
        and "test_tiers.py::test_every_listed_module_exists" in out.stdout
    ), out.stdout
