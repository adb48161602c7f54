"""KServe v2 / Triton gRPC (serving/frontend/grpc/server.py, service.py, call.py) against Triton's own gRPC
client on fake gangs: health, metadata, config, inference equal to REST's, the outputs asked for,
errors as status codes (INVALID_ARGUMENT, NOT_FOUND, UNAUTHENTICATED, RESOURCE_EXHAUSTED with
retry-after, DEADLINE_EXCEEDED, UNAVAILABLE while draining), the API key and admin token in the
``authorization`` metadata, request ids, the access log and metrics, a cancelled call's dropped work,
the repository over gRPC.

Run: python -m pytest tests/serving/frontend/grpc/test_grpc.py -q      (fake in-process gangs; seconds)
"""

from __future__ import annotations

import contextlib
import logging
import signal
import struct
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import pytest
from fastapi.testclient import TestClient

from shardserve.partitioner.runtime.fake_gang import FakeFactory
from shardserve.serving.frontend.cli import bind_problem
from shardserve.serving.frontend.grpc import call as grpc_call
from shardserve.serving.frontend.settings import ServeSettings
from tests.serving.frontend.api_helpers import TOKEN, ask, serving, wait_until
from tests.serving.frontend.v2.test_routes import CONTEXTS, QUESTIONS, infer, infer_body, outputs
from tests.serving.live import draining_server, free_port

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

NAME = "squad-qa"
KEY = "grpc-key"


@contextlib.contextmanager
def grpc_serving(**overrides: Any) -> Iterator[tuple[TestClient, FakeFactory, Any]]:
    """A started app on fake gangs with gRPC on a free port: (REST client, factory, Triton gRPC client)."""
    with serving(served_model_name=overrides.pop("served_model_name", NAME), grpc_port=0, **overrides) as (
        client,
        factory,
    ):
        triton = grpcclient.InferenceServerClient(f"127.0.0.1:{client.app.state.grpc_port}")
        try:
            yield client, factory, triton
        finally:
            triton.close()


@pytest.fixture(scope="module")
def shared() -> Iterator[tuple[TestClient, FakeFactory, Any]]:
    """One server for the cases that do not change its state."""
    with grpc_serving() as running:
        yield running


def raw_stub(client: TestClient) -> tuple[Any, grpc.Channel]:
    channel = grpc.insecure_channel(f"127.0.0.1:{client.app.state.grpc_port}")
    return service_pb2_grpc.GRPCInferenceServiceStub(channel), channel


def bytes_input(name: str, values: list[str]) -> Any:
    tensor = grpcclient.InferInput(name, [len(values)], "BYTES")
    tensor.set_data_from_numpy(np.array([v.encode() for v in values], dtype=np.object_))
    return tensor


def pairs(questions: list[str] = QUESTIONS, contexts: list[str] = CONTEXTS) -> list[Any]:
    return [bytes_input("question", questions), bytes_input("context", contexts)]


def raw_bytes(values: list[str]) -> bytes:
    """A BYTES tensor's raw contents: each element's 4-byte little-endian length, then its UTF-8."""
    return b"".join(struct.pack("<I", len(b)) + b for b in (v.encode() for v in values))


def status_of(err: InferenceServerException) -> str:
    return str(err.status())


# ------------------------------------------------------------------------------------- health, metadata


