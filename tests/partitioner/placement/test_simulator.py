"""The placement simulator: pipeline timing, batching, admission, replicas, memory, and its speed."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardserve.partitioner.placement.latency import (
    LatencyModel,
    MeasuredLatency,
    ModelProfile,
    PlacementError,
)
from shardserve.partitioner.placement.layout import Group, Placement
from shardserve.partitioner.placement.simulator import SimConfig, simulate
from shardserve.partitioner.placement.workload import Trace, steady

MiB = 2**20


def profile(name: str = "a", *, single: float = 0.010, hop: float = 0.0, param_bytes: int = 1000 * MiB):
    """Stage time = single / pp * b + hop (pp > 1): no batching gain, so the arithmetic stays exact."""
    table = {
        (pp, 1): {b: single / pp * b + (hop if pp > 1 else 0.0) for b in (1, 2, 4, 8)} for pp in (1, 2, 4)
    }
    return ModelProfile(name, param_bytes=param_bytes, latency=LatencyModel(table))


def one_group(*models: str, pp: int = 1) -> Placement:
    return Placement((Group(tuple(range(pp)), pp, 1, models),))


def test_latency_table_interpolates_and_extrapolates() -> None:
    lat = LatencyModel({(1, 1): {1: 0.010, 4: 0.022}, (2, 1): {2: (0.004, 0.006)}})
    assert lat.stages(1, 1, 2) == pytest.approx((0.014,))  # between 1 and 4: linear
    assert lat.stages(1, 1, 8) == pytest.approx((0.038,))  # past 4: along the last segment
    assert lat.stages(2, 1, 1) == pytest.approx((0.002, 0.003))  # below the table: in proportion
    assert lat.stages(2, 1, 4) == pytest.approx((0.008, 0.012))  # one point: in proportion
    assert lat.capacity(1, 1, 4, max_inflight=2) == pytest.approx(4 / 0.022)
    with pytest.raises(PlacementError, match=r"no latencies for pp=4 tp=1 \(have \[\(1, 1\), \(2, 1\)\]\)"):
        lat.stages(4, 1, 1)
    with pytest.raises(PlacementError, match="1 stage times for pp=2"):
        LatencyModel({(2, 1): {1: (0.01,)}})


def test_low_rate_meets_every_slo_and_latency_is_the_sum_of_stages() -> None:
    trace = Trace(tuple((0.1 * k, "a") for k in range(50)), duration_s=5.0)  # 100 ms apart: never queued
    res = simulate(one_group("a", pp=2), [profile(hop=0.001)], trace, slo_s=0.02)
    stats = res.per_model["a"]
    assert (res.attainment, stats.good, stats.rejected, stats.late) == (1.0, 50, 0, 0)
    assert stats.p50_s == pytest.approx(2 * (0.005 + 0.001)) and stats.p99_s == pytest.approx(0.012)
    assert res.goodput == pytest.approx(10.0)
    # an SLO below the pipeline's latency: every request is late
    assert simulate(one_group("a", pp=2), [profile(hop=0.001)], trace, slo_s=0.011).attainment == 0.0


def test_pipeline_overlaps_micro_batches_up_to_max_inflight() -> None:
    """3 requests at t=0, batches of 1, stages 5 ms + 5 ms, 2 in flight: the second enters stage 0
    while the first is in stage 1 (done at 10 and 15 ms); the third waits for a free slot at 10 ms."""
    trace = Trace(((0.0, "a"), (0.0, "a"), (0.0, "a")), duration_s=1.0)
    cfg = SimConfig(max_batch_size=1, max_inflight=2, admission=False)
    res = simulate(one_group("a", pp=2), [profile()], trace, slo_s=0.0155, config=cfg)
    assert res.per_model["a"].good == 2 and res.per_model["a"].late == 1  # latencies 10, 15, 20 ms
    # one in flight: the first request goes alone (10 ms), the other two then as one batch of 2
    # (10 ms per stage): done at 30 ms
    cfg = SimConfig(max_batch_size=4, max_inflight=1)
    res = simulate(one_group("a", pp=2), [profile()], trace, slo_s=1.0, config=cfg)
    assert (res.per_model["a"].p50_s, res.per_model["a"].p99_s) == pytest.approx((0.030, 0.030))


def test_queue_delay_waits_for_a_fuller_batch() -> None:
    trace = Trace(((0.0, "a"), (0.001, "a")), duration_s=1.0)
    eager = simulate(one_group("a"), [profile()], trace, slo_s=1.0, config=SimConfig(max_inflight=1))
    assert eager.per_model["a"].p99_s == pytest.approx(0.019, abs=1e-4)  # 2nd waits for the 1st batch
    patient = SimConfig(max_inflight=1, max_queue_delay_s=0.002, wait_when_idle=True)
    res = simulate(one_group("a"), [profile()], trace, slo_s=1.0, config=patient)
    # released at 2 ms as one batch of 2 (20 ms): latencies 22 and 21 ms
    assert res.per_model["a"].p50_s == pytest.approx(0.0215, abs=1e-4)
    # as the server batches by default: the idle group takes the first request at once, the second
    # waits for it either way (one in flight), so the delay changes nothing
    idle_first = simulate(
        one_group("a"),
        [profile()],
        trace,
        slo_s=1.0,
        config=SimConfig(max_inflight=1, max_queue_delay_s=0.002),
    )
    assert idle_first.per_model["a"].p99_s == pytest.approx(eager.per_model["a"].p99_s)


def test_the_delay_holds_a_batch_only_while_every_holding_group_is_busy() -> None:
    """Two in flight per group: the first request goes at once to the idle group; the second arrives
    while it computes and waits the delay (2 ms) for company; the third joins it."""
    trace = Trace(((0.0, "a"), (0.001, "a"), (0.0015, "a")), duration_s=1.0)
    cfg = SimConfig(max_inflight=2, max_queue_delay_s=0.002)
    res = simulate(one_group("a"), [profile()], trace, slo_s=0.015, config=cfg)
    # batch 1 (1 request, 10 ms) from 0 to 10 ms; batch 2 (2 requests, 20 ms) sent at 3 ms, runs 10-30:
    # latencies 10, 28.5 and 29 ms
    stats = res.per_model["a"]
    assert (stats.good, stats.late, stats.p50_s) == (1, 2, pytest.approx(0.0285, abs=1e-4))
    waiting = simulate(
        one_group("a"),
        [profile()],
        trace,
        slo_s=0.015,
        config=SimConfig(max_inflight=2, max_queue_delay_s=0.002, wait_when_idle=True),
    )
    assert waiting.per_model["a"].good == 0  # the first request waited 2 ms for company: 22 ms


def test_overload_is_refused_at_admission_and_throughput_is_the_slowest_stage() -> None:
    """400 req/s on one device whose batches of 4 take 40 ms (100 req/s): the device computes at its
    capacity; admission refuses the excess at arrival instead of letting it expire in the queue.
    Like the server's admission (the work queued and in flight / rate, without the request's own
    batch latency), it admits up to its deadline, so under sustained overload the admitted finish
    a little late: the simulator predicts that too."""
    trace = steady(("a",), rate=400.0, duration_s=10.0, seed=1).trace()
    res = simulate(one_group("a"), [profile()], trace, slo_s=0.1, config=SimConfig(max_batch_size=4))
    stats = res.per_model["a"]
    assert stats.good + stats.late + stats.rejected + stats.expired == stats.requests
    assert (stats.good + stats.late) / 10.0 == pytest.approx(100.0, rel=0.03)  # computed at capacity
    assert stats.rejected > 0.6 * stats.requests and stats.expired < 0.05 * stats.requests, stats
    assert stats.p99_s < 0.1 + 2 * 0.040, stats  # the queue is bounded by admission
    unadmitted = simulate(
        one_group("a"), [profile()], trace, slo_s=0.1, config=SimConfig(max_batch_size=4, admission=False)
    )
    u = unadmitted.per_model["a"]
    assert u.rejected == 0 and u.expired > 0.6 * u.requests
    assert u.good + u.late == pytest.approx(stats.good + stats.late, rel=0.01)  # computed at capacity too


def test_each_model_has_its_own_cap_on_a_shared_group_and_replicas_share_the_load() -> None:
    trace = Trace(tuple(sorted([(0.0, "a")] * 4 + [(0.0, "b")] * 4)), duration_s=1.0)
    cfg = SimConfig(max_batch_size=2, max_inflight=1, admission=False)
    res = simulate(one_group("a", "b"), [profile("a"), profile("b")], trace, slo_s=1.0, config=cfg)
    # a's first request goes alone at once (0-10 ms), b's first at once too, behind it (10-20 ms): b
    # is not held back by a's queue; then each sends its next batch of 2 when its own returns:
    # a 20-40, b 40-60, a's last 60-70, b's last 70-80
    a, b = res.per_model["a"], res.per_model["b"]
    assert (a.p50_s, b.p50_s, a.p99_s, b.p99_s) == pytest.approx((0.040, 0.060, 0.0699, 0.0798), abs=1e-3)
    tight = simulate(one_group("a", "b"), [profile("a"), profile("b")], trace, slo_s=0.045, config=cfg)
    assert (tight.per_model["a"].good, tight.per_model["b"].good) == (3, 1)
    two = Placement((Group((0,), 1, 1, ("a",)), Group((1,), 1, 1, ("a",))))
    only_a = Trace(tuple((0.0, "a") for _ in range(4)), duration_s=1.0)
    # the first two go alone, one to each device (10 ms); the other two as a batch of 2 at 10 ms
    res = simulate(two, [profile("a")], only_a, slo_s=0.015, config=cfg)
    assert res.per_model["a"].good == 2 and res.per_model["a"].p99_s == pytest.approx(0.030)


def test_unplaced_models_are_rejected_and_bad_inputs_name_the_numbers() -> None:
    trace = Trace(((0.0, "a"), (0.1, "b")), duration_s=1.0)
    res = simulate(one_group("a"), [profile("a"), profile("b")], trace, slo_s=1.0)
    assert res.per_model["b"].rejected == 1 and res.attainment == 0.5
    with pytest.raises(PlacementError, match="pp=3 x tp=1 = 3 != 2 devices"):
        Group((0, 1), 3)
    with pytest.raises(PlacementError, match="device 1 is in group 0 and group 1"):
        Placement((Group((0, 1), 2), Group((1,), 1)))
    with pytest.raises(PlacementError, match=r"model 'a' has no latencies for pp=3 tp=1"):
        simulate(one_group("a", pp=3), [profile()], trace, slo_s=1.0)


def test_memory_check_refuses_with_the_numbers() -> None:
    profiles = {"a": profile("a", param_bytes=1000 * MiB), "b": profile("b", param_bytes=1000 * MiB)}
    both_on_one = Placement((Group((0,), 1, 1, ("a", "b")),))
    with pytest.raises(
        PlacementError, match=r"device 0 \(pp=1 tp=1, models a,b\) needs 2000\.0 MiB > 1500\.0 MiB"
    ):
        both_on_one.check_memory(profiles, device_memory_bytes=1500 * MiB)
    split = Placement((Group((0, 1), 2, 1, ("a", "b")),))
    split.check_memory(profiles, device_memory_bytes=1500 * MiB)  # 500 + 500 MiB per device
    assert split.device_bytes(profiles) == {0: 1000 * MiB, 1: 1000 * MiB}
    # uneven stages and an activation allowance (the largest model's, once per device)
    heavy = ModelProfile(
        "c",
        1000 * MiB,
        profile().latency,
        activation_bytes=300 * MiB,
        stage_bytes={(2, 1): (700 * MiB, 300 * MiB)},
    )
    uneven = Group((0, 1), 2, 1, ("a", "c"))
    assert uneven.device_bytes({**profiles, "c": heavy}) == {0: 1500 * MiB, 1: 1100 * MiB}
    assert Placement((uneven,)).to_dict({**profiles, "c": heavy})["groups"][0]["models"] == ["a", "c"]


def test_two_models_thirty_seconds_at_200_rps_simulate_well_under_a_second() -> None:
    trace = steady(("a", "b"), rate=200.0, duration_s=30.0, seed=3).trace()
    placement = Placement((Group((0, 1), 2, 1, ("a", "b")),))
    profiles = [profile("a", single=0.004), profile("b", single=0.004)]
    t0 = time.perf_counter()
    res = simulate(placement, profiles, trace, slo_s=0.05, config=SimConfig(max_batch_size=8))
    elapsed = time.perf_counter() - t0
    assert res.overall.requests == len(trace.requests) > 5000
    assert res.attainment > 0.9  # 200 req/s on a 2-stage pipeline of 2 ms stages
    assert elapsed < 0.5, elapsed


def test_sim_config_reads_the_servers_scheduler_knobs() -> None:
    from shardserve.serving.config import SchedulerConfig

    cfg = SimConfig.from_scheduler(SchedulerConfig(max_batch_size=16, max_inflight_per_replica=3))
    assert (cfg.max_batch_size, cfg.max_inflight, cfg.max_queue_delay_s, cfg.wait_when_idle) == (
        16,
        3,
        0.005,
        False,
    )
    assert SimConfig.from_scheduler(SchedulerConfig(wait_when_idle=True)).wait_when_idle
    server = SimConfig.from_scheduler(SchedulerConfig())
    assert (server.max_batch_size, server.max_inflight) == (
        SimConfig().max_batch_size,
        SimConfig().max_inflight,
    )
    with pytest.raises(PlacementError, match="max_inflight=0 must be an integer >= 1"):
        SimConfig(max_inflight=0)


def test_simulating_imports_no_torch() -> None:
    code = "import sys, shardserve.partitioner.placement; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[3])


def test_the_front_takes_a_burst_one_request_at_a_time_both_ways() -> None:
    """overhead_s = 4 ms: 2 ms in (tokenizing) and 2 ms out (decoding), one request at a time.
    A burst of 3 reaches the queue at 2, 4 and 6 ms; alone on the device (10 ms each, batches of 1):
    done at 12, 22, 32 ms, answered at 14, 24, 34 ms."""
    trace = Trace(((0.0, "a"), (0.0, "a"), (0.0, "a")), duration_s=1.0)
    cfg = SimConfig(max_batch_size=1, max_inflight=1, overhead_s=0.004, admission=False)
    res = simulate(one_group("a"), [profile()], trace, slo_s=0.03, config=cfg)
    a = res.per_model["a"]
    assert (a.good, a.late) == (2, 1) and a.p50_s == pytest.approx(0.024)
    alone = simulate(one_group("a"), [profile()], Trace(((0.0, "a"),), 1.0), slo_s=1.0, config=cfg)
    assert alone.per_model["a"].p50_s == pytest.approx(0.014)  # 2 + 10 + 2 ms


def test_measured_latency_profiles_round_trip_and_bad_files_name_the_problem(tmp_path) -> None:
    lat = LatencyModel({(1, 1): {1: 0.010, 4: 0.030}, (2, 1): {1: (0.006, 0.005)}})
    MeasuredLatency(lat, overhead_s=0.004).write(tmp_path / "p.json")
    back = MeasuredLatency.read(tmp_path / "p.json")
    assert back.overhead_s == 0.004 and back.latency.points(2, 1) == {1: (0.006, 0.005)}
    assert back.latency.stages(1, 1, 2) == lat.stages(1, 1, 2)
    (tmp_path / "bad.json").write_text('{"stages": {"one": {}}}')
    with pytest.raises(PlacementError, match=r"bad\.json: ValueError"):
        MeasuredLatency.read(tmp_path / "bad.json")
    with pytest.raises(PlacementError, match=r"no\.json"):
        MeasuredLatency.read(tmp_path / "no.json")
