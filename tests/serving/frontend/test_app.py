"""The app's start-up heap (``serving/frontend/app.py``): frozen for the garbage collector while any
app of the process serves, handed back when the last one stops.

    python -m pytest tests/serving/frontend/test_app.py -q
"""

from __future__ import annotations

import gc

from tests.serving.frontend.test_api import serving


def test_an_app_that_stops_leaves_a_serving_apps_heap_frozen() -> None:
    """A test process runs apps inside each other (a module's live server, a test's own app): the
    inner one's shutdown once unfroze the whole heap, and a full collection of a late suite's 1.5 M
    objects then paused the outer server for 0.5-1.4 s under load."""
    gc.unfreeze()
    kept = [[i] for i in range(50_000)]  # long-lived objects made before the apps start
    pair = {"question": "Who?", "context": "Ann met Bob."}
    with serving() as (outer, _):
        frozen = gc.get_freeze_count()
        assert frozen >= len(kept)
        with serving() as (inner, _):
            assert inner.post("/v1/qa", json=pair).status_code == 200
        assert gc.get_freeze_count() >= frozen, "the inner app's shutdown unfroze the outer app's heap"
        assert outer.post("/v1/qa", json=pair).status_code == 200
    assert gc.get_freeze_count() == 0, "the last app's shutdown leaves the heap frozen"
    del kept
