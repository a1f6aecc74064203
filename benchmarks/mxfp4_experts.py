"""gpt-oss's MXFP4 experts on one layer (``models.gpt_oss.GptOssMoeBlock``): the two ways a step runs them, to place
``models.gpt_oss.MATVEC_PAIRS_PER_EXPERT`` (below it, a step multiplies the packed bytes; above, it dequantizes).

Shape: gpt-oss-20b's layer by default (hidden 2880, experts 2880 wide, 32 experts, top 4), random MXFP4 experts (the
dummy loader's: random fp4 codes, scales 2 ** -7), random router and biases, bf16 activations. Per token count T, one
JSON line:

* ``check``: max abs difference of the two paths' outputs (float32), and the grouped path's max;
* ``matvec_us``: median wall microseconds of ``_gathered`` (each (token, expert) pair reduces over its expert's
  packed bytes, ``mxfp4.matvec``); ``grouped_us``: of ``_grouped`` (every expert dequantized to bf16, then the
  grouped matmuls of ``moe_impl="auto"``: the fused MoE kernel on a GPU). Both include routing and the top-k sum;
* ``experts_touched`` and ``floor_us``: the distinct experts the tokens route to, and the time to read their packed
  weights (blocks, scales, biases) once at ``floors.H200_HBM_BYTES_PER_S``; ``<path>_x_floor`` the ratios.

Usage (GPU): ``python -m benchmarks.mxfp4_experts --out mxfp4.json``; tiny shapes on the CPU for the smoke test.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.floors import H200_HBM_BYTES_PER_S
from benchmarks.report import median_seconds
from models.config import ModelConfig
from models.gpt_oss import GptOssMoeBlock
from models.loader import MXFP4_DUMMY_SCALE
from models.presets import PRESETS

DEFAULT_TOKENS = "1,2,4,7,8,16,32,64,128,256,1024"


def build_block(args, seed: int) -> GptOssMoeBlock:
    """One layer of gpt-oss-20b's config with ``args``' sizes, random MXFP4 experts, router and biases."""
    config = ModelConfig.from_hf_config({
        **PRESETS["gpt-oss-20b"], "num_hidden_layers": 1, "layer_types": ["full_attention"],
        "hidden_size": args.hidden, "intermediate_size": args.inter, "num_local_experts": args.experts,
        "num_experts_per_tok": args.top_k})
    block = GptOssMoeBlock(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(seed), init_std=0.02)
    keys = iter(jax.random.split(jax.random.key(seed), 8))
    experts = block.experts
    for name in ("gate_up_proj", "down_proj"):
        blocks = getattr(experts, f"{name}_blocks")
        blocks.set_value(jax.random.bits(next(keys), blocks.shape, jnp.uint8))
        scales = getattr(experts, f"{name}_scales")
        scales.set_value(jnp.full(scales.shape, MXFP4_DUMMY_SCALE, jnp.uint8))
        bias = getattr(experts, f"{name}_bias")
        bias.set_value((0.02 * jax.random.normal(next(keys), bias.shape)).astype(bias.dtype))
    block.router.kernel.set_value(jax.random.normal(next(keys), block.router.kernel.shape).astype(jnp.bfloat16))
    return block


def packed_bytes_per_expert(hidden: int, inter: int) -> int:
    """Bytes of one expert's packed weights, scales and biases."""
    gate_up, down = 2 * inter * hidden, hidden * inter
    return (gate_up + down) // 2 + (gate_up + down) // 32 + 2 * (2 * inter + hidden)


def run_case(num_tokens: int, args, seed: int) -> dict:
    block = build_block(args, seed)
    graphdef, state = nnx.split(block)
    x = (jax.random.normal(jax.random.key(seed + 100), (num_tokens, args.hidden))).astype(jnp.bfloat16)

    def path(name):
        def run(state, x):
            model = nnx.merge(graphdef, state)
            weights, ids = model.route(x)
            out = getattr(model, name)(x, ids).reshape(*ids.shape, x.shape[1])
            return jnp.sum(out * weights[:, :, None], axis=1)
        return jax.jit(run)

    fns = {"matvec": path("_gathered"), "grouped": path("_grouped")}
    outs = {name: np.asarray(fn(state, x), np.float32) for name, fn in fns.items()}
    touched = int(np.unique(np.asarray(block.route(x)[1])).size)
    floor_us = touched * packed_bytes_per_expert(args.hidden, args.inter) / H200_HBM_BYTES_PER_S * 1e6
    record = {"tokens": num_tokens, "hidden": args.hidden, "inter": args.inter, "experts": args.experts,
              "top_k": args.top_k, "experts_touched": touched, "floor_us": round(floor_us, 2),
              "check": {"max_abs_diff": float(np.abs(outs["matvec"] - outs["grouped"]).max()),
                        "grouped_max_abs": float(np.abs(outs["grouped"]).max())}}
    for name, fn in fns.items():
        micros = median_seconds(lambda fn=fn: fn(state, x), args.repeats, warmup=2) * 1e6
        record[f"{name}_us"] = round(micros, 1)
        record[f"{name}_x_floor"] = round(micros / floor_us, 2)
    return record


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default=DEFAULT_TOKENS, help="comma-separated token counts T")
    parser.add_argument("--hidden", type=int, default=2880)
    parser.add_argument("--inter", type=int, default=2880, help="each expert's width (a multiple of 32)")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="write {'results': [...]} as JSON here")
    args = parser.parse_args(argv)
    results = []
    for seed, num_tokens in enumerate(int(t) for t in args.tokens.split(",")):
        record = run_case(num_tokens, args, seed)
        print(json.dumps(record), flush=True)
        results.append(record)
    if args.out is not None:
        args.out.write_text(json.dumps({"device": str(jax.devices()[0].device_kind), "argv": sys.argv[1:] if argv
                                        is None else list(argv), "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
