"""The engine core and an API process in one test process (``--api-workers`` without the processes):
the core's app on fake gangs with its ``CoreServer``, and an API app (``build_app(settings, core=...)``)
joined over the real ipc socket. The API app must answer as the core's own routes do, forward what
is off the hot path, count in the core's one registry, refuse before tokenizing, and a gone API
process must give its places and queued work back.

Run: python -m pytest tests/serving/engine/test_core_server.py -q      (no worker processes; seconds)
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import zmq
import zmq.asyncio
from fastapi.testclient import TestClient
from tritonclient.utils import InferenceServerException

import shardserve.serving.engine.core_client as cc
from shardserve.models.qa_windows import WindowConfig, encode_qa
from shardserve.models.registry import resolve_model
from shardserve.partitioner.runtime.fake_gang import FakeFactory, fake_logits
from shardserve.partitioner.runtime.wire import WireError, decode, decode_many, encode, encode_many, new_key
from shardserve.serving.engine import core_wire as cw
from shardserve.serving.engine.client import EngineClient, LocalCore
from shardserve.serving.engine.core_client import CoreClient
from shardserve.serving.engine.input_processor import AdmissionAsk, InputProcessor
from shardserve.serving.engine.output_processor import OutputProcessor
from shardserve.serving.engine.qa_types import CoreAnswer
from shardserve.serving.frontend.api_role import CoreLink
from shardserve.serving.frontend.app import build_app
from shardserve.serving.frontend.settings import ServeSettings
from tests.serving.frontend.api_helpers import CONTEXT, QUESTION, TOKEN, wait_busy, wait_until

VOLATILE = ("request_id", "latency_ms", "id")


@contextlib.contextmanager
def core_and_api(**overrides: Any) -> Iterator[tuple[TestClient, TestClient, FakeFactory]]:
    """The core's app (fake gangs, ``api_workers=2``: its CoreServer runs, no processes are spawned)
    and one API app joined to it; both ready."""
    factory = FakeFactory()
    kw: dict[str, Any] = dict(
        model="tiny-bert",
        replicas=1,
        max_queue_delay_ms=1.0,
        drain_timeout_s=5.0,
        admin_token=TOKEN,
        api_workers=2,
    )
    kw.update(overrides)
    core_app = build_app(ServeSettings(**kw), backend_factory=factory)
    with TestClient(core_app) as core:
        wait_until(lambda: core.get("/readyz").status_code == 200, what="a ready core")
        server = core_app.state.core_server
        link = CoreLink(
            endpoint=server.endpoint,
            key=server.key,
            identity="w0.0",
            parent_pid=None,
            grpc_address=server.grpc_address,
        )
        settings = core_app.state.settings.model_copy(update={"admin_token": None})  # as the pool's
        with TestClient(build_app(settings, core=link)) as api:
            wait_until(lambda: api.get("/readyz").status_code == 200, what="a ready API app")
            try:
                yield core, api, factory
            finally:
                factory.gate.set()


def same(a: Any, b: Any) -> None:
    """Two answers alike but for their request ids and latencies."""
    assert a.status_code == b.status_code, (a.text, b.text)
    ja, jb = a.json(), b.json()
    for j in (ja, jb):
        for k in VOLATILE:
            j.pop(k, None)
    assert ja == jb


def metric(client: TestClient, line: str) -> float | None:
    m = re.search(rf"^{re.escape(line)} (\S+)$", client.get("/metrics").text, re.M)
    return None if m is None else float(m.group(1))


def test_both_processes_answer_through_the_same_client_and_processors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One request path: the server's own process and an API process each answer with an
    ``EngineClient`` (one ``submit_async``), tokenizing with its ``InputProcessor`` and decoding with
    its ``OutputProcessor``; only the core link differs (in-process vs ZeroMQ)."""
    seen: list[tuple[str, int]] = []
    encode, decode = InputProcessor.encode, OutputProcessor.decode

    def spy_encode(self: InputProcessor, pairs: Any) -> Any:
        seen.append(("encode", id(self)))
        return encode(self, pairs)

    async def spy_decode(self: OutputProcessor, *args: Any) -> Any:
        seen.append(("decode", id(self)))
        return await decode(self, *args)

    monkeypatch.setattr(InputProcessor, "encode", spy_encode)
    monkeypatch.setattr(OutputProcessor, "decode", spy_decode)
    with core_and_api() as (core, api, _):
        one = {"question": QUESTION, "context": CONTEXT}
        for side in (api, core):
            client = side.app.state.clients.client()
            assert type(client) is EngineClient
            seen.clear()
            assert side.post("/v1/qa", json=one).status_code == 200
            assert seen == [("encode", id(client.inputs)), ("decode", id(client.outputs))]
        remote, local = api.app.state.clients.client(), core.app.state.clients.client()
        assert isinstance(remote.core, CoreClient) and isinstance(local.core, LocalCore)
        assert (
            core.app.state.core_server.core is not local.core
        )  # the core answers API processes with its own


