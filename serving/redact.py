"""What the server may tell a client (or a terminal) about an internal error: one line, no paths.

Worker failures arrive as multi-line ``GangError`` texts (a rank's traceback, with install and
checkpoint paths). Logs keep them whole; HTTP bodies, ``/readyz`` and the start-up error line get
``one_line(err)``: the error's first line plus, for a traceback, its last line (the exception
itself), with absolute file-system paths replaced by ``<path>``.

    one_line(GangError("gang-r0: rank 1 failed while starting:\\nTraceback ...\\nOSError: /x/y: bad"))
    # -> "gang-r0: rank 1 failed while starting: OSError: <path>: bad"
"""

from __future__ import annotations

import re

# an absolute POSIX path (two components or more), or a Windows drive path
_PATH = re.compile(r"(?<![\w.:/])(?:/[^\s'\"/:,()\[\]]+){2,}/?|\b[A-Za-z]:\\[^\s'\",()]+")


def scrub_paths(text: str) -> str:
    """``text`` with absolute file-system paths replaced by ``<path>``."""
    return _PATH.sub("<path>", text)


def one_line(err: BaseException | str, *, limit: int = 300, scrub: bool = True) -> str:
    """One line, no paths: the first line, plus the last line when the text holds a traceback.

    ``scrub=False`` keeps paths (for the operator's own terminal, not for HTTP clients)."""
    text = str(err).strip() or (type(err).__name__ if isinstance(err, BaseException) else "")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return ""
    head = lines[0]
    if len(lines) > 1 and any(ln.startswith("Traceback") for ln in lines):
        tail = next((ln for ln in reversed(lines) if not ln.startswith("(then also down")), lines[-1])
        head = f"{head.rstrip(':')}: {tail}" if tail != head else head
    out = scrub_paths(head) if scrub else head
    return out if len(out) <= limit else out[: limit - 3] + "..."
