"""Many models on shared devices: SLO attainment of dedicated, multiplexed and auto placements, each
measured on the real server beside the simulator's prediction for the same requests (issue 28).

What runs, in one process tree on this machine:

1. ``--models`` copies of the default model's shape, each with its own weights (the shipped model,
   each tensor perturbed by 1 % of its spread with its own seed), written as Hugging Face folders;
2. the stage times of one of them at pp=1 and pp=2 (one single-thread rank per device, batch sizes
   up to ``--max-batch-size``: a micro-batch alone through the pipeline, and many streamed) and the
   server's own time per request (HTTP, tokenizing, decoding: end-to-end latency of one request
   minus the pp=1 stage time): the ``MeasuredLatency`` profile the auto servers choose with
   (``--latency-profile``);
3. each device's memory budget from the cost model: what a pp=2 group holding every model needs,
   so that with 2 models a device holds one whole model but not two (with 4 models on 2 devices
   it then holds three whole models: the embeddings make a pp=2 split's first stage 77 % of the
   model, so four first stages outweigh three whole models);
4. for every sweep point (total rate, CV of each model's Gamma arrivals, SLO as a multiple of the
   measured single-request latency) one seeded trace, replayed open-loop against a fresh
   ``shardserve serve --placement P`` for P in dedicated, multiplexed and auto, each told the
   point's workload (auto chooses its placement by it, dedicated which models get replicas), one
   after the other, each request carrying its SLO as ``timeout_s``; and the same trace simulated on
   the placement the server reports (``/ui/status``), with the profile's stage times scaled to the
   pace a burst of full micro-batches gets through that server just before (the VM's speed drifts
   within the hour, and the server's own work shares the cores).

It prints a table per point (measured vs predicted attainment), writes ``--json OUT`` with every
point and ``{"dedicated_max_rate", "multiplexed_max_rate", "auto_max_rate"}`` (the highest total
rate of the rate sweep with >= 99 % measured attainment, at ``--cv`` and ``--slo-scale``; null when
no swept rate reaches it) and ``--plots DIR/multimodel.png`` (attainment vs rate, vs CV, vs SLO
scale; measured solid, predicted dashed).

``--paired`` measures instead dedicated against auto in alternating pairs on one seeded trace per
point (``multimodel_paired.py``): CV 4, SLO 10x and 20x, at the rate where the simulator predicts
the widest gap and one where it predicts none, 3 pairs of runs of >= 1,000 requests each; it
prints the per-pair differences and their spread beside the predictions (``"paired"`` in the JSON,
``multimodel-paired.png``). ``--paired --quick``: SLO 10x only, runs of at most 45 s and >= 300 requests.

``--drift`` measures re-planning under drift instead (``multimodel_drift.py``, issue 61): 3 models,
each device holding two whole models but no pipeline of all three, one seeded trace whose hot
model changes half-way (m0 hot, then m2 hot), replayed against an auto server that keeps its
start's placement and one that re-plans every ``--replan-interval-s`` from the last
``--replan-look-back-s`` of arrivals, ``--pairs`` pairs in alternating order; attainment per half
and per window, failed requests, the re-plans and their searches' cost, beside the simulator's
prediction of both (``"drift"`` in the JSON, ``multimodel-drift.png``). ``--drift --quick``: 40 s +
40 s instead of 60 s + 60 s.

    python benchmarks/bench_multimodel.py --json /tmp/mm.json --plots /tmp          # ~45 min, 2 cores
    python benchmarks/bench_multimodel.py --paired --quick --json /tmp/mmp.json --plots /tmp
    python benchmarks/bench_multimodel.py --drift --drift-rate 29 --json /tmp/mmd.json --plots /tmp  # ~15 min
    python benchmarks/bench_multimodel.py --quick                                   # ~10 min
    python benchmarks/bench_multimodel.py --models 4 --rates 4,8,16 --duration-s 60
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import logging
import math
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from multimodel_drift import Planner, drift_budget, report_drift, run_drift
from multimodel_paired import report_paired, run_paired
from multimodel_report import POLICIES, report
from serving_report import machine_info

from shardserve.loadtest.local_server import local_server
from shardserve.loadtest.replay import Sent, replay, summary
from shardserve.models.build import build_model
from shardserve.models.bundled import minilm_dir
from shardserve.models.hf_weights import save_hf_checkpoint
from shardserve.models.qa_windows import WindowConfig, encode_qa, pad_windows
from shardserve.models.registry import resolve_model
from shardserve.partitioner.placement.cost_profile import cost_profiles
from shardserve.partitioner.placement.latency import LatencyModel, MeasuredLatency, ModelProfile
from shardserve.partitioner.placement.layout import MIB, Group, Placement
from shardserve.partitioner.placement.search import choose_placement
from shardserve.partitioner.placement.simulator import SimConfig, simulate
from shardserve.partitioner.placement.workload import ArrivalSpec, Trace, Workload
from shardserve.partitioner.plan import ParallelDims, make_plan
from shardserve.partitioner.precision import DTYPES, resolve_dtype
from shardserve.partitioner.stream.driver import StreamGang
from shardserve.partitioner.stream.program import stream_spec
from shardserve.training.sigterm import Terminated, raise_on_sigterm

logger = logging.getLogger("bench_multimodel")

QUESTION = "Which river carries the most water into the sea?"
CONTEXT = (
    "The delta region is crossed by several rivers. The Lenna, the longest of them, runs 840 kilometres "
    "from the northern hills and carries about 1,900 cubic metres of water a second into the sea, more "
    "than the other three together. The Orsa and the Velt join it near the old harbour town of Marrow, "
    "whose bridges were rebuilt in 1923 after a flood. The smallest, the Tamm, dries up in most summers. "
    "Fishing and river transport were the main trades until the railway reached the delta in 1881; since "
    "then the harbour has mostly served ferries and the tourists who come for the bird reserves."
)


# ------------------------------------------------------------------------------------ the models
def write_models(n: int, root: Path) -> list[Path]:
    """``n`` folders holding the default model's weights, each tensor perturbed with its own seed."""
    source = resolve_model("default")
    model = build_model(source)
    state = model.state_dict()
    out = []
    for i in range(n):
        folder = root / f"m{i}"
        if not (folder / "model.safetensors").is_file():
            gen = torch.Generator().manual_seed(1000 + i)
            mine = {
                k: v + 0.01 * v.float().std() * torch.randn(v.shape, generator=gen)
                if v.is_floating_point() and v.numel() > 1
                else v
                for k, v in state.items()
            }
            save_hf_checkpoint(
                mine,
                source.config,
                folder,
                base_config=minilm_dir() / "config.json",
                tokenizer_dir=source.tokenizer_dir,
            )
        out.append(folder)
    return out


