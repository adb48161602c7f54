"""Model loading for serving: a model name + a ``FleetConfig`` -> a checked ``ModelGeneration``; the device pool.

Owns the checks that run BEFORE any gang starts (at startup in the CLI and the lifespan, and on
POST /admin/reload): the model resolves, its weight files open (headers only), ``max_seq_len``
fits its positions, its tokenizer is fast (offsets are needed), and the partition plan is
feasible; and the device pool of the config fits at least one gang. The front end reaches them
through the engine room (``serving/engine/builder.py``, and ``Engine.reload``).

    fleet = FleetConfig(pp=2, max_seq_len=384)                     # serving/config.py
    model = load_generation(fleet, "tiny-bert", generation=0)      # ValueError / CheckpointError / OSError
    pool = device_pool(fleet)                                      # ValueError when no gang fits

An unreadable model (missing, no weights, a corrupt tokenizer) is a ``CheckpointError`` or an
``OSError``: the reload route answers all of them alike (a reply must not map the file system);
``ValueError`` is a model that loads but does not fit the settings.
"""

from __future__ import annotations

import logging

from shardserve.models.hf_weights import CheckpointError, CheckpointReader
from shardserve.models.registry import ModelSource, resolve_model
from shardserve.partitioner.plan import ParallelDims
from shardserve.serving.config import FleetConfig
from shardserve.serving.fleet.backend import ModelGeneration
from shardserve.serving.fleet.pool import DevicePool

logger = logging.getLogger(__name__)


def load_generation(config: FleetConfig, name: str, *, generation: int) -> ModelGeneration:
    """Resolve a model, check its weights can be opened, load its fast tokenizer, validate the
    partition (``config``: pp, tp, max_seq_len); raises ValueError / CheckpointError / OSError on a
    misfit (before any gang starts)."""
    source: ModelSource = resolve_model(name)
    for path in (source.checkpoint, *source.overlays):
        CheckpointReader(path)  # headers only (safetensors / mmap): no weights -> CheckpointError now
    if config.max_seq_len > source.config.max_seq_len:
        raise ValueError(
            f"max_seq_len={config.max_seq_len} exceeds the model's {source.config.max_seq_len} positions"
        )
    try:
        tokenizer = source.tokenizer()
    except Exception as err:  # transformers / tokenizers raise anything here (KeyError, JSON errors, ...)
        raise CheckpointError(f"{source.tokenizer_dir}: the tokenizer cannot be loaded: {err!r}") from err
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{source.tokenizer_dir} has no fast tokenizer (offsets are required)")
    model = ModelGeneration(generation, source, ParallelDims(pp=config.pp, tp=config.tp), tokenizer)
    model.plan()  # raises InfeasiblePlanError (a ValueError) with the numbers
    logger.debug("model %s (generation %d) checked", source.name, generation)
    return model


def device_pool(config: FleetConfig) -> DevicePool:
    """The device pool of ``config`` (device, pool_slots, ranks_per_gpu); ValueError when not even
    one gang of ``config.world_size`` ranks fits."""
    pool = DevicePool.for_device(
        config.device, cpu_slots=config.pool_slots, ranks_per_gpu=config.ranks_per_gpu
    )
    if pool.gangs_that_fit(config.world_size) < 1:
        hint = " (raise --ranks-per-gpu to let ranks share a GPU)" if config.device == "cuda" else ""
        raise ValueError(f"the device pool has {pool.capacity} slots, a gang needs {config.world_size}{hint}")
    return pool
