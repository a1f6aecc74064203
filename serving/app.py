"""The FastAPI app: OpenAI-compatible completions and chat completions over an ``LLMEngine``.

``create_app(engine, ...)`` wraps the engine in an ``AsyncEngine`` (engine loop on its own thread) and serves:

* ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or SSE with ``stream: true``),
* ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text), ``POST /tokenize``, ``POST /detokenize``.

Prompts are tokenized here, on the event loop, with the server's own copy of the tokenizer (HF tokenizers are not
safe to share with the engine thread), so prompt-length checks and usage counts need no engine round trip.
Every error answers OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for invalid input
(including pydantic validation errors, which FastAPI would answer 422), 401 without the API key, 404 for an unknown
model, 503 with ``Retry-After`` when the waiting queue is full, 500 when the engine has failed.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hmac
import json
import logging
import math
import os
import re
from typing import Any, AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.async_engine import (AsyncEngine, EngineDeadError, EngineOverloadedError, EngineRequest,
                                  RequestStream)
from serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from serving.metrics import ServingMetrics
from serving.protocol import (ChatCompletionLogProbs, ChatCompletionLogProbsContent, ChatCompletionRequest,
                              ChatCompletionResponse, ChatCompletionResponseChoice, ChatCompletionStreamChoice,
                              ChatCompletionStreamResponse, ChatCompletionTopLogprob, ChatMessage,
                              ChatMessageParam, CompletionLogProbs, CompletionRequest, CompletionResponse,
                              CompletionResponseChoice, CompletionStreamChoice, CompletionStreamResponse,
                              DeltaMessage, DetokenizeRequest, DetokenizeResponse, ErrorInfo, ErrorResponse,
                              ModelCard, ModelList, SamplingFields, TokenizeChatRequest, TokenizeRequest,
                              TokenizeResponse, UsageInfo, random_uuid, unix_time)

logger = logging.getLogger(__name__)

# Logprobs of -inf (or nan) are not valid JSON; vLLM clamps them to this value.
MIN_LOGPROB = -9999.0

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 500: "internal_server_error", 503: "service_unavailable"}


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


def json_response(model: Any, status_code: int = 200) -> Response:
    # pydantic serializes every key (None as null), which OpenAI clients expect.
    return Response(model.model_dump_json(), status_code=status_code, media_type="application/json")


# ----------------------------------------------------------------------------------------------- engine facts
@dataclasses.dataclass
class ModelInfo:
    """What the HTTP layer needs to know about the served model."""

    served_model_name: str
    root: str | None  # checkpoint directory (None for a named dummy shape)
    max_model_len: int
    vocab_size: int


def model_info_from_engine(engine: Any, served_model_name: str | None) -> ModelInfo:
    """The served model's facts from an ``LLMEngine`` (``max_model_len``, ``vocab_size``, ``model_path``,
    ``engine_args``)."""
    engine_args = getattr(engine, "engine_args", None)
    root = getattr(engine, "model_path", None) or getattr(engine_args, "model", None)
    name = served_model_name or getattr(engine_args, "served_model_name", None)
    if not name:
        name = os.path.basename(os.path.normpath(str(root))) if root else "paged-jax"
    return ModelInfo(served_model_name=str(name), root=str(root) if root is not None else None,
                     max_model_len=int(engine.max_model_len), vocab_size=int(engine.vocab_size))


# ---------------------------------------------------------------------------------------------------- errors
_FIELD_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)")


def _param_from_message(message: str, known: set[str], aliases: dict[str, str]) -> str | None:
    """The request field an engine ValueError names (its messages start with the field name)."""
    match = _FIELD_NAME.match(message.strip())
    if match is None:
        return None
    name = aliases.get(match.group(1), match.group(1))
    return name if name in known else None


def _is_union_tag(part: Any) -> bool:
    # pydantic puts the union member it tried into the error location ("TokenizeChatRequest", "list[int]",
    # "function-after[...]"); request fields are lower-case identifiers.
    return isinstance(part, str) and (part[:1].isupper() or not part.isidentifier())


def _validation_error(exc: RequestValidationError) -> APIError:
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
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return APIError(400, message, param=param)


# ------------------------------------------------------------------------------------------- the server state
class OpenAIServer:
    """Request handling shared by the endpoints (tokenization, validation, engine submission, formatting)."""

    def __init__(self, async_engine: AsyncEngine, tokenizer: Any, info: ModelInfo, metrics: ServingMetrics) -> None:
        self.engine = async_engine
        self.tokenizer = tokenizer
        self.info = info
        self.metrics = metrics

    # ---------------------------------------------------------------- input handling
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.info.served_model_name, self.info.root):
            raise APIError(404, f"The model `{model}` does not exist.", param="model")

    def check_token_ids(self, token_ids: Sequence[int], param: str) -> None:
        for position, token_id in enumerate(token_ids):
            if not 0 <= token_id < self.info.vocab_size:
                raise APIError(400, f"{param}: token id {token_id} at position {position} is out of range "
                                    f"[0, {self.info.vocab_size})", param=param)

    def require_tokenizer(self, param: str) -> Any:
        if self.tokenizer is None:
            raise APIError(400, f"{param}: this model has no tokenizer, so only token-id prompts are accepted",
                           param=param)
        return self.tokenizer

    def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        self.require_tokenizer(param)
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except Exception as exc:  # noqa: BLE001 - e.g. lone surrogates the tokenizer cannot encode
            raise APIError(400, f"{param}: cannot tokenize the text ({exc})", param=param) from exc

    def decode(self, token_ids: Sequence[int], param: str) -> str:
        return self.require_tokenizer(param).decode(list(token_ids))

    def render_chat(self, messages: Sequence[ChatMessageParam], add_generation_prompt: bool) -> str:
        tokenizer = self.require_tokenizer("messages")
        conversation = []
        for message in messages:
            if isinstance(message.content, list):
                content = "\n".join(part.text for part in message.content)
            else:
                content = message.content or ""
            role = "system" if message.role == "developer" else message.role
            entry = {"role": role, "content": content}
            if message.name is not None:
                entry["name"] = message.name
            conversation.append(entry)
        try:
            rendered = tokenizer.apply_chat_template(conversation, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 - template errors (e.g. unsupported role order) are input errors
            raise APIError(400, f"messages: the chat template rejected the conversation ({exc})",
                           param="messages") from exc
        if not isinstance(rendered, str):
            raise APIError(500, "the tokenizer's chat template did not render a string")
        return rendered

    def check_prompt_length(self, num_prompt_tokens: int, param: str) -> None:
        if num_prompt_tokens == 0:
            raise APIError(400, f"{param} must not be empty", param=param)
        if num_prompt_tokens >= self.info.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.info.max_model_len} tokens. "
                                f"However, your request has {num_prompt_tokens} input tokens. Please reduce the "
                                f"length of the input.", param=param)

    def resolve_max_tokens(self, requested: int | None, num_prompt_tokens: int, param: str) -> int:
        room = self.info.max_model_len - num_prompt_tokens
        if requested is None:
            return room
        if requested > room:
            raise APIError(400, f"{param}: '{requested}' is too large: the prompt has {num_prompt_tokens} tokens "
                                f"and this model's maximum context length is {self.info.max_model_len}, so at most "
                                f"{room} tokens can be generated.", param=param)
        return requested

    def sampling_params(self, body: SamplingFields, *, max_tokens: int, logprobs: int | None,
                        aliases: dict[str, str]):
        from paged_jax.sampling_params import SamplingParams

        if body.stop_token_ids:
            self.check_token_ids(body.stop_token_ids, "stop_token_ids")
        try:
            return SamplingParams(
                n=body.n,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                # top_k >= vocab keeps every token, i.e. is off; mapping it to 0 also keeps huge values out of
                # the sampler's int32 tensors.
                top_k=0 if body.top_k is None or body.top_k >= self.info.vocab_size else body.top_k,
                min_p=0.0 if body.min_p is None else body.min_p,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                seed=body.seed,
                stop=body.stop,
                stop_token_ids=body.stop_token_ids,
                ignore_eos=body.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=body.min_tokens,
                logprobs=logprobs,
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
            )
        except ValueError as exc:
            raise self.bad_request(exc, body, aliases) from exc

    def bad_request(self, exc: Exception, body: Any, aliases: dict[str, str]) -> APIError:
        known = set(type(body).model_fields) | {"prompt", "messages"}
        return APIError(400, str(exc), param=_param_from_message(str(exc), known, aliases))

    async def submit(self, requests: list[EngineRequest], body: Any, aliases: dict[str, str]) -> list[RequestStream]:
        try:
            return await self.engine.add_requests(requests)
        except EngineOverloadedError as exc:
            raise APIError(503, str(exc), headers={"Retry-After": str(exc.retry_after_s)}) from exc
        except EngineDeadError as exc:
            raise APIError(500, str(exc)) from exc
        except ValueError as exc:
            raise self.bad_request(exc, body, aliases) from exc

    # ---------------------------------------------------------------- logprobs formatting
    def token_text(self, token_id: int, logprob: Any) -> str:
        decoded = getattr(logprob, "decoded_token", None)
        if decoded is not None:
            return decoded
        if self.tokenizer is None:
            return f"token_id:{token_id}"  # vLLM's spelling for tokens it cannot show as text
        return self.tokenizer.decode([token_id])

    @staticmethod
    def clamp(value: float) -> float:
        value = float(value)
        return MIN_LOGPROB if math.isnan(value) or value < MIN_LOGPROB else value

    def _ranked(self, entries: dict) -> list[tuple[int, Any]]:
        return sorted(entries.items(), key=lambda item: (getattr(item[1], "rank", None) or 1 << 30, item[0]))

    def completion_logprobs(self, token_ids: Sequence[int], logprobs: Sequence[dict], num_top: int,
                            text_offset: int) -> CompletionLogProbs:
        """Legacy format for generated tokens ``token_ids`` (the sampled token plus the ``num_top`` most likely)."""
        result = CompletionLogProbs()
        for token_id, entries in zip(token_ids, logprobs):
            sampled = entries.get(token_id)
            text = self.token_text(token_id, sampled)
            result.tokens.append(text)
            result.token_logprobs.append(self.clamp(sampled.logprob) if sampled is not None else None)
            top: dict[str, float] = {}
            for other_id, entry in self._ranked(entries)[:num_top]:
                top[self.token_text(other_id, entry)] = self.clamp(entry.logprob)
            if sampled is not None:
                top.setdefault(text, self.clamp(sampled.logprob))
            result.top_logprobs.append(top)
            result.text_offset.append(text_offset)
            text_offset += len(text)
        return result

    def chat_logprobs(self, token_ids: Sequence[int], logprobs: Sequence[dict], num_top: int
                      ) -> ChatCompletionLogProbs:
        content = []
        for token_id, entries in zip(token_ids, logprobs):
            sampled = entries.get(token_id)
            text = self.token_text(token_id, sampled)
            top = [ChatCompletionTopLogprob(token=(t := self.token_text(other_id, entry)),
                                            logprob=self.clamp(entry.logprob), bytes=list(t.encode("utf-8")))
                   for other_id, entry in self._ranked(entries)[:num_top]]
            content.append(ChatCompletionLogProbsContent(
                token=text, logprob=self.clamp(sampled.logprob) if sampled is not None else MIN_LOGPROB,
                bytes=list(text.encode("utf-8")), top_logprobs=top))
        return ChatCompletionLogProbs(content=content)


# ------------------------------------------------------------------------------------------ stream utilities
async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """Yield ``(stream_index, output)`` from several streams as outputs arrive, until all are finished."""
    if len(streams) == 1:  # the common case: no task per output, just await the one stream
        stream = streams[0]
        while True:
            output = await stream.next_output()  # re-raises engine errors
            yield 0, output
            if stream.finished:
                return
    pending: dict[asyncio.Task, int] = {}
    try:
        for index, stream in enumerate(streams):
            pending[asyncio.ensure_future(stream.next_output())] = index
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                output = task.result()  # re-raises engine errors
                if not streams[index].finished:
                    pending[asyncio.ensure_future(streams[index].next_output())] = index
                yield index, output
    finally:
        for task in pending:
            task.cancel()


async def wait_for_disconnect(raw_request: Request) -> None:
    """Return when the client closes the connection (the request body was already read by FastAPI)."""
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientDisconnected(Exception):
    pass


async def collect_final(streams: Sequence[RequestStream], raw_request: Request) -> list[Any]:
    """Final outputs of all streams; raises ClientDisconnected if the client leaves first."""
    finals: list[Any] = [None] * len(streams)

    async def consume() -> None:
        async for index, output in merge_streams(streams):
            finals[index] = output

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if consumer.done():
            consumer.result()
            return finals
        raise ClientDisconnected()
    finally:
        consumer.cancel()
        watcher.cancel()


def abort_unfinished(async_engine: AsyncEngine, streams: Sequence[RequestStream]) -> None:
    unfinished = [stream.request_id for stream in streams if not stream.finished]
    if unfinished:
        async_engine.abort(unfinished)


class EngineStreamingResponse(StreamingResponse):
    """SSE response that aborts its engine requests however it ends.

    The generator's own ``finally`` covers disconnects mid-stream, but if the client leaves before the first
    chunk, Starlette cancels the response before the generator ever starts, and a never-started generator runs
    no ``finally``; this wrapper covers that case.
    """

    def __init__(self, content: AsyncIterator[str], async_engine: AsyncEngine, streams: Sequence[RequestStream]):
        super().__init__(content, media_type="text/event-stream")
        self._async_engine = async_engine
        self._streams = list(streams)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            abort_unfinished(self._async_engine, self._streams)


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def sse_error(error: APIError) -> str:
    return sse(error.body().model_dump_json())


def engine_error(exc: Exception) -> APIError:
    return APIError(500, f"the engine failed: {exc}")


# ------------------------------------------------------------------------------------------- api-key guard
class APIKeyMiddleware:
    """Pure ASGI middleware: every ``/v1`` route needs ``Authorization: Bearer <key>`` (others stay open)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("path", "").startswith("/v1"):
            given = dict(scope.get("headers") or ()).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                response = APIError(401, "Invalid or missing API key (send 'Authorization: Bearer <key>').",
                                    headers={"WWW-Authenticate": "Bearer"}).response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ------------------------------------------------------------------------------------------------- the app
