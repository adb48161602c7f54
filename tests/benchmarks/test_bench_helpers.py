"""Pure helpers of the benchmark scripts (no timing, no model runs): span agreement, ratios, configs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_api_workers
import bench_frontend_floor
import bench_kernels
import bench_serving
import serving_procs
import serving_raw
import serving_report

from shardserve.loadtest.overload import process_tree
from shardserve.models.cpu import cpu_capabilities


def _logits(n: int = 2, s: int = 8) -> torch.Tensor:
    out = torch.zeros(n, s, 2)
    out[0, 3, 0], out[0, 5, 1] = 5.0, 5.0  # window 0: span (3, 5)
    out[1, 2, 0], out[1, 2, 1] = 5.0, 5.0  # window 1: span (2, 2)
    return out


def test_best_spans_respect_context_order_and_length():
    ctx = torch.ones(2, 8, dtype=torch.bool)
    ctx[:, 0] = False  # CLS
    assert bench_kernels.best_spans(_logits(), ctx).tolist() == [[3, 5], [2, 2]]
    logits = _logits()
    logits[0, 7, 0] = 9.0  # a start after every end: not a valid span
    assert bench_kernels.best_spans(logits, ctx)[0].tolist() == [3, 5]
    assert bench_kernels.best_spans(_logits(), ctx, max_len=2)[0].tolist() != [3, 5]


def test_compare_logits_ignores_padding_and_counts_changed_spans():
    ref = _logits()
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    ctx = mask.bool()
    out = ref.clone()
    out[1, 7, 0] = 100.0  # on padding: ignored
    assert bench_kernels.compare_logits(ref, out, mask, ctx) == (0.0, 1.0)
    out[0, 4, 1] = 6.0  # window 0's best end moves
    diff, agree = bench_kernels.compare_logits(ref, out, mask, ctx)
    assert diff == pytest.approx(6.0) and agree == 0.5


def test_parse_variants_rejects_unknown_names():
    assert bench_kernels.parse_variants("fp32, bf16") == ["fp32", "bf16"]
    with pytest.raises(ValueError, match="int4"):
        bench_kernels.parse_variants("fp32,int4")


def _result(name: str, qps: float) -> serving_report.Result:
    return serving_report.Result(name, qps, None, None, 0, 0)


def test_ratio_lines_use_the_best_row_of_each_part_and_state_targets():
    rows = [
        _result("(a) raw batched bfloat16, 1 proc", 40.0),
        _result("(a') raw batched bfloat16, 2 procs", 50.0),
        _result("(a2) raw batch 1 bfloat16, 2 procs", 49.0),
        _result("(b) naive FastAPI fp32", 10.0),
        _result("(d) ONNX Runtime fp32, batch 32", 20.0),
        _result("(d) ONNX Runtime int8, batch 1", 25.0),
        _result("(c) shardserve default flags", 45.0),
        _result("(c) shardserve flags #1", 30.0),
        _result("(c) shardserve flags #2", 48.0),
    ]
    text = "\n".join(serving_report.ratio_lines(rows))
    assert "raw forward limit (a) [(a') raw batched bfloat16, 2 procs]: 0.90x  (target >= 0.9x: met)" in text
    assert "naive fp32 server (b) [(b) naive FastAPI fp32]: 4.50x  (target >= 4x: met)" in text
    assert (
        "ONNX Runtime best raw (d) [(d) ONNX Runtime int8, batch 1]: 1.80x  (target >= 2x: NOT met)" in text
    )
    assert "best flags [(c) shardserve flags #2]: 48.0 q/s" in text
    rows.append(_result("(a2) raw batch 1 float32, 2 procs", 60.0))  # batch 1 can be the best raw row
    assert "raw forward limit (a) [(a2) raw batch 1 float32, 2 procs]: 0.75x" in "\n".join(
        serving_report.ratio_lines(rows)
    )
    assert "ONNX Runtime best accurate raw (d, fp32) [(d) ONNX Runtime fp32, batch 32]: 2.25x" in text
    rows.append(_result("(a3) raw batch 8 float32, 2 procs", 64.0))  # and so can small batches
    assert "raw forward limit (a) [(a3) raw batch 8 float32, 2 procs]: 0.70x" in "\n".join(
        serving_report.ratio_lines(rows)
    )


def test_ceiling_line_charges_the_server_process_cpu_to_the_cores():
    c = _result("(c) shardserve default flags", 45.0)
    rows = [_result("(a') raw batched bfloat16, 2 procs", 100.0), c]
    assert not any("ceiling" in line for line in serving_report.ratio_lines(rows, cores=2))  # not measured
    c.server_cpu_ms = 5.0  # at q answers/s the model keeps 2 - 0.005 q cores at 50 answers/core-s
    text = "\n".join(serving_report.ratio_lines(rows, cores=2))
    assert (
        "5.0 ms CPU per answer on 2 cores, batching as good as the limit's: 80.0 q/s = 0.80x the limit"
        in text
    )


def test_cpu_seconds_counts_a_process_and_its_children():
    import subprocess

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}])"],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while serving_procs.cpu_seconds(parent.pid)[2] < 0.3 and time.monotonic() < deadline:
            time.sleep(0.1)
        own, api, children = serving_procs.cpu_seconds(parent.pid)
        assert children >= 0.3 and own < children and api == 0.0  # the child burned 0.3 s, the parent waited
        child = process_tree(parent.pid)[1]
        own, api, children = serving_procs.cpu_seconds(parent.pid, api=[child])  # as an API process
        assert api >= 0.3 and children == 0.0
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the parent and its child
        parent.wait()
    assert serving_procs.cpu_seconds(parent.pid) == (0.0, 0.0, 0.0)  # gone: nothing to count


def test_api_workers_configs_name_their_checkout_and_the_load_is_the_asked_size(tmp_path):
    here = bench_api_workers.parse_config("--api-workers 2 --max-batch-size 8")
    assert here.tree == bench_api_workers.REPO and here.flags == [
        "--api-workers",
        "2",
        "--max-batch-size",
        "8",
    ]
    assert here.label == "--api-workers 2 --max-batch-size 8"
    other = bench_api_workers.parse_config(f"@{tmp_path} --api-workers 2")
    assert other.tree == tmp_path and other.flags == ["--api-workers", "2"]
    assert other.label == f"@{tmp_path} --api-workers 2"
    assert bench_api_workers.parse_config("").label == "(no flags)"
    load = [json.loads(b) for b in bench_api_workers.bodies(5, context_chars=40)]
    assert len({d["question"] for d in load}) == 5 and all(len(d["context"]) == 40 for d in load)
    assert serving_procs.process_cpu_s("/proc/no-such-process") == 0.0
    assert serving_procs.process_cpu_s("/proc/self") > 0


def test_explicit_configs_expand_cores_and_drop_duplicates():
    args = bench_serving.build_parser().parse_args(
        ["--cores", "4", "--extra-config", "--replicas 1 --threads-per-rank {cores}", "--extra-config", ""]
    )
    configs = bench_serving.explicit_configs(args)
    assert configs[0] == ["--pp", "1", "--tp", "1", "--replicas", "2", "--threads-per-rank", "1"]
    assert configs[1:] == [["--replicas", "1", "--threads-per-rank", "4"]]


def test_on_cuda_the_default_rows_share_the_gpus_and_no_ceiling_is_charged_to_the_cores():
    args = bench_serving.build_parser().parse_args(["--device", "cuda"])
    extra = bench_serving.explicit_configs(args)[1:]
    assert extra and all("--ranks-per-gpu" in flags for flags in extra)
    assert serving_report.shared_cores(args) is None
    assert serving_report.shared_cores(bench_serving.build_parser().parse_args(["--cores", "2"])) == 2


def test_machine_info_says_when_onnxruntime_is_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails as if not installed
    info = serving_report.machine_info("float32")
    assert info["onnxruntime"] is None and info["dtype"] == "float32"
    assert (
        info["cpu"]
        and isinstance(info["bf16_units"], bool)
        and info["int8_kernels"] in (None, cpu_capabilities().int8_unit)
    )


def test_onnx_export_keeps_the_mask_and_matches_torch_on_a_padded_batch(tmp_path):
    """Traced on an all-ones mask, a packed forward would drop ``attention_mask`` from the graph
    (ONNX Runtime then refuses the feed) and ignore padding."""
    pytest.importorskip("onnxruntime")
    from shardserve.models.build import build_model
    from shardserve.models.registry import resolve_model

    source = resolve_model("tiny-bert")
    session = bench_kernels.ort_session(source, tmp_path, int8=False, threads=1)
    assert {i.name for i in session.get_inputs()} >= {"input_ids", "attention_mask"}
    ids = torch.randint(1000, 2000, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # (2, 12): the second row padded after 7 tokens
    with torch.no_grad():
        want = build_model(source)(ids, mask, torch.zeros_like(ids))
    got = bench_kernels.ort_forward(session, ids, mask, None)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=1e-4)


def test_big_model_checkpoint_is_sharded_and_loads_as_transformers_wrote_it(tmp_path, monkeypatch):
    """bench_big_model's writer (tensor by tensor, 1 GB shards + index), at a tiny shape and shard
    size: shardserve loads it, and its forward equals transformers' on the same files."""
    import bench_big_model
    from transformers import AutoModelForQuestionAnswering

    from shardserve.models.build import build_model
    from shardserve.models.registry import resolve_model

    tiny = {**bench_big_model.SHAPE, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 3000}  # fmt: skip
    monkeypatch.setattr(bench_big_model, "SHAPE", tiny)
    monkeypatch.setattr(bench_big_model, "SHARD_BYTES", 200_000)
    out = bench_big_model.write_checkpoint(tmp_path / "big")
    assert len(list(out.glob("model-*.safetensors"))) > 1
    source = resolve_model(out)
    ids = torch.randint(5, 2000, (2, 16))
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        got = build_model(source, dtype=torch.bfloat16).float()(ids, mask)
        ref = AutoModelForQuestionAnswering.from_pretrained(out).float()(input_ids=ids, attention_mask=mask)
    assert torch.allclose(got[..., 0], ref.start_logits, atol=1e-5)


