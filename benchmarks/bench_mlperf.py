"""MLPerf Inference's own load generator (``mlcommons-loadgen``) drives shardserve and the naive server.

One run, same machine, same questions (SQuAD v1.1 development pool, ``../shared/data/squad``), the
servers one after the other, each over HTTP ``/v1/qa`` (one question per query, as MLPerf's BERT
benchmark issues them):

- **SingleStream** (loadgen): one query at a time; its median latency is the single-request latency.
  The SLO is ``--slo-scale`` (default 5) x the faster server's median, unless ``--slo-ms`` is given;
  both servers are held to the same SLO.
- **Offline** (loadgen): every sample issued at once; samples/s. Also the upper end of the search.
- **Server** (loadgen): Poisson arrivals at a target QPS; a probe passes when loadgen's latency
  constraint holds (99th-percentile latency within the SLO: "Performance constraints satisfied").
  Bisection over the target QPS (``--search-steps`` probes of ``--duration-s`` each) finds the
  highest passing QPS. MLPerf's own runs last 600 s and also need loadgen's early-stopping
  criterion (enough queries to bound the 99th percentile); the short probes here report it
  beside each figure ("early stopping ok") rather than requiring it, and ``--confirm-s`` adds one
  long run at the QPS found, with loadgen's whole verdict.
- **Accuracy** (loadgen ``AccuracyOnly``): each of ``--accuracy-samples`` questions once; the
  answers scored with the project's SQuAD metric (``shardserve.training.squad_metrics.evaluate``: exact match
  and F1).

The raw forward (``bench_serving.py``'s part (a): the unpartitioned model, no HTTP, the best of one
process with every core at batches of 32 windows and one process per core at batches of 32 and of
``SMALL_BATCH``) gives the ratio
shardserve Offline / raw. Servers: ``shardserve serve`` with its default flags (plus each
``--serve-arg``), and ``bench_serving.py``'s naive FastAPI server (one request at a time,
``--naive-dtype``, fp32 by default: what a user writes).

    pip install -e ".[bench]"                           # mlcommons-loadgen
    python benchmarks/bench_mlperf.py                   # default model, ~15 min on 2 cores
    python benchmarks/bench_mlperf.py --duration-s 10 --search-steps 3 --accuracy-samples 100  # smoke
    python benchmarks/bench_mlperf.py --json mlperf.json --skip naive
"""

from __future__ import annotations

import argparse
import array
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serving import SMALL_BATCH
from http_load import OpenLoopClient
from serving_raw import raw_in_subprocess
from serving_report import machine_info

from shardserve.loadtest.local_server import free_port, stop, wait_ready
from shardserve.training.squad_data import SquadExample, load_squad
from shardserve.training.squad_metrics import evaluate

logger = logging.getLogger("bench_mlperf")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
POOL = REPO.parent / "shared" / "data" / "squad" / "squad-v1.1-train-pool.json"


# ------------------------------------------------------------------------------------------ loadgen runs


@dataclass
class LoadgenRun:
    """What one loadgen run's summary says (``mlperf_log_summary.txt``)."""

    scenario: str
    mode: str
    samples_per_s: float | None
    result: str  # VALID / INVALID (loadgen's verdict: constraints, minimums and early stopping)
    latency_ok: bool  # "Performance constraints satisfied" (the SLO at its percentile)
    early_stopping_ok: bool | None
    p50_ms: float | None
    p99_ms: float | None
    target_qps: float | None = None
    errors: dict[int, int] = field(default_factory=dict)  # HTTP status (599: no answer) -> count
    answers: dict[int, str] = field(default_factory=dict, repr=False)


def parse_summary(text: str) -> dict[str, Any]:
    """The figures of a loadgen summary; absent ones are None."""

    def grab(pattern: str) -> str | None:
        m = re.search(pattern, text, re.MULTILINE)
        return m.group(1).strip() if m else None

    def num(pattern: str) -> float | None:
        v = grab(pattern)
        return float(v) if v is not None else None

    per_s = num(r"^(?:Completed samples per second|Samples per second)\s*:\s*([\d.eE+-]+)")
    p50, p99 = (
        num(r"^50\.00 percentile latency \(ns\)\s*:\s*(\d+)"),
        num(r"^99\.00 percentile latency \(ns\)\s*:\s*(\d+)"),
    )
    early = grab(r"^\s*Early stopping satisfied\s*:\s*(\w+)")
    return {
        "samples_per_s": per_s,
        "result": grab(r"^Result is\s*:\s*(\w+)") or "?",
        "latency_ok": (grab(r"^\s*Performance constraints satisfied\s*:\s*(\w+)") or "Yes").lower() == "yes",
        "early_stopping_ok": None if early is None else early.lower() == "yes",
        "p50_ms": p50 / 1e6 if p50 is not None else None,
        "p99_ms": p99 / 1e6 if p99 is not None else None,
    }


