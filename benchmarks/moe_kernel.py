"""The fused MoE op (``paged_jax.ops.fused_moe``) on one sparse layer: the Pallas grouped-matmul kernel against the
XLA forms (``lax.ragged_dot``), with the memory floor of the experts the step reads.

Shape: Qwen3-30B-A3B's experts by default (hidden 2048, expert width 768, 128 experts, top 8), random bf16 weights
(std 0.02) and a random router (each token's top-k of a random softmax: uneven loads, experts without tokens at small
T). Per token count T, one JSON line:

* ``check``: max abs difference of the kernel's output against the reference (float32), and the reference's max;
* ``<impl>_us``: median wall microseconds of the op (sort, gate/up + SwiGLU, down, top-k combine), ``repeats`` calls
  after compile and warm-up, for ``pallas`` (the kernel), ``ragged_dot`` (the reference: gate and up as two
  ragged_dots) and ``ragged_dot_fused`` (one ragged_dot over the gate|up weights concatenated once, outside the
  timing: XLA's best form);
* ``experts_touched`` and ``floor_us``: the distinct experts the step's tokens route to, and the time to read their
  weights plus the activations once (x, the gate|up and SwiGLU rows, the down rows, the output; bf16) at
  ``floors.H200_HBM_BYTES_PER_S``; ``<impl>_x_floor`` the ratio.

``--weights fp8``: block-FP8 experts as the DeepSeek and Qwen FP8 checkpoints hold them (float8_e4m3fn, one float32
scale per ``--fp8-block`` square of each expert's ``[out, in]``; ``models.quantization.block_fp8.BlockFp8Experts``):
``pallas`` is then the kernel dequantizing each tile, ``ragged_dot`` the reference (the layer's experts dequantized
to bf16, then ``lax.ragged_dot``), and ``pallas_bf16`` / ``ragged_dot_fused`` the bf16 forms on the same weights
dequantized once outside the timing (what loading them dequantized runs); the floor counts one byte per weight.

Usage (GPU): ``python -m benchmarks.moe_kernel --out moe.json`` (``--weights fp8`` for the FP8 experts);
``--interpret`` runs the kernel in Pallas interpret mode (the CPU test, tiny shapes).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.floors import H200_HBM_BYTES_PER_S
from benchmarks.report import median_seconds
from models.moe import grouped_matmul_reference, moe_experts_with, route_top_k, sort_by_expert
from models.quantization.block_fp8 import FP8_MAX, BlockFp8Experts
from paged_jax.ops.fused_moe import grouped_matmul_pallas

DEFAULT_TOKENS = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096"


def _inputs(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, seed: int) -> dict:
    keys = jax.random.split(jax.random.key(seed), 5)

    def normal(key, shape, std):
        return (jax.random.normal(key, shape, jnp.float32) * std).astype(jnp.bfloat16)

    weights, ids = route_top_k(jax.random.normal(keys[4], (num_tokens, num_experts), jnp.float32), top_k, True)
    return dict(x=normal(keys[0], (num_tokens, hidden), 1.0),
                w_gate=normal(keys[1], (num_experts, hidden, inter), 0.02),
                w_up=normal(keys[2], (num_experts, hidden, inter), 0.02),
                w_down=normal(keys[3], (num_experts, inter, hidden), 0.02), topk_weights=weights, topk_ids=ids)


def block_fp8_experts(key, shape: tuple[int, int, int], block: int, std: float) -> BlockFp8Experts:
    """Random block-FP8 experts of model-layout ``shape`` ``[E, K, N]``: float8 values spread over the format's
    range, each ``block`` x ``block`` square of ``[out, in]`` scaled to about ``N(0, std)`` by a random scale."""
    num_experts, k, n = shape
    weight_key, scale_key = jax.random.split(key)
    spread = FP8_MAX / 4  # most draws inside float8's range, the largest clipped by the cast
    weight = (jnp.clip(jax.random.normal(weight_key, shape, jnp.float32) * spread, -FP8_MAX, FP8_MAX)
              ).astype(jnp.float8_e4m3fn)
    scales = (num_experts, -(-n // block), -(-k // block))
    scale_inv = std / spread * jax.random.uniform(scale_key, scales, jnp.float32, 0.5, 1.5)
    return BlockFp8Experts(weight, scale_inv, (block, block))


def _fused_gate_up_ragged_dot(x, w_gate_up, w_down, topk_weights, topk_ids):
    """The op in XLA's best form: one ragged_dot over ``w_gate_up [E, H, 2I]`` (gate | up) for the rows gathered
    in expert order, the SwiGLU, one ragged_dot for down, the weighted sum."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    order, group_sizes = sort_by_expert(topk_ids, w_gate_up.shape[0])
    gate_up = jax.lax.ragged_dot(x[order // top_k], w_gate_up, group_sizes, preferred_element_type=jnp.float32)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    act = (jax.nn.silu(gate) * up).astype(x.dtype)
    out_sorted = jax.lax.ragged_dot(act, w_down, group_sizes, preferred_element_type=jnp.float32).astype(x.dtype)
    out = jnp.zeros_like(out_sorted).at[order].set(out_sorted, unique_indices=True)
    out = out.reshape(num_tokens, top_k, hidden).astype(jnp.float32)
    return jnp.sum(out * topk_weights[:, :, None], axis=1).astype(x.dtype)


def floor_bytes(num_tokens: int, hidden: int, inter: int, top_k: int, experts_touched: int,
                weight_bytes: int = 2) -> int:
    """Bytes a step must move at least: the touched experts' gate, up and down weights (``weight_bytes`` each: 2
    for bf16, 1 for FP8, whose scales add under 0.1%), x read, the gate|up-then-SwiGLU rows written and read, the
    down rows written and read, the output written (bf16)."""
    weights = experts_touched * 3 * hidden * inter
    rows = num_tokens * top_k
    activations = num_tokens * hidden + 2 * rows * inter + 2 * rows * hidden + num_tokens * hidden
    return weight_bytes * weights + 2 * activations


def _implementations(inputs: dict, args) -> dict:
    """name -> (jitted op, operands) of every form timed (``--weights`` decides the experts' storage)."""
    route = (inputs["topk_weights"], inputs["topk_ids"])
    experts = (inputs["w_gate"], inputs["w_up"], inputs["w_down"])
    kernel = functools.partial(grouped_matmul_pallas, interpret=args.interpret)
    fns = {"pallas": (jax.jit(functools.partial(moe_experts_with, kernel)), (inputs["x"], *experts, *route)),
           "ragged_dot": (jax.jit(functools.partial(moe_experts_with, grouped_matmul_reference)),
                          (inputs["x"], *experts, *route))}
    if args.weights == "fp8":  # the bf16 forms on the same weights, dequantized once here
        experts = tuple(jax.block_until_ready(w.dequantize(jnp.bfloat16)) for w in experts)
        fns["pallas_bf16"] = (fns["pallas"][0], (inputs["x"], *experts, *route))
    w_gate_up = jnp.concatenate(experts[:2], axis=-1)
    fns["ragged_dot_fused"] = (jax.jit(_fused_gate_up_ragged_dot), (inputs["x"], w_gate_up, experts[2], *route))
    return fns


def run_case(num_tokens: int, args, seed: int) -> dict:
    """Check, then time every implementation on one token count; returns the JSON record."""
    inputs = _inputs(num_tokens, args.hidden, args.inter, args.experts, args.top_k, seed)
    if args.weights == "fp8":
        keys = jax.random.split(jax.random.key(seed + 1000), 3)
        shapes = [(args.experts, args.hidden, args.inter)] * 2 + [(args.experts, args.inter, args.hidden)]
        for key, name, shape in zip(keys, ("w_gate", "w_up", "w_down"), shapes):
            inputs[name] = block_fp8_experts(key, shape, args.fp8_block, 0.02)
    fns = _implementations(inputs, args)
    outs = {name: np.asarray(fn(*ops), np.float32) for name, (fn, ops) in fns.items()}
    touched = int(np.unique(np.asarray(inputs["topk_ids"])).size)
    weight_bytes = 1 if args.weights == "fp8" else 2
    floor_us = floor_bytes(num_tokens, args.hidden, args.inter, args.top_k, touched,
                           weight_bytes) / H200_HBM_BYTES_PER_S * 1e6
    reference = outs["ragged_dot"]
    record = {"tokens": num_tokens, "hidden": args.hidden, "inter": args.inter, "experts": args.experts,
              "top_k": args.top_k, "weights": args.weights, "experts_touched": touched,
              "floor_us": round(floor_us, 2),
              "check": {"kernel_max_abs_diff": float(np.abs(outs["pallas"] - reference).max()),
                        "fused_max_abs_diff": float(np.abs(outs["ragged_dot_fused"] - reference).max()),
                        "reference_max_abs": float(np.abs(reference).max())}}
    for name, (fn, ops) in fns.items():
        micros = median_seconds(lambda fn=fn, ops=ops: fn(*ops), args.repeats, warmup=2) * 1e6
        record[f"{name}_us"] = round(micros, 1)
        record[f"{name}_x_floor"] = round(micros / floor_us, 2)
    return record


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default=DEFAULT_TOKENS, help="comma-separated token counts T")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768, help="each expert's width (moe_intermediate_size)")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--weights", choices=("bf16", "fp8"), default="bf16",
                        help="the experts' storage: bf16, or block-FP8 (float8_e4m3fn + float32 block scales)")
    parser.add_argument("--fp8-block", type=int, default=128, help="--weights fp8: the side of one scale block")
    parser.add_argument("--interpret", action="store_true", help="the kernel in Pallas interpret mode (CPU)")
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
