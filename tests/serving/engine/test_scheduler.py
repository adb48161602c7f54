"""Tests for serving/engine/scheduler.py: pure logic driven by a fake clock (plain floats for ``now``).

Run: python -m pytest tests/serving/engine/test_scheduler.py -q
"""

from __future__ import annotations

import pytest

from shardserve.serving.config import SchedulerConfig
from shardserve.serving.engine.batcher import ReplicaView
from shardserve.serving.engine.scheduler import Outcome, Scheduler

R0 = ReplicaView("r0")


def make(**overrides: object) -> Scheduler:
    """Small limits; dyadic delays so the fake-clock arithmetic is exact. An idle replica waits for
    the delay here (``wait_when_idle``), so the release rules are seen one at a time; the default,
    an idle replica taking what is queued at once, has its own tests below."""
    kw: dict[str, object] = {
        "wait_when_idle": True,
        "max_queue_size": 8,
        "max_batch_size": 4,
        "max_batch_tokens": 1024,
        "max_queue_delay_ms": 250.0,
        "length_buckets": (64, 128, 256),
        "max_inflight_per_replica": 2,
        "default_deadline_s": 10.0,
        "deadline_margin_ms": 500.0,
    }
    kw.update(overrides)
    return Scheduler(SchedulerConfig(**kw))  # type: ignore[arg-type]


def submit_all(s: Scheduler, sizes: dict[str, list[int]], *, now: float) -> None:
    for rid, windows in sizes.items():
        assert s.submit(rid, windows, now=now).accepted


# ---------------------------------------------------------------- batching


def test_batch_released_when_full_by_size() -> None:
    s = make()
    submit_all(s, {"a": [40], "b": [50], "c": [60]}, now=0.0)
    assert s.next_batch(0.0, [R0]) is None  # partial batch, delay not over
    submit_all(s, {"d": [30], "e": [20]}, now=0.0)
    d = s.next_batch(0.0, [R0])
    assert d is not None
    assert (d.items, d.padded_len, d.bucket, d.reason, d.replica_id) == (
        [("a", 0), ("b", 0), ("c", 0), ("d", 0)],
        60,
        64,
        "full",
        "r0",
    )
    assert s.next_batch(0.0, [R0]) is None  # "e" alone waits for its delay
    assert s.stats().queued_windows == 1


def test_batch_released_when_full_by_token_budget() -> None:
    s = make(max_batch_tokens=256)
    submit_all(s, {"a": [120], "b": [100], "c": [70]}, now=0.0)
    d = s.next_batch(0.0, [R0])  # padded to the longest: 2 * 120 = 240 fits, 3 * 120 = 360 > 256
    assert d is not None
    assert (d.items, d.padded_len, d.reason) == ([("a", 0), ("b", 0)], 120, "full")
    assert s.next_batch(0.0, [R0]) is None
    d = s.next_batch(0.25, [R0])
    assert d is not None
    assert (d.items, d.padded_len, d.reason) == ([("c", 0)], 70, "timeout")


def test_partial_batch_released_after_max_queue_delay() -> None:
    s = make()
    submit_all(s, {"a": [10]}, now=1.0)
    submit_all(s, {"b": [20]}, now=1.125)
    assert s.next_batch(1.125, [R0]) is None
    assert s.next_wakeup(1.125) == 1.25  # oldest window (t=1.0) + 250 ms
    assert s.next_batch(1.2, [R0]) is None
    d = s.next_batch(1.25, [R0])
    assert d is not None
    assert (d.items, d.padded_len, d.reason) == ([("a", 0), ("b", 0)], 20, "timeout")
    assert s.next_wakeup(1.25) is None  # nothing queued
    assert s.stats().batches_by_reason == {"full": 0, "deadline": 0, "timeout": 1, "idle": 0}


