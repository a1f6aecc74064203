"""``GET /health``, ``GET|POST /ping`` (vLLM's: the same answer as /health), ``GET /version``, ``GET /metrics``
(Prometheus text) and ``GET /v1/models``."""

from __future__ import annotations

import importlib.metadata

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from serving.errors import APIError
from serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from serving.openai_server import OpenAIServer, get_server
from serving.protocol import ErrorResponse, ModelCard, ModelList
from serving.routes import ERROR_RESPONSES, json_response

router = APIRouter()


@router.get("/health", responses={503: {"model": ErrorResponse}})
async def health(server: OpenAIServer = Depends(get_server)) -> Response:
    if not server.engine.is_healthy:
        return APIError(503, f"engine is not running: {server.engine.dead_error}").response()
    return Response(status_code=200)


@router.get("/ping", responses={503: {"model": ErrorResponse}})
@router.post("/ping", responses={503: {"model": ErrorResponse}})
async def ping(server: OpenAIServer = Depends(get_server)) -> Response:
    """vLLM's ping (load balancers and SageMaker send GET or POST): 200 while the engine runs, else 503."""
    return await health(server)


@router.get("/version")
async def version() -> Response:
    """``{"version": <the installed paged-jax package's version>}`` (vLLM answers its own version here)."""
    return JSONResponse({"version": importlib.metadata.version("paged-jax")})


@router.get("/metrics")
async def metrics_endpoint(server: OpenAIServer = Depends(get_server)) -> Response:
    return Response(server.metrics.render(), media_type=METRICS_CONTENT_TYPE)


@router.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
async def list_models(server: OpenAIServer = Depends(get_server)) -> Response:
    info = server.info
    cards = [ModelCard(id=name, root=info.root or name, max_model_len=info.max_model_len)
             for name in info.served_model_names]
    cards += [ModelCard(id=lora.lora_name, root=lora.lora_path, parent=lora.base_model_name or info.served_model_name)
              for lora in (server.loras or ())]  # LoRA adapters, as vLLM lists them
    return json_response(ModelList(data=cards))
