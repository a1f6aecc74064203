"""``paged-jax bench {serve,throughput,latency}``: vLLM's ``vllm bench`` commands, with vLLM's flags and output, on
the benchmarks of ``benchmarks/`` (one home per benchmark; this module only speaks vLLM's flags to them).

    paged-jax bench latency [--input-len N] [--output-len N] [--batch-size B] [--num-iters-warmup W] [--num-iters I]
                            [--output-json FILE] [engine flags]                  (``benchmarks.latency``)
    paged-jax bench throughput [--input-len N] [--output-len N] [--num-prompts P] [--dataset-name random]
                               [--output-json FILE] [engine flags]               (``benchmarks.throughput``)
    paged-jax bench serve [--backend openai] [--base-url URL | --host H --port P] [--endpoint /v1/completions]
                          [--model M] [--dataset-name random] [--random-input-len N] [--random-output-len N]
                          [--num-prompts P] [--request-rate R] [--max-concurrency C]
                          [--save-result [--result-dir D] [--result-filename F]]  (``benchmarks.serving``)

Prompts are random token ids (vLLM's ``random`` dataset; the only one here) and every request generates exactly its
output length (EOS ignored). A flag of vLLM's that is not listed by ``--help`` is refused with status 2, naming it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
from collections.abc import Sequence

from benchmarks import latency as latency_benchmark
from benchmarks import serving as serving_benchmark
from benchmarks import throughput as throughput_benchmark
from benchmarks.report import write_json
from paged_jax.entrypoints.cli import normalize_flag_spelling

USAGE = """usage: paged-jax bench {serve,throughput,latency} ...

commands (vLLM's `vllm bench`; `paged-jax bench COMMAND --help` for flags):
  serve        load an OpenAI-compatible server: TTFT, TPOT, ITL (mean / median / p99) and throughput
  throughput   offline engine throughput on random prompts: requests/s and tokens/s
  latency      offline latency of one batch over several iterations: average and percentiles
"""

# Engine flags benchmarks/throughput.py takes (its own parser), forwarded as given.
_THROUGHPUT_ENGINE_FLAGS = {
    "--model": str, "--load-format": str, "--max-num-seqs": int, "--max-num-batched-tokens": int,
    "--max-model-len": int, "--block-size": int, "--gpu-memory-utilization": float, "--attention-impl": str,
    "--quantization": str, "--kv-cache-dtype": str, "--tensor-parallel-size": int, "--pipeline-parallel-size": int,
    "--data-parallel-size": int,
}


def _parse_refusing_unknown(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv``; a flag the parser lacks (e.g. one of vLLM's not implemented here) exits with status 2 naming
    it."""
    args, unknown = parser.parse_known_args(normalize_flag_spelling(argv))
    if unknown:
        parser.error(f"{unknown[0]} is not implemented by {parser.prog} (its flags: {parser.prog} --help)")
    return args


def build_throughput_parser(prog: str = "paged-jax bench throughput") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, allow_abbrev=False,
                                     description="Offline throughput (vLLM's bench throughput).")
    parser.add_argument("--dataset-name", default="random", choices=["random"],
                        help="random token-id prompts (the only dataset here)")
    parser.add_argument("--input-len", type=int, default=1024, help="prompt tokens of each request")
    parser.add_argument("--output-len", type=int, default=128, help="tokens each request generates")
    parser.add_argument("--num-prompts", type=int, default=1000, help="requests, all submitted at once")
    parser.add_argument("--output-json", default=None, help="write the result as JSON here")
    engine = parser.add_argument_group("engine (default model: the built-in SmolLM2-135M-Instruct)")
    for flag, kind in _THROUGHPUT_ENGINE_FLAGS.items():
        engine.add_argument(flag, type=kind, default=None,
                            help="default: --input-len + --output-len" if flag == "--max-model-len" else None)
    engine.add_argument("--dtype", default="auto", help="auto (bfloat16 on GPU, float32 on CPU), bfloat16, ...")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    engine.add_argument("--async-scheduling", action="store_true")
    return parser