def run_loadgen(
    client: OpenLoopClient,
    bodies: list[bytes],
    *,
    scenario: str,
    mode: str = "PerformanceOnly",
    duration_s: float = 30.0,
    target_qps: float | None = None,
    slo_ms: float | None = None,
    min_queries: int = 1,
) -> LoadgenRun:
    """One loadgen test over ``bodies`` (the QSL: sample i is ``bodies[i]``) against ``client``'s
    server. ``AccuracyOnly`` keeps each sample's answer text (``LoadgenRun.answers``)."""
    import mlperf_loadgen as lg

    answers: dict[int, str] = {}
    errors: dict[int, int] = {}
    keep = mode == "AccuracyOnly"

    def issue(samples: list) -> None:
        for s in samples:

            def done(status: int, payload: bytes, s: Any = s) -> None:
                text = b""
                if status == 200:
                    if keep:
                        found = json.loads(payload)["answers"]
                        answers[s.index] = found[0]["text"] if found else ""
                        text = answers[s.index].encode()
                else:
                    errors[status] = errors.get(status, 0) + 1
                buf = array.array("B", text or b"\0")
                ptr, n = buf.buffer_info()
                lg.QuerySamplesComplete([lg.QuerySampleResponse(s.id, ptr, n if text else 0)])

            client.post(bodies[s.index], done)

    settings = lg.TestSettings()
    settings.scenario = getattr(lg.TestScenario, scenario)
    settings.mode = getattr(lg.TestMode, mode)
    settings.min_duration_ms = int(duration_s * 1000)
    settings.max_duration_ms = int(duration_s * 1000 * 3)
    settings.min_query_count = min_queries
    if scenario == "Server":
        settings.server_target_qps = float(target_qps or 1.0)
        settings.server_target_latency_ns = int((slo_ms or 1e6) * 1e6)
        settings.server_target_latency_percentile = 0.99
    elif scenario == "Offline":
        settings.offline_expected_qps = float(target_qps or 1.0)
    elif scenario == "SingleStream":
        settings.single_stream_expected_latency_ns = int(50e6)
    with tempfile.TemporaryDirectory(prefix="loadgen-") as out:
        log_out = lg.LogOutputSettings()
        log_out.outdir, log_out.copy_summary_to_stdout = out, False
        log_settings = lg.LogSettings()
        log_settings.log_output, log_settings.enable_trace = log_out, False
        sut = lg.ConstructSUT(issue, lambda: None)
        qsl = lg.ConstructQSL(len(bodies), len(bodies), lambda idx: None, lambda idx: None)
        try:
            lg.StartTestWithLogSettings(sut, qsl, settings, log_settings)
        finally:
            lg.DestroyQSL(qsl)
            lg.DestroySUT(sut)
        summary = parse_summary((Path(out) / "mlperf_log_summary.txt").read_text())
    return LoadgenRun(scenario, mode, target_qps=target_qps, errors=errors, answers=answers, **summary)


def find_server_qps(
    probe: Callable[[float], LoadgenRun], *, low: float, high: float, steps: int
) -> tuple[float | None, list[LoadgenRun]]:
    """Bisection over the Server scenario's target QPS in [low, high]: the highest target whose probe
    met the latency constraint with no failed query (None if none did), and every probe run."""
    runs: list[LoadgenRun] = []
    best: float | None = None
    for _ in range(steps):
        qps = (low + high) / 2
        run = probe(qps)
        runs.append(run)
        if run.latency_ok and not run.errors:
            best, low = qps, qps
        else:
            high = qps
    return best, runs


# ------------------------------------------------------------------------------------------ servers


@dataclass
class ServerFigures:
    name: str
    single_p50_ms: float | None = None
    offline_qps: float | None = None
    server_qps: float | None = None  # highest Server-scenario QPS within the SLO
    server_probe: dict[str, Any] | None = None  # that probe's figures
    probes: list[dict[str, Any]] = field(default_factory=list)
    confirm: dict[str, Any] | None = None  # the --confirm-s run at server_qps
    exact: float | None = None
    f1: float | None = None
    errors: dict[int, int] = field(default_factory=dict)  # HTTP status -> count, every run

    def count(self, run: LoadgenRun) -> None:
        for status, n in run.errors.items():
            self.errors[status] = self.errors.get(status, 0) + n


