"""Engine (scheduler driver) over fake gangs: dynamic batching, length buckets, token budget,
disconnect cancellation, drain on stop, tokenization off the event loop, one in-flight ledger.
Each test runs its own event loop (``asyncio.run``).

Run: python -m pytest tests/serving/engine/test_engine.py -q
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from transformers import AutoTokenizer

from shardserve.models.qa_windows import WindowConfig
from shardserve.models.registry import resolve_model
from shardserve.partitioner.plan import ParallelDims
from shardserve.partitioner.runtime.fake_gang import FakeFactory
from shardserve.serving.config import SchedulerConfig
from shardserve.serving.engine import input_processor
from shardserve.serving.engine.client import ClientLimits, EngineClient, LocalCore
from shardserve.serving.engine.core import Engine
from shardserve.serving.engine.input_processor import InputProcessor
from shardserve.serving.engine.output_processor import record_end
from shardserve.serving.engine.qa_types import ClientGone, EngineError, QAPair
from shardserve.serving.engine.scheduler import Scheduler
from shardserve.serving.fleet.backend import ModelGeneration, OwnGangs
from shardserve.serving.fleet.pool import DevicePool
from shardserve.serving.fleet.replicas import ReplicaManager
from shardserve.serving.metrics import ServingMetrics

SHORT = QAPair("Who?", "Ann met Bob.")
PHASES = ("compute_input", "queue", "compute_infer", "compute_output")
LIMITS = {
    "window": WindowConfig(),
    "context_cache_bytes": 0,
    "null_threshold": None,
    "max_windows_per_request": 128,
    "default_deadline_s": 30.0,
    "stall_timeout_s": 30.0,
}
LONG_CONTEXT = " ".join(f"Sentence number {i} talks about topic {i * 7} in some detail." for i in range(20))


@pytest.fixture(scope="module")
def model() -> ModelGeneration:
    source = resolve_model("tiny-bert")
    return ModelGeneration(
        0, source, ParallelDims(1, 1), AutoTokenizer.from_pretrained(str(source.tokenizer_dir))
    )


async def _until(cond: Callable[[], Any], what: str, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


class Served:
    """The engine under test and its client (an ``EngineClient`` over a ``LocalCore``, as the server
    builds it): requests go through the client, everything else is the engine's."""

    def __init__(self, engine: Engine, qa: EngineClient) -> None:
        self.engine, self.qa, self.inputs = engine, qa, qa.inputs
        self.submit_async, self.wait = qa.submit_async, qa.wait

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def served(engine: Engine, metrics: Any, **limits: Any) -> Served:
    qa = EngineClient(
        name=engine.name,
        core=LocalCore(lambda _: engine),
        tokenizer=lambda: engine.manager.model.tokenizer,
        limits=ClientLimits(**{**LIMITS, **limits}),
        on_end=functools.partial(record_end, metrics),
    )
    return Served(engine, qa)


def run_engine(
    model: ModelGeneration, body: Callable[[Served, FakeFactory], Awaitable[None]], **sched: Any
) -> FakeFactory:
    """Start a manager with one fake gang + an engine, run ``body``, stop everything."""
    factory = FakeFactory()

    async def main() -> None:
        metrics = ServingMetrics().for_model("m")
        cfg = {"max_queue_delay_ms": 50.0, "max_inflight_per_replica": 2, **sched}
        scheduler = Scheduler(SchedulerConfig(**cfg))
        manager = ReplicaManager(
            gangs=OwnGangs(DevicePool(["cpu"] * 2), factory), model=model, metrics=metrics, ledger=scheduler
        )
        engine = Engine(scheduler=scheduler, manager=manager, metrics=metrics)
        manager.attach(engine)
        await engine.start()
        manager.set_target(1)
        await _until(lambda: manager.ready == 1, "a ready replica")
        client = served(engine, metrics, default_deadline_s=scheduler.config.default_deadline_s)
        try:
            await body(client, factory)
        finally:
            factory.gate.set()
            await engine.stop(timeout_s=2)
            client.qa.shutdown()
            await manager.close(timeout_s=2)

    asyncio.run(main())
    return factory


def test_concurrent_requests_are_batched_together(model: ModelGeneration) -> None:
    async def body(engine: Served, factory: FakeFactory) -> None:
        jobs = [
            await engine.submit_async([QAPair(f"Who is {i}?", "Ann met Bob in Paris.")]) for i in range(5)
        ]
        results = await asyncio.gather(*(engine.wait(j) for j in jobs))
        assert all(r[0].prediction.answers for r in results)

    factory = run_engine(model, body, max_batch_size=8)
    assert [b[0] for b in factory.batches()] == [5]  # one micro-batch of 5 windows


