"""Triton's model repository extension over REST: list, load and unload the served models live.

``GET``/``POST /v2/repository/index`` lists every model the server knows (served, loading, failed, or
a folder of ``--model-repository`` not loaded) with its version and state; ``POST
/v2/repository/models/NAME/load`` loads a model (from the repository folder, or from
``{"parameters": {"path": "DIR_OR_REGISTRY_NAME"}}``, e.g. a checkpoint that ``shardserve train``
wrote; a model already served is reloaded: its new gangs are ready before the old ones drain) and
answers once a gang of it answers; ``.../unload`` drains and stops one. All of them need the admin
token (``Authorization: Bearer <admin_token>``, 401 otherwise). The other models keep serving
throughout: each has its own engine (``serving/fleet/repository.py``).

Errors are the v2 object ``{"error": "code: detail"}``: 400 a model that cannot be loaded or is not
loaded, 404 a name the server does not know (to load without a path, or to unload), 409 a load or unload of it already under way, 503 starting
or shutting down.

    curl -X POST -H "Authorization: Bearer $TOKEN" localhost:8000/v2/repository/models/b/load \\
         -d '{"parameters": {"path": "runs/squad/export"}}'

Tests: ``pytest tests/serving/frontend/v2/test_repository.py``.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from shardserve.serving.config import MODEL_NAME
from shardserve.serving.engine.qa_types import EngineError
from shardserve.serving.fleet.repository import ModelRepository
from shardserve.serving.frontend.rest.routes import AdminRoute, require_admin
from shardserve.serving.frontend.v2.routes import V2Route, v2_error, v2_responses


class V2AdminRoute(V2Route, AdminRoute):
    """The admin token checked before the body (``AdminRoute``); errors as ``{"error": ...}``."""


router = APIRouter(
    tags=["model repository (v2)"], route_class=V2AdminRoute, dependencies=[Depends(require_admin)]
)


ModelName = Annotated[
    str, Path(pattern=MODEL_NAME.pattern, description="the model's name: 1-64 letters, digits, . _ -")
]


class IndexRequest(BaseModel):
    """POST /v2/repository/index body (Triton's): ``ready`` lists only the models that can answer."""

    model_config = ConfigDict(strict=True, extra="forbid")
    ready: bool = False


class LoadRequest(BaseModel):
    """POST /v2/repository/models/NAME/load body (Triton's); ``parameters.path``: where the model is (a
    registry name or a server directory; default: the repository folder, or where it was loaded from)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    parameters: dict[str, Any] = Field(default_factory=dict)


class IndexEntry(BaseModel):
    name: str
    version: str = Field(description="the served generation + 1; empty when not loaded")
    state: str = Field(description="READY, LOADING, UNLOADING or UNAVAILABLE")
    reason: str = Field(description="why it is not served (no server paths)")


def _models(request: Request) -> ModelRepository | JSONResponse:
    models = getattr(request.app.state, "models", None)
    if models is None or request.app.state.shutting_down:
        return v2_error(503, "the server is starting" if models is None else "the server is shutting down")
    return models


def _failed(err: EngineError) -> JSONResponse:
    return v2_error(err.status, f"{err.code}: {err.detail}")


@router.get("/v2/repository/index", response_model=list[IndexEntry], responses=v2_responses(401, 503))
async def index_get(request: Request) -> Any:
    """Every model the server knows, with its version, state and reason."""
    models = _models(request)
    return models if isinstance(models, JSONResponse) else models.index()


@router.post(
    "/v2/repository/index",
    response_model=list[IndexEntry],
    responses=v2_responses(400, 401, 408, 413, 415, 503),
)
async def index_post(request: Request, body: IndexRequest | None = None) -> Any:
    """Triton's form: ``{"ready": true}`` lists only the models that can answer now."""
    models = _models(request)
    if isinstance(models, JSONResponse):
        return models
    entries = models.index()
    return [e for e in entries if e["state"] == "READY"] if body is not None and body.ready else entries


@router.post(
    "/v2/repository/models/{model_name}/load", responses=v2_responses(400, 401, 404, 408, 409, 413, 415, 503)
)
async def load(model_name: ModelName, request: Request, body: LoadRequest | None = None) -> Any:
    """Load (or reload) ``model_name``; answers once a gang of it answers."""
    models = _models(request)
    if isinstance(models, JSONResponse):
        return models
    path = (body.parameters if body is not None else {}).get("path")
    if path is not None and not (isinstance(path, str) and path):
        return v2_error(400, "invalid_request: parameters.path must be a non-empty string")
    try:
        entry = await models.load(model_name, path)
    except EngineError as err:
        return _failed(err)
    return {"name": entry.name, "state": entry.state.value}


@router.post("/v2/repository/models/{model_name}/unload", responses=v2_responses(400, 401, 404, 409, 503))
async def unload(model_name: ModelName, request: Request) -> Any:
    """Stop serving ``model_name``: admitted requests finish, then its gangs stop."""
    models = _models(request)
    if isinstance(models, JSONResponse):
        return models
    try:
        await models.unload(model_name)
    except EngineError as err:
        return _failed(err)
    return {"name": model_name, "state": "UNAVAILABLE"}
