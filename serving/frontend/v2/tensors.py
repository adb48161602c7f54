"""The tensors of an Open Inference Protocol (v2) inference call, for REST and gRPC alike.

Owns what a v2 inference request means here and how answers become output tensors, whichever
protocol carried them (``serving/frontend/v2/routes.py``: REST's JSON and binary bodies;
``serving/frontend/grpc/service.py``: gRPC's messages, turned into the same ``V2InferenceRequest``):

- inputs ``question`` and ``context``, datatype ``BYTES``, shape ``[N]`` or ``[N, 1]`` (data flat, or
  nested as the shape, row-major), or binary data (``binary_data_size``; the binary extension's and
  gRPC's raw layout: ``serving/frontend/v2/binary.py``); a duplicate input or output is an error;
- request ``parameters``: ``top_k``, ``max_answer_length``, ``null_threshold``, ``timeout_s`` (the
  fields of the native ``/v1/qa/batch``, with its limits), or Triton's ``timeout`` (microseconds);
- outputs (all, or those named, in that order): ``answer`` BYTES [N, K], ``score`` FP32 [N, K],
  ``start`` / ``end`` INT64 [N, K] (character offsets), ``no_answer`` BOOL [N]; rows with fewer than K
  answers are padded with ``""``, 0.0, -1, -1.

``parse_call`` decodes a request into a ``V2Call`` (the pairs as ``QAItem``s, the deadline, the
outputs) or raises ``V2InputError`` naming what is wrong (a 400 / INVALID_ARGUMENT);
``V2Call.encode`` shapes the answers.

    call = parse_call(body, binary, max_batch_items=64)
    outputs = call.encode([qa_result(r) for r in results])

Tests: ``pytest tests/serving/frontend/v2/test_routes.py tests/serving/frontend/grpc/test_grpc.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shardserve.serving.frontend.schemas import JsonInt, QAItem
from shardserve.serving.frontend.v2 import binary as v2_binary

INPUTS = ("question", "context")
OUTPUTS = ("answer", "score", "start", "end", "no_answer")
REQUEST_PARAMETERS = ("top_k", "max_answer_length", "null_threshold", "timeout_s")
# Triton's deadline (µs); the binary extension's; Triton's streaming flag, which perf_analyzer sends over
# gRPC and which means nothing for one answer per request (ignored)
PROTOCOL_PARAMETERS = ("timeout", "binary_data_output", "triton_enable_empty_final_response")

_STRICT = ConfigDict(strict=True, extra="forbid")
ParameterValue = bool | int | float | str


class V2RequestInput(BaseModel):
    """One input tensor: ``question`` or ``context``, BYTES, shape [N] or [N, 1]."""

    model_config = _STRICT

    name: str
    shape: list[JsonInt] = Field(description="[N] or [N, 1]")
    datatype: str = Field(description="BYTES")
    parameters: dict[str, ParameterValue] | None = Field(
        None, description="content_type str; binary_data_size (bytes after the JSON) in place of data"
    )
    data: list[Any] | None = Field(None, description="N strings, flat or nested as the shape (row-major)")


class V2RequestOutput(BaseModel):
    model_config = _STRICT

    name: str
    parameters: dict[str, ParameterValue] | None = None


class V2InferenceRequest(BaseModel):
    """POST /v2/models/{name}/infer body."""

    model_config = _STRICT

    id: str | None = Field(None, description="returned as the response's id")
    parameters: dict[str, ParameterValue] | None = Field(
        None,
        description="top_k, max_answer_length, null_threshold, timeout_s (as in /v1/qa/batch); Triton's "
        "timeout (µs); binary_data_output (all outputs as binary data)",
    )
    inputs: list[V2RequestInput]
    outputs: list[V2RequestOutput] | None = Field(None, description="the outputs to return (default: all)")


class V2ResponseOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, ParameterValue] | None = Field(
        None, description="binary_data_size: the output's data follows the JSON (binary extension)"
    )
    data: list[Any] | None = Field(None, description="row-major, flat; absent for a binary output")


OUTPUT_TYPES = {"answer": "BYTES", "score": "FP32", "start": "INT64", "end": "INT64", "no_answer": "BOOL"}


class V2InputError(ValueError):
    """A request the model cannot take (400): a tensor's name, shape, datatype or data, a parameter."""


def _elements(name: str, data: list[Any], shape: list[int]) -> list[Any]:
    """The elements of a tensor's ``data``: flat, or nested exactly as ``shape`` ([N, 1]: N rows of 1)."""
    if not any(isinstance(x, list) for x in data):
        return data
    rows, width = shape[0], shape[-1]
    if len(shape) == 2 and len(data) == rows and all(isinstance(r, list) and len(r) == width for r in data):
        return [x for r in data for x in r]
    raise V2InputError(f"input {name!r}: data is nested otherwise than its shape {shape} (give it flat)")