def test_an_idle_replica_takes_a_partial_batch_at_once_a_busy_one_waits_for_the_delay() -> None:
    s = make(wait_when_idle=False)
    submit_all(s, {"a": [10], "b": [20]}, now=1.0)
    d = s.next_batch(1.0, [R0])  # r0 has nothing in flight: waiting would leave it idle
    assert d is not None
    assert (d.items, d.reason) == ([("a", 0), ("b", 0)], "idle")
    submit_all(s, {"c": [30]}, now=1.0)
    assert s.next_batch(1.0, [R0]) is None  # r0 is computing: "c" may wait for company
    assert s.next_wakeup(1.0) == 1.25
    d2 = s.next_batch(1.25, [R0])
    assert d2 is not None
    assert (d2.items, d2.reason) == ([("c", 0)], "timeout")
    s.batch_done(d.batch_id, now=1.5, ok=True)
    s.batch_done(d2.batch_id, now=1.5, ok=True)
    submit_all(s, {"d": [40]}, now=1.5)
    d3 = s.next_batch(1.5, [R0])  # idle again
    assert d3 is not None and d3.reason == "idle"
    assert s.stats().batches_by_reason == {"full": 0, "deadline": 0, "timeout": 1, "idle": 2}


def test_idle_replicas_each_take_a_bucket_of_one_request_at_once() -> None:
    """A request's long and short windows (two buckets) start together on two idle replicas."""
    s = make(wait_when_idle=False)
    r1 = ReplicaView("r1")
    submit_all(s, {"q": [250, 40]}, now=0.0)
    d1 = s.next_batch(0.0, [R0, r1])
    d2 = s.next_batch(0.0, [R0, r1])
    assert d1 is not None and d2 is not None
    assert {(d1.replica_id, *d1.items), (d2.replica_id, *d2.items)} == {("r0", ("q", 0)), ("r1", ("q", 1))}
    assert s.next_batch(0.0, [R0, r1]) is None  # nothing left


def test_idle_replicas_share_what_is_queued_busy_ones_do_not() -> None:
    """Four windows of one bucket and two idle replicas: two each, so the request computes on both;
    with one replica busy the idle one takes all four, and a busy replica's timeout batch is whole."""
    s = make(wait_when_idle=False)
    r1 = ReplicaView("r1")
    submit_all(s, {"q": [250, 250, 250, 200]}, now=0.0)
    d1 = s.next_batch(0.0, [R0, r1])
    d2 = s.next_batch(0.0, [R0, r1])
    assert d1 is not None and d2 is not None
    assert (d1.replica_id, d1.items, d1.padded_len, d1.reason) == ("r0", [("q", 0), ("q", 1)], 250, "idle")
    assert (d2.replica_id, d2.items, d2.padded_len, d2.reason) == ("r1", [("q", 2), ("q", 3)], 250, "idle")
    s.batch_done(d1.batch_id, now=0.5, ok=True)  # r1 still computes
    submit_all(s, {"p": [250, 250, 250]}, now=0.5)
    d3 = s.next_batch(0.5, [R0, r1])
    assert d3 is not None
    assert (d3.replica_id, len(d3.items), d3.reason) == ("r0", 3, "idle")
    submit_all(s, {"o": [250, 250, 100]}, now=0.5)  # both busy: it waits for the delay, then goes whole
    assert s.next_batch(0.5, [R0, r1]) is None
    d4 = s.next_batch(0.75, [R0, r1])
    assert d4 is not None
    assert (d4.replica_id, d4.items, d4.reason) == ("r0", [("o", 0), ("o", 1)], "timeout")


def test_partial_batch_released_when_deadline_near() -> None:
    s = make(max_queue_delay_ms=10_000.0)
    submit_all(s, {"other": [10]}, now=0.0)
    assert s.submit("urgent", [12], now=0.0, deadline=2.0).accepted
    assert s.next_wakeup(0.0) == 1.5  # deadline 2.0 - margin 0.5
    assert s.next_batch(1.25, [R0]) is None
    d = s.next_batch(1.5, [R0])
    assert d is not None
    assert (d.items, d.reason) == ([("other", 0), ("urgent", 0)], "deadline")


def test_length_buckets_never_mix_and_oldest_bucket_goes_first() -> None:
    s = make()
    submit_all(s, {"long1": [100], "long2": [128]}, now=0.0)
    submit_all(s, {"s1": [30], "s2": [64], "s3": [10]}, now=0.125)
    submit_all(s, {"xl": [129]}, now=0.25)
    assert s.next_batch(0.25, [R0, ReplicaView("r1")]) is not None  # bucket 128, timed out at 0.25
    d2 = s.next_batch(0.375, [R0, ReplicaView("r1")])
    d3 = s.next_batch(0.5, [ReplicaView("r2")])
    assert d2 is not None and d3 is not None
    assert (d2.items, d2.bucket, d2.padded_len) == ([("s1", 0), ("s2", 0), ("s3", 0)], 64, 64)
    assert (d3.items, d3.bucket, d3.padded_len) == ([("xl", 0)], 256, 129)


