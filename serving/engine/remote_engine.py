"""An API process's view of the served models: the core's ``State`` digest, and a client per model.

``RemoteRepository`` answers from the core's digest (``CoreServer.digest``): which models are served
(``engine(name)``: the core's own 404 / 503, as a ``RemoteModel``), readiness, health; and holds an
``EngineClient`` per model (``client(name)``: ``serving/engine/client.py``), the same request path as the
server's own process, its ``CoreLink`` the ZeroMQ ``CoreClient``: the admission numbers, tokenizing
and span decoding run here, admission, batching and the gangs in the core. A model's client exists
here once its tokenizer, saved by the core per generation, is loaded (off the event loop).

    repo = RemoteRepository(client=client, limits=limits, metrics=relay)
    await repo.apply(client.state)
    qa = repo.client("b")                              # EngineClient, or EngineError 404 / 503
    request = await qa.submit_async(pairs); results = await qa.wait(request)

Tests: ``pytest tests/serving/engine/test_core_server.py``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass
from typing import Any

from shardserve.serving.engine.client import ClientLimits, EngineClient
from shardserve.serving.engine.core_client import CoreClient, MetricsRelay
from shardserve.serving.engine.qa_types import EngineError
from shardserve.serving.fleet.repository import model_not_found

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemoteModel:
    """A served model as an API process knows it: its name and the core's generation of it."""

    name: str
    generation: int


class RemoteRepository:
    """See module doc."""

    def __init__(self, *, client: CoreClient, limits: ClientLimits, metrics: MetricsRelay) -> None:
        self.core, self.limits, self.metrics = client, limits, metrics  # core: the CoreLink
        self.digest: dict[str, Any] = {"models": {}, "ready": False, "health": {}, "fatal": None}
        self._clients: dict[str, tuple[str, EngineClient]] = {}  # name -> (tokenizer path, client)

    async def apply(self, digest: dict[str, Any]) -> None:
        """Take the core's newest digest: clients for new models (or new tokenizers), none for gone ones."""
        for name, model in digest["models"].items():
            path = model["tokenizer"]
            if path is not None and self._clients.get(name, ("",))[0] != path:
                tokenizer = await asyncio.to_thread(_load_tokenizer, path)
                qa = EngineClient(
                    name=name,
                    core=self.core,
                    tokenizer=lambda t=tokenizer: t,
                    limits=self.limits,
                    on_end=functools.partial(self.metrics.record_end, name),
                    on_lookups=functools.partial(self.metrics.context_cache, name),
                )
                if (old := self._clients.get(name)) is not None:
                    old[1].shutdown()
                self._clients[name] = (path, qa)
        for name in set(self._clients) - set(digest["models"]):
            self._clients.pop(name)[1].shutdown()
        self.digest = digest

    @property
    def default_name(self) -> str | None:
        return self.digest.get("default")

    def engine(self, name: str | None = None) -> RemoteModel:
        """``ModelRepository.engine`` as the core answers it: 404 unknown, 503 not served now."""
        key = self.default_name if name is None else name
        models = self.digest["models"]
        if key not in models:
            raise model_not_found(name, served=list(models))
        if (error := models[key]["error"]) is not None:
            raise EngineError(*error)
        if key not in self._clients:  # its tokenizer is being loaded here
            raise EngineError(503, "model_unavailable", f"model {key!r} is not served now: loading")
        return RemoteModel(key, models[key]["generation"])

    def client(self, name: str | None = None) -> EngineClient:
        """The client of ``name`` (None: the default model); EngineError 404 / 503 (``engine``)."""
        return self._clients[self.engine(name).name][1]

    def model_ready(self, name: str) -> bool:
        if name not in self.digest["models"]:
            raise model_not_found(name)
        return bool(self.digest["models"][name]["ready"])

    def ready(self) -> bool:
        return bool(self.digest["ready"])

    def health(self) -> dict[str, Any]:
        return dict(self.digest["health"])

    def fatal_error(self) -> str | None:
        return self.digest["fatal"]

    def shutdown(self) -> None:
        for _, qa in self._clients.values():
            qa.shutdown()


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
