"""``paged-jax serve [MODEL]`` / ``python -m serving [MODEL]``: the OpenAI-compatible server, with vLLM's flag names
and meanings (the ``paged-jax`` command itself is ``serving.commands.main``).

    paged-jax serve [MODEL] [flags]          OpenAI-compatible server (``serve_main``)
    paged-jax generate --prompt TEXT ...     offline generation (``paged_jax.entrypoints.cli.generate_main``)
    paged-jax run-batch -i IN -o OUT ...     an OpenAI batch file offline (``serving.run_batch.run_batch_main``)
    paged-jax bench {serve,throughput,latency} ...   vLLM's benchmarks (``serving.bench``)

MODEL is an HF checkpoint directory or Hub repo id; omitted, the built-in SmolLM2-135M-Instruct is served. Engine
flags are ``paged_jax.entrypoints.cli.add_engine_args``'s (one per ``EngineArgs`` field, as ``generate`` has them); the server
flags (``build_parser``) are vLLM's frontend flags: ``--host`` (default: every interface), ``--port``, ``--api-key``
(or env ``PAGED_JAX_API_KEY``), CORS (``--allowed-origins/--allowed-methods/--allowed-headers`` as JSON lists,
``--allow-credentials``), ``--root-path``, TLS (``--ssl-keyfile/--ssl-certfile/--ssl-ca-certs/--ssl-cert-reqs``),
``--enable-log-requests`` (``--disable-log-requests``, vLLM's older spelling, keeps them off), ``--max-log-len``,
``--uvicorn-log-level``, ``--disable-uvicorn-access-log``, ``--shutdown-timeout`` (``serving.lifecycle``); and ours:
``--max-waiting-requests``, ``--max-seqs-per-request``, ``--max-request-body-size``, ``--api-key-protect-all``,
``--engine-process``, ``--max-logprobs``, ``--chat-template``, ``--response-role``, ``--metrics-prefix``;
``--api-server-count`` (vLLM's: several API server processes over one engine process, ``serving.api_servers``);
``--lora-modules`` (vLLM's). The server exits with status 1 when the engine dies (so an orchestrator restarts it).
Flags may be spelled with underscores (``--max_model_len``), as vLLM allows; any other flag is refused (exit status 2,
"unrecognized arguments: --flag"), never ignored.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import signal
import socket
import ssl
import sys
from typing import Sequence

from paged_jax.entrypoints.cli import add_engine_args, normalize_flag_spelling
from paged_jax.sampling_params import MAX_LOGPROBS
from serving.api_servers import api_server_count_error, serve_api_servers
from serving.harmony import check_parsers
from serving.lora import parse_lora_module
from serving.metrics import NATIVE_PREFIX, VLLM_PREFIX, check_prefix
from serving.reasoning_parsers import REASONING_PARSERS
from serving.request_limits import DEFAULT_MAX_REQUEST_BODY_SIZE
from serving.server_logs import quiet_library_loggers
from serving.tool_parsers import TOOL_PARSERS
from serving.settings import app_kwargs, engine_args_from_namespace, server_settings, uvicorn_config

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def json_string_list(flag: str):
    """argparse type of vLLM's JSON-list flags (``--allowed-origins '["https://a.example"]'``)."""

    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON list of strings, e.g. '[\"*\"]' ({exc})")
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON list of strings, got {text!r}")
        return value

    return parse


def build_parser(prog: str = "paged-jax serve") -> argparse.ArgumentParser:
    """The full ``serve`` argument parser: MODEL, the server flags (one group, vLLM's frontend flags and ours) and the
    engine flags (``paged_jax.entrypoints.cli.add_engine_args``)."""
    # allow_abbrev=False: a vLLM flag we lack must not be taken as a longer flag of ours it happens to prefix.
    parser = argparse.ArgumentParser(prog=prog, description="OpenAI-compatible server for paged-jax.",
                                     allow_abbrev=False)
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="HF checkpoint directory or Hub repo id (default: the built-in SmolLM2-135M-Instruct); "
                             "or --model")
    server = parser.add_argument_group("server (vLLM's frontend flags)")
    _add_http_args(server)
    _add_logging_args(server)
    _add_limit_args(server)
    _add_openai_args(server)
    add_engine_args(parser.add_argument_group("engine (EngineArgs, vLLM names)"))
    return parser


