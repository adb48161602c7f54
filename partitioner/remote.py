"""Ranks on other hosts: the spec a remote worker joins a gang with, published in the rendezvous.

A gang whose ranks live on several hosts is still driven by one process (the HTTP server), which
hosts the rendezvous store and the channel (``partitioner/channel.py``) on an address the other
hosts reach (``GangNetwork``), spawns its local ranks, and publishes what the others need under
``shardserve/spec`` in the store: the model reference, the layout (pp, tp, stage boundaries),
dtype, threads and timeouts, and the channel's endpoints, signed with the gang key (the store
has no authentication; an unsigned or foreign spec is refused).

A worker started elsewhere (``shardserve worker``: torchrun's ``MASTER_ADDR`` / ``MASTER_PORT`` /
``RANK``, the key in ``SHARDSERVE_GANG_KEY`` or a file) reads and verifies the spec, resolves the
model locally (a registry name, or a path that exists on its host), builds the same plan, checks
its stages match, and runs the rank program like a local rank: only its shard is loaded.

    key = new_key()
    net = GangNetwork(host="10.0.0.1", store_port=29500, external_ranks=(1,), key=key)
    gang = Gang(spec, network=net).start()           # on the server's host: waits for rank 1
    # on the other host:  MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 RANK=1 SHARDSERVE_GANG_KEY=<hex> \\
    #                     GLOO_SOCKET_IFNAME=eth0 shardserve worker
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from models.registry import resolve_model
from partitioner.channel import ENV_ENDPOINTS, ENV_KEY
from partitioner.plan import ParallelDims, make_plan
from partitioner.worker import GangMode, GangSpec, serve_rank

logger = logging.getLogger(__name__)

SPEC_KEY = "shardserve/spec"


class JoinError(RuntimeError):
    """A worker cannot join: no spec in time, a spec not signed with our key, or a plan mismatch."""


@dataclass(frozen=True)
class GangNetwork:
    """Where a gang's driver listens and which ranks it does not spawn.

    ``host``: the address the store and the channel bind (127.0.0.1: a gang on this machine; for
    ranks elsewhere, this host's address on the network they share, never all interfaces by
    default). ``store_port``: 0 picks a free one (local gangs); remote workers need a fixed one.
    ``external_ranks``: ranks started elsewhere (``shardserve worker``); the driver waits for them.
    ``key``: the gang key the workers were given (None: a fresh one, local gangs only)."""

    host: str = "127.0.0.1"
    store_port: int = 0
    external_ranks: tuple[int, ...] = ()
    key: bytes | None = None

    def __post_init__(self) -> None:
        if self.external_ranks and (self.key is None or self.store_port == 0):
            raise ValueError(
                f"ranks {list(self.external_ranks)} are external: the workers need a fixed store port "
                f"(got {self.store_port}) and the gang key they were given (got {'none' if self.key is None else 'one'})"
            )


def read_gang_key(path: str | None = None) -> bytes:
    """The gang key (hex) from ``path``, else from ``SHARDSERVE_GANG_KEY``; ``JoinError`` if neither."""
    if path is not None:
        try:
            text = open(path).read().strip()
        except OSError as exc:
            raise JoinError(f"cannot read the gang key file {path}: {exc.strerror}") from None
    else:
        text = os.environ.get(ENV_KEY, "").strip()
        if not text:
            raise JoinError(f"no gang key: give --key-file or set {ENV_KEY}")
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise JoinError(
            "the gang key must be hex (as `python -c 'import secrets; print(secrets.token_hex(32))'`)"
        ) from None
    if len(key) < 16:
        raise JoinError(f"the gang key has {len(key)} bytes; use at least 16 (32 recommended)")
    return key


def _sign(payload: bytes, key: bytes) -> str:
    return hmac.new(key, payload, hashlib.sha256).hexdigest()


def publish_spec(store: dist.Store, spec: GangSpec, *, endpoints: str, key: bytes) -> None:
    """Write what remote workers need to join (a serving gang) into ``store``, signed."""
    if spec.mode is not GangMode.STREAM or spec.program is not serve_rank:
        raise ValueError("ranks on other hosts are supported for serving gangs (serve_rank) only")
    plan = spec.plan
    body = {
        "model": spec.source.name,
        "pp": plan.dims.pp,
        "tp": plan.dims.tp,
        "boundaries": [s.layers[0] for s in plan.stages[1:]],
        "stage_layers": [list(s.layers) for s in plan.stages],
        "dtype": spec.dtype,
        "threads_per_rank": spec.threads_per_rank,
        "backend": spec.backend,
        "collective_timeout_s": spec.collective_timeout_s,
        "head_seed": spec.head_seed,
        "endpoints": endpoints,
    }
    payload = json.dumps(body, sort_keys=True).encode()
    store.set(SPEC_KEY, json.dumps({"spec": body, "sig": _sign(payload, key)}))


def read_spec(store: dist.Store, *, key: bytes, rank: int, device: str = "cpu") -> tuple[GangSpec, str]:
    """The gang spec published in ``store`` (verified with ``key``) as this host sees it, and the
    driver's channel endpoints. ``JoinError`` when it is not ours or does not match locally."""
    raw = json.loads(store.get(SPEC_KEY))
    body = raw.get("spec")
    payload = json.dumps(body, sort_keys=True).encode()
    if not hmac.compare_digest(_sign(payload, key), str(raw.get("sig", ""))):
        raise JoinError(
            "the gang spec in the rendezvous store is not signed with our key: wrong key, or not our gang"
        )
    source = resolve_model(body["model"])
    dims = ParallelDims(pp=body["pp"], tp=body["tp"])
    if not 0 <= rank < dims.world_size:
        raise JoinError(
            f"rank {rank} is outside the gang's {dims.world_size} ranks (pp={dims.pp}, tp={dims.tp})"
        )
    devices = tuple(device for _ in range(dims.world_size))
    plan = make_plan(source.config, dims, boundaries=body["boundaries"] or None, devices=devices)
    local = [list(s.layers) for s in plan.stages]
    if local != body["stage_layers"]:
        raise JoinError(
            f"model {body['model']!r} splits differently here: stages {local}, the driver's {body['stage_layers']} "
            "(a different model at that path?)"
        )
    spec = GangSpec(
        source,
        plan,
        threads_per_rank=body["threads_per_rank"],
        dtype=body["dtype"],
        backend=body["backend"],
        collective_timeout_s=body["collective_timeout_s"],
        head_seed=body["head_seed"],
    )
    return spec, body["endpoints"]


