"""The protocol-neutral "answer these pairs" call: what every QA route of every protocol comes down to.

Owns the order of one call: check each pair against the text limits (``validate_qa_inputs``), refuse
while the server is starting or stopping (503), admit and tokenize (``EngineClient.submit_async``:
429 / 413 before the work), wait for the answers (504 past the deadline; the client disconnecting
cancels the queued work: 499). Every way it can fail is an ``EngineError`` with its HTTP status and
a detail naming the field (``locate``: how the protocol names pair ``i``'s field); each protocol
(``serving/frontend/rest/routes.py``, ``serving/frontend/v2/routes.py``) shapes the answer.

    answered = await answer_pairs(client, [QAPair("Who?", "Ann met Bob.")], timeout_s=None,
                                  max_context_chars=100_000, max_question_chars=2_000)
    answered.results            # list[PairResult], in pair order

Tests: ``pytest tests/serving/frontend/test_api.py tests/serving/frontend/v2/test_routes.py``; bad
input: ``pytest tests/serving/frontend/test_api_inputs.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shardserve.models.qa_windows import QAInputError, validate_qa_inputs
from shardserve.serving.engine.client import EngineClient
from shardserve.serving.engine.qa_types import ClientGone, EngineError, PairResult, QAPair

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Answered:
    """The answers of one call, and who answered them."""

    results: list[PairResult]  # in pair order
    model_name: str  # the public name of the model that answered
    job_id: str  # the engine's id of the call


def _plain_field(i: int, field: str) -> str:
    return field


async def answer_pairs(
    client: EngineClient | None,
    pairs: Sequence[QAPair],
    *,
    timeout_s: float | None,
    max_context_chars: int,
    max_question_chars: int,
    stopping: bool = False,
    locate: Callable[[int, str], str] = _plain_field,
    disconnected: Callable[[], Awaitable[Any]] | None = None,
) -> Answered:
    """Validate, admit and answer ``pairs`` (see module doc). ``client``: None while starting;
    ``stopping``: the server is shutting down; ``locate(i, field)`` names pair ``i``'s field in a 422
    (``items[1].context: yields no tokens``). Raises ``EngineError``."""
    for i, p in enumerate(pairs):
        try:
            validate_qa_inputs(
                p.question,
                p.context,
                top_k=p.top_k,
                max_answer_length=p.max_answer_length,
                max_context_chars=max_context_chars,
                max_question_chars=max_question_chars,
                null_threshold=p.null_threshold,
            )
        except QAInputError as err:
            raise EngineError(422, "invalid_input", f"{locate(i, err.field)}: {err.reason}") from err
    if stopping or client is None:
        raise EngineError(503, "shutting_down" if stopping else "starting", "the server is not serving")
    try:
        request = await client.submit_async(list(pairs), timeout_s=timeout_s)
    except QAInputError as err:  # found while tokenizing: ``err.pair`` says which pair, when several
        where = err.field if err.pair is None else locate(err.pair, err.field)
        raise EngineError(422, "invalid_input", f"{where}: {err.reason}") from err
    except (TypeError, ValueError) as err:  # the tokenizer refused the text
        logger.info("tokenizer rejected a request: %s", err)
        raise EngineError(422, "invalid_input", f"the text cannot be tokenized: {err}") from err
    try:
        results = await client.wait(request, disconnected=disconnected)
    except ClientGone as err:
        raise EngineError(499, "client_closed_request", "the client disconnected") from err
    return Answered(results=results, model_name=client.name, job_id=request.request_id)
