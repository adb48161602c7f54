"""A local rank's process as its driver sees it, whether or not the fork server that forked it lives.

multiprocessing hands a forked rank's exit status to the driver through its fork server's pipe, so
when the fork server dies every rank reads as exited (status 255) while it runs on. On Linux a
``pidfd`` on the rank (``os.pidfd_open``) is readable exactly when the rank exits, whoever its
parent is by then: ``RankProcess`` watches that, takes the status from the fork server while it
can give one (or reaps the rank itself where it became the rank's parent, as a container's PID 1
does), and signals through the pidfd (no pid reuse). Without pidfds it is multiprocessing's view.
The ranks in turn watch their driver, not their parent (``rank.py``), so a gang outlives the death
of its fork server, and the next gang starts a new one.

    proc = RankProcess(ctx.Process(target=worker_main, args=...))    # started
    proc.exitcode       # None while it runs; -9 killed by SIGKILL; 255: exited, status unknown
    proc.sentinel       # readable once it exited (select / zmq poll)
    proc.kill(); proc.join(timeout=5); proc.close()

Tests: ``pytest tests/partitioner/runtime/test_rank_process.py``.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import signal
from multiprocessing.process import BaseProcess

STATUS_WAIT_S = 1.0  # the fork server writes a rank's status right after the rank exits
UNKNOWN_STATUS = 255  # what multiprocessing reports for a rank whose fork server is gone


def pidfd_of(pid: int) -> int | None:
    """A pidfd on ``pid`` (Linux 5.3+), or None where there is none (or the process is gone)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def has_exited(pidfd: int, timeout_s: float | None = 0.0) -> bool:
    """Whether the process of ``pidfd`` has exited, waiting up to ``timeout_s`` (None: for ever).
    ``poll``, not ``select``: a busy server's descriptors pass select's limit of 1024."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else math.ceil(1000 * timeout_s)))


class RankProcess:
    """See module doc: a started ``multiprocessing`` process, watched through a pidfd where one exists."""

    def __init__(self, proc: BaseProcess) -> None:
        self.proc = proc
        self.pid: int = proc.pid  # type: ignore[assignment]  # started
        self._pidfd = pidfd_of(self.pid)
        self._code: int | None = None

    @property
    def sentinel(self) -> int:
        return self._pidfd if self._pidfd is not None else self.proc.sentinel

    @property
    def exitcode(self) -> int | None:
        if self._code is None:
            if self._pidfd is None:
                return self.proc.exitcode
            if has_exited(self._pidfd):
                self._code = self._status()
        return self._code

    def _status(self) -> int:
        """The exit status of a rank that exited: its own reaping where this process became its
        parent, else the fork server's report, else ``UNKNOWN_STATUS``."""
        with contextlib.suppress(OSError):  # not this process's child (ChildProcessError)
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                return os.waitstatus_to_exitcode(status)
        self.proc.join(timeout=STATUS_WAIT_S)
        code = self.proc.exitcode
        return UNKNOWN_STATUS if code is None else code

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds (None: for ever) for the process to exit."""
        if self._pidfd is None:
            self.proc.join(timeout)
        elif has_exited(self._pidfd, timeout):
            self.exitcode  # noqa: B018  # records the status

    def kill(self) -> None:
        """SIGKILL, unless it exited already."""
        if self._pidfd is None:
            self.proc.kill()
            return
        try:
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        except ProcessLookupError:  # exited
            pass
        except OSError:  # refused (a seccomp profile that allows pidfd_open only): by pid, if it runs
            if self.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        """Release the pidfd (the process was killed and joined); multiprocessing's view from here on."""
        if self._pidfd is not None:
            self.exitcode  # noqa: B018  # records the status while the pidfd can tell it
            os.close(self._pidfd)
            self._pidfd = None
