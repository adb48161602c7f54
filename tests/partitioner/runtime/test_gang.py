"""Gang runtime over real gloo worker processes: parity, per-rank shards, failures, shutdown.

Parity: the partitioned gang's start/end logits match ``transformers`` within 1e-4 (fp32, CPU)
on padded batches of mixed lengths, for every family's tiny checkpoint (encoders and the Llama /
Qwen2 / Mistral decoders) at every (pp, tp) of the acceptance matrix, for grouped-query attention
with more ranks than key/value heads, and for the real MiniLM weights at (2, 2).
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from shardserve.models.encoder import EncoderForQA
from shardserve.models.registry import ModelSource, resolve_model
from shardserve.partitioner.plan import ParallelDims, make_plan
from shardserve.partitioner.runtime.gang import Gang, GangError, bound_store
from shardserve.partitioner.runtime.rank import (
    OOM_SCORE_RAISE,
    FaultSpec,
    GangSpec,
    RankContext,
    prefer_for_oom_kill,
)
from shardserve.partitioner.stream.driver import StreamGang
from shardserve.partitioner.stream.program import stream_rank, stream_spec
from shardserve.partitioner.stream.verify import compare, sample_batches, verify_partitioned
from shardserve.training.messages import CheckpointSaved
from tests.procs import all_gone, parent_of

TOLERANCE = 1e-4
DIMS = [(1, 1), (2, 1), (3, 1), (1, 2), (2, 2)]


@pytest.mark.parametrize(
    "name",
    [
        "tiny-bert",
        "tiny-roberta",
        "tiny-xlm-roberta",
        "tiny-electra",
        "tiny-albert",
        "tiny-distilbert",
        "tiny-deberta-v2",
        "tiny-modernbert",
        "tiny-llama",
        "tiny-qwen2",
        "tiny-mistral",
    ],
)
@pytest.mark.parametrize(("pp", "tp"), DIMS)
def test_parity_with_transformers(name, pp, tp):
    result = verify_partitioned(resolve_model(name), ParallelDims(pp=pp, tp=tp), tolerance=TOLERANCE)
    assert result.passed, f"max |diff| {result.max_abs:.3g} > {TOLERANCE}"
    assert {s[1] for s in result.batch_shapes} != 1  # mixed padded lengths


def test_parity_with_more_ranks_than_key_value_heads():
    """tp=4 over 2 key/value heads: each rank holds the one (with its bias) its query head reads."""
    result = verify_partitioned(resolve_model("tiny-qwen2"), ParallelDims(pp=1, tp=4))
    assert result.passed, f"max |diff| {result.max_abs:.3g} > {TOLERANCE}"


def test_parity_real_minilm_pp2_tp2():
    result = verify_partitioned(resolve_model("minilm"), ParallelDims(pp=2, tp=2), tolerance=TOLERANCE)
    assert result.passed, f"max |diff| {result.max_abs:.3g} > {TOLERANCE}"


def test_compare_detects_a_difference():
    """The parity comparison itself can fail: a perturbed logit on a real token is caught."""
    batches = sample_batches(resolve_model("tiny-bert"))
    want = [torch.zeros(*b["input_ids"].shape, 2) for b in batches]
    got = [w.clone() for w in want]
    got[1][0, 0, 1] = 1e-3
    result = compare(got, want, batches, tolerance=TOLERANCE)
    assert not result.passed and result.max_abs_end == pytest.approx(1e-3) and result.max_abs_start == 0


def _spec(name="tiny-bert", pp=2, tp=1, **kw) -> GangSpec:
    source = resolve_model(name)
    plan = make_plan(source.config, ParallelDims(pp=pp, tp=tp))
    return GangSpec(source, plan, **kw) if "program" in kw else stream_spec(source, plan, **kw)


def _batch(n=2, s=12):
    ids = torch.randint(1000, 2000, (n, s))
    return ids, torch.ones(n, s, dtype=torch.long)


def test_each_rank_holds_a_quarter_of_the_encoder_at_pp2_tp2():
    source = resolve_model("minilm")
    plan = make_plan(source.config, ParallelDims(pp=2, tp=2))
    with StreamGang(stream_spec(source, plan)) as gang:
        info = gang.stats.ready_info
    cfg = source.config
    h = cfg.hidden_size
    with torch.device("meta"):
        layer_bytes = 4 * sum(p.numel() for p in EncoderForQA(cfg).layers.parameters())  # fp32, all layers
    for rank in range(4):
        share = info[rank]["layer_param_bytes"] / layer_bytes
        # a quarter, plus the LayerNorms and row-parallel biases every tp rank keeps whole
        assert 0.25 < share < 0.26, f"rank {rank} holds {share:.4f} of the encoder layers"
        assert info[rank]["param_bytes"] == 4 * plan.stage_of(rank).params_per_rank
        # each rank read only its own shard from the checkpoint (the QA head is initialised, not read)
        head_bytes = 4 * (2 * h + 2) if plan.stage_of(rank).has_head else 0
        assert info[rank]["checkpoint_bytes_read"] == info[rank]["param_bytes"] - head_bytes
    # stage 0 also holds half the (vocab-parallel) embedding table; stage 1 no embeddings at all
    assert info[0]["param_bytes"] - info[0]["layer_param_bytes"] > 4 * cfg.vocab_size * h / 2
    assert info[2]["param_bytes"] - info[2]["layer_param_bytes"] < 4 * 3 * h


def test_streams_many_micro_batches_in_order():
    with StreamGang(_spec(pp=3)) as gang:
        batches = [_batch(n=1 + k % 3, s=8 + k) for k in range(12)]
        outs = gang.run(batches, timeout_s=60)
        assert gang.stats.completed == 12 and gang.inflight == 0
        # the ranks' OpenMP threads wait passively (partitioner/runtime/gang.py): the variable was in the
        # environment they started with, where OpenMP reads it, unless the user chose another
        want = os.environ.get("OMP_WAIT_POLICY", "PASSIVE").encode()
        for pid in gang.pids():
            with open(f"/proc/{pid}/environ", "rb") as f:
                assert b"OMP_WAIT_POLICY=" + want in f.read().split(b"\0")
    assert [tuple(o.shape) for o in outs] == [(b[0].shape[0], b[0].shape[1], 2) for b in batches]


def test_an_idle_pipeline_outlives_its_collective_timeout():
    """A serving gang waits for traffic as long as there is none: the later stages wait for their
    next micro-batch in a gloo receive, which once failed the gang (and the replica) after the
    process group's timeout of idleness; stage 0 now sends a keep-alive down the pipeline."""
    with StreamGang(_spec(pp=3, collective_timeout_s=2.5)) as gang:
        gang.run([_batch()], timeout_s=30)
        time.sleep(6.0)  # over two timeouts of idleness
        assert gang.healthy, gang.error
        (out,) = gang.run([_batch(n=3, s=9)], timeout_s=30)
    assert tuple(out.shape) == (3, 9, 2)


