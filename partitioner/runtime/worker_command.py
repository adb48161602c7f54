"""``shardserve worker``: run one rank of a gang whose driver is on another host.

The command's settings (``WorkerSettings``; torchrun's variables fill what the flags leave out)
and ``worker_command(programs)``, the command as data for the console script, which composes the
programs a worker may run (serve's stream, training) from the packages above this one.

    MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 RANK=1 shardserve worker --key-file gang.key
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Annotated

from pydantic import AfterValidator, Field

from shardserve.partitioner.command import Command, Settings, positive_number
from shardserve.partitioner.runtime.remote import JoinError, RemoteProgram, join_gang, read_gang_key

logger = logging.getLogger(__name__)


class WorkerSettings(Settings):
    """``shardserve worker``: where the driver is and which rank this is (flags, else torchrun's
    variables; checked when the command runs, ``worker_address``)."""

    master_addr: str | None = Field(None, description="the driver's host (default: env MASTER_ADDR)")
    master_port: int | None = Field(
        None, description="its rendezvous port, 1..65535 (default: env MASTER_PORT)"
    )
    rank: int | None = Field(None, description="this worker's rank in the gang, >= 0 (default: env RANK)")
    world_size: int | None = Field(
        None,
        description="ranks in the gang (default: env WORLD_SIZE; optional: checked against the driver's spec)",
    )
    key_file: str | None = Field(
        None,
        description="file holding the gang key (hex), as given to the server; default: env SHARDSERVE_GANG_KEY",
    )
    join_timeout_s: Annotated[float, AfterValidator(positive_number)] = Field(
        300.0, description="seconds to wait for the driver's spec, > 0"
    )


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


def worker_address(args: WorkerSettings) -> tuple[str, int, int, int | None]:
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


def run_worker(args: WorkerSettings, *, programs: Mapping[str, RemoteProgram]) -> int:
    """``shardserve worker``: join the gang, run this rank's program until the gang stops."""
    addr, port, rank, world_size = worker_address(args)
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
        programs=dict(programs),
    )
    return 0  # not reached: the rank exits with its own code


def worker_command(programs: Sequence[RemoteProgram]) -> Command:
    """``shardserve worker`` as a command that runs only ``programs`` (a driver asking for another
    is refused)."""
    return Command(
        "worker",
        help="run one rank of a gang whose driver is on another host",
        description="Join the gang whose rendezvous store is at MASTER_ADDR:MASTER_PORT as rank RANK "
        "(torchrun's variables, or the flags), read the model and layout the driver published (signed "
        "with the gang key), load only this rank's shard and run it until the gang stops; exits 0 then, "
        "non-zero on a failure (a supervisor such as Kubernetes restarts it to join the next gang). "
        "The driver may be a server (`serve --external-ranks`) or a training run (`train --external-ranks`). "
        "GLOO_SOCKET_IFNAME names the interface the other ranks reach.",
        settings=WorkerSettings,
        run=functools.partial(run_worker, programs={prog.name: prog for prog in programs}),
    )
