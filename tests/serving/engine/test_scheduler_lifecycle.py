"""Tests for serving/engine/scheduler.py's request lifecycle and in-flight ledger
(serving/engine/ledger.py): expiry and cancellation, results, retries after a failed batch or
replica, completion of multi-window requests, the service rate, and the ledger's counts. Pure
logic driven by a fake clock (plain floats for ``now``; helpers: scheduler_helpers.py).

Run: python -m pytest tests/serving/engine/test_scheduler_lifecycle.py -q
"""

from __future__ import annotations

import pytest

from shardserve.serving.engine.batcher import ReplicaView
from shardserve.serving.engine.scheduler import Outcome
from tests.serving.engine.scheduler_helpers import R0, make, submit_all

# ---------------------------------------------------------------- deadlines and cancel


def test_expired_before_dispatch_is_reported_and_never_dispatched() -> None:
    s = make()
    assert s.submit("x", [10], now=0.0, deadline=1.0).accepted
    submit_all(s, {"y": [20]}, now=0.0)
    busy: list[ReplicaView] = []  # no replica with capacity
    assert s.next_batch(0.5, busy) is None  # due, but no capacity
    assert s.next_wakeup(0.5) == 1.0  # x's expiry is the next timer
    d = s.next_batch(1.0, [R0])
    assert d is not None and d.items == [("y", 0)]
    assert s.expire(1.0) == ["x"]
    assert s.expire(1.0) == []
    st = s.stats()
    assert (st.expired, st.queued_requests, st.queued_windows) == (1, 0, 0)


def test_expire_drops_partially_dispatched_request_and_ignores_its_results() -> None:
    s = make()
    assert s.submit("m", [10, 100], now=0.0, deadline=2.0).accepted
    d = s.next_batch(0.25, [R0])  # bucket 64 first: only one batch fits per call
    assert d is not None and d.items == [("m", 0)]
    assert s.expire(3.0) == ["m"]
    assert s.batch_done(d.batch_id, now=3.0, ok=True) == Outcome()
    assert s.next_batch(3.0, [R0]) is None


def test_request_fully_in_flight_is_not_expired() -> None:
    s = make()
    assert s.submit("a", [10], now=0.0, deadline=1.0).accepted
    d = s.next_batch(0.5, [R0])
    assert d is not None
    assert s.expire(5.0) == []
    assert s.batch_done(d.batch_id, now=5.0, ok=True).completed == ["a"]


def test_cancel_removes_queued_work_and_ignores_late_results() -> None:
    s = make()
    submit_all(s, {"a": [10], "b": [20]}, now=0.0)
    d = s.next_batch(0.25, [R0])
    assert d is not None and d.items == [("a", 0), ("b", 0)]
    assert s.cancel("a")  # in flight
    submit_all(s, {"c": [10, 20], "d": [30]}, now=0.5)
    assert s.cancel("c")  # queued
    assert not s.cancel("c") and not s.cancel("nope")
    assert s.stats().queued_windows == 1
    assert s.batch_done(d.batch_id, now=0.75, ok=True) == Outcome(completed=["b"])
    d2 = s.next_batch(0.75, [R0])
    assert d2 is not None and d2.items == [("d", 0)]
    st = s.stats()
    assert (st.cancelled, st.completed, st.queued_requests) == (2, 1, 0)


def test_many_cancellations_compact_lazily() -> None:
    s = make(max_queue_size=1000)
    for i in range(300):
        submit_all(s, {f"r{i}": [10]}, now=0.0)
    for i in range(299):
        assert s.cancel(f"r{i}")
    assert s.stats().queued_windows == 1
    d = s.next_batch(0.25, [R0])
    assert d is not None and d.items == [("r299", 0)]
    assert s.next_wakeup(0.25) is None


# ---------------------------------------------------------------- results, retries, fail-over