def test_first_of_each_shape_picks_one_batch_per_shape_in_order():
    """On cuda the raw rows and the naive server warm every distinct shape once before timing."""
    shapes = [(1, 40), (1, 52), (1, 40), (2, 384), (1, 52), (2, 384), (1, 7)]
    assert serving_raw.first_of_each_shape([torch.zeros(s) for s in shapes]) == [0, 1, 3, 6]
    assert serving_raw.first_of_each_shape([]) == []


def test_big_model_gpu_memory_matches_nvidia_smi_rows_to_rank_pids():
    import bench_big_model

    smi = "4242, 1536\n4243, 2048\n999, 100\n4243, 512\n4244, [N/A]\n"  # pid, MiB (a pid on two GPUs sums)
    assert bench_big_model.gpu_memory([4242, 4243, 4244, 5], smi) == [1536 << 20, 2560 << 20, None, None]
    assert bench_big_model.per_rank([1 << 30, None], [2 << 30, 1 << 30]) == "1.00/2.00 (0.50)  -"


SUMMARY = """================================================
MLPerf Results Summary
================================================
Scenario : Server
Mode     : PerformanceOnly
Completed samples per second    : 46.69
Result is : INVALID
  Performance constraints satisfied : Yes
  Min duration satisfied : Yes
  Min queries satisfied : Yes
  Early stopping satisfied: NO
================================================
Additional Stats
================================================
50.00 percentile latency (ns)   : 10573253
99.00 percentile latency (ns)   : 10929930
"""


