"""Load scenarios as PURE LOGIC: how many locust users run at time t, and when open-loop arrivals fire.

The locust load shape in ``loadtest/locustfile.py`` asks a :class:`Scenario` for the user count at
each tick; nothing here imports locust or gevent, so it is testable in-process::

    sc = make_scenario(ScenarioConfig(name="step", duration_s=60, peak_users=6))
    sc.users_at(10.0)   # -> 1 (low), 30.0 -> 6 (step up), 50.0 -> 1 (step down)

Scenarios (``duration_s`` = D, ``peak_users`` = P, ``low_users`` = L):

- ``steady``:    P users for D seconds (closed loop: each user sends, waits for the answer, thinks).
- ``step``:      L users until ``step_up_at`` x D (default 25%), P users until ``step_down_at`` x D
                 (60%), then back to L: a step up and a step down, the load that exercises the
                 autoscaler both ways.
- ``bursty``:    open loop: requests arrive as a Gamma renewal process of ``rate_rps`` with a
                 coefficient of variation ``cv`` > 1 (AlpaServe's bursty workload); a pool of P users
                 picks up the arrivals (a late pickup is logged as lag when all P are busy).
- ``ramp-down``: from P users down to L linearly over D (drain behaviour).

Tests: ``tests/loadtest/test_scenarios.py``.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)

SCENARIOS = ("steady", "step", "bursty", "ramp-down")


@dataclass(frozen=True)
class ScenarioConfig:
    """One scenario's knobs; validated once, errors print the numbers."""

    name: str = "steady"
    duration_s: float = 30.0
    peak_users: int = 4
    low_users: int = 1
    think_time_s: float = 0.0  # closed-loop scenarios: pause between a user's requests
    rate_rps: float = 10.0  # bursty: mean arrival rate
    cv: float = 3.0  # bursty: coefficient of variation of inter-arrival times
    step_up_at: float = 0.25  # step: fraction of the duration where the load steps up
    step_down_at: float = 0.60  # step: ... and where it steps back down
    seed: int = 0

    def __post_init__(self) -> None:
        problems = []
        if self.name not in SCENARIOS:
            problems.append(f"name={self.name!r} is not one of {SCENARIOS}")
        if not self.duration_s > 0:
            problems.append(f"duration_s={self.duration_s!r} must be > 0")
        for field in ("peak_users", "low_users"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{field}={value!r} must be an integer >= 1")
        if not problems and self.low_users > self.peak_users:
            problems.append(f"low_users={self.low_users} > peak_users={self.peak_users}")
        if self.think_time_s < 0:
            problems.append(f"think_time_s={self.think_time_s!r} must be >= 0")
        if not self.rate_rps > 0:
            problems.append(f"rate_rps={self.rate_rps!r} must be > 0")
        if not self.cv > 0:
            problems.append(f"cv={self.cv!r} must be > 0")
        elif self.name == "bursty" and not self.cv > 1:
            problems.append(f"cv={self.cv!r} must be > 1 for the bursty scenario (burstier than Poisson)")
        if not 0 < self.step_up_at < self.step_down_at < 1:
            problems.append(
                f"step_up_at={self.step_up_at!r}, step_down_at={self.step_down_at!r}: "
                "need 0 < step_up_at < step_down_at < 1"
            )
        if problems:
            raise ValueError("invalid ScenarioConfig: " + "; ".join(problems))

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class Scenario:
    """User count over time for one :class:`ScenarioConfig`; ``None`` once the run is over."""

    def __init__(self, config: ScenarioConfig) -> None:
        self.config = config

    @property
    def open_loop(self) -> bool:
        """True when arrivals follow a clock (bursty) instead of users' own request loops."""
        return self.config.name == "bursty"

    def users_at(self, t: float) -> int | None:
        """Users that should be running ``t`` seconds after the start; None when the run is over."""
        c = self.config
        if t < 0:
            raise ValueError(f"t={t} must be >= 0")
        if t >= c.duration_s:
            return None
        if c.name in ("steady", "bursty"):
            return c.peak_users
        if c.name == "step":
            up, down = self.phase_times()
            return c.peak_users if up <= t < down else c.low_users
        # ramp-down: linear from peak to low over the duration
        frac = t / c.duration_s
        return max(c.low_users, round(c.peak_users - frac * (c.peak_users - c.low_users)))

    def phase_times(self) -> list[float]:
        """Times (s) where the load level changes: the step edges, for plots and checks."""
        if self.config.name != "step":
            return []
        c = self.config
        return [c.step_up_at * c.duration_s, c.step_down_at * c.duration_s]


def make_scenario(config: ScenarioConfig) -> Scenario:
    """The :class:`Scenario` for a validated config."""
    return Scenario(config)


class GammaArrivals:
    """Arrival times of a Gamma renewal process: mean gap 1/rate, gap CV ``cv`` (shape 1/cv²).

    cv = 1 is a Poisson process; cv > 1 clusters arrivals into bursts separated by lulls.
    Times are seconds from the start; deterministic for a seed.
    """

    def __init__(self, *, rate_rps: float, cv: float, seed: int = 0) -> None:
        if not rate_rps > 0 or not cv > 0:
            raise ValueError(f"rate_rps={rate_rps} and cv={cv} must both be > 0")
        self.rate_rps = rate_rps
        self.cv = cv
        self.shape = 1.0 / (cv * cv)
        self.scale = 1.0 / (rate_rps * self.shape)  # mean = shape * scale = 1 / rate
        self._rng = random.Random(seed)
        self._t = 0.0

    def next_gap(self) -> float:
        return self._rng.gammavariate(self.shape, self.scale)

    def next_time(self) -> float:
        """The next arrival time (s from the start); each call claims one arrival."""
        self._t += self.next_gap()
        return self._t


def coefficient_of_variation(values: list[float]) -> float:
    """Sample standard deviation / mean (NaN with fewer than two values or a zero mean)."""
    if len(values) < 2:
        return math.nan
    mean = sum(values) / len(values)
    if mean == 0:
        return math.nan
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return math.sqrt(var) / mean
