"""The ``paged-jax`` command, and ``paged-jax serve [MODEL]`` / ``python -m serving [MODEL]``: the OpenAI-compatible
server, with vLLM's flag names.

    paged-jax serve [MODEL] [flags]          OpenAI-compatible server (``serve_main``)
    paged-jax generate --prompt TEXT ...     offline generation (``paged_jax.cli.generate_main``)

MODEL is an HF checkpoint directory; omitted, the built-in SmolLM2-135M-Instruct is served. Engine flags are
``paged_jax.cli.add_engine_args``'s (one per ``EngineArgs`` field, as ``generate`` has them); server flags are
``--host``, ``--port``, ``--api-key`` (or env ``PAGED_JAX_API_KEY``), ``--max-waiting-requests``,
``--engine-process``, ``--max-logprobs``, ``--chat-template``, ``--response-role`` and ``--uvicorn-log-level``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Sequence

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_USAGE = "usage: paged-jax {serve,generate} ...\n"


def build_parser(prog: str = "paged-jax serve") -> argparse.ArgumentParser:
    from paged_jax.cli import add_engine_args
    from paged_jax.sampling_params import MAX_LOGPROBS

    parser = argparse.ArgumentParser(prog=prog, description="OpenAI-compatible server for paged-jax.")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="HF checkpoint directory (default: the built-in SmolLM2-135M-Instruct); or --model")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--api-key", default=os.environ.get("PAGED_JAX_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 routes (env PAGED_JAX_API_KEY)")
    server.add_argument("--max-waiting-requests", type=int, default=None,
                        help="bound on queued requests; beyond it the server answers 503 with Retry-After")
    server.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                        help="run the engine in its own process, apart from the HTTP event loop (no shared GIL); "
                             "default on (--no-engine-process or PAGED_JAX_ENGINE_PROCESS=0: a thread instead)")
    server.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS,
                        help=f"most log-probabilities a request may ask for per token (logprobs / top_logprobs; "
                             f"at most {MAX_LOGPROBS}); more is answered 400")
    server.add_argument("--chat-template", default=None,
                        help="chat template replacing the tokenizer's: a file path, or the template itself inline")
    server.add_argument("--response-role", default="assistant",
                        help="role of the chat replies when the request has add_generation_prompt=true")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    add_engine_args(parser.add_argument_group("engine (EngineArgs, vLLM names)"))
    return parser


def engine_args_from_namespace(args: argparse.Namespace):
    """``EngineArgs`` from parsed flags (raises ValueError naming the bad field)."""
    from paged_jax.cli import engine_kwargs
    from paged_jax.config import EngineArgs

    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"model given twice: positional {args.model_tag!r} and --model {args.model!r}")
    return EngineArgs(**{**engine_kwargs(args), "model": args.model_tag or args.model})


def served_model_name(engine_args) -> str:
    """``--served-model-name``, else the model directory's name, else the built-in model's name."""
    if engine_args.served_model_name:
        return engine_args.served_model_name
    if engine_args.model:
        return os.path.basename(os.path.normpath(str(engine_args.model)))
    return DEFAULT_MODEL_NAME


def build_app_from_args(args: argparse.Namespace):
    """Load the engine and build the app (no server started): returns ``(app, engine_args)``."""
    from paged_jax.chat import load_chat_template
    from paged_jax.engine import LLMEngine
    from paged_jax.sampling_params import MAX_LOGPROBS
    from serving.app import create_app
    from serving.engine_process import EngineProcessClient, engine_process_enabled

    engine_args = engine_args_from_namespace(args)
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise ValueError(f"max_waiting_requests must be >= 1, got {args.max_waiting_requests}")
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"--max-logprobs must be in [0, {MAX_LOGPROBS}] (the engine computes at most "
                         f"{MAX_LOGPROBS} top logprobs), got {args.max_logprobs}")
    try:
        chat_template = load_chat_template(args.chat_template)
    except ValueError as exc:
        raise ValueError(f"--chat-template: {exc}") from exc
    if engine_process_enabled(args.engine_process):
        engine = EngineProcessClient(engine_args)  # loads the model and compiles in the child
    else:
        engine = LLMEngine(engine_args)
    app = create_app(engine, served_model_name=served_model_name(engine_args), api_key=args.api_key,
                     max_waiting_requests=args.max_waiting_requests, max_logprobs=args.max_logprobs,
                     chat_template=chat_template, response_role=args.response_role)
    return app, engine_args


def serve_main(argv: Sequence[str] | None = None, prog: str = "paged-jax serve") -> int:
    """Run the server until interrupted.

    Args:
      argv: the arguments after ``serve`` (``paged-jax serve``) or after ``-m serving``; None = ``sys.argv[1:]``.
    """
    parser = build_parser(prog)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app, _ = build_app_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    import uvicorn

    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    finally:
        app.state.server.engine.shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The ``paged-jax`` console script: ``serve`` runs here, ``generate`` in ``paged_jax.cli``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(_USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return serve_main(rest, prog="paged-jax serve")
    if command == "generate":
        from paged_jax.cli import generate_main

        return generate_main(rest)
    sys.stderr.write(_USAGE + f"paged-jax: unknown command {command!r}\n")
    return 2
