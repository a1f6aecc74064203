"""The fairness bar (issue 53) in seconds: an ordinary request's time to first token, alone and beside the heaviest
request the server's default limits allow (``serving.request_limits.default_max_seqs_per_request`` sequences, each
as long as the context: long prompts, or short prompts with long outputs), on one engine.

The ordinary request (16 prompt tokens, one output token) is added one step after the heavy request, at a step
boundary; its time to first token runs from ``add_request`` to the step output that carries its token. A server
adds to it the rest of whatever step is in flight when the request arrives: ``heavy_step_s`` is that step's
median length. Every run uses fresh random prompts (no prefix hit), the heavy request is aborted after the ordinary
one's token, and the prefix cache is reset between runs.

Examples:
  python -m benchmarks.fairness --shape llama-3.1-8b --out $OUT/fairness.json
  python -m benchmarks.fairness --shape llama-3.1-8b --long-prefill-token-threshold 0 --heavy-seqs 256  # no policy
CPU smoke test: python -m benchmarks.fairness --shape smollm2-135m --dtype float32 --max-model-len 256 \
  --max-num-seqs 8 --max-num-batched-tokens 64 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from benchmarks.report import versions, write_json

ORDINARY_PROMPT_LEN = 16


def _first_token_seconds(engine, rng: random.Random, vocab: int) -> tuple[float, int]:
    """Add an ordinary request and step until its first token; -> (seconds, steps)."""
    from paged_jax import SamplingParams

    request_id = f"ordinary-{rng.random()}"
    prompt = [rng.randrange(1, vocab) for _ in range(ORDINARY_PROMPT_LEN)]
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    steps = 0
    while True:
        steps += 1
        if any(o.request_id == request_id and o.outputs[0].token_ids for o in engine.step()):
            return time.perf_counter() - start, steps


def _loaded_run(engine, rng: random.Random, vocab: int, num_seqs: int, prompt_len: int,
                max_tokens: int) -> tuple[float, int, float]:
    """The heavy request's sequences, one step, then the ordinary request; -> (seconds, steps, heavy step s)."""
    from paged_jax import SamplingParams

    heavy_ids = [f"heavy-{rng.random()}" for _ in range(num_seqs)]
    for request_id in heavy_ids:
        engine.add_request(request_id, [rng.randrange(1, vocab) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    step_start = time.perf_counter()
    engine.step()
    heavy_step_s = time.perf_counter() - step_start
    seconds, steps = _first_token_seconds(engine, rng, vocab)
    engine.abort_request(heavy_ids)
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()
    return seconds, steps, heavy_step_s


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", required=True, help="named shape with dummy weights (models/presets.py)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--long-prefill-token-threshold", type=int, help="default: the engine's (4%% of max_model_len)")
    p.add_argument("--heavy-seqs", type=int, help="default: the server's --max-seqs-per-request default")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", help="write the JSON result here")
    args = p.parse_args(argv)

    from models.presets import preset_config
    from paged_jax.config import EngineArgs
    from paged_jax.engine.llm_engine import LLMEngine
    from serving.request_limits import default_max_seqs_per_request

    engine = LLMEngine(EngineArgs(model=args.shape, load_format="dummy", dtype=args.dtype,
                                  max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  long_prefill_token_threshold=args.long_prefill_token_threshold), use_tqdm=False)
    vocab = preset_config(args.shape).vocab_size
    num_seqs = args.heavy_seqs or default_max_seqs_per_request(engine)
    rng = random.Random(0)
    _loaded_run(engine, rng, vocab, num_seqs, args.max_model_len - 8, 7)  # warm-up: the steps' host state
    unloaded = [_first_token_seconds(engine, rng, vocab) for _ in range(args.repeats + 1)][1:]
    result: dict = {"shape": args.shape, "heavy_seqs": num_seqs, "versions": versions(),
                    "argv": sys.argv[1:] if argv is None else argv,
                    "long_prefill_token_threshold": engine.engine_core.scheduler.long_prefill_token_threshold,
                    "unloaded_ttft_s": statistics.median(s for s, _ in unloaded),
                    "unloaded_steps": statistics.median(n for _, n in unloaded)}
    shapes = {"long_prompts": (args.max_model_len - 8, 7), "long_outputs": (ORDINARY_PROMPT_LEN,
                                                                            args.max_model_len - 17)}
    for name, (prompt_len, max_tokens) in shapes.items():
        runs = [_loaded_run(engine, rng, vocab, num_seqs, prompt_len, max_tokens) for _ in range(args.repeats)]
        ttft = statistics.median(s for s, _, _ in runs)
        result[name] = {"ttft_s": ttft, "steps": statistics.median(n for _, n, _ in runs),
                        "heavy_step_s": statistics.median(h for _, _, h in runs),
                        "ttft_vs_unloaded": ttft / result["unloaded_ttft_s"]}
    print(json.dumps(result, indent=1))
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