def on_output_metrics(metrics: ServingMetrics):
    """Latency metrics from the outputs as they reach the event loop (what a client observes)."""

    def observe(stream: RequestStream, output: Any, now: float) -> None:
        num_tokens = sum(len(completion.token_ids) for completion in output.outputs)
        if num_tokens > stream.num_tokens_seen:
            if stream.first_token_time is None:
                stream.first_token_time = now
                metrics.observe_first_token(now - stream.arrival_time)
            else:
                metrics.observe_inter_token(now - stream.last_token_time)
            stream.last_token_time = now
            stream.num_tokens_seen = num_tokens
        if output.finished:
            metrics.observe_finished(now - stream.arrival_time,
                                     [completion.finish_reason for completion in output.outputs])

    return observe


def create_app(engine: Any, *, served_model_name: str | None = None, api_key: str | None = None,
               max_waiting_requests: int | None = None, tokenizer: Any = None) -> FastAPI:
    """Build the server app around ``engine`` and start its engine thread.

    Args:
      engine: an ``LLMEngine`` (or any object with its methods, ``tokenizer``, ``max_model_len``/``vocab_size``).
        From now on only the engine thread may call it.
      served_model_name: the model id clients send and ``/v1/models`` lists (default: the engine's).
      api_key: if set, ``/v1`` routes require ``Authorization: Bearer <api_key>``.
      max_waiting_requests: bound on the engine's waiting queue; beyond it requests get 503 + Retry-After.
      tokenizer: the tokenizer for the HTTP layer; default a private copy of ``engine.tokenizer``.
    Returns:
      The FastAPI app; ``app.state.server`` holds the ``OpenAIServer`` (``.engine`` is the AsyncEngine, whose
      ``shutdown()`` the caller runs when done serving).
    """
    info = model_info_from_engine(engine, served_model_name)
    if tokenizer is None:
        tokenizer = copy.deepcopy(engine.tokenizer)  # never shared with the engine thread
    metrics = ServingMetrics(info.served_model_name)
    async_engine = AsyncEngine(engine, max_waiting_requests=max_waiting_requests,
                               on_stats=metrics.update_engine_stats, on_output=on_output_metrics(metrics))
    server = OpenAIServer(async_engine, tokenizer, info, metrics)
    async_engine.start()

    # The engine thread's life is not tied to the ASGI lifespan: test clients run a lifespan per request, and the
    # process owner (serving.cli.main, a test fixture) calls ``app.state.server.engine.shutdown()`` at the end.
    app = FastAPI(title="paged-jax OpenAI-compatible server", version="0.1.0")
    app.state.server = server
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.exception_handler(APIError)
    async def api_error_handler(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error_handler(request: Request, exc: RequestValidationError) -> Response:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error_handler(request: Request, exc: StarletteHTTPException) -> Response:
        # FastAPI's own errors (undecodable body, unknown route, wrong method) in the OpenAI error shape.
        param = "body" if exc.status_code == 400 else None
        return APIError(exc.status_code, str(exc.detail), param=param,
                        headers=dict(exc.headers) if exc.headers else None).response()

    @app.exception_handler(Exception)
    async def unexpected_error_handler(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error")
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    error_responses = {code: {"model": ErrorResponse} for code in (400, 401, 404, 500, 503)}

    # ------------------------------------------------------------------ plain routes
    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        if not async_engine.is_healthy:
            return APIError(503, f"engine is not running: {async_engine.dead_error}").response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList, responses=error_responses)
    async def list_models() -> Response:
        card = ModelCard(id=info.served_model_name, root=info.root or info.served_model_name,
                         max_model_len=info.max_model_len)
        return json_response(ModelList(data=[card]))

    @app.post("/tokenize", response_model=TokenizeResponse, responses=error_responses)
    async def tokenize(body: TokenizeRequest) -> Response:
        server.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            text = server.render_chat(body.messages, body.add_generation_prompt)
            token_ids = server.encode(text, body.add_special_tokens, "messages")
        else:
            token_ids = server.encode(body.prompt, body.add_special_tokens, "prompt")
        token_strs = tokenizer.convert_ids_to_tokens(token_ids) if body.return_token_strs else None
        return json_response(TokenizeResponse(count=len(token_ids), max_model_len=info.max_model_len,
                                              tokens=token_ids, token_strs=token_strs))

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=error_responses)
    async def detokenize(body: DetokenizeRequest) -> Response:
        server.check_model(body.model)
        server.check_token_ids(body.tokens, "tokens")
        return json_response(DetokenizeResponse(prompt=server.decode(body.tokens, "tokens")))

    # ------------------------------------------------------------------ completions
    @app.post("/v1/completions", response_model=CompletionResponse, responses={
        **error_responses, 200: {"content": {"text/event-stream": {}}}})
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        server.check_model(body.model)
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo: echo together with logprobs needs prompt logprobs, which this engine does "
                                "not compute", param="echo")
        prompts = _normalize_prompts(body.prompt)
        prompt_token_ids: list[list[int]] = []
        for prompt in prompts:
            ids = server.encode(prompt, True, "prompt") if isinstance(prompt, str) else list(prompt)
            server.check_token_ids(ids, "prompt")
            server.check_prompt_length(len(ids), "prompt")
            prompt_token_ids.append(ids)
        aliases: dict[str, str] = {}
        requests = []
        response_id = f"cmpl-{random_uuid()}"
        for index, ids in enumerate(prompt_token_ids):
            max_tokens = server.resolve_max_tokens(body.max_tokens, len(ids), "max_tokens")
            params = server.sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs, aliases=aliases)
            requests.append(EngineRequest(f"{response_id}-{index}", ids, params))
        prompt_texts = [p if isinstance(p, str) else server.decode(ids, "echo")
                        for p, ids in zip(prompts, prompt_token_ids)] if body.echo else None
        streams = await server.submit(requests, body, aliases)
        num_prompt_tokens = sum(len(ids) for ids in prompt_token_ids)
        created = unix_time()
        if body.stream:
            return EngineStreamingResponse(
                _completion_stream(server, body, streams, response_id, created, prompt_texts, num_prompt_tokens),
                async_engine, streams)
        try:
            finals = await collect_final(streams, raw_request)
        except ClientDisconnected:
            return Response(status_code=499)
        except (EngineDeadError, RuntimeError) as exc:
            raise engine_error(exc) from exc
        finally:
            abort_unfinished(async_engine, streams)
        choices = []
        num_completion_tokens = 0
        for prompt_index, output in enumerate(finals):
            for completion in output.outputs:
                prefix = prompt_texts[prompt_index] if prompt_texts else ""
                logprobs = None
                if body.logprobs is not None and completion.logprobs is not None:
                    logprobs = server.completion_logprobs(completion.token_ids, completion.logprobs,
                                                          body.logprobs, len(prefix))
                choices.append(CompletionResponseChoice(
                    index=prompt_index * body.n + completion.index, text=prefix + completion.text, logprobs=logprobs,
                    finish_reason=completion.finish_reason, stop_reason=completion.stop_reason))
                num_completion_tokens += len(completion.token_ids)
        choices.sort(key=lambda choice: choice.index)
        usage = UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                          total_tokens=num_prompt_tokens + num_completion_tokens)
        return json_response(CompletionResponse(id=response_id, created=created, model=info.served_model_name,
                                                choices=choices, usage=usage))

    # ------------------------------------------------------------------ chat completions
    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={
        **error_responses, 200: {"content": {"text/event-stream": {}}}})
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
        server.check_model(body.model)
        if body.top_logprobs is not None and body.top_logprobs > 0 and not body.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
        text = server.render_chat(body.messages, body.add_generation_prompt)
        ids = server.encode(text, False, "messages")
        server.check_prompt_length(len(ids), "messages")
        max_tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = server.resolve_max_tokens(requested, len(ids), max_tokens_param)
        num_top = (body.top_logprobs or 0) if body.logprobs else None
        aliases = {"logprobs": "top_logprobs", "max_tokens": max_tokens_param}
        params = server.sampling_params(body, max_tokens=max_tokens, logprobs=num_top, aliases=aliases)
        response_id = f"chatcmpl-{random_uuid()}"
        streams = await server.submit([EngineRequest(f"{response_id}-0", ids, params)], body, aliases)
        created = unix_time()
        if body.stream:
            return EngineStreamingResponse(
                _chat_stream(server, body, streams[0], response_id, created, len(ids)), async_engine, streams)
        try:
            (final,) = await collect_final(streams, raw_request)
        except ClientDisconnected:
            return Response(status_code=499)
        except (EngineDeadError, RuntimeError) as exc:
            raise engine_error(exc) from exc
        finally:
            abort_unfinished(async_engine, streams)
        choices = []
        for completion in final.outputs:
            logprobs = None
            if num_top is not None and completion.logprobs is not None:
                logprobs = server.chat_logprobs(completion.token_ids, completion.logprobs, num_top)
            choices.append(ChatCompletionResponseChoice(
                index=completion.index, message=ChatMessage(role="assistant", content=completion.text),
                logprobs=logprobs, finish_reason=completion.finish_reason, stop_reason=completion.stop_reason))
        choices.sort(key=lambda choice: choice.index)
        num_completion_tokens = sum(len(completion.token_ids) for completion in final.outputs)
        usage = UsageInfo(prompt_tokens=len(ids), completion_tokens=num_completion_tokens,
                          total_tokens=len(ids) + num_completion_tokens)
        return json_response(ChatCompletionResponse(id=response_id, created=created, model=info.served_model_name,
                                                    choices=choices, usage=usage))

    return app