def test_killed_rank_fails_fast_and_is_named():
    with StreamGang(_spec(pp=2, tp=2)) as gang:
        gang.run([_batch()], timeout_s=60)
        inflight = [gang.submit(*_batch(n=4, s=64)) for _ in range(8)]
        victim = 3
        os.kill(gang.pids()[victim], signal.SIGKILL)
        t0 = time.monotonic()
        for fut in inflight:
            try:
                fut.result(timeout=10)
            except GangError as err:
                assert err.rank == victim and "rank 3 (stage 1, tp 1) was killed by signal 9" in str(err)
        assert time.monotonic() - t0 < 5
        assert not gang.healthy
        with pytest.raises(GangError, match="rank 3"):
            gang.submit(*_batch())
        assert all(p.exitcode is not None for p in gang._procs.values())  # the whole gang is down


def test_a_killed_peer_is_blamed_not_the_stage0_rank_it_took_down():
    """Rank 1 is killed; rank 0 fails on its next send to it and leaves. Submits that meet rank 0
    gone fail with the diagnosis naming rank 1, not with the channel's "rank 0 is not connected"."""
    with StreamGang(_spec(pp=2)) as gang:
        gang.run([_batch()], timeout_s=60)
        os.kill(gang.pids()[1], signal.SIGKILL)
        futures = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5:
            try:
                futures.append(gang.submit(*_batch()))
            except GangError as err:  # the gang failed already: its own error
                assert err is gang.error
                break
            time.sleep(0.005)
        assert futures and gang.error is not None
        for fut in futures:
            with pytest.raises(GangError) as info:
                fut.result(timeout=10)
            assert info.value.rank == 1 and "rank 1 (stage 1, tp 0) was killed by signal 9" in str(info.value)


