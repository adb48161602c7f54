"""Overload: 256 concurrent clients with long contexts against a 1-replica server.

Starts ``shardserve serve --replicas 1`` on loopback, lets ``shardserve.loadtest.overload`` drive it past
capacity, and prints, per HTTP status, the count and p50/p99/max latency, plus the server's memory
(frontend + ranks) before, at peak and after. The figures that matter: 429s answered at once
(p99 in milliseconds, not seconds) and bounded memory growth.

    python benchmarks/bench_overload.py                       # default model, 256 clients, 20 s
    python benchmarks/bench_overload.py --model tiny-bert --clients 128 --duration 10 --json out.json
    python benchmarks/bench_overload.py -- --max-queue-size 64  # flags after -- go to `serve`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

import httpx

from shardserve.loadtest.local_server import ServerNotReady, local_server
from shardserve.loadtest.overload import (
    QUESTION,
    OverloadConfig,
    access_log_latencies,
    long_context,
    run_overload,
)
from shardserve.models.cpu import cpu_capabilities


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="model to serve (default: the embedded default)")
    p.add_argument("--clients", type=int, default=256, help="concurrent closed-loop clients")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of overload")
    p.add_argument("--context-chars", type=int, default=20_000, help="characters per request's context")
    p.add_argument(
        "--ignore-retry-after",
        action="store_true",
        help="clients resend 50 ms after a 429 instead of waiting what Retry-After says",
    )
    p.add_argument("--json", help="also write the summary to this JSON file")
    p.add_argument("serve_args", nargs="*", help="extra `shardserve serve` flags (after --)")
    args = p.parse_args(argv)

    serve_args = ["--model", args.model, "--replicas", "1", *args.serve_args]
    with tempfile.TemporaryFile("w+") as log:
        try:
            # --log-level INFO: the access log gives the server-side latencies
            with local_server(serve_args, global_args=["--log-level", "INFO"], log=log) as server:
                body = {"question": QUESTION, "context": long_context(args.context_chars)}
                # warm-up: the server measures a rate
                httpx.post(f"{server.url}/v1/qa", json=body, timeout=120).raise_for_status()
                cfg = OverloadConfig(
                    url=server.url,
                    pid=server.pid,
                    clients=args.clients,
                    duration_s=args.duration,
                    context_chars=args.context_chars,
                    honor_retry_after=not args.ignore_retry_after,
                )
                report = asyncio.run(run_overload(cfg))
        except ServerNotReady as exc:
            log.seek(0)
            raise SystemExit(f"{exc}\n{log.read()[-3000:]}") from None
        log.seek(0)
        report.server_latencies_ms = access_log_latencies(log.read())
    summary = {"cpu": cpu_capabilities().model, "cores": os.cpu_count(), "model": args.model, "config": vars(args),
               **report.summary()}  # fmt: skip
    print(f"overload: {args.clients} clients x {args.context_chars} chars for {args.duration:g} s, "
          f"model {args.model}, 1 replica, {summary['cpu']} ({summary['cores']} cores)")  # fmt: skip
    for side in ("statuses", "server_statuses"):
        print("as the clients saw it:" if side == "statuses" else "inside the server (access log):")
        print(f"{'status':>6} {'count':>7} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}")
        for status, row in summary[side].items():
            print(f"{status:>6} {row['count']:>7} {row['p50_ms']:>9} {row['p99_ms']:>9} {row['max_ms']:>9}")
    print(f"transport errors {summary['transport_errors']}, 429/503 without Retry-After: "
          f"{summary['missing_retry_after']}")  # fmt: skip
    print(f"server RSS (frontend + ranks): before {summary['rss_before_mb']} MB, peak "
          f"{summary['rss_peak_mb']} MB (growth {summary['rss_growth_mb']} MB), after {summary['rss_after_mb']} MB")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
