"""Output processing: a request's logits -> its answers (span decoding), and its end in the metrics.

The client's side of an answer (vLLM's output processor), the same in the server's own process and
in each ``--api-workers`` API process (``serving/engine/client.py``): ``decode`` turns the engine
core's ``CoreAnswer`` (the logits of a request's windows) into one ``PairResult`` per pair
(``decode_spans``; ``null_threshold``: the server's default, a pair's own wins), and ``end`` writes
the request's outcome and phases (``compute_output``: its decoding) where its metrics go.

Decoding is vectorised but not free: ~0.1-0.2 s for a 128-window request on a loaded 2-core CPU.
On the event loop that stalled every other request (and every 429) that long, so a request of more
than ``DECODE_INLINE_MAX_WINDOWS`` windows is decoded on the one decode thread (torch releases the
GIL; the loop keeps answering); small ones stay inline (no thread hop).

``await_answer`` waits for a request's answer (or its client's departure, or its bound).

    outputs = OutputProcessor(null_threshold=None, on_end=functools.partial(record_end, metrics))
    results = await outputs.decode(request_id, encoded, answer.logits, pairs, phases)  # EngineError 500
    outputs.end(answered=len(pairs), started=t0, phases=phases)
    outputs.shutdown()
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch

from shardserve.models.qa_decoding import decode_spans
from shardserve.models.qa_windows import EncodedBatch
from shardserve.serving.engine.qa_types import ClientGone, EngineError, PairResult, QAPair
from shardserve.serving.metrics import ModelMetrics

logger = logging.getLogger(__name__)

DECODE_INLINE_MAX_WINDOWS = 8  # requests with more windows are decoded off the event loop


class EndRecorder(Protocol):
    """Where a request's end goes: ``record_end`` on this process's metrics, or an API process's
    relay to the core's (``MetricsRelay``)."""

    def __call__(self, *, answered: int | None, seconds: float, phases: dict[str, float]) -> None: ...


class OutputProcessor:
    """Span decoding, inline or on the decode thread, and a request's end (module doc)."""

    def __init__(self, *, null_threshold: float | None, on_end: EndRecorder) -> None:
        self.null_threshold = null_threshold  # the server's default; None: the decoder's own
        self.on_end = on_end
        self._decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardserve-decode")

    async def decode(
        self,
        request_id: str,
        encoded: EncodedBatch,
        logits: Sequence[torch.Tensor],
        pairs: Sequence[QAPair],
        phases: dict[str, float],
    ) -> list[PairResult]:
        """Every pair's answers (``phases["compute_output"]``: the seconds it took); EngineError 500
        when decoding fails (a bug: logged)."""

        def decode() -> list[PairResult]:
            t0 = time.perf_counter()
            out = decode_pairs(encoded, logits, pairs, null_threshold=self.null_threshold)
            phases["compute_output"] = time.perf_counter() - t0
            return out

        try:
            if len(encoded.windows) <= DECODE_INLINE_MAX_WINDOWS:
                return decode()
            return await asyncio.get_running_loop().run_in_executor(self._decoder, decode)
        except Exception as err:
            logger.exception("decoding request %s failed", request_id)
            raise EngineError(500, "decode_failed", f"{type(err).__name__}: {err}") from err

    def end(self, *, answered: int | None, started: float, phases: dict[str, float]) -> None:
        """A request's end: ``answered`` pairs (None: it failed, however), since ``started``
        (``time.perf_counter``)."""
        self.on_end(answered=answered, seconds=time.perf_counter() - started, phases=phases)

    def shutdown(self) -> None:
        """Stop the decode thread once what is on it is decoded (a drain's last answers)."""
        self._decoder.shutdown(wait=False)


def decode_pairs(
    encoded: EncodedBatch,
    logits: Sequence[torch.Tensor | None],
    pairs: Sequence[QAPair],
    *,
    null_threshold: float | None,
) -> list[PairResult]:
    """Span decoding of every pair over the logits of its windows (``logits[i]``: window ``i``'s
    ``(n_tokens, 2)``); ``null_threshold``: the server's default, a pair's own wins."""
    by_pair: list[list[int]] = [[] for _ in pairs]
    for i, w in enumerate(encoded.windows):
        by_pair[w.example_index].append(i)
    results = []
    for pair, idx in zip(pairs, by_pair, strict=True):
        rows = [logits[i] for i in idx]
        prediction = decode_spans(
            [encoded.windows[i] for i in idx],
            [r[:, 0] for r in rows],  # type: ignore[index]
            [r[:, 1] for r in rows],  # type: ignore[index]
            pair.context,
            top_k=pair.top_k,
            max_answer_length=pair.max_answer_length,
            null_threshold=null_threshold if pair.null_threshold is None else pair.null_threshold,
        )
        results.append(PairResult(prediction, len(idx)))
    return results


def record_end(
    metrics: ModelMetrics, *, answered: int | None, seconds: float, phases: dict[str, float]
) -> None:
    """A request's end in the metrics (``answered``: its pairs, None when it failed, however): its
    outcome and time since arrival; answered, its pairs as inferences and each of its phases (Triton's
    statistics: every phase counts the same requests). An API process's requests end here too, in the
    core (``MetricsRelay``; ``serving/engine/core_server.py``)."""
    outcome = "fail" if answered is None else "success"
    metrics.request_duration.labels(outcome=outcome).observe(seconds)
    if answered is not None:
        metrics.inferences.inc(answered)
        for phase, s in phases.items():
            metrics.request_phase.labels(phase=phase).observe(s)
    metrics.last_inference.set_to_current_time()


async def await_answer(
    future: asyncio.Future,
    *,
    request_id: str,
    bound_s: float,
    disconnected: Callable[[], Awaitable[Any]] | None,
    cancel: Callable[[], None],
) -> Any:
    """``future``'s result (its exception raised), else ``cancel()`` the request's work and raise:
    ClientGone when ``disconnected`` fires first, EngineError 504 after ``bound_s``, the caller's own
    cancellation (a gRPC client that went away)."""
    watch = asyncio.ensure_future(disconnected()) if disconnected is not None else None
    try:
        waiting = {future} if watch is None else {future, watch}
        done, _ = await asyncio.wait(waiting, timeout=bound_s, return_when=asyncio.FIRST_COMPLETED)
        if future in done:
            return future.result()
        cancel()
        if watch is not None and watch in done:
            raise ClientGone(request_id)
        logger.error("request %s not answered %.1f s past its deadline", request_id, bound_s)
        raise EngineError(504, "deadline_exceeded", f"not answered within {bound_s:.1f} s")
    except asyncio.CancelledError:
        cancel()
        raise
    finally:
        if watch is not None and not watch.done():
            watch.cancel()
        if not future.done():
            future.cancel()
