"""Tests for serving/engine/scheduler.py's batching (serving/engine/batcher.py): when a micro-batch is
released (full, delay, deadline, an idle replica), length buckets, the least-loaded replica and
max_inflight_per_replica, and fair order between large and small requests. Pure logic driven by a
fake clock (plain floats for ``now``; helpers: scheduler_helpers.py).

Run: python -m pytest tests/serving/engine/test_scheduler_batching.py -q
"""

from __future__ import annotations

from shardserve.serving.engine.batcher import ReplicaView
from shardserve.serving.engine.scheduler import Scheduler
from tests.serving.engine.scheduler_helpers import R0, make, submit_all

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


# ---------------------------------------------------------------- fair order (issue 11)


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
    window of the big one (in the API: 6-8 batches instead of at most 4, see test_api_admission.py)."""
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
