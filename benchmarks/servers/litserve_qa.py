"""LitServe serving the naive server's model work on ``POST /v1/qa``: row (e) of bench_serving.py.

LitServe 0.2 runs API server processes (uvicorn: HTTP, JSON, the request and response queues) in
front of inference worker processes. A worker takes up to ``--max-batch-size`` requests off the
queue, or what came within ``--batch-timeout-ms`` of its first, and runs the `QALitAPI` hooks on
them: ``decode_request`` per request (tokenizing), ``batch`` (every window of the batch padded into
one (W, S) batch), ``predict`` (ONE forward), ``unbatch`` (each request's logits) and
``encode_response`` per request (``decode_spans``). The model work is ``qa_model.QAModel``, the
naive server's: same model, precision, windows and decoder. Answers ``{"answers": [...]}`` as the
naive server does; readiness is LitServe's own ``GET /health`` (200 once every worker is set up).

Settings for a 2-core machine (bench_serving passes them; the defaults here are the same):

- ``--workers 2`` inference workers x ``--threads 1`` torch thread each: a worker tokenizes and
  decodes on its one Python thread between forwards, so one worker with 2 threads leaves a core idle
  while it does; two single-thread workers overlap one's tokenizing and decoding with the other's
  forward (as shardserve's single-thread replicas and the raw row (a') use the cores);
- ``--api-servers 1`` (``num_api_servers``; LitServe's default is one per worker): it only parses
  JSON and moves requests over queues, and a second would take CPU from the model;
- ``fast_queue`` off: its ZMQ transport needs pyzmq, which the ``bench`` extra does not install;
  requests and responses go through a multiprocessing Manager process, LitServe's default;
- ``--timeout-s 120``: how long a request may wait in LitServe's queue (its default, 30 s, is
  close to the latency of 32 clients on 2 cores; the naive server has no limit);
- ``generate_client_file=False`` (LitServe would write client.py into the current directory);
- SIGTERM (how bench_serving stops a server) runs LitServe's Ctrl+C shutdown: LitServe has no
  SIGTERM handler, and without one its workers and API process would outlive it.

    python benchmarks/servers/litserve_qa.py --port 8000                     # default model, fp32
    python benchmarks/servers/litserve_qa.py --port 8000 --dtype bfloat16 --workers 1 --threads 2
    curl -s localhost:8000/v1/qa -d '{"question": "Who wrote Hamlet?", "context": "Hamlet is by Shakespeare."}'
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import litserve as ls
from qa_model import QAModel, add_model_arguments

logger = logging.getLogger("bench_serving.litserve")

QA_PATH = "/v1/qa"
HEALTH_PATH = "/health"


class QALitAPI(ls.LitAPI):
    """The /v1/qa API; pickled into each inference worker, which calls ``setup`` there."""

    def __init__(
        self,
        *,
        model: str,
        dtype: str,
        max_seq_len: int,
        threads: int,
        max_batch_size: int,
        batch_timeout_s: float,
    ) -> None:
        super().__init__(max_batch_size=max_batch_size, batch_timeout=batch_timeout_s, api_path=QA_PATH)
        self.settings = {"model": model, "dtype": dtype, "max_seq_len": max_seq_len, "threads": threads}
        self.qa: QAModel | None = None

    def setup(self, device: str) -> None:
        self.qa = QAModel(device=device, **self.settings)

    # decode_request's argument and encode_response's result carry no annotations: LitServe makes
    # them the FastAPI route's request and response types (none: the request's JSON, a JSON response)
    def decode_request(self, request):
        """A /v1/qa body (dict) -> (its `EncodedBatch`, its context)."""
        return self.qa.encode(request["question"], request["context"]), request["context"]

    def batch(self, inputs: list[tuple[Any, str]]) -> tuple[list[tuple[Any, str]], Any]:
        """The requests and every window of theirs in one `WindowBatch`, (W, S)."""
        return inputs, self.qa.pad([enc for enc, _ in inputs])

    def predict(self, x: Any) -> Any:
        """Batched: (requests, their logits (W, S, 2)). Unbatched (--max-batch-size 1: LitServe calls
        neither batch nor unbatch): one request's (encoding, logits, context), as unbatch gives."""
        if self.max_batch_size == 1:
            enc, context = x
            return enc, self.qa.forward(self.qa.pad([enc])), context
        requests, padded = x
        return requests, self.qa.forward(padded)

    def unbatch(self, output: tuple[list[tuple[Any, str]], Any]) -> list[tuple[Any, Any, str]]:
        """Each request's (encoding, logits (W_i, S, 2), context)."""
        requests, logits = output
        encs = [enc for enc, _ in requests]
        return [
            (enc, x, context) for (enc, context), x in zip(requests, self.qa.split(logits, encs), strict=True)
        ]

    def encode_response(self, output: tuple[Any, Any, str]):
        """A request's answer, the /v1/qa JSON (dict)."""
        enc, logits, context = output
        return self.qa.decode(enc.windows, logits, context)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="LitServe on /v1/qa (row (e) of bench_serving.py; see module doc)."
    )
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    add_model_arguments(p)
    p.add_argument("--api-servers", type=int, default=1, help="uvicorn API processes (default: %(default)s)")
    p.add_argument(
        "--batch-timeout-ms",
        type=float,
        default=10.0,
        help="how long a worker waits for a batch to fill (default: %(default)s)",
    )
    p.add_argument(
        "--timeout-s", type=float, default=120.0, help="a request's limit in the queue (default: %(default)s)"
    )
    return p


MAIN_PID = os.getpid()


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM: LitServe's Ctrl+C shutdown in the main process. Its forked processes inherit this
    handler: there (uvicorn re-raises the SIGTERM it drained on) the signal's default, exit."""
    if os.getpid() == MAIN_PID:
        raise KeyboardInterrupt
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    api = QALitAPI(
        model=args.model,
        dtype=args.dtype,
        max_seq_len=args.max_seq_len,
        threads=args.threads,
        max_batch_size=args.max_batch_size,
        batch_timeout_s=args.batch_timeout_ms / 1000,
    )
    server = ls.LitServer(
        api,
        accelerator=args.device,
        devices=1,
        workers_per_device=args.workers,
        timeout=args.timeout_s,
        healthcheck_path=HEALTH_PATH,
    )
    logger.info(
        "LitServe %s: %d worker(s) x %d thread(s), batches of <= %d requests within %g ms, %d API process(es)",
        ls.__version__,
        args.workers,
        args.threads,
        args.max_batch_size,
        args.batch_timeout_ms,
        args.api_servers,
    )
    signal.signal(signal.SIGTERM, _interrupt)
    server.run(
        host=args.host,
        port=args.port,
        num_api_servers=args.api_servers,
        api_server_worker_type="process",
        log_level="warning",
        generate_client_file=False,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
