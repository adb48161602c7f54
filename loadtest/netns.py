"""Several "hosts" on one Linux machine: network namespaces joined by one bridge, for multi-host tests
and benchmarks (``benchmarks/bench_chaos.py``'s remote-worker faults).

What it builds (``virtual_hosts(n)``)::

    host ns <prefix><pid>-<seq>-h0   veth0 10.213.X.1/24 --+
    host ns <prefix><pid>-<seq>-h1   veth0 10.213.X.2/24 --+-- br0 in hub ns <prefix><pid>-<seq>-hub
    ...                                                    |
    host ns <prefix><pid>-<seq>-h<n-1> veth0 10.213.X.n/24 +

Each host is a network namespace with its own ``lo`` (127.0.0.1 is per host) and one veth ``veth0``
whose peer is a port of a bridge living in a dedicated "hub" namespace. Nothing is created in the
root namespace: no interface, no route, no firewall rule (so the host's iptables/br_netfilter setup
cannot drop the traffic, and the address block cannot clash with real networks; X is still derived
from the pid for readability). Every port is free in a fresh host, so tests may use fixed ports.

Usage::

    from shardserve.loadtest.netns import netns_available, virtual_hosts

    def test_two_hosts() -> None:
        if reason := netns_available():
            pytest.skip(reason)
        with virtual_hosts(2) as (a, b):
            server = a.popen([sys.executable, "-m", "shardserve", "serve", "--host", a.addr, ...])
            b.run(["curl", f"http://{a.addr}:8000/health"], check=True)

``with host.inside():`` moves the calling thread into the host's namespace for the block (threads
and processes it starts there stay in it: a load generator beside a server on that host).
``VirtualHost.popen`` / ``VirtualHost.run`` run argv inside the namespace (``ip netns exec NAME argv``)
with the caller's environment (plus the repository root on PYTHONPATH, so ``python -m shardserve``
and ``import tests...`` work from any cwd) in a new session. ``VirtualHost.ifname`` is the interface
to hand to GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME.

Cleanup is guaranteed by a ``finally`` (exceptions, pytest failures, KeyboardInterrupt): the process
group of every process started with ``popen`` is SIGKILLed, then any process still inside a namespace
(``ip netns pids``: children that started their own session, ``run`` leftovers, ...) is SIGKILLed,
then the namespaces are deleted, which destroys the veths and the bridge with them. If the test
process itself dies hard (SIGKILL), the next ``virtual_hosts`` or ``netns_available`` call with the
same prefix deletes the namespaces whose creator pid is no longer alive.

Requirements: Linux, root (CAP_SYS_ADMIN + CAP_NET_ADMIN), iproute2's ``ip``, and a kernel/container
that allows ``ip netns add`` and veth/bridge devices. ``netns_available()`` checks all of it and
returns a one-line reason when something is missing, for ``pytest.skip``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DEFAULT_PREFIX", "VirtualHost", "cleanup_stale", "netns_available", "virtual_hosts"]

DEFAULT_PREFIX = "ssnt-"  # "shardserve netns test"
REPO_ROOT = Path(__file__).resolve().parents[1]
IFNAME = "veth0"  # the host-side interface name, the same in every host
_CLONE_NEWNET = 0x40000000
_IP_TIMEOUT_S = 30.0
_seq = itertools.count()
_active: set[str] = set()  # namespaces owned by live contexts of this process
_lock = threading.Lock()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S, stdin=subprocess.DEVNULL
    )
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise RuntimeError(f"`ip {' '.join(args)}` failed (rc {proc.returncode}): {msg[0] if msg else ''}")
    return proc


def _list_netns() -> list[str]:
    proc = _ip("netns", "list", check=False)
    # lines look like "name (id: 3)" or just "name"
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_netns_pids(ns: str) -> None:
    """SIGKILL every process whose network namespace is ``ns``; wait (briefly) until none is left."""
    deadline = time.monotonic() + 5.0
    while True:
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split() if p.isdigit()]
        pids = [p for p in pids if p != os.getpid()]
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _delete_netns(ns: str) -> None:
    _kill_netns_pids(ns)
    _ip("netns", "del", ns)


def cleanup_stale(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Delete namespaces ``<prefix><pid>-...`` left by crashed runs (creator pid dead, or this process
    but not owned by a live context). Namespaces of other live processes are left alone, so parallel
    runs do not tear each other down. Returns the deleted names."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)-")
    removed = []
    for ns in _list_netns():
        m = pattern.match(ns)
        if not m:
            continue
        pid = int(m.group(1))
        with _lock:
            mine_and_live = ns in _active
        if mine_and_live or (pid != os.getpid() and _pid_alive(pid)):
            continue
        with contextlib.suppress(RuntimeError):
            _delete_netns(ns)
            removed.append(ns)
    return removed


@functools.lru_cache(maxsize=1)
def netns_available() -> str | None:
    """None when network namespaces, veths and bridges can be created here; else a one-line reason."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return f"network namespace tests need root (euid is {os.geteuid()})"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) not found on PATH: apt-get install iproute2"
    try:
        cleanup_stale()
    except (OSError, subprocess.SubprocessError) as e:
        return f"`ip netns list` failed: {e}"
    probe = f"{DEFAULT_PREFIX}{os.getpid()}-probe"
    steps = [
        ("`ip netns add`", ["netns", "add", probe]),
        ("veth pairs", ["-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"]),
        ("bridges", ["-n", probe, "link", "add", "br0", "type", "bridge"]),
        ("`ip netns exec`", ["netns", "exec", probe, "ip", "link", "set", "lo", "up"]),
    ]
    try:
        for what, args in steps:
            try:
                _ip(*args)
            except RuntimeError as e:
                return f"{what} not permitted here: {e}"
            except (OSError, subprocess.SubprocessError) as e:
                return f"{what} failed: {e}"
    finally:
        if probe in _list_netns():
            with contextlib.suppress(RuntimeError, OSError, subprocess.SubprocessError):
                _delete_netns(probe)
    return None