def test_length_buckets_do_not_mix_short_and_long_windows(model: ModelGeneration) -> None:
    async def body(engine: Served, factory: FakeFactory) -> None:
        jobs = [await engine.submit_async([SHORT]) for _ in range(3)]
        jobs += [
            await engine.submit_async([QAPair("What is topic 7?", LONG_CONTEXT[:900])]) for _ in range(2)
        ]
        await asyncio.gather(*(engine.wait(j) for j in jobs))

    factory = run_engine(model, body, length_buckets=(64, 256, 384), max_batch_size=8)
    batches = sorted(factory.batches())
    assert [b[0] for b in batches] == [2, 3]
    long_batch, short_batch = batches
    assert short_batch[1] <= 64 < long_batch[1] <= 256


def test_token_budget_limits_padded_tokens_per_batch(model: ModelGeneration) -> None:
    async def body(engine: Served, factory: FakeFactory) -> None:
        pair = QAPair("What is topic 7?", LONG_CONTEXT[:400])
        jobs = [await engine.submit_async([pair]) for _ in range(6)]
        await asyncio.gather(*(engine.wait(j) for j in jobs))

    factory = run_engine(model, body, length_buckets=(64, 128, 384), max_batch_tokens=384, max_batch_size=32)
    batches = factory.batches()
    assert sum(b[0] for b in batches) == 6
    assert all(size * length <= 384 for size, length in batches) and len(batches) >= 2


def test_long_context_request_completes_when_all_windows_return(model: ModelGeneration) -> None:
    async def body(engine: Served, factory: FakeFactory) -> None:
        engine.inputs.window = WindowConfig(max_seq_len=64, doc_stride=16, max_question_len=16)
        job = await engine.submit_async([QAPair("What is topic 70?", LONG_CONTEXT)])
        (res,) = await engine.wait(job)
        assert res.windows > 5 and res.prediction.answers
        for a in res.prediction.answers:
            assert LONG_CONTEXT[a.start : a.end] == a.text

    run_engine(model, body)


def test_client_disconnect_cancels_queued_work(model: ModelGeneration) -> None:
    async def body(engine: Served, factory: FakeFactory) -> None:
        factory.gate.clear()
        held = await engine.submit_async([SHORT])
        await _until(lambda: engine.manager.routable()[0].inflight_batches == 1, "held batch in flight")
        queued = await engine.submit_async([QAPair("Where?", "Ann met Bob in Paris.")])

        async def gone() -> None:
            await asyncio.sleep(0.05)

        with pytest.raises(ClientGone):
            await engine.wait(queued, disconnected=gone)
        assert engine.scheduler.stats().cancelled == 1 and engine.ongoing == 1
        factory.gate.set()
        assert (await engine.wait(held))[0].prediction.answers

    factory = run_engine(model, body, max_batch_size=1, max_inflight_per_replica=1, max_queue_delay_ms=0.0)
    assert len(factory.batches()) == 1  # the cancelled request never reached the gang


def test_stop_drains_admitted_requests_and_refuses_new_ones(model: ModelGeneration) -> None:
    async def body(engine: Served, factory: FakeFactory) -> None:
        factory.gate.clear()
        jobs = [await engine.submit_async([SHORT]) for _ in range(3)]
        stopping = asyncio.ensure_future(engine.stop(timeout_s=5))
        await asyncio.sleep(0.1)
        with pytest.raises(EngineError) as info:
            await engine.submit_async([SHORT])
        assert info.value.status == 503 and info.value.code == "shutting_down"
        factory.gate.set()
        results = await asyncio.gather(*(engine.wait(j) for j in jobs))
        assert all(r[0].prediction.answers for r in results)
        await stopping

    run_engine(model, body)


def test_stop_timeout_answers_leftovers_503(model: ModelGeneration) -> None:
    async def body(engine: Served, factory: FakeFactory) -> None:
        factory.gate.clear()
        job = await engine.submit_async([SHORT])
        await engine.stop(timeout_s=0.1)
        with pytest.raises(EngineError) as info:
            await engine.wait(job)
        assert info.value.status == 503

    run_engine(model, body)


