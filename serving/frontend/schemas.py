"""HTTP request / response models of the QA server (pydantic 2; they are the OpenAPI schema at /docs).

Requests are strict: a wrong JSON type (``"top_k": "3"``) or an unknown field is a 422 with the
offending location, never a silent coercion. Text limits that depend on settings (context length)
are checked by the routes with ``shardserve.models.qa_windows.validate_qa_inputs``.

No answer (SQuAD 2.0): when a ``null_threshold`` applies (the request's own, else the server's
``--null-threshold``) and the model prefers to abstain, ``no_answer`` is true and ``answers`` is
EMPTY; without any threshold ``no_answer`` is always false. Scores: ``models/qa_windows.py``.

    QARequest.model_validate({"question": "Who?", "context": "Ann met Bob."})
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from shardserve.models.qa_windows import MAX_ANSWER_LENGTH_RANGE, NULL_THRESHOLD_RANGE, TOP_K_RANGE
from shardserve.serving.engine.qa_types import PairResult, QAPair

_STRICT = ConfigDict(strict=True, extra="forbid")
# one character that is neither whitespace nor a control character (tokenizers drop both): the
# OpenAPI ``pattern`` of question / context, and what ``_not_blank`` checks (the same regex)
PRINTABLE = r"[^\s\x00-\x1f\x7f-\x9f]"
_NOT_BLANK = {"pattern": PRINTABLE}


def _whole_number(value: Any) -> Any:
    """JSON Schema ``integer`` admits ``2.0`` (a number with no fraction): accept it as ``2``."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


JsonInt = Annotated[int, BeforeValidator(_whole_number)]
"""A strict int that, like JSON Schema's ``integer``, also takes whole floats; never ``"3"``/``true``."""


def _not_blank(value: str, name: str) -> str:
    if not re.search(PRINTABLE, value):
        raise ValueError(f"{name} is empty, or whitespace / control characters only ({len(value)} chars)")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:  # a JSON escape like "\ud800": valid JSON, not valid Unicode text
        raise ValueError(f"{name} is not valid Unicode: {err.reason} at character {err.start}") from None
    return value


class QAItem(BaseModel):
    """One (question, context) pair with its decoding options."""

    model_config = _STRICT

    question: str = Field(
        min_length=1,
        description="the question (non-empty, not only whitespace)",
        json_schema_extra=_NOT_BLANK,
    )
    context: str = Field(
        min_length=1,
        description="the text to find the answer in (non-empty, not only whitespace)",
        json_schema_extra=_NOT_BLANK,
    )
    top_k: JsonInt = Field(
        1, ge=TOP_K_RANGE[0], le=TOP_K_RANGE[1], description="answers to return, best first"
    )
    max_answer_length: JsonInt = Field(
        30,
        ge=MAX_ANSWER_LENGTH_RANGE[0],
        le=MAX_ANSWER_LENGTH_RANGE[1],
        description="longest answer span in tokens",
    )
    null_threshold: float | None = Field(
        None,
        ge=NULL_THRESHOLD_RANGE[0],
        le=NULL_THRESHOLD_RANGE[1],
        allow_inf_nan=False,
        description="no-answer threshold for this pair, overriding the server's --null-threshold: "
        "abstain (no_answer, no answers) when null_score_diff > null_threshold; lower abstains more "
        "often, a large value (e.g. 1000) always answers; null: the server's setting",
    )

    @field_validator("question")
    @classmethod
    def _question(cls, v: str) -> str:
        return _not_blank(v, "question")

    @field_validator("context")
    @classmethod
    def _context(cls, v: str) -> str:
        return _not_blank(v, "context")

    def pair(self) -> QAPair:
        """The engine's ``QAPair`` of this item."""
        return QAPair(self.question, self.context, self.top_k, self.max_answer_length, self.null_threshold)


class QARequest(QAItem):
    """POST /v1/qa body."""

    timeout_s: float | None = Field(
        None, gt=0, description="deadline in seconds (default: the server's request_timeout_s)"
    )
    model: str | None = Field(
        None,
        max_length=64,
        description="the served model to ask (GET /v1/models lists them; default: the server's first model)",
    )


class QABatchRequest(BaseModel):
    """POST /v1/qa/batch body: many pairs answered in one call (one deadline for all)."""

    model_config = _STRICT

    items: list[QAItem] = Field(min_length=1, description="the pairs; at most max_batch_items")
    timeout_s: float | None = Field(None, gt=0, description="deadline in seconds for the whole batch")
    model: str | None = Field(
        None,
        max_length=64,
        description="the served model to ask (GET /v1/models lists them; default: the server's first model)",
    )


