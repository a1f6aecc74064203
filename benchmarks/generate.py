"""Throughput of the jittable research API ``paged_jax.research.generate`` (one jitted prefill + decode loop per call).

Example (on the H200, dummy weights in real shapes):
  python -m benchmarks.generate --out $OUT/generate.json
  python -m benchmarks.generate --shapes qwen3-0.6b --batch-sizes 1 32 256 --prompt-len 128 --max-new-tokens 128

For every (shape, batch size): random prompts of ``--prompt-len`` tokens, no EOS (every row decodes exactly
``--max-new-tokens`` tokens, so the work is fixed), greedy unless ``--temperature`` > 0. Compilation is timed
separately (first call); then ``--repeats`` timed calls, each ended by ``block_until_ready``, and the median is
reported. A second program with ``max_new_tokens=1`` measures the prefill (plus one sampling step) alone, so the
decode rate is ``B * (N - 1) / (t_total - t_prefill)``. ``decode_floor_tok_s`` is the HBM-bandwidth bound of the
decode phase (every step reads the weights a decode step must read once and each row its KV context; benchmarks/floors.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from benchmarks.report import versions, write_json
from paged_jax.worker.attention_impl import ATTENTION_IMPLS, DEPRECATED_ATTENTION_IMPLS


def _timed(fn, repeats: int) -> tuple[float, list[float]]:
    """(first call seconds incl. compilation, list of the following calls' seconds); each ends on device."""
    import jax

    start = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return first, times


def decode_floor_tok_s(config, batch_size: int, prompt_len: int, max_new_tokens: int, dtype_bytes: int) -> float:
    """Output tok/s no implementation can beat in the decode phase (weights + KV context read once per step)."""
    from benchmarks.floors import H200_HBM_BYTES_PER_S, decode_weight_bytes
    from models.presets import kv_bytes_per_token

    weight_bytes = decode_weight_bytes(config, batch_size, dtype_bytes)
    steps = max(max_new_tokens - 1, 1)
    # Step i (1-based) of each row reads prompt_len + i cached tokens.
    kv_bytes = batch_size * kv_bytes_per_token(config, dtype_bytes) * sum(prompt_len + i for i in range(1, steps + 1))
    seconds = (steps * weight_bytes + kv_bytes) / H200_HBM_BYTES_PER_S
    return batch_size * steps / seconds


def bench_shape(shape: str, args) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from models.llama import fuse_projections
    from models.loader import load_model
    from models.presets import preset_config
    from paged_jax.research.generate import generate

    config = preset_config(shape)
    model, config = load_model(None, load_format="dummy", config=config, dtype=args.dtype, seed=0)
    fuse_projections(model)  # the engine's layout: one q/k/v matmul and one gate/up matmul per layer
    graphdef, state = nnx.split(model)
    dtype_bytes = jnp.dtype(model.dtype).itemsize
    results = []
    for batch_size in args.batch_sizes:
        rng = np.random.default_rng(batch_size)
        prompts = jax.device_put(
            rng.integers(10, config.vocab_size - 10, size=(batch_size, args.prompt_len)).astype(np.int32))
        lengths = jax.device_put(np.full((batch_size,), args.prompt_len, np.int32))
        key = jax.random.key(0)
        temperature = jax.device_put(np.float32(args.temperature)) if args.temperature > 0 else 0.0

        def run(max_new_tokens):
            return lambda: generate(
                (graphdef, state), prompts, lengths, max_new_tokens=max_new_tokens, rng=key,
                temperature=temperature, block_size=args.block_size, attention_impl=args.attention_impl,
            )

        compile_total, totals = _timed(run(args.max_new_tokens), args.repeats)
        compile_prefill, prefills = _timed(run(1), args.repeats)
        total_s, prefill_s = statistics.median(totals), statistics.median(prefills)
        out = run(args.max_new_tokens)()
        assert out.tokens.shape == (batch_size, args.max_new_tokens)
        assert int(jnp.min(out.lengths)) == args.max_new_tokens  # no EOS: every row did the full work
        decode_s = max(total_s - prefill_s, 1e-9)
        result = {
            "shape": shape, "batch_size": batch_size, "prompt_len": args.prompt_len,
            "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "temperature": args.temperature,
            "block_size": args.block_size, "attention_impl": args.attention_impl,
            "first_call_s": compile_total, "first_prefill_call_s": compile_prefill,
            "total_s_median": total_s, "total_s_all": totals,
            "prefill_s_median": prefill_s, "prefill_s_all": prefills,
            "output_tok_s": batch_size * args.max_new_tokens / total_s,
            "prefill_tok_s": batch_size * args.prompt_len / prefill_s,
            "decode_tok_s": batch_size * (args.max_new_tokens - 1) / decode_s,
            "decode_step_ms": 1e3 * decode_s / max(args.max_new_tokens - 1, 1),
            "decode_floor_tok_s": decode_floor_tok_s(config, batch_size, args.prompt_len, args.max_new_tokens,
                                                     dtype_bytes),
        }
        result["decode_fraction_of_floor"] = result["decode_tok_s"] / result["decode_floor_tok_s"]
        if args.trace:  # device kernels of one whole call, per generated token (the prefill's appear as x0.01)
            from benchmarks.trace import trace_kernels

            full = run(args.max_new_tokens)
            result["kernels"] = trace_kernels(lambda: jax.block_until_ready(full()), args.max_new_tokens,
                                              args.trace_top)
        print(json.dumps({k: v for k, v in result.items() if not k.endswith("_all") and k != "kernels"}),
              flush=True)
        if args.trace:
            kern = result["kernels"]
            print(json.dumps({k: v for k, v in kern.items() if k != "top"}))
            for entry in kern.get("top", []):
                print(f"    {entry['us_per_step']:8.1f} us/token x{entry['count_per_step']:<6g} {entry['name'][:110]}")
        results.append(result)
    del model, state
    return results


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"],
                   help="named shapes from models/presets.py (dummy weights)")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32, 256])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples (traced temperature)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--attention-impl", default="auto", choices=[*ATTENTION_IMPLS, *DEPRECATED_ATTENTION_IMPLS])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--trace", action="store_true",
                   help="also profile one call (jax.profiler) and print GPU kernel time per generated token by name")
    p.add_argument("--trace-top", type=int, default=30)
    p.add_argument("--out", help="write the JSON result here")
    args = p.parse_args(argv)
    for name in ("prompt_len", "max_new_tokens", "repeats", "block_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    result = {"versions": versions(), "argv": sys.argv[1:] if argv is None else argv, "runs": []}
    for shape in args.shapes:
        result["runs"].extend(bench_shape(shape, args))
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
