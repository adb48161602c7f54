"""Smoke tests of the several-hosts-on-one-machine harness (loadtest/netns.py) that the multi-host gang
tests build on: hosts reach each other over TCP through the bridge, loopback is per host, and nothing
(namespace, veth, bridge, process) survives the context, even when the body raises.

Needs Linux, root and iproute2 (`ip`); skips with the reason otherwise.

python -m pytest tests/deploy/test_netns.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shardserve.loadtest.netns import netns_available, virtual_hosts
from tests.procs import all_gone, gone

PREFIX = "ssnt-smoke-"  # distinct from the default prefix, so the leftover checks only see these tests
PORT = 7000  # every port is free in a fresh namespace

pytestmark = pytest.mark.timeout(60)

# Echo server: listens on argv[1]:argv[2], prints "ready", answers "echo:<data>" to each connection.
SERVER = """
import socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
while True:
    conn, _ = srv.accept()
    with conn:
        conn.sendall(b"echo:" + conn.recv(1024))
"""

# Client: connects to argv[1]:argv[2], prints the reply, or "refused" / "timeout".
CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as c:
        c.sendall(sys.argv[3].encode())
        print(c.recv(1024).decode())
except ConnectionRefusedError:
    print("refused")
except OSError as e:
    print(type(e).__name__)
"""


@pytest.fixture(autouse=True)
def _need_netns() -> None:
    if reason := netns_available():
        pytest.skip(reason)


def _leftovers() -> list[str]:
    """This run's namespaces (PREFIX<pid>-...), and root-namespace links so named or peered into one
    (only this pid's: a parallel run of these tests has its own)."""
    mine = f"{PREFIX}{os.getpid()}-"
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    found = [line.split()[0] for line in names.splitlines() if line.startswith(mine)]
    found += [line for line in links.splitlines() if mine in line]
    return found


def _start_server(host, bind: str):
    proc = host.popen(
        [sys.executable, "-c", SERVER, bind, str(PORT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline().strip()
    assert line == "ready", f"echo server did not start: {line!r} {proc.poll()}"
    return proc


def _client(host, addr: str, msg: str) -> str:
    out = host.run(
        [sys.executable, "-c", CLIENT, addr, str(PORT), msg], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_hosts_reach_each_other_over_tcp() -> None:
    with virtual_hosts(3, prefix=PREFIX) as hosts:
        a, b, c = hosts
        assert len({h.name for h in hosts}) == 3 and len({h.addr for h in hosts}) == 3
        assert all(h.name.startswith(PREFIX) for h in hosts)
        # the address is really A's, on its veth
        shown = a.run(["ip", "-o", "-4", "addr", "show", "dev", a.ifname], capture_output=True, text=True)
        assert f"inet {a.addr}/24" in shown.stdout
        _start_server(a, a.addr)  # bound to A's own address, not 0.0.0.0
        assert _client(b, a.addr, "from-b") == "echo:from-b"
        assert _client(c, a.addr, "from-c") == "echo:from-c"
    assert _leftovers() == []


def test_loopback_is_per_host() -> None:
    with virtual_hosts(2, prefix=PREFIX) as (a, b):
        _start_server(a, "0.0.0.0")  # listens on A's loopback too
        assert _client(a, "127.0.0.1", "self") == "echo:self"
        assert _client(b, "127.0.0.1", "x") == "refused"  # B's own (empty) loopback
        assert _client(b, a.addr, "y") == "echo:y"
    assert _leftovers() == []


def test_a_thread_inside_a_host_is_that_host_and_comes_back() -> None:
    """``inside()``: this thread (and a thread it starts there) binds the host's address and reaches
    the other host; after the block it is in its own namespace again, where that address is none."""
    import socket
    import threading

    def bind(addr: str) -> None:
        with socket.socket() as s:
            s.bind((addr, 0))

    with virtual_hosts(2, prefix=PREFIX) as (a, b):
        _start_server(b, b.addr)
        with a.inside():
            bind(a.addr)
            errors: list[BaseException] = []
            t = threading.Thread(target=lambda: errors.extend(_try(lambda: bind(a.addr))))
            t.start()
            t.join()
            assert errors == []
            with socket.create_connection((b.addr, PORT), timeout=10) as conn:
                conn.sendall(b"in-a")
                assert conn.recv(64) == b"echo:in-a"
        with pytest.raises(OSError):  # EADDRNOTAVAIL: not an address of the root namespace
            bind(a.addr)
    assert _leftovers() == []


def _try(fn) -> list[BaseException]:
    try:
        fn()
    except BaseException as e:  # handed to the asserting thread
        return [e]
    return []


def test_cleanup_on_exception_kills_processes_and_removes_everything() -> None:
    # A grandchild in its own session escapes the process-group kill; the `ip netns pids` sweep gets it.
    escape = (
        "import subprocess, sys;"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL);"
        "print(p.pid, flush=True)"
    )
    with pytest.raises(KeyboardInterrupt), virtual_hosts(2, prefix=PREFIX) as (a, b):
        sleeper = a.popen([sys.executable, "-c", "import time; time.sleep(600)"])
        out = b.run([sys.executable, "-c", escape], capture_output=True, text=True, timeout=30)
        escaped = int(out.stdout.split()[0])
        assert not gone(escaped)
        assert len(_leftovers()) == 3  # two hosts + the hub
        raise KeyboardInterrupt  # like Ctrl-C in the middle of a test
    assert sleeper.returncode is not None
    assert all_gone([escaped], within_s=5)
    assert _leftovers() == []


def test_stale_namespaces_of_dead_runs_are_removed() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs, as after a crashed (SIGKILLed) test run
    stale = f"{PREFIX}{dead.pid}-0-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with virtual_hosts(1, prefix=PREFIX) as (a,):
            assert stale not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            assert a.run(["true"]).returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
    assert _leftovers() == []