def test_replica_failure_retries_once_at_front_then_fails() -> None:
    s = make()
    submit_all(s, {"a": [10]}, now=0.0)
    d1 = s.next_batch(0.25, [R0])
    assert d1 is not None
    submit_all(s, {"b": [20]}, now=0.375)
    assert s.replica_failed("r0") == Outcome(retried_windows=1)
    d2 = s.next_batch(0.375, [ReplicaView("r1")])  # a keeps its t=0 age: due at once, in front
    assert d2 is not None and (d2.items, d2.reason) == ([("a", 0), ("b", 0)], "timeout")
    assert s.replica_failed("r1") == Outcome(failed=["a"], retried_windows=1)
    assert s.batch_done(d1.batch_id, now=0.5, ok=True) == Outcome()  # late result: ignored
    assert s.next_batch(0.5, [ReplicaView("r2")]) is None  # b keeps its own age (t=0.375)
    d3 = s.next_batch(0.625, [ReplicaView("r2")])
    assert d3 is not None and d3.items == [("b", 0)]
    assert s.batch_done(d3.batch_id, now=0.75, ok=True).completed == ["b"]
    st = s.stats()
    assert (st.retried_windows, st.failed, st.completed, st.inflight_batches) == (2, 1, 1, {})


def test_failed_batch_retried_once_then_request_fails() -> None:
    s = make(max_queue_delay_ms=0.0)
    submit_all(s, {"a": [10, 11]}, now=0.0)
    d = s.next_batch(0.0, [R0])
    assert d is not None and d.items == [("a", 0), ("a", 1)]
    assert s.batch_done(d.batch_id, now=0.5, ok=False) == Outcome(retried_windows=2)
    d = s.next_batch(0.5, [R0])
    assert d is not None and d.items == [("a", 0), ("a", 1)]
    assert s.batch_done(d.batch_id, now=1.0, ok=False) == Outcome(failed=["a"])
    assert s.stats().service_rate == 0.0


def test_multi_window_request_completes_only_when_all_windows_complete() -> None:
    s = make(max_queue_delay_ms=0.0)
    submit_all(s, {"m": [50, 100, 200], "n": [60]}, now=0.0)
    d64 = s.next_batch(0.0, [R0])
    d128 = s.next_batch(0.0, [R0])
    d256 = s.next_batch(0.0, [ReplicaView("r1")])
    assert d64 is not None and d128 is not None and d256 is not None
    assert [d64.items, d128.items, d256.items] == [[("m", 0), ("n", 0)], [("m", 1)], [("m", 2)]]
    assert s.batch_done(d256.batch_id, now=0.25, ok=True) == Outcome()
    assert s.batch_done(d64.batch_id, now=0.5, ok=True) == Outcome(completed=["n"])
    assert s.batch_done(d128.batch_id, now=0.75, ok=True) == Outcome(completed=["m"])
    assert s.stats().completed == 2


def test_service_rate_excludes_idle_time() -> None:
    s = make()
    for t0 in (0.0, 100.0):
        submit_all(s, {f"w{t0}": [10] * 4}, now=t0)
        d = s.next_batch(t0, [R0])
        assert d is not None
        s.batch_done(d.batch_id, now=t0 + 0.5, ok=True)
    assert s.service_rate() == pytest.approx(8.0, rel=1e-12)


# ---------------------------------------------------------------- the in-flight ledger


def test_ledger_counts_requests_and_batches_in_flight() -> None:
    s = make(max_queue_delay_ms=0.0)
    submit_all(s, {"a": [10], "b": [100]}, now=0.0)
    assert (s.ongoing, s.inflight("r0")) == (2, 0)
    d1 = s.next_batch(0.0, [R0])
    d2 = s.next_batch(0.0, [R0])
    assert d1 is not None and d2 is not None
    assert (s.inflight("r0"), s.is_inflight(d1.batch_id), s.is_inflight(d2.batch_id)) == (2, True, True)
    assert s.batch_done(d1.batch_id, now=0.5, ok=True).completed == ["a"]
    assert (s.ongoing, s.inflight("r0"), s.is_inflight(d1.batch_id)) == (1, 1, False)
    out = s.replica_failed("r0")
    assert out.retried_requests == ["b"] and out == Outcome(retried_windows=1)
    assert (s.ongoing, s.inflight("r0"), s.is_inflight(d2.batch_id)) == (1, 0, False)
    assert s.reserve().accepted and s.ongoing == 1  # a reservation is not an admitted request
