"""Model loading for serving: a model name + settings -> a checked ``ModelGeneration``; the device pool.

Owns the checks that run BEFORE any gang starts (at startup in the CLI and the lifespan, and on
POST /admin/reload): the model resolves, its weight files open (headers only), ``max_seq_len``
fits its positions, its tokenizer is fast (offsets are needed), and the partition plan is
feasible; and the device pool of the settings fits at least one gang. The app, the routes and the
CLI all import these from here (none of them from another).

    model = load_generation(settings, "tiny-bert", generation=0)   # ValueError / CheckpointError / OSError
    pool = device_pool(settings)                                    # ValueError when no gang fits

An unreadable model (missing, no weights, a corrupt tokenizer) is a ``CheckpointError`` or an
``OSError``: the reload route answers all of them alike (a reply must not map the file system);
``ValueError`` is a model that loads but does not fit the settings.
"""

from __future__ import annotations

import logging

from transformers import AutoTokenizer

from models.hf_weights import CheckpointError, CheckpointReader
from models.registry import ModelSource, resolve_model
from partitioner.plan import ParallelDims
from serving.fleet.replicas import DevicePool, ModelGeneration
from serving.frontend.settings import ServeSettings

logger = logging.getLogger(__name__)


def load_generation(settings: ServeSettings, name: str, *, generation: int) -> ModelGeneration:
    """Resolve a model, check its weights can be opened, load its fast tokenizer, validate the
    partition; raises ValueError / CheckpointError / OSError on a misfit (before any gang starts)."""
    source: ModelSource = resolve_model(name)
    for path in (source.checkpoint, *source.overlays):
        CheckpointReader(path)  # headers only (safetensors / mmap): no weights -> CheckpointError now
    if settings.max_seq_len > source.config.max_seq_len:
        raise ValueError(
            f"max_seq_len={settings.max_seq_len} exceeds the model's {source.config.max_seq_len} positions"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source.tokenizer_dir))
    except Exception as err:  # transformers / tokenizers raise anything here (KeyError, JSON errors, ...)
        raise CheckpointError(f"{source.tokenizer_dir}: the tokenizer cannot be loaded: {err!r}") from err
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{source.tokenizer_dir} has no fast tokenizer (offsets are required)")
    model = ModelGeneration(generation, source, ParallelDims(pp=settings.pp, tp=settings.tp), tokenizer)
    model.plan()  # raises InfeasiblePlanError (a ValueError) with the numbers
    logger.debug("model %s (generation %d) checked", source.name, generation)
    return model


def device_pool(settings: ServeSettings) -> DevicePool:
    """The device pool of these settings; ValueError when not even one gang fits."""
    pool = DevicePool.for_device(
        settings.device, cpu_slots=settings.pool_slots, ranks_per_gpu=settings.ranks_per_gpu
    )
    if pool.gangs_that_fit(settings.world_size) < 1:
        hint = " (raise --ranks-per-gpu to let ranks share a GPU)" if settings.device == "cuda" else ""
        raise ValueError(
            f"the device pool has {pool.capacity} slots, a gang needs {settings.world_size}{hint}"
        )
    return pool
