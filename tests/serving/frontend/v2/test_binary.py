"""The binary tensor data extension of the v2 routes: the codec (BYTES length prefixes, fixed-size
types, the JSON/data split), a binary request and response against the same request in JSON, each
malformed body a 400 or 415 that says what is wrong, and Triton's own HTTP client
(``tritonclient.http``, binary by default) against a live server (and its statistics of the calls).

Run: python -m pytest tests/serving/frontend/v2/test_binary.py -q      (fake in-process gangs; a few seconds)
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from shardserve.partitioner.runtime.fake_gang import FakeFactory
from shardserve.serving.frontend.app import build_app
from shardserve.serving.frontend.settings import ServeSettings
from shardserve.serving.frontend.v2 import binary as v2_binary
from tests.serving.frontend.api_helpers import serving
from tests.serving.frontend.v2.test_routes import (
    CONTEXTS,
    NAME,
    QUESTIONS,
    assert_v2_error,
    infer,
    infer_body,
    outputs,
)
from tests.serving.live import live_server

URL = f"/v2/models/{NAME}/infer"


def binary_tensor(name: str, texts: list[str]) -> tuple[dict[str, Any], bytes]:
    data = v2_binary.encode("BYTES", texts)
    return {
        "name": name,
        "shape": [len(texts)],
        "datatype": "BYTES",
        "parameters": {"binary_data_size": len(data)},
    }, data


def binary_request(
    client: TestClient, head: dict[str, Any], data: bytes, *, header_length: int | None = None, **headers: str
) -> Any:
    raw = json.dumps(head).encode()
    length = str(len(raw) if header_length is None else header_length)
    return client.post(URL, content=raw + data, headers={v2_binary.HEADER: length, **headers})


def split_response(response: Any) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """The JSON header and each binary output's decoded values."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == v2_binary.BINARY_MEDIA_TYPE
    head_bytes, data = v2_binary.split_body(response.content, response.headers[v2_binary.HEADER])
    head = json.loads(head_bytes)
    values, at = {}, 0
    for out in head["outputs"]:
        if "data" in out:
            continue
        size = out["parameters"]["binary_data_size"]
        chunk, at = data[at : at + size], at + size
        n = int(np.prod(out["shape"]))
        if out["datatype"] == "BYTES":
            values[out["name"]] = v2_binary.decode_bytes(chunk)
        else:
            code = {"FP32": "f", "INT64": "q", "BOOL": "?"}[out["datatype"]]
            values[out["name"]] = list(struct.unpack(f"<{n}{code}", chunk))
    assert at == len(data), "the outputs' binary_data_size sum to the data after the JSON"
    return head, values


# ------------------------------------------------------------------------------------------ codec