def test_frozen_rank_is_found_by_its_missing_heartbeat_even_when_idle():
    """SIGSTOP: the process lives, nothing is in flight (no stall to see), but it stops beating."""
    with StreamGang(_spec(pp=2), heartbeat_timeout_s=1.5) as gang:
        gang.run([_batch()], timeout_s=60)
        os.kill(gang.pids()[1], signal.SIGSTOP)
        t0 = time.monotonic()
        while gang.healthy and time.monotonic() - t0 < 20:
            time.sleep(0.1)
        assert not gang.healthy and time.monotonic() - t0 < 6
        assert gang.error is not None and gang.error.rank == 1
        assert re.search(
            r"rank 1 \(stage 1, tp 0\) sent no heartbeat for [\d.]+s \(died, hung", str(gang.error)
        )


def test_raising_rank_reports_its_traceback():
    with StreamGang(_spec(pp=2, fault=FaultSpec(rank=1, mode="raise", at_batch=1))) as gang:
        gang.run([_batch()], timeout_s=60)
        with pytest.raises(
            GangError, match=r"(?s)rank 1 \(stage 1, tp 0\) failed.*injected fault on rank 1"
        ) as info:
            gang.submit(*_batch()).result(timeout=20)
        assert info.value.rank == 1 and "Traceback" in str(info.value)


def test_hung_rank_is_named_within_the_stall_timeout():
    """A stall is the owner's call (serving's fleet, after its stall timeout): the gang's heartbeats
    name the rank stuck inside a micro-batch, and ``fail()`` ends the gang with that diagnosis."""
    with StreamGang(_spec(pp=3, fault=FaultSpec(rank=1, mode="hang", at_batch=1))) as gang:
        gang.run([_batch()], timeout_s=60)
        t0 = time.monotonic()
        fut = gang.submit(*_batch())
        time.sleep(2.0)  # the owner's stall timeout
        stuck, why = gang.stuck_ranks(after_s=1.0)
        gang.fail(GangError(f"{gang.name}: stalled: no micro-batch completed for 2s; {why}", rank=stuck[0]))
        with pytest.raises(
            GangError, match=r"stalled.*stuck \(longest first\): rank 1 \(stage 1, tp 0\)"
        ) as info:
            fut.result(timeout=20)
        assert info.value.rank == 1 and time.monotonic() - t0 < 6


def test_start_failure_names_rank_and_file(tmp_path):
    src = resolve_model("tiny-bert")
    bad_dir = tmp_path / "bad"
    shutil.copytree(src.checkpoint, bad_dir)
    (bad_dir / "model.safetensors").write_bytes(b"\0" * 64)
    source = ModelSource("bad", bad_dir, src.config, bad_dir)
    gang = Gang(stream_spec(source, make_plan(src.config, ParallelDims(pp=2, tp=1))), start_timeout_s=60)
    with pytest.raises(
        GangError, match=r"(?s)rank \d \(stage \d, tp 0\) failed while starting.*model.safetensors"
    ):
        gang.start()
    assert all(p.exitcode is not None for p in gang._procs.values())


def test_clean_stop_frees_processes_and_port():
    gang = StreamGang(_spec(pp=2, tp=2)).start()
    port = int(gang._store.port)
    procs = list(gang._procs.values())
    fut = gang.submit(*_batch())
    gang.stop()
    assert fut.done() and fut.result().shape == (2, 12, 2)  # in-flight work drained, not dropped
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))  # nothing listens on the rendezvous port any more