def _add_http_args(group) -> None:
    """Where and how the server listens: address, API key, CORS, root path, TLS."""
    group.add_argument("--host", default=None, help="address to bind (default: every interface, as vLLM)")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--api-key", default=os.environ.get("PAGED_JAX_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1 routes (env PAGED_JAX_API_KEY)")
    group.add_argument("--api-key-protect-all", action="store_true",
                       help="with --api-key, also require the key on /tokenize, /detokenize and /metrics (vLLM's "
                            "--api-key covers the /v1 routes only; /health always stays open)")
    group.add_argument("--allowed-origins", type=json_string_list("--allowed-origins"), default=["*"],
                       help="CORS allowed origins, a JSON list (default [\"*\"])")
    group.add_argument("--allowed-methods", type=json_string_list("--allowed-methods"), default=["*"],
                       help="CORS allowed methods, a JSON list (default [\"*\"])")
    group.add_argument("--allowed-headers", type=json_string_list("--allowed-headers"), default=["*"],
                       help="CORS allowed headers, a JSON list (default [\"*\"])")
    group.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    group.add_argument("--root-path", default=None,
                       help="root path when the app is behind a path-based routing proxy (which strips it)")
    group.add_argument("--ssl-keyfile", default=None, help="TLS private key file (serve HTTPS)")
    group.add_argument("--ssl-certfile", default=None, help="TLS certificate file (serve HTTPS)")
    group.add_argument("--ssl-ca-certs", default=None, help="CA certificates file (client certificates)")
    group.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE),
                       help="whether a client certificate is required (the ssl module's CERT_* value)")


def _add_logging_args(group) -> None:
    """Request and uvicorn log lines."""
    group.add_argument("--enable-log-requests", action="store_true", default=None,
                       help="log one line per request (its id, sampling params and prompt token ids)")
    group.add_argument("--disable-log-requests", action="store_true", default=None,
                       help="do not log requests (vLLM's older flag; the default)")
    group.add_argument("--max-log-len", type=int, default=None,
                       help="most prompt token ids (or characters) a request's log line shows (default: all)")
    group.add_argument("--disable-uvicorn-access-log", action="store_true", help="no uvicorn access log lines")
    group.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"])


def _add_limit_args(group) -> None:
    """Admission limits, shutdown, API server processes and where the engine runs."""
    group.add_argument("--max-waiting-requests", type=int, default=None,
                       help="bound on queued sequences (a request counts best_of, else n, per prompt); beyond it "
                            "the server answers 503 with Retry-After, and 400 to a request that alone exceeds it")
    group.add_argument("--max-seqs-per-request", type=int, default=None,
                       help="most sequences one request may run (its prompts x best_of, else n or the beam width); "
                            "more is answered 400 naming the field (default: half the engine's --max-num-seqs, so one request leaves seats for others)")
    group.add_argument("--max-request-body-size", type=int, default=DEFAULT_MAX_REQUEST_BODY_SIZE,
                       help=f"most bytes a request body may have; more is answered 413 "
                            f"(default {DEFAULT_MAX_REQUEST_BODY_SIZE})")
    group.add_argument("--shutdown-timeout", type=float, default=0.0,
                       help="on SIGTERM / SIGINT, seconds running requests may take to finish before they are "
                            "ended with an error (vLLM's flag; default 0: at once)")
    group.add_argument("--api-server-count", "-asc", type=int, default=1,
                       help="API server processes (vLLM's flag): each runs the app on the one listening socket "
                            "(the kernel spreads connections over them) in front of the one engine process, so "
                            "HTTP, SSE and per-stream work use several cores (default 1)")
    group.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                       help="run the engine in its own process, apart from the HTTP event loop (no shared GIL); "
                            "default on (--no-engine-process or PAGED_JAX_ENGINE_PROCESS=0: a thread instead)")


def _add_openai_args(group) -> None:
    """The OpenAI API's behaviour: logprobs, chat template and role, LoRA adapters, metric names, tool calls and
    reasoning."""
    group.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS,
                       help=f"most log-probabilities a request may ask for per token (logprobs / top_logprobs; "
                            f"at most {MAX_LOGPROBS}); more is answered 400")
    group.add_argument("--chat-template", default=None,
                       help="chat template replacing the tokenizer's: a file path, or the template itself inline")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="render a request's own chat_template (a Jinja program, run at no bounded cost); "
                            "without it such a request is answered 400 (vLLM's flag and default)")
    group.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="usage reports prompt_tokens_details.cached_tokens: the prompt tokens served from the "
                            "prefix cache (vLLM's flag)")
    group.add_argument("--response-role", default="assistant",
                       help="role of the chat replies when the request has add_generation_prompt=true")
    group.add_argument("--lora-modules", type=parse_lora_module, nargs="+", default=[],
                       help="LoRA adapters to serve (needs --enable-lora): name=path or a JSON object "
                            "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; requests pick one by model")
    group.add_argument("--metrics-prefix", default=NATIVE_PREFIX,
                       help=f"prefix of the /metrics names (default {NATIVE_PREFIX}: {NATIVE_PREFIX}:<vLLM's name>); "
                            f"'{VLLM_PREFIX}' exports vLLM's own names, so vLLM dashboards and alerts work unchanged")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='tool_choice "auto": the model decides when to call tools; needs --tool-call-parser')
    group.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="how tool calls are read from replies: hermes (Qwen2/2.5/3, Hermes), llama3_json "
                            "(Llama 3.x), mistral, openai (gpt-oss's harmony format; needs the gpt-oss extra)")
    group.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                       help="split <think>...</think> into reasoning_content: qwen3, deepseek_r1; openai_gptoss: "
                            "gpt-oss's analysis channel (harmony format; needs the gpt-oss extra)")


