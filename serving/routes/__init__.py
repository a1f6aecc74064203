"""The HTTP routes, one ``APIRouter`` per module: ``completions`` (``POST /v1/completions``), ``chat``
(``POST /v1/chat/completions``), ``tokenize`` (``POST /tokenize``, ``POST /detokenize``) and ``system``
(``GET /health``, ``GET|POST /ping``, ``GET /version``, ``GET /metrics``, ``GET /v1/models``). Routes reach the
app's ``OpenAIServer`` through the ``serving.openai_server.get_server`` dependency.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import Response

from serving.protocol import ErrorResponse

# The error answers a /v1 route documents in the OpenAPI schema (all in OpenAI's error body).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse}
                                                    for code in (400, 401, 404, 500, 503)}
# A generation route answers JSON, or SSE with ``stream: true``.
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {**ERROR_RESPONSES,
                                                         200: {"content": {"text/event-stream": {}}}}


def json_response(model: Any, status_code: int = 200) -> Response:
    # pydantic serializes every key (None as null), which OpenAI clients expect.
    return Response(model.model_dump_json(), status_code=status_code, media_type="application/json")
