"""Scenario shapes and the Gamma arrival clock (pure logic, no locust).

python -m pytest tests/loadtest/test_scenarios.py -q
"""

from __future__ import annotations

import itertools

import pytest

from shardserve.loadtest.scenarios import (
    GammaArrivals,
    Scenario,
    ScenarioConfig,
    coefficient_of_variation,
)


def test_steady_holds_peak_then_stops() -> None:
    sc = Scenario(ScenarioConfig(name="steady", duration_s=10, peak_users=3))
    assert [sc.users_at(t) for t in (0.0, 5.0, 9.99)] == [3, 3, 3]
    assert sc.users_at(10.0) is None


def test_step_goes_low_peak_low() -> None:
    sc = Scenario(ScenarioConfig(name="step", duration_s=40, peak_users=6, low_users=1))
    assert [sc.users_at(t) for t in (0, 9.9, 10, 23.9, 24, 39.9)] == [1, 1, 6, 6, 1, 1]
    assert sc.phase_times() == [10.0, 24.0]
    custom = Scenario(
        ScenarioConfig(name="step", duration_s=10, peak_users=2, step_up_at=0.1, step_down_at=0.5)
    )
    assert [custom.users_at(t) for t in (0.5, 1.0, 4.9, 5.0)] == [1, 2, 2, 1]


def test_ramp_down_is_monotone_from_peak_to_low() -> None:
    sc = Scenario(ScenarioConfig(name="ramp-down", duration_s=10, peak_users=8, low_users=2))
    users = [sc.users_at(t / 2) for t in range(20)]
    assert users[0] == 8 and users[-1] == 2
    assert all(a >= b for a, b in itertools.pairwise(users))


def test_bursty_is_open_loop_and_requires_cv_above_one() -> None:
    assert Scenario(ScenarioConfig(name="bursty", cv=2.0)).open_loop
    assert not Scenario(ScenarioConfig(name="steady")).open_loop
    with pytest.raises(ValueError, match=r"cv=1\.0 must be > 1"):
        ScenarioConfig(name="bursty", cv=1.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "spike"}, "name='spike'"),
        ({"duration_s": 0}, "duration_s=0"),
        ({"peak_users": 2, "low_users": 3}, "low_users=3 > peak_users=2"),
        ({"peak_users": 0}, "peak_users=0"),
        ({"rate_rps": -1.0}, "rate_rps=-1.0"),
        ({"step_up_at": 0.7, "step_down_at": 0.6}, "step_up_at=0.7, step_down_at=0.6"),
    ],
)
def test_config_errors_name_the_numbers(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ScenarioConfig(**kwargs)


@pytest.mark.parametrize("cv", [1.0, 3.0])
def test_gamma_arrivals_have_the_requested_rate_and_cv(cv: float) -> None:
    clock = GammaArrivals(rate_rps=20.0, cv=cv, seed=1)
    times = [clock.next_time() for _ in range(40_000)]
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert times == sorted(times)
    assert len(gaps) / times[-1] == pytest.approx(20.0, rel=0.05)
    assert coefficient_of_variation(gaps) == pytest.approx(cv, rel=0.08)


def test_gamma_arrivals_are_deterministic_per_seed() -> None:
    a = GammaArrivals(rate_rps=5, cv=2, seed=7)
    b = GammaArrivals(rate_rps=5, cv=2, seed=7)
    c = GammaArrivals(rate_rps=5, cv=2, seed=8)
    ta = [a.next_time() for _ in range(5)]
    assert ta == [b.next_time() for _ in range(5)]
    assert ta != [c.next_time() for _ in range(5)]