def test_mlperf_summary_is_read_as_loadgen_wrote_it():
    import bench_mlperf

    got = bench_mlperf.parse_summary(SUMMARY)
    assert got["samples_per_s"] == 46.69 and got["result"] == "INVALID"
    assert got["latency_ok"] is True and got["early_stopping_ok"] is False
    assert abs(got["p50_ms"] - 10.573253) < 1e-9 and abs(got["p99_ms"] - 10.92993) < 1e-9
    missed = bench_mlperf.parse_summary(
        SUMMARY.replace("constraints satisfied : Yes", "constraints satisfied : NO")
    )
    assert missed["latency_ok"] is False
    offline = bench_mlperf.parse_summary("Scenario : Offline\nSamples per second: 12.5\nResult is : VALID\n")
    assert (
        offline["samples_per_s"] == 12.5
        and offline["early_stopping_ok"] is None
        and offline["p99_ms"] is None
    )


def test_mlperf_qps_search_finds_the_highest_passing_target():
    import bench_mlperf

    def probe(capacity: float, errors_above: float = float("inf")):
        def run(qps: float) -> bench_mlperf.LoadgenRun:
            return bench_mlperf.LoadgenRun(
                "Server", "PerformanceOnly", qps, "VALID", qps <= capacity, True, 1.0, 2.0, target_qps=qps,
                errors={503: 1} if qps > errors_above else {},
            )  # fmt: skip

        return run

    best, runs = bench_mlperf.find_server_qps(probe(30.0), low=0.0, high=100.0, steps=6)
    assert [r.target_qps for r in runs][:3] == [50.0, 25.0, 37.5]
    assert best is not None and 30.0 - 100 / 2**6 <= best <= 30.0
    best, _ = bench_mlperf.find_server_qps(probe(30.0, errors_above=20.0), low=0.0, high=100.0, steps=6)
    assert best is not None and best <= 20.0  # a probe with failed queries never passes
    assert bench_mlperf.find_server_qps(probe(0.5), low=0.0, high=100.0, steps=4)[0] is None


