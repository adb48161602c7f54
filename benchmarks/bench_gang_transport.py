"""Driver <-> gang round trip: what the transport costs per micro-batch.

Starts one ``Gang`` of the given layout on this machine and sends micro-batches one at a time
(the next after the previous answered), so the figure is the latency of one trip through the
transport and the model, not throughput. Run it at two commits to compare transports (e.g. the
multiprocessing queues before issue 13 vs the ZeroMQ channel):

    python benchmarks/bench_gang_transport.py                         # tiny-bert, pp=1, 300 trips
    python benchmarks/bench_gang_transport.py --pp 2 --batch 32 --seq 384 --trips 100
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-bert", help="model to load into the gang")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--batch", type=int, default=1, help="windows per micro-batch")
    p.add_argument("--seq", type=int, default=32, help="tokens per window")
    p.add_argument("--trips", type=int, default=300, help="timed round trips (after 20 warm-up trips)")
    p.add_argument("--json", help="also write the figures to this JSON file")
    args = p.parse_args(argv)

    from shardserve.models.cpu import cpu_capabilities
    from shardserve.models.registry import resolve_model
    from shardserve.partitioner.plan import ParallelDims, make_plan
    from shardserve.partitioner.stream.driver import StreamGang
    from shardserve.partitioner.stream.program import stream_spec

    source = resolve_model(args.model)
    plan = make_plan(source.config, ParallelDims(pp=args.pp, tp=1))
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 2000, size=(args.batch, args.seq), dtype=np.int64)  # (B, S)
    mask = np.ones_like(ids)  # (B, S)
    with StreamGang(stream_spec(source, plan)) as gang:
        for _ in range(20):
            gang.submit(ids, mask).result(timeout=60)
        trips = []
        for _ in range(args.trips):
            t0 = time.perf_counter()
            gang.submit(ids, mask).result(timeout=60)
            trips.append(1000 * (time.perf_counter() - t0))
    q = statistics.quantiles(trips, n=100)
    out = {
        "cpu": cpu_capabilities().model,
        "model": args.model,
        "pp": args.pp,
        "batch": args.batch,
        "seq": args.seq,
        "trips": args.trips,
        "p50_ms": round(q[49], 3),
        "p99_ms": round(q[98], 3),
        "mean_ms": round(statistics.fmean(trips), 3),
    }
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
