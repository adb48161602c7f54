"""The app's start-up heap (``serving/frontend/app.py``): frozen for the garbage collector while any
app of the process serves, handed back when the last one stops.

    python -m pytest tests/serving/frontend/test_app.py -q
"""

from __future__ import annotations

import gc
import weakref

from tests.serving.frontend.api_helpers import serving


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_an_app_that_stops_leaves_a_serving_apps_heap_frozen() -> None:
    """A test process runs apps inside each other (a module's live server, a test's own app): the
    inner one's shutdown once unfroze the whole heap, and a full collection of a late suite's 1.5 M
    objects then paused the outer server for 0.5-1.4 s under load; and only the first app freezes,
    or the garbage the inner apps leave would be frozen with it."""
    gc.unfreeze()
    kept = [[i] for i in range(50_000)]  # long-lived objects made before the apps start
    pair = {"question": "Who?", "context": "Ann met Bob."}
    with serving() as (outer, _):
        assert gc.get_freeze_count() >= len(kept)
        garbage = _Cycle()
        gone = weakref.ref(garbage)
        del garbage  # a cycle only a collection frees, left while the outer app serves
        gc.disable()  # no automatic collection frees it before the inner app's start-up
        try:
            with serving() as (inner, _):
                gc.enable()
                assert inner.post("/v1/qa", json=pair).status_code == 200
        finally:
            gc.enable()
        assert gc.get_freeze_count() >= len(kept), "the inner app's shutdown unfroze the outer app's heap"
        gc.collect()
        assert gone() is None, "the inner app's start-up froze garbage: never collected while the outer serves"
        assert outer.post("/v1/qa", json=pair).status_code == 200
    assert gc.get_freeze_count() == 0, "the last app's shutdown leaves the heap frozen"
    del kept


def test_a_stopped_app_is_freed() -> None:
    """Nothing of the process keeps a stopped app (its engine, tokenizer and model: ~35 MB) alive:
    FastAPI's module-level caches of what it learnt of each endpoint once held every app whose
    endpoints closed over it, and a test process grew to 7 GB."""
    with serving() as (client, _):
        assert client.post("/v1/qa", json={"question": "Who?", "context": "Ann met Bob."}).status_code == 200
        app = weakref.ref(client.app)
    del client
    gc.collect()
    assert app() is None, "a stopped app is still referenced"