def test_mlperf_server_ratio_names_the_server_that_met_the_slo_at_no_rate():
    import bench_mlperf

    def figures(
        name: str, qps: float | None, probes: list[tuple[float, float]]
    ) -> bench_mlperf.ServerFigures:
        return bench_mlperf.ServerFigures(
            name, server_qps=qps, probes=[{"target_qps": t, "p99_ms": p99} for t, p99 in probes]
        )

    ours = figures("shardserve", 47.4, [(50.6, 130.0), (25.3, 83.0), (47.4, 99.0)])
    naive = figures("naive FastAPI float32", 11.8, [(13.0, 219.0), (11.8, 240.0)])
    assert bench_mlperf.server_ratio(ours, naive, slo_ms=250.0).endswith("shardserve / naive: 4.02x")
    naive = figures("naive FastAPI float32", None, [(13.0, 219.0), (0.8, 108.0), (1.6, 127.0)])
    line = bench_mlperf.server_ratio(ours, naive, slo_ms=107.0)
    assert "no ratio" in line and "shardserve met" not in line
    assert (
        "naive FastAPI float32 met the 107-ms SLO at no probed rate (its slowest probe, 0.8 QPS: p99 108 ms)"
        in line
    )


def test_open_loop_client_answers_every_query_when_the_server_drops_kept_alive_connections():
    """The MLPerf client reuses connections; one the server has closed meanwhile is retried on a fresh one."""
    import asyncio
    import threading

    import http_load

    served = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (head := await reader.readuntil(b"\r\n\r\n")) is not None:
            length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            body = await reader.readexactly(length)
            served.append(body)
            reply = b'{"answers": []}'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(reply), reply))
            await writer.drain()
            if len(served) % 3 == 0:  # as a server whose keep-alive timeout passed
                writer.close()
                return

    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
    threading.Thread(target=loop.run_forever, daemon=True).start()
    client = http_load.OpenLoopClient(server.sockets[0].getsockname()[1], max_connections=2)
    answers, finished = [], threading.Event()

    def done(status: int, payload: bytes) -> None:
        answers.append((status, payload))
        if len(answers) == 12:
            finished.set()

    try:
        for i in range(12):
            client.post(b'{"q": %d}' % i, done)
        assert finished.wait(10)
    finally:
        client.close()
        loop.call_soon_threadsafe(loop.stop)
    assert [s for s, _ in answers] == [200] * 12 and sorted(served) == sorted(
        b'{"q": %d}' % i for i in range(12)
    )


