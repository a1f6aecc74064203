"""Benchmark of ragged paged attention on one GPU (H200): decode bandwidth, prefill/mixed TFLOP/s.

Run on the GPU machine from the repo root:

    PYTHONUNBUFFERED=1 PYTHONPATH=$PWD python3 benchmarks/kernels.py --out $OUT

Sections (``--sections``, comma separated): ``ceiling`` (device copy / elementwise / read-only bandwidth and a bf16
matmul), ``check`` (kernel vs the jnp reference on the GPU, many shapes, before any timing), ``decode`` (Llama-3-8B
head shape: 32 q heads, 8 kv heads, head_dim 128, bf16, block_size 16; full batch x context grid; ours vs the XLA
reference vs JAX's deprecated ``pallas.ops.gpu.paged_attention``; slow), ``decode_compare`` (the same three on 4
decode points, with a correctness check of JAX's kernel; ~1 min), ``decode_grid`` (ours only on a sparse grid of 10
points, batch 1..256 x context 512..32k; ~1 min), ``decode_sweep`` and ``prefill_sweep`` (tuning variants),
``decode_kv_dtype`` (bf16 pool vs an FP8 pool under several tunings, each FP8 variant checked first),
``prefill`` (4k-token prefill, chunked prefill, mixed batch), ``prefill_variants`` (the kernel's prefill tuning
options on 1x4096, 4x1024 and 512 over a 3584 prefix; each variant checked against the reference first; prints the
best variant as a recommended prefill default; ~1.5 min), ``rms_norm`` (the fused residual add + RMSNorm kernel vs
XLA's fusion of the jnp reference: max abs difference, microseconds per norm; ~20 s), ``qk_prepare`` (the fused q/k
norm + RoPE + KV write kernel vs its XLA reference on Qwen3-0.6B / Llama-3.1-8B shapes at T = 1 and 256: check, then
time and kernels per step; ``benchmarks/qk_prepare_kernel.py``).

Quick full run (under 5 minutes of GPU time): each section stops starting new cases after its soft budget
(``--section-budgets``, default prefill_variants 100 s, decode_compare 60 s, decode_grid 60 s, check 40 s) and the
whole run after ``--budget-s``; results are flushed after every case, so a timeout loses at most one case:

    PYTHONUNBUFFERED=1 PYTHONPATH=$PWD timeout 295 python3 benchmarks/kernels.py --out $OUT --repeats 5 \
        --budget-s 265 --sections ceiling,prefill_variants,decode_compare,decode_grid,check

CPU smoke test of the plumbing (interpret mode, tiny sizes): ``--interpret --tiny --repeats 1``.

Timing: each measured call runs ``n_inner`` attention steps inside one jitted ``fori_loop`` (the output feeds the
next step's queries, so nothing is hoisted, and the block table rotates over ``R`` disjoint copies of the KV so the
50 MB L2 cannot serve repeated reads), after a compile call and a warm-up call; median of ``--repeats`` calls with
``block_until_ready``. Inputs are fresh random normals. Results go to ``<out>/kernels.log`` and ``<out>/kernels.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.floors import H200_HBM_BYTES_PER_S  # noqa: E402
from benchmarks.report import median_seconds  # noqa: E402
from models.config import AttentionChunk  # noqa: E402
from paged_jax.ops.ragged_paged_attention import ragged_paged_attention  # noqa: E402
from paged_jax.ops.ragged_paged_attention.reference import ragged_paged_attention_reference  # noqa: E402
from paged_jax.ops.ragged_paged_attention.mgpu_kernel import default_tuning as mosaic_default_tuning  # noqa: E402
from paged_jax.ops.ragged_paged_attention.triton_kernel import default_tuning  # noqa: E402

HQ, HKV, D = 32, 8, 128  # Llama-3-8B attention shape
BLOCK_SIZE = 16
DTYPE = jnp.bfloat16
SM_SCALE = 1.0 / math.sqrt(D)
L2_DEFEAT_BYTES = 512 << 20  # rotate over this much KV so repeated steps miss the L2

INTERPRET = False  # --interpret: run the kernels in Pallas interpret mode (CPU smoke test of this script)
TINY = False  # --tiny: prefill_variants / decode_compare / decode_grid on tiny sizes (CPU smoke test)
LOG_LINES: list[str] = []
RESULTS: dict = {"meta": {}, "ceiling": {}, "check": [], "decode": [], "decode_sweep": [], "decode_kv_dtype": [],
                 "prefill": [], "prefill_sweep": [], "prefill_variants": [], "prefill_peers": [], "prefill_recommendation": {},
                 "decode_compare": [],
                 "decode_grid": [], "qk_prepare": [], "prefill_buckets": [], "errors": []}
OUT_DIR = "bench_out"
DEADLINE = float("inf")  # time.time() after which sections start no new case (--budget-s)
SECTION_DEADLINE = float("inf")  # the same for the running section (--section-budgets)
# Soft time limits (s) per section: a section starts no new variant / case after this; overrun <= one case.
DEFAULT_SECTION_BUDGETS = "prefill_variants=100,decode_compare=60,decode_grid=60,check=40"


def over_budget(what: str) -> bool:
    """True (and logged) once the run's --budget-s or the section's budget is spent: the caller skips ``what``."""
    now = time.time()
    if now < DEADLINE and now < SECTION_DEADLINE:
        return False
    log(f"SKIP {what}: {'--budget-s' if now >= DEADLINE else 'section budget'} spent")
    return True


def flush_results():
    """Write the JSON and the log so far (called after every case: a timeout loses at most one case)."""
    with open(os.path.join(OUT_DIR, "kernels.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    with open(os.path.join(OUT_DIR, "kernels.log"), "w") as f:
        f.write("\n".join(LOG_LINES) + "\n")


def log(msg: str = ""):
    print(msg, flush=True)
    LOG_LINES.append(msg)


def median_time(fn, args, repeats: int) -> float:
    """Median seconds of one call of ``fn(*args)`` after a compile call and a warm-up call."""
    return median_seconds(lambda: fn(*args), repeats, warmup=2)


# ----------------------------------------------------------------------------------------------------------------
# Problem construction


def make_batch(key, q_lens, kv_lens, *, num_rotations=1, pad_tokens=0, pad_seqs=0, dtype=DTYPE,
               hq=HQ, hkv=HKV, d=D, block_size=BLOCK_SIZE, max_blocks=None):
    """Random ragged batch. Returns dict with q, k_pages, v_pages, kv_lens, block_tables [R, S, mb], cu_q_lens.

    ``max_blocks`` (block-table width) defaults to the longest context; a larger value pads the tables with the
    null block, so that batches of different layouts share static shapes (one compilation).
    """
    q_lens = np.asarray(list(q_lens) + [0] * pad_seqs, np.int32)
    kv_lens = np.asarray(list(kv_lens) + [0] * pad_seqs, np.int32)
    num_seqs = len(q_lens)
    needed_blocks = int(max(1, -(-int(kv_lens.max()) // block_size)))
    if max_blocks is None:
        max_blocks = needed_blocks
    elif max_blocks < needed_blocks:
        raise ValueError(f"max_blocks={max_blocks} is below the {needed_blocks} blocks the longest context needs")
    blocks_per_rot = num_seqs * max_blocks
    num_blocks = 1 + num_rotations * blocks_per_rot
    rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**31 - 1)))
    perm = rng.permutation(np.arange(1, num_blocks, dtype=np.int32))
    tables = perm.reshape(num_rotations, num_seqs, max_blocks)
    # Unused logical blocks of shorter sequences point at the null block, as the engine does.
    used = np.arange(max_blocks)[None, :] < (-(-kv_lens // block_size))[:, None]
    tables = np.where(used[None], tables, 0).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(cu[-1]) + pad_tokens
    kq, kk, kv = jax.random.split(key, 3)
    gen = jax.jit(lambda k, shape: jax.random.normal(k, shape, dtype), static_argnums=1)
    return dict(
        q=gen(kq, (num_tokens, hq, d)),
        k_pages=gen(kk, (num_blocks, block_size, hkv, d)),
        v_pages=gen(kv, (num_blocks, block_size, hkv, d)),
        kv_lens=jnp.asarray(kv_lens),
        block_tables=jnp.asarray(tables),
        cu_q_lens=jnp.asarray(cu),
        q_lens_np=q_lens,
        kv_lens_np=kv_lens,
    )


def _decode_batch(key, batch, ctx):
    """``batch`` one-token decode rows over ``ctx`` keys each (bf16 pools), with enough rotated copies of the KV
    that repeated steps miss the L2. Returns ``(make_batch(...), rotations)``."""
    case_bytes = batch * ctx * HKV * D * 2 * 2
    rot = int(max(1, min(64, math.ceil(L2_DEFEAT_BYTES / case_bytes))))
    return make_batch(key, [1] * batch, [ctx] * batch, num_rotations=rot), rot


def bandwidth_fields(seconds: float, nbytes: int, ceiling_gbps: float | None, prefix: str = "") -> dict:
    """A timed memory-bound call's row fields: ``us``, ``GBps`` and, when the same-run copy ceiling is known,
    ``frac_copy_ceiling``; each name behind ``prefix``."""
    gbps = nbytes / seconds / 1e9
    fields = {f"{prefix}us": seconds * 1e6, f"{prefix}GBps": gbps}
    if ceiling_gbps:
        fields[f"{prefix}frac_copy_ceiling"] = gbps / ceiling_gbps
    return fields


def kv_bytes_read(b):
    itemsize = jnp.dtype(b["k_pages"].dtype).itemsize
    _, _, hkv, d = b["k_pages"].shape
    return int(b["kv_lens_np"].sum()) * hkv * d * 2 * itemsize


def io_bytes(b):
    return kv_bytes_read(b) + 2 * b["q"].size * jnp.dtype(b["q"].dtype).itemsize + b["block_tables"][0].size * 4


def attention_flops(b, sliding_window=None):
    """Useful FLOPs: 2 dots of 2*D FLOPs per (query head, visible key)."""
    total_visible = 0
    for ql, kl in zip(b["q_lens_np"], b["kv_lens_np"]):
        pos = np.arange(kl - ql, kl, dtype=np.int64)
        vis = pos + 1 if sliding_window is None else np.minimum(pos + 1, sliding_window)
        total_visible += int(vis.sum())
    hq, d = b["q"].shape[1], b["q"].shape[2]
    return 4 * hq * d * total_visible


def ours(impl="triton", **tuning):
    return lambda q, kp, vp, kl, bt, cu: ragged_paged_attention(
        q, kp, vp, kl, bt, cu, sm_scale=SM_SCALE, impl=impl, interpret=INTERPRET, **tuning)


def reference_fn(q, kp, vp, kl, bt, cu):
    return ragged_paged_attention_reference(q, kp, vp, kl, bt, cu, sm_scale=SM_SCALE)


def looped_dynamic(step_fn):
    """jit(fn) running ``n`` (a traced argument) dependent steps, rotating the block table copy each step: one
    compilation serves a 1-step correctness call and the timed ``n_inner``-step calls."""

    @jax.jit
    def run(n, q, k_pages, v_pages, kv_lens, tables, cu):
        rotations = tables.shape[0]

        def body(i, q):
            bt = lax.dynamic_index_in_dim(tables, i % rotations, keepdims=False)
            return step_fn(q, k_pages, v_pages, kv_lens, bt, cu).astype(q.dtype)

        return lax.fori_loop(0, n, body, q)

    return run


def n_inner_for(est_seconds):
    """Steps per timed call: about 4 ms of work, at most 200 (2 with --tiny: interpret mode is slow)."""
    return int(min(2 if TINY else 200, max(1, math.ceil(4e-3 / max(est_seconds, 1e-7)))))


def rel_l2(out, ref, n_real):
    out = np.asarray(jnp.asarray(out).astype(jnp.float32))[:n_real]
    ref = np.asarray(jnp.asarray(ref).astype(jnp.float32))[:n_real]
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)), bool(np.isfinite(out).all())


def time_step(step_fn, b, est_seconds, repeats):
    n_inner = n_inner_for(est_seconds)
    run = looped_dynamic(step_fn)
    args = (n_inner, b["q"], b["k_pages"], b["v_pages"], b["kv_lens"], b["block_tables"], b["cu_q_lens"])
    return median_time(run, args, repeats) / n_inner, n_inner


# ----------------------------------------------------------------------------------------------------------------
# Sections


def section_ceiling(args):
    log("== ceilings ==")
    n = (4 << 30) // 2
    x = jax.random.normal(jax.random.key(1), (n,), jnp.bfloat16)
    copy = jax.jit(lambda a: jnp.copy(a))
    y = copy(x)
    aliased = y.unsafe_buffer_pointer() == x.unsafe_buffer_pointer()
    del y
    t = median_time(copy, (x,), args.repeats)
    copy_bw = 2 * x.nbytes / t
    t = median_time(jax.jit(lambda a: a * 1.5 + 1.0), (x,), args.repeats)
    ew_bw = 2 * x.nbytes / t
    t = median_time(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), (x,), args.repeats)
    read_bw = x.nbytes / t
    del x
    gc.collect()
    m = 8192
    a = jax.random.normal(jax.random.key(2), (m, m), jnp.bfloat16)
    bm = jax.random.normal(jax.random.key(3), (m, m), jnp.bfloat16)
    t = median_time(jax.jit(lambda u, v: u @ v), (a, bm), args.repeats)
    mm = 2 * m**3 / t
    del a, bm
    RESULTS["ceiling"] = dict(copy_GBps=copy_bw / 1e9, copy_output_aliased_input=bool(aliased),
                              elementwise_GBps=ew_bw / 1e9, read_sum_GBps=read_bw / 1e9, matmul_TFLOPs=mm / 1e12)
    log(f"device copy 4 GiB (read+write): {copy_bw/1e9:8.0f} GB/s (aliased={aliased})")
    log(f"elementwise x*1.5+1 (read+write): {ew_bw/1e9:8.0f} GB/s")
    log(f"read-only sum:                   {read_bw/1e9:8.0f} GB/s")
    log(f"bf16 8192^3 matmul:              {mm/1e12:8.1f} TFLOP/s")


ALL_OPTIONS = dict(kv_heads_inner=True, longest_tiles_first=True, prefetch_pages=True, prescale_q=True,
                   k_transposed=True, zero_padding_in_kernel=True)


def section_check(args):
    """Kernel vs reference on the GPU: relative L2 error and max abs error, every shape family."""
    log("== correctness on GPU (kernel vs jnp reference, fp32 math) ==")
    key = jax.random.key(10)
    cases = [
        # name, q_lens, kv_lens, hq, hkv, d, bs, dtype, window (an AttentionChunk: chunked attention), tuning
        ("decode gqa4 d128 bs16", [1] * 7, [1, 17, 100, 512, 33, 16, 2049], 32, 8, 128, 16, jnp.bfloat16, None, {}),
        ("decode gqa4 bs16 splits", [1] * 3, [4000, 17, 2500], 32, 8, 128, 16, jnp.bfloat16, None,
         dict(num_kv_splits=7)),
        ("prefill gqa4 d128", [300, 77], [300, 77], 32, 8, 128, 16, jnp.bfloat16, None, {}),
        ("mixed chunked gqa8 d64 bs64", [129, 1, 1, 40], [1000, 64, 700, 40], 16, 2, 64, 64, jnp.bfloat16, None, {}),
        ("mixed gqa1 d128 bs128", [64, 1, 3], [200, 129, 300], 8, 8, 128, 128, jnp.bfloat16, None, {}),
        ("prefill gqa4 fp32", [100, 1], [260, 50], 16, 4, 128, 16, jnp.float32, None, {}),
        ("window 64 mixed", [80, 1, 1], [300, 200, 33], 32, 8, 128, 16, jnp.bfloat16, 64, {}),
        ("window 128 splits", [1, 1], [3000, 129], 32, 8, 128, 32, jnp.bfloat16, 128, dict(num_kv_splits=4)),
        ("prefill fp16 bq32", [200], [450], 32, 8, 128, 16, jnp.float16, None, dict(block_q=32, block_k=128)),
        ("mixed window 256 splits", [70, 1, 1], [900, 300, 5], 32, 8, 128, 16, jnp.bfloat16, 256,
         dict(num_kv_splits=3)),
        # The prefill tuning options, all on (they change the Triton program: transposed K gather, carried pages).
        ("all options: prefill gqa4", [300, 77], [300, 77], 32, 8, 128, 16, jnp.bfloat16, None, ALL_OPTIONS),
        ("all options: window 64 mixed splits", [80, 1, 1], [300, 200, 33], 32, 8, 128, 16, jnp.bfloat16, 64,
         dict(ALL_OPTIONS, num_kv_splits=3)),
        ("all options: bq32 bk128 w8 chunked", [200, 1], [700, 64], 32, 8, 128, 16, jnp.bfloat16, None,
         dict(ALL_OPTIONS, block_q=32, block_k=128, num_warps=8)),
        ("all options: fp32 prefill", [100, 1], [260, 50], 16, 4, 128, 16, jnp.float32, None, ALL_OPTIONS),
        # Llama 4's chunked layers: chunk edges inside the key blocks and query tiles, decodes after an edge.
        ("chunk 96 mixed", [80, 1, 1], [300, 200, 33], 40, 8, 128, 16, jnp.bfloat16, AttentionChunk(96), {}),
        ("chunk 256 splits", [1, 1, 200], [3000, 257, 700], 40, 8, 128, 32, jnp.bfloat16, AttentionChunk(256),
         dict(num_kv_splits=4)),
        ("all options: chunk 64 mixed splits", [80, 1, 1], [300, 200, 33], 32, 8, 128, 16, jnp.bfloat16,
         AttentionChunk(64), dict(ALL_OPTIONS, num_kv_splits=3)),
    ]
    _run_checks(cases[: args.check_cases], "triton", key)


MOSAIC_CHECK_CASES = [
    # name, q_lens, kv_lens, hq, hkv, d, bs, dtype, window, tuning (Mosaic GPU prefill kernel)
    ("mosaic prefill gqa4 d128", [300, 77], [300, 77], 32, 8, 128, 16, jnp.bfloat16, None, {}),
    ("mosaic chunked over prefix", [200, 129], [1000, 700], 32, 8, 128, 16, jnp.bfloat16, None, {}),
    ("mosaic ragged with 1-token seqs", [1, 130, 1, 64, 65], [1, 130, 900, 64, 3000], 32, 8, 128, 16,
     jnp.bfloat16, None, {}),
    ("mosaic gqa8 d64 bs64", [129, 40], [1000, 40], 16, 2, 64, 64, jnp.bfloat16, None, {}),
    ("mosaic gqa1 d128 bs128 fp16", [256, 3], [300, 300], 8, 8, 128, 128, jnp.float16, None, {}),
    ("mosaic bkv64 3 stages", [300, 77], [500, 77], 32, 8, 128, 16, jnp.bfloat16, None,
     dict(block_kv=64, num_stages=3)),
    ("mosaic prefill 4096", [4096], [4096], 32, 8, 128, 16, jnp.bfloat16, None, {}),
    ("mosaic bs32 no longest-first", [333], [2000], 32, 8, 128, 32, jnp.bfloat16, None,
     dict(longest_tiles_first=False)),
    # Short last tiles of fresh prefills, one at a time: valid rows at the start of the box (offset 0).
    ("mosaic fresh 44", [44], [44], 32, 8, 128, 16, jnp.bfloat16, None, {}),
    ("mosaic fresh 300", [300], [300], 32, 8, 128, 16, jnp.bfloat16, None, {}),
    ("mosaic fresh 77", [77], [77], 32, 8, 128, 16, jnp.bfloat16, None, {}),
    ("mosaic fresh 300 bkv64", [300], [300], 32, 8, 128, 16, jnp.bfloat16, None, dict(block_kv=64)),
    ("mosaic fresh 256+44 no padding", [300], [300], 32, 8, 128, 128, jnp.bfloat16, None, {}),
    # The persistent grid with few programs: many work items per program, the K/V ring and the output buffer
    # carried from item to item (items of 1 to 24 key steps), GQA 4 and 8.
    ("mosaic 7 programs ragged", [1, 130, 1, 64, 300], [1, 130, 900, 64, 3000], 32, 8, 128, 16, jnp.bfloat16,
     None, dict(num_programs=7)),
    ("mosaic 3 programs gqa8 bkv64 3 stages", [129, 40, 500], [1000, 40, 700], 16, 2, 64, 16, jnp.bfloat16, None,
     dict(num_programs=3, block_kv=64, num_stages=3)),
]


def section_check_mosaic(args):
    """The Mosaic GPU prefill kernel vs the reference on the GPU (ragged, chunked, GQA 1/4/8, d64/d128, block sizes
    16-128, fp16, 1-token sequences, padding tokens and sequence slots)."""
    log("== correctness on GPU: Mosaic GPU kernel vs jnp reference ==")
    _run_checks(MOSAIC_CHECK_CASES[: args.check_cases], "mosaic", jax.random.key(11))


def _run_checks(cases, impl, key):
    for name, ql, kl, hq, hkv, d, bs, dtype, window, tuning in cases:
        if over_budget(f"check {name}"):
            break
        key, sub = jax.random.split(key)
        b = make_batch(sub, ql, kl, pad_tokens=5, pad_seqs=2, dtype=dtype, hq=hq, hkv=hkv, d=d, block_size=bs)
        bt = b["block_tables"][0]
        scale = 1.0 / math.sqrt(d)
        masks = (dict(attention_chunk_size=window.size) if isinstance(window, AttentionChunk)
                 else dict(sliding_window=window))
        try:
            out = jax.jit(lambda q, kp, vp, kl_, bt_, cu: ragged_paged_attention(
                q, kp, vp, kl_, bt_, cu, sm_scale=scale, impl=impl, interpret=INTERPRET, **masks, **tuning))(
                b["q"], b["k_pages"], b["v_pages"], b["kv_lens"], bt, b["cu_q_lens"])
            ref = jax.jit(lambda q, kp, vp, kl_, bt_, cu: ragged_paged_attention_reference(
                q.astype(jnp.float32), kp.astype(jnp.float32), vp.astype(jnp.float32), kl_, bt_, cu,
                sm_scale=scale, **masks))(
                b["q"], b["k_pages"], b["v_pages"], b["kv_lens"], bt, b["cu_q_lens"])
            out = np.asarray(out.astype(jnp.float32))
            ref = np.asarray(ref)
            n_real = int(b["cu_q_lens"][-1])
            rel = float(np.linalg.norm(out[:n_real] - ref[:n_real]) / np.linalg.norm(ref[:n_real]))
            max_abs = float(np.abs(out - ref).max())
            pad_zero = bool(np.all(out[n_real:] == 0))
            finite = bool(np.isfinite(out).all())
            tol = 1e-4 if dtype == jnp.float32 else 2e-2
            ok = finite and pad_zero and rel < tol
            RESULTS["check"].append(dict(case=name, impl=impl, rel_l2=rel, max_abs=max_abs, pad_zero=pad_zero, ok=ok))
            log(f"{'OK ' if ok else 'BAD'} {name:32s} rel_l2={rel:.2e} max_abs={max_abs:.2e} pad_zero={pad_zero}")
            if not ok:  # where: per sequence, the share of (token, head) rows that are off
                cu = np.asarray(b["cu_q_lens"])
                for si in range(len(cu) - 1):
                    if cu[si + 1] > cu[si]:
                        d_rows = np.abs(out[cu[si]:cu[si + 1]] - ref[cu[si]:cu[si + 1]]).max(axis=-1)  # [q, H]
                        bad = d_rows > 0.05
                        toks = np.nonzero(bad.any(axis=1))[0]
                        log(f"    seq {si} (q {cu[si + 1] - cu[si]}, kv {int(b['kv_lens_np'][si])}): "
                            f"{bad.mean():.2f} of rows off; bad tokens {toks[:6].tolist()}..{toks[-3:].tolist()}"
                            f" heads {np.nonzero(bad.any(axis=0))[0][:8].tolist()}")
        except Exception as e:  # keep going: report every failing family
            RESULTS["check"].append(dict(case=name, impl=impl, ok=False, error=repr(e)[:2000]))
            log(f"ERR {name}: {e!r}"[:3000])
            traceback.print_exc()
        flush_results()


def _jax_paged_attention_step(b):
    """JAX's deprecated Pallas paged_attention on the same problem, in its own layout (decode only)."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jpa

    def step(q, kp_h, vp_h, kl, bt, cu):
        return jpa.paged_attention(q, kp_h, vp_h, bt, kl, interpret=INTERPRET)

    return step


