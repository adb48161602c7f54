"""Tests for serving/fleet/autoscaler.py: the scaling policy on a fake clock, and pipeline_capacity.

Run: python -m pytest tests/serving/fleet/test_autoscaler.py -q
"""

from __future__ import annotations

import pytest

from shardserve.serving.config import AutoscalingConfig
from shardserve.serving.fleet.autoscaler import Autoscaler, Decision, pipeline_capacity


def make(**overrides: object) -> Autoscaler:
    """target 2 per replica, margin 0.75 (down-scale threshold 1.5 per replica), ticks of 1 s
    with a look-back shorter than a tick, so each decision sees only the latest sample."""
    kw: dict[str, object] = {
        "min_replicas": 1,
        "max_replicas": 5,
        "target_ongoing_requests": 2.0,
        "upscale_delay_s": 10.0,
        "downscale_delay_s": 20.0,
        "look_back_period_s": 0.5,
        "downscale_margin": 0.75,
    }
    kw.update(overrides)
    return Autoscaler(AutoscalingConfig(**kw))  # type: ignore[arg-type]


def tick(
    a: Autoscaler, t: float, load: float, current: int, *, pending: int = 0, pool: int | None = None
) -> int:
    a.observe(
        t,
        ongoing_requests=load,
        current_replicas=current,
        pending_replicas=pending,
        max_replicas_allowed_by_device_pool=pool,
    )
    return a.decide(t).target


def run(a: Autoscaler, loads: list[float], *, start: int, pool: int | None = None) -> list[int]:
    """Apply each decision at once (a perfect driver); return the target after every 1 s tick."""
    current, targets = start, []
    for t, load in enumerate(loads):
        current = tick(a, float(t), load, current, pool=pool)
        targets.append(current)
    return targets


def test_scale_up_only_after_upscale_delay() -> None:
    a = make()
    targets = run(a, [5.0] * 12, start=1)  # ceil(5 / 2) = 3 wanted from t=0
    assert targets == [1] * 10 + [3, 3]
    assert a.counts == {"up": 1, "down": 0}


def test_upscale_wait_restarts_when_load_dips() -> None:
    a = make()
    loads = [5.0] * 9 + [1.0] + [5.0] * 12  # dip at t=9: the wish from t=0 is forgotten
    targets = run(a, loads, start=1)
    assert targets.index(3) == 20  # wish restarted at t=10, applied 10 s later
    assert targets[:20] == [1] * 20


def test_pending_replicas_count_as_provisioned() -> None:
    a = make(upscale_delay_s=0.0)
    assert tick(a, 0.0, 5.0, 1) == 3
    d = a.decide(0.0)
    assert d.target == 3  # still wants 3; nothing is pending yet
    assert tick(a, 1.0, 5.0, 1, pending=2) == 3
    assert a.decide(1.0).reason.startswith("hold at 3")


def test_scale_down_only_after_downscale_delay() -> None:
    a = make()
    targets = run(a, [0.5] * 22, start=3)  # ceil(0.5 / 1.5) = 1 wanted from t=0
    assert targets == [3] * 20 + [1, 1]
    assert a.counts == {"up": 0, "down": 1}


def test_bounds_and_device_pool_limit() -> None:
    a = make(upscale_delay_s=0.0, downscale_delay_s=0.0, min_replicas=2)
    assert run(a, [100.0], start=2) == [5]  # max_replicas
    a = make(upscale_delay_s=0.0, downscale_delay_s=0.0, min_replicas=2)
    assert run(a, [100.0], start=2, pool=3) == [3]  # pool limit
    a = make(upscale_delay_s=0.0, downscale_delay_s=0.0, min_replicas=2)
    assert run(a, [0.0, 0.0], start=3) == [2, 2]  # min_replicas


def test_out_of_bounds_corrected_without_delay() -> None:
    a = make(min_replicas=2)
    assert tick(a, 0.0, 0.0, 0) == 2  # a gang died: back to min at once
    assert a.decide(0.0).reason.startswith("scale up: 0 replicas below the lower bound 2")
    assert tick(a, 1.0, 9.0, 5, pool=3) == 3  # pool shrank under 5 replicas
    assert a.counts == {"up": 2, "down": 1}