# ------------------------------------------------------------------------------- the profile
def request_window(folder: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one window the benchmark's request is, as the server builds it: ids, mask, segment ids (1, S)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    enc = encode_qa(tok, [QUESTION], [CONTEXT], window=WindowConfig())
    assert len(enc.windows) == 1, "the benchmark's request must be one window"
    b = pad_windows(enc.windows, pad_token_id=enc.pad_token_id)
    return b.input_ids, b.attention_mask, b.token_type_ids


def measure_stages(folder: Path, *, dtype: str, batch_sizes: list[int], repeats: int = 12) -> LatencyModel:
    """Stage times at pp=1 and pp=2 (one single-thread rank each): a micro-batch alone through the
    pipeline (the sum of the stages) and many streamed (the slowest stage)."""
    source = resolve_model(str(folder))
    ids, mask, types = request_window(folder)
    table: dict[tuple[int, int], dict[int, Any]] = {}
    for pp in (1, 2):
        plan = make_plan(source.config, ParallelDims(pp=pp), seq_len=ids.shape[1])
        spec = stream_spec(source, plan, threads_per_rank=1, dtype=dtype)
        with StreamGang(spec, name=f"profile-pp{pp}", start_timeout_s=600) as gang:
            table[(pp, 1)] = {}
            for b in batch_sizes:
                batch = (ids.repeat(b, 1), mask.repeat(b, 1), types.repeat(b, 1))
                gang.run([batch] * 3, timeout_s=600)  # warm
                t0 = time.perf_counter()
                for _ in range(repeats):
                    gang.submit(*batch).result(timeout=600)
                alone = (time.perf_counter() - t0) / repeats
                t0 = time.perf_counter()
                gang.run([batch] * (3 * repeats), timeout_s=600)
                streamed = (time.perf_counter() - t0) / (3 * repeats)
                if pp == 1:
                    table[(pp, 1)][b] = (alone,)
                else:  # the slowest stage sets the streamed pace; the other takes what is left of alone
                    slow = min(streamed, alone)
                    table[(pp, 1)][b] = (slow, max(alone - slow, 0.05 * alone))
                logger.info(
                    "pp=%d batch %d: alone %.1f ms, streamed %.1f ms per batch",
                    pp,
                    b,
                    1e3 * alone,
                    1e3 * streamed,
                )
    return LatencyModel(table)


def http_single_latency(url: str, model: str, n: int = 30) -> float:
    """Median end-to-end latency of one request at a time (s)."""
    body = json.dumps({"question": QUESTION, "context": CONTEXT, "model": model}).encode()
    times = []
    for _ in range(n + 3):
        req = urllib.request.Request(url + "/v1/qa", data=body, headers={"content-type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


def burst_pace(url: str, model: str, *, batch: int, batches: int = 6) -> float:
    """Seconds between the answers of consecutive full micro-batches when ``batches * batch`` requests
    arrive at once (the median gap): the pace of the slowest stage as the server runs it."""
    trace = Trace(tuple((1e-6 * i, model) for i in range(batch * batches)), duration_s=1.0)
    asyncio.run(replay(url, trace, question=QUESTION, context=CONTEXT))  # warm
    time.sleep(0.5)
    done = sorted(s.latency_s for s in asyncio.run(replay(url, trace, question=QUESTION, context=CONTEXT)))
    ends = [done[k * batch + batch - 1] for k in range(batches)]
    return statistics.median(b - a for a, b in itertools.pairwise(ends))


def server_pace(
    url: str, placement: Placement, latency: LatencyModel, *, max_batch_size: int
) -> tuple[int, float]:
    """(pp, factor): the stage times as the server paces them now (the VM's speed drifts; its own
    work shares the cores): a burst of full micro-batches of the model held by the fewest groups (a
    burst of a replicated model spreads over them) against the profile's slowest stage."""
    names = placement.models
    probe = min(names, key=lambda m: sum(m in g.models for g in placement.groups))
    holders = [g for g in placement.groups if probe in g.models]
    pp = holders[0].pp
    pace = (
        len(holders)
        * burst_pace(url, probe, batch=max_batch_size)
        / max(latency.stages(pp, 1, max_batch_size))
    )
    return pp, pace


def scaled(latency: LatencyModel, factor: dict[int, float]) -> LatencyModel:
    """``latency`` with every pp's stage times multiplied by ``factor[pp]``."""
    table = {}
    for pp, tp in latency.configs:
        f = factor.get(pp, 1.0)
        table[(pp, tp)] = {b: tuple(f * t for t in stages) for b, stages in latency.points(pp, tp).items()}
    return LatencyModel(table)


# ------------------------------------------------------------------------------- the sweep
@dataclass(frozen=True)
class Point:
    rate: float  # total requests/s
    cv: float
    slo_scale: float
    sweep: str  # rate / cv / slo: which curve it belongs to

    def trace(self, names: list[str], duration_s: float, seed: int) -> Trace:
        arrivals = tuple(ArrivalSpec(m, self.rate / len(names), self.cv) for m in names)
        return Workload(arrivals, duration_s=duration_s, seed=seed).trace()


def sweep_points(args: argparse.Namespace) -> list[Point]:
    points = [Point(r, args.cv, args.slo_scale, "rate") for r in args.rates]
    points += [Point(args.fixed_rate, cv, args.slo_scale, "cv") for cv in args.cvs if cv != args.cv]
    points += [Point(args.fixed_rate, args.cv, s, "slo") for s in args.slo_scales if s != args.slo_scale]
    return points


def placement_of(url: str) -> Placement:
    """The placement the server reports on its status page."""
    with urllib.request.urlopen(url + "/ui/status", timeout=10) as resp:
        groups = json.loads(resp.read())["placement"]["groups"]
    return Placement(tuple(Group(tuple(g["devices"]), g["pp"], g["tp"], tuple(g["models"])) for g in groups))


def budget_bytes(n_models: int, config: Any, *, dtype_bytes: int, max_batch_size: int) -> int:
    """Memory per device: what a pp=2 group of every model needs on its first stage (the embeddings
    make it the heavier), and at least one whole model and a half (two whole models and a half with
    4 models: less could not hold every model at pp=1). With 2 models of the default shape a device
    then holds one whole model but not two."""
    (profile,), _, _ = cost_profiles(
        {"m": config}, devices=2, seq_len=384, max_batch_size=max_batch_size, dtype_bytes=dtype_bytes
    )
    whole, first_stage = profile.weight_bytes(1, 1, 0), profile.weight_bytes(2, 1, 0)
    k = max(1, math.ceil(n_models / 2))  # whole models a device must hold for every model to fit at pp=1
    return profile.activation_bytes + max(n_models * first_stage, k * whole + whole // 2) + MIB


def server_args(
    args: argparse.Namespace, folders: list[Path], profile: Path, memory: int, policy: str
) -> list[str]:
    out = ["--placement", policy, "--devices", "2", "--threads-per-rank", "1", "--dtype", args.dtype]
    out += ["--device-memory-mb", f"{memory / MIB:.3f}", "--latency-profile", str(profile)]
    out += [
        "--max-batch-size",
        str(args.max_batch_size),
        "--max-inflight-per-replica",
        str(args.max_inflight),
    ]
    out += ["--admission-margin", str(args.admission_margin), "--replan-interval-s", "0"]
    for i, f in enumerate(folders):
        out += ["--model", f"m{i}={f}"]
    return out


def bound(trace: Trace, latency: LatencyModel, *, slo_s: float, max_batch_size: int) -> float:
    """The attainment no placement on 2 devices can beat: every model alone on both devices as if
    they were one twice as fast (its pp=1 stage times halved, no other model, no front, admission
    that refuses only what cannot finish)."""
    fast = LatencyModel({(1, 1): {b: t[0] / 2 for b, t in latency.points(1, 1).items()}})
    names = trace.models
    ideal = Placement(tuple(Group((k,), 1, 1, (m,)) for k, m in enumerate(names)))
    profiles = [ModelProfile(m, param_bytes=1, latency=fast) for m in names]
    cfg = SimConfig(max_batch_size=max_batch_size, max_inflight=1)
    return simulate(ideal, profiles, trace, slo_s=slo_s, config=cfg).attainment


def run_point(url: str, trace: Trace, slo_s: float) -> list[Sent]:
    sent = asyncio.run(replay(url, trace, question=QUESTION, context=CONTEXT, timeout_s=slo_s))
    time.sleep(1.0)  # what is still queued drains before the next point
    return sent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--models",
        type=int,
        default=None,
        choices=(2, 3, 4),
        help="models of the default shape (2 devices; default 2, with --drift 3)",
    )
    p.add_argument("--dtype", default="auto", help="the ranks' dtype (auto: bf16 where the CPU has units)")
    p.add_argument(
        "--rates",
        type=lambda s: [float(x) for x in s.split(",")],
        default=None,
        help="total req/s of the rate sweep (default: 5 %% .. 60 %% of two devices' capacity)",
    )
    p.add_argument("--fixed-rate", type=float, default=None, help="total req/s of the CV and SLO sweeps")
    p.add_argument("--cv", type=float, default=4.0, help="the rate and SLO sweeps' CV")
    p.add_argument("--cvs", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 2.0, 4.0])
    p.add_argument("--slo-scale", type=float, default=5.0, help="the rate and CV sweeps' SLO scale")
    p.add_argument("--slo-scales", type=lambda s: [float(x) for x in s.split(",")], default=[2.0, 5.0, 10.0])
    p.add_argument("--duration-s", type=float, default=60.0, help="seconds of arrivals per point")
    p.add_argument("--max-batch-size", type=int, default=4)
    p.add_argument("--max-inflight", type=int, default=2, help="micro-batches in flight per model and gang")
    p.add_argument(
        "--admission-margin",
        type=float,
        default=1.0,
        help="the servers' --admission-margin (1: admit what fits the whole SLO; their default 0.35 refuses "
        "work that would finish in time when the SLO is a few single-request latencies)",
    )
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="20 s per point, 4 rates, CV 1/4, SLO 2/5")
    p.add_argument(
        "--workdir", type=Path, default=None, help="where the model copies go (default: a temp dir)"
    )
    p.add_argument("--json", type=Path, default=None, help="write every point and the summary here")
    p.add_argument("--plots", type=Path, default=None, help="write multimodel.png into this folder")
    p.add_argument(
        "--paired", action="store_true", help="dedicated vs auto in alternating pairs (multimodel_paired.py)"
    )
    p.add_argument("--pairs", type=int, default=3, help="--paired: pairs per point; --drift: pairs of runs")
    p.add_argument("--paired-rates", type=lambda s: [float(x) for x in s.split(",")], default=None,
                   help="--paired: total rates (default: the widest predicted gap and one with none)")  # fmt: skip
    p.add_argument("--paired-slos", type=lambda s: [float(x) for x in s.split(",")], default=None,
                   help="--paired: SLO scales (default 10,20; --quick: 10)")  # fmt: skip
    p.add_argument("--min-requests", type=int, default=1000, help="--paired: requests per run at least")
    p.add_argument("--max-run-s", type=float, default=300.0, help="--paired: longest run (s)")
    p.add_argument(
        "--drift",
        action="store_true",
        help="fixed vs re-planning auto when the hot model changes (multimodel_drift.py)",
    )
    p.add_argument(
        "--drift-rate",
        type=float,
        default=None,
        help="--drift: total req/s (default: 70 %% of two devices' capacity)",
    )
    p.add_argument("--drift-cv", type=float, default=1.0, help="--drift: each model's CV")
    p.add_argument(
        "--drift-skew", type=float, default=1.0, help="--drift: Zipf-like skew (m0 hot, then m2 hot)"
    )
    p.add_argument("--drift-slo-scale", type=float, default=5.0, help="--drift: the SLO scale")
    p.add_argument("--drift-half-s", type=float, default=60.0, help="--drift: seconds of each half")
    p.add_argument(
        "--replan-interval-s", type=float, default=10.0, help="--drift: the re-planning arm's interval"
    )
    p.add_argument(
        "--replan-look-back-s", type=float, default=15.0, help="--drift: the re-planning arm's look-back"
    )
    p.add_argument("--window-s", type=float, default=10.0, help="--drift: attainment windows (s)")
    args = p.parse_args(argv)
    if args.models is None:
        args.models = 3 if args.drift else 2
    args.paired_policies = ("dedicated", "auto")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.quick:
        args.duration_s, args.cvs, args.slo_scales = 20.0, [1.0, 4.0], [2.0, 5.0]
        args.max_run_s, args.min_requests = 45.0, min(args.min_requests, 300)
    if args.paired_slos is None:
        args.paired_slos = [10.0] if args.quick else [10.0, 20.0]
        args.drift_half_s = min(args.drift_half_s, 40.0)
    args.dtype = resolve_dtype(args.dtype, "cpu").name
    info = machine_info(args.dtype)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-multimodel-"))
    workdir.mkdir(parents=True, exist_ok=True)
    folders = write_models(args.models, workdir)
    names = [f"m{i}" for i in range(args.models)]
    batch_sizes = [b for b in (1, 2, 4, 8) if b <= args.max_batch_size]
    latency = measure_stages(folders[0], dtype=args.dtype, batch_sizes=batch_sizes)
    gang_single = latency.latency(1, 1, 1)
    budget = drift_budget if args.drift else functools.partial(budget_bytes, args.models)
    memory = budget(
        resolve_model(str(folders[0])).config,
        dtype_bytes=DTYPES[args.dtype].itemsize,
        max_batch_size=args.max_batch_size,
    )
    profile_path = workdir / "profile.json"
    MeasuredLatency(latency, 0.0).write(profile_path)
    policies = args.policies.split(",")
    # the SLO's base and the server's own time per request: one request at a time, end to end
    with local_server(
        server_args(args, folders, profile_path, memory, "dedicated"), ready_timeout_s=600
    ) as srv:
        single = http_single_latency(srv.url, names[0])
    overhead = max(0.0, single - gang_single)
    MeasuredLatency(latency, overhead).write(profile_path)  # what the auto servers choose with
    capacity = 2 / gang_single  # two devices, one request at a time each
    if args.rates is None:
        fractions = (0.05, 0.15, 0.3, 0.5) if args.quick else (0.05, 0.1, 0.2, 0.3, 0.45, 0.6)
        args.rates = [round(f * capacity, 1) for f in fractions]
    if args.fixed_rate is None:
        args.fixed_rate = args.rates[len(args.rates) // 2]
    points = sweep_points(args)
    logger.info(
        "single-request latency %.1f ms (stages %.1f + server %.1f); memory %.0f MiB per device; %d points",
        1e3 * single,
        1e3 * gang_single,
        1e3 * overhead,
        memory / MIB,
        len(points),
    )
    sim_cfg = SimConfig(
        max_batch_size=args.max_batch_size,
        max_inflight=args.max_inflight,
        max_queue_delay_s=0.005,
        overhead_s=overhead,
        admission_margin=args.admission_margin,
    )
    configs = {n: resolve_model(str(f)).config for n, f in zip(names, folders, strict=True)}
    rows: list[dict[str, Any]] = []

    def profiles_at(pace: dict[int, float]) -> list[ModelProfile]:
        """The models' profiles, each pp's stage times scaled by ``pace[pp]`` (none: as measured)."""
        profiles, _, _ = cost_profiles(
            configs,
            devices=2,
            seq_len=384,
            max_batch_size=args.max_batch_size,
            dtype_bytes=DTYPES[args.dtype].itemsize,
            measured=MeasuredLatency(scaled(latency, pace), overhead),
        )
        return profiles

    def record(policy: str, point: Point, url: str, seed: int, duration_s: float) -> dict[str, Any]:
        trace = point.trace(names, duration_s, seed)
        slo_s = point.slo_scale * single
        placement = placement_of(url)
        pp, pace = server_pace(url, placement, latency, max_batch_size=args.max_batch_size)
        profiles = profiles_at({pp: pace})
        sent = run_point(url, trace, slo_s)
        predicted = simulate(placement, profiles, trace, slo_s=slo_s, config=sim_cfg)
        got = summary(sent, slo_s=slo_s)
        row = {
            "policy": policy,
            "rate": point.rate,
            "cv": point.cv,
            "slo_scale": point.slo_scale,
            "sweep": point.sweep,
            "seed": seed,
            "slo_ms": round(1e3 * slo_s, 2),
            "placement": placement.describe(),
            "pace": round(pace, 3),
            "measured": got["attainment"],
            "predicted": round(predicted.attainment, 6),
            "bound": round(bound(trace, latency, slo_s=slo_s, max_batch_size=args.max_batch_size), 6),
            **{k: got[k] for k in ("requests", "statuses", "send_lag_p99_ms")},
        }
        rows.append(row)
        logger.info(
            "%-11s rate %5.1f cv %g slo %gx: measured %.3f predicted %.3f (%s, pace x%.2f) %s",
            policy,
            point.rate,
            point.cv,
            point.slo_scale,
            row["measured"],
            row["predicted"],
            row["placement"],
            pace,
            row["statuses"],
        )
        return row

    def measure(policy: str, pt: Point, seed: int, duration_s: float) -> dict[str, Any]:
        """A fresh server of ``policy`` told the point's workload (auto chooses its whole placement by
        it, dedicated and multiplexed which models get replicas), warmed, then the point's trace."""
        workload = [
            "--workload-rate",
            str(pt.rate),
            "--workload-cv",
            str(pt.cv),
            "--slo-scale",
            str(pt.slo_scale),
        ]
        cmd = server_args(args, folders, profile_path, memory, policy) + workload
        with local_server(cmd, ready_timeout_s=600) as srv:
            run_point(srv.url, pt.trace(names, 5.0, 999), pt.slo_scale * single)  # warm
            return record(policy, pt, srv.url, seed, duration_s)

    if args.drift:
        if args.drift_rate is None:
            args.drift_rate = round(0.7 * capacity, 1)
        server_single = latency.latency(1, 1, 1) + overhead  # the SLOs' base as the auto server computes it
        entry = run_drift(
            args,
            names=names,
            base_cmd=server_args(args, folders, profile_path, memory, "auto"),
            serve=lambda cmd: local_server(cmd, ready_timeout_s=600),
            replay_trace=run_point,
            placement_of=placement_of,
            pace_of=lambda url, pl: server_pace(url, pl, latency, max_batch_size=args.max_batch_size),
            profiles_at=profiles_at,
            planner=Planner(
                profiles_at({}),
                2,
                memory,
                {m: args.drift_slo_scale * server_single for m in names},
                sim_cfg,
            ),
            slo_s=args.drift_slo_scale * single,
        )
        measured = MeasuredLatency(latency, overhead)
        return report_drift(entry, args, info, single=single, memory=memory, measured=measured)

    if args.paired:
        profiles = profiles_at({})

        def predict(policy: str, rate: float, cv: float, slo: float, seed: int) -> float:
            trace = Point(rate, cv, slo, "paired").trace(names, args.max_run_s, seed)
            choice = choose_placement(
                policy,
                profiles,
                trace,
                num_devices=2,
                device_memory_bytes=memory,
                slo_s=slo * single,
                config=sim_cfg,
            )
            return choice.result.attainment

        entries = run_paired(
            args,
            measure=lambda policy, rate, cv, slo, seed, d: measure(
                policy, Point(rate, cv, slo, "paired"), seed, d
            ),
            predict=predict,
            capacity=capacity,
            count=lambda rate, seed, d: len(
                Point(rate, args.cv, 0.0, "paired").trace(names, d, seed).requests
            ),
        )
        return report_paired(
            entries, args, info, single=single, memory=memory, measured=MeasuredLatency(latency, overhead)
        )

    # point by point, the policies one after the other: each point's runs see the machine alike
    for k, pt in enumerate(points):
        for policy in policies:
            measure(policy, pt, args.seed + k, args.duration_s)
    measured = MeasuredLatency(latency, overhead)
    return report(rows, args, info, single=single, overhead=overhead, memory=memory, measured=measured)


if __name__ == "__main__":
    try:
        with raise_on_sigterm():  # kill PID stops the server it started, as Ctrl-C does
            sys.exit(main())
    except Terminated as stop:
        sys.exit(stop.exit_code)
