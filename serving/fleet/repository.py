"""The model repository: the models one server serves, each its own engine, loaded and unloaded live.

Triton's model repository (and its repository extension) over shardserve's engines: a model has a
public name (``--model NAME=MODEL``, a sub-folder of ``--model-repository``, or the loaded model's
name) and its own engine (``serving/engine/core.py``'s ``Engine``): its own admission and queue,
batcher, replica gangs, autoscaler and metrics series (``model`` label), so a burst or a failure of
one model never reaches another's queue or gangs. The repository knows an engine only as a
``ModelEngine`` (``serving/fleet/model_engine.py``) and gets each from ``build``, the engine factory
that whoever assembles the server hands in (the front end's lifespan, with
``serving/engine/builder.py``'s ``build_engine``). The engines share the device pool (``pool=`` of
``build_engine``), so together they never hold more slots than the machine has. With a placement
(``--placement``, ``serving/fleet/placement.py``) they share device groups instead: every model is
loaded before any engine is built, the placement chosen for all of them, and each engine draws its
replicas from the groups holding its model; a load, an unload or a reload re-places the models and
rolls the engines whose places changed.

Each model is in one state (Triton's names): ``LOADING`` (checked, its first gang starting),
``READY`` (a gang answers), ``UNLOADING`` (draining), ``UNAVAILABLE`` (failed to load, or a folder of
the repository not loaded; ``reason`` says which, without server paths). ``load`` adds a model (or
reloads one: its new gangs are ready before the old ones drain, ``Engine.reload``), ``unload`` drains
and stops one; the others keep serving throughout. Unload is not forget (Triton's repository extension
behaves alike): an unloaded model, or one whose load failed, stays in the index as ``UNAVAILABLE`` and
loads again by its name alone, from what declared it (``--model NAME=...``, a folder of the
repository, or the path of its last load).

    repo = ModelRepository(load=check_model, build=make_engine, metrics=metrics, root=None)
    await repo.start([("a", "default"), ("b", "minilm")])   # each failure is reported, the rest serve
    engine = repo.engine("b")                                # EngineError 404 / 503 with the reason
    await repo.load("c", "/models/c"); await repo.unload("a")
    repo.index()                                             # [{"name", "version", "state", "reason"}]
    await repo.shutdown(timeout_s=30)

Tests: ``pytest tests/serving/fleet/test_repository.py tests/serving/frontend/test_v2_repository.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Generic, TypeVar

from shardserve.models.config import ModelConfigError
from shardserve.models.hf_weights import CheckpointError
from shardserve.partitioner.placement.latency import PlacementError
from shardserve.serving.config import check_model_name, repository_models
from shardserve.serving.errors import EngineError
from shardserve.serving.fleet.backend import ModelGeneration
from shardserve.serving.fleet.model_engine import ModelEngine
from shardserve.serving.fleet.placement import PlacedModels
from shardserve.serving.metrics import ServingMetrics
from shardserve.serving.redact import one_line

logger = logging.getLogger(__name__)

READY_POLL_S = 0.05

E = TypeVar("E", bound=ModelEngine)  # the engines served (the server's: serving/engine/core.py's Engine)
LoadModel = Callable[[str, int], ModelGeneration]  # (model reference, generation) -> a checked model
BuildEngine = Callable[[str, ModelGeneration], E]  # (public name, model) -> an engine, not started


class ModelState(StrEnum):
    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass
class ModelEntry(Generic[E]):
    """One model of the repository."""

    name: str  # public name: the routes' and the metrics' ``model``
    ref: str  # what it loads: a registry name or a server path (never shown to clients)
    engine: E | None = None
    unavailable: str | None = None  # why it is not served (load failed, not loaded), path-free
    unloading: bool = False
    loaded_at: float = 0.0  # time.time() of its last load

    @property
    def state(self) -> ModelState:
        if self.engine is None:
            return ModelState.UNAVAILABLE if self.unavailable is not None else ModelState.LOADING
        if self.unloading:
            return ModelState.UNLOADING
        health = self.engine.health()
        if health["ready_replicas"] >= 1:
            return ModelState.READY
        return ModelState.UNAVAILABLE if health.get("fatal") else ModelState.LOADING

    @property
    def reason(self) -> str:
        if self.engine is not None and not self.unloading and self.engine.health().get("fatal"):
            return "its gangs could not start (the server log has the reason)"
        return self.unavailable or ""


def model_not_found(name: str | None, *, served: list[str] | None = None) -> EngineError:
    """The 404 of a model the server does not know; ``served``: the names it does, to list them."""
    listed = "" if served is None else "; models: " + (", ".join(repr(n) for n in served) or "none")
    return EngineError(404, "model_not_found", f"model {name!r} not found{listed}")


def model_version(engine: Any) -> str:
    """A served model's version as Triton's APIs report it: its generation + 1 (a reload adds one); an
    API process's ``RemoteEngine`` has its ``generation`` from the core."""
    return str(engine.generation + 1)


