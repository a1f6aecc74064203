"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (vLLM's run-time LoRA updates; mounted only
when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true: ``serving.lora``). Success answers vLLM's plain-text line."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse, Response

from serving.errors import APIError
from serving.openai_server import OpenAIServer, get_server
from serving.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from serving.routes import ERROR_RESPONSES

router = APIRouter()


def _registry(server: OpenAIServer):
    if server.loras is None:
        raise APIError(400, "LoRA is not enabled on this server (serve with --enable-lora)")
    return server.loras


@router.post("/v1/load_lora_adapter", responses=ERROR_RESPONSES)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, server: OpenAIServer = Depends(get_server)) -> Response:
    message = await _registry(server).load(server.engine, body.lora_name, body.lora_path, body.load_inplace)
    return PlainTextResponse(message)


@router.post("/v1/unload_lora_adapter", responses=ERROR_RESPONSES)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest,
                              server: OpenAIServer = Depends(get_server)) -> Response:
    return PlainTextResponse(await _registry(server).unload(server.engine, body.lora_name, body.lora_int_id))
