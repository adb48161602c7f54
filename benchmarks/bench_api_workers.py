"""The engine core's CPU per answer behind ``--api-workers``: configurations side by side, alternating.

Where the model is cheap (a GPU, or tiny-bert with short contexts on a CPU) the Python front end is
the limit, and with ``--api-workers N`` the one engine core is the part that does not multiply. This
drives each configuration with the same closed loop (``http_load.closed_loop``: N keep-alive
clients, short synthetic contexts), round after round in turn (the VM's speed drifts: read ratios
within a round), and prints per configuration: answers/s, p50, and the CPU per answer (from /proc)
of the core process, of its event-loop thread (the one that cannot spread), of its API processes
and of its ranks, with the mean micro-batch.

A configuration is `shardserve serve` flags; a leading ``@DIR`` runs the server of another checkout
(a ``git worktree`` of an older commit, say) with the same load:

    python benchmarks/bench_api_workers.py                                  # --api-workers 1 vs 2, tiny-bert
    python benchmarks/bench_api_workers.py --config "@/tmp/old --api-workers 2" --config "--api-workers 2"
    python benchmarks/bench_api_workers.py --model default --context-chars 800 --rounds 2

Tests: the pure helpers in ``tests/benchmarks/test_bench_helpers.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from http_load import closed_loop  # noqa: E402
from serving_procs import api_pids, batch_stats, process_cpu_s  # noqa: E402
from serving_report import machine_info  # noqa: E402

from shardserve.loadtest.local_server import ServerNotReady, local_server  # noqa: E402
from shardserve.loadtest.overload import process_tree  # noqa: E402

logger = logging.getLogger("bench_api_workers")
WORDS = (
    "the denver broncos defeated carolina panthers in super bowl fifty at levi's stadium santa clara "
    "on february seventh two thousand sixteen with a score of twenty four to ten"
).split()


@dataclass(frozen=True)
class Config:
    tree: Path  # the checkout whose server runs
    flags: list[str]

    @property
    def label(self) -> str:
        where = "" if self.tree == REPO else f"@{self.tree} "
        return where + (" ".join(self.flags) or "(no flags)")


def parse_config(text: str) -> Config:
    """``[@DIR] flags...``: the server of checkout DIR (default: this one) with these flags."""
    words = shlex.split(text)
    if words and words[0].startswith("@"):
        return Config(Path(words[0][1:]).resolve(), words[1:])
    return Config(REPO, words)


def bodies(n: int, *, context_chars: int, seed: int = 0) -> list[bytes]:
    """``n`` distinct QA requests with ``context_chars``-character contexts of common words."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        context = " ".join(rng.choice(WORDS) for _ in range(context_chars))[:context_chars]
        out.append(json.dumps({"question": f"who won {rng.choice(WORDS)} {i}?", "context": context}).encode())
    return out


def measure(config: Config, args: argparse.Namespace, load: list[bytes]) -> dict[str, float | str]:
    """One server of ``config``, ready; warm-up, then the measured closed loop; its figures."""
    serve_args = ["--model", args.model, "--max-queue-size", str(max(256, 8 * args.clients)),
                  "--log-level", "warning", *config.flags]  # fmt: skip
    env = {"TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(config.tree)}
    with tempfile.TemporaryFile() as log:
        try:
            with local_server(serve_args, all_replicas=True, log=log, env=env, cwd=config.tree) as srv:
                return _drive(srv.pid, srv.port, args, load)
        except ServerNotReady as err:
            log.seek(0)
            sys.exit(f"{config.label}: {err}\n{log.read().decode(errors='replace')[-2000:]}")


def _drive(pid: int, port: int, args: argparse.Namespace, load: list[bytes]) -> dict[str, float | str]:
    api = api_pids(port)
    closed_loop(port, load, clients=args.clients, warmup_s=0.0, duration_s=args.warmup_s)
    ranks = [p for p in process_tree(pid)[1:] if p not in api]

    def snap() -> tuple[float, float, float, float]:
        return (
            process_cpu_s(f"/proc/{pid}"),
            process_cpu_s(f"/proc/{pid}/task/{pid}"),  # the event-loop thread
            sum(process_cpu_s(f"/proc/{p}") for p in api),
            sum(process_cpu_s(f"/proc/{p}") for p in ranks),
        )

    before = snap()
    out = closed_loop(port, load, clients=args.clients, warmup_s=0.0, duration_s=args.duration_s)
    after = snap()
    answered = sorted(lat for lat, status in out if status == 200)
    per = [1000 * (b - a) / max(len(answered), 1) for a, b in zip(before, after, strict=True)]
    return {
        "qps": len(answered) / args.duration_s,
        "p50_ms": 1000 * statistics.median(answered) if answered else float("nan"),
        "errors": len(out) - len(answered),
        "core_ms": per[0],
        "loop_ms": per[1],
        "api_ms": per[2],
        "ranks_ms": per[3],
        "batch": batch_stats(port),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default="tiny-bert",
        help="model served (default: %(default)s, cheap: the front end is the limit)",
    )
    p.add_argument("--config", action="append", type=parse_config, metavar="'[@DIR] FLAGS'",
                   help="a configuration (repeatable): `shardserve serve` flags, @DIR first for another "
                   "checkout's server; default: --api-workers 1 | --api-workers 2")  # fmt: skip
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds, each configuration once per round (default: %(default)s)",
    )
    p.add_argument(
        "--clients", type=int, default=32, help="concurrent keep-alive clients (default: %(default)s)"
    )
    p.add_argument(
        "--duration-s", type=float, default=15.0, help="measured seconds per server (default: %(default)s)"
    )
    p.add_argument(
        "--warmup-s", type=float, default=3.0, help="unmeasured seconds of load first (default: %(default)s)"
    )
    p.add_argument(
        "--context-chars", type=int, default=120, help="characters per context (default: %(default)s)"
    )
    p.add_argument(
        "--requests", type=int, default=256, help="distinct requests cycled (default: %(default)s)"
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    configs = args.config or [parse_config("--api-workers 1"), parse_config("--api-workers 2")]
    load = bodies(args.requests, context_chars=args.context_chars)
    info = machine_info("auto", model=args.model)
    logger.info("cpu: %s; %d configurations x %d rounds", info["cpu"], len(configs), args.rounds)
    print(f"model={args.model} clients={args.clients} context={args.context_chars} chars "
          f"duration={args.duration_s:g}s cpu: {info['cpu']}")  # fmt: skip
    print(f"{'round':>5} {'q/s':>7} {'p50 ms':>7} {'core':>6} {'loop':>6} {'API':>6} {'ranks':>6}  "
          "(CPU ms per answer)  configuration; micro-batches")  # fmt: skip
    for r in range(1, args.rounds + 1):
        first = None
        for config in configs:
            m = measure(config, args, load)
            first = first or m["qps"]
            errors = f", {m['errors']} errors" if m["errors"] else ""
            print(f"{r:>5} {m['qps']:>7.1f} {m['p50_ms']:>7.1f} {m['core_ms']:>6.3f} {m['loop_ms']:>6.3f} "
                  f"{m['api_ms']:>6.3f} {m['ranks_ms']:>6.3f}  {m['qps'] / first:.2f}x  {config.label}; "
                  f"{m['batch']}{errors}", flush=True)  # fmt: skip
        time.sleep(1.0)


if __name__ == "__main__":
    main()
