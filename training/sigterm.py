"""SIGTERM as an exception in the ``shardserve train`` / ``eval`` driver, so that ``kill PID`` (or
Kubernetes / ``docker stop`` stopping the container) ends a run the way Ctrl-C does.

By default SIGTERM ended the driver at once (exit 143, no word; the checkpoints stayed resumable but
the user was not told), and a driver that is the container's PID 1 ignores it altogether (the kernel
drops default-action signals to PID 1), until the SIGKILL at the end of the grace period. Inside
`raise_on_sigterm` a SIGTERM raises `Terminated` in the main thread instead: the cleanup that Ctrl-C
runs runs (``trainer.train`` kills the gang's rank processes, ``Gang.__exit__`` those of an
evaluation), and the CLI says in one line where the run stands and exits with
`Terminated.exit_code` (128 + 15). A second SIGTERM ends the process at once, as before.

Only the CLI installs it, and only in the main thread (where Python runs signal handlers); the
library code the server shares never touches the process's signal handlers.

    with raise_on_sigterm():
        ...  # SIGTERM now raises Terminated here
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType

logger = logging.getLogger(__name__)


class Terminated(BaseException):
    """SIGTERM arrived inside `raise_on_sigterm`. A BaseException like KeyboardInterrupt (not an
    Exception), so ``except Exception`` handlers let it through to the CLI, and ``except
    BaseException`` cleanup (killing a gang) runs on the way."""

    exit_code = 128 + signal.SIGTERM  # 143: what a shell reports for a process SIGTERM ended

    def __init__(self) -> None:
        super().__init__("terminated (SIGTERM)")


@contextlib.contextmanager
def raise_on_sigterm() -> Iterator[None]:
    """Within the block, a SIGTERM to this process raises `Terminated` in the main thread (once:
    the handler then gives way to the default action, so a second SIGTERM ends the process at once).
    The previous handler is restored on the way out. Off the main thread this does nothing (Python
    only lets the main thread set handlers, and only runs them there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        logger.debug("SIGTERM: stopping")
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
