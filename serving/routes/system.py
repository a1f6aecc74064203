"""``GET /health``, ``GET /metrics`` (Prometheus text) and ``GET /v1/models``."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response

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
