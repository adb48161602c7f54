"""``shardserve serve`` stopped by SIGTERM/SIGINT during start-up, before uvicorn serves: one warning
line, exit 128 + the signal (143 / 130), no traceback, no rank process left behind.

Start-up has two parts: the CLI's own (imports, the model's checks: seconds, before uvicorn has its
signal handlers: the default SIGTERM ended the process silently with 143, SIGINT with a traceback or
"interrupted") and the app's lifespan under uvicorn (the gangs are launched there: a signal drained
nothing, then waited for the gangs to finish starting). The tests hold each part with a wrapper
around the real ``shardserve`` entry point (so the signal lands in it, not before or after) and signal
the process as soon as it says so.

Run: python -m pytest tests/serving/frontend/test_serve_cli_signals.py -q      (three servers: ~15 s)
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi.testclient import TestClient

from shardserve.partitioner.runtime.fake_gang import FakeFactory
from shardserve.serving.frontend.app import build_app
from shardserve.serving.frontend.cli import DrainingServer
from shardserve.serving.frontend.settings import ServeSettings
from tests.serving.frontend.api_helpers import wait_until

HOLD_MARK = "test: holding "
# ``shardserve`` with one start-up step held until the signal comes: argv[1] names the step
HOLDING_SERVE = f"""
import signal, sys, time
from shardserve.serving.frontend import app
from shardserve.serving.fleet import model_loader
from shardserve.cli import main

def hold(what, until):
    print({HOLD_MARK!r} + what, file=sys.stderr, flush=True)
    deadline = time.monotonic() + 60
    while not until() and time.monotonic() < deadline:
        time.sleep(0.01)

if sys.argv[1] == "load":  # the CLI's check of the model, before uvicorn runs
    real_load = model_loader.load_generation
    def load(*args, **kwargs):
        hold("the model's load", lambda: False)
        return real_load(*args, **kwargs)
    model_loader.load_generation = load
else:  # the end of the lifespan's start-up, after the gangs were launched
    real_freeze = app.freeze_startup_heap
    def freeze():
        server = signal.getsignal(signal.SIGTERM).__self__  # uvicorn's handler: the server's
        hold("the app's start-up", lambda: server.should_exit)
        real_freeze()
    app.freeze_startup_heap = freeze
sys.exit(main(sys.argv[2:]))
"""

needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")


def _session_processes(sid: int) -> list[str]:
    """The live (not zombie) processes of session ``sid``: the server and everything it started."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # gone meanwhile
            continue
        name_end = text.rindex(")")
        state, _ppid, _pgrp, session = text[name_end + 2 :].split()[:4]
        if int(session) == sid and state != "Z":
            found.append(text[: name_end + 1])
    return found


def _lines(stream: object) -> queue.Queue[str | None]:
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in stream:  # type: ignore[attr-defined]
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


@needs_proc
@pytest.mark.parametrize(
    ("step", "sig"),
    [("load", signal.SIGTERM), ("load", signal.SIGINT), ("lifespan", signal.SIGTERM)],
    ids=["sigterm-while-loading", "sigint-while-loading", "sigterm-in-the-lifespan"],
)
def test_a_signal_during_start_up_stops_in_one_line_with_128_plus_the_signal(
    step: str, sig: signal.Signals
) -> None:
    serve = ["serve", "--model", "tiny-bert", "--host", "127.0.0.1", "--port", "0", "--replicas", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDING_SERVE, step, *serve],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "SHARDSERVE_LOG_LEVEL": "WARNING"},
        start_new_session=True,  # its session: every process it starts, ranks included
    )
    err = _lines(proc.stderr)
    before: list[str] = []
    try:
        while not (line := err.get(timeout=120) or "").startswith(HOLD_MARK):
            before.append(line)
            assert proc.poll() is None, before
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 128 + sig, before
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    after = []
    while (line := err.get(timeout=30)) is not None:  # to the end of the stream
        after.append(line)
    assert len(after) == 1, after  # nothing else: no traceback, no "interrupted"
    assert after[0].endswith(
        f"WARNING shardserve.serving.frontend.cli: {sig.name} during start-up: stopped before serving"
    )
    assert proc.stdout is not None and proc.stdout.read() == ""  # never said it was serving
    deadline = time.monotonic() + 10  # killed ranks are gone at once; a resource tracker within moments
    while (left := _session_processes(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == []


def test_a_signal_before_uvicorn_started_is_a_start_up_stop_not_a_drain() -> None:
    app = build_app(ServeSettings(model="tiny-bert", replicas=1), backend_factory=FakeFactory())
    server = DrainingServer(uvicorn.Config(app), app)  # not started: in the lifespan's start-up
    server.handle_exit(signal.SIGINT, None)
    server.handle_exit(signal.SIGTERM, None)  # a second one: still the start-up's stop, no drain
    assert server.startup_signal == signal.SIGINT and server.should_exit
    assert app.state.shutting_down and not server._captured_signals  # (no re-raised signal)


def test_a_gang_never_ready_is_killed_at_shutdown_not_waited_for() -> None:
    """A shutdown while the first gang starts (a signal then, or during the lifespan's start-up):
    nothing needs that gang any more, so its start is ended at once instead of awaited (a big model's
    gang takes minutes; a drain waiting for it outlived Kubernetes' grace period)."""
    factory = FakeFactory(start_s=30.0)  # a start that ends early only when the gang is killed
    app = build_app(ServeSettings(model="tiny-bert", replicas=1), backend_factory=factory)
    with TestClient(app) as client:
        wait_until(lambda: factory.gangs, what="the first gang's start")
        assert client.get("/readyz").status_code == 503
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 10
    assert factory.gangs[0]._killed.is_set()
