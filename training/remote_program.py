"""The training rank program as ranks on other hosts run it (``shardserve worker``).

``partitioner/runtime/remote.py`` publishes a gang's spec for remote workers as signed JSON, naming its
program; this module is what the name ``train`` stands for: ``train_rank`` in ``GangMode.RUN``, its
``GangSpec.extra`` (the ``TrainConfig`` and the driver's ``RunInfo``) written as JSON and read back,
and the model source given the run's dropout, as the driver gave it to its own ranks.

    body = REMOTE_PROGRAM.to_json({"train": cfg, "run": run})       # on the driver
    extra, source = REMOTE_PROGRAM.from_json(body, resolve_model(cfg.model))   # on the worker
"""

from __future__ import annotations

import dataclasses
from typing import Any

from models.registry import ModelSource
from partitioner.runtime.rank import GangMode
from partitioner.runtime.remote import RemoteProgram
from training.config import RunInfo, TrainConfig
from training.trainer import train_rank, with_dropout


def to_json(extra: dict[str, Any]) -> dict[str, Any]:
    """``{"train": TrainConfig, "run": RunInfo}`` as JSON-ready dicts."""
    cfg: TrainConfig = extra["train"]
    run: RunInfo = extra["run"]
    return {"train": cfg.to_dict(), "run": dataclasses.asdict(run)}


def from_json(body: dict[str, Any], source: ModelSource) -> tuple[dict[str, Any], ModelSource]:
    """The inverse of ``to_json``, and ``source`` with the run's dropout."""
    cfg = TrainConfig.from_dict(body["train"])
    run_fields = dict(body["run"])
    run_fields["remote_ranks"] = tuple(run_fields.get("remote_ranks", ()))
    run_fields["skipped_checkpoints"] = tuple(run_fields.get("skipped_checkpoints", ()))
    run = RunInfo(**run_fields)
    return {"train": cfg, "run": run}, with_dropout(source, cfg.dropout)


REMOTE_PROGRAM = RemoteProgram("train", train_rank, GangMode.RUN, to_json=to_json, from_json=from_json)
