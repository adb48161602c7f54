"""The floor under the server's CPU per answer: shardserve's front end against bare servers doing the
same question-answering work, under the same load, alternating.

``bench_serving`` counts the server process's CPU per answer (issue 30's target: 1.0 ms on an AMX
Xeon, 2.0 ms on Zen 3). This says how much of it any Python server pays. Three servers of the
default model's tokenizer, each with fake logits instead of a model (no ranks: the cores are the
server's and the load generator's alone):

- ``asgi``: a bare ASGI app on uvicorn (uvloop, httptools): ``json.loads``, ``encode_qa`` with the
  server's tokenized-context cache, ``pad_windows``, the compute as a sleep, fake logits,
  ``decode_spans``, ``json.dumps``. Nothing else: no validation, limits, batching, metrics or logs;
- ``fastapi``: the same work behind a FastAPI route with pydantic request and response models;
- ``shardserve``: the real front end (``build_app``: routes, admission, batching, engine, metrics,
  access log) over the API tests' in-process fake gangs (``partitioner/runtime/fake_gang.py``), each
  micro-batch taking ``--batch-s``.

Two loads, each over ``--clients`` closed-loop keep-alive clients with pool questions:

- ``served``: the rate of a served model on 2 cores (~140 q/s: ``--batch-s`` 0.06 per micro-batch
  of ~4 windows on 2 fake replicas); the bare servers sleep ``clients / that rate`` per request, so
  each server wakes as often as the real one does;
- ``saturated``: no compute time: each server as fast as its one event loop goes.

Prints per load and server the answers/s and the CPU per answer (user + system, from /proc), round
after round in turn (the VM's speed drifts: read within a round), then the medians.

    python benchmarks/bench_frontend_floor.py                         # both loads, 3 rounds of 10 s
    python benchmarks/bench_frontend_floor.py --load served --rounds 5

Tests: the pure helpers in ``tests/benchmarks/test_bench_helpers.py``.
"""

# no `from __future__ import annotations`: FastAPI resolves the route models of fastapi_app from their objects
import argparse
import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from bench_serving import DEFAULT_SQUAD, load_pairs  # noqa: E402
from http_load import closed_loop  # noqa: E402
from serving_procs import process_cpu_s  # noqa: E402
from serving_report import machine_info  # noqa: E402

from shardserve.loadtest.local_server import free_port, stop, wait_ready  # noqa: E402

logger = logging.getLogger("bench_frontend_floor")
SERVERS = ("asgi", "fastapi", "shardserve")
LOADS = ("served", "saturated")


# ------------------------------------------------------------------------------------------ servers


class QAWork:
    """What every server does per question, the model's forward aside: ``encode`` before the
    compute, ``decode`` after it."""

    def __init__(self) -> None:
        import torch

        from shardserve.models.context_cache import ContextCache
        from shardserve.models.qa_windows import WindowConfig
        from shardserve.models.registry import resolve_model
        from shardserve.serving.frontend.settings import ServeSettings

        torch.set_num_threads(1)
        defaults = ServeSettings()
        self.tokenizer = resolve_model("default").tokenizer()
        self.window = WindowConfig()
        self.cache = ContextCache(max_bytes=defaults.context_cache_bytes)  # as the server's default

    def encode(self, question: str, context: str) -> tuple[Any, Any]:
        from shardserve.models.qa_windows import encode_qa, pad_windows

        enc = encode_qa(self.tokenizer, [question], [context], window=self.window, context_cache=self.cache)
        return enc, pad_windows(enc.windows, pad_token_id=enc.pad_token_id)

    def decode(self, enc: Any, batch: Any, context: str) -> list[dict[str, Any]]:
        from shardserve.models.qa_decoding import decode_spans
        from shardserve.partitioner.runtime.fake_gang import fake_logits

        logits = fake_logits(batch.input_ids)  # (W, S, 2)
        pred = decode_spans(enc.windows, logits[..., 0], logits[..., 1], context)
        return [{"text": a.text, "score": a.score, "start": a.start, "end": a.end} for a in pred.answers]


def asgi_app(work: QAWork, sleep_s: float) -> Any:
    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        more = True
        while more:
            msg = await receive()
            body, more = body + msg.get("body", b""), msg.get("more_body", False)
        if scope["path"] == "/v1/qa":
            ask = json.loads(body)
            enc, batch = work.encode(ask["question"], ask["context"])
            await asyncio.sleep(sleep_s)
            out = json.dumps({"answers": work.decode(enc, batch, ask["context"])}).encode()
        else:
            out = b'{"status": "ready"}'
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(out))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": out})

    return app


def fastapi_app(work: QAWork, sleep_s: float) -> Any:
    from fastapi import FastAPI
    from pydantic import BaseModel

    class Ask(BaseModel):
        question: str
        context: str

    class Span(BaseModel):
        text: str
        score: float
        start: int
        end: int

    class Answer(BaseModel):
        answers: list[Span]

    app = FastAPI()

    @app.get("/readyz")
    async def readyz() -> dict[str, str]:
        return {"status": "ready"}

    @app.post("/v1/qa", response_model=Answer)
    async def qa(body: Ask) -> Answer:
        enc, batch = work.encode(body.question, body.context)
        await asyncio.sleep(sleep_s)
        return Answer(answers=[Span(**a) for a in work.decode(enc, batch, body.context)])

    return app


