"""The FastAPI app: OpenAI-compatible completions and chat completions over an engine (``LLMEngine``).

``create_app(engine, ...)`` wraps the engine in an ``AsyncEngine`` (engine loop on its own thread), builds the
per-app state (``app.state.server``, an ``OpenAIServer``: the AsyncEngine, the tokenizer copy, the model's facts,
the metrics) and mounts the routers of ``serving.routes``:

* ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses`` (JSON, or SSE with ``stream: true``),
  ``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``,
* ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text), ``POST /tokenize``, ``POST /detokenize``.

Every error answers OpenAI's error body (``serving.errors``). Around the routes, outermost first: CORS (Starlette's
``CORSMiddleware`` with vLLM's defaults: every origin, method and header, no credentials), then the API key check,
then the request body size limit (``serving.request_limits``).
Behind a proxy that serves the app under a path prefix, the prefix is the ASGI server's ``root_path`` (uvicorn's,
``--root-path``); routes and the API key check match the path without it.
"""

from __future__ import annotations

import copy
import hmac
from typing import Any, Sequence

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from paged_jax.engine.generation_config import sampling_defaults
from paged_jax.sampling_params import MAX_LOGPROBS
from serving.async_engine import AsyncEngine
from paged_jax.engine.llm_engine import LLMEngine
from serving.errors import APIError, add_error_handlers, route_path
from serving.metrics import NATIVE_PREFIX, ServingMetrics, cache_config_labels
from serving.openai_server import OpenAIServer, model_info_from_engine
from serving.lora import LoRAModulePath, LoRARegistry, runtime_lora_updating_allowed
from serving.request_limits import DEFAULT_MAX_REQUEST_BODY_SIZE, BodySizeLimitMiddleware, default_max_seqs_per_request
from serving.responses_store import ResponseStore
from serving.routes import chat, completions, lora, pooling, responses, rl, system, tokenize
from serving.server_logs import RequestLogger, StatsLogger


# Routes the API key also covers with ``--api-key-protect-all`` (vLLM's --api-key covers /v1 only); /health stays
# open for probes.
EXTRA_PROTECTED_ROUTES = ("/tokenize", "/detokenize", "/metrics")