def server_ratio(ours: ServerFigures, naive: ServerFigures, *, slo_ms: float) -> str:
    """The Server scenario's verdict, shardserve against the naive server: the ratio of their QPS
    within the SLO, or, where one met it at no probed rate, that server's slowest probe (its p99 there
    says by how much: by default the SLO is 5x the faster server's single-request median, which the
    slower server's tail can exceed even one query at a time)."""
    if ours.server_qps and naive.server_qps:
        return f"Server QPS within the SLO, shardserve / naive: {ours.server_qps / naive.server_qps:.2f}x"
    parts = []
    for f in (ours, naive):
        if f.server_qps:
            continue
        probes = [p for p in f.probes if p.get("target_qps") is not None]
        if not probes:
            parts.append(f"{f.name}: no Server-scenario probe ran")
            continue
        low = min(probes, key=lambda p: p["target_qps"])
        p99 = low.get("p99_ms")
        parts.append(
            f"{f.name} met the {slo_ms:.0f}-ms SLO at no probed rate (its slowest probe, "
            f"{low['target_qps']:.1f} QPS: p99 {'-' if p99 is None else f'{p99:.0f}'} ms)"
        )
    return "Server QPS within the SLO, shardserve / naive: no ratio: " + "; ".join(parts)


def start_server(cmd: list[str], port: int) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env)
    try:
        wait_ready(f"http://127.0.0.1:{port}", timeout_s=300, proc=proc, all_replicas=True)
    except BaseException:
        stop(proc)
        raise
    return proc


def measure_server(
    name: str, cmd: list[str], port: int, bodies: list[bytes], args: argparse.Namespace
) -> tuple[ServerFigures, OpenLoopClient, subprocess.Popen]:
    """Start the server; SingleStream and Offline runs. Returns it still running, for the Server
    scenario (whose SLO needs every server's SingleStream first) and accuracy."""
    proc = start_server(cmd, port)
    client = OpenLoopClient(port, max_connections=args.max_connections)
    figures = ServerFigures(name)
    logger.info("%s: SingleStream", name)
    single = run_loadgen(client, bodies, scenario="SingleStream", duration_s=args.single_s, min_queries=64)
    figures.single_p50_ms = single.p50_ms
    logger.info("%s: Offline", name)
    # loadgen's Offline query holds expected QPS x min duration samples: --offline-samples of them
    offline = run_loadgen(
        client,
        bodies,
        scenario="Offline",
        duration_s=args.duration_s,
        target_qps=args.offline_samples / args.duration_s,
    )
    figures.offline_qps = offline.samples_per_s
    figures.count(single)
    figures.count(offline)
    return figures, client, proc


def server_and_accuracy(
    figures: ServerFigures,
    client: OpenLoopClient,
    bodies: list[bytes],
    examples: list[SquadExample],
    *,
    slo_ms: float,
    args: argparse.Namespace,
) -> None:
    def probe(qps: float, duration_s: float = args.duration_s) -> LoadgenRun:
        run = run_loadgen(
            client, bodies, scenario="Server", duration_s=duration_s, target_qps=qps, slo_ms=slo_ms
        )
        logger.info(
            "%s: Server at %.1f QPS: p99 %.0f ms (SLO %.0f), %s, early stopping %s, errors %s",
            figures.name, qps, run.p99_ms or -1, slo_ms, "met" if run.latency_ok else "missed",
            run.early_stopping_ok, run.errors,
        )  # fmt: skip
        return run

    top = figures.offline_qps or 1.0
    best, runs = find_server_qps(probe, low=0.0, high=top, steps=args.search_steps)
    figures.server_qps = best
    figures.probes = [{k: v for k, v in asdict(r).items() if k != "answers"} for r in runs]
    figures.server_probe = next((p for p in figures.probes if p["target_qps"] == best), None)
    for r in runs:
        figures.count(r)
    if best is not None and args.confirm_s > 0:  # one long run at the found QPS: loadgen's own verdict
        logger.info("%s: confirming %.1f QPS over %.0f s", figures.name, best, args.confirm_s)
        confirm = probe(best, args.confirm_s)
        figures.confirm = {k: v for k, v in asdict(confirm).items() if k != "answers"}
        figures.count(confirm)
    if args.accuracy_samples:
        n = min(args.accuracy_samples, len(bodies))
        logger.info("%s: accuracy over %d questions", figures.name, n)
        acc = run_loadgen(
            client, bodies[:n], scenario="Offline", mode="AccuracyOnly", duration_s=1, target_qps=n
        )
        preds = {examples[i].id: text for i, text in acc.answers.items()}
        scores = evaluate(examples[:n], preds)
        figures.exact, figures.f1 = scores["exact"], scores["f1"]
        figures.count(acc)


