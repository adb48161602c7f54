"""Mosec serving the naive server's model work on ``POST /v1/qa``: row (f) of bench_serving.py.

Mosec 0.9 runs a Rust HTTP front end that queues the requests and batches them (up to
``--max-batch-size`` requests, or what came within ``--max-wait-ms`` of the first) to Python worker
processes over Unix sockets. A `QAWorker`'s ``forward`` gets a batch's JSON bodies and runs
``qa_model.QAModel.answer_batch``: tokenize each, pad every window of the batch into ONE forward,
decode each with ``decode_spans``, the naive server's model work (same model, precision, windows
and decoder), answered as ``{"answers": [...]}``. Mosec serves /v1/qa itself (a route of
``append_worker``). It has no readiness route (``GET /`` answers before the workers are up), so
bench_serving waits for a first answer on /v1/qa.

Settings for a 2-core machine (bench_serving passes them; the defaults here are the same):

- ``--workers 2`` worker processes x ``--threads 1`` torch thread each: a worker tokenizes and
  decodes between its forwards, so two single-thread workers overlap one's tokenizing with the
  other's forward where one two-thread worker would leave a core idle (as litserve_qa.py);
- one stage, not Mosec's pipeline of stages (tokenize | forward | decode in separate processes):
  each stage boundary would serialize the windows or logits over IPC, and on 2 cores the stages
  share the same cores anyway; one stage also keeps the comparison with LitServe like for like;
- Mosec reads its own flags off the same command line: ``--port``, ``--address`` (its default
  binds 0.0.0.0), ``--timeout`` in ms (a request's limit, also each batch's; its default, 3 s, is
  below the latency of 32 clients on 2 cores: bench_serving passes 120000) and ``--log-level``.

    python benchmarks/servers/mosec_qa.py --port 8000 --address 127.0.0.1 --timeout 120000
    python benchmarks/servers/mosec_qa.py --port 8000 --dtype bfloat16 --workers 1 --threads 2
    curl -s localhost:8000/v1/qa -d '{"question": "Who wrote Hamlet?", "context": "Hamlet is by Shakespeare."}'
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from mosec import Server, Worker
from qa_model import QAModel, add_model_arguments

logger = logging.getLogger("bench_serving.mosec")

QA_PATH = "/v1/qa"
SETTINGS_ENV = "BENCH_MOSEC_QA"  # the worker's QAModel settings, JSON (a spawned worker gets no arguments)


class QAWorker(Worker):
    """One model process: a batch of /v1/qa bodies in, their answers out (JSON both ways, Mosec's
    default serialization)."""

    def __init__(self) -> None:
        super().__init__()
        self.qa = QAModel(**json.loads(os.environ[SETTINGS_ENV]))

    def forward(self, data: Any) -> Any:
        if isinstance(data, dict):  # --max-batch-size 1: Mosec hands over one request, not a list
            return self.qa.answer_batch([data])[0]
        return self.qa.answer_batch(data)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Mosec on /v1/qa (row (f) of bench_serving.py; see module doc). Mosec's own flags "
        "(--port, --address, --timeout, --log-level, ...) are read by Mosec from the same command line."
    )
    add_model_arguments(p)
    p.add_argument(
        "--max-wait-ms",
        type=int,
        default=10,
        help="how long Mosec waits for a batch to fill, >= 1 (default: %(default)s)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args, _ = build_parser().parse_known_args(argv)  # the rest is Mosec's (it parses sys.argv itself)
    settings = {"model": args.model, "dtype": args.dtype, "device": args.device,
                "max_seq_len": args.max_seq_len, "threads": args.threads}  # fmt: skip
    server = Server()
    server.append_worker(
        QAWorker,
        num=args.workers,
        max_batch_size=args.max_batch_size,
        max_wait_time=max(1, args.max_wait_ms),
        env=[{SETTINGS_ENV: json.dumps(settings)} for _ in range(args.workers)],
        route=QA_PATH,
    )
    logger.info(
        "Mosec: %d worker(s) x %d thread(s), batches of <= %d requests within %d ms",
        args.workers,
        args.threads,
        args.max_batch_size,
        max(1, args.max_wait_ms),
    )
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
