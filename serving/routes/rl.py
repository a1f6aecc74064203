"""The RL trainer's routes (vLLM's development routes, mounted only when ``VLLM_SERVER_DEV_MODE`` is true):
``POST /sleep?level=1|2``, ``POST /wake_up?tags=weights&tags=kv_cache``, ``GET /is_sleeping``,
``POST /pause?mode=abort|wait|keep``, ``POST /resume``, ``GET /is_paused`` and ``POST /update_weights_from_disk``
(SGLang's: ``{"model_path": ...}``), and vLLM's weight transfer from a trainer process of the engine's JAX job:
``POST /init_weight_transfer_engine`` (``{"init_info": {"trainer_process": i}}``) and ``POST /update_weights``
(``{"update_info": {"names", "dtype_names", "shapes"}}``, answered once the weights are in). Each runs on the engine
thread between steps (``paged_jax.engine.rollout_control``); an engine ValueError answers 400 with its message."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse, Response

from serving.errors import APIError
from serving.openai_server import OpenAIServer, get_server
from serving.protocol import (InitWeightTransferRequest, UpdateWeightsFromDiskRequest, UpdateWeightsRequest,
                              UpdateWeightsResponse)
from serving.routes import ERROR_RESPONSES, json_response

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
# How often a "wait" pause asks whether the requests it lets finish have.
_DRAIN_POLL_S = 0.01

router = APIRouter()


def server_dev_mode() -> bool:
    """vLLM's switch for its development routes: the environment variable set to true (or 1)."""
    return os.environ.get(DEV_MODE_ENV, "").strip().lower() in ("1", "true")


async def _call(server: OpenAIServer, method: str, *args: Any) -> Any:
    try:
        return await server.engine.call(method, *args)
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc


@router.post("/sleep", responses=ERROR_RESPONSES)
async def sleep(level: int = Query(1), server: OpenAIServer = Depends(get_server)) -> Response:
    await _call(server, "sleep", level)
    return Response(status_code=200)


@router.post("/wake_up", responses=ERROR_RESPONSES)
async def wake_up(tags: list[str] | None = Query(None), server: OpenAIServer = Depends(get_server)) -> Response:
    await _call(server, "wake_up", tags)
    return Response(status_code=200)


@router.get("/is_sleeping", responses=ERROR_RESPONSES)
async def is_sleeping(server: OpenAIServer = Depends(get_server)) -> Response:
    return JSONResponse({"is_sleeping": bool(await _call(server, "is_sleeping"))})


@router.post("/pause", responses=ERROR_RESPONSES)
async def pause(mode: str = Query("abort"), server: OpenAIServer = Depends(get_server)) -> Response:
    """Answers once nothing runs ("wait": after the running requests finished)."""
    await _call(server, "pause_generation", mode)
    while not await _call(server, "is_paused"):
        await asyncio.sleep(_DRAIN_POLL_S)
    return Response(status_code=200)


@router.post("/resume", responses=ERROR_RESPONSES)
async def resume(server: OpenAIServer = Depends(get_server)) -> Response:
    await _call(server, "resume_generation")
    return Response(status_code=200)


@router.get("/is_paused", responses=ERROR_RESPONSES)
async def is_paused(server: OpenAIServer = Depends(get_server)) -> Response:
    return JSONResponse({"is_paused": bool(await _call(server, "is_paused"))})


@router.post("/update_weights_from_disk", response_model=UpdateWeightsResponse, responses=ERROR_RESPONSES)
async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest,
                                   server: OpenAIServer = Depends(get_server)) -> Response:
    await _call(server, "update_weights_from_disk", body.model_path)
    return json_response(UpdateWeightsResponse(success=True, message=f"weights updated from {body.model_path}"))


@router.post("/init_weight_transfer_engine", responses=ERROR_RESPONSES)
async def init_weight_transfer_engine(body: InitWeightTransferRequest,
                                      server: OpenAIServer = Depends(get_server)) -> Response:
    await _call(server, "init_weight_transfer_engine", body.init_info)
    return Response(status_code=200)


@router.post("/update_weights", response_model=UpdateWeightsResponse, responses=ERROR_RESPONSES)
async def update_weights(body: UpdateWeightsRequest, server: OpenAIServer = Depends(get_server)) -> Response:
    info = body.update_info
    await _call(server, "update_weights_from_distributed", info.names, info.dtype_names, info.shapes)
    return json_response(UpdateWeightsResponse(success=True, message=f"{len(info.names)} parameters updated"))
