"""The front end's side of one QA call, shared by the native routes and the Open Inference Protocol.

Both protocols hand their items to ``answer_items``: it calls the engine room's protocol-neutral
``serving.engine.answer.answer_pairs`` with what only the HTTP side knows (the engine of the model
asked for, from the app's model repository; whether the server is shutting down, the settings' text
limits, the client's disconnect) and notes the model and the windows for the access log and the
metrics. Each protocol then shapes the answers, or the ``EngineError``, its way.

    answered = await answer_items(request, body.items, body.timeout_s, model="b", locate=name_of_field)

Tests: ``pytest tests/serving/frontend/test_api.py tests/serving/frontend/test_kserve_v2.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fastapi import Request

from serving.engine.answer import Answered, answer_pairs
from serving.engine.core import Engine
from serving.frontend.access import disconnect_watcher, note_windows
from serving.frontend.schemas import QAItem


async def answer_items(
    request: Request,
    items: Sequence[QAItem],
    timeout_s: float | None,
    *,
    model: str | None,
    locate: Callable[[int, str], str],
) -> Answered:
    """Answer ``items`` with ``model`` (None: the default one; raises ``EngineError``: 404 for a model
    not served, 499 when the client went away); ``locate(i, field)`` names item ``i``'s field in a 422
    as the protocol's request does."""
    state = request.app.state
    settings = state.settings
    engine = engine_for(request, model)
    answered = await answer_pairs(
        engine,
        [it.pair() for it in items],
        timeout_s=timeout_s,
        max_context_chars=settings.max_context_chars,
        max_question_chars=settings.max_question_chars,
        stopping=state.shutting_down,
        locate=locate,
        disconnected=disconnect_watcher(request),
    )
    note_windows(request, sum(r.windows for r in answered.results))
    return answered


def engine_for(request: Request, model: str | None) -> Engine | None:
    """The engine of ``model`` (None: the default), or None while the server starts; EngineError 404 /
    503 for a model not served. Names the model for the access log and the metrics' ``model`` label."""
    models = getattr(request.app.state, "models", None)
    if models is None:
        return None
    request.state.model = model or models.default_name or ""
    engine = models.engine(model)
    request.state.model = engine.name
    return engine
