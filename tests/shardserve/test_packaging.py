"""The wheel installs one import package, ``shardserve``, holding every folder of the repository.

``pip wheel .`` (setup.py maps ``serving/`` to ``shardserve.serving``, and so on) must give a wheel
whose only top-level package is ``shardserve``, with every module and data file of the folders; the
wheel installed alone (not the editable install) imports as ``shardserve.*``, and ``import models``
fails, so installing shardserve never shadows a user's own ``models`` or ``serving`` module.

Run: python -m pytest tests/shardserve/test_packaging.py -q     (~30 s: pip builds the wheel)
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import shardserve

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("models", "partitioner", "serving", "training", "loadtest", "shardserve")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(REPO)],
        check=True, timeout=300,
    )  # fmt: skip
    (found,) = out.glob("shardserve-*.whl")
    return found


def test_the_wheel_holds_one_top_level_package_with_every_module(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"shardserve"}
    assert wheel.name.startswith(f"shardserve-{shardserve.__version__}-")
    sources = [p for folder in FOLDERS for p in (REPO / folder).rglob("*.py")]
    data = [
        *(REPO / "models" / "default").iterdir(),
        *(REPO / "serving" / "frontend" / "status" / "ui").iterdir(),
    ]
    want = {str(p.relative_to(REPO)) for p in [*sources, *data] if "__pycache__" not in p.parts}
    want = {n if n.startswith("shardserve/") else f"shardserve/{n}" for n in want}
    assert want - set(names) == set(), "files of the folders missing from the wheel"
    assert (
        "shardserve/models/default/README.md" in names
        and "shardserve/serving/frontend/status/ui/index.html" in names
    )


def test_the_installed_wheel_imports_as_shardserve_only(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(target), str(wheel)],
        check=True, timeout=300,
    )  # fmt: skip
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    code = (
        "import shardserve.models.qa_windows as w, shardserve.serving.frontend.status.pages as p; "
        "print(w.__file__); print(p.UI_DIR / 'index.html')"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    module, page = done.stdout.split()
    assert module.startswith(str(target)) and Path(page).is_file()
    for bare in FOLDERS[:-1]:
        done = subprocess.run([sys.executable, "-c", f"import {bare}"], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert done.returncode == 1 and f"No module named '{bare}'" in done.stderr
    version = subprocess.run(
        [sys.executable, "-m", "shardserve", "--version"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert version.stdout.strip() == f"shardserve {shardserve.__version__}", version.stderr