# ------------------------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="MLPerf's load generator (Server, Offline, SingleStream, accuracy) against shardserve "
        "and a naive FastAPI server, with the raw forward for the ratio (see the module docstring)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="default", help="model name or HF directory")
    p.add_argument("--squad", type=Path, default=POOL, help="SQuAD v1.1 JSON (default: the development pool)")
    p.add_argument(
        "--samples", type=int, default=2048, help="questions in loadgen's sample set (spread over articles)"
    )
    p.add_argument(
        "--duration-s",
        type=float,
        default=30.0,
        help="each Server-scenario probe (and the Offline run's minimum)",
    )
    p.add_argument(
        "--offline-samples", type=int, default=1024, help="samples in the Offline scenario's one query"
    )
    p.add_argument(
        "--confirm-s",
        type=float,
        default=0.0,
        help="then one run this long at the QPS found, for loadgen's verdict with early stopping (MLPerf: 600)",
    )
    p.add_argument("--single-s", type=float, default=10.0, help="the SingleStream run")
    p.add_argument(
        "--search-steps", type=int, default=5, help="Server-scenario probes per server (bisection)"
    )
    p.add_argument("--slo-scale", type=float, default=5.0, help="SLO = this x the faster single-request p50")
    p.add_argument(
        "--slo-ms", type=float, default=None, help="a fixed SLO instead (ms, at the 99th percentile)"
    )
    p.add_argument("--accuracy-samples", type=int, default=1000, help="questions scored (0: no accuracy run)")
    p.add_argument(
        "--max-connections",
        type=int,
        default=64,
        help="HTTP connections (queries in flight) the client may open; further queries wait in the client, "
        "their wait counted in loadgen's latency",
    )
    p.add_argument(
        "--cores",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads of the raw forward and naive server",
    )
    p.add_argument("--max-seq-len", type=int, default=384, help="window length, every part")
    p.add_argument(
        "--context-cache-mb",
        type=float,
        default=0.0,
        help="shardserve's tokenized-context cache (`--context-cache-mb`); 0 here by default: loadgen's samples "
        "repeat, so a cache would skip tokenizing every context seen before, which unseen text never "
        "does; the server's own default is 32 (default: %(default)s)",
    )
    p.add_argument(
        "--naive-dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="the naive server's precision",
    )
    p.add_argument(
        "--serve-arg", action="append", default=[], help="extra `shardserve serve` argument (repeatable)"
    )
    p.add_argument(
        "--skip", action="append", default=[], choices=("raw", "naive", "shardserve"), help="skip a part"
    )
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p  # fmt: skip


def at_port(cmd: list[str], port: int) -> list[str]:
    """A server's command listening on ``port`` (the naive server takes it as its flag's value)."""
    return [*cmd, str(port)] if cmd[-1] == "--naive-server" else [*cmd, "--port", str(port)]


