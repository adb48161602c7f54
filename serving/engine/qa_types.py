"""The request, answer and error types the QA serving path passes between its parts.

Owns the vocabulary shared by the HTTP routes and the engine's parts (input processor, dispatcher,
output processor): one ``QAPair`` in, one ``PairResult`` out, the engine core's ``CoreAnswer`` between (a request's
logits, decoded by its client), and the two ways a request ends
without answers (``EngineError`` with its HTTP status, ``ClientGone``). Plain data, no logic, so
every part imports it without importing any other. ``EngineError`` is defined in ``serving/errors.py``
(the fleet's model repository raises it too) and handed on here.

    pair = QAPair("Who?", "Ann met Bob.", top_k=3)
    raise EngineError(429, "queue_full", "256 requests queued", retry_after_s=2)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardserve.models.qa_decoding import QAPrediction
from shardserve.serving.errors import EngineError

__all__ = ["ClientGone", "EngineError", "PairResult", "QAPair"]


class ClientGone(Exception):
    """The client disconnected; its work was cancelled."""


@dataclass(frozen=True)
class QAPair:
    """One question about one context, with its decoding options."""

    question: str
    context: str
    top_k: int = 1
    max_answer_length: int = 30
    null_threshold: float | None = None  # this pair's no-answer threshold; None: the server's


@dataclass(frozen=True)
class PairResult:
    """The decoded answer(s) of one pair and how many windows its context needed."""

    prediction: QAPrediction
    windows: int


@dataclass(frozen=True)
class CoreAnswer:
    """What the engine core answers an admitted request: its windows' logits, in window order, and
    the seconds of its ``queue`` and ``compute_infer`` phases."""

    logits: list[torch.Tensor]  # per window: (n_tokens, 2)
    queue_s: float
    infer_s: float