def test_an_api_process_answers_as_the_core_does() -> None:
    kw = dict(max_seq_len=64, doc_stride=16, max_question_len=16, length_buckets="32,64")
    long_context = " ".join([CONTEXT] * 6)
    with core_and_api(**kw) as (core, api, _):
        one = {"question": QUESTION, "context": CONTEXT, "top_k": 3}
        same(api.post("/v1/qa", json=one), core.post("/v1/qa", json=one))
        items = {"items": [one, {"question": "When?", "context": long_context, "top_k": 2}]}
        r = api.post("/v1/qa/batch", json=items)
        assert r.json()["results"][1]["windows"] > 3
        same(r, core.post("/v1/qa/batch", json=items))
        v2 = {
            "inputs": [
                {"name": "question", "datatype": "BYTES", "shape": [1], "data": [QUESTION]},
                {"name": "context", "datatype": "BYTES", "shape": [1], "data": [CONTEXT]},
            ]
        }
        same(
            api.post("/v2/models/tiny-bert/infer", json=v2), core.post("/v2/models/tiny-bert/infer", json=v2)
        )
        # the errors of one process, from the other
        same(
            api.post("/v1/qa", json={**one, "model": "nope"}),
            core.post("/v1/qa", json={**one, "model": "nope"}),
        )
        same(
            api.post("/v1/qa", json={**one, "context": ""}), core.post("/v1/qa", json={**one, "context": ""})
        )
        for path in ("/v2/models/nope/ready", "/v2/models/tiny-bert/ready", "/readyz", "/v2/health/ready"):
            assert api.get(path).status_code == core.get(path).status_code, path


