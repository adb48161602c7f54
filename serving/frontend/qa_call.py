"""The front end's side of one QA call, shared by the native routes, the Open Inference Protocol and gRPC.

``answer_for`` calls the engine room's protocol-neutral ``shardserve.serving.engine.answer.answer_pairs`` with
what the app knows (the settings' text limits, whether the server is shutting down); gRPC calls it
directly. The HTTP routes hand their items to ``answer_items``, which adds what only HTTP knows (the
client of the model asked for, ``app.state.clients``: a ``LocalClients`` in the server's own
process, the ``RemoteRepository`` in an API process; the client's disconnect) and notes
the model and the windows for the access log and the metrics. Each protocol then shapes the
answers, or the ``EngineError``, its way.

    answered = await answer_items(request, body.items, body.timeout_s, model="b", locate=name_of_field)
    answered = await answer_for(app.state, client, pairs, timeout_s=None, locate=name_of_field)
    limits = client_limits(settings)          # ClientLimits of the serve settings

Tests: ``pytest tests/serving/frontend/test_api.py tests/serving/frontend/v2/test_routes.py``; bad
input: ``pytest tests/serving/frontend/test_api_inputs.py``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import Request

from shardserve.serving.engine.answer import Answered, answer_pairs
from shardserve.serving.engine.client import ClientLimits, EngineClient
from shardserve.serving.engine.qa_types import QAPair
from shardserve.serving.frontend.http.access import disconnect_watcher, note_windows
from shardserve.serving.frontend.schemas import QAItem


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
    client = client_for(request, model)
    answered = await answer_for(
        request.app.state,
        client,
        [it.pair() for it in items],
        timeout_s=timeout_s,
        locate=locate,
        disconnected=disconnect_watcher(request),
    )
    note_windows(request, sum(r.windows for r in answered.results))
    return answered


async def answer_for(
    state: Any,
    client: EngineClient | None,
    pairs: Sequence[QAPair],
    *,
    timeout_s: float | None,
    locate: Callable[[int, str], str],
    disconnected: Callable[[], Awaitable[Any]] | None = None,
) -> Answered:
    """``answer_pairs`` with the app's settings' text limits, refused while the app (``state``: its
    ``app.state``) is shutting down; raises ``EngineError``."""
    settings = state.settings
    return await answer_pairs(
        client,
        pairs,
        timeout_s=timeout_s,
        max_context_chars=settings.max_context_chars,
        max_question_chars=settings.max_question_chars,
        stopping=state.shutting_down,
        locate=locate,
        disconnected=disconnected,
    )


def client_for(request: Request, model: str | None) -> EngineClient | None:
    """The client of ``model`` (None: the default), or None while the server starts; EngineError 404 /
    503 for a model not served. Names the model for the access log and the metrics' ``model`` label."""
    clients = getattr(request.app.state, "clients", None)
    if clients is None:
        return None
    request.state.model = model or clients.default_name or ""
    client = clients.client(model)
    request.state.model = client.name
    return client


def client_limits(settings: Any) -> ClientLimits:
    """The serve settings' numbers every model's client needs (``ServeSettings``)."""
    scheduler = settings.scheduler_config()
    return ClientLimits(
        window=settings.window(),
        context_cache_bytes=settings.context_cache_bytes,
        null_threshold=settings.null_threshold,
        max_windows_per_request=scheduler.max_windows_per_request,
        default_deadline_s=scheduler.default_deadline_s,
        stall_timeout_s=settings.fleet_config().stall_timeout_s,
    )
