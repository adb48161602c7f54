"""A forked rank's end, seen through its pidfd with its status, whether or not its fork server lives.

    pytest tests/partitioner/runtime/test_rank_process.py
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time

import pytest

from shardserve.partitioner.runtime.gang import rank_context
from shardserve.partitioner.runtime.rank_process import UNKNOWN_STATUS, RankProcess, has_exited, pidfd_of
from tests.procs import gone, parent_of

needs_pidfd = pytest.mark.skipif(pidfd_of(os.getpid()) is None, reason="needs pidfds (Linux 5.3+)")


def sleep_long() -> None:
    time.sleep(120)


def exit_with_3() -> None:
    sys.exit(3)


def start(target) -> RankProcess:
    proc = rank_context(__name__).Process(target=target, daemon=True)
    proc.start()
    return RankProcess(proc)


@pytest.mark.parametrize("pidfds", [True, False], ids=["pidfd", "without-pidfd"])
def test_a_rank_process_tells_how_it_ended(pidfds, monkeypatch):
    """Through its pidfd, or where there is none (not Linux) through multiprocessing's own view."""
    if not pidfds:
        monkeypatch.setattr("shardserve.partitioner.runtime.rank_process.pidfd_of", lambda pid: None)
    elif pidfd_of(os.getpid()) is None:
        pytest.skip("needs pidfds (Linux 5.3+)")
    sleeper, exiting = start(sleep_long), start(exit_with_3)
    assert (sleeper.sentinel == sleeper.proc.sentinel) is not pidfds
    try:
        exiting.join(timeout=60)
        assert exiting.exitcode == 3
        assert sleeper.exitcode is None
        sleeper.kill()
        sleeper.join(timeout=30)
        assert sleeper.exitcode == -signal.SIGKILL
    finally:
        for proc in (sleeper, exiting):
            proc.kill()
            proc.close()


@needs_pidfd
def test_a_rank_outlives_its_fork_server_and_is_still_watched():
    """When the fork server dies, multiprocessing reads its children as exited (255) while they run;
    ``RankProcess`` still sees the rank alive, kills it, sees it end; the next rank forks from a new
    fork server."""
    rank = start(sleep_long)
    try:
        server = parent_of(rank.pid)
        assert server != os.getpid()
        server_fd = pidfd_of(server)
        assert server_fd is not None
        os.kill(server, signal.SIGKILL)
        assert has_exited(server_fd, 30)
        os.close(server_fd)
        assert rank.proc.exitcode == UNKNOWN_STATUS  # multiprocessing's view: the pipe is gone
        assert rank.exitcode is None and not gone(rank.pid)
        assert not has_exited(rank.sentinel)
        rank.kill()
        rank.join(timeout=30)
        assert rank.exitcode in (-signal.SIGKILL, UNKNOWN_STATUS)  # reaped here, or by its new parent
        assert has_exited(rank.sentinel)
    finally:
        rank.kill()
        rank.close()
    again = start(exit_with_3)
    again.join(timeout=60)
    assert again.exitcode == 3
    again.close()


@needs_pidfd
def test_an_exit_is_seen_on_a_descriptor_past_selects_limit():
    """A busy server's descriptors pass 1024, where ``select`` stops working: the pidfd is polled."""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] <= 1100:
        pytest.skip("needs more than 1100 open files")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    fd = pidfd_of(child.pid)
    assert fd is not None
    high = os.dup2(fd, 1100)
    os.close(fd)
    try:
        assert has_exited(high, 30)
    finally:
        os.close(high)
        child.wait()