def test_health_metadata_and_config(shared: tuple[TestClient, FakeFactory, Any]) -> None:
    client, _, triton = shared
    assert triton.is_server_live() and triton.is_server_ready() and triton.is_model_ready(NAME)
    with pytest.raises(InferenceServerException) as unknown:  # REST answers 404 with the same words
        triton.is_model_ready("nope")
    rest = client.get("/v2/models/nope/ready")
    assert status_of(unknown.value) == "StatusCode.NOT_FOUND" and rest.status_code == 404
    assert unknown.value.message() == rest.json()["error"] == "model_not_found: model 'nope' not found"
    meta = triton.get_server_metadata(as_json=True)
    assert meta["name"] == "shardserve" and meta["extensions"] == client.get("/v2").json()["extensions"]
    model = triton.get_model_metadata(NAME, as_json=True)
    rest = client.get(f"/v2/models/{NAME}").json()
    assert [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in model["inputs"]] == [
        (t["name"], t["datatype"], t["shape"]) for t in rest["inputs"]
    ]
    assert [t["name"] for t in model["outputs"]] == ["answer", "score", "start", "end", "no_answer"]
    config = triton.get_model_config(NAME, as_json=True)["config"]
    assert config["name"] == NAME and config.get("max_batch_size", 0) == 0
    assert {t["name"]: t["data_type"] for t in config["input"]} == {
        "question": "TYPE_STRING",
        "context": "TYPE_STRING",
    }
    with pytest.raises(InferenceServerException) as missing:
        triton.get_model_metadata("nope")
    assert status_of(missing.value) == "StatusCode.NOT_FOUND" and "nope" in missing.value.message()
    with pytest.raises(InferenceServerException) as versioned:
        triton.get_model_metadata(NAME, model_version="3")
    assert (
        status_of(versioned.value) == "StatusCode.NOT_FOUND"
        and "serves version 1" in versioned.value.message()
    )
    assert triton.get_model_metadata(NAME, model_version="1").name == NAME  # the served version


# ------------------------------------------------------------------------------------- inference


def test_infer_answers_as_rest_does(shared: tuple[TestClient, FakeFactory, Any]) -> None:
    client, _, triton = shared
    rest = outputs(infer(client, infer_body(parameters={"top_k": 2})))
    result = triton.infer(NAME, pairs(), request_id="r-1", parameters={"top_k": 2})
    assert result.get_response().id == "r-1" and result.get_response().model_name == NAME
    assert [a.decode() for a in result.as_numpy("answer").reshape(-1)] == rest["answer"]["data"]
    assert result.as_numpy("answer").shape == (2, 2) and result.as_numpy("no_answer").shape == (2,)
    assert result.as_numpy("score").dtype == np.float32 and result.as_numpy("start").dtype == np.int64
    np.testing.assert_allclose(result.as_numpy("score").reshape(-1), rest["score"]["data"], rtol=1e-6)
    assert result.as_numpy("start").reshape(-1).tolist() == rest["start"]["data"]
    assert result.as_numpy("end").reshape(-1).tolist() == rest["end"]["data"]
    answers, starts, ends = (result.as_numpy(n)[:, 0] for n in ("answer", "start", "end"))
    assert [c[s:e] for c, s, e in zip(CONTEXTS, starts, ends, strict=True)] == [a.decode() for a in answers]
    # only the outputs asked for, in that order; [N, 1] inputs
    asked = [grpcclient.InferRequestedOutput(n) for n in ("no_answer", "answer")]
    column = [grpcclient.InferInput(n, [2, 1], "BYTES") for n in ("question", "context")]
    for tensor, values in zip(column, (QUESTIONS, CONTEXTS), strict=True):
        tensor.set_data_from_numpy(np.array([[v.encode()] for v in values], dtype=np.object_))
    some = triton.infer(NAME, column, outputs=asked, parameters={"top_k": 2})
    assert [o.name for o in some.get_response().outputs] == ["no_answer", "answer"]
    assert [a.decode() for a in some.as_numpy("answer")[:, 0]] == [a.decode() for a in answers]


