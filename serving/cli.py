"""``paged-jax serve [MODEL]`` / ``python -m serving [MODEL]``: the OpenAI-compatible server, with vLLM's flag names.

MODEL is an HF checkpoint directory; omitted, the built-in SmolLM2-135M-Instruct is served. Engine flags map one to
one onto ``paged_jax.config.EngineArgs``; server flags are ``--host``, ``--port``, ``--served-model-name``,
``--api-key`` (or env ``PAGED_JAX_API_KEY``), ``--max-waiting-requests`` and ``--uvicorn-log-level``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Sequence

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def build_parser(prog: str = "paged-jax serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="OpenAI-compatible server for paged-jax.")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="HF checkpoint directory (default: the built-in SmolLM2-135M-Instruct)")
    parser.add_argument("--model", default=None, help="same as the positional MODEL")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--served-model-name", default=None,
                        help="model id clients use (default: the model directory's name)")
    server.add_argument("--api-key", default=os.environ.get("PAGED_JAX_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 routes (env PAGED_JAX_API_KEY)")
    server.add_argument("--max-waiting-requests", type=int, default=None,
                        help="bound on queued requests; beyond it the server answers 503 with Retry-After")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    engine = parser.add_argument_group("engine (as vLLM)")
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=None)
    engine.add_argument("--max-num-batched-tokens", type=int, default=None)
    engine.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32, 64, 128])
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--num-gpu-blocks-override", type=int, default=None)
    engine.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    engine.add_argument("--swap-space", type=float, default=4.0, help="GiB of host memory for swapped-out KV")
    engine.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    engine.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    engine.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32", "half",
                                                            "float"])
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    engine.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                        help="run the engine in its own process, apart from the HTTP event loop (no shared GIL); "
                             "default on (--no-engine-process or PAGED_JAX_ENGINE_PROCESS=0: a thread instead)")
    engine.add_argument("--async-scheduling", action="store_true",
                        help="build and dispatch the next step while the current one runs on the device")
    engine.add_argument("--weight-cache", action=argparse.BooleanOptionalAction, default=True,
                        help="restore converted weights from / save them to the cache (models.weight_cache)")
    engine.add_argument("--disable-log-stats", action="store_true")
    return parser


def engine_args_from_namespace(args: argparse.Namespace):
    """``EngineArgs`` from parsed flags (raises ValueError naming the bad field)."""
    from paged_jax.config import EngineArgs

    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"model given twice: positional {args.model_tag!r} and --model {args.model!r}")
    return EngineArgs(
        model=args.model_tag or args.model,
        tokenizer=args.tokenizer,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        load_format=args.load_format,
        seed=args.seed,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        enable_prefix_caching=args.enable_prefix_caching,
        swap_space=args.swap_space,
        preemption_mode=args.preemption_mode,
        scheduling_policy=args.scheduling_policy,
        tensor_parallel_size=args.tensor_parallel_size,
        disable_log_stats=args.disable_log_stats,
        async_scheduling=args.async_scheduling,
        weight_cache=args.weight_cache,
    )


def served_model_name(engine_args) -> str:
    """``--served-model-name``, else the model directory's name, else the built-in model's name."""
    if engine_args.served_model_name:
        return engine_args.served_model_name
    if engine_args.model:
        return os.path.basename(os.path.normpath(str(engine_args.model)))
    return DEFAULT_MODEL_NAME


def build_app_from_args(args: argparse.Namespace):
    """Load the engine and build the app (no server started): returns ``(app, engine_args)``."""
    from paged_jax.engine import LLMEngine
    from serving.app import create_app
    from serving.engine_process import EngineProcessClient, engine_process_enabled

    engine_args = engine_args_from_namespace(args)
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise ValueError(f"max_waiting_requests must be >= 1, got {args.max_waiting_requests}")
    if engine_process_enabled(args.engine_process):
        engine = EngineProcessClient(engine_args)  # loads the model and compiles in the child
    else:
        engine = LLMEngine(engine_args)
    app = create_app(engine, served_model_name=served_model_name(engine_args), api_key=args.api_key,
                     max_waiting_requests=args.max_waiting_requests)
    return app, engine_args


def main(argv: Sequence[str] | None = None, prog: str = "paged-jax serve") -> int:
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