def test_closed_loop_counts_every_answer_that_ends_in_the_window():
    """Throughput is completions per second: an answer in flight when the window opens counts when it
    ends inside it. A server answering in 0.3 s, 4 clients, window [0.15, 1.05] s: answers end at 0.3,
    0.6 and 0.9 s on each connection, 12 in all (8 if only answers started in the window counted)."""
    import asyncio
    import threading

    import http_load

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]))
                await asyncio.sleep(0.3)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                await writer.drain()

    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        out = http_load.closed_loop(
            server.sockets[0].getsockname()[1], [b"{}"], clients=4, warmup_s=0.15, duration_s=0.9
        )
    finally:
        loop.call_soon_threadsafe(loop.stop)
    assert len(out) == 12 and {status for _, status in out} == {200}


def test_frontend_floor_summary_takes_medians_and_compares_with_the_bare_server():
    rows = [{"load": "served", "server": "asgi", "rate": 100.0, "cpu_ms": c} for c in (0.8, 1.0, 0.9)] + [
        {"load": "served", "server": "shardserve", "rate": r, "cpu_ms": 1.8} for r in (90.0, 110.0, 100.0)
    ]
    lines = bench_frontend_floor.summary(rows)
    assert len(lines) == 2
    assert "asgi" in lines[0] and "0.90 ms" in lines[0] and "x the bare" not in lines[0]
    assert "100.0 answers/s" in lines[1] and "2.00x the bare ASGI server's" in lines[1]
    assert bench_frontend_floor.bare_sleep_s(32, 128.0) == 0.25


def test_frontend_floor_bare_servers_answer_as_the_decoder_does():
    from fastapi.testclient import TestClient

    context = "The Denver Broncos defeated the Carolina Panthers 24-10 to win Super Bowl 50."
    ask = {"question": "Who won Super Bowl 50?", "context": context}
    work = bench_frontend_floor.QAWork()
    enc, batch = work.encode(ask["question"], context)
    want = work.decode(enc, batch, context)
    assert want and all(context[a["start"] : a["end"]] == a["text"] for a in want)
    for app in (bench_frontend_floor.asgi_app(work, 0.0), bench_frontend_floor.fastapi_app(work, 0.0)):
        with TestClient(app) as client:
            assert client.get("/readyz").status_code == 200
            got = client.post("/v1/qa", json=ask)
            assert got.status_code == 200
            answers = got.json()["answers"]
            spans = [(a["text"], a["start"], a["end"]) for a in answers]
            assert spans == [(a["text"], a["start"], a["end"]) for a in want]
            # the score went through JSON: equal within a float's round trip
            assert [a["score"] for a in answers] == pytest.approx([a["score"] for a in want], rel=1e-12)


def test_ratio_lines_compare_shardserve_with_litserve_and_mosec():
    rows = [
        _result("(e) LitServe fp32", 20.0),
        _result("(e2) LitServe bf16", 25.0),
        _result("(f) Mosec fp32", 40.0),
        _result("(c) shardserve default flags", 50.0),
    ]
    text = "\n".join(serving_report.ratio_lines(rows))
    assert "LitServe fp32 server (e) [(e) LitServe fp32]: 2.50x" in text
    assert "LitServe bf16 server (e2) [(e2) LitServe bf16]: 2.00x" in text
    assert "Mosec fp32 server (f) [(f) Mosec fp32]: 1.25x" in text
    assert "(f2)" not in text  # not measured: no line


def test_listener_pids_finds_the_process_holding_the_listening_socket():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert serving_procs.listener_pids([os.getpid()], port) == []  # bound, not listening
        s.listen()
        assert serving_procs.listener_pids([os.getpid()], port) == [os.getpid()]
        assert serving_procs.listener_pids([os.getpid()], port + 1 if port < 65535 else port - 1) == []