def test_bytes_contents_and_the_request_id_metadata(shared: tuple[TestClient, FakeFactory, Any]) -> None:
    """The other way to send BYTES (contents.bytes_contents) and the x-request-id metadata: echoed in
    the trailing metadata and the response id when the request has none."""
    client = shared[0]
    stub, channel = raw_stub(client)
    request = service_pb2.ModelInferRequest(model_name=NAME)
    for name, values in (("question", QUESTIONS), ("context", CONTEXTS)):
        tensor = request.inputs.add(name=name, datatype="BYTES", shape=[len(values)])
        tensor.contents.bytes_contents.extend(v.encode() for v in values)
    with channel:
        response, call = stub.ModelInfer.with_call(request, metadata=[("x-request-id", "trace-42")])
        assert response.id == "trace-42" and ("x-request-id", "trace-42") in call.trailing_metadata()
        # the answers, decoded from raw_output_contents (4-byte length + UTF-8 per element)
        raw = response.raw_output_contents[[o.name for o in response.outputs].index("answer")]
        texts, at = [], 0
        while at < len(raw):
            (n,) = struct.unpack_from("<I", raw, at)
            texts.append(raw[at + 4 : at + 4 + n].decode())
            at += 4 + n
    rest = outputs(infer(client, infer_body()))
    assert texts == rest["answer"]["data"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: setattr(r.inputs[0], "name", "query"), "unknown input 'query'"),
        (lambda r: setattr(r.inputs[1], "datatype", "FP32"), "datatype 'FP32'"),
        (lambda r: r.inputs[1].shape.__setitem__(0, 3), "its shape [3] needs 3"),
        (lambda r: r.raw_input_contents.__setitem__(1, b"\x05\x00"), "4-byte length is cut off"),
        (lambda r: r.raw_input_contents.__setitem__(0, b"\x01\x00\x00\x00\xff" * 2), "UTF-8"),
        (
            lambda r: r.parameters["top_k"].CopyFrom(service_pb2.InferParameter(int64_param=0)),
            "parameters.top_k",
        ),
        (
            lambda r: r.parameters["colour"].CopyFrom(service_pb2.InferParameter(bool_param=True)),
            "unknown parameter 'colour'",
        ),
        (lambda r: r.outputs.add(name="logits"), "unknown output 'logits'"),
        (lambda r: r.inputs[0].contents.fp32_contents.append(1.0), "fp32_contents"),
        (lambda r: r.raw_input_contents.pop(), "1 raw_input_contents for 2 inputs"),
    ],
)
def test_bad_requests_are_invalid_argument(
    shared: tuple[TestClient, FakeFactory, Any], change: Any, message: str
) -> None:
    client, _, _ = shared
    stub, channel = raw_stub(client)
    request = service_pb2.ModelInferRequest(model_name=NAME)
    for name, values in (("question", QUESTIONS), ("context", CONTEXTS)):
        request.inputs.add(name=name, datatype="BYTES", shape=[len(values)])
        request.raw_input_contents.append(raw_bytes(values))
    change(request)
    if message == "fp32_contents":  # contents and raw data together: drop the raw data
        del request.raw_input_contents[:]
    with channel, pytest.raises(grpc.RpcError) as refused:
        stub.ModelInfer(request)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert message in refused.value.details()


def test_limits_and_unknown_model(shared: tuple[TestClient, FakeFactory, Any]) -> None:
    _, _, triton = shared
    long_context = "word " * 30_000  # 150 000 characters > max_context_chars (100 000)
    for inputs, status, words in (
        (pairs(["Who?"], [long_context]), "StatusCode.INVALID_ARGUMENT", "the limit is 100000"),
        (pairs(["Who?"] * 65, ["Ann met Bob."] * 65), "StatusCode.INVALID_ARGUMENT", "max_batch_items"),
    ):
        with pytest.raises(InferenceServerException) as refused:
            triton.infer(NAME, inputs)
        assert status_of(refused.value) == status and words in refused.value.message()
    with pytest.raises(InferenceServerException) as missing:
        triton.infer("nope", pairs())
    assert status_of(missing.value) == "StatusCode.NOT_FOUND"


def test_a_message_over_max_body_bytes_is_refused_by_grpc_itself(
    shared: tuple[TestClient, FakeFactory, Any],
) -> None:
    stub, channel = raw_stub(shared[0])
    request = _raw_request()
    request.raw_input_contents[1] = raw_bytes(["x" * 1_000_001])  # max_body_bytes: 1 000 000
    with channel, pytest.raises(grpc.RpcError) as refused:
        stub.ModelInfer(request)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()


def test_access_log_and_metrics_count_grpc_calls(
    shared: tuple[TestClient, FakeFactory, Any], caplog: pytest.LogCaptureFixture
) -> None:
    client, _, triton = shared
    with caplog.at_level(logging.INFO, logger="shardserve.access"):
        triton.infer(NAME, pairs(), headers={"x-request-id": "log-me-1"})
        with pytest.raises(InferenceServerException):
            triton.infer(NAME, [bytes_input("question", ["Who?"])])

        def lines() -> list[str]:
            return [r.getMessage() for r in caplog.records if r.name == "shardserve.access"]

        wait_until(lambda: len(lines()) == 2, what="both lines (written as the call ends)")
    lines = lines()
    ok = next(line for line in lines if "request_id=log-me-1" in line)
    assert ok.startswith("method=GRPC path=/inference.GRPCInferenceService/ModelInfer status=200")
    assert "windows=2" in ok
    assert any("ModelInfer status=400" in line for line in lines), lines
    metrics = client.get("/metrics").text
    assert f'shardserve_requests_total{{endpoint="grpc_infer",model="{NAME}",status="200"}}' in metrics
    assert f'shardserve_requests_total{{endpoint="grpc_infer",model="{NAME}",status="400"}}' in metrics


