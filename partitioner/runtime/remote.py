"""Ranks on other hosts: the spec a remote worker joins a gang with, published in the rendezvous.

A gang whose ranks live on several hosts is still driven by one process (the HTTP server, or
``shardserve train``), which hosts the rendezvous store and the channel (``partitioner/runtime/channel.py``)
on an address the other hosts reach (``GangNetwork``), spawns its local ranks, and publishes what
the others need under ``shardserve/spec`` in the store: the model reference, the layout (dp, pp,
tp, stage boundaries), device, dtype, threads and timeouts, the program and its settings, and the
channel's endpoints, signed with the gang key (the store has no authentication; an unsigned or
foreign spec is refused).

A worker started elsewhere (``shardserve worker``: torchrun's ``MASTER_ADDR`` / ``MASTER_PORT`` /
``RANK``, the key in ``SHARDSERVE_GANG_KEY`` or a file) reads and verifies the spec, resolves the
model locally (a registry name, or a path that exists on its host), builds the same plan, checks
its stages match, and runs the rank program like a local rank: only its shard is loaded.

The spec names its program (``RemoteProgram``, registered by the program's own module: ``serve``
is the forward stream's, ``train`` training's; ``GangSpec.extra`` crosses as the program's JSON).
The driver says which one its remote ranks run (``GangNetwork.program``); a worker runs only the
programs it was given (``join_gang(programs=)``, an allow-list that the ``shardserve`` console
script composes): a name in a spec never imports anything, and no pickle crosses hosts.

    key = new_key()
    net = GangNetwork(host="10.0.0.1", store_port=29500, external_ranks=(1,), key=key, program=STREAM_PROGRAM)
    gang = Gang(spec, network=net).start()           # on the server's host: waits for rank 1
    # on the other host:  MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 RANK=1 SHARDSERVE_GANG_KEY=<hex> \\
    #                     GLOO_SOCKET_IFNAME=eth0 shardserve worker
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from shardserve.models.registry import MODEL_NAMES, ModelSource, resolve_model
from shardserve.partitioner.plan import ParallelDims, default_devices, make_plan
from shardserve.partitioner.runtime.channel import ENV_ENDPOINTS, ENV_KEY
from shardserve.partitioner.runtime.rank import GangSpec, Program

logger = logging.getLogger(__name__)

SPEC_KEY = "shardserve/spec"
RETRY_JOIN_S = 1.0  # pause before connecting again to a store that closed the connection


@dataclass(frozen=True)
class RemoteProgram:
    """A gang program that ranks on other hosts may run: its name in the spec and its
    ``GangSpec.extra`` as JSON both ways (``from_json`` also gets the model source the worker
    resolved, and returns it adjusted if the program changes it, e.g. training's dropout)."""

    name: str
    program: Program
    to_json: Callable[[dict[str, Any]], dict[str, Any]]
    from_json: Callable[[dict[str, Any], ModelSource], tuple[dict[str, Any], ModelSource]]


class JoinError(RuntimeError):
    """A worker cannot join: no spec in time, a spec not signed with our key, or a plan mismatch."""


@dataclass(frozen=True)
class GangNetwork:
    """Where a gang's driver listens and which ranks it does not spawn.

    ``host``: the address the store and the channel bind (127.0.0.1: a gang on this machine; for
    ranks elsewhere, this host's address on the network they share, never all interfaces by
    default). ``store_port``: 0 picks a free one (local gangs); remote workers need a fixed one.
    ``external_ranks``: ranks started elsewhere (``shardserve worker``); the driver waits for them.
    ``key``: the gang key the workers were given (None: a fresh one, local gangs only).
    ``program``: what the external ranks run (the gang spec's program must be its; the gang's user
    names it, e.g. ``dataclasses.replace(network, program=STREAM_PROGRAM)``)."""

    host: str = "127.0.0.1"
    store_port: int = 0
    external_ranks: tuple[int, ...] = ()
    key: bytes | None = None
    program: RemoteProgram | None = None

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


def publish_spec(
    store: dist.Store, spec: GangSpec, *, endpoints: str, key: bytes, program: RemoteProgram
) -> None:
    """Write what remote workers need to join into ``store``, signed: the model, the layout, the
    ``program`` (the spec's own, by name) with its settings, and the driver's channel ``endpoints``."""
    if program.program is not spec.program:
        raise ValueError(
            f"the gang runs {getattr(spec.program, '__qualname__', spec.program)}, not the "
            f"remote program {program.name!r} ({program.program.__qualname__}): give GangNetwork(program=...)"
        )
    plan = spec.plan
    source = spec.source
    body = {
        "program": program.name,
        "extra": program.to_json(spec.extra),
        # a registry name resolves on any host; a directory must exist at that path there too
        "model": source.name if source.name in MODEL_NAMES else str(source.checkpoint),
        "device": plan.devices[0].split(":")[0],
        "dp": plan.dims.dp,
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


def _layout(dims: ParallelDims) -> str:
    return (f"dp={dims.dp}, " if dims.dp > 1 else "") + f"pp={dims.pp}, tp={dims.tp}"


def read_spec(
    store: dist.Store,
    *,
    key: bytes,
    rank: int,
    device: str = "cpu",
    world_size: int | None = None,
    programs: Mapping[str, RemoteProgram],
) -> tuple[GangSpec, str]:
    """The gang spec published in ``store`` (verified with ``key``) as this host sees it, and the
    driver's channel endpoints. ``JoinError`` when it is not ours, names a program not in
    ``programs``, or does not match locally (``world_size``: the worker's ``WORLD_SIZE``, if given)."""
    raw = json.loads(store.get(SPEC_KEY))
    body = raw.get("spec")
    payload = json.dumps(body, sort_keys=True).encode()
    if not hmac.compare_digest(_sign(payload, key), str(raw.get("sig", ""))):
        raise JoinError(
            "the gang spec in the rendezvous store is not signed with our key: wrong key, or not our gang"
        )
    name = body.get("program")
    if name not in programs:
        raise JoinError(f"the gang spec names program {name!r}; this worker runs only {sorted(programs)}")
    prog = programs[name]
    source = resolve_model(body["model"])
    dims = ParallelDims(pp=body["pp"], tp=body["tp"], dp=body.get("dp", 1))
    if not 0 <= rank < dims.world_size:
        raise JoinError(f"rank {rank} is outside the gang's {dims.world_size} ranks ({_layout(dims)})")
    if world_size is not None and world_size != dims.world_size:
        raise JoinError(
            f"WORLD_SIZE={world_size}, but the gang the driver published has {dims.world_size} ranks "
            f"({_layout(dims)})"
        )
    devices = default_devices(dims.world_size, device=body.get("device", device))
    plan = make_plan(source.config, dims, boundaries=body["boundaries"] or None, devices=devices)
    local = [list(s.layers) for s in plan.stages]
    if local != body["stage_layers"]:
        raise JoinError(
            f"model {body['model']!r} splits differently here: stages {local}, the driver's {body['stage_layers']} "
            "(a different model at that path?)"
        )
    extra, source = prog.from_json(body.get("extra", {}), source)
    spec = GangSpec(
        source,
        plan,
        program=prog.program,
        threads_per_rank=body["threads_per_rank"],
        dtype=body["dtype"],
        backend=body["backend"],
        collective_timeout_s=body["collective_timeout_s"],
        head_seed=body["head_seed"],
        extra=extra,
    )
    return spec, body["endpoints"]


def join_gang(
    *,
    master_addr: str,
    master_port: int,
    rank: int,
    key: bytes,
    timeout_s: float = 300.0,
    world_size: int | None = None,
    programs: Mapping[str, RemoteProgram],
) -> None:
    """Join the gang whose store is at ``master_addr:master_port`` as ``rank`` and run it (this
    process becomes the rank and exits with its code). ``world_size``: torchrun's ``WORLD_SIZE``
    when given, checked against the spec; ``programs``: the programs this worker may run, by name."""
    from shardserve.partitioner.runtime.rank import worker_main

    store = _spec_store(master_addr, master_port, timeout_s=timeout_s)
    spec, endpoints = read_spec(store, key=key, rank=rank, world_size=world_size, programs=programs)
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
    logger.info(
        "rank %d joins the %s gang at %s:%d (%s)",
        rank, spec.program.__name__, master_addr, master_port, spec.source.name,
    )  # fmt: skip
    worker_main(rank, spec, {k: v for k, v in env.items() if v is not None} | _passthrough())


def _spec_store(master_addr: str, master_port: int, *, timeout_s: float) -> dist.TCPStore:
    """A client of the driver's store once it holds the spec, within ``timeout_s``.

    A connection the driver closes is tried again: a server replacing a failed gang closes the old
    gang's store and opens the new one's on the same port, and a worker started in between must
    wait for the new one rather than give up (``JoinError`` only when the time is spent)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with _quiet_native_stderr():
                store = dist.TCPStore(
                    master_addr,
                    master_port,
                    is_master=False,
                    timeout=timedelta(seconds=max(1.0, left)),
                    use_libuv=True,
                )
                store.wait([SPEC_KEY])
            return store
        except Exception as exc:  # the store's timeout and connection errors
            if time.monotonic() + RETRY_JOIN_S >= deadline:
                raise JoinError(
                    f"no gang spec at {master_addr}:{master_port} after {timeout_s:.0f}s: {exc}"
                ) from None
            logger.info("the gang store at %s:%d went away (%s); trying again", master_addr, master_port, exc)
            time.sleep(RETRY_JOIN_S)


@contextlib.contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """Hold back what C++ writes to stderr (fd 2) meanwhile and pass it to the debug log.

    While it waits for a store, c10d logs every failed connection attempt and timed-out poll as a
    warning with ~30 C++ stack frames; ``TORCH_CPP_LOG_LEVEL`` would silence it, but torch reads it
    only when it is first imported (long before a worker knows it will wait). The Python exception
    that follows carries the one line worth showing (``JoinError``'s message)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable fd 2 (closed, or a test's replaced stream): leave it
        yield
        return
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            text = caught.read().decode("utf-8", errors="replace").strip()
            if text:
                logger.debug("c10d while waiting for the store (held back from stderr):\n%s", text[-8000:])


def _passthrough() -> dict[str, str]:
    """Settings of this host that the rank should keep (its network interface for gloo/NCCL)."""
    return {k: os.environ[k] for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if k in os.environ}