def binary_size(tensor: V2RequestInput) -> int | None:
    """The input's ``binary_data_size`` (its data follows the JSON), None when its data is JSON."""
    size = (tensor.parameters or {}).get("binary_data_size")
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise V2InputError(f"input {tensor.name!r}: binary_data_size {size!r} is not a number of bytes")
    if tensor.data is not None:
        raise V2InputError(f"input {tensor.name!r} has both data and binary_data_size; give one")
    return size


def decode_input(tensor: V2RequestInput, binary: bytes | None = None) -> list[str]:
    """The N strings of a BYTES tensor of shape [N] or [N, 1], from its JSON data or its ``binary``
    data (the binary extension); ``V2InputError`` names what is wrong."""
    name = tensor.name
    if tensor.datatype != "BYTES":
        raise V2InputError(f"input {name!r} has datatype {tensor.datatype!r}; this model takes BYTES")
    shape = tensor.shape
    if not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)) or shape[0] < 1:
        raise V2InputError(f"input {name!r} has shape {shape}; this model takes [N] or [N, 1] with N >= 1")
    for key, value in (tensor.parameters or {}).items():
        if key not in ("content_type", "binary_data_size"):
            raise V2InputError(f"input {name!r}: unknown parameter {key!r} (content_type, binary_data_size)")
        if key == "content_type" and value not in ("str", "bytes", "BYTES"):
            raise V2InputError(f"input {name!r}: content_type {value!r} is not str")
    if binary is not None:
        try:
            flat: list[Any] = v2_binary.decode_bytes(binary)
        except ValueError as err:
            raise V2InputError(f"input {name!r} binary data: {err}") from None
    elif tensor.data is None:
        raise V2InputError(f"input {name!r} has no data (and no binary_data_size)")
    else:
        flat = _elements(name, tensor.data, shape)
    if len(flat) != math.prod(shape):
        raise V2InputError(
            f"input {name!r} has {len(flat)} elements; its shape {shape} needs {math.prod(shape)}"
        )
    for i, x in enumerate(flat):
        if not isinstance(x, str):
            raise V2InputError(f"input {name!r}[{i}] is {type(x).__name__}; BYTES elements are JSON strings")
    return flat


def _binary_inputs(inputs: list[V2RequestInput], binary: bytes | None) -> dict[str, bytes]:
    """Each binary input's slice of the tensor data after the JSON, in input order."""
    sizes = [(t.name, size) for t in inputs if (size := binary_size(t)) is not None]
    if binary is None:
        if sizes:
            raise V2InputError(
                f"input {sizes[0][0]!r} has binary_data_size but the request has no {v2_binary.HEADER}"
            )
        return {}
    total = sum(size for _, size in sizes)
    if total != len(binary):
        raise V2InputError(
            f"{len(binary)} bytes of binary data follow the JSON; the inputs' binary_data_size sum to {total}"
        )
    out, at = {}, 0
    for name, size in sizes:
        out[name], at = binary[at : at + size], at + size
    return out


def decode_request(body: V2InferenceRequest, binary: bytes | None = None) -> list[QAItem]:
    """The (question, context) pairs of a v2 request with its parameters, as /v1/qa/batch items
    (their server limits are checked on the shared path, ``answer_pairs``); ``binary``: the tensor
    data after the JSON (the binary extension), None when the body is all JSON."""
    tensors: dict[str, V2RequestInput] = {}
    for t in body.inputs:
        if t.name not in INPUTS:
            raise V2InputError(f"unknown input {t.name!r}; this model takes question and context (BYTES)")
        if t.name in tensors:
            raise V2InputError(f"input {t.name!r} is given twice")
        tensors[t.name] = t
    missing = [n for n in INPUTS if n not in tensors]
    if missing:
        raise V2InputError(f"missing input {missing[0]!r}; this model takes question and context (BYTES)")
    data = _binary_inputs(body.inputs, binary)
    questions, contexts = (decode_input(tensors[n], data.get(n)) for n in INPUTS)
    if len(questions) != len(contexts):
        raise V2InputError(
            f"{len(questions)} questions but {len(contexts)} contexts; give one question per context"
        )
    params = dict(body.parameters or {})
    params.pop("content_type", None)
    unknown = sorted(set(params) - set(REQUEST_PARAMETERS) - set(PROTOCOL_PARAMETERS))
    if unknown:
        known = ", ".join(REQUEST_PARAMETERS + PROTOCOL_PARAMETERS)
        raise V2InputError(f"unknown parameter {unknown[0]!r}; supported: {known}")
    for name in ("timeout_s", *PROTOCOL_PARAMETERS):
        params.pop(name, None)
    items = []
    for i, (q, c) in enumerate(zip(questions, contexts, strict=True)):
        try:
            item = QAItem.model_validate({"question": q, "context": c, **params})
        except ValidationError as err:
            e = err.errors()[0]
            loc = ".".join(str(x) for x in e.get("loc", ()))
            raise V2InputError(f"{v2_field(i, loc)}: {e.get('msg', 'invalid')}") from None
        items.append(item)
    return items


