"""Pipeline stages built from a ``PartitionPlan``, each rank loading only its own shard.

``build_stage`` creates the whole model (``shardserve.models.build.new_model``) on the ``meta`` device (no
memory), deletes what the stage does not own (embeddings before stage 0, layers outside its range,
the head before the last stage), applies tensor parallelism, materialises the remainder on the
rank's device in its compute dtype, and reads exactly the rank's slices from the checkpoint
(``partitioner/shard_loading.py``: safetensors mmap + slice).

    stage = build_stage(source, plan, rank=3, tp_group=group)   # eval mode
    out = stage(x, attention_mask)   # ids (B, S) or hidden (B, S, H) -> hidden (B, S, H) or logits (B, S, 2)
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from shardserve.models.build import QAModel, new_model
from shardserve.models.registry import ModelSource
from shardserve.partitioner.int8 import model_calibration, quantize_linears
from shardserve.partitioner.plan import PartitionPlan
from shardserve.partitioner.shard_loading import load_shard
from shardserve.partitioner.tensor_parallel import apply_tensor_parallel

logger = logging.getLogger(__name__)


def slice_stage(model: QAModel, plan: PartitionPlan, stage_index: int) -> QAModel:
    """Drop the parts of ``model`` that stage ``stage_index`` does not own (in place)."""
    spec = plan.stages[stage_index]
    if not spec.has_embeddings:
        model.embeddings = None
    if not spec.has_head:
        for name in model.head_modules:
            setattr(model, name, None)
    for key in list(model.layers.keys()):
        if int(key) not in spec.layers:
            del model.layers[key]
    return model


def build_stage(
    source: ModelSource,
    plan: PartitionPlan,
    *,
    rank: int,
    tp_group: dist.ProcessGroup | None,
    dtype: torch.dtype = torch.float32,
    head_seed: int = 0,
    int8: bool = False,
) -> QAModel:
    """The stage module of global ``rank``, with its shard of the weights loaded; ``int8``: its
    Linear layers quantized with the model's calibration (``partitioner/int8.py``)."""
    stage_index, tp_rank = plan.dims.coords(rank)
    with torch.device("meta"):
        model = new_model(source.config)
    slice_stage(model, plan, stage_index)
    apply_tensor_parallel(model, tp_rank=tp_rank, tp_size=plan.dims.tp, group=tp_group)
    model = model.to_compute_dtype(dtype).to_empty(device=plan.devices[rank])  # in dtype from the start
    report = load_shard(model, source.weights(), source.config, head_seed=head_seed)
    logger.debug("rank %d loaded %.1f MB of weights", rank, report.bytes_read / 1e6)
    model.load_report = report  # what was read from disk / initialised, for the gang's ready info
    model.eval()
    if int8:
        quantize_linears(model, model_calibration(source))
    return model