def serve(kind: str, port: int, *, sleep_s: float, batch_s: float) -> None:
    """Run one server (a subprocess of this script: ``--serve KIND``) until SIGTERM."""
    import uvicorn

    if kind == "shardserve":
        from shardserve.partitioner.runtime.fake_gang import FakeFactory
        from shardserve.serving.frontend.app import build_app
        from shardserve.serving.frontend.cli import DrainingServer
        from shardserve.serving.frontend.http.protocol import uvicorn_config
        from shardserve.serving.frontend.settings import ServeSettings

        settings = ServeSettings(model="default", replicas=2, port=port, host="127.0.0.1")
        factory = FakeFactory()
        factory.batch_s = batch_s
        app = build_app(settings, backend_factory=factory)
        DrainingServer(uvicorn_config(settings, app), app).run()
        return
    work = QAWork()
    app = asgi_app(work, sleep_s) if kind == "asgi" else fastapi_app(work, sleep_s)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", loop="uvloop", http="httptools")


# ------------------------------------------------------------------------------------------ load


def measure(
    kind: str, bodies: list[bytes], args: argparse.Namespace, *, sleep_s: float, batch_s: float
) -> dict:
    """One server under the closed loop: answers/s and its CPU per answer (ms)."""
    port = free_port()
    cmd = [sys.executable, __file__, "--serve", kind, "--port", str(port)]
    cmd += ["--sleep-s", str(sleep_s), "--batch-s", str(batch_s)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env)
    try:
        wait_ready(f"http://127.0.0.1:{port}", timeout_s=120, proc=proc, all_replicas=True)
        closed_loop(port, bodies, clients=args.clients, warmup_s=0, duration_s=args.warmup_s)
        cpu0 = process_cpu_s(f"/proc/{proc.pid}")
        out = closed_loop(port, bodies, clients=args.clients, warmup_s=0, duration_s=args.duration_s)
        cpu_s = process_cpu_s(f"/proc/{proc.pid}") - cpu0
    finally:
        stop(proc)
    ok = sum(1 for _, status in out if status == 200)
    if ok == 0:
        raise RuntimeError(f"{kind}: no answer in {args.duration_s:g} s ({len(out)} errors)")
    return {"rate": ok / args.duration_s, "cpu_ms": 1000 * cpu_s / ok, "errors": len(out) - ok}


def bare_sleep_s(clients: int, rate: float) -> float:
    """The per-request sleep that makes a bare server with ``clients`` closed-loop clients answer at
    ``rate``/s (its own work aside)."""
    return clients / rate


def summary(rows: list[dict]) -> list[str]:
    """Per (load, server): the median answers/s and CPU per answer over the rounds, and each server's
    CPU against the bare ASGI server's of the same load."""
    lines = []
    for load in LOADS:
        med = {}
        for kind in SERVERS:
            got = [r for r in rows if r["load"] == load and r["server"] == kind]
            if got:
                med[kind] = (
                    statistics.median(r["rate"] for r in got),
                    statistics.median(r["cpu_ms"] for r in got),
                )
        for kind, (rate, cpu) in med.items():
            base = med.get("asgi", (0.0, 0.0))[1]
            vs = f", {cpu / base:.2f}x the bare ASGI server's" if base and kind != "asgi" else ""
            lines.append(f"{load:9s} {kind:10s} {rate:7.1f} answers/s  {cpu:.2f} ms CPU per answer{vs}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--load", choices=(*LOADS, "both"), default="both", help="which load (default: %(default)s)"
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds over the servers (default: %(default)s)")
    p.add_argument("--duration-s", type=float, default=10.0, help="measured seconds per server and round")
    p.add_argument("--warmup-s", type=float, default=3.0, help="unmeasured load first (default: %(default)s)")
    p.add_argument("--clients", type=int, default=32, help="closed-loop clients (default: %(default)s)")
    p.add_argument(
        "--batch-s", type=float, default=0.06,
        help="served load: seconds per fake micro-batch (default %(default)s: ~140 answers/s on 2 fake replicas)",
    )  # fmt: skip
    p.add_argument("--questions", type=int, default=512, help="pool questions the clients send in turn")
    p.add_argument(
        "--squad", type=Path, default=DEFAULT_SQUAD, help="SQuAD-format questions (default: the pool)"
    )
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--serve", choices=SERVERS, help=argparse.SUPPRESS)  # internal: run one server
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--sleep-s", type=float, default=0.0, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.serve:
        serve(args.serve, args.port, sleep_s=args.sleep_s, batch_s=args.batch_s)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for name in ("bench_serving", "httpx", "serving"):
        logging.getLogger(name).setLevel(logging.WARNING)
    info = machine_info("bfloat16")
    logger.info("cpu %s", info["cpu"])
    bodies = [
        json.dumps({"question": q, "context": c}).encode() for q, c in load_pairs(args.squad, args.questions)
    ]
    loads = LOADS if args.load == "both" else (args.load,)
    rows: list[dict] = []
    for r in range(args.rounds):
        for load in loads:
            batch_s = args.batch_s if load == "served" else 0.0
            first = measure("shardserve", bodies, args, sleep_s=0.0, batch_s=batch_s)
            sleep_s = bare_sleep_s(args.clients, first["rate"]) if load == "served" else 0.0
            got = {"shardserve": first}
            for kind in ("asgi", "fastapi"):
                got[kind] = measure(kind, bodies, args, sleep_s=sleep_s, batch_s=0.0)
            for kind in SERVERS:
                rows.append({"round": r, "load": load, "server": kind, **got[kind]})
                logger.info(
                    "round %d %s %s: %.1f answers/s, %.2f ms CPU per answer, %d errors",
                    r, load, kind, got[kind]["rate"], got[kind]["cpu_ms"], got[kind]["errors"],
                )  # fmt: skip
    print(f"cpu: {info['cpu']}; {args.clients} clients, {args.rounds} round(s) of {args.duration_s:g} s")
    for line in summary(rows):
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
