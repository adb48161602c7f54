"""Progress display of the load test's long waits: plain throttled lines off a terminal, a tqdm bar
on one, nothing when disabled or when the wait ended before the first update.

python -m pytest tests/loadtest/test_progress.py -q
"""

from __future__ import annotations

import io

from shardserve.loadtest.progress import StatusLine


def test_plain_lines_every_interval_and_a_final_one() -> None:
    buf = io.StringIO()
    status = StatusLine("steady load", 30, stream=buf, every_s=10, tty=False)
    for t in range(0, 25, 3):
        status.update(float(t), f"{t * 10} requests, 0 failed")
    status.close("250 requests, 0 failed")
    assert buf.getvalue().splitlines() == [
        "steady load: 0/30 s, 0 requests, 0 failed",
        "steady load: 12/30 s, 120 requests, 0 failed",
        "steady load: 24/30 s, 240 requests, 0 failed",
        "steady load: 24/30 s, 250 requests, 0 failed",
    ]


def test_close_without_status_repeats_only_an_unprinted_last_update() -> None:
    buf = io.StringIO()
    status = StatusLine("wait", 5, stream=buf, every_s=10, tty=False)
    status.update(0.0, "HTTP 503")
    status.update(1.0, "HTTP 503")
    status.close()
    assert buf.getvalue().splitlines() == ["wait: 0/5 s, HTTP 503", "wait: 1/5 s, HTTP 503"]


def test_nothing_shown_when_disabled_or_never_updated() -> None:
    buf = io.StringIO()
    quiet = StatusLine("x", 5, stream=buf, enabled=False, tty=False)
    quiet.update(1.0, "status")
    quiet.close("done")
    StatusLine("y", 5, stream=buf, tty=False).close("ready")  # ready at once: no line
    assert buf.getvalue() == ""


def test_a_terminal_gets_a_bar() -> None:
    buf = io.StringIO()
    status = StatusLine("run", 4, stream=buf, tty=True)
    for t in range(5):
        status.update(float(t), f"{t} requests")
    status.close("done")
    frames = buf.getvalue().split("\r")
    assert any(f.startswith("run: ") and "2/4 s, 2 requests" in f for f in frames), frames
    assert "4/4 s, done" in frames[-1] or "4/4 s, done" in frames[-2]
