"""The server under test: wait until one is ready, or start ``shardserve serve`` locally and stop it.

One home for what every benchmark and end-to-end test needs (a free loopback port, a child
server, polling ``/readyz`` while watching that the child is alive, a draining stop):

    with local_server(["--model", "tiny-bert", "--replicas", "1"], ready_timeout_s=120) as srv:
        httpx.post(f"{srv.url}/v1/qa", json=...)        # srv.proc: the Popen, srv.pid, srv.port
    wait_ready("http://127.0.0.1:8000", timeout_s=60)  # a server started elsewhere

The child runs with ``HF_HUB_OFFLINE=1`` and binds 127.0.0.1 only; on exit it gets SIGTERM (it
drains) and, after ``stop_timeout_s``, SIGKILL. Its ranks exit on their own when it is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO


class ServerNotReady(RuntimeError):
    """The server did not turn ready in time, or exited before it did (the message says which)."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(
    base_url: str,
    *,
    timeout_s: float,
    proc: subprocess.Popen | None = None,
    all_replicas: bool = False,
    on_poll: Callable[[float, str], None] | None = None,
) -> None:
    """Poll ``/readyz`` until it answers 200 (``all_replicas``: and no replica is still starting);
    ``ServerNotReady`` with the last answer after ``timeout_s``, or at once if ``proc`` exits.
    ``on_poll(seconds_waited, last_answer)`` runs after every poll that was not ready (progress)."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServerNotReady(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(base_url + "/readyz", timeout=2) as resp:
                body = json.loads(resp.read() or b"{}")
                if not (all_replicas and body.get("starting_replicas", 0)):
                    return
                last = f"HTTP {resp.status}, {body.get('starting_replicas')} replicas starting"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError, ValueError) as exc:
            last = str(exc)
        if on_poll is not None:
            on_poll(time.monotonic() - t0, last)
        time.sleep(0.3)
    raise ServerNotReady(f"{base_url}/readyz not ready after {timeout_s:g} s (last: {last})")


@dataclass(frozen=True)
class LocalServer:
    url: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


@contextlib.contextmanager
def local_server(
    serve_args: Sequence[str],
    *,
    ready_timeout_s: float = 180.0,
    all_replicas: bool = False,
    log: IO | int | None = subprocess.DEVNULL,
    env: Mapping[str, str] | None = None,
    global_args: Sequence[str] = (),
    stop_timeout_s: float = 60.0,
    cwd: str | Path | None = None,
) -> Iterator[LocalServer]:
    """``python -m shardserve [global_args] serve --host 127.0.0.1 --port FREE [serve_args]`` as a
    child process, yielded once ready; stopped (drained) on exit. ``log``: where its stdout and
    stderr go (a file, ``None`` to inherit); ``env``: extra environment variables; ``cwd``: where it
    runs (``python -m`` finds ``shardserve`` there first: another checkout's server)."""
    port = free_port()
    cmd = [sys.executable, "-m", "shardserve", *global_args, "serve",
           "--host", "127.0.0.1", "--port", str(port), *serve_args]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT if log is not None else None,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, cwd=cwd,
    )  # fmt: skip
    server = LocalServer(f"http://127.0.0.1:{port}", proc)
    try:
        wait_ready(server.url, timeout_s=ready_timeout_s, proc=proc, all_replicas=all_replicas)
        yield server
    finally:
        stop(proc, timeout_s=stop_timeout_s)


def stop(proc: subprocess.Popen, *, timeout_s: float = 60.0) -> None:
    """SIGTERM (the server drains), then SIGKILL after ``timeout_s``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
