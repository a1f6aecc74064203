"""What a ``serve`` command line asks for, turned into what each part of the server is built from: the engine's
``EngineArgs`` and the loaded chat template (``server_settings``, every check made before anything loads),
``serving.app.create_app``'s keyword arguments (``app_kwargs``) and uvicorn's ``Config`` (``uvicorn_config``).
The flags are parsed by ``serving.cli``; one server (``serving.cli.serve_main``) and each of several API server
processes (``serving.api_servers``) build from these alike.
"""

from __future__ import annotations

import argparse

import uvicorn

from models.hub import check_directory_or_repo_id
from paged_jax.entrypoints.chat import load_chat_template
from paged_jax.entrypoints.cli import engine_kwargs
from paged_jax.config import EngineArgs
from paged_jax.sampling_params import MAX_LOGPROBS


def engine_args_from_namespace(args: argparse.Namespace):
    """``EngineArgs`` from parsed flags (raises ValueError naming the bad field)."""
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"model given twice: positional {args.model_tag!r} and --model {args.model!r}")
    return EngineArgs(**{**engine_kwargs(args), "model": args.model_tag or args.model})


def server_settings(args: argparse.Namespace) -> tuple:
    """``(EngineArgs, the loaded --chat-template or None)`` from the parsed flags, checked before anything loads
    (raises ValueError naming the bad flag)."""
    engine_args = engine_args_from_namespace(args)
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise ValueError(f"max_waiting_requests must be >= 1, got {args.max_waiting_requests}")
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"--max-logprobs must be in [0, {MAX_LOGPROBS}] (the engine computes at most "
                         f"{MAX_LOGPROBS} top logprobs), got {args.max_logprobs}")
    if args.lora_modules and not engine_args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    for module in args.lora_modules:
        check_directory_or_repo_id(module.path, f"--lora-modules {module.name}:")
    if engine_args.tokenizer is not None:
        check_directory_or_repo_id(engine_args.tokenizer, "--tokenizer")
    try:
        chat_template = load_chat_template(args.chat_template)
    except ValueError as exc:
        raise ValueError(f"--chat-template: {exc}") from exc
    return engine_args, chat_template


def app_kwargs(args: argparse.Namespace, engine_args, chat_template: str | None = None) -> dict:
    """``serving.app.create_app``'s keyword arguments from the parsed flags (``chat_template``: the loaded
    ``--chat-template``)."""
    return dict(served_model_name=engine_args.served_model_names or None, api_key=args.api_key,
                max_waiting_requests=args.max_waiting_requests, allowed_origins=args.allowed_origins,
                allowed_methods=args.allowed_methods, allowed_headers=args.allowed_headers,
                allow_credentials=args.allow_credentials, log_requests=bool(args.enable_log_requests),
                max_log_len=args.max_log_len, log_stats=not engine_args.disable_log_stats,
                max_logprobs=args.max_logprobs, chat_template=chat_template, response_role=args.response_role,
                metrics_prefix=args.metrics_prefix,
                api_key_protect_all=args.api_key_protect_all, max_request_body_size=args.max_request_body_size,
                max_seqs_per_request=args.max_seqs_per_request,
                enable_auto_tool_choice=args.enable_auto_tool_choice, tool_parser=args.tool_call_parser,
                reasoning_parser=args.reasoning_parser, lora_modules=args.lora_modules,
                trust_request_chat_template=args.trust_request_chat_template,
                enable_prompt_tokens_details=args.enable_prompt_tokens_details)


def uvicorn_config(app, args: argparse.Namespace):
    """The ``uvicorn.Config`` of ``app`` for the parsed flags (host, port, TLS, root path, log level, access log).
    ``--root-path`` is the ASGI root_path (FastAPI's is deprecated in its favour): the proxy strips the prefix."""
    return uvicorn.Config(app, host=args.host or "0.0.0.0", port=args.port, log_level=args.uvicorn_log_level,
                          root_path=args.root_path or "", access_log=not args.disable_uvicorn_access_log,
                          ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                          ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs)