def test_both_buckets_due_oldest_first() -> None:
    s = make()
    submit_all(s, {"late_short": [10]}, now=0.125)
    submit_all(s, {"early_long": [100]}, now=0.0)
    d1 = s.next_batch(1.0, [R0])
    d2 = s.next_batch(1.0, [R0])
    assert d1 is not None and d2 is not None
    assert (d1.items, d1.bucket) == ([("early_long", 0)], 128)
    assert (d2.items, d2.bucket) == ([("late_short", 0)], 64)


def test_padding_ratio() -> None:
    s = make()
    submit_all(s, {"a": [40], "b": [60]}, now=0.0)
    assert s.next_batch(0.25, [R0]) is not None
    assert s.stats().padding_ratio == (120 - 100) / 120


# ---------------------------------------------------------------- admission


def _with_rate_8_per_s(windows_per_request: int) -> Scheduler:
    """One full batch of 4 windows served in 0.5 s (8 windows/s), then the queue (2) filled."""
    s = make(max_queue_size=2)
    submit_all(s, {"warm": [50, 50, 50, 50]}, now=0.0)
    d = s.next_batch(0.0, [R0])
    assert d is not None and d.reason == "full"
    assert s.batch_done(d.batch_id, now=0.5, ok=True) == Outcome(completed=["warm"])
    assert s.service_rate() == 8.0
    for rid in ("q1", "q2"):  # deadlines long enough for their windows at that rate
        assert s.submit(rid, [50] * windows_per_request, now=0.5, deadline=1000.0).accepted
    return s


@pytest.mark.parametrize(("windows_per_request", "retry_after"), [(4, 1), (40, 10), (400, 60)])
def test_queue_full_rejected_with_retry_after_growing_with_depth(
    windows_per_request: int, retry_after: int
) -> None:
    s = _with_rate_8_per_s(windows_per_request)
    adm = s.submit("over", [50], now=0.5)
    assert (adm.accepted, adm.reason, adm.retry_after_s) == (False, "queue_full", retry_after)
    assert "max_queue_size=2" in adm.detail
    st = s.stats()
    assert (st.queued_requests, st.queued_windows, st.rejected["queue_full"]) == (
        2,
        2 * windows_per_request,
        1,
    )


def test_queue_full_before_any_completion_uses_floor() -> None:
    s = make(max_queue_size=1)
    submit_all(s, {"a": [10]}, now=0.0)
    adm = s.submit("b", [10], now=0.0)
    assert (adm.reason, adm.retry_after_s) == ("queue_full", 1)


def test_in_flight_requests_do_not_count_against_queue_size() -> None:
    s = make(max_queue_size=1)
    submit_all(s, {"a": [10]}, now=0.0)
    assert s.next_batch(0.25, [R0]) is not None
    assert s.submit("b", [10], now=0.25).accepted


def test_window_too_large_rejected() -> None:
    s = make()
    adm = s.submit("big", [10, 257], now=0.0)
    assert (adm.accepted, adm.reason, adm.retry_after_s) == (False, "too_large", None)
    assert "257" in adm.detail and "256" in adm.detail
    st = s.stats()
    assert (st.queued_windows, st.rejected) == (0, {"queue_full": 0, "overloaded": 0, "too_large": 1})
    assert s.submit("edge", [256], now=0.0).accepted