def test_bytes_elements_round_trip_with_4_byte_little_endian_lengths() -> None:
    texts = ["", "Denver Broncos", "naïve ☃ 🙂"]
    data = v2_binary.encode("BYTES", texts)
    assert data[:4] == b"\x00\x00\x00\x00" and data[4:8] == struct.pack("<I", 14)
    assert v2_binary.decode_bytes(data) == texts
    assert v2_binary.encode("INT64", [-1, 2]) == struct.pack("<2q", -1, 2)
    assert v2_binary.encode("BOOL", [True, False]) == b"\x01\x00"
    assert v2_binary.encode("FP32", [0.5]) == struct.pack("<f", 0.5)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"\x05\x00", "element 0: its 4-byte length is cut off at byte 0"),
        (b"\x05\x00\x00\x00abc", "element 0 has length 5; 3 bytes are left"),
        (b"\x01\x00\x00\x00a\x02\x00\x00\x00\xff\xfe", "element 1 is not UTF-8 text"),
    ],
)
def test_malformed_bytes_data_names_the_element(data: bytes, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        v2_binary.decode_bytes(data)


@pytest.mark.parametrize(("header", "needle"), [("x", "not a number"), ("0", "is 0"), ("99", "has 10 bytes")])
def test_a_header_length_outside_the_body_is_refused(header: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        v2_binary.split_body(b"0123456789", header)


# ------------------------------------------------------------------------------------------ routes


def test_binary_inputs_and_outputs_answer_as_the_same_request_in_json() -> None:
    with serving(served_model_name=NAME) as (client, _):
        as_json = outputs(infer(client, infer_body(parameters={"top_k": 2})))
        (q, q_data), (c, c_data) = binary_tensor("question", QUESTIONS), binary_tensor("context", CONTEXTS)
        head = {
            "id": "7",
            "inputs": [q, c],
            "outputs": [{"name": n, "parameters": {"binary_data": n != "score"}} for n in as_json],
            "parameters": {"top_k": 2},
        }
        response, values = split_response(binary_request(client, head, q_data + c_data))
        assert response["id"] == "7" and response["model_name"] == NAME
        by_name = {o["name"]: o for o in response["outputs"]}
        assert by_name["score"]["data"] == as_json["score"]["data"] and "parameters" not in by_name["score"]
        for name in ("answer", "start", "end", "no_answer"):
            assert by_name[name]["shape"] == as_json[name]["shape"] and "data" not in by_name[name]
            assert values[name] == as_json[name]["data"], name
        assert values["answer"][0] == CONTEXTS[0][values["start"][0] : values["end"][0]]


def test_binary_data_output_sends_every_output_binary_and_json_inputs_may_mix() -> None:
    """What tritonclient sends when no outputs are named: binary_data_output true."""
    with serving(served_model_name=NAME) as (client, _):
        q, q_data = binary_tensor("question", QUESTIONS)
        head = {
            "inputs": [q, {"name": "context", "shape": [2], "datatype": "BYTES", "data": CONTEXTS}],
            "parameters": {"binary_data_output": True},
        }
        response, values = split_response(binary_request(client, head, q_data))
        assert [o["name"] for o in response["outputs"]] == ["answer", "score", "start", "end", "no_answer"]
        assert all("data" not in o for o in response["outputs"])
        assert values["score"] == pytest.approx(
            outputs(infer(client, infer_body()))["score"]["data"], rel=1e-6
        )
        plain = infer(client, infer_body(parameters={"binary_data_output": False}))
        assert plain.headers["content-type"] == "application/json" and v2_binary.HEADER not in plain.headers


def test_triton_timeout_in_microseconds_is_the_deadline(shared_client: TestClient) -> None:
    ok = infer(shared_client, infer_body(parameters={"timeout": 30_000_000}))
    assert ok.status_code == 200, ok.text
    both = infer(shared_client, infer_body(parameters={"timeout": 1, "timeout_s": 1}))
    assert "not both" in assert_v2_error(both, 400)
    assert "microseconds" in assert_v2_error(infer(shared_client, infer_body(parameters={"timeout": 0})), 400)


@pytest.fixture(scope="module")
def shared_client() -> Any:
    with serving(served_model_name=NAME) as (client, _):
        yield client


def _bad_binary_cases() -> list[tuple[dict[str, Any], bytes, dict[str, Any], str]]:
    (q, q_data), (c, c_data) = binary_tensor("question", QUESTIONS), binary_tensor("context", CONTEXTS)
    short = {**c, "parameters": {"binary_data_size": len(c_data) - 1}}
    both = {**q, "data": QUESTIONS}
    negative = {**q, "parameters": {"binary_data_size": -1}}
    bad_utf8 = struct.pack("<I", 2) + b"\xff\xfe"
    one = {**q, "shape": [1], "parameters": {"binary_data_size": len(bad_utf8)}}
    ctx1, ctx1_data = binary_tensor("context", CONTEXTS[:1])
    return [
        ({"inputs": [q, short]}, q_data + c_data, {}, "the inputs' binary_data_size sum to"),
        ({"inputs": [q, c]}, q_data + c_data + b"!", {}, "bytes of binary data follow the JSON"),
        ({"inputs": [both, c]}, c_data, {}, "both data and binary_data_size"),
        ({"inputs": [negative, c]}, c_data, {}, "binary_data_size -1"),
        (
            {"inputs": [one, ctx1]},
            bad_utf8 + ctx1_data,
            {},
            "input 'question' binary data: element 0 is not UTF-8",
        ),
        (
            {"inputs": [q, c]},
            q_data + c_data,
            {"header_length": 10**6},
            "Inference-Header-Content-Length is 1000000",
        ),
        ({"inputs": [q, c]}, q_data + c_data, {"header_length": 5}, "JSON decode error"),
        (
            {"inputs": [q, c], "parameters": {"binary_data_output": "yes"}},
            q_data + c_data,
            {},
            "not true or false",
        ),
        (
            {"inputs": [q, c], "outputs": [{"name": "answer", "parameters": {"binary_data": 1}}]},
            q_data + c_data,
            {},
            "binary_data: 1 is not true or false",
        ),
    ]


@pytest.mark.parametrize(("head", "data", "kw", "needle"), _bad_binary_cases())
def test_malformed_binary_requests_are_400_saying_why(
    shared_client: TestClient, head: dict, data: bytes, kw: dict, needle: str
) -> None:
    assert needle in assert_v2_error(binary_request(shared_client, head, data, **kw), 400)


def test_binary_data_need_not_be_utf8_but_its_json_must(shared_client: TestClient) -> None:
    """A 200-character context's length prefix is the byte 0xC8: not UTF-8, and the body guard
    (which refuses non-UTF-8 bodies) must let it through; the JSON part is still checked."""
    context = ("Ann met Bob in Paris in 1999. " * 7)[:200]
    (q, q_data), (c, c_data) = (
        binary_tensor("question", ["Where did Ann meet Bob?"]),
        binary_tensor("context", [context]),
    )
    assert c_data[0] == 0xC8
    _, values = split_response(
        binary_request(
            shared_client, {"inputs": [q, c], "parameters": {"binary_data_output": True}}, q_data + c_data
        )
    )
    assert context[values["start"][0] : values["end"][0]] == values["answer"][0]
    raw = json.dumps({"inputs": [q, c]}).encode().replace(b"question", b"qu\xffstion")
    r = shared_client.post(URL, content=raw + q_data + c_data, headers={v2_binary.HEADER: str(len(raw))})
    assert assert_v2_error(r, 400).startswith("invalid_utf8: body is not valid UTF-8")


def test_binary_size_without_the_header_and_a_foreign_media_type_are_refused(
    shared_client: TestClient,
) -> None:
    (q, q_data), (c, c_data) = binary_tensor("question", QUESTIONS), binary_tensor("context", CONTEXTS)
    no_header = infer(shared_client, {"inputs": [q, c]})
    assert "has binary_data_size but the request has no Inference-Header-Content-Length" in assert_v2_error(
        no_header, 400
    )
    form = binary_request(
        shared_client,
        {"inputs": [q, c]},
        q_data + c_data,
        **{"content-type": "application/x-www-form-urlencoded"},
    )
    assert "application/octet-stream" in assert_v2_error(form, 415)
    octet = binary_request(
        shared_client, {"inputs": [q, c]}, q_data + c_data, **{"content-type": "application/octet-stream"}
    )
    assert octet.status_code == 200, octet.text


# ------------------------------------------------------------------------------------------ Triton's client


def test_tritonclient_http_with_its_binary_defaults() -> None:
    """Triton's HTTP client, as its users call it: binary inputs (set_data_from_numpy's default) and,
    with no outputs named, every output binary (binary_data_output)."""
    httpclient = pytest.importorskip("tritonclient.http")
    factory = FakeFactory()
    settings = ServeSettings(model="tiny-bert", replicas=1, served_model_name=NAME, max_queue_delay_ms=1.0)
    with live_server(
        build_app(settings, backend_factory=factory), ready_timeout_s=30, before_exit=factory.gate.set
    ) as base:
        client = httpclient.InferenceServerClient(base.removeprefix("http://"))
        try:
            assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(NAME)
            assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
            inputs = [httpclient.InferInput(n, [2], "BYTES") for n in ("question", "context")]
            inputs[0].set_data_from_numpy(np.array(QUESTIONS, dtype=np.object_))
            inputs[1].set_data_from_numpy(np.array([c.encode() for c in CONTEXTS], dtype=np.object_))
            result = client.infer(NAME, inputs, request_id="r1", parameters={"top_k": 1}, timeout=30_000_000)
            answers = [a.decode() for a in result.as_numpy("answer").reshape(-1)]
            start, end = result.as_numpy("start").reshape(-1), result.as_numpy("end").reshape(-1)
            assert (
                result.as_numpy("score").dtype == np.float32
                and result.as_numpy("no_answer").dtype == np.bool_
            )
            assert [c[s:e] for c, s, e in zip(CONTEXTS, start, end, strict=True)] == answers
            assert result.get_response()["id"] == "r1"
            for algorithm in ("gzip", "deflate"):  # compressed requests (Content-Encoding)
                zipped = client.infer(NAME, inputs, request_compression_algorithm=algorithm)
                assert [a.decode() for a in zipped.as_numpy("answer").reshape(-1)] == answers
            json_out = httpclient.InferRequestedOutput("answer", binary_data=False)
            again = client.infer(NAME, inputs, outputs=[json_out])
            assert list(again.as_numpy("answer").reshape(-1)) == answers  # JSON: str elements
            (stats,) = client.get_inference_statistics(NAME)["model_stats"]  # the statistics extension
            assert stats["inference_stats"]["success"]["count"] == 4 and stats["inference_count"] == 8
        finally:
            client.close()