def section_decode(args):
    log("== decode: Llama-3-8B heads (32q/8kv, d128), bf16, block_size 16; GB/s = (KV + q + out bytes) / time ==")
    ceiling = RESULTS["ceiling"].get("copy_GBps")
    key = jax.random.key(20)
    batches = [int(x) for x in args.decode_batches.split(",")]
    contexts = [int(x) for x in args.decode_contexts.split(",")]
    log(f"{'batch':>5} {'ctx':>6} {'tuning':>22} | {'ours us':>9} {'GB/s':>6} {'%ceil':>5} | "
        f"{'jax_pa us':>9} {'GB/s':>6} | {'xla_ref us':>10} {'GB/s':>6}")
    for ctx in contexts:
        for batch in batches:
            key, sub = jax.random.split(key)
            row = dict(batch=batch, context=ctx)
            try:
                b, row["rotations"] = _decode_batch(sub, batch, ctx)
                nbytes = io_bytes(b)
                est = nbytes / 3.0e12
                tun = default_tuning(batch, batch, HQ, HKV, b["block_tables"].shape[2], BLOCK_SIZE)
                row["tuning"] = tun
                t, n_inner = time_step(ours(), b, est, args.repeats)
                row.update(bytes=nbytes, n_inner=n_inner, **bandwidth_fields(t, nbytes, ceiling, "ours_"))
                try:
                    bj = dict(b)
                    bj["k_pages"] = jnp.transpose(b["k_pages"], (2, 0, 1, 3))
                    bj["v_pages"] = jnp.transpose(b["v_pages"], (2, 0, 1, 3))
                    del b["k_pages"], b["v_pages"]
                    gc.collect()
                    tj, _ = time_step(_jax_paged_attention_step(bj), bj, est, args.repeats)
                    row.update(jax_pa_us=tj * 1e6, jax_pa_GBps=nbytes / tj / 1e9)
                    b["k_pages"] = jnp.transpose(bj["k_pages"], (1, 2, 0, 3))
                    b["v_pages"] = jnp.transpose(bj["v_pages"], (1, 2, 0, 3))
                    del bj
                except Exception as e:
                    row["jax_pa_error"] = repr(e)[:500]
                    if "k_pages" not in b:
                        b["k_pages"] = jnp.transpose(bj["k_pages"], (1, 2, 0, 3))
                        b["v_pages"] = jnp.transpose(bj["v_pages"], (1, 2, 0, 3))
                if batch * ctx <= args.ref_max_tokens:
                    tr, _ = time_step(reference_fn, b, est * 10, max(3, args.repeats // 2))
                    row.update(ref_us=tr * 1e6, ref_GBps=nbytes / tr / 1e9)
                tun_s = f"bq{tun['block_q']} bk{tun['block_k']} s{tun['num_kv_splits']} w{tun['num_warps']}"
                log(f"{batch:5d} {ctx:6d} {tun_s:>22} | {row['ours_us']:9.1f} {row['ours_GBps']:6.0f} "
                    f"{100 * row.get('ours_frac_copy_ceiling', float('nan')):5.1f} | "
                    f"{row.get('jax_pa_us', float('nan')):9.1f} {row.get('jax_pa_GBps', float('nan')):6.0f} | "
                    f"{row.get('ref_us', float('nan')):10.1f} {row.get('ref_GBps', float('nan')):6.0f}"
                    + (f"  jax_pa_error={row['jax_pa_error'][:80]}" if "jax_pa_error" in row else ""))
            except Exception as e:
                row["error"] = repr(e)[:2000]
                log(f"ERR decode batch={batch} ctx={ctx}: {e!r}"[:2000])
                traceback.print_exc()
            RESULTS["decode"].append(row)
            b = bj = None
            gc.collect()


def section_decode_sweep(args):
    log("== decode tuning sweep ==")
    key = jax.random.key(30)
    cases = [(32, 8192), (1, 32768), (256, 2048)]
    variants = [
        {}, dict(block_k=32), dict(block_k=128), dict(num_stages=3), dict(num_stages=4),
        dict(block_k=128, num_stages=3), dict(num_warps=8),
    ]
    for batch, ctx in cases:
        key, sub = jax.random.split(key)
        b, _ = _decode_batch(sub, batch, ctx)
        nbytes = io_bytes(b)
        base = default_tuning(batch, batch, HQ, HKV, b["block_tables"].shape[2], BLOCK_SIZE)
        more = [dict(num_kv_splits=max(1, base["num_kv_splits"] * 2)),
                dict(num_kv_splits=max(1, base["num_kv_splits"] // 2))]
        for var in variants + more:
            try:
                t, _ = time_step(ours(**var), b, nbytes / 3e12, args.repeats)
                RESULTS["decode_sweep"].append(dict(batch=batch, context=ctx, variant=var, us=t * 1e6,
                                                    GBps=nbytes / t / 1e9))
                log(f"batch {batch:4d} ctx {ctx:6d} {str(var):40s} {t*1e6:9.1f} us {nbytes/t/1e9:7.0f} GB/s")
            except Exception as e:
                RESULTS["decode_sweep"].append(dict(batch=batch, context=ctx, variant=var, error=repr(e)[:500]))
                log(f"ERR sweep {batch} {ctx} {var}: {e!r}"[:600])
        b = None
        gc.collect()


# ``--sections decode_kv_dtype``: (batch, context) points and the Triton kernel tunings timed on an FP8 pool beside
# the bf16 pool's default (the engine's ``--kv-cache-dtype fp8`` decode).
DECODE_KV_DTYPE_CASES = [(256, 1024), (64, 2048), (32, 8192), (1, 32768)]
DECODE_FP8_VARIANTS = [{}, dict(fp8_dots_in_fp16=False), dict(fp8_dots_in_fp16=False, block_k=64),
                       dict(block_k=64), dict(num_stages=3), dict(block_k=256)]


def section_decode_kv_dtype(args):
    """Decode on a bf16 pool (default tuning) vs an FP8 (e4m3) pool (``DECODE_FP8_VARIANTS``): each FP8 variant
    checked against the reference on the same FP8 pool first; GB/s counts the bytes each pool's dtype makes the
    kernel read, against the same-run copy ceiling."""
    log("== decode: bf16 vs FP8 KV pool ==")
    ceiling = RESULTS["ceiling"].get("copy_GBps")
    key = jax.random.key(31)
    cases = [(2, 64), (1, 256)] if TINY else DECODE_KV_DTYPE_CASES
    for batch, ctx in cases:
        if over_budget(f"decode_kv_dtype {batch}x{ctx}"):
            break
        key, sub = jax.random.split(key)
        b16, _ = _decode_batch(sub, batch, ctx)
        b8 = dict(b16, k_pages=b16["k_pages"].astype(jnp.float8_e4m3fn),
                  v_pages=b16["v_pages"].astype(jnp.float8_e4m3fn))
        ref = reference_fn(b8["q"], b8["k_pages"], b8["v_pages"], b8["kv_lens"], b8["block_tables"][0],
                           b8["cu_q_lens"])
        for pool, b, variants in (("bf16", b16, [{}]), ("fp8", b8, DECODE_FP8_VARIANTS)):
            nbytes = io_bytes(b)
            for var in variants:
                row = dict(batch=batch, context=ctx, pool=pool, variant=var, bytes=nbytes)
                try:
                    if pool == "fp8":
                        out = jax.jit(ours(**var))(b["q"], b["k_pages"], b["v_pages"], b["kv_lens"],
                                                   b["block_tables"][0], b["cu_q_lens"])
                        row["rel_l2_vs_reference"], row["finite"] = rel_l2(out, ref, b["q"].shape[0])
                    t, _ = time_step(ours(**var), b, nbytes / 3e12, args.repeats)
                    row.update(bandwidth_fields(t, nbytes, ceiling))
                    log(f"batch {batch:4d} ctx {ctx:6d} {pool:4s} {str(var):40s} {t*1e6:9.1f} us "
                        f"{nbytes/t/1e9:7.0f} GB/s  rel_l2 {row.get('rel_l2_vs_reference', float('nan')):.2e}")
                except Exception as e:
                    row["error"] = repr(e)[:500]
                    log(f"ERR decode_kv_dtype {batch} {ctx} {pool} {var}: {e!r}"[:600])
                RESULTS["decode_kv_dtype"].append(row)
                flush_results()
        b16 = b8 = ref = None
        gc.collect()


def _prefill_cases():
    return [
        ("prefill 1x4096", [4096], [4096]),
        ("prefill 4x1024", [1024] * 4, [1024] * 4),
        ("chunked 512 over 3584 prefix", [512], [4096]),
        ("mixed 256-chunk@2048 + 255 decodes@2048", [256] + [1] * 255, [2048] * 256),
        ("prefill 1x16384", [16384], [16384]),
    ]


def section_prefill(args, variants=None, sweep=False):
    log("== prefill / mixed: TFLOP/s = 4*Hq*D*(visible keys) / time ==" if not sweep else "== prefill sweep ==")
    mm = RESULTS["ceiling"].get("matmul_TFLOPs")
    key = jax.random.key(40 if not sweep else 50)
    cases = _prefill_cases() if not sweep else _prefill_cases()[:1] + _prefill_cases()[3:4]
    variants = variants or [{}]
    for name, ql, kl in cases:
        key, sub = jax.random.split(key)
        b = make_batch(sub, ql, kl, num_rotations=1)
        flops = attention_flops(b)
        est = flops / 300e12
        for var in variants:
            row = dict(case=name, variant=var, flops=flops)
            try:
                t, n_inner = time_step(ours(**var), b, est, args.repeats)
                row.update(ours_us=t * 1e6, ours_TFLOPs=flops / t / 1e12, n_inner=n_inner)
                if mm:
                    row["frac_matmul"] = flops / t / 1e12 / mm
                if not sweep and sum(ql) <= args.ref_max_prefill:
                    tr, _ = time_step(reference_fn, b, est * 20, 3)
                    row.update(ref_us=tr * 1e6, ref_TFLOPs=flops / tr / 1e12)
                if not sweep and not var and len(ql) == 1 and ql[0] == kl[0]:
                    row.update(_dense_prefill_refs(b, flops, est, args.repeats))
                    for nm in ("jax_mha", "cudnn"):
                        if f"{nm}_us" in row:
                            log(f"    {nm:8s} (dense, contiguous KV) {row[nm + '_us']:9.1f} us "
                                f"{row[nm + '_TFLOPs']:6.1f} TFLOP/s")
                        elif f"{nm}_error" in row:
                            log(f"    {nm:8s} error: {row[nm + '_error'][:200]}")
                row["ours_GBps"] = io_bytes(b) / t / 1e9
                log(f"{name:42s} {str(var):48s} {row['ours_us']:9.1f} us {row['ours_TFLOPs']:6.1f} TFLOP/s "
                    f"({100 * row.get('frac_matmul', float('nan')):4.1f}% of matmul; KV+q+out {row['ours_GBps']:5.0f} GB/s)"
                    + (f" | xla_ref {row['ref_us']:9.1f} us {row['ref_TFLOPs']:6.1f} TFLOP/s" if "ref_us" in row
                       else ""))
            except Exception as e:
                row["error"] = repr(e)[:2000]
                log(f"ERR {name} {var}: {e!r}"[:2000])
            RESULTS["prefill_sweep" if sweep else "prefill"].append(row)
        b = None
        gc.collect()


def _dense_prefill_refs(b, flops, est, repeats):
    """Non-paged comparison points for one fresh causal prefill: JAX's Pallas-Triton flash attention (MHA: K/V
    repeated to Hq heads) and cuDNN flash attention through jax.nn.dot_product_attention (GQA)."""
    row = {}
    t = b["q"].shape[0]
    kd = jax.random.normal(jax.random.key(7), (1, t, HKV, D), DTYPE)
    vd = jax.random.normal(jax.random.key(8), (1, t, HKV, D), DTYPE)
    try:
        from jax.experimental.pallas.ops.gpu import attention as jattn

        group = HQ // HKV
        bd = dict(b, k_pages=jnp.repeat(kd, group, axis=2), v_pages=jnp.repeat(vd, group, axis=2))
        step = lambda q, k, v, *_: jattn.mha(q[None], k, v, None, sm_scale=SM_SCALE, causal=True)[0]  # noqa: E731
        tm, _ = time_step(step, bd, est, repeats)
        row.update(jax_mha_us=tm * 1e6, jax_mha_TFLOPs=flops / tm / 1e12)
    except Exception as e:
        row["jax_mha_error"] = repr(e)[:500]
    try:
        bd = dict(b, k_pages=kd, v_pages=vd)
        step = lambda q, k, v, *_: jax.nn.dot_product_attention(  # noqa: E731
            q[None], k, v, scale=SM_SCALE, is_causal=True, implementation="cudnn")[0]
        tc, _ = time_step(step, bd, est, repeats)
        row.update(cudnn_us=tc * 1e6, cudnn_TFLOPs=flops / tc / 1e12)
    except Exception as e:
        row["cudnn_error"] = repr(e)[:500]
    return row


def section_prefill_peers(args):
    """What other attention kernels reach on the same 4k-token causal prefill (Llama-3-8B heads), same run: ours
    (paged: the Triton kernel with default tuning, and the Mosaic GPU kernel), JAX's Pallas-Triton flash attention
    (dense, MHA), cuDNN flash attention (dense, GQA,
    through jax.nn.dot_product_attention) and JAX's Mosaic GPU (Hopper: TMA + wgmma + warp specialization) flash
    attention ``pallas.ops.gpu.attention_mgpu`` (dense, GQA) in a few tile configurations. Only ours reads a paged
    pool; the others are the ceilings of each backend on contiguous K/V."""
    log("== prefill peers: 1 x 4096 causal, TFLOP/s = 4*Hq*D*(visible keys) / time ==")
    mm = _matmul_tflops(args.repeats)
    n = 256 if TINY else 4096
    b = make_batch(jax.random.key(70), [n], [n])
    flops = attention_flops(b)
    est = flops / 300e12
    row = dict(case=f"prefill 1x{n}", flops=flops, matmul_TFLOPs=mm)
    t, _ = time_step(ours(), b, est, args.repeats)
    row.update(ours_us=t * 1e6, ours_TFLOPs=flops / t / 1e12)
    try:
        if INTERPRET:  # the Mosaic GPU interpreter on 32 heads takes minutes; the CPU smoke test skips it
            raise RuntimeError("skipped in interpret mode")
        t, _ = time_step(ours(impl="mosaic"), b, est, args.repeats)
        row.update(ours_mosaic_us=t * 1e6, ours_mosaic_TFLOPs=flops / t / 1e12)
    except Exception as e:
        row["ours_mosaic_error"] = repr(e)[:500]
    row.update(_dense_prefill_refs(b, flops, est, args.repeats))
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu as am

        for dtype_name in ("bfloat16", "float16"):
            dt = jnp.dtype(dtype_name)
            kd = jax.random.normal(jax.random.key(7), (1, n, HKV, D), dt)
            vd = jax.random.normal(jax.random.key(8), (1, n, HKV, D), dt)
            bd = dict(b, q=b["q"].astype(dt), k_pages=kd, v_pages=vd)
            for bq, bkv, steps in ((64, 128, 2), (64, 64, 2), (64, 128, 3), (64, 256, 2)):
                name = f"mgpu_{dtype_name}_bq{bq}_bkv{bkv}_st{steps}"
                if over_budget(name):
                    break
                try:
                    cfg = am.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=steps, causal=True)
                    # attention_mgpu has no scale argument (softmax(q k^T)); the run time does not depend on it.
                    step = lambda q, k, v, *_, cfg=cfg: am.attention(q[None], k, v, cfg)[0]  # noqa: E731
                    tm, _ = time_step(step, bd, est, args.repeats)
                    row.update({f"{name}_us": tm * 1e6, f"{name}_TFLOPs": flops / tm / 1e12})
                except Exception as e:
                    row[f"{name}_error"] = repr(e)[:500]
    except Exception as e:
        row["mgpu_error"] = repr(e)[:500]
    # Empty sequence slots: an engine-like bucket (2048 tokens, 256 slots) holding 2 prompts of 1024. Every slot
    # adds a tile to the static tile bound (the Triton kernel's grid; the Mosaic kernel's persistent grid does not
    # grow with it). The prefill_buckets section covers more bucket cases.
    if not TINY:
        be = make_batch(jax.random.key(71), [1024, 1024], [1024, 1024], pad_seqs=254)
        fe = attention_flops(be)
        for nm, fn in (("slots256_triton", ours()), ("slots256_mosaic", ours(impl="mosaic"))):
            try:
                te, _ = time_step(fn, be, fe / 300e12, args.repeats)
                row.update({f"{nm}_us": te * 1e6, f"{nm}_TFLOPs": fe / te / 1e12})
            except Exception as e:
                row[f"{nm}_error"] = repr(e)[:500]
    for k in sorted(row):
        if k.endswith("_TFLOPs") and k != "matmul_TFLOPs":
            log(f"  {k[:-7]:34s} {row[k[:-7] + '_us']:9.1f} us {row[k]:6.1f} TFLOP/s "
                f"{100 * row[k] / mm:5.1f}% of matmul")
        elif k.endswith("_error"):
            log(f"  {k:34s} {row[k][:300]}")
    RESULTS["prefill_peers"].append(row)
    flush_results()


# ----------------------------------------------------------------------------------------------------------------
# Prefill tuning options (triton_kernel module docstring): hi = kv_heads_inner, lf = longest_tiles_first,
# pp = prefetch_pages, sq = prescale_q, kt = k_transposed, zp = zero_padding_in_kernel. Tile shape
# "bq16 bk64 w4 s3" (block_q tokens, block_k keys, warps, stages) is the prefill default.

_HI_LF = dict(kv_heads_inner=True, longest_tiles_first=True)
_HI_LF_SQ = dict(_HI_LF, prescale_q=True)
_HI_LF_SQ_ZP = dict(_HI_LF_SQ, zero_padding_in_kernel=True)
PREFILL_OPTION_VARIANTS = [
    ("default (bq16 bk64 w4 s3)", {}),
    ("lf", dict(longest_tiles_first=True)),
    ("hi+lf", _HI_LF),
    ("hi+lf+sq", _HI_LF_SQ),
    ("hi+lf+sq+pp", dict(_HI_LF_SQ, prefetch_pages=True)),
    ("hi+lf+sq+kt", dict(_HI_LF_SQ, k_transposed=True)),
    ("hi+lf+sq+zp", _HI_LF_SQ_ZP),
    ("bk128 hi+lf+sq+zp", dict(_HI_LF_SQ_ZP, block_q=16, block_k=128, num_warps=4, num_stages=3)),
    ("bq32 bk64 w8 s3 hi+lf+sq+zp", dict(_HI_LF_SQ_ZP, block_q=32, block_k=64, num_warps=8, num_stages=3)),
    ("bq32 bk128 w8 s3 hi+lf+sq+zp", dict(_HI_LF_SQ_ZP, block_q=32, block_k=128, num_warps=8, num_stages=3)),
    ("bq32 bk128 w8 s2 hi+lf+sq+zp+kt", dict(_HI_LF_SQ_ZP, k_transposed=True, block_q=32, block_k=128,
                                             num_warps=8, num_stages=2)),
    ("bq32 bk64 w8 s3 all", dict(ALL_OPTIONS, block_q=32, block_k=64, num_warps=8, num_stages=3)),
]
# The Mosaic GPU kernel (mgpu_kernel): default = 2 x 64-row warpgroups, 128-key steps, 2 ring slots, longest first.
MOSAIC_VARIANTS = [
    ("mosaic default (bkv128 st2 lf)", dict(impl="mosaic")),
    ("mosaic bkv64", dict(impl="mosaic", block_kv=64)),
    ("mosaic bkv64 st3", dict(impl="mosaic", block_kv=64, num_stages=3)),
    ("mosaic no lf", dict(impl="mosaic", longest_tiles_first=False)),
]


def _matmul_tflops(repeats):
    """The same-run bf16 matmul ceiling: from the ``ceiling`` section, else measured here (a few seconds)."""
    if "matmul_TFLOPs" not in RESULTS["ceiling"]:
        m = 256 if TINY else 8192
        a = jax.random.normal(jax.random.key(2), (m, m), jnp.bfloat16)
        bm = jax.random.normal(jax.random.key(3), (m, m), jnp.bfloat16)
        t = median_time(jax.jit(lambda u, v: u @ v), (a, bm), repeats)
        RESULTS["ceiling"]["matmul_TFLOPs"] = 2 * m**3 / t / 1e12
        log(f"bf16 8192^3 matmul: {RESULTS['ceiling']['matmul_TFLOPs']:.1f} TFLOP/s")
    return RESULTS["ceiling"]["matmul_TFLOPs"]


def section_prefill_variants(args):
    """Each prefill tuning variant on three prefill cases: checked against the reference, then timed.

    1x4096 and 4x1024 share static shapes (T 4096, 4 sequence slots, 256-entry tables), so one compilation per
    variant serves both; the chunked case (T 512) compiles once more. At most ~12 variants x 2 compilations.
    """
    log("== prefill variants: Llama-3-8B heads, bf16, block_size 16; TFLOP/s = 4*Hq*D*(visible keys) / time ==")
    mm = _matmul_tflops(args.repeats)
    key = jax.random.key(60)
    cases = [  # name, q_lens, kv_lens, sequence slots, table width: equal shapes share a compilation
        ("1x4096", [4096], [4096], 4, 256),
        ("4x1024", [1024] * 4, [1024] * 4, 4, 256),
        ("512 over 3584", [512], [4096], 1, 256),
    ]
    if TINY:  # token counts / 64: 64-token prefill, 4 x 16, 8 over a 56-token prefix
        cases = [(n, [x // 64 for x in ql], [x // 64 for x in kl], slots, width // 64)
                 for n, ql, kl, slots, width in cases]
    batches = {}
    for name, ql, kl, slots, width in cases:
        key, sub = jax.random.split(key)
        b = make_batch(sub, ql, kl, pad_seqs=slots - len(ql), max_blocks=width)
        ref_fn = jax.jit(lambda q, kp, vp, kl_, bt, cu: ragged_paged_attention_reference(
            q.astype(jnp.float32), kp.astype(jnp.float32), vp.astype(jnp.float32), kl_, bt, cu,
            sm_scale=SM_SCALE, max_chunk_bytes=1 << 30))
        ref = ref_fn(b["q"], b["k_pages"], b["v_pages"], b["kv_lens"], b["block_tables"][0], b["cu_q_lens"])
        batches[name] = (b, np.asarray(ref), attention_flops(b))
        log(f"case {name}: T={b['q'].shape[0]} S={len(b['q_lens_np'])} tables {tuple(b['block_tables'].shape[1:])}"
            f" {attention_flops(b) / 1e9:.1f} GFLOP")
    variants = PREFILL_OPTION_VARIANTS[: args.max_variants]
    if args.mosaic_variants:
        variants = variants + MOSAIC_VARIANTS[: args.mosaic_variants]
    rows = {}
    for vname, var in variants:
        if over_budget(f"prefill variant {vname}"):
            break
        run = looped_dynamic(ours(**var))
        for name, *_ in cases:
            b, ref, flops = batches[name]
            row = dict(case=name, variant=vname, options=var, flops=flops)
            try:
                b_args = (b["q"], b["k_pages"], b["v_pages"], b["kv_lens"], b["block_tables"], b["cu_q_lens"])
                if var.get("impl") == "mosaic":
                    mosaic_var = {k: v for k, v in var.items() if k != "impl"}
                    row["tuning"] = mosaic_default_tuning(D, BLOCK_SIZE, **mosaic_var)
                else:
                    row["tuning"] = default_tuning(b["q"].shape[0], len(b["q_lens_np"]), HQ, HKV,
                                                   b["block_tables"].shape[2], BLOCK_SIZE, **var)
                t0 = time.time()
                out = jax.block_until_ready(run(jnp.int32(1), *b_args))
                row["first_call_s"] = time.time() - t0  # compile (first case of the shape group) + one step
                n_real = int(b["cu_q_lens"][-1])
                err, finite = rel_l2(out, ref, n_real)
                row.update(rel_l2=err, finite=finite, ok=finite and err < 2e-2)
                if row["ok"]:
                    n_inner = n_inner_for(flops / 300e12)
                    n = jnp.int32(n_inner)
                    t = median_time(run, (n, *b_args), args.repeats) / n_inner
                    row.update(us=t * 1e6, TFLOPs=flops / t / 1e12, frac_matmul=flops / t / 1e12 / mm,
                               n_inner=n_inner)
                    log(f"{vname:32s} {name:14s} {t * 1e6:8.1f} us {row['TFLOPs']:6.1f} TFLOP/s "
                        f"{100 * row['frac_matmul']:5.1f}% of matmul  rel_l2 {err:.1e}")
                else:
                    log(f"BAD {vname:28s} {name:14s} rel_l2 {err:.2e} finite={finite}: not timed")
            except Exception as e:  # a Triton lowering / resource failure of one variant must not end the run
                row["error"] = repr(e)[:2000]
                log(f"ERR {vname} {name}: {e!r}"[:1500])
            RESULTS["prefill_variants"].append(row)
            rows[(vname, name)] = row
            flush_results()
        run = None
        gc.collect()
    _prefill_variant_table(variants, [c[0] for c in cases], rows, mm)


def _prefill_variant_table(variants, case_names, rows, mm):
    """Compact table and the recommended prefill default (best geometric-mean TFLOP/s over the cases)."""
    log(f"-- prefill variants (same-run bf16 matmul ceiling {mm:.0f} TFLOP/s; us / TFLOP/s / % of ceiling) --")
    log(f"{'variant':32s} " + " | ".join(f"{c:>24s}" for c in case_names) + " | geomean speedup vs default")
    default_name = variants[0][0]
    scores = []
    for vname, var in variants:
        cells, times = [], []
        for c in case_names:
            row = rows.get((vname, c))
            if row is None:
                cells.append(f"{'not run':>24s}")
            elif "us" in row:
                cells.append(f"{row['us']:8.1f} {row['TFLOPs']:6.1f} {100 * row['frac_matmul']:5.1f}%  ")
                times.append(row["us"])
            else:
                cells.append(f"{'ERR' if 'error' in row else 'BAD':>24s}")
        speed = ""
        if len(times) == len(case_names):
            ref_rows = [rows.get((default_name, c)) for c in case_names]
            geo_tflops = math.exp(statistics.fmean(
                math.log(rows[(vname, c)]["TFLOPs"]) for c in case_names))
            scores.append((geo_tflops, vname, var))
            if all(r is not None and "us" in r for r in ref_rows):
                speedup = math.exp(statistics.fmean(math.log(r["us"] / t) for r, t in zip(ref_rows, times)))
                speed = f"{speedup:5.3f}x"
        log(f"{vname:32s} " + " | ".join(cells) + f" | {speed}")
    if not scores:
        log("no variant ran on every case: no recommendation")
        return
    best_geo, best_name, best_var = max(scores)
    per_case = {}
    for c in case_names:
        timed = [(rows[(v, c)]["us"], v) for v, _ in variants if "us" in rows.get((v, c), {})]
        if timed:
            per_case[c] = min(timed)
    RESULTS["prefill_recommendation"] = dict(variant=best_name, options=best_var, geomean_TFLOPs=best_geo,
                                             best_per_case={c: dict(variant=v, us=t) for c, (t, v) in
                                                            per_case.items()})
    log(f"RECOMMENDED prefill tuning (best geomean over the cases, {best_geo:.1f} TFLOP/s): {best_name} = {best_var}")
    for c, (t, v) in per_case.items():
        log(f"  best on {c}: {v} ({t:.1f} us)")
    log("  (the kernel default is unchanged: apply it to default_tuning's prefill branch after review)")


# ----------------------------------------------------------------------------------------------------------------
# The engine's prefill-sized buckets: T tokens x 256 sequence slots (most of them padding), as a step of the engine
# pads them; one pool size and one table width per T, so each implementation compiles once per T.

BUCKET_SLOTS = 256
# (name, q_lens, kv_lens, bucket tokens T). Groups of equal T share static shapes. T 512 / 1024: the buckets on
# either side of choose_impl's MOSAIC_MIN_TOKENS (where "auto" switches from the Triton kernel to the hybrid path).
PREFILL_BUCKET_CASES = [
    ("1x2048", [2048], [2048], 2048),
    ("2x1024", [1024] * 2, [1024] * 2, 2048),
    ("8x256", [256] * 8, [256] * 8, 2048),
    ("mixed 200 decodes@1024 + 1800 chunk", [1] * 200 + [1800], [1024] * 200 + [1800], 2048),
    ("1x4096", [4096], [4096], 4096),
    ("512 over 3584", [512], [4096], 4096),
    ("512 over 3584 (T 512)", [512], [4096], 512),
    ("1x1024 (T 1024)", [1024], [1024], 1024),
]
# --tiny (CPU smoke test in interpret mode): 2 query heads, 8 slots, a few dozen tokens; the Mosaic kernel on 2
# persistent programs and the hybrid's split at 8 query tokens (the interpreter's cost is per program).
PREFILL_BUCKET_CASES_TINY = [
    ("1x32", [32], [32], 32),
    ("mixed 3 decodes@16 + 24 chunk", [1, 1, 1, 24], [16, 16, 16, 24], 32),
    ("8 over 56", [8], [64], 64),
]


def _bucket_batch(key, q_lens, kv_lens, num_tokens, num_slots, num_blocks, width, hq, hkv):
    """A bucket-shaped batch: the real sequences' pages drawn without repeat from a pool of ``num_blocks`` blocks,
    the other slots padding (q_len 0, kv_len 0, tables on the null block), tokens past the real ones padding.
    Same dict layout as ``make_batch`` (block tables ``[1, S, width]``)."""
    rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**31 - 1)))
    q_np = np.zeros(num_slots, np.int32)
    kv_np = np.zeros(num_slots, np.int32)
    q_np[: len(q_lens)], kv_np[: len(kv_lens)] = q_lens, kv_lens
    needed = -(-kv_np // BLOCK_SIZE)
    free = rng.permutation(np.arange(1, num_blocks, dtype=np.int32))
    tables = np.zeros((1, num_slots, width), np.int32)
    used = 0
    for s, n in enumerate(needed):
        tables[0, s, :n] = free[used: used + n]
        used += n
    cu = np.concatenate([[0], np.cumsum(q_np)]).astype(np.int32)
    kq, kk, kv = jax.random.split(key, 3)
    gen = jax.jit(lambda k, shape: jax.random.normal(k, shape, DTYPE), static_argnums=1)
    return dict(q=gen(kq, (num_tokens, hq, D)), k_pages=gen(kk, (num_blocks, BLOCK_SIZE, hkv, D)),
                v_pages=gen(kv, (num_blocks, BLOCK_SIZE, hkv, D)), kv_lens=jnp.asarray(kv_np),
                block_tables=jnp.asarray(tables), cu_q_lens=jnp.asarray(cu), q_lens_np=q_np, kv_lens_np=kv_np)


def section_prefill_buckets(args):
    """Prefill-sized engine buckets (T = 2048 / 4096 tokens x 256 sequence slots; probes at T 512 / 1024): what
    ``impl="auto"`` picks (on Hopper: the hybrid path at T >= MOSAIC_MIN_TOKENS) vs the Triton kernel alone vs
    the Mosaic kernel alone (persistent grid) vs the hybrid path forced; every implementation checked against the
    jnp reference (fp32) on each case first, then timed. TFLOP/s = useful causal FLOPs (4*Hq*D*visible keys) /
    time, and the share of the same-run bf16 matmul rate (the ``ceiling`` section's, else measured here)."""
    from paged_jax.ops.ragged_paged_attention import choose_impl
    from paged_jax.ops.ragged_paged_attention.hybrid import ragged_paged_attention_hybrid

    log("== prefill buckets: T tokens x sequence slots, Llama-3-8B heads, bf16, block_size 16; "
        "TFLOP/s = 4*Hq*D*(visible keys) / time ==")
    mm = _matmul_tflops(args.repeats)
    hq, hkv = (2, 1) if TINY else (HQ, HKV)
    slots = 8 if TINY else BUCKET_SLOTS
    cases = PREFILL_BUCKET_CASES_TINY if TINY else PREFILL_BUCKET_CASES
    mosaic_tuning = dict(num_programs=2) if TINY else {}
    split_at = 8 if TINY else None  # None: the hybrid's MOSAIC_MIN_Q_LEN
    scale = 1.0 / math.sqrt(D)

    def hybrid(q, kp, vp, kl, bt, cu):
        return ragged_paged_attention_hybrid(q, kp, vp, kl, bt, cu, sm_scale=scale, interpret=INTERPRET,
                                             min_q_len=split_at, mosaic_tuning=mosaic_tuning)

    impls = [("auto", ours("auto")), ("triton", ours("triton")), ("mosaic", ours("mosaic", **mosaic_tuning)),
             ("hybrid", hybrid)]
    # One pool for every case (static shapes shared within a T group): the largest case's pages plus the null block.
    num_blocks = 1 + max(int(sum(-(-k // BLOCK_SIZE) for k in kl)) for _, _, kl, _ in cases)
    widths = {}
    for _, _, kl, t in cases:
        widths[t] = max(widths.get(t, 1), -(-max(kl) // BLOCK_SIZE))
    key = jax.random.key(80)
    runs = {}  # (impl, T) -> one jitted looped function (compiled once per group)
    summary = {}
    for name, ql, kl, t in cases:
        if over_budget(f"prefill bucket {name}"):
            break
        key, sub = jax.random.split(key)
        b = _bucket_batch(sub, ql, kl, t, slots, num_blocks, widths[t], hq, hkv)
        b_args = (b["q"], b["k_pages"], b["v_pages"], b["kv_lens"], b["block_tables"], b["cu_q_lens"])
        flops = attention_flops(b)
        ref = np.asarray(jax.jit(lambda q, kp, vp, kl_, bt, cu: ragged_paged_attention_reference(
            q.astype(jnp.float32), kp.astype(jnp.float32), vp.astype(jnp.float32), kl_, bt, cu, sm_scale=scale,
            max_chunk_bytes=1 << 30))(b["q"], b["k_pages"], b["v_pages"], b["kv_lens"], b["block_tables"][0],
                                      b["cu_q_lens"]))
        auto_pick = choose_impl(b["q"].shape, b["k_pages"].shape, b["q"].dtype, slots, kv_dtype=b["k_pages"].dtype)
        n_real = int(b["cu_q_lens"][-1])
        log(f"case {name}: T={t} S={slots} real tokens {n_real} {flops / 1e9:.1f} GFLOP; auto -> {auto_pick}")
        for impl, fn in impls:
            row = dict(case=name, impl=impl, bucket_tokens=t, slots=slots, flops=flops, auto_pick=auto_pick)
            try:
                run = runs.setdefault((impl, t), looped_dynamic(fn))
                out = jax.block_until_ready(run(jnp.int32(1), *b_args))
                err, finite = rel_l2(out, ref, n_real)
                pad_zero = bool(np.all(np.asarray(out[n_real:].astype(jnp.float32)) == 0))
                row.update(rel_l2=err, finite=finite, pad_zero=pad_zero, ok=finite and pad_zero and err < 2e-2)
                if row["ok"]:
                    n_inner = n_inner_for(flops / 300e12)
                    tm = median_time(run, (jnp.int32(n_inner), *b_args), args.repeats) / n_inner
                    row.update(us=tm * 1e6, TFLOPs=flops / tm / 1e12, frac_matmul=flops / tm / 1e12 / mm,
                               matmul_TFLOPs=mm, n_inner=n_inner)
                    summary[(name, impl)] = tm
                    log(f"  {impl:7s} {tm * 1e6:9.1f} us {row['TFLOPs']:6.1f} TFLOP/s "
                        f"{100 * row['frac_matmul']:5.1f}% of matmul  rel_l2 {err:.1e}")
                else:
                    log(f"  BAD {impl:7s} rel_l2 {err:.2e} finite={finite} pad_zero={pad_zero}: not timed")
            except Exception as e:  # one implementation failing must not end the section
                row["error"] = repr(e)[:2000]
                log(f"  ERR {impl}: {e!r}"[:1500])
            RESULTS["prefill_buckets"].append(row)
            log(json.dumps({k: v for k, v in row.items() if k != "error"}, default=str))
            flush_results()
        b = None
        gc.collect()
    log(f"-- prefill buckets: time vs the Triton kernel alone (same-run bf16 matmul {mm:.0f} TFLOP/s) --")
    for name, *_ in cases:
        base = summary.get((name, "triton"))
        cells = [f"{impl} {base / summary[(name, impl)]:5.2f}x" for impl, _ in impls
                 if base and (name, impl) in summary and impl != "triton"]
        if cells:
            log(f"  {name:40s} " + "  ".join(cells))


DECODE_COMPARE_POINTS = [(8, 2048), (32, 8192), (128, 2048), (1, 32768)]
DECODE_GRID_POINTS = [(1, 512), (1, 32768), (8, 2048), (8, 32768), (32, 512), (32, 8192), (64, 2048),
                      (128, 8192), (256, 512), (256, 2048)]


def section_decode_compare(args):
    """Ours vs JAX's deprecated Pallas ``paged_attention`` (its own [Hkv, pages, page, D] layout, its defaults)
    vs the XLA reference, on decode points that JAX's kernel supports (pages per sequence divisible by its 16
    k-splits). JAX's kernel takes no sm_scale: its correctness check feeds it ``q * sm_scale``."""
    log("== decode compare: ours vs jax pallas paged_attention vs XLA reference (GB/s = KV+q+out bytes / time) ==")
    ceiling = RESULTS["ceiling"].get("copy_GBps")
    key = jax.random.key(70)
    log(f"{'batch':>5} {'ctx':>6} | {'ours us':>8} {'GB/s':>6} {'%copy':>5} | {'jax_pa us':>9} {'GB/s':>6} "
        f"{'rel_l2':>7} | {'xla_ref us':>10} {'GB/s':>6} | ours speedup vs jax_pa, vs xla")
    for batch, ctx in [(2, 256), (1, 512)] if TINY else DECODE_COMPARE_POINTS:
        if over_budget(f"decode_compare {batch}x{ctx}"):
            break
        key, sub = jax.random.split(key)
        row = dict(batch=batch, context=ctx)
        try:
            b, rot = _decode_batch(sub, batch, ctx)
            row["rotations"] = rot
            nbytes = io_bytes(b)
            est = nbytes / 3.0e12
            b_args = (b["q"], b["k_pages"], b["v_pages"], b["kv_lens"], b["block_tables"], b["cu_q_lens"])
            run = looped_dynamic(ours())
            ours_out = np.asarray(run(jnp.int32(1), *b_args).astype(jnp.float32))
            n_inner = n_inner_for(est)
            t = median_time(run, (jnp.int32(n_inner), *b_args), args.repeats) / n_inner
            row.update(bytes=nbytes, **bandwidth_fields(t, nbytes, ceiling, "ours_"))
            try:
                kp_h = jnp.transpose(b["k_pages"], (2, 0, 1, 3))
                vp_h = jnp.transpose(b["v_pages"], (2, 0, 1, 3))
                run_j = looped_dynamic(_jax_paged_attention_step(None))
                out_j = run_j(jnp.int32(1), (b["q"].astype(jnp.float32) * SM_SCALE).astype(b["q"].dtype), kp_h,
                              vp_h, b["kv_lens"], b["block_tables"], b["cu_q_lens"])
                row["jax_pa_rel_l2_vs_ours"], _ = rel_l2(out_j, ours_out, batch)
                tj = median_time(run_j, (jnp.int32(n_inner), b["q"], kp_h, vp_h, b["kv_lens"], b["block_tables"],
                                         b["cu_q_lens"]), args.repeats) / n_inner
                row.update(jax_pa_us=tj * 1e6, jax_pa_GBps=nbytes / tj / 1e9)
                del kp_h, vp_h
            except Exception as e:
                row["jax_pa_error"] = repr(e)[:1000]
            if batch * ctx <= args.ref_max_tokens:
                tr, _ = time_step(reference_fn, b, est * 10, max(3, args.repeats // 2))
                row.update(ref_us=tr * 1e6, ref_GBps=nbytes / tr / 1e9)
            nan = float("nan")
            log(f"{batch:5d} {ctx:6d} | {row['ours_us']:8.1f} {row['ours_GBps']:6.0f} "
                f"{100 * row.get('ours_frac_copy_ceiling', nan):5.1f} | {row.get('jax_pa_us', nan):9.1f} "
                f"{row.get('jax_pa_GBps', nan):6.0f} {row.get('jax_pa_rel_l2_vs_ours', nan):7.1e} | "
                f"{row.get('ref_us', nan):10.1f} {row.get('ref_GBps', nan):6.0f} | "
                f"{row.get('jax_pa_us', nan) / row['ours_us']:5.2f}x {row.get('ref_us', nan) / row['ours_us']:6.2f}x"
                + (f"  jax_pa_error={row['jax_pa_error'][:200]}" if "jax_pa_error" in row else ""))
        except Exception as e:
            row["error"] = repr(e)[:2000]
            log(f"ERR decode_compare batch={batch} ctx={ctx}: {e!r}"[:2000])
        RESULTS["decode_compare"].append(row)
        flush_results()
        b = run = None
        gc.collect()


def section_decode_grid(args):
    """Ours alone (default tuning) on a sparse decode grid, batch 1..256 x context 512..32k."""
    log("== decode grid: ours, default tuning (GB/s = KV+q+out bytes / time) ==")
    ceiling = RESULTS["ceiling"].get("copy_GBps")
    key = jax.random.key(80)
    log(f"{'batch':>5} {'ctx':>6} {'tuning':>24} | {'us':>8} {'GB/s':>6} {'% of copy':>9}")
    for batch, ctx in [(1, 64), (3, 100)] if TINY else DECODE_GRID_POINTS:
        if over_budget(f"decode_grid {batch}x{ctx}"):
            break
        key, sub = jax.random.split(key)
        row = dict(batch=batch, context=ctx)
        b = None
        try:
            b, rot = _decode_batch(sub, batch, ctx)
            nbytes = io_bytes(b)
            tun = default_tuning(batch, batch, HQ, HKV, b["block_tables"].shape[2], BLOCK_SIZE)
            t, n_inner = time_step(ours(), b, nbytes / 3.0e12, args.repeats)
            row.update(rotations=rot, tuning=tun, bytes=nbytes, n_inner=n_inner, **bandwidth_fields(t, nbytes, ceiling))
            tun_s = f"bq{tun['block_q']} bk{tun['block_k']} s{tun['num_kv_splits']} w{tun['num_warps']}"
            log(f"{batch:5d} {ctx:6d} {tun_s:>24s} | {t * 1e6:8.1f} {row['GBps']:6.0f} "
                f"{100 * row.get('frac_copy_ceiling', float('nan')):8.1f}%")
        except Exception as e:
            row["error"] = repr(e)[:2000]
            log(f"ERR decode_grid batch={batch} ctx={ctx}: {e!r}"[:2000])
        RESULTS["decode_grid"].append(row)
        flush_results()
        b = None
        gc.collect()


RMS_NORM_SHAPES = ((1, 4096), (256, 1024), (2048, 4096), (1, 8192))  # (rows, hidden): decode and prefill rows
RMS_NORM_CHAIN = 64  # norms per timed call: a Llama-3.1-8B step has 64 (two per layer)


def section_rms_norm(args):
    """The fused residual add + RMSNorm (``paged_jax.ops.rms_norm``) vs XLA's fusion of the jnp reference (the add,
    the sum of squares, the scaling), bf16: max abs difference on the GPU, then time per norm. Each timed call runs
    a chain of ``RMS_NORM_CHAIN`` dependent norms (the normed rows and the new residual feed the next), with an
    optimization barrier between links so XLA cannot fuse one norm's scaling into the next one's add (in the model
    a matmul sits there); time per norm = median call / chain length. ``floor_us``: the bytes one norm moves (x and
    residual in, normed and residual out, the weight) at ``--hbm-gbps``."""
    from models.norm import rms_norm_reference
    from paged_jax.ops.rms_norm import rms_norm_pallas

    log("== fused residual add + RMSNorm (bf16) ==")
    RESULTS["rms_norm"] = []
    for rows, hidden in ((8, 64), (3, 1000)) if TINY else RMS_NORM_SHAPES:
        if over_budget(f"rms_norm {rows}x{hidden}"):
            break
        kx, kr, kw = jax.random.split(jax.random.key(rows * 7919 + hidden), 3)
        x = jax.random.normal(kx, (rows, hidden), jnp.bfloat16)
        residual = jax.random.normal(kr, (rows, hidden), jnp.bfloat16)
        weight = (1.0 + 0.1 * jax.random.normal(kw, (hidden,), jnp.float32)).astype(jnp.bfloat16)
        eps = 1e-5
        kernel = jax.jit(lambda a, r, w: rms_norm_pallas(a, w, r, eps=eps, interpret=INTERPRET))
        reference = jax.jit(lambda a, r, w: rms_norm_reference(a, w, r, eps=eps))
        (got, got_res), (want, want_res) = kernel(x, residual, weight), reference(x, residual, weight)
        max_abs = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        residual_equal = bool(jnp.array_equal(got_res, want_res))

        def chain(norm):
            def run(a, r, w):
                for _ in range(RMS_NORM_CHAIN):
                    a, r = lax.optimization_barrier(norm(a, r, w))
                return a, r

            return jax.jit(run)

        chain_len = 2 if TINY else RMS_NORM_CHAIN
        times = {}
        for name, norm in (("pallas", lambda a, r, w: rms_norm_pallas(a, w, r, eps=eps, interpret=INTERPRET)),
                           ("xla", lambda a, r, w: rms_norm_reference(a, w, r, eps=eps))):
            run = chain(norm) if not TINY else jax.jit(lambda a, r, w, norm=norm: norm(*norm(a, r, w), w))
            times[name] = median_time(run, (x, residual, weight), args.repeats) / chain_len * 1e6
        floor_us = (4 * rows * hidden + hidden) * 2 / (args.hbm_gbps * 1e9) * 1e6
        record = dict(figure="rms_norm", rows=rows, hidden=hidden, dtype="bfloat16", max_abs_diff=max_abs,
                      residual_bit_equal=residual_equal, pallas_us=times["pallas"], xla_us=times["xla"],
                      floor_us=floor_us, chain=chain_len)
        RESULTS["rms_norm"].append(record)
        print(json.dumps(record), flush=True)
        log(f"{rows:5d} x {hidden:5d}: max|diff| {max_abs:.3g} residual equal {residual_equal}  pallas "
            f"{times['pallas']:7.2f} us  xla {times['xla']:7.2f} us  floor {floor_us:6.2f} us")
        flush_results()


# Triton prefill tunings timed by ``--sections prefill_sweep``: the default, the previous default (8 warps, 2 stages)
# and other block / warp / stage choices.
PREFILL_VARIANTS = [
    {}, dict(block_q=16, block_k=64, num_warps=8, num_stages=2), dict(block_q=16, block_k=64, num_warps=4),
    dict(block_q=16, block_k=64, num_warps=4, num_stages=3),
    dict(block_q=16, block_k=128, num_warps=8), dict(block_q=32, block_k=64, num_warps=8),
    dict(block_q=32, block_k=64, num_warps=8, num_stages=3), dict(block_q=32, block_k=128, num_warps=8),
    dict(block_q=32, block_k=32, num_warps=4, num_stages=3),
]


def section_qk_prepare(args):
    from benchmarks.qk_prepare_kernel import run_section

    run_section(args.repeats, log=log, results=RESULTS["qk_prepare"], interpret=INTERPRET, tiny=TINY,
                over_budget=over_budget, flush=flush_results)


# --sections name -> what it runs (each takes the parsed arguments).
SECTIONS = {
    "ceiling": section_ceiling,
    "check": section_check,
    "decode": section_decode,
    "decode_sweep": section_decode_sweep,
    "decode_kv_dtype": section_decode_kv_dtype,
    "prefill": section_prefill,
    "prefill_sweep": lambda args: section_prefill(args, variants=PREFILL_VARIANTS, sweep=True),
    "prefill_variants": section_prefill_variants,
    "check_mosaic": section_check_mosaic,
    "prefill_peers": section_prefill_peers,
    "prefill_buckets": section_prefill_buckets,
    "decode_compare": section_decode_compare,
    "decode_grid": section_decode_grid,
    "rms_norm": section_rms_norm,
    "qk_prepare": section_qk_prepare,
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--sections", default="ceiling,check,decode,prefill,decode_sweep,prefill_sweep")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--decode-batches", default="1,8,32,64,128,256")
    parser.add_argument("--decode-contexts", default="512,2048,8192,32768")
    parser.add_argument("--ref-max-tokens", type=int, default=32 * 8192, help="skip the XLA reference above this")
    parser.add_argument("--ref-max-prefill", type=int, default=4096)
    parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU smoke test)")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny sizes in prefill_variants / decode_compare / decode_grid (CPU smoke test)")
    parser.add_argument("--check-cases", type=int, default=100, help="run only the first N correctness cases")
    parser.add_argument("--max-variants", type=int, default=len(PREFILL_OPTION_VARIANTS),
                        help="prefill_variants: run only the first N variants")
    parser.add_argument("--mosaic-variants", type=int, default=0,
                        help="prefill_variants: also time the first N Mosaic GPU kernel variants (Hopper)")
    parser.add_argument("--hbm-gbps", type=float, default=H200_HBM_BYTES_PER_S / 1e9,
                        help="rms_norm: bandwidth of the floor (benchmarks/floors.py's H200 figure)")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no new case after this many seconds (results so far are kept)")
    parser.add_argument("--section-budgets", default=DEFAULT_SECTION_BUDGETS,
                        help="comma-separated section=seconds soft limits (sections not named: unlimited)")
    args = parser.parse_args()
    global INTERPRET, OUT_DIR, DEADLINE, SECTION_DEADLINE, TINY
    INTERPRET = args.interpret
    TINY = args.tiny
    OUT_DIR = args.out
    os.makedirs(args.out, exist_ok=True)
    dev = jax.devices()[0]
    RESULTS["meta"] = dict(jax=jax.__version__, device=str(getattr(dev, "device_kind", dev)),
                           backend=jax.default_backend(), date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                           argv=sys.argv)
    log(f"jax {jax.__version__} on {RESULTS['meta']['device']} ({jax.default_backend()})")
    t_start = time.time()
    DEADLINE = t_start + args.budget_s
    sections = args.sections.split(",")
    section_budgets = {k: float(v) for k, v in (item.split("=") for item in args.section_budgets.split(",") if item)}
    for sec in sections:
        t0 = time.time()
        SECTION_DEADLINE = t0 + section_budgets.get(sec, float("inf"))
        try:
            if sec not in SECTIONS:
                raise ValueError(f"unknown section {sec!r}")
            SECTIONS[sec](args)
        except Exception as e:
            RESULTS["errors"].append(dict(section=sec, error=repr(e)[:2000]))
            log(f"ERR section {sec}: {e!r}"[:2000])
            traceback.print_exc()
        log(f"-- section {sec} took {time.time() - t0:.1f} s")
        flush_results()
    log(f"total {time.time() - t_start:.1f} s")
    flush_results()


if __name__ == "__main__":
    main()
