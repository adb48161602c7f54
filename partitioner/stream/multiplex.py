"""Several models on one gang (AlpaServe-style multiplexing): the gang's model table, the tag each
micro-batch carries through the pipeline, and the table's JSON for ranks on other hosts.

A multiplexed gang's every rank holds its stage of each model placed on it: every model is split
at the same pp and tp over the same devices, each by its own ``PartitionPlan`` (e.g. balanced for
that model), built on the meta device and loading only the rank's slices (``build_stage``). The
``GangSpec``'s own ``source`` / ``plan`` are the first model's (the default for an untagged
micro-batch); the table's names and the other models ride in ``GangSpec.extra`` (``models_extra``),
so a one-model spec is exactly what it was before multiplexing.

The tag: a micro-batch's model is its index in the table, carried in the high bits of the
micro-batch id that the stage-to-stage p2p header already carries (``tag``: ``index << MODEL_SHIFT |
mb_id``). Every rank of every stage, tp peers included (each gets the same header from its own
predecessor, and stage 0's tp ranks the same ``Batch``), reads it back (``untag``) and runs that
model's stage module (``MultiplexedExecutor``). Index 0 leaves the id unchanged, so a one-model
gang's wire is as before.

    table = check_models({"bert": (src_b, plan_b), "roberta": (src_r, plan_r)})  # ValueError with numbers
    gang_models(spec)        # a spec's table (one entry for a one-model spec)
    tagged = tag(mb_id, 1); untag(tagged) == (mb_id, 1)

Run the tests: ``python -m pytest tests/partitioner/stream -q``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from shardserve.models.registry import MODEL_NAMES, ModelSource, resolve_model
from shardserve.partitioner.plan import ParallelDims, PartitionPlan, default_devices, make_plan
from shardserve.partitioner.runtime.rank import GangSpec
from shardserve.partitioner.runtime.remote import JoinError
from shardserve.partitioner.schedules import MicroBatch, ScheduleError, StageExecutor

MODEL_SHIFT = 40  # micro-batch ids below 2**40 (a trillion); model indices in the bits above
MAX_MODELS = 1 << (62 - MODEL_SHIFT)  # the tagged id stays a positive int64


@dataclass(frozen=True)
class GangModel:
    """One model placed on a gang: its name (what ``submit(model=)`` says), weights and split."""

    name: str
    source: ModelSource
    plan: PartitionPlan


def _layout(dims: ParallelDims) -> str:
    return (f"dp={dims.dp} " if dims.dp > 1 else "") + f"pp={dims.pp} tp={dims.tp}"


def check_models(models: Mapping[str, tuple[ModelSource, PartitionPlan]]) -> tuple[GangModel, ...]:
    """The table of a gang holding ``models`` (name -> (source, plan)), in order; ``ValueError``
    naming the numbers unless every plan splits its own model and all agree on the layout."""
    if not models:
        raise ValueError("a gang holds at least one model, got none")
    if len(models) > MAX_MODELS:
        raise ValueError(f"{len(models)} models on one gang; at most {MAX_MODELS}")
    table = tuple(GangModel(name, source, plan) for name, (source, plan) in models.items())
    first = table[0]
    for m in table:
        if not isinstance(m.name, str) or not m.name:
            raise ValueError(f"a model's name on a gang must be a non-empty string, got {m.name!r}")
        if m.plan.num_layers != m.source.config.num_layers:
            raise ValueError(
                f"model {m.name!r}: its plan splits {m.plan.num_layers} layers, "
                f"its config has {m.source.config.num_layers} (a plan made for another model?)"
            )
        m.plan.dims.validate_for(m.source.config)
        if m.plan.dims != first.plan.dims:
            raise ValueError(
                f"the models of one gang must agree on pp and tp: {first.name!r} is "
                f"{_layout(first.plan.dims)}, {m.name!r} is {_layout(m.plan.dims)}"
            )
        if m.plan.devices != first.plan.devices:
            raise ValueError(
                f"the models of one gang share its ranks' devices: {first.name!r} is on "
                f"{list(first.plan.devices)}, {m.name!r} on {list(m.plan.devices)}"
            )
    return table


def models_extra(table: Sequence[GangModel]) -> dict[str, Any]:
    """``GangSpec.extra`` entries for ``table`` (whose first model is the spec's source and plan):
    none for one model under its own name, so a one-model spec is unchanged."""
    extra: dict[str, Any] = {}
    first = table[0]
    if first.name != first.source.name:
        extra["model"] = first.name
    if len(table) > 1:
        extra["more_models"] = tuple(table[1:])
    return extra


def gang_models(spec: GangSpec) -> tuple[GangModel, ...]:
    """The models a stream ``GangSpec`` holds, the spec's own source and plan first."""
    first = GangModel(spec.extra.get("model", spec.source.name), spec.source, spec.plan)
    return (first, *spec.extra.get("more_models", ()))


def tag(mb_id: int, index: int) -> int:
    """Micro-batch ``mb_id`` of the table's model ``index`` as the id that crosses the pipeline."""
    if not 0 <= mb_id < 1 << MODEL_SHIFT or not 0 <= index < MAX_MODELS:
        raise ValueError(
            f"micro-batch {mb_id} of model {index}: ids must be < 2**{MODEL_SHIFT}, models < {MAX_MODELS}"
        )
    return index << MODEL_SHIFT | mb_id


def untag(tagged: int) -> tuple[int, int]:
    """A pipeline id -> (micro-batch id, model index)."""
    return tagged & ((1 << MODEL_SHIFT) - 1), tagged >> MODEL_SHIFT


@dataclass
class MultiplexedExecutor(StageExecutor):
    """A ``StageExecutor`` over one stage module per model: each micro-batch runs on the module
    its tag names (``module`` is the one that ran last)."""

    stages: tuple[nn.Module, ...] = ()

    @classmethod
    def over(cls, ex: StageExecutor, stages: Sequence[nn.Module]) -> MultiplexedExecutor:
        """``ex`` (a rank's executor, its neighbours filled in) running ``stages`` by tag."""
        fields = {f.name: getattr(ex, f.name) for f in dataclasses.fields(ex) if f.init}
        return cls(**fields, stages=tuple(stages))

    def forward_step(self, inputs: MicroBatch) -> None:
        mb_id, index = untag(inputs.mb_id)
        if index >= len(self.stages):
            raise ScheduleError(
                f"micro-batch {mb_id} is tagged for model {index}, this stage holds {len(self.stages)}"
            )
        self.module = self.stages[index]
        super().forward_step(inputs)


# ---------------------------------------------------------------------- JSON (ranks on other hosts)
def _model_ref(source: ModelSource) -> str:
    # as publish_spec names the gang's own model: a registry name resolves on any host, a directory
    # must exist at that path there too
    return source.name if source.name in MODEL_NAMES else str(source.checkpoint)


def models_to_json(extra: Mapping[str, Any]) -> dict[str, Any]:
    """The table entries of a stream spec's ``extra`` as JSON (none for a one-model spec)."""
    out: dict[str, Any] = {}
    if "model" in extra:
        out["model"] = extra["model"]
    more: tuple[GangModel, ...] = extra.get("more_models", ())
    if more:
        out["more_models"] = [
            {
                "name": m.name,
                "model": _model_ref(m.source),
                "dp": m.plan.dims.dp,
                "pp": m.plan.dims.pp,
                "tp": m.plan.dims.tp,
                "device": m.plan.devices[0].split(":")[0],
                "boundaries": [s.layers[0] for s in m.plan.stages[1:]],
                "stage_layers": [list(s.layers) for s in m.plan.stages],
            }
            for m in more
        ]
    return out


def models_from_json(body: Mapping[str, Any]) -> dict[str, Any]:
    """``models_to_json``'s output back as ``extra`` entries, each model resolved and split here;
    ``JoinError`` when one splits differently on this host. A body without them: one model."""
    extra: dict[str, Any] = {}
    if "model" in body:
        extra["model"] = body["model"]
    more = []
    for entry in body.get("more_models", ()):
        source = resolve_model(entry["model"])
        dims = ParallelDims(pp=entry["pp"], tp=entry["tp"], dp=entry["dp"])
        devices = default_devices(dims.world_size, device=entry["device"])
        plan = make_plan(source.config, dims, boundaries=entry["boundaries"] or None, devices=devices)
        local = [list(s.layers) for s in plan.stages]
        if local != entry["stage_layers"]:
            raise JoinError(
                f"model {entry['name']!r} ({entry['model']}) splits differently here: stages {local}, "
                f"the driver's {entry['stage_layers']} (a different model at that path?)"
            )
        more.append(GangModel(entry["name"], source, plan))
    if more:
        extra["more_models"] = tuple(more)
    return extra
