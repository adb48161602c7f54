"""Server settings that depend on the machine: auto-sizing of replicas x threads, and the dtype.

python -m pytest tests/serving/test_settings.py -q
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serving import settings as settings_mod
from serving.settings import ServeSettings


@pytest.fixture
def cores(monkeypatch):
    def use(n: int) -> None:
        monkeypatch.setattr(settings_mod, "available_cores", lambda: n)

    return use


@pytest.mark.parametrize(
    ("n_cores", "pp", "tp", "replicas", "threads"),
    [(2, 1, 1, 2, 1), (2, 2, 1, 1, 1), (8, 2, 1, 4, 1), (1, 2, 1, 1, 1), (16, 2, 2, 4, 1)],
)
def test_no_flags_sizes_one_rank_per_core(cores, n_cores, pp, tp, replicas, threads):
    cores(n_cores)
    s = ServeSettings(pp=pp, tp=tp)
    assert s.auto_sized
    assert s.replica_bounds == (replicas, replicas)
    assert s.rank_threads == threads
    assert not s.autoscaling


@pytest.mark.parametrize(
    ("flags", "bounds", "threads"),
    [
        (dict(replicas=1), (1, 1), 8),  # one replica: its rank gets every core
        (dict(threads_per_rank=2), (1, 1), 2),
        (dict(min_replicas=1, max_replicas=4), (1, 4), 2),  # threads sized for the largest fleet
    ],
)
def test_explicit_flags_win(cores, flags, bounds, threads):
    cores(8)
    s = ServeSettings(**flags)
    assert not s.auto_sized
    assert s.replica_bounds == bounds
    assert s.rank_threads == threads


def test_dtype_is_validated_with_the_choices():
    assert ServeSettings().dtype == "auto"
    with pytest.raises(ValidationError, match="dtype='int8' must be one of auto, float32, bfloat16, float16"):
        ServeSettings(dtype="int8")
