"""Processes as tests see them through Linux /proc: a process's parent, and whether it is gone.

    from tests.procs import gone, parent_of
"""

from __future__ import annotations


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name: state, ppid, ..."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def parent_of(pid: int) -> int:
    return int(_stat_fields(pid)[1])


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its parent has not reaped yet."""
    try:
        return _stat_fields(pid)[0] == "Z"
    except FileNotFoundError:
        return True
