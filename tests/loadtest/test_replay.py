"""Open-loop trace replay (loadtest/replay.py) against the stub server: every request is sent at its
time whatever the answers so far, with its model and deadline, and counted by status.

Run: python -m pytest tests/loadtest/test_replay.py -q
"""

from __future__ import annotations

import asyncio

from shardserve.loadtest.replay import attainment, replay, summary
from shardserve.partitioner.placement.workload import Trace
from tests.loadtest.stub_server import StubServer


def test_a_burst_is_sent_at_once_and_each_answer_is_timed_from_its_due_time() -> None:
    trace = Trace(tuple([(0.0, "a")] * 8 + [(0.3, "b")] * 2), duration_s=0.5)
    with StubServer(shed_every=5, delay_s=0.25) as srv:
        sent = asyncio.run(replay(srv.url, trace, question="Who?", context="Ann met Bob.", timeout_s=1.0))
        assert srv.counts["received"] == 10
    assert [s.model for s in sent] == ["a"] * 8 + ["b"] * 2
    assert sorted(s.status for s in sent) == [200] * 8 + [429] * 2  # every 5th is shed
    # open loop: the 8 due at 0 were all sent at once. The stub answers each after 250 ms, in
    # parallel, so a replay that waited for answers would lag >= 250 ms; 150 ms leaves a slow CI room
    assert max(s.send_lag_s for s in sent) < 0.15
    ok = [s.latency_s for s in sent if s.status == 200]
    assert min(ok) >= 0.25 and max(ok) < 1.0
    assert attainment(sent, slo_s=1.0) == 0.8 and attainment(sent, slo_s=0.01) == 0.0
    assert summary(sent, slo_s=1.0)["statuses"] == {"200": 8, "429": 2}


def test_a_server_that_is_gone_counts_as_status_0_not_an_exception() -> None:
    with StubServer() as srv:
        url = srv.url
    sent = asyncio.run(replay(url, Trace(((0.0, "a"),), duration_s=0.1), question="q", context="c"))
    assert [s.status for s in sent] == [0] and attainment(sent, slo_s=1.0) == 0.0