def test_submit_caller_errors() -> None:
    s = make()
    with pytest.raises(ValueError, match="no windows"):
        s.submit("a", [], now=0.0)
    with pytest.raises(ValueError, match="0 tokens"):
        s.submit("a", [5, 0], now=0.0)
    submit_all(s, {"a": [5]}, now=0.0)
    with pytest.raises(ValueError, match="already queued"):
        s.submit("a", [5], now=0.0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_batch_size": 0}, "max_batch_size=0 must be"),
        ({"max_queue_size": -3}, "max_queue_size=-3 must be"),
        ({"length_buckets": (128, 64)}, r"length_buckets=\(128, 64\)"),
        ({"length_buckets": ()}, r"length_buckets=\(\)"),
        ({"max_batch_tokens": 200}, "max_batch_tokens=200 is below the largest length bucket 256"),
        ({"max_queue_delay_ms": -1.0}, r"max_queue_delay_ms=-1.0"),
        ({"default_deadline_s": 0.0}, r"default_deadline_s=0.0"),
    ],
)
def test_config_validation_prints_numbers(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(**overrides)


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


# ---------------------------------------------------------------- replicas


def test_least_loaded_replica_selected() -> None:
    s = make(max_queue_delay_ms=0.0)
    submit_all(s, {"z": [10]}, now=0.0)
    assert s.next_batch(0.0, [R0]) is not None  # r0 now has one batch in flight (the ledger's count)
    submit_all(s, {"a": [10]}, now=0.0)
    d = s.next_batch(0.0, [ReplicaView("r0"), ReplicaView("r1")])
    assert d is not None and d.replica_id == "r1"
    submit_all(s, {"b": [10]}, now=0.0)
    d = s.next_batch(0.0, [ReplicaView("r0"), ReplicaView("r1", accepting=False)])
    assert d is not None and d.replica_id == "r0"


def test_max_inflight_per_replica_respected_with_stale_views() -> None:
    s = make()
    submit_all(s, {f"q{i}": [10] * 4 for i in range(5)}, now=0.0)
    views = [ReplicaView("r0"), ReplicaView("r1")]  # the scheduler counts the load itself
    batches = [s.next_batch(0.0, views) for _ in range(4)]
    assert [b.replica_id for b in batches if b is not None] == ["r0", "r1", "r0", "r1"]
    assert s.next_batch(0.0, views) is None  # a full batch is ready but both replicas are full
    assert s.stats().inflight_batches == {"r0": 2, "r1": 2}
    assert s.next_wakeup(0.0) == 10.0  # only q4's expiry: the full batch waits for capacity
    assert batches[1] is not None
    # fair order: each request has windows in several batches, so none is complete yet
    assert s.batch_done(batches[1].batch_id, now=0.5, ok=True).completed == []
    d = s.next_batch(0.5, views)
    assert d is not None and (d.replica_id, d.items) == ("r1", [("q1", 3), ("q2", 3), ("q3", 3), ("q4", 3)])


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


# ---------------------------------------------------------------- fairness, bounds, reservations (issue 11)


def _drain(s: Scheduler, now: float, n: int) -> list:
    out = []
    for _ in range(n):
        d = s.next_batch(now, [R0])
        assert d is not None
        out.append(d)
        s.batch_done(d.batch_id, now=now, ok=True)
    return out


def test_large_request_is_interleaved_with_a_later_small_one_in_the_same_bucket() -> None:
    """Batching took the oldest windows first: a 100-window request held every replica until done."""
    s = make(max_queue_size=8, max_windows_per_request=1000)
    assert s.submit("big", [60] * 100, now=0.0).accepted
    _drain(s, 0.0, 2)  # 8 of its windows went out
    assert s.submit("small", [30], now=1.0).accepted
    d = s.next_batch(1.0, [R0])
    assert d is not None and ("small", 0) in d.items  # in the very next batch, not after 23 more
    assert d.items == [("big", 8), ("small", 0), ("big", 9), ("big", 10)]


def test_small_request_in_another_bucket_waits_at_most_one_batch_of_a_large_one() -> None:
    s = make(max_windows_per_request=1000)
    assert s.submit("big", [200] * 100, now=0.0).accepted
    _drain(s, 0.0, 2)
    assert s.submit("small", [10], now=1.0).accepted
    served = []
    for d in _drain(s, 1.25, 3):  # the small bucket's delay is over at 1.25
        served.append([rid for rid, _ in d.items])
    small_at = next(i for i, rids in enumerate(served) if "small" in rids)
    assert small_at <= 1, served


def test_a_batch_taking_a_far_ahead_window_does_not_push_later_arrivals_behind_the_rest() -> None:
    """A two-item request's short last windows (tags 6 and 13) share a bucket and leave in one batch;
    virtual time used to jump past tag 13, so a small request admitted next waited for every other
    window of the big one (in the API: 6-8 batches instead of at most 4, see test_api.py)."""
    s = make(max_windows_per_request=1000)
    assert s.submit("big", [200] * 6 + [100] + [200] * 6 + [100], now=0.0).accepted
    done = [d.items for d in _drain(s, 1.0, 3)]  # at 1.0 the 128-bucket's delay is over
    assert done[2] == [("big", 6), ("big", 13)]
    assert s.submit("small", [10], now=1.0).accepted
    assert s.next_batch(2.0, [R0]).items == [("small", 0)]  # type: ignore[union-attr]


def test_two_large_requests_share_the_replicas_round_robin() -> None:
    s = make(max_windows_per_request=1000)
    assert s.submit("a", [60] * 40, now=0.0).accepted
    _drain(s, 0.0, 5)  # a: windows 0..19
    assert s.submit("b", [60] * 40, now=0.5).accepted
    items = [it for d in _drain(s, 0.5, 4) for it in d.items]
    assert [rid for rid, _ in items] == ["a", "b"] * 8


def test_single_window_requests_keep_fifo_order() -> None:
    s = make(max_batch_size=2)
    submit_all(s, {f"q{i}": [10] for i in range(6)}, now=0.0)
    assert [d.items for d in _drain(s, 0.0, 3)] == [
        [("q0", 0), ("q1", 0)],
        [("q2", 0), ("q3", 0)],
        [("q4", 0), ("q5", 0)],
    ]


def test_windows_per_request_are_bounded_with_the_numbers() -> None:
    s = make(max_windows_per_request=5)
    adm = s.submit("huge", [10] * 6, now=0.0)
    assert not adm.accepted and adm.reason == "too_large"
    assert "6 windows" in adm.detail and "max_windows_per_request=5" in adm.detail
    assert s.submit("ok", [10] * 5, now=0.0).accepted
    assert s.stats().rejected["too_large"] == 1


def test_reservations_count_against_the_queue_before_tokenization() -> None:
    s = make(max_queue_size=2)
    assert s.reserve().accepted and s.reserve().accepted
    full = s.reserve()  # two requests are being tokenized: the third is refused at once
    assert not full.accepted and full.reason == "queue_full" and full.retry_after_s == 1
    assert "2 being tokenized" in full.detail
    assert not s.submit("unreserved", [10], now=0.0).accepted
    assert s.submit("a", [10], now=0.0, reserved=True).accepted  # uses its place
    s.unreserve()  # the other one failed to tokenize
    assert s.reserve().accepted and s.submit("b", [10] * 2000, now=0.0, reserved=True).reason == "too_large"
    assert s.reserve().accepted  # the rejected submit gave its place back
    with pytest.raises(ValueError, match="unreserve"):
        s.unreserve()
        s.unreserve()


def test_request_that_cannot_meet_its_deadline_is_refused_up_front() -> None:
    """At the measured rate a 400-window request needs ~10 s: with a 5 s deadline it is refused at
    admission instead of being partly computed and answered 504 (wasted work)."""
    s = make(max_queue_delay_ms=0.0, max_windows_per_request=1000, max_queue_size=8)
    submit_all(s, {"warm": [10] * 4}, now=0.0)
    d = s.next_batch(0.0, [R0])
    assert d is not None
    s.batch_done(d.batch_id, now=0.1, ok=True)  # 4 windows in 0.1 s: 40 windows/s
    late = s.submit("big", [10] * 400, now=1.0, deadline=6.0)
    assert not late.accepted and late.reason == "too_large"
    assert "400 windows" in late.detail and "40.0 windows/s" in late.detail
    assert s.submit("big", [10] * 400, now=1.0, deadline=21.0).accepted  # 10 s fits in 20 s
    assert s.submit("one", [10], now=1.0, deadline=1.001).accepted  # single windows are never refused


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


# ---------------------------------------------------------------- capacity (429 overloaded)


def _rate_40_per_s(**overrides: object) -> Scheduler:
    s = make(max_queue_delay_ms=0.0, max_windows_per_request=1000, max_queue_size=64, **overrides)
    submit_all(s, {"warm": [10] * 4}, now=0.0)
    d = s.next_batch(0.0, [R0])
    assert d is not None
    s.batch_done(d.batch_id, now=0.1, ok=True)  # 4 windows in 0.1 s: 40 windows/s
    return s


def test_windows_ahead_follow_fair_order() -> None:
    s = _rate_40_per_s()
    assert s.windows_ahead(5) == 0
    assert s.submit("long", [10] * 100, now=0.2, deadline=100.0).accepted
    # fair order: a request of n windows admitted now waits for n of the long one's, not all 100
    assert [s.windows_ahead(n) for n in (1, 10, 100, 500)] == [1, 10, 100, 100]
    assert s.submit("b", [10] * 10, now=0.2, deadline=100.0).accepted
    assert s.windows_ahead(10) == 20


def test_a_reserved_request_is_not_refused_for_the_reservations_taken_after_it() -> None:
    s = _rate_40_per_s()
    for i in range(5):  # 5 x 40 windows queued: 200 windows, 5 s of work at 40 windows/s
        assert s.submit(f"q{i}", [10] * 40, now=0.2, deadline=100.0).accepted
    assert s.reserve(now=0.2, deadline=20.2, windows_hint=40).accepted  # 6 s fits 35 % of 20 s
    for _ in range(20):  # a burst arrives while it is tokenized: 20 x 40 estimated windows
        assert s.reserve(now=0.2, deadline=200.0, windows_hint=40).accepted
    # counting those 800 windows as ahead of it (26 s) would refuse it after tokenizing, late
    assert s.windows_ahead(40) == 200 + 840  # (its own reservation counts here too)
    assert s.submit("first", [10] * 40, now=0.3, deadline=20.2, reserved=True, windows_hint=40).accepted
    # without a reservation of its own, the same request is checked against them (they came first)
    late = s.submit("unreserved", [10] * 40, now=0.3, deadline=20.2)
    assert (late.accepted, late.reason) == (False, "overloaded")


def test_overloaded_queue_refuses_what_cannot_finish_in_time_with_retry_after() -> None:
    s = _rate_40_per_s()
    for i in range(10):  # 10 x 40 windows queued: 400 windows, 10 s of work at 40 windows/s
        assert s.submit(f"q{i}", [10] * 40, now=0.2, deadline=100.0).accepted
    # a 40-window request waits for ~all of them (fair order): 440 windows = 11 s > its 5 s deadline
    late = s.submit("late", [10] * 40, now=0.2, deadline=5.2)
    assert (late.accepted, late.reason) == (False, "overloaded")
    assert late.retry_after_s is not None and late.retry_after_s >= 1
    assert "400 windows (queued or in flight) go before" in late.detail and "40.0 windows/s" in late.detail
    assert s.stats().rejected["overloaded"] == 1
    # before tokenizing, the estimate says the same (and takes no queue place)
    assert s.reserve(now=0.2, deadline=5.2, windows_hint=40).reason == "overloaded"
    assert s.reserve(now=0.2, deadline=40.0, windows_hint=40).accepted  # 11 s fits in 0.35 of 39.8 s
    s.unreserve()
    # before tokenizing only 35 % of the time left counts (the estimates move meanwhile); after it, all
    assert s.reserve(now=0.2, deadline=20.0, windows_hint=40).reason == "overloaded"  # 11 s > 0.35 x 19.8 s
    assert s.submit("fits", [10] * 40, now=0.2, deadline=20.0).accepted  # 11 s < 19.8 s
    # a single window waits for one window of each request ahead (10 <= a batch? no: 4 per batch),
    # 11 windows = 0.3 s: well inside a 5 s deadline
    assert s.submit("small", [10], now=0.2, deadline=5.2).accepted


def test_windows_in_flight_count_as_ahead_of_a_new_request() -> None:
    """A burst whose first batches were dispatched at once: its later requests wait for those too."""
    s = _rate_40_per_s()  # 40 windows/s
    for i in range(8):  # two full batches of 4, both in flight
        assert s.submit(f"b{i}", [10], now=0.2, deadline=10.0).accepted
    assert s.next_batch(0.2, [R0]) is not None and s.next_batch(0.2, [R0]) is not None
    assert s.stats().queued_windows == 0 and s.ledger.inflight_windows == 8
    # 8 in flight + 1 queued + its own = 10 windows = 0.25 s: more than a 0.2 s deadline
    assert s.submit("q", [10], now=0.2, deadline=10.0).accepted
    late = s.submit("late", [10], now=0.2, deadline=0.4)
    assert (late.accepted, late.reason) == (
        False,
        "overloaded",
    ) and "9 windows (queued or in flight)" in late.detail
    assert s.submit("fits", [10], now=0.2, deadline=0.6).accepted


def test_less_than_a_batch_ahead_is_never_refused_as_overloaded() -> None:
    s = _rate_40_per_s()
    assert s.submit("big", [10] * 400, now=0.2, deadline=21.0).accepted
    assert s.submit("one", [10], now=0.2, deadline=0.201).accepted  # rides the next batch
