"""``bench_multimodel.py --drift``'s pure parts (benchmarks/multimodel_drift.py): the two-phase trace,
the measured side's bookkeeping, the arms' prediction with a stub planner, the JSON and the plot.
No servers, no timings."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import multimodel_drift as md

from shardserve.partitioner.placement.latency import LatencyModel, MeasuredLatency, ModelProfile
from shardserve.partitioner.placement.layout import Group, Placement
from shardserve.partitioner.placement.simulator import SimConfig
from shardserve.partitioner.placement.workload import Trace

NAMES = ["m0", "m1", "m2"]


def test_shares_are_zipf_like_with_the_first_hot() -> None:
    got = md.shares(NAMES, 22.0, 1.0)
    assert got == pytest.approx({"m0": 12.0, "m1": 6.0, "m2": 4.0})
    assert md.shares(NAMES, 9.0, 0.0) == pytest.approx({m: 3.0 for m in NAMES})


def test_two_phase_trace_switches_the_hot_model_half_way() -> None:
    trace = md.two_phase_trace(NAMES, rate=30.0, cv=1.0, skew=1.0, half_s=100.0, seed=3)
    assert trace.duration_s == 200.0
    assert trace == md.two_phase_trace(NAMES, rate=30.0, cv=1.0, skew=1.0, half_s=100.0, seed=3)  # seeded
    first, second = md.cut(trace, 0.0, 100.0), md.cut(trace, 100.0, 200.0)
    assert len(first.requests) + len(second.requests) == len(trace.requests)
    assert all(0 <= t < 100.0 for t, _ in second.requests)  # times from the cut's start
    c1, c2 = first.counts(), second.counts()
    assert c1["m0"] > c1["m1"] > c1["m2"] and c2["m2"] > c2["m1"] > c2["m0"]
    assert c1["m0"] == pytest.approx(100 * 30 * 6 / 11, rel=0.1)  # 6/11 of the rate: the first model
    assert c2["m2"] == pytest.approx(100 * 30 * 6 / 11, rel=0.1)
    assert len(trace.requests) == pytest.approx(200 * 30, rel=0.05)


def test_window_edges() -> None:
    assert md.edges(120.0, 10.0) == [10.0 * k for k in range(13)]
    assert md.edges(25.0, 10.0) == [0.0, 10.0, 20.0, 25.0]


@dataclass(frozen=True)
class _Sent:  # loadtest.replay.Sent's fields that are read
    model: str
    due_s: float
    status: int
    latency_s: float


def test_measured_side_splits_outcomes_halves_and_windows() -> None:
    assert md.outcome(200, 0.1, 0.2) == "good" and md.outcome(200, 0.3, 0.2) == "slo_miss"
    assert md.outcome(429, 0.0, 0.2) == md.outcome(504, 0.5, 0.2) == "slo_miss"
    assert md.outcome(503, 0.0, 0.2) == "5xx" and md.outcome(0, 1.0, 0.2) == "connection"
    assert md.outcome(404, 0.0, 0.2) == "other"
    sent = [
        _Sent("m0", 1.0, 200, 0.1),  # window 0, good
        _Sent("m0", 2.0, 200, 0.5),  # window 0, late
        _Sent("m1", 15.0, 429, 0.0),  # window 1, refused
        _Sent("m2", 21.0, 503, 0.0),  # window 2 (second half), 5xx at the switch
        _Sent("m2", 25.0, 0, 1.0),  # window 2, no answer, at the switch
        _Sent("m2", 35.0, 200, 0.1),  # window 3, good
        _Sent("m2", 39.0, 0, 60.0),  # window 3, no answer, 19 s after the switch
    ]
    side = md.measured_side(sent, slo_s=0.2, half_s=20.0, window_s=10.0)
    assert side["requests"] == 7 and side["attainment"] == pytest.approx(2 / 7, abs=1e-6)
    assert side["half_attainment"] == [pytest.approx(1 / 3, abs=1e-6), 0.25]
    assert side["window_attainment"] == [0.5, 0.0, 0.0, 0.5]
    assert side["outcomes"] == {"good": 2, "slo_miss": 2, "5xx": 1, "connection": 2, "other": 0}
    assert side["failed"] == 3 and side["failed_at_switch"] == 2


def test_replans_map_the_servers_history_onto_the_trace() -> None:
    history = [
        {"time": 1000.0, "policy": "auto", "placement": "start", "attainment": 0.9},
        {"time": 1075.5, "policy": "auto", "placement": "new", "attainment": 0.95, "reason": "re-plan"},
    ]
    assert md.replans(history, trace_start_wall=1005.0) == [
        {"t_s": 70.5, "placement": "new", "predicted_attainment": 0.95, "reason": "re-plan"}
    ]
    assert md.replans(history[:1], trace_start_wall=1005.0) == []


def test_with_replan_sets_the_servers_re_plan_flags() -> None:
    base = ["--placement", "auto", "--replan-interval-s", "0"]
    assert md.with_replan(base, 10, 15) == [*base[:3], "10", "--replan-look-back-s", "15"]
    assert md.with_replan(base, 0, 15)[3] == "0" and base[3] == "0"  # a copy


START = Placement((Group((0,), 1, 1, ("m0",)), Group((1,), 1, 1, ("m1", "m2"))))
MOVED = Placement((Group((0,), 1, 1, ("m2",)), Group((1,), 1, 1, ("m1", "m0"))))


@dataclass
class _StubPlanner:
    """Re-plans to MOVED once the observed window is mostly m2 (records what it was shown)."""

    config: SimConfig
    calls: list

    def replan(self, trace: Trace, current: Placement) -> Placement | None:
        self.calls.append(len(trace.requests))
        counts = trace.counts()
        return MOVED if counts.get("m2", 0) > counts.get("m0", 0) else None


def _profiles(stage_s: float = 0.05) -> list[ModelProfile]:
    latency = LatencyModel({(1, 1): {1: stage_s, 2: 2 * stage_s, 4: 4 * stage_s}})
    return [ModelProfile(m, param_bytes=1, latency=latency) for m in NAMES]


def test_predict_arms_replans_after_the_switch_and_keeps_the_fixed_placement() -> None:
    trace = md.two_phase_trace(NAMES, rate=30.0, cv=1.0, skew=1.0, half_s=30.0, seed=0)
    planner = _StubPlanner(SimConfig(max_batch_size=4), [])
    out = md.predict_arms(trace, START, half_s=30.0, window_s=10.0, interval_s=10.0, look_back_s=15.0,
                          planner=planner, profiles=_profiles(), slo_s=0.25)  # fmt: skip
    assert len(planner.calls) == 5  # ticks at 10, 20, 30, 40, 50 s
    assert out["fixed"]["replans"] == []
    assert out["replan"]["replans"] == [{"t_s": 40.0, "placement": MOVED.describe()}]  # (25, 40]: m2 hot
    for arm in md.ARMS:
        assert len(out[arm]["window_attainment"]) == 6 and len(out[arm]["half_attainment"]) == 2
    assert out["replan"]["half_attainment"][0] == out["fixed"]["half_attainment"][0]  # same until the switch
    # m2 (18 req/s at 20 req/s a device) shares a device with m1 when fixed, has one alone re-planned
    assert out["replan"]["half_attainment"][1] > out["fixed"]["half_attainment"][1] + 0.05


def _pair(fixed_2nd: float, replan_2nd: float, *, first: float = 0.97, order=md.ARMS) -> dict:
    predicted = {
        "fixed": {"attainment": 0.8, "half_attainment": [0.98, 0.6], "window_attainment": [1.0, 0.6], "replans": []},
        "replan": {"attainment": 0.9, "half_attainment": [0.98, 0.85], "window_attainment": [1.0, 0.85],
                   "replans": [{"t_s": 70.0, "placement": MOVED.describe()}]},
    }  # fmt: skip
    measured = {
        arm: {
            "requests": 100,
            "half_attainment": [first if arm == "fixed" else first - 0.02, fixed_2nd if arm == "fixed" else replan_2nd],
            "window_attainment": [0.97, fixed_2nd if arm == "fixed" else replan_2nd],
            "failed": int(arm == "replan"),
            "failed_at_switch": 0,
            "replans": [] if arm == "fixed" else [{"t_s": 72.3, "placement": MOVED.describe()}],
            "searches": None if arm == "fixed" else {"count": 11, "seconds": 0.44, "last_s": 0.04},
        }
        for arm in md.ARMS
    }  # fmt: skip
    return md.pair_entry(order=list(order), measured=measured, predicted=predicted)


def test_drift_entry_sums_the_pairs_and_writes_json_and_plot(tmp_path: Path) -> None:
    pairs = [_pair(0.55, 0.80), _pair(0.50, 0.85, order=md.ARMS[::-1]), _pair(0.60, 0.80)]
    assert pairs[0]["gain_points"] == {"measured": 25.0, "predicted": 25.0}
    assert pairs[0]["first_half_points"] == {"measured": -2.0, "predicted": 0.0}
    assert pairs[1]["order"] == ["replan", "fixed"]
    settings = {"models": 3, "rate": 29.0, "cv": 1.0, "skew": 1.0, "slo_scale": 5.0, "half_s": 60.0,
                "window_s": 60.0}  # fmt: skip
    entry = md.drift_entry(settings=settings, pairs=pairs)
    assert entry["gain_points"]["measured"] == {"per_pair": [25.0, 35.0, 20.0], "mean": 26.67, "spread": 15.0}
    assert entry["gain_points"]["predicted"]["mean"] == 25.0
    assert entry["first_half_points"]["measured"]["per_pair"] == [-2.0, -2.0, -2.0]
    assert entry["failed"] == {"fixed": 0, "replan": 3}
    assert entry["failed_at_switch"] == {"fixed": 0, "replan": 0}
    assert entry["replan_searches"] == {"count": 33, "mean_ms": 40.0}
    table = md.drift_table(entry)
    assert "72.3" in table and "+25.0 +35.0 +20.0 (mean +26.7, spread 15.0)" in table
    assert table.splitlines()[3].split()[:2] == ["2", "replan"]  # the second pair as it ran: replan first
    args = argparse.Namespace(json=tmp_path / "d.json", plots=tmp_path, models=3, dtype="float32")
    prof = MeasuredLatency(LatencyModel({(1, 1): {1: 0.05}}), overhead_s=0.001)
    assert md.report_drift(entry, args, {"cpu": "test cpu"}, single=0.051, memory=2**20, measured=prof) == 0
    body = json.loads((tmp_path / "d.json").read_text())
    assert body["models"] == 3 and body["single_latency_ms"] == 51.0 and body["profile"] == prof.to_dict()
    drift = body["drift"]
    assert drift["pairs"][0]["arms"]["replan"]["measured"]["replans"][0]["t_s"] == 72.3
    assert {"measured", "predicted"} == set(drift["pairs"][2]["arms"]["fixed"]) and drift["half_s"] == 60.0
    assert (tmp_path / "multimodel-drift.png").stat().st_size > 0


def test_run_drift_alternates_the_arms_on_one_trace_and_predicts_each_pair() -> None:
    import contextlib
    import time

    served, replayed, paced = [], [], []

    @contextlib.contextmanager
    def serve(cmd: list[str]):
        served.append(cmd)
        arm = "fixed" if cmd[cmd.index("--replan-interval-s") + 1] == "0" else "replan"
        yield argparse.Namespace(url=f"http://server{len(served)}-{arm}")

    def replay_trace(url: str, trace: Trace, slo_s: float) -> list[_Sent]:
        replayed.append((url, len(trace.requests), trace.duration_s))
        fast = url.endswith("replan")  # the fixed server is late in the second half
        return [_Sent(m, t, 200, 0.1 if t < 20.0 or fast else 0.5) for t, m in trace.requests]

    def status_of(url: str) -> dict:
        now = time.time()
        first = {"time": now - 100, "placement": START.describe(), "attainment": 0.9}
        moved = {"time": now - 10, "placement": MOVED.describe(), "attainment": 0.95, "reason": "re-plan"}
        if url.endswith("replan"):
            return {"history": [first, moved], "searches": {"count": 3, "seconds": 0.3, "last_s": 0.1}}
        return {"history": [first], "searches": {"count": 0, "seconds": 0.0, "last_s": None}}

    def pace_of(url: str, placement: Placement) -> tuple[int, float]:
        paced.append(url)
        return 1, 1.0 + 0.1 * len(paced)

    args = argparse.Namespace(
        drift_rate=30.0, drift_cv=1.0, drift_skew=1.0, drift_slo_scale=5.0, drift_half_s=20.0, window_s=10.0,
        seed=0, replan_interval_s=10.0, replan_look_back_s=15.0, pairs=2,
    )  # fmt: skip
    factors: list[float] = []
    entry = md.run_drift(
        args,
        names=NAMES,
        base_cmd=["--placement", "auto", "--replan-interval-s", "0"],
        serve=serve,
        replay_trace=replay_trace,
        placement_of=lambda url: START,
        pace_of=pace_of,
        profiles_at=lambda pace: factors.append(pace[1]) or _profiles(),
        planner=_StubPlanner(SimConfig(max_batch_size=4), []),
        slo_s=0.25,
        status_of=status_of,
    )
    intervals = [cmd[cmd.index("--replan-interval-s") + 1] for cmd in served]
    assert intervals == ["0", "10", "10", "0"]  # fixed replan, replan fixed
    assert all(cmd[cmd.index("--replan-look-back-s") + 1] == "15" for cmd in served)
    assert served[0][served[0].index("--workload-skew") + 1] == "1" and "--slo-scale" in served[0]
    # per run: 5 s of warm-up at the first half's shares, then the same two-phase trace
    assert [r[2] for r in replayed] == [5.0, 40.0] * 4 and len({r[1] for r in replayed[1::2]}) == 1
    # the fixed runs are paced before and after their trace, the re-planning ones after only
    assert [u.rsplit("-", 1)[1] for u in paced] == ["fixed", "fixed", "replan", "replan", "fixed", "fixed"]
    assert factors == [1.1, 1.5]  # each pair predicted at its own fixed run's pace before the trace
    assert [p["order"] for p in entry["pairs"]] == [["fixed", "replan"], ["replan", "fixed"]]
    for pair in entry["pairs"]:
        assert pair["arms"]["fixed"]["measured"]["half_attainment"] == [1.0, 0.0]
        assert pair["arms"]["replan"]["measured"]["half_attainment"] == [1.0, 1.0]
        assert pair["arms"]["replan"]["measured"]["replans"][0]["placement"] == MOVED.describe()
        assert pair["arms"]["fixed"]["measured"]["replans"] == []
        assert pair["arms"]["replan"]["predicted"]["replans"][0]["t_s"] == 30.0
    assert entry["pairs"][1]["pace"] == {"pp": 1, "factor": 1.5}
    assert entry["gain_points"]["measured"] == {"per_pair": [100.0, 100.0], "mean": 100.0, "spread": 0.0}
    assert entry["replan_searches"] == {"count": 6, "mean_ms": 100.0}
    assert entry["start_placement"] == START.describe() and entry["requests"] == replayed[1][1]
    assert entry["pairs"][0]["arms"]["replan"]["measured"]["pace_after"] == 1.3
