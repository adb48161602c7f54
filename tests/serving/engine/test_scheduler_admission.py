"""Tests for serving/engine/scheduler.py's admission (serving/engine/admission.py): the bounded queue
and Retry-After, size limits (windows, windows per request), reservations before tokenizing,
config validation, and refusing what cannot finish in time (429 overloaded). Pure logic driven by
a fake clock (plain floats for ``now``; helpers: scheduler_helpers.py).

Run: python -m pytest tests/serving/engine/test_scheduler_admission.py -q
"""

from __future__ import annotations

import pytest

from shardserve.serving.engine.scheduler import Outcome, Scheduler
from tests.serving.engine.scheduler_helpers import R0, make, submit_all

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


# ---------------------------------------------------------------- bounds, reservations (issue 11)


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
