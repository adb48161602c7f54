"""``shardserve plan`` and ``shardserve verify``: inspect a partition, check it against the reference.

shardserve plan --model minilm --pp 2 --tp 2 --batch-size 8 --seq-len 384
shardserve plan --model tiny-bert --pp 3 --json
shardserve plan --model minilm --dp 2 --pp 2 --batch-size 4 --seq-len 256   # training: 4 ranks
shardserve verify --model tiny-roberta --pp 2 --tp 2
MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 RANK=1 shardserve worker --key-file gang.key   # on another host
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Sequence

from models.config import ModelConfigError
from models.hf_weights import CheckpointError
from models.registry import MODEL_NAMES, resolve_model
from partitioner.compiled import COMPILE_CHOICES, resolve_compile
from partitioner.cost import InfeasiblePlanError, analytic_costs, profile_costs
from partitioner.plan import ParallelDims, default_devices, make_plan
from partitioner.precision import DTYPE_CHOICES, PrecisionError, resolve_dtype
from partitioner.runtime.remote import SERVE, JoinError, RemoteProgram, join_gang, read_gang_key
from serving.fleet.verify import TOLERANCES

logger = logging.getLogger(__name__)


def _parse_boundaries(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"--boundaries expects comma-separated layer indices, got {text!r}"
        ) from exc


def _at_least(minimum: int):
    """argparse type: an integer >= ``minimum`` (a mistake is argparse's one-line error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum} (got {value})")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def _positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a number > 0 (got {text})")
    return value


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="default",
        help=f"registry name {MODEL_NAMES} or a local Hugging Face model directory (default: %(default)s)",
    )
    p.add_argument(
        "--pp", type=int, default=1, help="pipeline-parallel degree: number of stages (default: %(default)s)"
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel degree: ranks per stage sharing heads and MLP (default: %(default)s)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where ranks run: cpu (gloo), or cuda (one GPU per rank round-robin; NCCL when every rank has "
        "its own GPU, gloo through host memory when ranks share one) (default: %(default)s)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="compute dtype of the ranks: auto picks bfloat16 on GPUs and on CPUs with bf16 units (AMX, "
        "AVX512-BF16), else float32; float16 only where the device has fp16 units (default: %(default)s)",
    )
    p.add_argument(
        "--boundaries",
        type=_parse_boundaries,
        default=None,
        help="manual split: first layer of stages 1..pp-1, e.g. '2,4' (default: balanced by the cost model)",
    )


def add_subcommands(
    sub: argparse._SubParsersAction, *, worker_programs: Sequence[RemoteProgram] = (SERVE,)
) -> None:
    """``plan``, ``verify`` and ``worker``; a worker runs only ``worker_programs`` (the console
    script gives it the programs of the packages above this one)."""
    p = sub.add_parser(
        "plan",
        help="show how a model is split across ranks",
        description="Print the partition plan: stages, ranks, layers, parameters per rank, "
        "memory estimates for serving and training, and each stage's cost share.",
    )
    _add_common(p)
    p.add_argument(
        "--dp",
        type=int,
        default=1,
        help="training only: data-parallel copies of the pipeline; adds the gradient all-reduce volume "
        "per step (default: %(default)s)",
    )
    p.add_argument(
        "--batch-size",
        type=_at_least(1),
        default=8,
        help="micro-batch size for memory estimates (default: %(default)s)",
    )
    p.add_argument(
        "--seq-len",
        type=_at_least(1),
        default=384,
        help="sequence length for costs and memory estimates (default: %(default)s)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="measure per-layer cost with a short CPU profile instead of computing it from shapes",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    p.set_defaults(func=cmd_plan)

    v = sub.add_parser(
        "verify",
        help="check partitioned logits against the transformers reference",
        description="Run sample inputs (several lengths, padded batches) through a gang of pp x tp "
        "worker processes and through transformers' unpartitioned model; print the max "
        "absolute difference of start/end logits; exit 1 above the tolerance.",
    )
    _add_common(v)
    v.add_argument(
        "--tolerance",
        type=_positive_float,
        default=None,
        help="max allowed |logit difference| against the fp32 reference, > 0 (default: per dtype, "
        + ", ".join(f"{k} {v:g}" for k, v in TOLERANCES.items())
        + ")",
    )
    v.add_argument(
        "--threads-per-rank",
        type=_at_least(1),
        default=1,
        help="torch threads per worker rank, >= 1 (default: %(default)s)",
    )
    v.add_argument(
        "--compile",
        choices=COMPILE_CHOICES,
        default="off",
        help="on: torch.compile the ranks' stages as `shardserve serve --compile on` does and check the "
        "compiled gang (default: %(default)s)",
    )
    v.set_defaults(func=cmd_verify)

    w = sub.add_parser(
        "worker",
        help="run one rank of a gang whose driver is on another host",
        description="Join the gang whose rendezvous store is at MASTER_ADDR:MASTER_PORT as rank RANK "
        "(torchrun's variables, or the flags), read the model and layout the driver published (signed "
        "with the gang key), load only this rank's shard and run it until the gang stops; exits 0 then, "
        "non-zero on a failure (a supervisor such as Kubernetes restarts it to join the next gang). "
        "The driver may be a server (`serve --external-ranks`) or a training run (`train --external-ranks`). "
        "GLOO_SOCKET_IFNAME names the interface the other ranks reach.",
    )
    w.add_argument("--master-addr", default=None, help="the driver's host (default: env MASTER_ADDR)")
    w.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="its rendezvous port, 1..65535 (default: env MASTER_PORT)",
    )
    w.add_argument(
        "--rank", type=int, default=None, help="this worker's rank in the gang, >= 0 (default: env RANK)"
    )
    w.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks in the gang (default: env WORLD_SIZE; optional: checked against the driver's spec)",
    )
    w.add_argument(
        "--key-file",
        help="file holding the gang key (hex), as given to the server; default: env SHARDSERVE_GANG_KEY",
    )
    w.add_argument(
        "--join-timeout-s",
        type=_positive_float,
        default=300.0,
        help="seconds to wait for the driver's spec, > 0 (default: %(default)s)",
    )
    w.set_defaults(func=cmd_worker, programs={prog.name: prog for prog in worker_programs})


def _flag_or_env_int(value: int | None, flag: str, env: str) -> int | None:
    """The flag's value, else the environment variable's (``JoinError`` if that is not an integer)."""
    if value is not None:
        return value
    text = os.environ.get(env, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise JoinError(f"{env}={text!r} is not an integer (or give {flag})") from None


def worker_settings(args: argparse.Namespace) -> tuple[str, int, int, int | None]:
    """(master address, port, rank, world size or None) from the flags, else torchrun's variables;
    ``JoinError`` naming the first problem (a value missing or out of range)."""
    addr = args.master_addr or os.environ.get("MASTER_ADDR") or None
    port = _flag_or_env_int(args.master_port, "--master-port", "MASTER_PORT")
    rank = _flag_or_env_int(args.rank, "--rank", "RANK")
    world_size = _flag_or_env_int(args.world_size, "--world-size", "WORLD_SIZE")
    missing = [
        flag for flag, v in (("--master-addr", addr), ("--master-port", port), ("--rank", rank)) if v is None
    ]
    if missing:
        raise JoinError(f"{', '.join(missing)} not given (or MASTER_ADDR / MASTER_PORT / RANK not set)")
    assert port is not None and rank is not None  # for the type checker: checked just above
    if not 1 <= port <= 65535:
        raise JoinError(f"master port {port} is outside 1..65535 (--master-port / MASTER_PORT)")
    if rank < 0:
        raise JoinError(f"rank {rank} must be >= 0 (--rank / RANK)")
    if world_size is not None and not rank < world_size:
        raise JoinError(
            f"rank {rank} is outside a gang of world size {world_size} (--world-size / WORLD_SIZE)"
        )
    return addr, port, rank, world_size


def cmd_worker(args: argparse.Namespace) -> int:
    addr, port, rank, world_size = worker_settings(args)
    key = read_gang_key(args.key_file)
    print(
        f"waiting for the driver at {addr}:{port} (join timeout {args.join_timeout_s:g} s)",
        file=sys.stderr,
        flush=True,
    )
    join_gang(
        master_addr=addr,
        master_port=port,
        rank=rank,
        key=key,
        timeout_s=args.join_timeout_s,
        world_size=world_size,
        programs=args.programs,
    )
    return 0  # not reached: the rank exits with its own code


def cmd_plan(args: argparse.Namespace) -> int:
    source = resolve_model(args.model)
    cfg = source.config
    if args.profile:
        costs = profile_costs(
            cfg,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            device="cuda" if args.device == "cuda" else "cpu",
        )
        how = "profile"
    else:
        costs, how = analytic_costs(cfg, seq_len=args.seq_len), "analytic"
    dims = ParallelDims(pp=args.pp, tp=args.tp, dp=args.dp)
    plan = make_plan(
        cfg,
        dims,
        boundaries=args.boundaries,
        costs=costs,
        cost_source=how,
        devices=default_devices(dims.world_size, device=args.device),
    )
    choice = resolve_dtype(args.dtype, plan.devices[0])
    mem = plan.memory_estimates(
        cfg, batch_size=args.batch_size, seq_len=args.seq_len, dtype_bytes=choice.itemsize
    )
    if args.json:
        out = plan.to_dict()
        out["model"] = source.describe()
        out["dtype"] = choice.name
        for s, m in zip(out["stages"], mem, strict=True):
            s.update(m)
        print(json.dumps(out, indent=2))
        return 0
    dp = f"dp={args.dp} " if args.dp > 1 else ""
    print(
        f"model {source.name}: {cfg.arch}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_heads} heads; {dp}pp={args.pp} tp={args.tp} ({plan.dims.world_size} ranks); "
        f"cost: {plan.cost_source}; memory at batch {args.batch_size} x seq {args.seq_len}, {choice.name} "
        f"(training: fp32 weights + Adam, 16 B/param)"
    )
    if args.dp > 1:
        mp = plan.dims.model_parallel_size
        print(
            f"data parallel: {args.dp} copies of the pipeline (ranks below are copy 0; copy d adds "
            f"d x {mp}); AdamW state is replicated on every copy (no ZeRO-1), so train MB per rank is "
            f"the same at any dp; AR MB = fp32 gradient bytes each rank sends (and receives) per step "
            f"in the ring all-reduce, 2 x ({args.dp}-1)/{args.dp} x 4 B/param"
        )
    ar = args.dp > 1
    header = f"{'stage':>5}  {'ranks':<12} {'layers':<9} {'params/rank':>12} {'serve MB':>9} {'train MB':>9} {'cost':>6}"
    header += f" {'AR MB':>8}" if ar else ""
    print(header)
    print("-" * len(header))
    for s, m in zip(plan.stages, mem, strict=True):
        parts = (
            (["emb"] if s.has_embeddings else [])
            + [f"{s.layer_start}-{s.layer_end - 1}"]
            + (["head"] if s.has_head else [])
        )
        row = (
            f"{s.index:>5}  {','.join(map(str, s.ranks)):<12} {'+'.join(parts):<9} {s.params_per_rank:>12,} "
            f"{m['serving_bytes'] / 2**20:>9.1f} {m['training_bytes'] / 2**20:>9.1f} {s.cost_share:>6.1%}"
        )
        print(row + (f" {m['allreduce_bytes'] / 2**20:>8.1f}" if ar else ""))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from serving.fleet.verify import verify_partitioned

    source = resolve_model(args.model)
    choice = resolve_dtype(args.dtype, args.device)
    compiled = resolve_compile(args.compile, device=args.device, tp=args.tp)
    logger.info("dtype %s (%s), compile %s", choice.name, choice.reason, args.compile)
    result = verify_partitioned(
        source,
        ParallelDims(pp=args.pp, tp=args.tp),
        tolerance=args.tolerance,
        threads_per_rank=args.threads_per_rank,
        boundaries=args.boundaries,
        device=args.device,
        dtype=choice.name,
        compile=compiled,
    )
    verdict = "PASS" if result.passed else "FAIL"
    print(
        f"{verdict} model={source.name} pp={args.pp} tp={args.tp} dtype={result.dtype}"
        f"{' compiled' if compiled else ''} "
        f"batches={result.batch_shapes} max|d start|={result.max_abs_start:.3g} "
        f"max|d end|={result.max_abs_end:.3g} tolerance={result.tolerance:g} "
        f"best span changed in {result.span_changes}/{result.windows} windows "
        f"({result.span_change_fraction:.1%}) vs the fp32 reference"
    )
    return 0 if result.passed else 1


USER_ERRORS = (ModelConfigError, CheckpointError, InfeasiblePlanError, PrecisionError, JoinError)


def main_guard(func, args: argparse.Namespace) -> int:
    try:
        return func(args)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the gangs were killed on the way out; no traceback
        print("interrupted", file=sys.stderr)
        return 130
