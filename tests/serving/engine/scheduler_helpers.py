"""Helpers the scheduler tests share (tests/serving/engine/test_scheduler_*.py): a ``Scheduler`` with
small limits driven by a fake clock (plain floats for ``now``), one replica view, and a submit that
must be accepted. Not a test module itself (its asserts are rewritten: tests/conftest.py)."""

from __future__ import annotations

from shardserve.serving.config import SchedulerConfig
from shardserve.serving.engine.batcher import ReplicaView
from shardserve.serving.engine.scheduler import Scheduler

R0 = ReplicaView("r0")


def make(**overrides: object) -> Scheduler:
    """Small limits; dyadic delays so the fake-clock arithmetic is exact. An idle replica waits for
    the delay here (``wait_when_idle``), so the release rules are seen one at a time; the default,
    an idle replica taking what is queued at once, has its own tests (test_scheduler_batching.py)."""
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
