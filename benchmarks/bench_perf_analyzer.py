"""Triton's perf_analyzer against ``shardserve serve``: throughput and latency by concurrency, over
HTTP with binary tensors and with JSON tensors and over gRPC, side by side in one run, with the
server's own breakdown (Triton's statistics extension: queue and compute per request).

perf_analyzer comes from PyPI's ``tritonclient==2.41.0`` wheel, unpacked into ``--cache``
(``loadtest/perf_analyzer.py``; needs ``apt-get install libb64-0d``). One server (the embedded
default model unless ``--model``, the server's own defaults otherwise) answers every run; each
request is one pair of the default question set, cycled. The server serves gRPC on a free port.

    python benchmarks/bench_perf_analyzer.py                               # concurrency 1,2,4,8,16
    python benchmarks/bench_perf_analyzer.py --concurrency 4 --json pa.json -- --replicas 1

Arguments after ``--`` go to ``shardserve serve``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving_report import machine_info

from shardserve.loadtest.local_server import free_port, local_server
from shardserve.loadtest.perf_analyzer import install, run
from shardserve.partitioner.precision import resolve_dtype

logger = logging.getLogger("bench_perf_analyzer")

PAIRS = [
    (
        "Which team won Super Bowl 50?",
        "Super Bowl 50 was an American football game to determine the champion of the National Football "
        "League (NFL) for the 2015 season. The American Football Conference (AFC) champion Denver Broncos "
        "defeated the National Football Conference (NFC) champion Carolina Panthers 24-10 to earn their "
        "third Super Bowl title.",
    ),
    ("Where did Ann meet Bob?", "Ann met Bob in Paris in 1999, three years after she left Lyon."),
    ("At what temperature does water boil?", "Water boils at 100 degrees Celsius at sea level."),
]


# perf_analyzer's CSV columns of the server's statistics (µs per request, from GET .../stats)
SERVER_COLUMNS = ("Server Queue", "Server Compute Input", "Server Compute Infer", "Server Compute Output")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, serve_args = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="the served model (registry name or folder)")
    p.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated concurrencies")
    p.add_argument("--window-ms", type=int, default=5000, help="perf_analyzer's measurement window")
    p.add_argument(
        "--stability-pct", type=float, default=25.0, help="windows that agree within this %% end a run"
    )
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "shardserve" / "perf_analyzer")
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = p.parse_args(ours)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    pa = install(args.cache)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    info = machine_info(resolve_dtype("auto", "cpu").name)
    rows = []
    grpc_port = free_port()
    serve = ["--model", args.model, "--served-model-name", "qa", "--grpc-port", str(grpc_port), *serve_args]
    with local_server(serve, ready_timeout_s=600, all_replicas=True) as srv:
        http_url = srv.url.removeprefix("http://")
        grpc_url = f"{http_url.rsplit(':', 1)[0]}:{grpc_port}"
        for n in concurrency:
            for protocol, url, fmt in (
                ("http", http_url, "binary"),
                ("http", http_url, "json"),
                ("grpc", grpc_url, "binary"),
            ):
                (row,) = run(
                    pa, url, "qa", pairs=PAIRS, concurrency=[n], protocol=protocol,
                    binary_data=fmt == "binary", window_ms=args.window_ms, stability_pct=args.stability_pct,
                )  # fmt: skip
                rows.append({"protocol": protocol, "tensors": fmt, **row})
                logger.info("%s %-6s concurrency %2d: %.1f infer/s, p50 %.1f ms, p99 %.1f ms", protocol, fmt, n,
                            row["Inferences/Second"], row["p50 latency"] / 1e3, row["p99 latency"] / 1e3)  # fmt: skip
    header = (
        f"{'protocol':8} {'tensors':7} {'conc':>4} {'infer/s':>8} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'srv queue':>9} {'srv input':>9} {'srv infer':>9} {'srv output':>10}  (server times: ms per request)"
    )
    print(f"\n{info['cpu']}, {info['cores']} cores, dtype {info['dtype']}; model {args.model}\n{header}")
    for r in rows:
        server = [r.get(k, float("nan")) / 1e3 for k in SERVER_COLUMNS]
        print(f"{r['protocol']:8} {r['tensors']:7} {r['Concurrency']:4.0f} {r['Inferences/Second']:8.1f} "
              f"{r['p50 latency'] / 1e3:7.1f} {r['p99 latency'] / 1e3:7.1f} "
              f"{server[0]:9.2f} {server[1]:9.2f} {server[2]:9.2f} {server[3]:10.2f}")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": info, "model": args.model, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
