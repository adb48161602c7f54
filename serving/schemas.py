"""HTTP request / response models of the QA server (pydantic 2; they are the OpenAPI schema at /docs).

Requests are strict: a wrong JSON type (``"top_k": "3"``) or an unknown field is a 422 with the
offending location, never a silent coercion. Text limits that depend on settings (context length)
are checked by the routes with ``models.qa_processing.validate_qa_inputs``.

No answer (SQuAD 2.0): when a ``null_threshold`` is configured and the model prefers to abstain,
``no_answer`` is true and ``answers`` is EMPTY; without a threshold ``no_answer`` is always false.

    QARequest.model_validate({"question": "Who?", "context": "Ann met Bob."})
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from models.qa_processing import MAX_ANSWER_LENGTH_RANGE, TOP_K_RANGE

_STRICT = ConfigDict(strict=True, extra="forbid")


def _not_blank(value: str, name: str) -> str:
    if not value.strip():
        raise ValueError(f"{name} is empty or whitespace only ({len(value)} chars)")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:  # a JSON escape like "\ud800": valid JSON, not valid Unicode text
        raise ValueError(f"{name} is not valid Unicode: {err.reason} at character {err.start}") from None
    return value


class QAItem(BaseModel):
    """One (question, context) pair with its decoding options."""

    model_config = _STRICT

    question: str = Field(min_length=1, description="the question (non-empty, not only whitespace)")
    context: str = Field(
        min_length=1, description="the text to find the answer in (non-empty, not only whitespace)"
    )
    top_k: int = Field(1, ge=TOP_K_RANGE[0], le=TOP_K_RANGE[1], description="answers to return, best first")
    max_answer_length: int = Field(
        30,
        ge=MAX_ANSWER_LENGTH_RANGE[0],
        le=MAX_ANSWER_LENGTH_RANGE[1],
        description="longest answer span in tokens",
    )

    @field_validator("question")
    @classmethod
    def _question(cls, v: str) -> str:
        return _not_blank(v, "question")

    @field_validator("context")
    @classmethod
    def _context(cls, v: str) -> str:
        return _not_blank(v, "context")


class QARequest(QAItem):
    """POST /v1/qa body."""

    timeout_s: float | None = Field(
        None, gt=0, description="deadline in seconds (default: the server's request_timeout_s)"
    )


class QABatchRequest(BaseModel):
    """POST /v1/qa/batch body: many pairs answered in one call (one deadline for all)."""

    model_config = _STRICT

    items: list[QAItem] = Field(min_length=1, description="the pairs; at most max_batch_items")
    timeout_s: float | None = Field(None, gt=0, description="deadline in seconds for the whole batch")


class AnswerOut(BaseModel):
    """One answer span: ``context[start:end] == text`` (character offsets into the original string)."""

    text: str
    score: float = Field(description="p_start * p_end in [0, 1]")
    start: int
    end: int


class QAResult(BaseModel):
    """Answers of one pair."""

    answers: list[AnswerOut] = Field(description="best first; empty when no_answer")
    no_answer: bool = Field(description="the model abstains (only with a configured null_threshold)")
    null_score_diff: float | None = Field(
        description="null_score - best span logit (compare with null_threshold); null when no span"
    )
    windows: int = Field(description="windows the context was split into")


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


class ModelInfo(BaseModel):
    """GET /v1/models entry."""

    model: str
    checkpoint: dict[str, Any]
    plan: dict[str, Any]
    generation: int
    replicas: list[dict[str, Any]]


class ReplicasRequest(BaseModel):
    """POST /admin/replicas: a fixed count (autoscaling off) or new autoscaling bounds."""

    model_config = _STRICT

    replicas: int | None = Field(None, ge=0, description="run exactly this many gangs (0 stops all)")
    min_replicas: int | None = Field(None, ge=1, description="new autoscaling lower bound")
    max_replicas: int | None = Field(None, ge=1, description="new autoscaling upper bound")


class ReloadRequest(BaseModel):
    """POST /admin/reload: load another checkpoint into fresh gangs and switch traffic to them."""

    model_config = _STRICT

    model: str = Field(description="registry name or local Hugging Face directory")
