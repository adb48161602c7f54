"""The settings that put some of a gang's ranks on other hosts, for every command that drives a gang.

``shardserve serve`` and ``shardserve train`` take the same five, defined once here:
``--external-ranks`` (ranks started elsewhere with ``shardserve worker``), ``--gang-host`` /
``--gang-port`` (where the rendezvous store and the channel listen) and ``--gang-key`` /
``--gang-key-file`` (the key the workers were given). ``GangFlags`` is a pydantic-settings model
(every field also reads ``SHARDSERVE_<NAME>``; the console script makes its flags): ``ServeSettings``
inherits it, ``TrainSettings`` holds one. ``gang_problems`` is the one validation, ``network()`` the
``GangNetwork`` it describes.

    flags = GangFlags(external_ranks="1", gang_host="10.0.0.1", gang_port=29500, gang_key_file="k")
    problems = flags.gang_problems(world_size=2, layout="pp=2 x tp=1")   # [] when usable
    Gang(spec, network=flags.network())
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from shardserve.partitioner.command import split_list
from shardserve.partitioner.runtime.remote import GangNetwork

HEX = frozenset("0123456789abcdefABCDEF")


def secret_from_file(data: Any, *, secret: str, file: str) -> Any:
    """Settings input with ``secret`` read from the first line of the file named by ``file``."""
    if not isinstance(data, dict) or not data.get(file):
        return data
    if data.get(secret):
        raise ValueError(f"give {secret} or {file}, not both")
    path = Path(str(data[file])).expanduser()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise ValueError(f"{file} {str(path)!r} cannot be read: {reason}") from None
    value = lines[0].strip() if lines else ""
    if not value:
        raise ValueError(f"{file} {str(path)!r} is empty")
    return {**data, secret: value}


class GangFlags(BaseSettings):
    """Where a gang's driver listens and which of its ranks run on other hosts (see module doc)."""

    model_config = SettingsConfigDict(env_prefix="SHARDSERVE_", extra="ignore", frozen=True)

    external_ranks: Annotated[list[int], NoDecode] = Field(
        default_factory=list,
        description="comma-separated ranks of the gang that run on other hosts, each started there "
        "with `shardserve worker` (MASTER_ADDR and MASTER_PORT: gang_host and gang_port, RANK=r, and the gang key); "
        "the driver spawns the others and waits for these",
    )
    gang_host: str = Field(
        "127.0.0.1",
        description="address the gang's rendezvous store and channel listen on: 127.0.0.1 for a gang on this "
        "machine; with external_ranks this host's address on the network the workers share (not 0.0.0.0)",
    )
    gang_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="rendezvous port of the gang (0: a free one; with external_ranks: fixed, "
        "the workers' MASTER_PORT)",
    )
    gang_key: str | None = Field(
        None,
        description="the gang key (hex, at least 16 bytes) the workers were given: their messages and the "
        "published spec are signed with it",
    )
    gang_key_file: str | None = Field(
        None, description="read the gang key from this file (first line); not together with gang_key"
    )

    @model_validator(mode="before")
    @classmethod
    def _read_gang_key_file(cls, data: Any) -> Any:
        return secret_from_file(data, secret="gang_key", file="gang_key_file")

    @model_validator(mode="before")
    @classmethod
    def _split_external_ranks(cls, data: Any) -> Any:
        return split_list(data, "external_ranks")

    def gang_problems(self, *, world_size: int, layout: str) -> list[str]:
        """What makes these flags unusable for a gang of ``world_size`` ranks (``layout``, e.g.
        "pp=2 x tp=1", names it in the message); empty when no rank is external or all is well."""
        if not self.external_ranks:
            return []
        out = []
        outside = [r for r in self.external_ranks if not 0 <= r < world_size]
        if outside:
            out.append(f"external_ranks {outside} are not ranks of a {layout} gang (0..{world_size - 1})")
        if self.gang_port == 0:
            out.append("external_ranks need a fixed gang_port (the workers' MASTER_PORT)")
        if self.gang_host in ("0.0.0.0", "::", ""):
            out.append(
                f"gang_host={self.gang_host!r} would listen on every interface: give this host's address"
            )
        key = self.gang_key or ""
        if not set(key) <= HEX or len(key) < 32 or len(key) % 2:
            out.append(
                "external_ranks need the gang key (gang_key / gang_key_file / SHARDSERVE_GANG_KEY): hex, >= 16 bytes"
            )
        return out

    def network(self) -> GangNetwork:
        """The ``GangNetwork`` these flags describe (call after ``gang_problems`` came back empty)."""
        external = tuple(self.external_ranks)
        return GangNetwork(
            host=self.gang_host,
            store_port=self.gang_port,
            external_ranks=external,
            key=bytes.fromhex(self.gang_key) if external and self.gang_key else None,
        )


GANG_FIELDS: tuple[str, ...] = tuple(GangFlags.model_fields)