def test_routes_off_the_hot_path_are_answered_by_the_core() -> None:
    """The API app has no admin token and no models: the core's app answers those routes, auth too."""
    with core_and_api() as (core, api, _):
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert api.get("/v1/models").json() == core.get("/v1/models").json()
        assert (
            api.get("/admin/replicas", headers=auth).json()
            == core.get("/admin/replicas", headers=auth).json()
        )
        assert api.get("/admin/replicas").status_code == 401
        assert api.get("/v2/repository/index", headers=auth).status_code == 200
        assert api.get("/ui/status").json()["models"][0]["name"] == "tiny-bert"
        assert api.get("/v2/models/tiny-bert/config").json() == core.get("/v2/models/tiny-bert/config").json()
        r = api.get("/v2/models/stats", headers={"X-Request-ID": "abc-123"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"


def test_api_process_requests_count_in_the_cores_one_registry() -> None:
    with core_and_api() as (core, api, _):
        for _ in range(3):
            assert api.post("/v1/qa", json={"question": QUESTION, "context": CONTEXT}).status_code == 200
        assert api.post("/v1/qa", json={"question": QUESTION, "context": ""}).status_code == 422
        assert core.post("/v1/qa", json={"question": QUESTION, "context": ""}).status_code == 422
        assert core.post("/v1/qa", json={"question": QUESTION, "context": CONTEXT}).status_code == 200
        ok = 'shardserve_requests_total{endpoint="qa",model="tiny-bert",status="200"}'
        assert metric(api, ok) == 4.0  # the API app flushes its own events before it forwards /metrics
        assert metric(core, 'shardserve_requests_total{endpoint="qa",model="",status="422"}') == 2.0
        assert metric(core, 'shardserve_inferences_total{model="tiny-bert"}') == 4.0
        for phase in ("compute_input", "queue", "compute_infer", "compute_output"):
            line = f'shardserve_request_phase_seconds_count{{model="tiny-bert",phase="{phase}"}}'
            assert metric(core, line) == 4.0, phase
        assert (
            metric(
                core,
                'shardserve_inference_request_duration_seconds_count{model="tiny-bert",outcome="success"}',
            )
            == 4.0
        )
        stats = api.get("/v2/models/tiny-bert/stats").json()["model_stats"][0]
        assert stats["inference_count"] == 4


def test_a_full_queue_refuses_an_api_process_before_it_tokenizes() -> None:
    with core_and_api(max_queue_size=2, max_inflight_per_replica=1, max_batch_size=1) as (core, api, factory):
        engine = core.app.state.engine
        remote = api.app.state.clients.client()
        tokenized: list[int] = []
        encode_timed = remote.inputs.encode_timed
        remote.inputs.encode_timed = lambda pairs: tokenized.append(len(pairs)) or encode_timed(pairs)
        factory.gate.clear()
        body = {"question": QUESTION, "context": CONTEXT}
        with ThreadPoolExecutor(4) as pool:
            held = [pool.submit(api.post, "/v1/qa", json=body)]
            wait_busy(core)
            held += [pool.submit(api.post, "/v1/qa", json=body) for _ in range(2)]
            wait_until(lambda: engine.scheduler.stats().queued_requests == 2, what="a full queue")
            tokenized.clear()
            r = api.post("/v1/qa", json=body)
            assert r.status_code == 429 and r.json()["error"] == "queue_full"
            assert int(r.headers["Retry-After"]) >= 1 and tokenized == []
            factory.gate.set()
            assert [f.result(timeout=10).status_code for f in held] == [200] * 3
        assert engine.ongoing == 0 and engine.scheduler.reserved == 0


def test_a_gone_api_process_gives_back_its_places_and_queued_work() -> None:
    """``forget_worker``: a reserved place and a queued request of the dead process are given back,
    the request counted as failed; another process's requests are untouched."""
    with core_and_api() as (core, api, factory):
        state = core.app.state
        engine, server = state.engine, state.core_server
        factory.gate.clear()
        with ThreadPoolExecutor(1) as pool:
            other = pool.submit(api.post, "/v1/qa", json={"question": QUESTION, "context": CONTEXT})
            wait_until(lambda: engine.ongoing == 1, what="the other process's request")
            tok = engine.model.tokenizer
            enc = encode_qa(tok, [QUESTION], [CONTEXT], window=WindowConfig())

            async def doomed() -> None:
                client = CoreClient(endpoint=server.endpoint, key=server.key, identity="w9.0")
                await client.start()
                await client.reserve("w9.0-1", "tiny-bert", AdmissionAsk(1, 1, 0.0), timeout_s=None)
                client.submit("w9.0-1", enc, input_s=0.001)
                await client.reserve("w9.0-2", "tiny-bert", AdmissionAsk(1, 1, 0.0), timeout_s=None)
                for _ in range(100):
                    if engine.ongoing == 2:
                        break
                    await asyncio.sleep(0.01)
                await client.stop()

            core.portal.call(doomed)
            assert engine.ongoing == 2 and engine.scheduler.reserved == 1
            failed = 'shardserve_inference_request_duration_seconds_count{model="tiny-bert",outcome="fail"}'
            assert core.portal.call(_forget, server, "w9.0") == 2
            assert engine.ongoing == 1 and engine.scheduler.reserved == 0
            assert metric(core, failed) == 1.0
            factory.gate.set()
            assert other.result(timeout=10).status_code == 200
        assert engine.ongoing == 0


async def _forget(server: Any, identity: str) -> int:
    return server.forget_worker(identity)


def test_the_core_reads_a_bundle_and_answers_it_with_one() -> None:
    """What an API process sends in one loop turn arrives as one bundle, and what the core answers in
    its turn goes back as one."""
    with core_and_api() as (core, _, _):
        engine, server = core.app.state.engine, core.app.state.core_server

        async def exchange() -> list[Any]:
            ctx = zmq.asyncio.Context()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, b"w8.0")
            sock.connect(server.endpoint)
            try:
                bundle = [
                    cw.Hello(1),
                    cw.Reserve("w8.0-1", "tiny-bert", 1, 1, 0.0, None),
                    cw.Reserve("w8.0-2", "nope", 1, 1, 0.0, None),
                    cw.Reserve("w8.0-3", "tiny-bert", 1, 1, 0.0, None),
                ]
                await sock.send_multipart(encode_many(bundle, server.key))
                return decode_many(await asyncio.wait_for(sock.recv_multipart(), 5.0), server.key)
            finally:
                sock.close(linger=0)
                ctx.term()

        got = core.portal.call(exchange)
        assert cw.State in {type(m) for m in got}  # the answer to Hello, in the same bundle
        got = [m for m in got if not isinstance(m, cw.State)]
        assert [type(m) for m in got] == [cw.Reserved, cw.Failed, cw.Reserved]
        assert (got[1].rid, got[1].status, got[1].code) == ("w8.0-2", 404, "model_not_found")
        assert engine.scheduler.reserved == 2
        assert core.portal.call(_forget, server, "w8.0") == 2 and engine.scheduler.reserved == 0


def test_a_bundle_the_socket_refuses_fails_its_calls_with_503() -> None:
    """The core's queue is full (ZeroMQ's high-water mark): the calls of the bundle end at once."""

    async def run() -> tuple[int, str]:
        client = CoreClient(endpoint="ipc:///nowhere", key=new_key(), identity="w0.0")
        refused = asyncio.get_running_loop().create_future()
        refused.set_exception(zmq.Again())
        client._sock.send_multipart = lambda frames, flags=0: refused
        call = asyncio.ensure_future(client.reserve("w0.0-1", "m", AdmissionAsk(1, 1, 0.0), timeout_s=None))
        try:
            await asyncio.wait_for(call, 2.0)
        except cc.EngineError as err:
            return err.status, err.code
        finally:
            client._sock.close(linger=0)
            client._ctx.term()
        return 0, ""

    assert asyncio.run(run()) == (503, "core_unreachable")


def test_a_draining_core_stops_its_api_processes_taking_new_work() -> None:
    with core_and_api() as (core, api, _):
        core.app.state.shutting_down = True
        wait_until(lambda: api.get("/readyz").status_code == 503, timeout=2.0, what="readiness 503")
        r = api.post("/v1/qa", json={"question": QUESTION, "context": CONTEXT})
        assert r.status_code == 503 and r.headers["Retry-After"]
        core.app.state.shutting_down = False


def test_grpc_in_an_api_process_answers_and_the_core_answers_its_own_rpcs() -> None:
    """Inference, metadata and config in the API process; statistics and the repository (admin token,
    which the API process does not hold) from the core's gRPC on its unix socket."""
    with core_and_api(grpc_port=0, host="127.0.0.1") as (core, api, _):
        triton = grpcclient.InferenceServerClient(f"127.0.0.1:{api.app.state.grpc_port}")
        tensors = []
        for name, value in (("question", QUESTION), ("context", CONTEXT)):
            tensor = grpcclient.InferInput(name, [1], "BYTES")
            tensor.set_data_from_numpy(np.array([value.encode()], dtype=np.object_))
            tensors.append(tensor)
        answer = triton.infer("tiny-bert", tensors).as_numpy("answer").ravel()[0].decode()
        rest = core.post("/v1/qa", json={"question": QUESTION, "context": CONTEXT}).json()["answers"][0][
            "text"
        ]
        assert answer == rest
        assert triton.get_model_config("tiny-bert", as_json=True)["config"]["name"] == "tiny-bert"
        stats = triton.get_inference_statistics("tiny-bert", as_json=True)["model_stats"][0]
        assert int(stats["inference_count"]) == 2  # the core's REST one and its own, flushed before it asked
        index = triton.get_model_repository_index(headers={"authorization": f"Bearer {TOKEN}"}, as_json=True)
        assert [m["name"] for m in index["models"]] == ["tiny-bert"]
        with pytest.raises(InferenceServerException, match=r"UNAUTHENTICATED|admin"):
            triton.get_model_repository_index()
        triton.close()


# ------------------------------------------------------------------ the wire, pure


def test_windows_and_logits_cross_the_wire_unchanged() -> None:
    tok = resolve_model("tiny-bert").tokenizer()
    window = WindowConfig(max_seq_len=64, doc_stride=16, max_question_len=16)
    enc = encode_qa(tok, [QUESTION, "When?"], [CONTEXT, " ".join([CONTEXT] * 3)], window=window)
    key = new_key()
    back = cw.encoded_of(decode(encode(cw.submit_of("w0.0-1", enc, input_s=0.5), key), key))
    assert len(back.windows) == len(enc.windows) > 2 and back.pad_token_id == enc.pad_token_id
    for a, b in zip(enc.windows, back.windows, strict=True):
        assert torch.equal(a.data.to(torch.int32), b.data)
        assert (a.example_index, a.window_index) == (b.example_index, b.window_index)
    rows = [fake_logits(w.input_ids[None])[0] for w in enc.windows]  # (n_tokens, 2) each
    answer = decode(encode(cw.answer_of("w0.0-1", CoreAnswer(rows, 0.1, 0.0)), key), key)
    assert all(torch.equal(a, b) for a, b in zip(rows, cw.logits_of(answer), strict=True))
    assert answer.queue_s == 0.1 and answer.infer_s == 0.0
    with pytest.raises(WireError):
        decode(encode(cw.Cancel("x"), new_key()), key)
    bad = cw.Submit("r", 0, 1, 0.0, np.array([[5, 0, 0]], dtype=np.int32), np.zeros((3, 4), dtype=np.int32))
    with pytest.raises(ValueError, match="does not fit"):
        cw.encoded_of(bad)
    bad = cw.Submit("r", 0, 1, 0.0, np.array([[2, 1, 0]], dtype=np.int32), np.zeros((2, 4), dtype=np.int32))
    with pytest.raises(ValueError, match="does not fit"):  # pair 1 of a 1-pair request
        cw.encoded_of(bad)


def test_a_client_notices_a_silent_core() -> None:
    """No State for CORE_TIMEOUT_S: open calls fail 503, and the API process is told to stop."""

    lost = threading.Event()

    async def run() -> tuple[int, str]:
        key = new_key()
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        client = CoreClient(
            endpoint=f"tcp://127.0.0.1:{port}", key=key, identity="w0.0", on_core_lost=lost.set
        )
        start = asyncio.ensure_future(client.start(timeout_s=5.0))
        ident, *frames = await router.recv_multipart()
        assert isinstance(decode(frames, key), cw.Hello)
        await router.send_multipart([ident, *encode(cw.State({"models": {}}), key)])
        await start
        call = asyncio.ensure_future(client.reserve("w0.0-1", "m", AdmissionAsk(1, 1, 0.0), timeout_s=None))
        try:
            await asyncio.wait_for(call, 5.0)
        except cc.EngineError as err:
            return err.status, err.code
        finally:
            await client.stop()
            router.close()
            ctx.term()
        return 0, ""

    saved = cc.CORE_TIMEOUT_S
    cc.CORE_TIMEOUT_S = 0.3
    try:
        t0 = time.monotonic()
        assert asyncio.run(run()) == (503, "core_lost")
        assert lost.is_set() and time.monotonic() - t0 < 3.0
    finally:
        cc.CORE_TIMEOUT_S = saved
