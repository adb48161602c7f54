"""Shard-at-load: what part of each full checkpoint tensor a rank holds, and reading only that part.

A sharded module (``partitioner/tp_layers.py``, LoRA factors from ``partitioner/lora.py``) records
in a ``shard_specs`` dict (parameter local name -> ``ShardSlice``) which slice of the full tensor
each of its parameters holds. ``load_shard`` turns those specs into the plain index regions that
``shardserve.models.hf_weights.load_weights`` reads, so every rank reads from the safetensors mmap only the
bytes of its own slices (and the matching rows/columns of any LoRA overlay factors). Parameters
without a spec are replicated and read whole. ``models/`` never sees a ``ShardSlice``.

    with torch.device("meta"):
        model = EncoderForQA(config)
    apply_tensor_parallel(model, tp_rank=r, tp_size=t, group=g)      # sets shard_specs
    model = model.to_empty(device="cpu")
    report = load_shard(model, source.weights(), config)               # rank r's slices only
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from shardserve.models.config import EncoderConfig
from shardserve.models.hf_weights import LoadReport, Region, WeightSource, load_weights

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardSlice:
    """The part of a full tensor a rank holds: ``length`` entries from ``start`` along ``dim``; with
    ``blocks`` > 1 (a fused projection: query/key/value in one matrix), the full tensor is that many
    equal blocks along ``dim`` and the rank holds ``[start, start + length)`` of each, in block order."""

    dim: int
    start: int
    length: int
    blocks: int = 1

    def regions(self, full_size: int) -> list[Region]:
        """Index regions of a full tensor of ``full_size`` along ``dim``; this rank's tensor is their
        concatenation along ``dim`` (one region unless fused)."""
        block = full_size // self.blocks
        lead = [slice(None)] * self.dim
        return [
            (*lead, slice(b * block + self.start, b * block + self.start + self.length))
            for b in range(self.blocks)
        ]

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``full``."""
        return torch.cat([full[r] for r in self.regions(full.shape[self.dim])], dim=self.dim)

    def to_list(self) -> list[int]:
        """As shard files store it (``training/checkpoint_shards.py``)."""
        return [self.dim, self.start, self.length, self.blocks]


def shard_spec(module: nn.Module, name: str) -> ShardSlice | None:
    """The ``ShardSlice`` of parameter ``name`` (dotted, relative to ``module``), None if replicated."""
    owner_name, _, local = name.rpartition(".")
    return getattr(module.get_submodule(owner_name), "shard_specs", {}).get(local)


def shard_specs_of(module: nn.Module) -> dict[str, ShardSlice]:
    """Parameter name -> slice of the full tensor, for every sharded parameter of ``module``."""
    specs = {name: shard_spec(module, name) for name, _ in module.named_parameters()}
    return {name: spec for name, spec in specs.items() if spec is not None}


def load_shard(
    module: nn.Module,
    source: WeightSource,
    config: EncoderConfig,
    *,
    head_seed: int = 0,
) -> LoadReport:
    """Fill ``module`` (materialised, e.g. by ``to_empty``) with its shard of ``source``'s weights.

    Sharded parameters receive only their slice (read straight off the mmap); LoRA overlay
    factors are merged slice by slice (``shardserve.models.hf_weights.load_weights`` documents the rules).
    """

    def regions_of(name: str, full_shape: tuple[int, ...]) -> list[Region] | None:
        spec = shard_spec(module, name)
        return None if spec is None else spec.regions(full_shape[spec.dim])

    return load_weights(module, source, config, head_seed=head_seed, regions_of=regions_of)
