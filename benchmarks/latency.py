"""End-to-end latency of one batch through the offline engine, as vLLM's ``vllm bench latency``.

    paged-jax bench latency [--input-len 32] [--output-len 128] [--batch-size 8] [--num-iters-warmup 10]
                            [--num-iters 30] [--output-json FILE] [engine flags, e.g. --model DIR --max-model-len 512]

Each iteration generates ``--batch-size`` random token-id prompts of ``--input-len`` tokens for ``--output-len``
tokens each (``ignore_eos``: the work is fixed), through ``paged_jax.LLM``; ``--num-iters-warmup`` untimed
iterations come first. Prints vLLM's lines (``Avg latency: X seconds`` and the 10/25/50/75/90/99th percentiles)
and writes vLLM's JSON (``avg_latency``, ``latencies``, ``percentiles``) to ``--output-json``. The engine compiles
every step shape at start-up, before the first iteration.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import numpy as np

from benchmarks.report import write_json
from paged_jax.entrypoints.cli import add_engine_args, engine_kwargs, normalize_flag_spelling

PERCENTILES = (10, 25, 50, 75, 90, 99)


def build_parser(prog: str = "paged-jax bench latency") -> argparse.ArgumentParser:
    """vLLM's ``bench latency`` flags and the engine flags (one per ``EngineArgs`` field)."""
    parser = argparse.ArgumentParser(prog=prog, description="Latency of one batch of requests (vLLM's bench latency).",
                                     allow_abbrev=False)
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens of each request")
    parser.add_argument("--output-len", type=int, default=128, help="tokens each request generates")
    parser.add_argument("--batch-size", type=int, default=8, help="requests in the batch")
    parser.add_argument("--n", type=int, default=1, help="sequences per request")
    parser.add_argument("--num-iters-warmup", type=int, default=10, help="untimed iterations first")
    parser.add_argument("--num-iters", type=int, default=30, help="timed iterations")
    parser.add_argument("--output-json", default=None, help="write the latencies as JSON here")
    add_engine_args(parser.add_argument_group("engine (EngineArgs, vLLM names)"))
    return parser


def latency_summary(latencies: Sequence[float]) -> dict:
    """vLLM's result: ``avg_latency`` (s), every iteration's latency and the percentiles (keys "10" ... "99")."""
    percentiles = np.percentile(latencies, PERCENTILES)
    return {"avg_latency": statistics.fmean(latencies), "latencies": list(latencies),
            "percentiles": {str(p): float(v) for p, v in zip(PERCENTILES, percentiles)}}


def main(argv: Sequence[str] | None = None, prog: str = "paged-jax bench latency") -> dict:
    """Run the benchmark; returns the JSON result (also printed as vLLM's lines)."""
    from paged_jax import LLM, SamplingParams

    parser = build_parser(prog)
    args = parser.parse_args(normalize_flag_spelling(list(sys.argv[1:] if argv is None else argv)))
    for flag, value, least in (("--input-len", args.input_len, 1), ("--output-len", args.output_len, 1),
                               ("--batch-size", args.batch_size, 1), ("--n", args.n, 1),
                               ("--num-iters-warmup", args.num_iters_warmup, 0), ("--num-iters", args.num_iters, 1)):
        if value < least:
            parser.error(f"{flag} must be >= {least}, got {value}")
    try:
        llm = LLM(**engine_kwargs(args), use_tqdm=False)
    except ValueError as exc:
        parser.error(str(exc))
    rng = np.random.default_rng(0)
    vocab = min(llm.llm_engine.vocab_size, 10000)  # ids every tokenizer decodes; no tokenizer needed
    prompts = [{"prompt_token_ids": rng.integers(0, vocab, args.input_len).tolist()} for _ in range(args.batch_size)]
    params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)

    def one_batch() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in range(args.num_iters_warmup):
        one_batch()
    result = latency_summary([one_batch() for _ in range(args.num_iters)])
    print(f"Avg latency: {result['avg_latency']} seconds")
    for percentile, value in result["percentiles"].items():
        print(f"{percentile}% percentile latency: {value} seconds")
    write_json(args.output_json, result, indent=4)
    return result


if __name__ == "__main__":
    main()