class ModelRepository(Generic[E]):
    """The served models by public name, in the order given (the first is the default)."""

    def __init__(
        self,
        *,
        load: LoadModel,
        build: BuildEngine[E],
        metrics: ServingMetrics,
        root: Path | None = None,
        drain_timeout_s: float = 30.0,
        ready_timeout_s: float = 300.0,
        placement: PlacedModels | None = None,
    ) -> None:
        self._load, self._build, self.metrics = load, build, metrics
        self.placement = placement
        self.root = root
        self.drain_timeout_s = drain_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.entries: dict[str, ModelEntry[E]] = {}
        self._busy: set[str] = set()  # names with a load or unload under way
        self._starting: set[str] = set()  # start-up models that have neither answered nor failed yet
        self._stopping = False
        if root is not None:
            for name, path in repository_models(root).items():
                self.entries[name] = ModelEntry(name, path, unavailable="not loaded")

    # ------------------------------------------------------------------ reading
    @property
    def default_name(self) -> str | None:
        """The first model being served or loading (requests naming no model go to it)."""
        return next((e.name for e in self.entries.values() if e.engine is not None), None)

    def engines(self) -> list[E]:
        return [e.engine for e in self.entries.values() if e.engine is not None]

    def engine(self, name: str | None = None) -> E:
        """The engine of ``name`` (None: the default model). EngineError 404 ``model_not_found`` for a
        name the server does not know, 503 ``model_unavailable`` for one it does not serve now."""
        key = self.default_name if name is None else name
        entry = self.entries.get(key) if key is not None else None
        if entry is None:
            raise model_not_found(name, served=list(self.entries))
        if entry.engine is None or entry.unloading:
            why = entry.unavailable or ("unloading" if entry.unloading else "loading")
            raise EngineError(503, "model_unavailable", f"model {entry.name!r} is not served now: {why}")
        return entry.engine

    def model_ready(self, name: str) -> bool:
        """Triton's model readiness: whether ``name`` answers now (its state READY); EngineError 404
        ``model_not_found`` for a name the server does not know."""
        entry = self.entries.get(name)
        if entry is None:
            raise model_not_found(name)
        return entry.state is ModelState.READY

    def index(self) -> list[dict[str, Any]]:
        """Triton's repository index: each model's name, version (its generation), state and reason."""
        out = []
        for e in self.entries.values():
            version = "" if e.engine is None else model_version(e.engine)
            out.append({"name": e.name, "version": version, "state": e.state.value, "reason": e.reason})
        return out

    def ready(self) -> bool:
        """Server readiness: a model is served, and every model asked for at start-up has answered
        once or failed (one still starting holds it back; a model loaded later never does)."""
        settled = (ModelState.READY, ModelState.UNAVAILABLE)
        self._starting = {
            n for n in self._starting if n in self.entries and self.entries[n].state not in settled
        }
        return not self._starting and any(e.state is ModelState.READY for e in self.entries.values())

    def health(self) -> dict[str, Any]:
        """Readiness detail, safe for unauthenticated clients: ready / starting gangs of all models,
        and each model's state, reason and its engine's health (counts, one path-free line)."""
        per_model = {}
        for e in self.entries.values():
            detail = (
                e.engine.health() if e.engine is not None else {"ready_replicas": 0, "starting_replicas": 0}
            )
            per_model[e.name] = {"state": e.state.value, "reason": e.reason, **detail}
        default = self.engines()[0].health() if self.engines() else {}
        out: dict[str, Any] = {
            **default,  # the default model's detail (failed starts, last failure), as a one-model server's
            "ready_replicas": sum(m["ready_replicas"] for m in per_model.values()),
            "starting_replicas": sum(m["starting_replicas"] for m in per_model.values()),
            "models": per_model,
        }
        out.pop("fatal", None)  # the server failed only when no model can serve: then each one's line
        if self.fatal_error() is not None:
            lines = [m.get("fatal") or f"model {name!r} {m['reason']}" for name, m in per_model.items()]
            out["fatal"] = lines[0] if len(lines) == 1 else "; ".join(lines)
        return out

    def fatal_error(self) -> str | None:
        """Why no model can serve, once every model failed (its load, or its first gang's start);
        None while one serves or may still."""
        reasons = []
        for e in self.entries.values():
            if e.engine is None and e.unavailable is None:
                return None  # still loading
            fatal = (
                e.engine.manager.fatal_error if e.engine is not None else f"model {e.name!r} {e.unavailable}"
            )
            if fatal is None:
                return None
            reasons.append(fatal)
        return "; ".join(reasons) if reasons else None

    # ------------------------------------------------------------------ lifecycle
    async def start(
        self, models: Iterable[tuple[str, str]], *, preloaded: dict[str, ModelGeneration] | None = None
    ) -> None:
        """Load and start ``models`` ((name, reference) pairs; ``preloaded``: models the CLI already
        checked). A model that fails is reported (state UNAVAILABLE with its reason) and the others
        start; the server is ready once every one has answered once or failed (``ready``)."""
        preloaded = preloaded or {}
        pending = []
        for name, ref in models:
            check_model_name(name)
            entry = self.entries.setdefault(name, ModelEntry(name, ref))
            entry.ref, entry.unavailable = ref, None
            pending.append(entry)
        self._starting = {e.name for e in pending}
        if self.placement is not None:
            await self._start_placed(pending, preloaded)
            return
        for entry in pending:
            model = preloaded.get(entry.name)
            try:
                await self._start_entry(entry, model)
            except EngineError as err:
                logger.error("model %s is unavailable: %s", entry.name, err.detail)

    async def _start_placed(
        self, pending: list[ModelEntry[E]], preloaded: dict[str, ModelGeneration]
    ) -> None:
        """Load every model, place them all, then build and start each placed one's engine."""
        assert self.placement is not None
        models: dict[str, ModelGeneration] = {}
        for entry in pending:
            try:
                models[entry.name] = preloaded.get(entry.name) or await self._load_entry(entry)
            except EngineError as err:
                logger.error("model %s is unavailable: %s", entry.name, err.detail)
        try:
            placed = self.placement.place(models) if models else {}
        except (PlacementError, ValueError) as err:
            logger.error("no placement of the models fits: %s", err)
            for name in models:
                self.entries[name].unavailable = f"failed to load: {one_line(err)}"
            return
        for name in models:
            entry = self.entries[name]
            if name not in placed:
                entry.unavailable = self.placement.why.get(name, "not placed")
                continue
            try:
                await self._start_entry(entry, placed[name])
            except EngineError as err:
                logger.error("model %s is unavailable: %s", entry.name, err.detail)
        self.placement.start()

    async def _load_entry(self, entry: ModelEntry[E], generation: int = 0) -> ModelGeneration:
        """Check and load ``entry``'s model; EngineError 400 ``load_failed`` (entry UNAVAILABLE, the
        reason path-free) when it cannot be loaded."""
        try:
            return await asyncio.to_thread(self._load, entry.ref, generation)
        except (ModelConfigError, CheckpointError, OSError) as err:
            logger.info("model %s (%s) failed to load: %s", entry.name, entry.ref, err)
            entry.unavailable = "failed to load: not a loadable model (the server log has the reason)"
            raise EngineError(400, "load_failed", f"model {entry.name!r} {entry.unavailable}") from err
        except ValueError as err:  # loads, but does not fit the settings: the numbers, no paths
            entry.unavailable = f"failed to load: {one_line(err)}"
            raise EngineError(400, "load_failed", f"model {entry.name!r} {entry.unavailable}") from err

    async def _start_entry(self, entry: ModelEntry[E], model: ModelGeneration | None) -> None:
        """Check and build ``entry``'s model and start its engine; EngineError 400 ``load_failed``
        (entry UNAVAILABLE, the reason path-free) when it cannot be loaded."""
        if model is None:
            model = await self._load_entry(entry)
        try:
            engine = self._build(entry.name, model)
        except ValueError as err:  # does not fit the settings: the numbers, no paths
            entry.unavailable = f"failed to load: {one_line(err)}"
            raise EngineError(400, "load_failed", f"model {entry.name!r} {entry.unavailable}") from err
        entry.engine, entry.unavailable, entry.loaded_at = engine, None, time.time()
        if self.placement is not None:
            self.placement.attach(entry.name, engine)
        await engine.start()
        logger.info("model %s: %s loaded, its gangs starting", entry.name, model.source.name)

    async def load(self, name: str, ref: str | None = None) -> ModelEntry[E]:
        """Load model ``name`` from ``ref`` (a registry name or a server path; None: where the
        repository has it, or what it was loaded from) and wait until a gang of it answers. A model
        already served is reloaded (new gangs ready before the old drain). EngineError: 400
        ``load_failed``, 404 ``model_not_found``, 409 ``load_in_progress``, 503 ``shutting_down``."""
        check_model_name(name)
        if self._stopping:
            raise EngineError(503, "shutting_down", "the server is shutting down")
        entry = self.entries.get(name)
        if ref is None and entry is None:
            where = "is not in the model repository" if self.root is not None else "is not known"
            raise EngineError(404, "model_not_found", f"model {name!r} {where}: give parameters.path")
        if name in self._busy:
            raise EngineError(409, "load_in_progress", f"model {name!r} is being loaded or unloaded")
        self._busy.add(name)
        try:
            if entry is not None and entry.engine is not None and not entry.unloading:
                await entry.engine.reload(ref or entry.ref)  # EngineError 409 / 422 as /admin/reload
                entry.ref, entry.loaded_at = ref or entry.ref, time.time()
                return entry
            entry = self.entries.setdefault(name, ModelEntry(name, ref or ""))
            entry.ref, entry.unavailable = ref or entry.ref, None
            await self._start_entry(entry, await self._place_new(entry))
            await self._wait_ready(entry)
            return entry
        finally:
            self._busy.discard(name)

    async def _place_new(self, entry: ModelEntry[E]) -> ModelGeneration | None:
        """With a placement: load ``entry``'s model, place it beside the others (rolling those whose
        places change) and return it as placed; EngineError 400 ``load_failed`` when it is not placed.
        Without one: None (``_start_entry`` loads it)."""
        if self.placement is None:
            return None
        model = await self._load_entry(entry)
        try:
            await self.placement.change(
                {**self.placement.models, entry.name: model}, reason=f"model {entry.name} loaded"
            )
        except (PlacementError, ValueError) as err:
            entry.unavailable = f"failed to load: {one_line(err)}"
            raise EngineError(400, "load_failed", f"model {entry.name!r} {entry.unavailable}") from err
        placed = self.placement.placed(entry.name)
        if placed is None:
            entry.unavailable = f"failed to load: {self.placement.why.get(entry.name, 'not placed')}"
            raise EngineError(400, "load_failed", f"model {entry.name!r} {entry.unavailable}")
        return placed

    async def _wait_ready(self, entry: ModelEntry[E]) -> None:
        """Until a gang of ``entry`` answers; a model whose gangs cannot start is stopped and reported."""
        deadline = time.monotonic() + self.ready_timeout_s
        while entry.state is ModelState.LOADING and time.monotonic() < deadline:
            await asyncio.sleep(READY_POLL_S)
        if entry.state is not ModelState.READY:
            reason = entry.reason or f"no gang ready within {self.ready_timeout_s:g} s"
            await self._stop_entry(entry, timeout_s=0.0)
            entry.unavailable = f"failed to load: {reason}"
            raise EngineError(400, "load_failed", f"model {entry.name!r} {entry.unavailable}")

    async def unload(self, name: str) -> None:
        """Stop serving ``name``: new requests for it are refused (503), admitted ones finish (within
        the drain time), then its gangs stop and its series leave /metrics; it stays known (UNAVAILABLE,
        "unloaded"). EngineError 404 / 409."""
        entry = self.entries.get(name)
        if entry is None or entry.engine is None:
            raise EngineError(
                404 if entry is None else 400, "model_not_found", f"model {name!r} is not loaded"
            )
        if name in self._busy:
            raise EngineError(409, "load_in_progress", f"model {name!r} is being loaded or unloaded")
        self._busy.add(name)
        try:
            await self._stop_entry(entry, timeout_s=self.drain_timeout_s)
        finally:
            self._busy.discard(name)
        entry.unavailable = "unloaded"  # still known: a load by name alone serves it again
        logger.info("model %s unloaded", name)

    async def _stop_entry(self, entry: ModelEntry[E], *, timeout_s: float) -> None:
        engine, entry.unloading = entry.engine, True
        if engine is not None:
            await engine.shutdown(timeout_s=timeout_s)
        entry.engine, entry.unloading = None, False
        entry.unavailable = entry.unavailable or "unloaded"
        self.metrics.forget_model(entry.name)
        if self.placement is not None and entry.name in self.placement.models and not self._stopping:
            # the others are placed again without it (its stages leave the shared gangs)
            self.placement.detach(entry.name)
            others = {n: m for n, m in self.placement.models.items() if n != entry.name}
            try:
                await self.placement.change(others, reason=f"model {entry.name} unloaded")
            except (PlacementError, ValueError) as err:
                logger.error("placing the models again without %s failed: %s", entry.name, err)

    def begin_drain(self, *, within_s: float | None = None) -> None:
        """Every model refuses new requests (503) and finishes the admitted ones (signal-safe)."""
        for engine in self.engines():
            engine.begin_drain(within_s=within_s)

    def abort(self) -> None:
        """Every model answers what it admitted 503 now (a second signal; signal-safe)."""
        for engine in self.engines():
            engine.abort()

    async def shutdown(self, *, timeout_s: float) -> None:
        """Drain every model within ``timeout_s`` (together, not one after the other), stop their gangs."""
        self._stopping = True
        if self.placement is not None:
            await self.placement.stop()
        await asyncio.gather(*(e.shutdown(timeout_s=timeout_s) for e in self.engines()))
