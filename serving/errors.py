"""The error a call of serving ends with when it cannot be answered: ``EngineError`` (HTTP status, code, detail).

A leaf, as ``serving/config.py``: the engine raises it on the request path (429, 413, 504, ...) and the
fleet's model repository (``serving/fleet/repository.py``: 404 ``model_not_found``, 503
``model_unavailable``, 400 ``load_failed``, ...), so both rooms share one definition without the
fleet importing the engine; each protocol of the front end shapes it. The engine's vocabulary
(``serving/engine/qa_types.py``) hands it on beside the request and answer types.

    raise EngineError(429, "queue_full", "256 requests queued", retry_after_s=2)
"""

from __future__ import annotations


class EngineError(Exception):
    """A request cannot be answered: HTTP ``status``, machine ``code``, human ``detail``."""

    def __init__(self, status: int, code: str, detail: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail
        self.retry_after_s = retry_after_s