DRIVER_THAT_FORGETS_TO_STOP = """
from shardserve.models.registry import resolve_model
from shardserve.partitioner.plan import ParallelDims, make_plan
from shardserve.partitioner.stream.driver import StreamGang
from shardserve.partitioner.stream.program import stream_spec

source = resolve_model("tiny-bert")
gang = StreamGang(stream_spec(source, make_plan(source.config, ParallelDims(pp=2, tp=1)))).start()
print(*gang.pids(), flush=True)
"""  # ...and the interpreter exits with the gang running


def test_a_gang_never_outlives_its_driver():
    """Ranks ignore SIGTERM; multiprocessing's exit hook would terminate and join them for ever.
    The gang's own exit hook kills them: the driver exits and no rank is left."""
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER_THAT_FORGETS_TO_STOP],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):  # reaped by the driver: no zombie either
            os.kill(pid, 0)


DRIVER_THAT_IS_KILLED = DRIVER_THAT_FORGETS_TO_STOP + "import time; time.sleep(300)\n"


def test_ranks_leave_at_once_when_their_driver_is_killed():
    """SIGKILL runs no exit hook: the ranks see their driver's process end (not only its silence,
    DRIVER_TIMEOUT_S = 15 s) and leave within seconds."""
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER_THAT_IS_KILLED],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 2
        driver.kill()
        driver.wait(timeout=30)
        assert all_gone(pids, within_s=5)
    finally:
        driver.kill()
        driver.wait(timeout=30)


def test_a_gang_outlives_its_fork_server():
    """Once their fork server dies multiprocessing reads every rank as exited, but they run on: the
    gang watches them through pidfds, keeps answering, stops them cleanly, and the next gang starts
    a new fork server."""
    with StreamGang(_spec(pp=2)) as gang:
        gang.run([_batch()], timeout_s=60)
        server = parent_of(gang.pids()[0])
        assert server != os.getpid()
        os.kill(server, signal.SIGKILL)
        assert all_gone([server], within_s=30)
        time.sleep(1.0)  # the ranks' and the gang's watchers had their chance
        (out,) = gang.run([_batch(n=3, s=10)], timeout_s=60)
        assert gang.healthy and tuple(out.shape) == (3, 10, 2)
        pids = gang.pids()
    assert all_gone(pids, within_s=10)
    with StreamGang(_spec(pp=1)) as again:
        assert parent_of(again.pids()[0]) != server
        again.run([_batch()], timeout_s=60)


