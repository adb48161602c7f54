"""A gang with a rank the driver does not spawn: ``shardserve worker`` joins it through the
rendezvous (the spec signed with the gang key), on this host over TCP; the multi-host versions
run the same in network namespaces (tests/deploy/).

    python -m pytest tests/partitioner/runtime/test_remote.py -q
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch

from shardserve.loadtest.local_server import free_port
from shardserve.partitioner.runtime.gang import GangError, bound_store
from shardserve.partitioner.runtime.remote import GangNetwork, JoinError, publish_spec, read_spec
from shardserve.partitioner.runtime.wire import new_key
from shardserve.partitioner.stream.driver import StreamGang
from shardserve.partitioner.stream.program import STREAM_PROGRAM
from tests.deploy.gang_driver import fixed_batch, tiny_spec


def _worker(port: int, rank: int, key: bytes) -> subprocess.Popen:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
           "SHARDSERVE_GANG_KEY": key.hex(), "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    return subprocess.Popen([sys.executable, "-m", "shardserve", "worker"], env=env, start_new_session=True)


SERVE = {"serve": STREAM_PROGRAM}  # what `shardserve worker` runs here


def _start(gang: StreamGang) -> threading.Thread:
    errors: list[BaseException] = []
    t = threading.Thread(target=lambda: _catch(gang.start, errors), daemon=True)
    t.errors = errors  # type: ignore[attr-defined]
    t.start()
    return t


def _catch(fn, errors: list[BaseException]) -> None:
    try:
        fn()
    except BaseException as exc:  # reported by the test
        errors.append(exc)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def test_spec_round_trips_and_refuses_another_key() -> None:
    store = bound_store(2, timeout=timedelta(seconds=5))
    key = new_key()
    spec = tiny_spec()
    publish_spec(
        store, spec, endpoints="tcp://127.0.0.1:1;tcp://127.0.0.1:2", key=key, program=STREAM_PROGRAM
    )
    got, endpoints = read_spec(store, key=key, rank=1, programs=SERVE)
    assert endpoints == "tcp://127.0.0.1:1;tcp://127.0.0.1:2"
    assert [s.layers for s in got.plan.stages] == [s.layers for s in spec.plan.stages]
    assert got.source.name == "tiny-bert" and got.dtype == spec.dtype
    with pytest.raises(JoinError, match="not signed with our key"):
        read_spec(store, key=new_key(), rank=1, programs=SERVE)
    with pytest.raises(JoinError, match="outside the gang"):
        read_spec(store, key=key, rank=5, programs=SERVE)
    with pytest.raises(ValueError, match="fixed store port"):
        GangNetwork(external_ranks=(1,), key=key, program=STREAM_PROGRAM)


def test_external_rank_joins_serves_and_its_death_is_named_then_a_new_worker_rejoins() -> None:
    key, port = new_key(), free_port()
    net = GangNetwork(host="127.0.0.1", store_port=port, external_ranks=(1,), key=key, program=STREAM_PROGRAM)
    with StreamGang(tiny_spec()) as local:  # the reference: both ranks spawned here
        want = local.run([fixed_batch()], timeout_s=60)[0]

    gang = StreamGang(tiny_spec(), network=net, heartbeat_timeout_s=5.0, start_timeout_s=120)
    starting = _start(gang)
    worker = _worker(port, 1, key)
    try:
        starting.join(timeout=120)
        assert not starting.errors, starting.errors  # type: ignore[attr-defined]
        assert gang.healthy and len(gang.pids()) == 1  # only rank 0 is a child of the driver
        here = socket.gethostname()  # each rank says where it runs (its heartbeats), the joined one too
        deadline = time.monotonic() + 10  # a rank is heard of by its first heartbeat (every 0.5 s)
        while None in gang.rank_processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gang.rank_processes() == [(here, gang.pids()[0]), (here, worker.pid)]
        got = gang.run([fixed_batch()], timeout_s=60)[0]
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # same shards, same numbers
        inflight = [gang.submit(*fixed_batch()) for _ in range(8)]
        os.killpg(worker.pid, signal.SIGKILL)  # the remote worker dies under load
        t0 = time.monotonic()
        for fut in inflight:
            try:
                fut.result(timeout=30)
            except GangError as err:  # never a hang: an answer or this
                assert err.rank == 1 and "rank 1 (stage 1, tp 0) sent no heartbeat" in str(err), err
        assert not gang.healthy and time.monotonic() - t0 < 10
    finally:
        gang.stop()
        _stop(worker)

    # the replica comes back when a new worker joins (same port, same key)
    gang = StreamGang(tiny_spec(), network=net, start_timeout_s=120)
    starting = _start(gang)
    worker = _worker(port, 1, key)
    try:
        starting.join(timeout=120)
        assert not starting.errors, starting.errors  # type: ignore[attr-defined]
        torch.testing.assert_close(gang.run([fixed_batch()], timeout_s=60)[0], want, rtol=0, atol=0)
    finally:
        gang.stop()
        worker.wait(timeout=30)  # the stop flowed through: the worker exits by itself
    assert worker.returncode == 0


def test_worker_with_the_wrong_key_says_so_in_one_line() -> None:
    port = free_port()
    store = bound_store(2, timeout=timedelta(seconds=5), port=port)
    publish_spec(
        store,
        tiny_spec(),
        endpoints="tcp://127.0.0.1:1;tcp://127.0.0.1:2",
        key=new_key(),
        program=STREAM_PROGRAM,
    )
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "1",
           "SHARDSERVE_GANG_KEY": new_key().hex(), "HF_HUB_OFFLINE": "1"}  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "shardserve", "worker"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"waiting for the driver at 127.0.0.1:{port} (join timeout 300 s)",
        "error: the gang spec in the rendezvous store is not signed with our key: wrong key, or not our gang",
    ]