def load_examples(path: Path, n: int) -> list[SquadExample]:
    examples = load_squad(path)
    step = max(1, len(examples) // n)  # spread over articles
    return examples[::step][:n]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        import mlperf_loadgen  # noqa: F401
    except ImportError:
        print("mlcommons-loadgen is not installed: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    if not args.squad.is_file():
        print(f"{args.squad}: no such file (the SQuAD data lives in ../shared/data/squad)", file=sys.stderr)
        return 2
    examples = load_examples(args.squad, args.samples)
    bodies = [json.dumps({"question": e.question, "context": e.context}).encode() for e in examples]
    info = machine_info("auto", model=args.model)
    servers: dict[str, list[str]] = {}
    if "shardserve" not in args.skip:
        servers["shardserve"] = [sys.executable, "-m", "shardserve.cli", "--log-level", "WARNING", "serve",
                                 "--model", args.model, "--host", "127.0.0.1", "--max-seq-len", str(args.max_seq_len),
                                 "--max-queue-size", "1024", "--context-cache-mb", str(args.context_cache_mb),
                                 *args.serve_arg]  # fmt: skip
    if "naive" not in args.skip:
        servers[f"naive FastAPI {args.naive_dtype}"] = [
            sys.executable, str(HERE / "bench_serving.py"), "--model", args.model, "--cores", str(args.cores),
            "--max-seq-len", str(args.max_seq_len), "--naive-dtype", args.naive_dtype, "--naive-server",
        ]  # fmt: skip
    # SingleStream and Offline of each server first (the SLO needs every single-request latency),
    # one server up at a time: stopped after its runs, started again for the Server scenario
    results: dict[str, ServerFigures] = {}
    for name, cmd in servers.items():
        port = free_port()
        full = at_port(cmd, port)
        figures, client, proc = measure_server(name, full, port, bodies, args)
        client.close()
        stop(proc)
        results[name] = figures
    singles = [f.single_p50_ms for f in results.values() if f.single_p50_ms]
    slo_ms = args.slo_ms or (args.slo_scale * min(singles) if singles else 1000.0)
    for name, cmd in servers.items():
        port = free_port()
        full = at_port(cmd, port)
        proc = start_server(full, port)
        client = OpenLoopClient(port, max_connections=args.max_connections)
        try:
            server_and_accuracy(results[name], client, bodies, examples, slo_ms=slo_ms, args=args)
        finally:
            client.close()
            stop(proc)
    raw = None
    if "raw" not in args.skip:
        ns = argparse.Namespace(model=args.model, questions=min(512, args.samples), squad=args.squad,
                                max_seq_len=args.max_seq_len, cores=args.cores)  # fmt: skip
        dtype = info["dtype"]
        runs = [raw_in_subprocess(ns, procs=1, threads=args.cores, batch_size=32, duration_s=args.duration_s / 2,
                                  name=f"raw batched {dtype}, 1 proc", dtype=dtype)]  # fmt: skip
        for batch in (32, SMALL_BATCH) if args.cores > 1 else ():
            runs.append(raw_in_subprocess(ns, procs=args.cores, threads=1, batch_size=batch, duration_s=args.duration_s / 2,
                                          name=f"raw batch {batch} {dtype}, {args.cores} procs", dtype=dtype))  # fmt: skip
        raw = max(runs, key=lambda r: r.questions_per_s)
    report(results, raw, slo_ms=slo_ms, info=info, args=args)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": info,
                    "slo_ms": slo_ms,
                    "servers": {k: asdict(v) for k, v in results.items()},
                    "raw": asdict(raw) if raw else None,
                },
                indent=1,
            )
        )
    return 0


def report(
    results: dict[str, ServerFigures],
    raw: Any,
    *,
    slo_ms: float,
    info: dict[str, Any],
    args: argparse.Namespace,
) -> None:
    print(f"\nmodel={args.model} samples={args.samples} probes={args.search_steps} x {args.duration_s:.0f} s")
    print(f"cpu: {info['cpu']}; shardserve precision {info['dtype']} ({info['dtype_reason']})")
    print(f"SLO: {slo_ms:.0f} ms at the 99th percentile")
    head = f"{'':28} {'single p50':>10} {'Offline':>9} {'Server QPS':>10} {'its p99':>8} {'early stop':>10} {'EM':>6} {'F1':>6} {'err':>4}"
    print(head)
    for f in results.values():
        p = f.server_probe or {}

        def fmt(v: float | None, spec: str = ".1f") -> str:
            return "-" if v is None else format(v, spec)

        print(
            f"{f.name:28} {fmt(f.single_p50_ms):>10} {fmt(f.offline_qps):>9} {fmt(f.server_qps):>10} "
            f"{fmt(p.get('p99_ms'), '.0f'):>8} {p.get('early_stopping_ok', '-')!s:>10} "
            f"{fmt(f.exact):>6} {fmt(f.f1):>6} {sum(f.errors.values()):>4}"
        )
    if raw is not None:
        print(f"{raw.name:28} {'':>10} {raw.questions_per_s:>9.1f}   (no HTTP: the limit)")
    for f in results.values():
        if f.confirm:
            c = f.confirm
            print(
                f"{f.name}: {args.confirm_s:.0f} s at {c['target_qps']:.1f} QPS: loadgen says {c['result']} "
                f"(p99 {c['p99_ms']:.0f} ms, latency {'met' if c['latency_ok'] else 'missed'}, "
                f"early stopping {c['early_stopping_ok']}, errors {c['errors'] or 0})"
            )
    ours = results.get("shardserve")
    naive = next((f for k, f in results.items() if k.startswith("naive")), None)
    if ours and naive:
        print(server_ratio(ours, naive, slo_ms=slo_ms))
    if ours and raw is not None and ours.offline_qps:
        print(f"Offline, shardserve / raw forward: {ours.offline_qps / raw.questions_per_s:.2f}x")
    if ours and naive and ours.f1 is not None and naive.f1 is not None:
        print(f"F1, shardserve / naive: {ours.f1:.2f} / {naive.f1:.2f}")


if __name__ == "__main__":
    sys.exit(main())