def _normalize_prompts(prompt: Any) -> list[str | list[int]]:
    """The request's ``prompt`` as a list of prompts (each a text or a token-id list)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


@dataclasses.dataclass
class _ChoiceProgress:
    """How much of one choice has been streamed already."""

    num_chars: int = 0
    num_tokens: int = 0
    finished: bool = False

    def advance(self, completion) -> tuple[str, list[int], list | None, int] | None:
        """Move past a cumulative ``CompletionOutput``; returns (new text, new token ids, their logprobs or None,
        character offset of the new text) or None when there is nothing new to send."""
        if self.finished:
            return None
        delta_text = completion.text[self.num_chars:]
        new_token_ids = completion.token_ids[self.num_tokens:]
        finished = completion.finish_reason is not None
        if not delta_text and not new_token_ids and not finished:
            return None
        new_logprobs = None if completion.logprobs is None else completion.logprobs[self.num_tokens:]
        char_offset = self.num_chars
        self.num_chars, self.num_tokens, self.finished = len(completion.text), len(completion.token_ids), finished
        return delta_text, new_token_ids, new_logprobs, char_offset


def _usage_sse(response_cls, response_id: str, created: int, model: str, num_prompt_tokens: int,
               num_completion_tokens: int) -> str:
    """The final ``stream_options.include_usage`` chunk: usage and no choices, as OpenAI sends it."""
    usage = UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                      total_tokens=num_prompt_tokens + num_completion_tokens)
    return sse(response_cls(id=response_id, created=created, model=model, choices=[], usage=usage).model_dump_json())


class _CompletionTextChunk:
    """The SSE line of a completion chunk without logprobs, rendered from a fixed prefix and suffix.

    Per token and stream this replaces building two pydantic models and serializing them (tens of microseconds,
    on the event loop, under the GIL the engine thread also needs) by one ``json.dumps`` of the text. The JSON is
    the same document ``CompletionStreamResponse.model_dump_json`` gives (tests compare them)."""

    def __init__(self, response_id: str, created: int, model: str, include_usage: bool):
        self._prefix = (f'data: {{"id":{json.dumps(response_id)},"object":"text_completion","created":{int(created)},'
                        f'"model":{json.dumps(model)},"choices":[{{"index":')
        self._suffix = ',"usage":null}\n\n' if include_usage else '}\n\n'

    def __call__(self, index: int, text: str, finish_reason: str | None, stop_reason: int | str | None) -> str:
        return (f'{self._prefix}{int(index)},"text":{json.dumps(text, ensure_ascii=False)},"logprobs":null,'
                f'"finish_reason":{json.dumps(finish_reason)},"stop_reason":{json.dumps(stop_reason)}}}]'
                f'{self._suffix}')


async def _completion_stream(server: OpenAIServer, body: CompletionRequest, streams: list[RequestStream],
                             response_id: str, created: int, prompt_texts: list[str] | None,
                             num_prompt_tokens: int) -> AsyncIterator[str]:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    model = server.info.served_model_name
    progress: dict[int, _ChoiceProgress] = {}
    num_completion_tokens = 0

    def chunk(choice: CompletionStreamChoice) -> str:
        response = CompletionStreamResponse(id=response_id, created=created, model=model, choices=[choice])
        return sse(response.model_dump_json(exclude=None if include_usage else {"usage"}))

    text_chunk = _CompletionTextChunk(response_id, created, model, include_usage)

    try:
        if prompt_texts is not None:
            for prompt_index, text in enumerate(prompt_texts):
                for i in range(body.n):
                    yield chunk(CompletionStreamChoice(index=prompt_index * body.n + i, text=text))
        async for prompt_index, output in merge_streams(streams):
            for completion in output.outputs:
                index = prompt_index * body.n + completion.index
                delta = progress.setdefault(index, _ChoiceProgress()).advance(completion)
                if delta is None:
                    continue
                delta_text, new_token_ids, new_logprobs, char_offset = delta
                logprobs = None
                if body.logprobs is not None and new_logprobs is not None:
                    offset = char_offset + (len(prompt_texts[prompt_index]) if prompt_texts else 0)
                    logprobs = server.completion_logprobs(new_token_ids, new_logprobs, body.logprobs, offset)
                if completion.finish_reason is not None:
                    num_completion_tokens += len(completion.token_ids)
                if logprobs is None:
                    yield text_chunk(index, delta_text, completion.finish_reason, completion.stop_reason)
                else:
                    yield chunk(CompletionStreamChoice(index=index, text=delta_text, logprobs=logprobs,
                                                       finish_reason=completion.finish_reason,
                                                       stop_reason=completion.stop_reason))
        if include_usage:
            yield _usage_sse(CompletionStreamResponse, response_id, created, model, num_prompt_tokens,
                             num_completion_tokens)
    except (EngineDeadError, RuntimeError) as exc:
        yield sse_error(engine_error(exc))
    finally:
        abort_unfinished(server.engine, streams)
    yield sse("[DONE]")


async def _chat_stream(server: OpenAIServer, body: ChatCompletionRequest, stream: RequestStream, response_id: str,
                       created: int, num_prompt_tokens: int) -> AsyncIterator[str]:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    model = server.info.served_model_name
    num_top = (body.top_logprobs or 0) if body.logprobs else None
    progress: dict[int, _ChoiceProgress] = {}
    num_completion_tokens = 0

    def chunk(choice: ChatCompletionStreamChoice) -> str:
        response = ChatCompletionStreamResponse(id=response_id, created=created, model=model, choices=[choice])
        return sse(response.model_dump_json(exclude=None if include_usage else {"usage"}))

    try:
        for index in range(body.n):
            yield chunk(ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", content="")))
        async for output in stream:
            for completion in output.outputs:
                delta = progress.setdefault(completion.index, _ChoiceProgress()).advance(completion)
                if delta is None:
                    continue
                delta_text, new_token_ids, new_logprobs, _ = delta
                logprobs = None
                if num_top is not None and new_logprobs is not None:
                    logprobs = server.chat_logprobs(new_token_ids, new_logprobs, num_top)
                if completion.finish_reason is not None:
                    num_completion_tokens += len(completion.token_ids)
                delta = DeltaMessage(content=delta_text) if delta_text else DeltaMessage()
                yield chunk(ChatCompletionStreamChoice(index=completion.index, delta=delta, logprobs=logprobs,
                                                       finish_reason=completion.finish_reason,
                                                       stop_reason=completion.stop_reason))
        if include_usage:
            yield _usage_sse(ChatCompletionStreamResponse, response_id, created, model, num_prompt_tokens,
                             num_completion_tokens)
    except (EngineDeadError, RuntimeError) as exc:
        yield sse_error(engine_error(exc))
    finally:
        abort_unfinished(server.engine, [stream])
    yield sse("[DONE]")
