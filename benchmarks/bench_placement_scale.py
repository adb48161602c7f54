"""The placement search at cluster scale: how long ``dedicated`` and ``auto`` take to plan 8 to 64
devices and 8 to 32 models, and what they predict, by simulation only (no server, no GPU).

    python benchmarks/bench_placement_scale.py                      # the grid, H100 roofline profiles
    python benchmarks/bench_placement_scale.py --devices 64 --models 32 --json out.json

Each point plans ``--models`` models of mixed sizes (a quarter each of MiniLM-L6, BERT-base,
BERT-large and Qwen2-1.5B shapes, ``models/shapes.py``) on ``--devices`` GPUs (``--gpu``'s roofline
latencies and memory, or ``--device-memory-mb``), under a Zipf-like skew of per-model rates (the
k-th model gets 1/k^skew of the total) with Gamma arrivals of ``--cv``; the total rate grows with
the devices (``--rate-per-device``) and the simulated window is ``--requests`` requests long, so
the points differ in the search's size, not in its statistics. Auto searches tensor-parallel
groups too, up to ``--max-tp`` (default: the GPU's 8 per node; 1: pipelines only). Per point: the
seconds each policy's search took on this machine (one process), its predicted attainment and the
(pp, tp) of its groups; the search's time grows with devices x models x requests simulated per step
x the parallel configs tried.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from serving_report import machine_info

from shardserve.partitioner.placement.gpus import GPUS
from shardserve.partitioner.placement.plan_command import PlacementFlags, placement_profiles
from shardserve.partitioner.placement.search import auto, dedicated
from shardserve.partitioner.placement.simulator import SimConfig

logger = logging.getLogger("bench_placement_scale")

SHAPE_MIX = ("minilm-l6", "bert-base", "bert-large", "qwen2-1.5b")


def point(args: argparse.Namespace, devices: int, models: int) -> dict[str, Any]:
    """Plan ``models`` models on ``devices`` devices with both policies; their times and predictions."""
    per = models // len(SHAPE_MIX)
    rate = args.rate_per_device * devices
    flags = PlacementFlags(
        placement="auto",
        devices=devices,
        gpu=args.gpu,
        device_memory_mb=args.device_memory_mb,
        rate=rate,
        cv=args.cv,
        skew=args.skew,
        models=[f"{s}:{per}" for s in SHAPE_MIX],
        duration_s=args.requests / rate,
        slo_scale=args.slo_scale,
        seed=args.seed,
        placement_max_tp=args.max_tp,
    )
    profiles, single, _how = placement_profiles(flags, device="cpu", dtype="auto", seq_len=384, batch_size=8)
    names = [p.name for p in profiles]
    memory = (
        int(args.device_memory_mb * 2**20) if args.device_memory_mb else GPUS[args.gpu].usable_memory_bytes
    )
    workload = flags.workload(names)
    kw = dict(
        num_devices=devices,
        device_memory_bytes=memory,
        slo_s={m: args.slo_scale * single[m] for m in names},
        config=SimConfig(max_batch_size=8),
    )
    out: dict[str, Any] = {
        "devices": devices,
        "models": len(names),
        "requests": len(workload.trace().requests),
    }
    for name, policy in (("dedicated", dedicated), ("auto", auto)):
        t0 = time.perf_counter()
        choice = policy(profiles, workload, **kw)
        out[name] = {
            "seconds": round(time.perf_counter() - t0, 2),
            "attainment": round(choice.result.attainment, 4),
            "group_sizes": sorted({len(g.devices) for g in choice.placement.groups}),
            "configs": sorted({f"{g.pp}x{g.tp}" for g in choice.placement.groups if g.models}),
            "replicas": sum(len(g.models) for g in choice.placement.groups),
        }
        logger.info("%d devices, %d models: %s %s", devices, len(names), name, out[name])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, action="append", help="devices per point (default 8 16 32 64)")
    p.add_argument("--models", type=int, action="append", help="models per point, multiples of 4 (8 16 32)")
    p.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="the GPU whose roofline is planned")
    p.add_argument("--device-memory-mb", type=float, help="memory per device (default: the GPU's usable)")
    p.add_argument("--max-tp", type=int, help="auto's largest tensor-parallel degree (default: the GPU's)")
    p.add_argument("--rate-per-device", type=float, default=20.0, help="total req/s = this x devices")
    p.add_argument("--cv", type=float, default=4.0, help="inter-arrival CV of every model")
    p.add_argument("--skew", type=float, default=1.0, help="Zipf-like skew of the per-model rates")
    p.add_argument("--slo-scale", type=float, default=5.0, help="SLO as a multiple of one request's latency")
    p.add_argument("--requests", type=int, default=10_000, help="requests in each simulated window")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the points here")
    args = p.parse_args(argv)
    devices, models = args.devices or [8, 16, 32, 64], args.models or [8, 16, 32]
    if any(m % len(SHAPE_MIX) for m in models):
        p.error(f"--models must be multiples of {len(SHAPE_MIX)} (got {models})")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    info = machine_info("float32")
    rows = [point(args, d, m) for d in devices for m in models]
    print(
        f"\n{info['cpu']}; {args.gpu} roofline, cv {args.cv:g}, skew {args.skew:g}, SLO {args.slo_scale:g}x"
    )
    header = (
        f"{'devices':>7} {'models':>6} {'requests':>8}  {'dedicated s':>11} {'attain':>7}  {'auto s':>7} "
        f"{'attain':>7} {'groups (pp x tp)':>16}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        d, a = r["dedicated"], r["auto"]
        print(
            f"{r['devices']:>7} {r['models']:>6} {r['requests']:>8}  {d['seconds']:>11.1f} {d['attainment']:>7.1%}  "
            f"{a['seconds']:>7.1f} {a['attainment']:>7.1%} {','.join(a['configs']):>16}"
        )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"machine": info, "args": vars(args) | {"json": str(args.json)}, "points": rows}, indent=2
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
