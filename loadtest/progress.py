"""Progress of the load test's long waits on stderr (the server's readiness, the run, the cooldown).

On a terminal a tqdm bar (elapsed / total seconds and a short status); elsewhere (a log file, CI)
one plain line every ``every_s`` seconds, so a 60 s wait or a 30 s run is never silent and logs
stay readable::

    status = StatusLine("steady load on http://127.0.0.1:8000", total_s=30)
    status.update(12.0, "480 requests, 0 failed")   # as often as convenient
    status.close("1200 requests, 0 failed")

Nothing is shown until the first ``update`` (a wait that ends at once prints nothing).
Tests: ``tests/loadtest/test_progress.py``.
"""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO


def _is_terminal(stream: TextIO) -> bool:
    """A terminal with a known width (a pty of width 0 would get an empty bar: plain lines then)."""
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):
        return False


class StatusLine:
    """A bar on a terminal, else a line every ``every_s`` s; ``enabled=False``: silent."""

    def __init__(
        self,
        desc: str,
        total_s: float,
        *,
        stream: TextIO | None = None,
        every_s: float = 10.0,
        enabled: bool = True,
        leave: bool = True,
        tty: bool | None = None,
    ) -> None:
        self.desc = desc
        self.total_s = float(total_s)
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = every_s
        self.enabled = enabled
        self.leave = leave
        self.tty = _is_terminal(self.stream) if tty is None else tty
        self._bar: Any = None
        self._next_line_at = 0.0
        self._elapsed = 0.0
        self._status = ""
        self._shown = False
        self._printed_last = False

    def _line(self, status: str) -> None:
        text = f"{self.desc}: {self._elapsed:.0f}/{self.total_s:.0f} s" + (f", {status}" if status else "")
        print(text, file=self.stream, flush=True)

    def update(self, elapsed_s: float, status: str = "") -> None:
        """Show ``elapsed_s`` of ``total_s`` and ``status`` (throttled off a terminal)."""
        if not self.enabled:
            return
        self._elapsed, self._status, self._shown = elapsed_s, status, True
        if self.tty:
            if self._bar is None:
                from tqdm import tqdm

                self._bar = tqdm(
                    total=self.total_s,
                    desc=self.desc,
                    file=self.stream,
                    leave=self.leave,
                    dynamic_ncols=True,
                    bar_format="{desc}: {bar:20} {n:.0f}/{total:.0f} s{postfix}",
                )
            self._bar.n = min(elapsed_s, self.total_s)
            self._bar.set_postfix_str(status, refresh=False)
            self._bar.refresh()
        elif elapsed_s >= self._next_line_at:
            self._line(status)
            self._next_line_at = elapsed_s + self.every_s
            self._printed_last = True
        else:
            self._printed_last = False

    def close(self, status: str | None = None) -> None:
        """End the display; ``status``: the final word (off a terminal, a last line if one was shown)."""
        if not (self.enabled and self._shown):
            return
        final = self._status if status is None else status
        if self._bar is not None:
            self._bar.set_postfix_str(final, refresh=False)
            self._bar.refresh()
            self._bar.close()
            self._bar = None
        elif status is not None or not self._printed_last:
            self._line(final)
        self._shown = False
