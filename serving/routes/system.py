"""``GET /health``, ``GET|POST /ping`` (vLLM's: the same answer as /health), ``GET /version``, ``GET /metrics``
(Prometheus text) and ``GET /v1/models``."""

from __future__ import annotations

import importlib.metadata
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse, Response

from serving.errors import APIError
from serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from serving.openai_server import OpenAIServer, get_server
from serving.protocol import ModelCard, ModelList, VersionResponse
from serving.routes import error_responses, json_response

router = APIRouter()

# /health and /ping answer an empty body while the engine runs (as vLLM), else the error.
_HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The engine is running (empty body)", "content": None},
    **error_responses(503)}


@router.get("/health", response_class=Response, responses=_HEALTH_RESPONSES)
async def health(server: OpenAIServer = Depends(get_server)) -> Response:
    if not server.engine.is_healthy:
        return APIError(503, f"engine is not running: {server.engine.dead_error}").response()
    return Response(status_code=200)


@router.get("/ping", response_class=Response, responses=_HEALTH_RESPONSES)
@router.post("/ping", response_class=Response, responses=_HEALTH_RESPONSES)
async def ping(server: OpenAIServer = Depends(get_server)) -> Response:
    """vLLM's ping (load balancers and SageMaker send GET or POST): 200 while the engine runs, else 503."""
    return await health(server)


@router.get("/version", response_model=VersionResponse)
async def version() -> Response:
    """``{"version": <the installed paged-jax package's version>}`` (vLLM answers its own version here)."""
    return json_response(VersionResponse(version=importlib.metadata.version("paged-jax")))


@router.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"description": "Prometheus text exposition format 0.0.4",
                             "content": {"text/plain": {"schema": {"type": "string"}}}},
                       **error_responses(401)})
async def metrics_endpoint(server: OpenAIServer = Depends(get_server)) -> Response:
    return Response(server.metrics.render(), media_type=METRICS_CONTENT_TYPE)


@router.get("/v1/models", response_model=ModelList, responses=error_responses(401))
async def list_models(server: OpenAIServer = Depends(get_server)) -> Response:
    info = server.info
    cards = [ModelCard(id=name, root=info.root or name, max_model_len=info.max_model_len)
             for name in info.served_model_names]
    cards += [ModelCard(id=lora.lora_name, root=lora.lora_path, parent=lora.base_model_name or info.served_model_name)
              for lora in (server.loras or ())]  # LoRA adapters, as vLLM lists them
    return json_response(ModelList(data=cards))
