"""Shard-at-load: what part of each full checkpoint tensor a rank holds, and reading only that part.

A sharded module (``partitioner/tp_layers.py``, LoRA factors from ``partitioner/lora.py``) records
in a ``shard_specs`` dict (parameter local name -> ``ShardSlice``) which slice of the full tensor
each of its parameters holds. ``load_shard`` turns those specs into the plain index regions that
``models.hf_weights.load_weights`` reads, so every rank reads from the safetensors mmap only the
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

from torch import nn

from models.config import EncoderConfig
from models.hf_weights import LoadReport, Region, WeightSource, load_weights

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardSlice:
    """The part of a full tensor a rank holds: ``length`` entries from ``start`` along ``dim``."""

    dim: int
    start: int
    length: int

    def region(self) -> Region:
        """The same slice as a plain index region: ``full[region]`` is this rank's tensor."""
        return (*([slice(None)] * self.dim), slice(self.start, self.start + self.length))


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
    factors are merged slice by slice (``models.hf_weights.load_weights`` documents the rules).
    """

    def region_of(name: str) -> Region | None:
        spec = shard_spec(module, name)
        return None if spec is None else spec.region()

    return load_weights(module, source, config, head_seed=head_seed, region_of=region_of)