def parse_serve_args(argv: Sequence[str], prog: str = "paged-jax serve") -> tuple[argparse.ArgumentParser,
                                                                                   argparse.Namespace]:
    """Parse ``serve``'s arguments (exits with status 2 naming any flag it does not know, as argparse does)."""
    parser = build_parser(prog)
    args = parser.parse_args(normalize_flag_spelling(argv))
    if args.enable_log_requests and args.disable_log_requests:
        parser.error("--enable-log-requests and --disable-log-requests contradict each other")
    if args.max_log_len is not None and args.max_log_len < 0:
        parser.error(f"--max-log-len must be >= 0, got {args.max_log_len}")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    try:
        check_parsers(REASONING_PARSERS.get(args.reasoning_parser), TOOL_PARSERS.get(args.tool_call_parser))
    except ValueError as exc:
        parser.error(str(exc))
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        parser.error("--ssl-keyfile and --ssl-certfile go together (HTTPS needs both)")
    try:
        check_prefix(args.metrics_prefix)
    except ValueError as exc:
        parser.error(f"--metrics-prefix: {exc}")
    for flag, value in (("--max-seqs-per-request", args.max_seqs_per_request),
                        ("--max-request-body-size", args.max_request_body_size)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.shutdown_timeout < 0:
        parser.error(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.api_key_protect_all and not args.api_key:
        parser.error("--api-key-protect-all needs --api-key")
    error = api_server_count_error(args)
    if error:
        parser.error(error)
    return parser, args


def build_app_from_args(args: argparse.Namespace):
    """Load the engine and build the app (no server started): returns ``(app, engine_args)``."""
    from paged_jax.engine.llm_engine import LLMEngine
    from serving.app import create_app
    from serving.engine_process import engine_process_enabled, start_engine_process

    engine_args, chat_template = server_settings(args)
    if engine_process_enabled(args.engine_process):
        engine = start_engine_process(engine_args)  # the core loads the model and compiles in its process
    else:
        engine = LLMEngine(engine_args)
    return create_app(engine, **app_kwargs(args, engine_args, chat_template)), engine_args


def bind_socket(host: str | None, port: int) -> socket.socket:
    """The listening socket, bound before the engine loads (as vLLM does): a port in use fails at once, not after
    minutes of loading and compiling. ``host`` None or "" = every IPv4 interface."""
    family = socket.AF_INET6 if host and ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host or "", port))
    return sock


def serve_main(argv: Sequence[str] | None = None, prog: str = "paged-jax serve") -> int:
    """Run the server until interrupted (SIGTERM / SIGINT: drained for ``--shutdown-timeout``) or until the engine
    dies.

    Args:
      argv: the arguments after ``serve`` (``paged-jax serve``) or after ``-m serving``; None = ``sys.argv[1:]``.
    Returns:
      The exit status: 0 after a shutdown, 1 when the engine died.
    """
    parser, args = parse_serve_args(list(sys.argv[1:] if argv is None else argv), prog)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    quiet_library_loggers()
    if args.node_rank > 0:  # multi-host: node 0 serves HTTP and schedules, this node runs the same steps
        from paged_jax.parallel.follower import run_follower

        try:
            return run_follower(engine_args_from_namespace(args))
        except ValueError as exc:
            parser.error(str(exc))
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        parser.error(f"cannot listen on {args.host or '0.0.0.0'}:{args.port} (--host/--port): {exc}")
    if args.api_server_count > 1:
        return serve_api_servers(parser, args, sock)
    from serving.async_engine import EngineDeadError

    # SIGTERM while the engine loads or compiles ends the start as Ctrl-C does (KeyboardInterrupt): the interpreter
    # then exits normally, and multiprocessing's exit handler terminates the engine process (a daemon child) instead
    # of leaving it compiling without a parent. The server's own handlers (serving.lifecycle) take over afterwards.
    previous_sigterm = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        app, _ = build_app_from_args(args)
    except ValueError as exc:
        sock.close()
        parser.error(str(exc))
    except EngineDeadError as exc:  # e.g. a multi-host node died while the engine process was starting
        sock.close()
        logging.getLogger(__name__).error("the engine did not start: %s", exc)
        return 1
    except KeyboardInterrupt:
        sock.close()
        _stop_child_processes()
        logging.getLogger(__name__).info("interrupted during start-up; the engine process is stopped")
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
    from serving.lifecycle import ServingServer

    scheme = "https" if args.ssl_certfile else "http"
    logging.getLogger(__name__).info("Starting the API server on %s://%s:%d%s", scheme, args.host or "0.0.0.0",
                                     sock.getsockname()[1], args.root_path or "")
    server = ServingServer(uvicorn_config(app, args), app.state.server.engine, args.shutdown_timeout)
    return server.serve_on_socket(sock)


def _stop_child_processes(grace_s: float = 2.0) -> None:
    """SIGTERM every multiprocessing child still running (the engine process mid start-up), SIGKILL after
    ``grace_s`` what has not exited."""
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(grace_s)
        if child.is_alive():
            child.kill()
            child.join()
