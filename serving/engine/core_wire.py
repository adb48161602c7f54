"""The messages between API processes and the engine core (``shardserve serve --api-workers N``).

N >= 2 API processes run HTTP, validation, tokenizing and span decoding; one core process holds the
engines (admission, batching, the gangs). They talk over one ZeroMQ ``ipc://`` socket with
``partitioner/runtime/wire.py``'s signed frames (numpy arrays as raw bytes, no pickle):

    API -> core   Hello | Reserve | Submit | Cancel | HttpCall | Observed
    core -> API   State | Reserved | Answer | Failed | HttpReply

(each way, the messages of one event-loop turn travel as one bundle: ``wire.encode_many``)

A request is two round trips: ``Reserve`` (a queue place BEFORE tokenizing: a full server answers
429 at once, as in one process) -> ``Reserved`` / ``Failed``; then ``Submit`` (its windows) ->
``Answer`` (its windows' logits; the API process decodes the spans) / ``Failed``. ``Cancel`` gives a
place or a queued request back (the client left, the tokenizer refused the text). Routes off the hot
path travel whole (``HttpCall`` -> ``HttpReply``) and run in the core's own app. ``Observed`` carries
the API process's metric events to the core, the one registry; ``State`` tells every API process
what the repository serves and whether the server is stopping.

    frames = encode(submit_of("w1.0-7", encoded, input_s=0.002), key)
    encoded = encoded_of(decode(frames, key))                  # EncodedBatch, windows only
    rows = logits_of(answer)                                   # list[Tensor (n_tokens, 2)]

Tests: ``pytest tests/serving/engine/test_core_wire.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shardserve.models.qa_windows import EncodedBatch, QAWindow
from shardserve.partitioner.runtime.wire import register_messages
from shardserve.serving.engine.qa_types import CoreAnswer


@dataclass(frozen=True)
class Hello:
    """An API process is up (its DEALER identity is the ROUTER frame); the core answers with ``State``."""

    pid: int


@dataclass(frozen=True)
class Reserve:
    """Ask for a queue place of ``model`` for a request not tokenized yet (``Engine.reserve``)."""

    rid: str
    model: str
    floor: int
    hint: int
    tokenize_wait_s: float
    timeout_s: float | None


@dataclass(frozen=True)
class Reserved:
    rid: str


@dataclass(frozen=True)
class Submit:
    """A reserved request's windows: ``windows`` (W, 3) int32 rows of (n_tokens, example, window
    index); ``data`` (sum n_tokens, 4) int32, the windows' ``QAWindow.data`` one after another."""

    rid: str
    pad_token_id: int
    num_examples: int
    input_s: float
    windows: np.ndarray
    data: np.ndarray


@dataclass(frozen=True)
class Cancel:
    rid: str


@dataclass(frozen=True)
class Answer:
    """A request's logits: ``logits`` (sum n_tokens, 2) float32, its windows' rows one after another
    (``lengths`` (W,) int32); the seconds of its ``queue`` and ``compute_infer`` phases."""

    rid: str
    lengths: np.ndarray
    logits: np.ndarray
    queue_s: float
    infer_s: float


@dataclass(frozen=True)
class Failed:
    """The request ends with this ``EngineError`` (admission, deadline, shutdown, a replica's failure)."""

    rid: str
    status: int
    code: str
    detail: str
    retry_after_s: int | None = None


@dataclass(frozen=True)
class HttpCall:
    """A whole HTTP request for the core's own app (admin, metrics, status, repository...); headers
    as latin-1 strings."""

    cid: int
    method: str
    path: str
    query: str
    headers: list[list[str]]
    client: list[Any] | None
    body: np.ndarray  # uint8


@dataclass(frozen=True)
class HttpReply:
    cid: int
    status: int
    headers: list[list[str]]
    body: np.ndarray  # uint8


@dataclass(frozen=True)
class Observed:
    """Metric events of an API process, oldest first: ``["request", model, endpoint, status, seconds]``
    (an answered HTTP request), ``["end", model, pairs answered or None, seconds, phases]`` (an
    admitted request's end) and ``["cache", model, hits, misses]`` (a request's context cache lookups)."""

    events: list[list[Any]] = field(default_factory=list)


@dataclass(frozen=True)
class State:
    """What the API processes need of the core's repository (``CoreServer.digest``)."""

    digest: dict[str, Any]


register_messages(
    Hello, Reserve, Reserved, Submit, Cancel, Answer, Failed, HttpCall, HttpReply, Observed, State
)


def submit_of(rid: str, encoded: EncodedBatch, *, input_s: float) -> Submit:
    """The ``Submit`` of a tokenized request."""
    ws = encoded.windows
    meta = np.array([[w.num_tokens, w.example_index, w.window_index] for w in ws], dtype=np.int32)
    data = torch.cat([w.data for w in ws]).to(torch.int32).numpy()  # (sum n_tokens, 4)
    return Submit(rid, encoded.pad_token_id, encoded.num_examples, input_s, meta.reshape(-1, 3), data)


def encoded_of(msg: Submit) -> EncodedBatch:
    """The windows of a ``Submit`` as the scheduler queues them (no questions: the core never decodes)."""
    data = torch.from_numpy(msg.data)  # (sum n_tokens, 4) int32
    windows, at = [], 0
    for n, example, index in msg.windows.tolist():
        if n <= 0 or at + n > data.shape[0] or not 0 <= example < msg.num_examples:
            raise ValueError(f"window of {n} tokens for pair {example} does not fit the message")
        windows.append(QAWindow(data[at : at + n], example, index))
        at += n
    if not windows or at != data.shape[0]:
        raise ValueError(f"{at} tokens in windows, {data.shape[0]} sent")
    return EncodedBatch(
        windows=windows, num_examples=msg.num_examples, pad_token_id=msg.pad_token_id, questions=[]
    )


def answer_of(rid: str, answer: CoreAnswer) -> Answer:
    """The ``Answer`` of an API process's request: its windows' ``(n_tokens, 2)`` logits and phase times."""
    lengths = np.array([r.shape[0] for r in answer.logits], dtype=np.int32)
    rows = torch.cat([r.float() for r in answer.logits]).numpy()  # (sum n_tokens, 2)
    return Answer(rid, lengths, rows, answer.queue_s, answer.infer_s)


def logits_of(msg: Answer) -> list[torch.Tensor]:
    """An ``Answer``'s logits per window, ``(n_tokens, 2)`` each."""
    return list(torch.from_numpy(msg.logits).split(msg.lengths.tolist()))
