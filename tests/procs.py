"""Processes as tests see them through Linux /proc: a process's parent, and whether it is gone.

from tests.procs import alive, all_gone, gone, parent_of
"""

from __future__ import annotations

import time


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name: state, ppid, ..."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def parent_of(pid: int) -> int:
    return int(_stat_fields(pid)[1])


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie (dead) its parent has not reaped yet."""
    try:
        return _stat_fields(pid)[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # gone, or going while read
        return True


def alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` not ``gone``."""
    return [pid for pid in pids if not gone(pid)]


def all_gone(pids: list[int], *, within_s: float) -> bool:
    """Whether every process of ``pids`` is gone within ``within_s`` seconds (polled)."""
    deadline = time.monotonic() + within_s
    while not all(gone(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