def test_reap_kills_the_processes_that_outlive_their_server():
    import subprocess

    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        serving_procs.reap([left.pid], timeout_s=0.2)
        assert left.wait(timeout=10) == -signal.SIGKILL
    finally:
        left.kill()
        left.wait()


def _same_answers(got: list[dict], want: list[dict]) -> None:
    assert [[(a["text"], a["start"], a["end"]) for a in g["answers"]] for g in got] == [
        [(a["text"], a["start"], a["end"]) for a in w["answers"]] for w in want
    ]
    for g, w in zip(got, want, strict=True):  # other padding in a batch: equal within float rounding
        assert [a["score"] for a in g["answers"]] == pytest.approx(
            [a["score"] for a in w["answers"]], abs=1e-3
        )


QA_SETTINGS = {"model": "default", "dtype": "float32", "max_seq_len": 384, "threads": 1}


@pytest.fixture(scope="module")
def naive_qa():
    """The naive server's model work (servers/qa_model.py) and its answers to two questions of
    different lengths, each alone (as the naive server answers)."""
    servers = str(Path(bench_serving.HERE, "servers"))
    if servers not in sys.path:
        sys.path.insert(0, servers)
    from qa_model import QAModel

    threads = torch.get_num_threads()
    naive = QAModel(device="cpu", **QA_SETTINGS)
    asks = [{"question": q, "context": c} for q, c in (bench_serving.BUILTIN[0], bench_serving.BUILTIN[3])]
    want = [naive.answer(a["question"], a["context"]) for a in asks]
    assert all(w["answers"] for w in want)
    yield naive, asks, want
    torch.set_num_threads(threads)


def test_qa_model_answers_a_batch_as_each_question_alone(naive_qa):
    naive, asks, want = naive_qa
    _same_answers(naive.answer_batch(asks), want)  # one forward, both padded to the longer


def test_litserve_api_answers_as_the_naive_server(naive_qa):
    """Row (e)'s hooks on a batch of two (decode_request, batch, predict, unbatch, encode_response),
    and LitServe's unbatched loop (--max-batch-size 1: decode_request, predict, encode_response)."""
    pytest.importorskip("litserve")
    import litserve_qa

    naive, asks, want = naive_qa
    api = litserve_qa.QALitAPI(max_batch_size=8, batch_timeout_s=0.01, **QA_SETTINGS)
    api.qa = naive  # what setup("cpu") loads in a worker
    x = api.batch([api.decode_request(a) for a in asks])
    _same_answers([api.encode_response(y) for y in api.unbatch(api.predict(x))], want)
    one = litserve_qa.QALitAPI(max_batch_size=1, batch_timeout_s=0.0, **QA_SETTINGS)
    one.qa = naive
    _same_answers([one.encode_response(one.predict(one.decode_request(asks[1])))], want[1:])


def test_mosec_worker_answers_as_the_naive_server(naive_qa, monkeypatch):
    pytest.importorskip("mosec")
    import mosec_qa

    _, asks, want = naive_qa
    threads = torch.get_num_threads()
    monkeypatch.setenv(mosec_qa.SETTINGS_ENV, json.dumps({"device": "cpu", **QA_SETTINGS}))
    try:
        worker = mosec_qa.QAWorker()  # loads the model as a spawned worker does, from the environment
    finally:
        torch.set_num_threads(threads)
    _same_answers(worker.forward(asks), want)
    _same_answers([worker.forward(asks[0])], want[:1])  # --max-batch-size 1: one body, not a list


# ------------------------------------------------------------------------------ multimodel --paired


def test_paired_runs_alternate_and_the_rates_come_from_the_predicted_gap() -> None:
    import multimodel_paired as mp

    assert mp.run_order(3) == [0, 1, 1, 0, 0, 1]
    gap = {2.0: (1.0, 1.0), 4.0: (0.99, 0.995), 8.0: (0.6, 0.9), 16.0: (0.3, 0.4)}  # (a, b) predicted
    assert mp.choose_rates(lambda r: gap[r], list(gap)) == (8.0, 2.0)
    wide_everywhere = {2.0: (0.5, 0.9), 4.0: (0.5, 0.95), 8.0: (0.5, 0.7)}
    assert mp.choose_rates(lambda r: wide_everywhere[r], list(wide_everywhere)) == (4.0, 8.0)  # the least gap