def test_a_drain_lets_requests_being_tokenized_finish(
    model: ModelGeneration, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request admitted before tokenizing (its queue place reserved) is part of the drain: it is
    queued and answered when its tokens arrive after the drain began, not refused 503."""
    monkeypatch.setattr(input_processor, "INLINE_CHARS", 0)  # tokenized on the thread, the drain meanwhile

    async def body(engine: Served, factory: FakeFactory) -> None:
        encode = engine.inputs.encode

        def slow_encode(pairs: list[QAPair]) -> Any:
            time.sleep(0.3)
            return encode(pairs)

        engine.inputs.encode = slow_encode  # type: ignore[method-assign]
        job = asyncio.ensure_future(engine.submit_async([SHORT]))
        await _until(lambda: engine.scheduler.reserved == 1, "a reserved place")
        stopping = asyncio.ensure_future(engine.stop(timeout_s=5))
        (res,) = await engine.wait(await job)
        assert res.prediction.answers
        await stopping

    run_engine(model, body)


def test_the_drain_time_running_out_answers_leftovers_503_without_stop(model: ModelGeneration) -> None:
    """begin_drain(within_s=...) (the signal handler's call): when the time is out the loop itself
    answers what is left 503, before the HTTP server would cancel those requests (a bare 500)."""

    async def body(engine: Served, factory: FakeFactory) -> None:
        factory.gate.clear()
        job = await engine.submit_async([SHORT])
        engine.begin_drain(within_s=0.2)
        with pytest.raises(EngineError) as info:
            await asyncio.wait_for(engine.wait(job), 3)
        assert (info.value.status, info.value.code) == (503, "shutting_down")
        assert "drain time ran out" in info.value.detail
        engine.begin_drain(within_s=60)  # the first deadline holds
        assert engine.drain_left_s() == 0.0

    run_engine(model, body)


def test_abort_answers_admitted_requests_503_at_once(model: ModelGeneration) -> None:
    """A second signal: every admitted request (queued or in a blocked gang) is answered 503 by the
    loop's next pass, without waiting for the gang, and a later stop() does not wait either."""

    async def body(engine: Served, factory: FakeFactory) -> None:
        factory.gate.clear()  # the gang holds its micro-batches: nothing would finish on its own
        jobs = [await engine.submit_async([SHORT]) for _ in range(5)]
        await asyncio.sleep(0.1)
        engine.abort()
        for job in jobs:  # the gate stays shut: only the abort can answer them
            with pytest.raises(EngineError) as info:
                await engine.wait(job)
            assert (info.value.status, info.value.code) == (503, "shutting_down")
            assert "second signal" in info.value.detail
        with pytest.raises(EngineError) as info:
            await engine.submit_async([SHORT])
        assert info.value.status == 503
        await asyncio.wait_for(engine.stop(timeout_s=60), 10)  # nothing left to drain: no 60 s wait

    run_engine(model, body)


def test_short_text_is_tokenized_on_the_loop_unless_the_thread_is_busy(model: ModelGeneration) -> None:
    """Text of at most INLINE_CHARS is tokenized right on the event loop (a hand-off to the thread
    costs more); while the thread holds the tokenizer, it queues behind it on the thread instead."""
    seen: list[str] = []
    real_encode = InputProcessor.encode

    async def body(engine: Served, factory: FakeFactory) -> None:
        def noting(pairs: list[QAPair]) -> Any:
            seen.append(threading.current_thread().name)
            return real_encode(engine.inputs, pairs)

        engine.inputs.encode = noting  # type: ignore[method-assign]
        assert (await engine.wait(await engine.submit_async([SHORT])))[0].prediction.answers
        assert seen == [threading.current_thread().name]  # the loop's own thread
        with engine.inputs._lock:  # the tokenizer is in use (by the thread)
            task = asyncio.ensure_future(engine.submit_async([SHORT]))
            await _until(lambda: len(seen) == 2, "the second tokenization to start")
        assert (await engine.wait(await task))[0].prediction.answers
        assert seen[1].startswith("shardserve-tokenize"), seen

    run_engine(model, body)


def test_long_text_is_tokenized_off_the_event_loop(model: ModelGeneration, monkeypatch) -> None:
    """``submit_async`` (the HTTP path) tokenizes text longer than INLINE_CHARS on the engine's
    tokenizer thread: while it is being tokenized the event loop keeps running — here it is the loop
    that lets the tokenization finish, so tokenizing on the loop would block for 10 s and fail."""
    long = QAPair(SHORT.question, SHORT.context + " and so on" * (input_processor.INLINE_CHARS // 10))
    release = threading.Event()
    seen: dict[str, str] = {}
    real_encode = InputProcessor.encode

    def gated_encode(self: InputProcessor, pairs: list[QAPair]) -> Any:
        seen["thread"] = threading.current_thread().name
        assert release.wait(timeout=10), "the event loop was blocked while tokenizing"
        return real_encode(self, pairs)

    monkeypatch.setattr(InputProcessor, "encode", gated_encode)

    async def body(engine: Served, factory: FakeFactory) -> None:
        task = asyncio.ensure_future(engine.submit_async([long]))
        await _until(lambda: "thread" in seen, "tokenization to start")
        release.set()
        assert (await engine.wait(await task))[0].prediction.answers

    run_engine(model, body)
    assert seen["thread"].startswith("shardserve-tokenize"), seen


def test_step_schedules_its_wakeup_from_the_same_clock_reading(model: ModelGeneration) -> None:
    """Regression (a wedged queue under load): the loop asked next_batch at `now` but next_wakeup
    at a later clock reading; a batch that became releasable in between was neither dispatched nor
    counted as a timer, so the loop slept until a request deadline while a replica sat idle."""
    ticks = iter(100.0 + 0.01 * k for k in range(10_000))  # every clock read advances 10 ms

    async def main() -> None:
        metrics = ServingMetrics().for_model("m")
        # the idle replica waits for the delay: the timer is what this test is about
        scheduler = Scheduler(
            SchedulerConfig(max_queue_delay_ms=15.0, default_deadline_s=30.0, wait_when_idle=True)
        )
        manager = ReplicaManager(
            gangs=OwnGangs(DevicePool(["cpu"]), FakeFactory()), model=model, metrics=metrics, ledger=scheduler
        )
        manager.set_target(1)
        await _until(lambda: manager.ready == 1, "a ready replica")
        # the loop task is not started: steps are driven here
        core = Engine(scheduler=scheduler, manager=manager, metrics=metrics, clock=lambda: next(ticks))
        manager.attach(core)
        engine = served(core, metrics)
        job = await engine.submit_async([SHORT])
        submitted_at = core.jobs.get(job.request_id).submitted_at
        wake = engine._step()  # one clock read: 10 ms after submit, the 15 ms delay has not passed
        assert wake == pytest.approx(submitted_at + 0.015)  # not the 30 s deadline
        assert engine.scheduler.stats().queued_requests == 1
        engine._step()  # 20 ms after submit: released by timeout
        assert engine.scheduler.stats().batches_by_reason["timeout"] == 1
        assert (await engine.wait(job))[0].prediction.answers
        engine.qa.shutdown()
        await manager.close(timeout_s=2)

    asyncio.run(main())


def test_one_ledger_counts_in_flight_work(model: ModelGeneration) -> None:
    """The replica's in-flight count and the engine's ongoing count are views of the scheduler's."""

    async def body(engine: Served, factory: FakeFactory) -> None:
        factory.gate.clear()
        job = await engine.submit_async([SHORT])
        replica = engine.manager.routable()[0]
        await _until(lambda: replica.inflight_batches == 1, "a batch in flight")
        assert engine.scheduler.inflight(replica.replica_id) == 1
        assert engine.ongoing == engine.scheduler.ongoing == 1
        factory.gate.set()
        assert (await engine.wait(job))[0].prediction.answers
        assert replica.inflight_batches == 0 and engine.ongoing == 0

    run_engine(model, body, max_queue_delay_ms=0.0)


def test_failed_replica_work_fails_over_through_the_attached_listener(model: ModelGeneration) -> None:
    """With the only gang killed, the manager tells the engine at once: a clean 503, no hang."""

    async def body(engine: Served, factory: FakeFactory) -> None:
        factory.gate.clear()
        job = await engine.submit_async([SHORT])
        replica = engine.manager.routable()[0]
        await _until(lambda: replica.inflight_batches == 1, "a batch in flight")
        factory.gangs[0].kill()
        with pytest.raises(EngineError) as info:
            await engine.wait(job)
        assert (info.value.status, info.value.code) == (503, "replica_failed")
        assert engine.ongoing == 0 and engine.scheduler.inflight(replica.replica_id) == 0

    run_engine(model, body, max_queue_delay_ms=0.0)


def test_each_admitted_request_is_one_outcome_and_one_sample_per_phase(model: ModelGeneration) -> None:
    """What Triton's statistics read (serving/metrics.py): per request its outcome with its duration,
    its pairs as inferences when answered, and each phase it went through; per micro-batch returned,
    an execution by its windows. A request whose client went away is a failure."""

    async def body(engine: Served, factory: FakeFactory) -> None:
        def value(name: str, **labels: str) -> float:
            return engine.metrics.all.registry.get_sample_value(
                f"shardserve_{name}", {"model": "m", **labels}
            )

        engine.inputs.window = WindowConfig(max_seq_len=64, doc_stride=16, max_question_len=16)
        jobs = [
            await engine.submit_async([QAPair("What is topic 70?", LONG_CONTEXT)]),
            await engine.submit_async([SHORT, SHORT]),
        ]
        results = await asyncio.gather(*(engine.wait(j) for j in jobs))
        windows = sum(r.windows for rs in results for r in rs)
        assert [value("request_phase_seconds_count", phase=p) for p in PHASES] == [2.0] * len(PHASES)
        assert all(value("request_phase_seconds_sum", phase=p) > 0 for p in PHASES)
        assert value("inference_request_duration_seconds_count", outcome="success") == 2
        assert value("inferences_total") == 3  # pairs
        sizes = {size for size, _ in factory.batches()}
        executed = {b: value("execution_seconds_count", batch_size=str(b)) for b in sizes}
        assert sum(executed.values()) == len(factory.batches())
        assert sum(size * n for size, n in executed.items()) == windows > 5

        factory.gate.clear()  # a request held in flight, one queued behind it whose client goes
        held = await engine.submit_async([SHORT])
        await _until(lambda: engine.manager.routable()[0].inflight_batches == 1, "held batch in flight")
        with pytest.raises(ClientGone):
            await engine.wait(await engine.submit_async([SHORT]), disconnected=lambda: asyncio.sleep(0.05))
        factory.gate.set()
        await engine.wait(held)
        assert value("inference_request_duration_seconds_count", outcome="fail") == 1
        assert value("inference_request_duration_seconds_sum", outcome="fail") >= 0.05
        assert value("inference_request_duration_seconds_count", outcome="success") == 3
        assert value("inferences_total") == 4
        # the phases of answered requests only (Triton's), each counting the same requests
        assert [value("request_phase_seconds_count", phase=p) for p in PHASES] == [3.0] * len(PHASES)
        assert 0 < value("last_inference_timestamp_seconds") <= time.time()

    run_engine(model, body, max_batch_size=4, max_inflight_per_replica=1, max_queue_delay_ms=0.0)


def test_engine_refuses_to_start_unwired(model: ModelGeneration) -> None:
    async def main() -> None:
        metrics = ServingMetrics().for_model("m")
        scheduler = Scheduler(SchedulerConfig())
        manager = ReplicaManager(
            gangs=OwnGangs(DevicePool(["cpu"]), FakeFactory()), model=model, metrics=metrics, ledger=scheduler
        )
        engine = Engine(scheduler=scheduler, manager=manager, metrics=metrics)
        with pytest.raises(RuntimeError, match=r"manager\.attach"):
            await engine.start()

    asyncio.run(main())


def test_stop_now_kills_a_gang_that_is_still_starting(model: ModelGeneration) -> None:
    """A second signal while a gang starts: ``close(timeout_s=0)`` kills it rather than waiting for
    its start (a rank hung while loading held the server until the 300 s start timeout)."""

    async def main() -> None:
        metrics = ServingMetrics().for_model("m")
        scheduler = Scheduler(SchedulerConfig())
        factory = FakeFactory()
        manager = ReplicaManager(
            gangs=OwnGangs(DevicePool(["cpu"] * 2), factory), model=model, metrics=metrics, ledger=scheduler
        )
        manager.set_target(1)
        await _until(lambda: manager.ready == 1, "a ready replica")
        factory.start_s = 600.0  # the next gang does not finish starting by itself
        manager.set_target(2)
        await _until(lambda: len(factory.gangs) == 2, "the second gang starting")
        await asyncio.sleep(0.05)  # its start() is under way on a thread
        t0 = time.monotonic()
        await manager.close(timeout_s=0)
        assert time.monotonic() - t0 < 5.0
        assert not manager.replicas and factory.gangs[1].error is not None  # killed, not left running

    asyncio.run(main())
