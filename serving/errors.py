"""OpenAI's error body for every failure: ``{"error": {"message", "type", "param", "code"}}``.

400 for invalid input (including pydantic validation errors, which FastAPI would answer 422), 405 (with ``Allow``
listing every method the path serves) for a method it does not, 413 for a body over ``--max-request-body-size``,
401 without the API key, 404 for an unknown model, 503 with ``Retry-After`` when the waiting queue is full, 500 when
the engine has failed. ``add_error_handlers(app)`` makes the app answer every exception in that shape.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status_code: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=_ERROR_TYPES.get(self.status_code, "error"),
                                             param=self.param, code=self.status_code))

    def response(self) -> Response:
        return Response(self.body().model_dump_json(), status_code=self.status_code,
                        media_type="application/json", headers=self.headers)


def engine_error(exc: Exception) -> APIError:
    """The 500 answered when the engine failed while serving a request."""
    return APIError(500, f"the engine failed: {exc}")


_FIELD_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)")


def param_from_message(message: str, known: set[str], aliases: dict[str, str]) -> str | None:
    """The request field an engine ValueError names (its messages start with the field name), after ``aliases``
    (engine name -> request field); None unless it is one of ``known``."""
    match = _FIELD_NAME.match(message.strip())
    if match is None:
        return None
    name = aliases.get(match.group(1), match.group(1))
    return name if name in known else None


def _is_union_tag(part: Any) -> bool:
    # pydantic puts the union member it tried into the error location ("TokenizeChatRequest", "list[int]",
    # "function-after[...]"); request fields are lower-case identifiers.
    return isinstance(part, str) and (part[:1].isupper() or not part.isidentifier())


def validation_error(exc: RequestValidationError) -> APIError:
    """A FastAPI/pydantic validation error as a 400 naming the (first) offending field."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body", param="body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"body: invalid JSON ({detail})" if detail else "body: invalid JSON", param="body")
    loc = [part for part in first.get("loc", ()) if part != "body" and not _is_union_tag(part)]
    param = str(loc[0]) if loc and isinstance(loc[0], str) else "body"
    where = ".".join(str(part) for part in loc) or "body"
    message = f"{where}: {first.get('msg', 'invalid value')}"
    detail = str(first.get("msg", "")).removeprefix("Value error, ")
    named = _FIELD_NAME.match(detail)
    if not loc and named and detail[named.end():].startswith(":"):  # a whole-body check that names the field
        param, message = named.group(1), detail
    elif loc and detail.startswith(where) and detail[len(where):len(where) + 1] in (":", "["):
        message = detail  # the field's own check names the field (and the offending item) itself
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return APIError(400, message, param=param)


async def _api_error(request: Request, exc: APIError) -> Response:
    return exc.response()


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    return validation_error(exc).response()


def route_path(scope) -> str:
    """The path the router matches: ``scope["path"]`` without a leading ``root_path`` (Starlette's rule)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):]
    return path


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    # FastAPI's own errors (undecodable body, unknown route, wrong method) in the OpenAI error shape.
    param = "body" if exc.status_code == 400 else None
    headers = dict(exc.headers) if exc.headers else {}
    # Starlette's 405 names the methods of the first route at the path only; a path served by several routes (a GET
    # and a POST one) lists all of them (``app.state.route_methods``: {path: methods}, set by serving.app).
    methods = getattr(request.app.state, "route_methods", {}).get(route_path(request.scope))
    if exc.status_code == 405 and methods:
        headers["Allow"] = ", ".join(sorted(methods))
    return APIError(exc.status_code, str(exc.detail), param=param, headers=headers or None).response()


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()


def add_error_handlers(app: FastAPI) -> None:
    """Answer every exception of ``app``'s routes with OpenAI's error body."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