def v2_field(i: int, field: str) -> str:
    """Where a field of pair ``i`` lives in a v2 request: an input tensor's element, or a parameter."""
    return f"{field}[{i}]" if field in INPUTS else f"parameters.{field}"


def request_timeout(body: V2InferenceRequest) -> float | None:
    """The deadline in seconds: ``timeout_s``, or Triton's ``timeout`` in microseconds."""
    params = body.parameters or {}
    if "timeout_s" in params and "timeout" in params:
        raise V2InputError("parameters: give timeout_s (seconds) or timeout (microseconds), not both")
    name, unit = ("timeout", 1e-6) if "timeout" in params else ("timeout_s", 1.0)
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 or math.isinf(value):
        what = "microseconds" if name == "timeout" else "seconds"
        raise V2InputError(f"parameters.{name}: {value!r} is not a number of {what} > 0")
    return float(value) * unit


def _flag(where: str, value: ParameterValue | None) -> bool:
    if value is None or isinstance(value, bool):
        return bool(value)
    raise V2InputError(f"{where}: {value!r} is not true or false")


def _requested_outputs(body: V2InferenceRequest) -> list[tuple[str, bool]]:
    """The outputs to return, in order, each with whether it goes as binary data."""
    binary = _flag("parameters.binary_data_output", (body.parameters or {}).get("binary_data_output"))
    if body.outputs is None:
        return [(name, binary) for name in OUTPUTS]
    out: dict[str, bool] = {}
    for requested in body.outputs:
        name, params = requested.name, dict(requested.parameters or {})
        if name not in OUTPUTS:
            raise V2InputError(f"unknown output {name!r}; this model has {', '.join(OUTPUTS)}")
        if name in out:
            raise V2InputError(f"output {name!r} is requested twice")
        flag = params.pop("binary_data", None)
        if params:
            key, value = next(iter(params.items()))
            raise V2InputError(f"output {name!r}: parameter {key}={value!r} is not supported")
        out[name] = binary if flag is None else _flag(f"output {name!r} binary_data", flag)
    return list(out.items())


@dataclass(frozen=True)
class V2Call:
    """A decoded inference request: the pairs, the deadline, the outputs to return (each with whether
    it goes as binary data). The same for REST and gRPC (``serving/frontend/grpc/service.py``)."""

    items: list[QAItem]
    timeout_s: float | None
    outputs: list[tuple[str, bool]]

    def encode(self, results: list[Any]) -> list[V2ResponseOutput]:
        """The requested output tensors of the answers (``QAResult``s, in pair order)."""
        return encode_outputs(results, top_k=self.items[0].top_k, names=[n for n, _ in self.outputs])


def parse_call(body: V2InferenceRequest, binary: bytes | None, *, max_batch_items: int) -> V2Call:
    """Decode ``body`` (and its ``binary`` tensor data); ``V2InputError`` (a 400) names what is wrong."""
    items = decode_request(body, binary)
    call = V2Call(items=items, timeout_s=request_timeout(body), outputs=_requested_outputs(body))
    if len(items) > max_batch_items:
        raise V2InputError(f"too_many_items: {len(items)} pairs, max_batch_items={max_batch_items}")
    return call


def encode_outputs(results: list[Any], *, top_k: int, names: list[str]) -> list[V2ResponseOutput]:
    """The named output tensors of N results (``shardserve.serving.frontend.schemas.QAResult``), K = top_k per row."""
    n = len(results)
    rows: dict[str, list[Any]] = {"answer": [], "score": [], "start": [], "end": []}
    for r in results:
        answers = r.answers[:top_k]
        pad = top_k - len(answers)
        rows["answer"] += [a.text for a in answers] + [""] * pad
        rows["score"] += [float(a.score) for a in answers] + [0.0] * pad
        rows["start"] += [int(a.start) for a in answers] + [-1] * pad
        rows["end"] += [int(a.end) for a in answers] + [-1] * pad
    rows["no_answer"] = [bool(r.no_answer) for r in results]
    return [
        V2ResponseOutput(
            name=name,
            shape=[n] if name == "no_answer" else [n, top_k],
            datatype=OUTPUT_TYPES[name],
            data=rows[name],
        )
        for name in names
    ]