class APIKeyMiddleware:
    """Pure ASGI middleware: every ``/v1`` route (with ``protect_all`` also ``EXTRA_PROTECTED_ROUTES``) needs
    ``Authorization: Bearer <key>``, the scheme in any case (vLLM); others stay open. The route path is the request
    path without the app's ``root_path`` prefix, as the router matches it, so ``<root_path>/v1/...`` is checked
    too."""

    def __init__(self, app: Any, api_key: str, protect_all: bool = False) -> None:
        self.app = app
        self._expected = api_key.encode()
        self._protect_all = protect_all

    def _protected(self, path: str) -> bool:
        return path.startswith("/v1") or (self._protect_all and any(
            path == route or path.startswith(route + "/") for route in EXTRA_PROTECTED_ROUTES))

    def _authorized(self, scope) -> bool:
        scheme, _, given = dict(scope.get("headers") or ()).get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(given, self._expected)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self._protected(route_path(scope)):
            if not self._authorized(scope):
                response = APIError(401, "Invalid or missing API key (send 'Authorization: Bearer <key>').",
                                    headers={"WWW-Authenticate": "Bearer"}).response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine: LLMEngine, *, served_model_name: str | Sequence[str] | None = None,
               api_key: str | None = None, max_waiting_requests: int | None = None, tokenizer: Any = None,
               allowed_origins: Sequence[str] = ("*",), allowed_methods: Sequence[str] = ("*",),
               allowed_headers: Sequence[str] = ("*",), allow_credentials: bool = False,
               log_requests: bool = False, max_log_len: int | None = None, log_stats: bool = False,
               max_logprobs: int = MAX_LOGPROBS, chat_template: str | None = None,
               response_role: str = "assistant", metrics_prefix: str = NATIVE_PREFIX,
               api_key_protect_all: bool = False,
               max_request_body_size: int | None = DEFAULT_MAX_REQUEST_BODY_SIZE,
               max_seqs_per_request: int | None = None, enable_auto_tool_choice: bool = False,
               tool_parser: str | None = None, reasoning_parser: str | None = None,
               lora_modules: Sequence[LoRAModulePath] = (), trust_request_chat_template: bool = False,
               enable_prompt_tokens_details: bool = False) -> FastAPI:
    """Build the server app around ``engine`` and start its engine thread.

    Args:
      engine: an ``LLMEngine`` (its core in this process or in its own). From now on only the engine thread
        may call it.
      served_model_name: the model id(s) clients may send; responses report the first and ``/v1/models`` lists
        all (default: ``engine.engine_args.served_model_names``).
      api_key: if set, ``/v1`` routes require ``Authorization: Bearer <api_key>``.
      api_key_protect_all: the key also guards ``/tokenize``, ``/detokenize`` and ``/metrics``.
      max_waiting_requests: bound on the engine's waiting queue (in sequences, counted as above); beyond it 503 +
        Retry-After, and a request with more sequences than the bound gets 400.
      max_request_body_size: bytes a request body may have (413 beyond; None: no limit).
      max_seqs_per_request: most sequences one request may run (each prompt's n, best_of or beam width, summed;
        400 beyond); None: half the engine's ``max_num_seqs`` (``serving.request_limits.default_max_seqs_per_request``).
      tokenizer: the tokenizer for the HTTP layer; default a private copy of ``engine.tokenizer``.
      allowed_origins, allowed_methods, allowed_headers, allow_credentials: CORS (vLLM's flags and defaults).
      log_requests, max_log_len: one log line per request (``serving.server_logs.RequestLogger``).
      log_stats: the periodic stats log line (``serving.server_logs.StatsLogger``), until the engine shuts down.
      max_logprobs: most top logprobs a request may ask for (``--max-logprobs``, at most ``MAX_LOGPROBS``).
      chat_template: a Jinja chat template replacing the tokenizer's (``--chat-template``, already loaded).
      response_role: the role of chat replies (``--response-role``).
      metrics_prefix: the Prometheus names' prefix (``--metrics-prefix``; ``"vllm"`` exports vLLM's names).
      enable_auto_tool_choice, tool_parser, reasoning_parser: ``--enable-auto-tool-choice``,
        ``--tool-call-parser``, ``--reasoning-parser`` (``OpenAIServer``).
      enable_prompt_tokens_details: usage reports ``prompt_tokens_details.cached_tokens``
        (``--enable-prompt-tokens-details``).
      trust_request_chat_template: render a request's own ``chat_template`` (``--trust-request-chat-template``).
      lora_modules: LoRA adapters to serve from the start (``--lora-modules``; the engine needs ``enable_lora``);
        with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` true, ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
        are mounted too (``serving.lora``).
    Returns:
      The FastAPI app; ``app.state.server`` holds the ``OpenAIServer`` (``.engine`` is the AsyncEngine, whose
      ``shutdown()`` the caller runs when done serving).
    """
    if not 0 <= max_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}] (the engine computes at most "
                         f"{MAX_LOGPROBS} top logprobs), got {max_logprobs}")
    info = model_info_from_engine(engine, served_model_name)
    if tokenizer is None:
        tokenizer = copy.deepcopy(engine.tokenizer)  # never shared with the engine thread
    if max_seqs_per_request is None:
        max_seqs_per_request = default_max_seqs_per_request(engine)
    metrics = _serving_metrics(engine, info, metrics_prefix)
    loras = _lora_registry(engine, info, lora_modules)
    async_engine = AsyncEngine(engine, max_waiting_requests=max_waiting_requests,
                               on_stats=metrics.update_engine_stats, on_output=metrics.observe_output,
                               request_logger=RequestLogger(max_log_len).log if log_requests else None)
    # Requests leaving a sampling field unset take the checkpoint's generation config default (vLLM).
    defaults = sampling_defaults(engine.generation_config)
    server = OpenAIServer(async_engine, tokenizer, info, metrics, default_sampling_params=defaults,
                          max_logprobs=max_logprobs, chat_template=chat_template, response_role=response_role,
                          scheduling_policy=engine.engine_args.scheduling_policy,
                          max_seqs_per_request=max_seqs_per_request,
                          enable_auto_tool_choice=enable_auto_tool_choice, tool_parser=tool_parser,
                          reasoning_parser=reasoning_parser, loras=loras,
                          trust_request_chat_template=trust_request_chat_template,
                          enable_prompt_tokens_details=enable_prompt_tokens_details)
    async_engine.start()
    if log_stats:
        StatsLogger(lambda: async_engine.latest_stats, is_done=lambda: async_engine.dead_error is not None).start()

    return _fastapi_app(server, api_key=api_key, api_key_protect_all=api_key_protect_all,
                        max_request_body_size=max_request_body_size, allowed_origins=allowed_origins,
                        allowed_methods=allowed_methods, allowed_headers=allowed_headers,
                        allow_credentials=allow_credentials)


