"""Multi-head latent attention over the paged latent cache: the MLA Pallas kernel
(``paged_jax.ops.ragged_paged_attention.mla_kernel``, ``impl="triton"``) against the jnp reference (what a latent
cache ran on before it), on DeepSeek-V2-Lite's attention shape by default (16 heads, ``kv_lora_rank`` 512,
``qk_rope_head_dim`` 64: one KV head 576 wide, values its first 512 columns), bf16, block size 16.

Cases: decode steps of ``--batches`` sequences (one query token each) at every ``--contexts`` length, and with
``--prefill`` ragged prefill chunks (``--prefill`` ``SEQSxQUERYxCONTEXT`` items: that many sequences, each a chunk of
QUERY tokens ending at CONTEXT). Pool blocks are shuffled over the pool (tables as the KV-cache manager leaves them
after churn); new rows are already written. Per case, one JSON line:

* ``check``: max abs difference of the kernel's output against the reference (float32), and the reference's max;
* ``<impl>_us``: median wall microseconds of one call (jitted: the tile map, the kernel, the kv-split combine),
  ``repeats`` calls after compile and warm-up; on a GPU also ``<impl>_gpu_us`` (summed device time of its kernels,
  from a profiler trace, ``benchmarks.trace``);
* ``floor_us``: the memory floor, the bytes the call must move at ``floors.H200_HBM_BYTES_PER_S``: every
  sequence's latent rows read once (``kv_len * (L + R)`` elements), q read, the latent output written;
  ``compute_floor_us`` the same call's dot FLOPs (``q . k`` over ``L + R`` and ``p @ latent`` over ``L``, each query
  against the keys it sees) at ``floors.H200_BF16_FLOPS``; ``<impl>_x_floor`` the wall time over the larger floor.

``--sweep`` also times the kernel's tuning variants (``SWEEP``; all, or the names given) on each case:
``variants`` maps a name to its timing, for choosing ``mla_kernel.default_tuning``'s defaults.

Usage (GPU): ``python -m benchmarks.mla_kernel --out mla.json`` (add ``--sweep``); the CPU smoke test runs tiny
shapes with ``--interpret``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.floors import H200_BF16_FLOPS, H200_HBM_BYTES_PER_S
from benchmarks.report import median_seconds, versions
from benchmarks.trace import trace_kernels
from models.presets import preset_config
from paged_jax.ops import ragged_paged_attention
from paged_jax.ops.ragged_paged_attention.mla_kernel import default_tuning

# Kernel tuning variants of ``--sweep`` (``mla_kernel.default_tuning`` keywords).
SWEEP = {
    "bk16": dict(block_k=16), "bk64": dict(block_k=64), "warps4": dict(num_warps=4), "warps8": dict(num_warps=8),
    "stages1": dict(num_stages=1), "stages3": dict(num_stages=3), "bh8": dict(block_h=8), "bh64": dict(block_h=64),
    "bq2": dict(block_q=2), "splits_x2": "x2", "splits_half": "half",
}


def make_case(num_seqs: int, q_len: int, context: int, *, heads: int, latent: int, rope: int, block_size: int,
              dtype, seed: int) -> dict:
    """Random operands of one call: q [S * q_len, H, L + R], a pool of shuffled blocks holding each sequence's
    ``context`` rows, tables, kv_lens, cu_q_lens."""
    blocks_per_seq = -(-context // block_size)
    num_blocks = 1 + num_seqs * blocks_per_seq
    rng = np.random.default_rng(seed)
    tables = (1 + rng.permutation(num_blocks - 1)).reshape(num_seqs, blocks_per_seq).astype(np.int32)
    kq, kk = jax.random.split(jax.random.key(seed))
    width = latent + rope
    return dict(
        q=jax.random.normal(kq, (num_seqs * q_len, heads, width), jnp.float32).astype(dtype),
        k_pages=jax.random.normal(kk, (num_blocks, block_size, 1, width), jnp.float32).astype(dtype),
        kv_lens=jnp.full((num_seqs,), context, jnp.int32), block_tables=jnp.asarray(tables),
        cu_q_lens=jnp.arange(num_seqs + 1, dtype=jnp.int32) * q_len)


def floors_us(num_seqs: int, q_len: int, context: int, heads: int, latent: int, rope: int, itemsize: int):
    """(memory floor, compute floor) in microseconds of one call (module docstring)."""
    tokens = num_seqs * q_len
    nbytes = itemsize * (num_seqs * context * (latent + rope) + tokens * heads * (latent + rope)
                         + tokens * heads * latent)
    keys_seen = num_seqs * sum(context - q_len + 1 + i for i in range(q_len))
    flops = 2 * heads * keys_seen * (2 * latent + rope)
    return nbytes / H200_HBM_BYTES_PER_S * 1e6, flops / H200_BF16_FLOPS * 1e6


def _attention(impl: str, interpret: bool, latent: int, sm_scale: float, tuning: dict):
    def run(q, k_pages, kv_lens, block_tables, cu_q_lens):
        return ragged_paged_attention(q, k_pages, k_pages[..., :0], kv_lens, block_tables, cu_q_lens,
                                      sm_scale=sm_scale, impl=impl, v_head_dim=latent,
                                      interpret=interpret and impl == "triton", **tuning)

    return jax.jit(run)


def _time(fn, operands: tuple, repeats: int) -> dict:
    out = {"us": round(median_seconds(lambda: fn(*operands), repeats, warmup=2) * 1e6, 1)}
    if jax.default_backend() == "gpu":
        out["gpu_us"] = trace_kernels(lambda: jax.block_until_ready(fn(*operands)), 1, 4).get("busy_us_per_step")
    return out


def _sweep_tuning(variant, num_tokens: int, num_seqs: int, heads: int, latent: int, context: int, block_size: int):
    """A ``SWEEP`` entry as ``default_tuning`` keywords (the kv-split variants scale the default split count)."""
    if isinstance(variant, dict):
        return variant

    splits = default_tuning(num_tokens, num_seqs, heads, latent, -(-context // block_size),
                            block_size)["num_kv_splits"]
    return dict(num_kv_splits=splits * 2 if variant == "x2" else max(1, splits // 2))


def run_case(num_seqs: int, q_len: int, context: int, args, seed: int) -> dict:
    """Check, then time the kernel and the reference on one case; returns the JSON record."""
    dtype = jnp.dtype(args.dtype)
    case = make_case(num_seqs, q_len, context, heads=args.heads, latent=args.latent, rope=args.rope,
                     block_size=args.block_size, dtype=dtype, seed=seed)
    operands = (case["q"], case["k_pages"], case["kv_lens"], case["block_tables"], case["cu_q_lens"])
    sm_scale = args.sm_scale
    fns = {impl: _attention(impl, args.interpret, args.latent, sm_scale, {}) for impl in ("triton", "reference")}
    outs = {impl: np.asarray(fn(*operands), np.float32) for impl, fn in fns.items()}
    mem_us, compute_us = floors_us(num_seqs, q_len, context, args.heads, args.latent, args.rope, dtype.itemsize)
    record = {"seqs": num_seqs, "q_len": q_len, "context": context, "heads": args.heads, "latent": args.latent,
              "rope": args.rope, "dtype": args.dtype, "block_size": args.block_size,
              "floor_us": round(mem_us, 3), "compute_floor_us": round(compute_us, 3),
              "check": {"kernel_max_abs_diff": float(np.abs(outs["triton"] - outs["reference"]).max()),
                        "reference_max_abs": float(np.abs(outs["reference"]).max())}}
    for impl, fn in fns.items():
        timed = _time(fn, operands, args.repeats)
        record[f"{impl}_us"] = timed["us"]
        record[f"{impl}_x_floor"] = round(timed["us"] / max(mem_us, compute_us), 2)
        if "gpu_us" in timed:
            record[f"{impl}_gpu_us"] = timed["gpu_us"]
    if args.sweep:
        names = list(SWEEP) if args.sweep == "all" else args.sweep.split(",")
        record["variants"] = {
            name: _time(_attention("triton", args.interpret, args.latent, sm_scale, _sweep_tuning(
                SWEEP[name], num_seqs * q_len, num_seqs, args.heads, args.latent, context, args.block_size)),
                operands, args.repeats)
            for name in names}
    return record


def _cases(args) -> list[tuple[int, int, int]]:
    """(sequences, query tokens each, context) of every case: decode, then the prefill chunks."""
    decode = [(int(b), 1, int(c)) for b in args.batches.split(",") for c in args.contexts.split(",")]
    prefill = [tuple(int(x) for x in item.split("x")) for item in args.prefill.split(",") if item]
    return decode + prefill


def main(argv=None) -> list[dict]:
    lite = preset_config("deepseek-v2-lite")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,32,128", help="comma-separated decode batch sizes")
    parser.add_argument("--contexts", default="1024,2048,4096,8192", help="comma-separated decode context lengths")
    parser.add_argument("--prefill", default="1x1024x4096,4x512x2048",
                        help="comma-separated SEQSxQUERYxCONTEXT ragged prefill cases ('' for none)")
    parser.add_argument("--heads", type=int, default=lite.num_attention_heads)
    parser.add_argument("--latent", type=int, default=lite.mla.kv_lora_rank, help="kv_lora_rank L")
    parser.add_argument("--rope", type=int, default=lite.mla.qk_rope_head_dim, help="qk_rope_head_dim R")
    parser.add_argument("--sm-scale", type=float, default=lite.mla.qk_head_dim ** -0.5,
                        help="softmax scale (the model's: qk_nope_head_dim + qk_rope_head_dim to the -1/2)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sweep", nargs="?", const="all", default=None,
                        help="also time the kernel's tuning variants: 'all' (the flag alone) or comma-separated "
                             f"names of {', '.join(SWEEP)}")
    parser.add_argument("--interpret", action="store_true", help="the kernel in Pallas interpret mode (CPU)")
    parser.add_argument("--out", type=Path, default=None, help="write {'versions', 'argv', 'results'} as JSON here")
    args = parser.parse_args(argv)
    unknown = set() if args.sweep in (None, "all") else set(args.sweep.split(",")) - set(SWEEP)
    if unknown:
        parser.error(f"--sweep: unknown variants {sorted(unknown)}; expected 'all' or some of {', '.join(SWEEP)}")
    results = []
    for seed, (num_seqs, q_len, context) in enumerate(_cases(args)):
        record = run_case(num_seqs, q_len, context, args, seed)
        print(json.dumps(record), flush=True)
        results.append(record)
    if args.out is not None:
        args.out.write_text(json.dumps({"versions": versions(), "argv": sys.argv[1:] if argv is None else list(argv),
                                        "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
