"""What one engine step holds beside its arguments, against the KV pool it updates (issue 51).

Builds the engine's model runner for a named shape with dummy weights and a pool of ``--pool-gib`` GiB, compiles
the forward of each step bucket from abstract inputs (the pool itself is never allocated, so a pool that would not
fit twice still compiles) and reports each executable's ``memory_analysis()``: ``temp_bytes`` (scratch the step
allocates), ``alias_bytes`` (outputs written into donated arguments) and the pool's bytes. A step updates the donated
pool in place when ``alias_bytes`` equals the pool's bytes and ``temp_bytes`` stays far below them; a step that
copies the pool needs a second one (``in_place`` false). A model with sliding-window or chunked layers runs with
its KV-cache groups (``paged_jax.worker.kv_group_pool``: several layers write one pool slot per step).

Example (GPU): ``python -m benchmarks.pool_memory --shape gemma-3-12b --pool-gib 40`` (add ``--qk-prepare-impl
xla`` to compile the K/V writes in XLA instead of the Pallas kernel). CPU check: ``JAX_PLATFORMS=cpu python -m
benchmarks.pool_memory --tiny``. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys

# A decode step, a mixed one and the widest: the buckets that differ in how the K/V writes compile.
REPORTED_BUCKETS = 3


def _runner(args):
    """The runner the engine would build for the shape (fused projections, one device), its pool of
    ``--pool-gib`` GiB (a tiny config: 8000 blocks)."""
    import jax.numpy as jnp

    from models.config import ModelConfig
    from models.llama import fuse_projections
    from models.loader import init_dummy_model
    from models.presets import preset_config
    from models.testing import tiny_config
    from paged_jax.engine.generation_config import eos_token_ids
    from paged_jax.worker.kv_pool_sizing import kv_bytes_per_block
    from paged_jax.worker.model_runner import ModelRunner

    config = (ModelConfig.from_hf_config(tiny_config("gemma3", num_hidden_layers=6, sliding_window=16,
                                                     sliding_window_pattern=3))
              if args.tiny else preset_config(args.shape))
    dtype = jnp.float32 if args.tiny else jnp.dtype(args.dtype)
    block_bytes = kv_bytes_per_block(config, args.block_size, dtype)
    num_blocks = 8000 if args.tiny else int(args.pool_gib * 2**30 // block_bytes)
    model = fuse_projections(init_dummy_model(config, dtype=dtype, seed=0))
    return ModelRunner(model, config, num_blocks=num_blocks, block_size=args.block_size,
                       max_model_len=256 if args.tiny else args.max_model_len, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=64 if args.tiny else args.max_num_batched_tokens,
                       eos_token_ids=eos_token_ids({"eos_token_id": config.eos_token_id}), qk_prepare_impl=args.qk_prepare_impl)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="gemma-3-12b", help="named shape with dummy weights (models/presets.py)")
    p.add_argument("--tiny", action="store_true", help="a 6-layer random Gemma 3 config (CPU check of the script)")
    p.add_argument("--pool-gib", type=float, default=40.0, help="KV pool size (never allocated)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=32776)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--qk-prepare-impl", default="auto", help="the K/V write: auto, xla or pallas")
    args = p.parse_args(argv)

    import jax

    from paged_jax.worker.warm_up import compile_forward_apart

    runner = _runner(args)
    pool_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(runner.abstract_kv_pool()))
    buckets = sorted(runner.buckets)
    picked = sorted({buckets[0], buckets[len(buckets) // 2], buckets[-1]})[:REPORTED_BUCKETS]
    steps = []
    for num_tokens, num_seqs in picked:
        memory = compile_forward_apart(runner, num_tokens, num_seqs).memory_analysis()
        steps.append({"num_tokens": num_tokens, "num_seqs": num_seqs, "temp_bytes": memory.temp_size_in_bytes,
                      "alias_bytes": memory.alias_size_in_bytes,
                      "temp_of_pool": round(memory.temp_size_in_bytes / pool_bytes, 4)})
    result = {"benchmark": "pool_memory", "shape": "tiny" if args.tiny else args.shape,
              "qk_prepare_impl": args.qk_prepare_impl, "kv_groups": runner.kv_layout.num_groups,
              "pool_bytes": pool_bytes, "steps": steps,
              "in_place": all(s["alias_bytes"] == pool_bytes and s["temp_bytes"] < pool_bytes / 4 for s in steps)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["in_place"] else 1)