def _default_env(env: dict[str, str] | None) -> dict[str, str]:
    if env is not None:
        return env
    env = dict(os.environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO_ROOT) not in parts:
        parts.insert(0, str(REPO_ROOT))
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


@dataclass(frozen=True)
class VirtualHost:
    """One simulated host: a network namespace ``name`` reachable from the others at ``addr``."""

    name: str  # the network namespace (``ip netns exec NAME ...``)
    addr: str  # its IPv4 address on the shared /24, e.g. "10.213.57.1"
    ifname: str = IFNAME  # its interface on that /24 (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)
    index: int = 0  # 0..n-1, its position in the list
    _procs: list[subprocess.Popen] = field(default_factory=list, repr=False, compare=False)

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside this host's namespace."""
        if isinstance(argv, str):
            raise TypeError("argv must be a sequence of strings, not a str")
        return ["ip", "netns", "exec", self.name, *map(str, argv)]

    def popen(self, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start ``argv`` inside this host (``subprocess.Popen`` keywords pass through). It runs in a
        new session (its own process group), which is SIGKILLed when the ``virtual_hosts`` context
        exits. ``env`` defaults to this process's environment with the repository root on PYTHONPATH."""
        kw["start_new_session"] = True
        kw["env"] = _default_env(kw.get("env"))
        proc = subprocess.Popen(self.argv(argv), **kw)
        self._procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` inside this host to completion (``subprocess.run`` keywords pass through)."""
        kw["start_new_session"] = True
        kw["env"] = _default_env(kw.get("env"))
        return subprocess.run(self.argv(argv), **kw)

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """Run the calling thread in this host's network namespace for the block (``setns``); what it
        starts there (threads, processes, sockets) stays in it; back to its own namespace after."""
        libc = ctypes.CDLL(None, use_errno=True)
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/var/run/netns/{self.name}", os.O_RDONLY)
        try:
            if libc.setns(target, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into {self.name}: {os.strerror(err)}")
            try:
                yield
            finally:
                if libc.setns(own, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns back from {self.name}: {os.strerror(err)}")
        finally:
            os.close(target)
            os.close(own)

    def _kill_processes(self) -> None:
        for proc in self._procs:
            # start_new_session=True: the process group id is the child's pid; while any member of
            # the group lives, that number cannot be reused, so this only hits our group.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


@contextlib.contextmanager
def virtual_hosts(n: int = 2, *, prefix: str = DEFAULT_PREFIX) -> Iterator[list[VirtualHost]]:
    """Create ``n`` hosts (network namespaces) on one private /24, yield them, always tear down.

    Host i has address ``10.213.X.(i+1)`` on ``veth0``; all hosts are bridged in a hub namespace.
    Stale namespaces with ``prefix`` from dead processes are deleted first."""
    if not 1 <= n <= 250:
        raise ValueError(f"n must be in 1..250, got {n}")
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,40}", prefix) or prefix[-1].isdigit():
        raise ValueError(f"prefix must be short, [A-Za-z0-9_.-] and not end in a digit: {prefix!r}")
    cleanup_stale(prefix)
    pid, seq = os.getpid(), next(_seq)
    base = f"{prefix}{pid}-{seq}"
    subnet = f"10.213.{(pid + seq) % 250 + 1}"
    hub = f"{base}-hub"
    hosts = [VirtualHost(name=f"{base}-h{i}", addr=f"{subnet}.{i + 1}", index=i) for i in range(n)]
    created: list[str] = []
    try:
        with _lock:
            _active.update([hub, *(h.name for h in hosts)])
        _ip("netns", "add", hub)
        created.append(hub)
        _ip("-n", hub, "link", "set", "lo", "up")
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for h in hosts:
            _ip("netns", "add", h.name)
            created.append(h.name)
            port = f"p{h.index}"
            # both ends are created directly in their namespaces: nothing ever appears in the root one
            _ip("-n", hub, "link", "add", port, "type", "veth", "peer", "name", h.ifname, "netns", h.name)
            _ip("-n", hub, "link", "set", port, "master", "br0", "up")
            _ip("-n", h.name, "link", "set", "lo", "up")
            _ip("-n", h.name, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
            _ip("-n", h.name, "link", "set", h.ifname, "up")
        yield hosts
    finally:
        errors: list[str] = []
        for h in hosts:
            try:
                h._kill_processes()
            except Exception as e:
                errors.append(f"killing processes of {h.name}: {e}")
        for ns in reversed(created):  # hosts first, the hub last
            try:
                _delete_netns(ns)
            except Exception as e:
                errors.append(f"deleting {ns}: {e}")
        with _lock:
            _active.difference_update([hub, *(h.name for h in hosts)])
        if errors:
            msg = "virtual_hosts cleanup incomplete: " + "; ".join(errors)
            if sys.exc_info()[0] is None:
                raise RuntimeError(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
