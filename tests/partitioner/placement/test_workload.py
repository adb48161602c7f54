"""Arrival processes and traces: the rate and burstiness asked for are the ones drawn."""

from __future__ import annotations

import numpy as np
import pytest

from shardserve.partitioner.placement.workload import (
    ArrivalSpec,
    Trace,
    Workload,
    WorkloadError,
    alternating_bursts,
    fit_arrivals,
    load_trace,
    look_back,
    steady,
    write_trace,
)


@pytest.mark.parametrize("cv", [1.0, 0.5, 3.0])
def test_gamma_arrivals_have_the_rate_and_cv_asked_for(cv: float) -> None:
    trace = Workload((ArrivalSpec("a", rate=50.0, cv=cv),), duration_s=400.0, seed=7).trace()
    times = np.array([t for t, _ in trace.requests])
    gaps = np.diff(times)
    assert len(times) / 400.0 == pytest.approx(50.0, rel=0.06 if cv > 1 else 0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)


def test_same_seed_same_trace_and_streams_are_merged_sorted() -> None:
    specs = (ArrivalSpec("a", 30.0), ArrivalSpec("b", 10.0, cv=2.0))
    one, two = Workload(specs, 20.0, seed=3).trace(), Workload(specs, 20.0, seed=3).trace()
    other = Workload(specs, 20.0, seed=4).trace()
    assert one == two and one != other
    times = [t for t, _ in one.requests]
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 20.0
    rates = one.rates()
    assert rates["a"] == pytest.approx(30.0, rel=0.2) and rates["b"] == pytest.approx(10.0, rel=0.35)
    assert steady(("a", "b"), rate=40.0, duration_s=100.0, seed=1).trace().rates()["b"] == pytest.approx(
        20.0, rel=0.1
    )


def test_alternating_bursts_take_turns() -> None:
    trace = alternating_bursts(("a", "b"), burst_rate=100.0, period_s=2.0, duration_s=8.0, seed=5).trace()
    phases = {}
    for t, m in trace.requests:
        phases.setdefault(int(t // 2.0), set()).add(m)
    assert phases == {0: {"a"}, 1: {"b"}, 2: {"a"}, 3: {"b"}}
    assert trace.counts()["a"] == pytest.approx(400, rel=0.15)  # 2 phases x 2 s x 100 req/s
    with_base = alternating_bursts(
        ("a", "b"), burst_rate=100.0, base_rate=5.0, period_s=2.0, duration_s=8.0, seed=5
    ).trace()
    assert {m for t, m in with_base.requests if t < 2.0} == {"a", "b"}


def test_trace_files_round_trip_and_fit(tmp_path) -> None:
    trace = Workload((ArrivalSpec("a", 40.0, cv=2.0), ArrivalSpec("b", 20.0)), 100.0, seed=2).trace()
    path = tmp_path / "t.jsonl"
    write_trace(path, trace.requests)
    loaded = load_trace(path, duration_s=100.0)
    assert loaded.counts() == trace.counts()
    fitted = {s.model: s for s in fit_arrivals(loaded)}
    assert fitted["a"].rate == pytest.approx(40.0, rel=0.1) and fitted["a"].cv == pytest.approx(2.0, rel=0.15)
    assert fitted["b"].cv == pytest.approx(1.0, rel=0.1)
    csv = tmp_path / "t.csv"
    csv.write_text("time_s,model\n0.5,b\n0.1,a\n")
    assert load_trace(csv).requests == ((0.1, "a"), (0.5, "b"))


def test_bad_specs_and_files_say_the_numbers(tmp_path) -> None:
    with pytest.raises(WorkloadError, match=r"rate=-1\.0 must be a finite number >= 0"):
        ArrivalSpec("a", rate=-1.0)
    with pytest.raises(WorkloadError, match=r"cv=0\.0 must be a finite number > 0"):
        ArrivalSpec("a", rate=1.0, cv=0.0)
    with pytest.raises(WorkloadError, match="outside"):
        Trace(((0.5, "a"), (3.0, "a")), duration_s=2.0)
    bad = tmp_path / "bad.csv"
    bad.write_text("time_s,model\n0.1,a\nx,b\n")
    with pytest.raises(WorkloadError, match="line 3"):
        load_trace(bad)
    (tmp_path / "nohead.csv").write_text("0.1,a\n")
    with pytest.raises(WorkloadError, match="header 'time_s,model'"):
        load_trace(tmp_path / "nohead.csv")


def test_skewed_rates_follow_zipf_and_keep_the_total() -> None:
    rates = {
        s.model: s.rate for s in steady(["a", "b", "c", "d"], rate=100.0, duration_s=1.0, skew=1.0).arrivals
    }
    assert sum(rates.values()) == pytest.approx(100.0)
    assert rates["a"] / rates["b"] == pytest.approx(2.0) and rates["a"] / rates["d"] == pytest.approx(4.0)
    assert {s.rate for s in steady(["a", "b"], rate=10.0, duration_s=1.0).arrivals} == {5.0}
    with pytest.raises(WorkloadError, match="skew=-1"):
        steady(["a"], rate=1.0, duration_s=1.0, skew=-1.0)


def test_look_back_is_the_window_a_re_plan_fits() -> None:
    # on any clock, in any order
    arrivals = [(1005.0, "b"), (1001.0, "a"), (1009.5, "a"), (1010.0, "c"), (1010.5, "a")]
    seen = look_back(arrivals, now=1010.0, window_s=5.0)  # (1005, 1010]: the start out, the end in
    assert seen.requests == ((4.5, "a"), (5.0, "c")) and seen.duration_s == 5.0
    now = 110571.91525859303  # a monotonic clock's reading where now - (now - 0.3) rounds past 0.3
    edge = look_back([(now, "a")], now=now, window_s=0.3)
    assert edge.requests == ((0.3, "a"),) and edge.duration_s == 0.3
    assert look_back([], now=10.0, window_s=5.0).requests == ()
