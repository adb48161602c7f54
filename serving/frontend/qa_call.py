"""The front end's side of one QA call, shared by the native routes and the Open Inference Protocol.

Both protocols hand their items to ``answer_items``: it calls the engine room's protocol-neutral
``serving.engine.answer.answer_pairs`` with what only the HTTP side knows (the app's engine, whether
the server is shutting down, the settings' text limits, the client's disconnect) and notes the
windows for the access log. Each protocol then shapes the answers, or the ``EngineError``, its way.

    answered = await answer_items(request, body.items, body.timeout_s, locate=name_of_field)

Tests: ``pytest tests/serving/frontend/test_api.py tests/serving/frontend/test_kserve_v2.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fastapi import Request

from serving.engine.answer import Answered, answer_pairs
from serving.frontend.access import disconnect_watcher, note_windows
from serving.frontend.schemas import QAItem


async def answer_items(
    request: Request, items: Sequence[QAItem], timeout_s: float | None, *, locate: Callable[[int, str], str]
) -> Answered:
    """Answer ``items`` (raises ``EngineError``, 499 when the client went away); ``locate(i, field)``
    names item ``i``'s field in a 422 as the protocol's request does."""
    state = request.app.state
    settings = state.settings
    answered = await answer_pairs(
        getattr(state, "engine", None),
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