def join_gang(*, master_addr: str, master_port: int, rank: int, key: bytes, timeout_s: float = 300.0) -> None:
    """Join the gang whose store is at ``master_addr:master_port`` as ``rank`` and run it (this
    process becomes the rank and exits with its code)."""
    from partitioner.worker import worker_main

    try:
        store = dist.TCPStore(
            master_addr, master_port, is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True
        )
        store.wait([SPEC_KEY])
    except Exception as exc:  # the store's timeout and connection errors
        raise JoinError(
            f"no gang spec at {master_addr}:{master_port} after {timeout_s:.0f}s: {exc}"
        ) from None
    spec, endpoints = read_spec(store, key=key, rank=rank)
    del store
    env = {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "RANK": str(rank),
        "WORLD_SIZE": str(spec.plan.dims.world_size),
        "SHARDSERVE_DRIVER_STORE": "1",
        ENV_ENDPOINTS: endpoints,
        ENV_KEY: key.hex(),
        "OMP_NUM_THREADS": str(spec.threads_per_rank),
    }
    logger.info("rank %d joins the gang at %s:%d (%s)", rank, master_addr, master_port, spec.source.name)
    worker_main(rank, spec, {k: v for k, v in env.items() if v is not None} | _passthrough())


def _passthrough() -> dict[str, str]:
    """Settings of this host that the rank should keep (its network interface for gloo/NCCL)."""
    return {k: os.environ[k] for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if k in os.environ}
