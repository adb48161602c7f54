"""One model's engine as the fleet holds it: the calls the model repository and the placement make of it.

The model repository (``serving/fleet/repository.py``) keeps one engine per served model and starts,
reloads, drains and stops it; the placement (``serving/fleet/placement.py``) rolls its replica
manager onto new places and reads its arrivals. ``ModelEngine`` is what they need of it, and the
engine room's ``Engine`` (``serving/engine/core.py``) has it, structurally: the fleet never imports
the engine room (the engine imports the fleet). Whoever assembles the server builds the engines and
hands them in (the repository's ``build`` callable: ``serving/engine/builder.py``'s ``build_engine``,
called by the front end's lifespan), as the replica manager is handed its ``ReplicaListener``.

    repo = ModelRepository(load=check_model, build=lambda name, model: build_engine(model=model, ...), ...)
    isinstance(engine, ModelEngine)      # True for an Engine (and for a test's fake)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from shardserve.serving.fleet.backend import ModelGeneration
from shardserve.serving.fleet.replicas import ReplicaManager
from shardserve.serving.fleet.supervisor import Supervisor


@runtime_checkable
class ModelEngine(Protocol):
    """A served model's engine: its fleet parts, its life, its health (see module doc)."""

    @property
    def manager(self) -> ReplicaManager:
        """Its replica gangs (the placement rolls them; ``fatal_error``: why none can start)."""
        ...

    @property
    def supervisor(self) -> Supervisor | None:
        """Its health and autoscaling loop (None: the replica count is set by hand)."""
        ...

    @property
    def arrivals(self) -> Iterable[float]:
        """Its recent requests' arrival times (``time.monotonic``): auto's re-plans fit them."""
        ...

    @property
    def generation(self) -> int:
        """The generation of the model it serves (a reload adds one)."""
        ...

    def health(self) -> dict[str, Any]:
        """Readiness detail: ``ready_replicas``, ``starting_replicas``, ``fatal`` (a path-free line) ..."""
        ...

    async def start(self) -> None:
        """Start its loop and supervisor (its gangs start in the background)."""
        ...

    async def reload(self, name: str) -> ModelGeneration:
        """Serve another checkpoint: new gangs ready before the old drain (``EngineError`` 409 / 422)."""
        ...

    def begin_drain(self, *, within_s: float | None = None) -> None:
        """Refuse new requests (503), finish the admitted ones (signal-safe)."""
        ...

    def abort(self) -> None:
        """Answer what it admitted 503 now (signal-safe)."""
        ...

    async def shutdown(self, *, timeout_s: float) -> None:
        """Drain within ``timeout_s`` and stop its gangs."""
        ...
