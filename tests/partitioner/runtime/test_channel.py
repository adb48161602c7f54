"""The driver <-> rank transport: signed frames (``partitioner/runtime/wire.py``) over ZeroMQ
(``partitioner/runtime/channel.py``), both ends in one process, no gang.

    python -m pytest tests/partitioner/runtime/test_channel.py -q
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time

import numpy as np
import pytest

from shardserve.partitioner.runtime.channel import ChannelError, DriverChannel, RankChannel
from shardserve.partitioner.runtime.messages import Heartbeat, RankFailed, RankReady
from shardserve.partitioner.runtime.wire import (
    MESSAGE_TYPES,
    WireError,
    decode,
    decode_many,
    encode,
    encode_many,
    new_key,
    register_messages,
)
from shardserve.partitioner.stream.program import Batch, Result, Stop  # programs' own messages, registered
from shardserve.training.messages import EvalLogits, StepReport


def test_every_message_round_trips_with_arrays_and_plain_fields() -> None:
    key = new_key()
    ids = np.arange(12, dtype=np.int64).reshape(3, 4)
    msgs = [
        Batch(7, ids, np.ones((3, 4), dtype=np.int64), None),
        Batch(8, ids, np.ones((3, 4), dtype=np.int64), np.zeros((3, 4), dtype=np.int64)),
        Stop(),
        Result(7, np.random.default_rng(0).standard_normal((3, 4, 2)).astype(np.float32)),
        RankReady(1, {"host": "h", "layers": [3, 4, 5], "load_s": 0.25}),
        RankFailed(2, "Traceback ...\nRuntimeError: boom"),
        StepReport(0, 5, 1.25, 1e-4, float("nan"), 32, {"bytes": 10}),
        EvalLogits(1, 5, np.zeros((0, 4, 2), dtype=np.float32)),
        Heartbeat(3, 17, 1234.5),
        Heartbeat(1, 2, 0.0, 0.5, "node-b", 4242),
    ]
    for msg in msgs:
        got = decode(encode(msg, key), key)
        assert type(got) is type(msg)
        for name, want in vars(msg).items():
            have = getattr(got, name)
            if isinstance(want, np.ndarray):
                assert have.dtype == want.dtype and np.array_equal(have, want) and have.flags.writeable
            elif isinstance(want, float) and np.isnan(want):
                assert np.isnan(have)
            else:
                assert have == want, name


def test_foreign_tampered_or_unknown_frames_are_refused() -> None:
    key = new_key()
    frames = encode(Result(1, np.zeros((1, 2, 2), dtype=np.float32)), key)
    with pytest.raises(WireError, match="signature"):
        decode(frames, new_key())  # another gang's key
    tampered = list(frames)
    tampered[1] = b"\x01" + tampered[1][1:]
    with pytest.raises(WireError, match="signature"):
        decode(tampered, key)
    with pytest.raises(WireError, match="frame"):
        decode([b"{}"], key)
    with pytest.raises(WireError, match="not a wire message"):
        encode(object(), key)


def test_a_bundle_carries_several_messages_under_one_signature() -> None:
    key = new_key()
    ids = np.arange(6, dtype=np.int64).reshape(2, 3)
    msgs = [Batch(1, ids, ids + 1, None), Stop(), Result(1, np.ones((2, 3, 2), dtype=np.float32)), Stop()]
    frames = encode_many(msgs, key)
    assert len(frames) == 1 + 3 + 1  # one header, the three arrays, one signature
    got = decode_many(frames, key)
    assert [type(m) for m in got] == [type(m) for m in msgs]
    assert np.array_equal(got[0].attention_mask, ids + 1) and got[0].token_type_ids is None
    assert np.array_equal(got[2].logits, msgs[2].logits)
    assert decode_many(encode(Stop(), key), key) == [Stop()]  # one message is a bundle of one
    with pytest.raises(WireError, match="one message expected, 4"):
        decode(frames, key)
    with pytest.raises(WireError, match="signature"):
        decode_many([*frames[:2], *frames[3:]], key)  # an array left out
    with pytest.raises(WireError, match="nothing"):
        encode_many([], key)
    with pytest.raises(WireError, match="not a wire message"):
        encode_many([Stop(), object()], key)


@dataclasses.dataclass(frozen=True)
class Unregistered:
    n: int


def test_only_registered_program_messages_cross_and_names_are_unique() -> None:
    """The runtime carries what a program registered, nothing else; a name means one class."""
    with pytest.raises(WireError, match="not a wire message"):
        encode(Unregistered(1), new_key())
    clash = dataclasses.make_dataclass("Result", [("n", int)], frozen=True)  # the stream's message's name
    with pytest.raises(ValueError, match=r"'Result' is taken by shardserve\.partitioner\.stream\.program\.Result"):
        register_messages(clash)
    register_messages(Unregistered)
    try:
        assert decode(encode(Unregistered(3), b"k" * 32), b"k" * 32) == Unregistered(3)
    finally:
        MESSAGE_TYPES.pop("Unregistered")


@pytest.fixture
def pair():
    key = new_key()
    driver = DriverChannel(world_size=2, key=key, heartbeat_s=0.05)
    lost: list[int] = []
    ranks = [
        RankChannel(
            rank=r,
            endpoints=driver.endpoints,
            key=key,
            heartbeat_s=0.05,
            driver_timeout_s=0.5,
            on_driver_lost=lambda r=r: lost.append(r),
        )
        for r in range(2)
    ]
    try:
        yield driver, ranks, lost
    finally:
        for rc in ranks:
            rc.close(linger_s=0.1)
        driver.close()


def test_messages_flow_both_ways_and_heartbeats_carry_progress(pair) -> None:
    driver, ranks, _lost = pair
    assert driver.endpoints.startswith("tcp://127.0.0.1:")
    assert all(rc.wait_connected(5.0) for rc in ranks)  # the driver's heartbeats reached both
    ids = np.arange(6, dtype=np.int64).reshape(2, 3)
    driver.send(0, Batch(1, ids, ids))
    got = ranks[0].get(timeout_s=5.0)
    assert isinstance(got, Batch) and np.array_equal(got.input_ids, ids)
    ranks[1].progress, ranks[1].busy_since, ranks[1].busy_s = 4, 99.0, 1.5
    ranks[1].send(Result(1, np.ones((2, 3, 2), dtype=np.float32)))
    msg = driver.recv(5.0)  # heartbeats are consumed inside recv
    assert isinstance(msg, Result) and msg.mb_id == 1
    deadline = time.monotonic() + 5
    while driver.progress[1] != 4 and time.monotonic() < deadline:
        driver.recv(0.05)
    assert driver.progress[1] == 4 and driver.busy_since[1] == 99.0 and driver.busy_s[1] == 1.5
    assert driver.silent_ranks(5.0) == []
    # where each rank runs, as it says itself (here both ends share this process)
    assert driver.where == [(socket.gethostname(), os.getpid())] * 2


def test_a_rank_that_stops_beating_is_silent_and_a_rank_without_driver_leaves(pair) -> None:
    driver, ranks, lost = pair
    assert all(rc.wait_connected(5.0) for rc in ranks)
    deadline = time.monotonic() + 5
    while None in driver.last_seen and time.monotonic() < deadline:
        driver.recv(0.05)  # a rank is judged only once heard from (start-up has its own timeout)
    assert None not in driver.last_seen
    ranks[1].close(linger_s=0.1)  # as if killed: no more heartbeats
    deadline = time.monotonic() + 5
    while driver.silent_ranks(0.3) != [1] and time.monotonic() < deadline:
        driver.recv(0.05)
    assert driver.silent_ranks(0.3) == [1]
    with pytest.raises(ChannelError, match="rank 5 is not connected"):
        driver.send(5, Stop())
    driver.close()  # the driver goes away: rank 0 hears nothing for driver_timeout_s
    deadline = time.monotonic() + 5
    while 0 not in lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost == [0]