def _serving_metrics(engine: LLMEngine, info, metrics_prefix: str) -> ServingMetrics:
    """The app's ``ServingMetrics`` for the model ``info`` (``model_info_from_engine``); a core in another process
    hands it each of its steps' stats."""
    # One of several API servers over one engine process: metrics of every process (serving.multiprocess_metrics).
    metrics = ServingMetrics(info.served_model_name, max_model_len=info.max_model_len, prefix=metrics_prefix,
                             cache_config=cache_config_labels(engine.engine_args),
                             multiprocess=engine.shared_engine_process)
    if not engine.core_in_process:  # before the engine thread starts; a core in-process is read after each step
        engine.set_step_stats_callback(metrics.update_engine_stats)
    return metrics


def _lora_registry(engine: LLMEngine, info, lora_modules: Sequence[LoRAModulePath]) -> LoRARegistry | None:
    """The adapters served by name (``lora_modules`` loaded into ``engine`` now, before its thread starts), or None
    when the engine runs without LoRA and none is given."""
    if not (getattr(engine.engine_args, "enable_lora", False) or lora_modules):
        return None
    loras = LoRARegistry(info.served_model_names)
    loras.add_static(engine, list(lora_modules))  # before the engine thread starts: called directly
    return loras


def mounted_routers() -> list:
    """The app's routers: the OpenAI (pooling included) and system routes, plus the switched ones (run-time LoRA updates with
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, the RL routes with ``VLLM_SERVER_DEV_MODE``)."""
    routers = [module.router for module in (system, tokenize, completions, chat, responses, pooling)]
    if runtime_lora_updating_allowed():
        routers.append(lora.router)
    if rl.server_dev_mode():
        routers.append(rl.router)
    return routers


def _fastapi_app(server: OpenAIServer, *, api_key: str | None, api_key_protect_all: bool,
                 max_request_body_size: int | None, allowed_origins: Sequence[str], allowed_methods: Sequence[str],
                 allowed_headers: Sequence[str], allow_credentials: bool) -> FastAPI:
    """The FastAPI app over ``server`` (``app.state.server``): the middleware (CORS outermost, then the API key
    check, then the body size limit; see the module docstring), the error handlers and the routers."""
    # The engine thread's life is not tied to the ASGI lifespan: test clients run a lifespan per request, and the
    # process owner (serving.cli.serve_main, a test fixture) calls ``app.state.server.engine.shutdown()`` at the end.
    app = FastAPI(title="paged-jax OpenAI-compatible server", version="0.1.0")
    app.state.server = server
    app.state.response_store = ResponseStore()  # the Responses API's stored responses (serving.routes.responses)
    if max_request_body_size is not None:
        app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_size)
    if api_key:  # outside the size limit: an unauthorized body is refused before it is read
        app.add_middleware(APIKeyMiddleware, api_key=api_key, protect_all=api_key_protect_all)
    # Added last, so outermost: preflight requests and 401 answers get the CORS headers too.
    app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=list(allowed_methods),
                       allow_headers=list(allowed_headers), allow_credentials=allow_credentials)
    add_error_handlers(app)
    routers = mounted_routers()
    app.state.route_methods = {}  # {path: every method some route serves there}: the Allow header of a 405
    for router in routers:
        app.include_router(router)
        for route in router.routes:
            app.state.route_methods.setdefault(route.path, set()).update(route.methods)
    return app