class AnswerOut(BaseModel):
    """One answer span: ``context[start:end] == text`` (character offsets into the original string)."""

    text: str
    score: float = Field(
        description="p_start * p_end in [0, 1], the start and end each softmax-normalised over all "
        "windows of the context together (comparable across windows and requests)"
    )
    start: int
    end: int


class QAResult(BaseModel):
    """Answers of one pair."""

    answers: list[AnswerOut] = Field(description="best first; empty when no_answer")
    no_answer: bool = Field(
        description="the model abstains (only with a null_threshold: the request's or the server's)"
    )
    null_score_diff: float | None = Field(
        description="null_score - best span logit (compare with null_threshold); null when no span"
    )
    windows: int = Field(description="windows the context was split into")


def qa_result(pr: PairResult) -> QAResult:
    """The answers of one pair as clients see them (no spans when the model abstains; an infinite
    null score difference is null)."""
    p = pr.prediction
    answers = (
        []
        if p.no_answer
        else [AnswerOut(text=a.text, score=a.score, start=a.start, end=a.end) for a in p.answers]
    )
    diff = p.null_score_diff
    return QAResult(
        answers=answers,
        no_answer=p.no_answer,
        null_score_diff=diff if diff not in (float("inf"), float("-inf")) else None,
        windows=pr.windows,
    )


class QAResponse(QAResult):
    """POST /v1/qa answer."""

    model: str
    request_id: str
    latency_ms: float


class QABatchResponse(BaseModel):
    """POST /v1/qa/batch answer: one result per item, in order."""

    results: list[QAResult]
    model: str
    request_id: str
    latency_ms: float


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body: a short machine code and a human reason."""

    error: str = Field(description="machine-readable code, e.g. queue_full, deadline_exceeded")
    detail: Any = Field(description="what was wrong, with the offending values")
    request_id: str | None = Field(
        None, description="the request's X-Request-ID (serving/frontend/http/access.py)"
    )


class FieldError(BaseModel):
    """One problem of a request that failed validation."""

    loc: list[str | int] = Field(description='where, e.g. ["body", "items", 0, "top_k"]')
    msg: str
    type: str = Field(description="pydantic error type, e.g. int_type, missing, extra_forbidden")


class ValidationErrorResponse(BaseModel):
    """Every 422 body: FastAPI's request validation and the server's own checks alike."""

    error: str = Field(description="invalid_request, invalid_input, invalid_timeout, too_many_items, ...")
    detail: str = Field(description="what was wrong, one line naming the fields and the limits")
    errors: list[FieldError] = Field(description="per-field problems of request validation (else empty)")
    request_id: str | None = Field(
        None, description="the request's X-Request-ID (serving/frontend/http/access.py)"
    )


class ModelInfo(BaseModel):
    """GET /v1/models entry."""

    model: str
    checkpoint: dict[str, Any]
    plan: dict[str, Any]
    generation: int
    replicas: list[dict[str, Any]]


_ONE_OF_REPLICAS = {  # replicas alone, or min_replicas and/or max_replicas (null counts as absent)
    # each branch repeats the bounds of its fields: generators may read a branch on its own
    "anyOf": [
        {
            "required": ["replicas"],
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "min_replicas": {"type": "null"},
                "max_replicas": {"type": "null"},
            },
        },
        {
            "required": ["min_replicas"],
            "properties": {"min_replicas": {"type": "integer", "minimum": 1}, "replicas": {"type": "null"}},
        },
        {
            "required": ["max_replicas"],
            "properties": {"max_replicas": {"type": "integer", "minimum": 1}, "replicas": {"type": "null"}},
        },
    ]
}


class ReplicasRequest(BaseModel):
    """POST /admin/replicas: a fixed count (autoscaling off) or new autoscaling bounds.

    Bounds over the device pool's cap (``pool_limit`` of GET /admin/replicas, the ``maximum`` in the
    OpenAPI document), a fixed ``replicas`` count included, are a 422 naming the cap."""

    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_ONE_OF_REPLICAS)

    replicas: JsonInt | None = Field(
        None, ge=0, description="run exactly this many gangs (0 stops all; <= the cap)"
    )
    min_replicas: JsonInt | None = Field(None, ge=1, description="new autoscaling lower bound (<= the cap)")
    max_replicas: JsonInt | None = Field(None, ge=1, description="new autoscaling upper bound (<= the cap)")


class ReloadRequest(BaseModel):
    """POST /admin/reload: load another checkpoint into fresh gangs and switch traffic to them."""

    model_config = _STRICT

    model: str = Field(description="registry name or local Hugging Face directory")
    name: str | None = Field(
        None, max_length=64, description="the served model to reload (default: the server's first model)"
    )