def test_a_paired_run_lasts_until_its_trace_holds_the_requests_asked_for() -> None:
    import multimodel_paired as mp

    assert mp.run_length(10.0, 0, min_requests=1000, max_run_s=300.0) == 100.0  # at the mean rate
    assert mp.run_length(100.0, 0, min_requests=1000, max_run_s=300.0) == 20.0  # 20 s at the least
    short = mp.run_length(10.0, 0, min_requests=1000, max_run_s=300.0, count=lambda r, s, d: int(0.9 * r * d))
    assert 1000 / 9 <= short < 1.1 * 1000 / 9  # a draw 10 % short: lengthened just enough
    assert mp.run_length(10.0, 0, min_requests=1000, max_run_s=105.0, count=lambda r, s, d: 0) == 105.0


def test_run_paired_measures_each_point_in_alternating_pairs_on_one_trace(tmp_path) -> None:
    import argparse

    import multimodel_paired as mp

    calls = []

    def measure(policy: str, rate: float, cv: float, slo: float, seed: int, duration_s: float) -> dict:
        calls.append((policy, rate, seed, duration_s))
        drift = 0.01 * len(calls)  # the machine slows run by run: a steady drift favours neither side
        att = (0.95 if policy == "auto" else 0.80) - drift
        return {
            "measured": att,
            "predicted": att + 0.02,
            "requests": int(rate * duration_s),
            "placement": policy,
        }

    def predict(policy: str, rate: float, cv: float, slo: float, seed: int) -> float:
        return 1.0 if rate < 5 or policy == "auto" else 0.5

    args = argparse.Namespace(
        paired_policies=("dedicated", "auto"), paired_slos=[10.0], paired_rates=None, seed=7, cv=4.0,
        min_requests=100, max_run_s=45.0, pairs=3,
    )  # fmt: skip
    entries = mp.run_paired(args, measure=measure, predict=predict, capacity=40.0)
    assert [e["rate"] for e in entries] == [6.0, 4.0]  # the widest predicted gap, then none (2: too few)
    first = [c for c in calls if c[1] == 6.0]
    assert [c[0] for c in first] == ["dedicated", "auto", "auto", "dedicated", "dedicated", "auto"]
    assert {c[2] for c in calls} == {7}  # one trace for every run
    assert first[0][3] == 20.0  # 100 requests at 6 req/s take 17 s: 20 s at the least
    e = entries[0]
    assert len(e["att_a"]) == len(e["att_b"]) == len(e["pred_a"]) == 3
    assert e["diff_points"] == [14.0, 16.0, 14.0] and e["diff_mean_points"] == pytest.approx(14.67, abs=0.01)
    assert e["diff_spread_points"] == 2.0
    assert mp.prediction_errors(e) == {"dedicated": 2.0, "auto": 2.0}
    assert "+14.0 +16.0 +14.0" in mp.paired_table(entries)
    # the report's JSON: bench_multimodel's header keys and the "paired" shape
    from shardserve.partitioner.placement.latency import LatencyModel, MeasuredLatency

    out = tmp_path / "paired.json"
    report_args = argparse.Namespace(
        json=out, plots=None, models=2, dtype="float32", pairs=3, min_requests=100
    )
    measured = MeasuredLatency(LatencyModel({(1, 1): {1: 0.05}}), overhead_s=0.001)
    info = {"cpu": "test cpu"}
    assert mp.report_paired(entries, report_args, info, single=0.051, memory=2**20, measured=measured) == 0
    body = json.loads(out.read_text())
    assert body["profile"] == measured.to_dict() and body["single_latency_ms"] == 51.0
    p = body["paired"][0]
    assert {"slo_scale", "cv", "rate", "a", "b", "att_a", "att_b", "pred_a", "pred_b"} <= set(p)
    assert (p["a"], p["b"]) == ("dedicated", "auto")