def throughput_main(argv: Sequence[str]) -> dict:
    """``paged-jax bench throughput``: prints vLLM's ``Throughput: ...`` line; ``--output-json`` gets vLLM's keys."""
    from models.smollm2 import ensure_smollm2

    parser = build_throughput_parser()
    args = _parse_refusing_unknown(parser, argv)
    forwarded = ["--workload", "random", "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
                 "--output-len", str(args.output_len), "--dtype", args.dtype]
    if args.model is None:
        forwarded += ["--model", str(ensure_smollm2())]
    if args.max_model_len is None:  # what the workload needs: a smaller KV pool on the CPU, narrower block tables
        args.max_model_len = args.input_len + args.output_len
    for flag in _THROUGHPUT_ENGINE_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            forwarded += [flag, str(value)]
    forwarded += [] if args.enable_prefix_caching else ["--no-enable-prefix-caching"]
    forwarded += ["--async-scheduling"] if args.async_scheduling else []
    with contextlib.redirect_stdout(io.StringIO()):  # its own JSON report; vLLM's lines are printed below
        result = throughput_benchmark.main(forwarded)
    total_tokens = result["prompt_tokens"] + result["output_tokens"]
    print(f"Throughput: {result['requests_per_s']:.2f} requests/s, {result['total_tok_s']:.2f} total tokens/s, "
          f"{result['output_tok_s']:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {result['prompt_tokens']}")
    print(f"Total num output tokens:  {result['output_tokens']}")
    summary = {"elapsed_time": result["elapsed_s"], "num_requests": result["num_requests"],
               "total_num_tokens": total_tokens, "requests_per_second": result["requests_per_s"],
               "tokens_per_second": result["total_tok_s"], "output_tokens_per_second": result["output_tok_s"]}
    write_json(args.output_json, summary, indent=4)
    return summary


def build_serve_parser(prog: str = "paged-jax bench serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, allow_abbrev=False,
                                     description="Load an OpenAI-compatible server (vLLM's bench serve).")
    parser.add_argument("--backend", default="openai", choices=["openai", "vllm"],
                        help="streamed /v1/completions requests (vLLM's openai and vllm backends)")
    parser.add_argument("--base-url", default=None, help="server URL (default: http://HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions"])
    parser.add_argument("--model", default=None, help="model name sent (default: the first of GET /v1/models)")
    parser.add_argument("--dataset-name", default="random", choices=["random"],
                        help="random token-id prompts (the only dataset here)")
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf: all at once")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals; 1: Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--num-warmups", type=int, default=1, help="warm-up requests before the timed run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=None, help="default: 1.0 (vLLM's random dataset)")
    parser.add_argument("--save-result", action="store_true", help="write the metrics as JSON")
    parser.add_argument("--result-dir", default=None, help="directory of the JSON (default: the current one)")
    parser.add_argument("--result-filename", default=None,
                        help="name of the JSON (default: {backend}-{request_rate}qps-{model}-{date}.json)")
    return parser


def serve_result_path(args: argparse.Namespace, model: str) -> str | None:
    """Where ``--save-result`` writes, as vLLM names it; None without ``--save-result``."""
    if not args.save_result:
        return None
    name = args.result_filename or (f"{args.backend}-{args.request_rate}qps-{os.path.basename(model.rstrip('/'))}-"
                                    f"{time.strftime('%Y%m%d-%H%M%S')}.json")
    return os.path.join(args.result_dir or ".", name)


def serve_main(argv: Sequence[str]) -> dict:
    """``paged-jax bench serve``: vLLM's result table (TTFT, TPOT, ITL, E2E mean / median / p90 / p99)."""
    parser = build_serve_parser()
    args = _parse_refusing_unknown(parser, argv)
    if (args.result_dir or args.result_filename) and not args.save_result:
        parser.error("--result-dir and --result-filename need --save-result")
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    model = args.model or serving_benchmark.first_served_model(base_url, os.environ.get("OPENAI_API_KEY"))
    forwarded = ["--base-url", base_url, "--endpoint", args.endpoint, "--model", model, "--dataset", "random",
                 "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.random_input_len),
                 "--random-output-len", str(args.random_output_len), "--request-rate", str(args.request_rate),
                 "--burstiness", str(args.burstiness), "--num-warmup", str(args.num_warmups),
                 "--seed", str(args.seed)]
    for flag, value in (("--max-concurrency", args.max_concurrency), ("--temperature", args.temperature),
                        ("--result-file", serve_result_path(args, model))):
        forwarded += [flag, str(value)] if value is not None else []
    return serving_benchmark.main(forwarded)


def bench_main(argv: Sequence[str]) -> int:
    """``paged-jax bench COMMAND ...``: returns the exit status."""
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "latency":
        latency_benchmark.main(rest)
    elif command == "throughput":
        throughput_main(rest)
    elif command == "serve":
        serve_main(rest)
    else:
        sys.stderr.write(USAGE + f"paged-jax bench: unknown command {command!r}\n")
        return 2
    return 0

