"""Helpers the HTTP API tests share (tests/serving/frontend/test_api*.py and the modules that drive a
server the same way: grpc/, http/, rest/, status/, v2/, fleet/, engine/test_core_server.py, ...): the
question and context every test asks, the admin token, ``serving(...)`` (a started app on fake
in-process gangs, ``partitioner/runtime/fake_gang.py``), ``ask``, ``wait_until`` and the failing
worker's traceback. Not a test module itself."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi.testclient import TestClient

from shardserve.partitioner.runtime.fake_gang import FakeFactory
from shardserve.serving.frontend.app import build_app
from shardserve.serving.frontend.settings import ServeSettings

CONTEXT = (
    "Super Bowl 50 was an American football game to determine the champion of the National Football "
    "League (NFL) for the 2015 season. The Denver Broncos defeated the Carolina Panthers 24–10 to earn "
    "their third Super Bowl title. The game was played on February 7, 2016, at Levi's Stadium."
)
QUESTION = "Which team won Super Bowl 50?"
TOKEN = "s3cret-token"


def wait_until(
    cond: Callable[[], Any],
    *,
    timeout: float = 10.0,
    what: str = "condition",
    detail: Callable[[], object] | None = None,
) -> Any:
    """``cond()`` once it is truthy; an AssertionError after ``timeout`` s (with ``detail()``: the
    state that explains why, e.g. a server's /readyz body)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.01)
    why = f": {detail()}" if detail is not None else ""
    raise AssertionError(f"timed out after {timeout} s waiting for {what}{why}")


def wait_busy(client: TestClient) -> None:
    """Until the server's first replica has a batch in flight (its only slot held)."""
    wait_until(lambda: client.app.state.manager.routable()[0].inflight_batches == 1, what="busy replica")


@contextlib.contextmanager
def serving(factory: FakeFactory | None = None, **overrides: Any) -> Iterator[tuple[TestClient, FakeFactory]]:
    """A started app on fake gangs, ready to answer."""
    factory = factory or FakeFactory()
    kw: dict[str, Any] = {
        "model": "tiny-bert",
        "max_queue_delay_ms": 1.0,
        "restart_backoff_s": 0.05,
        "drain_timeout_s": 5.0,
        "admin_token": TOKEN,
    }
    kw.update(overrides)
    if not {"replicas", "min_replicas", "max_replicas", "threads_per_rank"} & set(kw):
        kw["replicas"] = 1  # the tests count on one fake gang (the default sizes to the machine's cores)
    app = build_app(ServeSettings(**kw), backend_factory=factory)
    with TestClient(app) as client:
        wait_until(lambda: client.get("/readyz").status_code == 200, what="readiness")
        try:
            yield client, factory
        finally:
            factory.gate.set()


def ask(client: TestClient, question: str = QUESTION, context: str = CONTEXT, **extra: Any) -> Any:
    return client.post("/v1/qa", json={"question": question, "context": context, **extra})


def _submit_async(client: TestClient, pool: ThreadPoolExecutor, n: int, **extra: Any) -> list:
    return [pool.submit(ask, client, **extra) for _ in range(n)]


WORKER_TRACEBACK = (
    "gang-r1: rank 0 (stage 0, tp 0) failed while starting:\n"
    "Traceback (most recent call last):\n"
    '  File "/usr/lib/python3/site-packages/partitioner/worker.py", line 190, in worker_main\n'
    "    program(ctx, queues, ready=ready)\n"
    "shardserve.models.hf_weights.CheckpointError: /srv/models/secret-run/final: no weights found"
)
