"""The HTTP routes, one ``APIRouter`` per module: ``completions`` (``POST /v1/completions``), ``chat``
(``POST /v1/chat/completions``), ``responses`` (``POST /v1/responses``, ``GET /v1/responses/{id}``,
``POST /v1/responses/{id}/cancel``), ``tokenize`` (``POST /tokenize``, ``POST /detokenize``) and ``system``
(``GET /health``, ``GET|POST /ping``, ``GET /version``, ``GET /metrics``, ``GET /v1/models``), ``pooling``
(``POST /v1/embeddings``, ``/classify``, ``/v1/score``, ``/v1/rerank``: a pooling model's). Routes reach the
app's ``OpenAIServer`` through the ``serving.openai_server.get_server`` dependency.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
from fastapi.responses import Response

from serving.protocol import ErrorResponse

# What each error status means, as the OpenAPI document describes it (every one in OpenAI's error body).
_ERROR_DESCRIPTIONS = {
    400: "The request cannot be served: a value the schema admits but the server refuses or that does not fit the "
         "model or the server's limits (the error's param names the field)",
    401: "Missing or wrong API key (--api-key; with --api-key-protect-all also on /tokenize, /detokenize, /metrics)",
    404: "No served model or LoRA adapter has the request's model name",
    413: "The request body is larger than --max-request-body-size",
    500: "The engine failed while serving the request",
    503: "The waiting queue is full (retry after Retry-After seconds) or the engine is not running",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` entries of the error statuses ``codes``."""
    return {code: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[code]} for code in codes}


# The error answers of a route that takes a JSON body (tokenize, detokenize, LoRA updates).
ERROR_RESPONSES = error_responses(400, 401, 404, 413, 500)
# A generation route answers JSON, or SSE with ``stream: true``; 503 while the waiting queue is full.
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    **error_responses(400, 401, 404, 413, 500, 503),
    200: {"description": "The whole response (JSON), or with stream: true its chunks as server-sent events",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def json_response(model: Any, status_code: int = 200) -> Response:
    # pydantic serializes every key (None as null), which OpenAI clients expect.
    return Response(model.model_dump_json(), status_code=status_code, media_type="application/json")


def encode_routed_experts(routed_experts: np.ndarray | None) -> str | None:
    """A choice's ``routed_experts`` as vLLM's responses carry it: the base64 of the array's ``.npy`` bytes
    (``np.load(io.BytesIO(base64.b64decode(s)))`` reads it back), or None."""
    if routed_experts is None:
        return None
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(routed_experts), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")
