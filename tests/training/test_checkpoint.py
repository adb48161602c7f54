"""Checkpoint publication: files readable like ordinary files (issue 11.12)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import torch
from safetensors.torch import save_file

from training.checkpoint import publish


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_published_checkpoint_files_are_world_readable(tmp_path: Path) -> None:
    """safetensors writes 0600; a published checkpoint is 0644 / 0755 under umask 022, so a server
    running as another user (the container's 10001) can read a mounted checkpoint."""
    old_umask = os.umask(0o022)
    try:
        tmp = tmp_path / ".tmp-final"
        (tmp / "training_state").mkdir(parents=True)
        save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
        save_file({"w": torch.zeros(2)}, str(tmp / "training_state" / "rank0.safetensors"))
        (tmp / "config.json").write_text("{}")
        assert _mode(tmp / "model.safetensors") & 0o044 == 0  # what safetensors gives us
        final = tmp_path / "final"
        publish(tmp, final)
        assert _mode(final / "model.safetensors") == 0o644
        assert _mode(final / "training_state" / "rank0.safetensors") == 0o644
        assert _mode(final / "config.json") == 0o644
        assert _mode(final) == 0o755 and _mode(final / "training_state") == 0o755
        # a stricter umask is honoured
        os.umask(0o077)
        tmp2 = tmp_path / ".tmp-final2"
        tmp2.mkdir()
        save_file({"w": torch.zeros(2)}, str(tmp2 / "model.safetensors"))
        publish(tmp2, final)
        assert _mode(final / "model.safetensors") == 0o600
    finally:
        os.umask(old_umask)