def _listen_addresses(port: int) -> set[str]:
    """Local addresses of the sockets LISTENing on ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, hexport = local.split(":")
                if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                    found.add("127.0.0.1" if addr == "0100007F" else addr)
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc/net")
def test_rendezvous_store_listens_on_loopback_only():
    """The unauthenticated TCPStore of a local gang is not reachable from other hosts (issue 11.5)."""
    store = bound_store(2, timeout=timedelta(seconds=5))
    assert _listen_addresses(int(store.port)) == {"127.0.0.1"}
    del store
    gang = StreamGang(_spec(pp=2)).start()
    try:
        port = int(gang._store.port)
        # the driver's channel (ZeroMQ ROUTER + PULL) too
        channel_ports = [int(ep.rsplit(":", 1)[1]) for ep in gang._channel.endpoints.split(";")]
        for p in (port, *channel_ports):
            assert _listen_addresses(p) == {"127.0.0.1"}  # not 0.0.0.0 / :: (every interface)
        assert gang.run([_batch()], timeout_s=60)[0].shape == (2, 12, 2)
    finally:
        gang.stop()
    assert all(_listen_addresses(p) == set() for p in (port, *channel_ports))


def test_spec_names_its_program_explicitly():
    spec = _spec()
    assert spec.program is stream_rank  # the forward stream, named by its spec
    assert pickle.loads(pickle.dumps(spec)).program is stream_rank  # spawn pickles it by name
    with pytest.raises(TypeError, match="module-level function"):
        _spec(program=lambda ctx, *, ready: None)


def report_and_finish(ctx: RankContext, *, ready) -> None:
    """A program that runs to completion: ready, one message from the last rank, done."""
    ready({"stage": ctx.stage})
    if ctx.is_last:
        ctx.link.send(CheckpointSaved(ctx.rank, step=1, final=True))


def test_gang_joins_a_program_and_hands_over_its_messages():
    gang = Gang(_spec(pp=2, program=report_and_finish), name="run").start()
    got = []
    try:
        gang.join(on_message=got.append, timeout_s=60)
    finally:
        gang.stop()
    assert got == [CheckpointSaved(1, step=1, final=True)]
    assert gang.stats.ready_info[1]["stage"] == 1


def report_environment(ctx: RankContext, *, ready) -> None:
    """A program that reports what its rank saw: a variable of the driver's, its parent, and its
    standing with the OOM killer."""
    oom = Path("/proc/self/oom_score_adj")
    ready(
        {
            "mark": os.environ.get("SHARDSERVE_TEST_MARK"),
            "parent": os.getppid(),
            "oom_score_adj": int(oom.read_text()) if oom.exists() else None,
        }
    )


def test_ranks_fork_from_the_fork_server_and_see_the_drivers_environment_of_now(monkeypatch):
    """Ranks fork from one fork server that imported torch once (``rank_context``), which keeps the
    environment it started with: a variable the driver set since still reaches the ranks."""
    with StreamGang(_spec(pp=1)):  # the fork server runs from here on
        pass
    monkeypatch.setenv("SHARDSERVE_TEST_MARK", "set after the fork server started")
    gang = Gang(_spec(pp=2, program=report_environment), name="env").start()
    try:
        gang.join(timeout_s=60)
    finally:
        gang.stop()
    info = gang.stats.ready_info
    assert [info[r]["mark"] for r in (0, 1)] == ["set after the fork server started"] * 2
    parents = {info[r]["parent"] for r in (0, 1)}
    assert len(parents) == 1 and os.getpid() not in parents  # one fork server, not the driver
    oom = Path("/proc/self/oom_score_adj")
    if oom.exists():  # Linux: ranks go before the driver and the fork server when memory runs out
        raised = min(1000, int(oom.read_text()) + OOM_SCORE_RAISE)
        assert [info[r]["oom_score_adj"] for r in (0, 1)] == [raised] * 2


def test_a_rank_raises_its_oom_score_relative_to_what_it_was(tmp_path):
    adj = tmp_path / "oom_score_adj"
    for before, after in ((0, OOM_SCORE_RAISE), (-997, -997 + OOM_SCORE_RAISE), (700, 1000)):
        adj.write_text(f"{before}\n")
        assert prefer_for_oom_kill(str(adj)) == after
        assert int(adj.read_text()) == after
    adj.write_text("not a number")
    assert prefer_for_oom_kill(str(adj)) is None
    assert prefer_for_oom_kill(str(tmp_path / "missing")) is None


def test_kill_ends_a_start_held_by_a_rank_hung_while_loading():
    """``kill()`` from another thread (the server's stop-now) ends a ``start()`` that a rank hung
    while loading would hold until ``start_timeout_s``, and leaves no rank behind."""
    import threading

    gang = StreamGang(_spec(pp=2, fault=FaultSpec(rank=1, mode="hang", at_batch=-1)), start_timeout_s=300)
    failure: list[BaseException] = []

    def start() -> None:
        try:
            gang.start()
        except BaseException as err:  # the test inspects it
            failure.append(err)

    thread = threading.Thread(target=start)
    thread.start()
    deadline = time.monotonic() + 60
    while len(gang.pids()) < 2 and time.monotonic() < deadline:  # both ranks spawned
        time.sleep(0.05)
    time.sleep(1.0)  # rank 1 is loading (and hangs there)
    pids = gang.pids()
    t0 = time.monotonic()
    gang.kill()
    thread.join(timeout=30)
    assert not thread.is_alive() and time.monotonic() - t0 < 15
    # "killed while starting" (the flag) or "rank N ... was killed by signal 9 while starting" (the
    # diagnosis of the dead ranks), whichever the start loop sees first
    assert failure and isinstance(failure[0], GangError) and "killed" in str(failure[0]), failure
    gang.stop(timeout_s=0)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone (and reaped)