def test_no_observation_gives_min() -> None:
    assert make(min_replicas=2).decide(0.0) == Decision(2, "no observations yet")


def test_look_back_average() -> None:
    loads = [2.0, 4.0, 6.0, 8.0, 10.0]  # t = 0..4
    a = make(look_back_period_s=10.0, upscale_delay_s=0.0)
    assert run(a, loads[:4], start=4) == [4, 4, 4, 4]  # means 2, 3, 4, 5 -> at most 3 wanted
    assert tick(a, 4.0, loads[4], 4) == 4  # mean 6 -> ceil(6 / 2) = 3 <= 4: hold
    a = make(look_back_period_s=2.0, upscale_delay_s=0.0)
    assert run(a, loads, start=1)[-1] == 4  # t=2..4: mean 8 -> 4


def test_fast_oscillation_around_threshold_does_not_flap() -> None:
    a = make()
    loads = ([3.5] * 5 + [4.5] * 5) * 10  # ceil(4.5 / 2) = 3 wanted, never for 10 s in a row
    assert run(a, loads, start=2) == [2] * 100
    assert a.counts == {"up": 0, "down": 0}


@pytest.mark.parametrize(("margin", "ups", "downs"), [(0.75, 1, 0), (1.0, 3, 3)])
def test_dead_band_prevents_flapping_on_slow_oscillation(margin: float, ups: int, downs: int) -> None:
    # 30 s at 4.5 (wants 3 replicas), 30 s at 3.5 (2 replicas would do at margin 1.0, but at
    # margin 0.75 three replicas are needed: ceil(3.5 / 1.5) = 3, so no scale-down).
    a = make(downscale_margin=margin)
    loads = ([4.5] * 30 + [3.5] * 30) * 3
    targets = run(a, loads, start=2)
    assert a.counts == {"up": ups, "down": downs}
    if margin == 0.75:
        assert targets == [2] * 10 + [3] * 170


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"min_replicas": 3, "max_replicas": 2}, "min_replicas=3 > max_replicas=2"),
        ({"min_replicas": 0}, "min_replicas=0 must be"),
        ({"target_ongoing_requests": 0.0}, r"target_ongoing_requests=0.0 must be > 0"),
        ({"upscale_delay_s": -1.0}, r"upscale_delay_s=-1.0 must be >= 0"),
        ({"look_back_period_s": 0.0}, r"look_back_period_s=0.0 must be > 0"),
        ({"downscale_margin": 1.5}, r"downscale_margin=1.5 must be in \(0, 1\]"),
    ],
)
def test_config_validation_prints_numbers(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(**overrides)


def test_observe_rejects_negative_values() -> None:
    with pytest.raises(ValueError, match="pending_replicas=-1"):
        make().observe(0.0, ongoing_requests=1, current_replicas=1, pending_replicas=-1)


@pytest.mark.parametrize(
    ("latencies", "slo", "capacity"),
    [
        ([0.25, 0.5, 0.25], 0.75, 0),  # one request needs 1.0 s
        ([0.25, 0.5, 0.25], 1.0, 1),
        ([0.25, 0.5, 0.25], 1.49, 1),
        ([0.25, 0.5, 0.25], 1.5, 2),
        ([0.25, 0.5, 0.25], 2.0, 3),
        ([0.1, 0.2], 0.3, 1),  # 0.1 + 0.2 > 0.3 in binary floating point
        ([0.1, 0.1, 0.1, 0.1], 1.0, 7),  # 0.4 + 6 * 0.1 = 1.0
    ],
)
def test_pipeline_capacity(latencies: list[float], slo: float, capacity: int) -> None:
    assert pipeline_capacity(latencies, slo) == capacity


def test_pipeline_capacity_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match=r"\[\]"):
        pipeline_capacity([], 1.0)
    with pytest.raises(ValueError, match="slo_s=0"):
        pipeline_capacity([0.1], 0)