# ------------------------------------------------------------------------------------- keys


def test_the_api_key_and_the_admin_token_travel_as_authorization_metadata() -> None:
    with grpc_serving(api_key=KEY) as (_, _, triton):
        assert triton.is_server_live() and triton.is_model_ready(NAME)  # health stays open
        for call in (
            lambda h: triton.infer(NAME, pairs(), headers=h),
            lambda h: triton.get_model_config(NAME, headers=h),
        ):
            for headers in (None, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
                with pytest.raises(InferenceServerException) as refused:
                    call(headers)
                assert status_of(refused.value) == "StatusCode.UNAUTHENTICATED"
            call({"authorization": f"Bearer {KEY}"})
        # the repository: the admin token, not the API key
        with pytest.raises(InferenceServerException) as refused:
            triton.get_model_repository_index(headers={"authorization": f"Bearer {KEY}"})
        assert status_of(refused.value) == "StatusCode.UNAUTHENTICATED"
        index = triton.get_model_repository_index(headers={"authorization": f"Bearer {TOKEN}"}, as_json=True)
        assert [(m["name"], m["state"]) for m in index["models"]] == [(NAME, "READY")]


def test_repository_unload_and_load_over_grpc() -> None:
    admin = {"authorization": f"Bearer {TOKEN}"}
    with grpc_serving(model=["a=tiny-bert", "b=tiny-bert"], served_model_name=None) as (client, _, triton):
        triton.unload_model("b", headers=admin)
        assert triton.is_model_ready("a")
        with pytest.raises(InferenceServerException) as gone:
            triton.infer("b", pairs())
        assert status_of(gone.value) == "StatusCode.UNAVAILABLE", gone.value.message()  # known, unloaded
        [entry] = [
            m
            for m in triton.get_model_repository_index(headers=admin, as_json=True)["models"]
            if m["name"] == "b"
        ]
        assert (entry["state"], entry["reason"]) == ("UNAVAILABLE", "unloaded")
        triton.load_model("b", headers=admin)  # by name alone: as --model declared it
        assert triton.is_model_ready("b")
        triton.unload_model("b", headers=admin)
        stub, channel = raw_stub(client)
        with channel:  # from a path (tritonclient's load_model sends no parameters but config and files)
            path = service_pb2.ModelRepositoryParameter(string_param="tiny-bert")
            load = service_pb2.RepositoryModelLoadRequest(model_name="b", parameters={"path": path})
            stub.RepositoryModelLoad(load, metadata=[("authorization", f"Bearer {TOKEN}")])
        assert triton.is_model_ready("b") and triton.infer("b", pairs()).as_numpy("answer").shape == (2, 1)
        with pytest.raises(InferenceServerException) as bad:
            triton.load_model("no/such", headers=admin)
        assert status_of(bad.value) == "StatusCode.INVALID_ARGUMENT"


# ------------------------------------------------------------------------------------- overload, deadline


def test_overload_is_resource_exhausted_with_retry_after_and_cancel_drops_the_work() -> None:
    with grpc_serving(max_queue_size=1, max_inflight_per_replica=1, max_batch_size=1) as (
        client,
        factory,
        _,
    ):
        engine = client.app.state.engine
        stub, channel = raw_stub(client)
        factory.gate.clear()
        try:
            with ThreadPoolExecutor(2) as pool:
                held = pool.submit(ask, client)
                wait_until(lambda: client.app.state.manager.routable()[0].inflight_batches == 1, what="busy")
                queued = stub.ModelInfer.future(_raw_request())
                wait_until(lambda: engine.scheduler.stats().queued_requests == 1, what="a full queue")
                with pytest.raises(grpc.RpcError) as refused:
                    stub.ModelInfer(_raw_request())
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "queue_full" in refused.value.details()
                assert int(dict(refused.value.trailing_metadata())["retry-after"]) >= 1
                queued.cancel()  # the client goes: its queued windows are dropped
                wait_until(lambda: engine.scheduler.stats().queued_requests == 0, what="the work dropped")
                factory.gate.set()
                assert held.result(timeout=10).status_code == 200
        finally:
            factory.gate.set()
            channel.close()


def test_the_client_deadline_is_the_request_deadline() -> None:
    with grpc_serving() as (_, factory, triton):
        factory.gate.clear()
        try:
            with pytest.raises(InferenceServerException) as late:
                triton.infer(NAME, pairs(), client_timeout=0.5)
            assert status_of(late.value) == "StatusCode.DEADLINE_EXCEEDED"
            with pytest.raises(InferenceServerException) as late:  # Triton's timeout parameter (µs)
                triton.infer(NAME, pairs(), timeout=300_000)
            assert status_of(late.value) == "StatusCode.DEADLINE_EXCEEDED", late.value.message()
        finally:
            factory.gate.set()


def _raw_request() -> Any:
    request = service_pb2.ModelInferRequest(model_name=NAME)
    for name, values in (("question", QUESTIONS[:1]), ("context", CONTEXTS[:1])):
        request.inputs.add(name=name, datatype="BYTES", shape=[len(values)])
        request.raw_input_contents.append(raw_bytes(values))
    return request


# ------------------------------------------------------------------------------------- drain, ports


def test_drain_answers_in_flight_calls_and_refuses_new_ones() -> None:
    with grpc_serving(drain_timeout_s=10.0) as (client, factory, triton):
        app = client.app
        stub, channel = raw_stub(client)
        factory.gate.clear()
        try:
            held = stub.ModelInfer.future(_raw_request())
            wait_until(lambda: app.state.engine.ongoing == 1, what="the call in flight")
            app.state.shutting_down = True  # what SIGTERM does first (serving/frontend/cli.py)
            with pytest.raises(grpc.RpcError) as refused:
                stub.ModelInfer(_raw_request())
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "retry-after" in dict(refused.value.trailing_metadata())
            assert not triton.is_server_ready()
            factory.gate.set()
            assert held.result(timeout=10).outputs[0].name == "answer"  # the admitted call is answered
        finally:
            factory.gate.set()
            channel.close()


def test_sigterm_drains_grpc_calls_in_flight_then_stops() -> None:
    """The real server's SIGTERM path (DrainingServer): a gRPC call admitted before the signal is
    answered when its gang answers within the drain; the server then exits."""
    factory = FakeFactory()
    settings = ServeSettings(
        model="tiny-bert", replicas=1, host="127.0.0.1", port=free_port(), grpc_port=0, drain_timeout_s=10.0
    )
    with draining_server(settings, factory) as (server, app, thread):
        with grpc.insecure_channel(f"127.0.0.1:{app.state.grpc_port}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            factory.gate.clear()
            request = _raw_request()
            request.model_name = "tiny-bert"
            held = stub.ModelInfer.future(request)
            wait_until(lambda: app.state.engine.ongoing == 1, what="the call in flight")
            server.handle_exit(signal.SIGTERM, None)
            time.sleep(0.5)  # draining: the call still waits for its gang
            assert not held.done()
            factory.gate.set()
            assert held.result(timeout=10).model_name == "tiny-bert"
        thread.join(timeout=30)
        assert not thread.is_alive()


def test_a_port_in_use_is_one_line_naming_the_flag() -> None:
    with grpc_serving() as (client, _, _):
        port = client.app.state.grpc_port
        assert bind_problem("127.0.0.1", port, flag="--grpc-port").startswith(
            f"--host 127.0.0.1 --grpc-port {port}: cannot listen there"
        )
    with pytest.raises(ValueError, match="grpc_port=8000 is the HTTP port"):
        ServeSettings(model="tiny-bert", port=8000, grpc_port=8000)


def test_status_codes_follow_rest_s_statuses() -> None:
    assert grpc_call.GrpcError(429, "x").code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert grpc_call.GrpcError(503, "x").trailing_metadata("r")[1] == ("retry-after", "1")
    assert grpc_call.GrpcError(504, "x").code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert grpc_call.GrpcError(500, "x").code == grpc.StatusCode.INTERNAL
