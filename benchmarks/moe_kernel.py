"""The fused MoE op (``paged_jax.ops.fused_moe``) on one sparse layer: the Pallas grouped-matmul kernel (its default
launch and a sweep of launch configs) against the XLA forms, with the memory floor of the experts the step reads.

Shape: Qwen3-30B-A3B's experts by default (hidden 2048, expert width 768, 128 experts, top 8; gpt-oss-20b's, hidden
2880, width 2880, 32 experts, top 4, with ``--weights mxfp4``: ``layer_shape``), random bf16 weights
(std 0.02) and random routers (each token's top-k of a random softmax: uneven loads, experts without tokens at small
T). Per token count T, one JSON line:

* ``<form>_us``: microseconds per call of the op (sort, gate/up + SwiGLU, down, top-k combine), measured as GPU
  throughput: ``--repeats`` calls dispatched back to back, cycling over ``--rotations`` routings (so the experts
  one call reads are not still in L2 from the call before, as a model's next layer would not find them), one wait
  at the end; the median of 3 such rounds. Forms: ``pallas`` (the kernel, ``default_config``), ``ragged_dot`` (the
  reference: gate and up as two ragged_dots), ``ragged_dot_fused`` (one ragged_dot over the gate|up weights
  concatenated once, outside the timing: XLA's best sorted form), and for T <= ``--gather-max-tokens``
  ``gather_dot`` / ``gather_reduce`` (``models.moe.moe_experts_gathered``: every pair's expert gathered, no sort),
  and for bf16 experts ``pallas_pairs`` (``models.moe.moe_experts_pairs`` on the pair kernel,
  ``paged_jax.ops.fused_moe.pair_experts_pallas``: what ``moe_impl="pallas"`` runs up to
  ``models.moe.PAIR_FORM_MAX_PAIRS`` pairs) with its launches of ``PAIR_SWEEP`` as ``pairs_<n>_<k>_<warps>``;
* ``check``: each form's max abs difference against the reference (float32), and the reference's max; ``errors``:
  each form but the reference that failed to compile or run, with its error (it is then not timed);
* ``configs``: per kernel launch config swept (``--configs``; "auto": ``sweep_configs(T)``), the op's time, its
  ratio to the floor and its max abs difference, or the error that stopped it; ``best_config`` the fastest;
* ``experts_touched`` (mean over the rotations) and ``floor_us``: the time to read their weights plus the
  activations once (x, the gate|up and SwiGLU rows, the down rows, the output) at ``floors.H200_HBM_BYTES_PER_S``;
  with ``--ceilings``, ``floor_measured_us`` at this device's measured copy bandwidth;
* ``split`` (T in ``--split-tokens``): the parts of the default op timed alone the same way (``route``: router
  matmul and top-k; ``sort``: sort by expert and the rows' tokens; ``gate_up`` and ``down``: the kernels with their
  partial sums; ``combine``: back to pair order and the weighted top-k sum) and ``hlo_launches``: the compiled op's
  kernel-launching instructions by opcode.

``--weights fp8``: block-FP8 experts as the DeepSeek and Qwen FP8 checkpoints hold them (float8_e4m3fn, one float32
scale per ``--fp8-block`` square of each expert's ``[out, in]``; ``models.quantization.block_fp8.BlockFp8Experts``):
``pallas`` is then the kernel dequantizing each tile, ``ragged_dot`` the reference (the layer's experts dequantized
to bf16, then ``lax.ragged_dot``), ``gather_*`` gather the float8 experts and dequantize those, and ``pallas_bf16``
/ ``ragged_dot_fused`` the bf16 forms on the same weights dequantized once outside the timing; the floor counts one
byte per weight.

``--weights mxfp4``: gpt-oss's layer (``models.gpt_oss.experts_grouped``: gate|up interleaved in one matmul, biases,
the clamped SwiGLU) on random MXFP4
experts (random fp4 codes, scales 2 ** -7; ``models.quantization.mxfp4.Mxfp4Experts``): ``pallas`` is the kernel
decoding each packed tile, ``dequant_pallas`` the layer's experts dequantized to bf16 in the call and then the
kernel, ``ragged_dot`` the XLA reference (dequantize, ``lax.ragged_dot``), ``matvec`` (T <= ``--gather-max-tokens``)
each pair reducing over its expert's packed bytes (``experts_gathered``), ``pallas_bf16`` the kernel on the weights
dequantized once outside the timing; the floor counts 4.25 bits per weight (the packed codes and scales). These place
``models.gpt_oss.mxfp4_form``'s bounds. The op is not timed in parts (``--split-tokens`` is refused).

Usage (GPU): ``python -m benchmarks.moe_kernel --ceilings --out moe.json`` (``--weights fp8`` for the FP8 experts);
``--interpret`` runs the kernel in Pallas interpret mode (the CPU test, tiny shapes). ``--budget-s`` bounds the run:
past it, the remaining sweeps are skipped (recorded as such) and only the forms are timed.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import re
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.floors import H200_HBM_BYTES_PER_S, measure_ceilings
from models.gpt_oss import combine_top_k, experts_gathered, experts_grouped
from models.loader import MXFP4_DUMMY_SCALE
from models.moe import (grouped_matmul_reference, in_pair_order, moe_experts_gathered, moe_experts_pairs,
                        moe_experts_with, route_top_k, sort_by_expert)
from models.presets import PRESETS
from models.quantization import mxfp4
from models.quantization.block_fp8 import FP8_MAX, BlockFp8Experts
from paged_jax.ops.fused_moe import KernelConfig, default_config, grouped_matmul_pallas, pair_experts_pallas

DEFAULT_TOKENS = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096"  # benchmarks.expert_parallel's
SWEEP_TOKENS = "1,2,4,8,16,64,256,1024,4096"  # this benchmark's: one GPU call
# Launch configs swept where an expert averages few rows (DECODE) and many (PREFILL); both near the boundary.
DECODE_SWEEP = ("16/128/64/auto/4/3", "16/64/64/1/4/2", "16/128/64/1/4/3", "16/32/128/1/4/4", "16/128/128/auto/4/3",
                "16/256/64/auto/4/3", "16/64/128/auto/4/4", "16/128/64/auto/8/4")
PREFILL_SWEEP = ("64/64/64/1/4/2", "64/128/64/1/4/3", "128/128/64/1/8/3", "32/128/64/1/4/3", "64/256/32/1/8/3")
# MXFP4 adds longer K steps (a K step of 64 reads only 32 bytes of each weight row).
# The pair kernel's launches (block_n, block_k, num_warps) timed beside its default, as forms "pairs_<n>_<k>_<w>".
PAIR_SWEEP = ((128, 128, 4), (64, 128, 4), (256, 64, 8), (128, 256, 4), (64, 64, 2))
MXFP4_DECODE_SWEEP = ("16/128/256/auto/8/3", "16/64/256/auto/4/3")
MXFP4_PREFILL_SWEEP = ("128/128/128/1/8/3", "64/128/128/1/4/3")
ROUNDS = 3  # timing rounds per figure (the median is reported)
MXFP4_BITS_PER_WEIGHT = 4 + 8 / mxfp4.BLOCK  # a code, and a scale byte per 32
GPT_OSS_SWIGLU = dict(alpha=1.702, limit=7.0)  # gpt-oss's published swiglu_alpha / swiglu_limit


def sweep_configs(num_rows: int, num_experts: int, weights: str = "bf16") -> list[KernelConfig]:
    """The configs ``--configs auto`` times for ``num_rows`` sorted rows: ``DECODE_SWEEP`` up to 16 rows per
    expert, ``PREFILL_SWEEP`` from 4 (each with its ``MXFP4_*`` additions for ``weights`` "mxfp4")."""
    per_expert, extra = num_rows / num_experts, weights == "mxfp4"
    names = ((DECODE_SWEEP + (MXFP4_DECODE_SWEEP if extra else ()) if per_expert <= 16 else ())
             + (PREFILL_SWEEP + (MXFP4_PREFILL_SWEEP if extra else ()) if per_expert >= 4 else ()))
    return [KernelConfig.parse(name) for name in names]


def _normal(key, shape, std):
    return (jax.random.normal(key, shape, jnp.float32) * std).astype(jnp.bfloat16)


def _experts(args) -> dict:
    """The layer's weights: ``stacks``, the forms' expert operands (gate / up / down: bf16, or ``BlockFp8Experts``
    with ``--weights fp8``; with ``--weights mxfp4`` gpt-oss's gate_up and down as ``Mxfp4Experts`` with their
    biases), ``bf16`` the same dequantized, and the router ``[H, E]``."""
    keys = jax.random.split(jax.random.key(0), 5)
    router = _normal(keys[3], (args.hidden, args.experts), 0.02)
    if args.weights == "mxfp4":
        stacks = (mxfp4_experts(keys[0], args.experts, args.hidden, 2 * args.inter),
                  _normal(keys[1], (args.experts, 2 * args.inter), 0.02),
                  mxfp4_experts(keys[2], args.experts, args.inter, args.hidden),
                  _normal(keys[4], (args.experts, args.hidden), 0.02))
        return dict(stacks=stacks, router=router, bf16=tuple(
            w.dequantize(jnp.bfloat16) if isinstance(w, mxfp4.Mxfp4Experts) else w for w in stacks))
    shapes = [(args.experts, args.hidden, args.inter)] * 2 + [(args.experts, args.inter, args.hidden)]
    if args.weights == "fp8":
        stacks = tuple(block_fp8_experts(key, shape, args.fp8_block, 0.02) for key, shape in zip(keys, shapes))
    else:
        stacks = tuple(_normal(key, shape, 0.02) for key, shape in zip(keys, shapes))
    bf16 = tuple(w.dequantize(jnp.bfloat16) if isinstance(w, BlockFp8Experts) else w for w in stacks)
    return dict(stacks=stacks, router=router, bf16=bf16, w_gate_up=jnp.concatenate(bf16[:2], axis=-1))


def mxfp4_experts(key, num_experts: int, k: int, n: int) -> mxfp4.Mxfp4Experts:
    """Random MXFP4 experts of model-layout ``[E, k, n]`` as the dummy loader makes them: random fp4 codes, every
    scale ``2 ** (MXFP4_DUMMY_SCALE - 127)`` (weights of about N(0, 0.02)'s size)."""
    blocks, scales = mxfp4.packed_shapes(num_experts, n, k)
    return mxfp4.Mxfp4Experts(jax.random.bits(key, blocks, jnp.uint8), jnp.full(scales, MXFP4_DUMMY_SCALE, jnp.uint8))


def _routings(num_tokens: int, args, seed: int) -> list[dict]:
    """``--rotations`` inputs ``{x, topk_weights, topk_ids}`` of ``num_tokens`` tokens, each routed afresh."""
    out = []
    for r in range(args.rotations):
        keys = jax.random.split(jax.random.key(1000 * seed + r + 1), 2)
        weights, ids = route_top_k(jax.random.normal(keys[1], (num_tokens, args.experts), jnp.float32), args.top_k,
                                   True)
        out.append(dict(x=_normal(keys[0], (num_tokens, args.hidden), 1.0), topk_weights=weights, topk_ids=ids))
    return out


def _inputs(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, seed: int) -> dict:
    """One layer's random bf16 experts and ``num_tokens`` routed tokens: ``{x, w_gate, w_up, w_down, topk_weights,
    topk_ids}`` (``benchmarks.expert_parallel``'s inputs)."""
    keys = jax.random.split(jax.random.key(seed), 5)
    weights, ids = route_top_k(jax.random.normal(keys[4], (num_tokens, num_experts), jnp.float32), top_k, True)
    return dict(x=_normal(keys[0], (num_tokens, hidden), 1.0),
                w_gate=_normal(keys[1], (num_experts, hidden, inter), 0.02),
                w_up=_normal(keys[2], (num_experts, hidden, inter), 0.02),
                w_down=_normal(keys[3], (num_experts, inter, hidden), 0.02), topk_weights=weights, topk_ids=ids)


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
    """The op in XLA's best sorted form: one ragged_dot over ``w_gate_up [E, H, 2I]`` (gate | up) for the rows
    gathered in expert order, the SwiGLU, one ragged_dot for down, the weighted sum."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    order, group_sizes = sort_by_expert(topk_ids, w_gate_up.shape[0])
    gate_up = jax.lax.ragged_dot(x[order // top_k], w_gate_up, group_sizes, preferred_element_type=jnp.float32)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    act = (jax.nn.silu(gate) * up).astype(x.dtype)
    out_sorted = jax.lax.ragged_dot(act, w_down, group_sizes, preferred_element_type=jnp.float32).astype(x.dtype)
    out = in_pair_order(out_sorted, order).reshape(num_tokens, top_k, hidden).astype(jnp.float32)
    return jnp.sum(out * topk_weights[:, :, None], axis=1).astype(x.dtype)


def floor_bytes(num_tokens: int, hidden: int, inter: int, top_k: int, experts_touched: float,
                weight_bytes: float = 2) -> float:
    """Bytes a step must move at least: the touched experts' gate, up and down weights (``weight_bytes`` each: 2
    for bf16, 1 for FP8, whose scales add under 0.1%, 4.25 / 8 for MXFP4), x read, the gate|up-then-SwiGLU rows
    written and read, the down rows written and read, the output written (bf16)."""
    weights = experts_touched * 3 * hidden * inter
    rows = num_tokens * top_k
    activations = num_tokens * hidden + 2 * rows * inter + 2 * rows * hidden + num_tokens * hidden
    return weight_bytes * weights + 2 * activations


def throughput_us(fn, operands: list[tuple], repeats: int) -> float:
    """Microseconds per call of ``fn`` as the GPU runs it: ``repeats`` calls dispatched back to back, cycling over
    ``operands``, one wait at the end; the median of ``ROUNDS`` rounds, after one untimed call per operand set
    (compilation, first-call effects)."""
    jax.block_until_ready([fn(*ops) for ops in operands])
    rounds = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        out = [fn(*operands[i % len(operands)]) for i in range(repeats)]
        jax.block_until_ready(out[-1])
        rounds.append((time.perf_counter() - start) / repeats)
        del out
    return statistics.median(rounds) * 1e6


def _kernel(args, config: KernelConfig | None = None):
    return functools.partial(grouped_matmul_pallas, interpret=args.interpret, config=config)


def _op(args, matmul):
    """The op on a grouped matmul, called as ``op(x, *stacks, topk_weights, topk_ids)``: ``moe_experts_with``, or
    gpt-oss's experts for ``--weights mxfp4``."""
    if args.weights == "mxfp4":
        return functools.partial(_gpt_oss_op, functools.partial(experts_grouped, matmul))
    return functools.partial(moe_experts_with, matmul)


def _gpt_oss_op(experts, x, gate_up, gate_up_bias, down, down_bias, topk_weights, topk_ids):
    """gpt-oss's experts (``experts``: ``experts_grouped`` on a matmul, or ``experts_gathered``) and top-k sum."""
    out = experts(x, topk_ids, gate_up, gate_up_bias, down, down_bias, **GPT_OSS_SWIGLU)
    return combine_top_k(out, topk_weights).astype(x.dtype)


def _dequantizing(matmul):
    """``matmul`` on MXFP4 experts dequantized to the rows' dtype first, in the call (gpt-oss's grouped path on the
    GPU before the kernel decoded MXFP4)."""
    def run(lhs, rhs, group_sizes, **kwargs):
        return matmul(lhs, rhs.dequantize(lhs.dtype), group_sizes, **kwargs)
    return run


def _forms(experts: dict, num_tokens: int, args) -> dict:
    """name -> (jitted op, experts' operands) of every form timed (``--weights`` decides the experts' storage)."""
    stacks, bf16 = experts["stacks"], experts["bf16"]
    fns = {"pallas": (jax.jit(_op(args, _kernel(args))), stacks),
           "ragged_dot": (jax.jit(_op(args, grouped_matmul_reference)), stacks)}
    if args.weights == "mxfp4":
        fns["dequant_pallas"] = (jax.jit(_op(args, _dequantizing(_kernel(args)))), stacks)
        if num_tokens <= args.gather_max_tokens:
            fns["matvec"] = (jax.jit(functools.partial(_gpt_oss_op, experts_gathered)), stacks)
        fns["pallas_bf16"] = (fns["pallas"][0], bf16)
        return fns
    if num_tokens <= args.gather_max_tokens:
        for reduce in (False, True):
            fns[f"gather_{'reduce' if reduce else 'dot'}"] = (
                jax.jit(functools.partial(moe_experts_gathered, reduce=reduce)), stacks)
        if args.weights == "bf16":
            pairs = functools.partial(pair_experts_pallas, interpret=args.interpret)
            fns["pallas_pairs"] = (jax.jit(functools.partial(moe_experts_pairs, pairs)), stacks)
            for block_n, block_k, warps in PAIR_SWEEP if not args.interpret else ():
                launch = functools.partial(pairs, block_n=block_n, block_k=block_k, num_warps=warps)
                fns[f"pairs_{block_n}_{block_k}_{warps}"] = (jax.jit(functools.partial(moe_experts_pairs, launch)),
                                                             stacks)
    if args.weights == "fp8":  # the bf16 forms on the same weights, dequantized once
        fns["pallas_bf16"] = (fns["pallas"][0], bf16)
    fns["ragged_dot_fused"] = (jax.jit(_fused_gate_up_ragged_dot), (experts["w_gate_up"], bf16[2]))
    return fns


def _operands(routings: list[dict], stacks: tuple) -> list[tuple]:
    return [(r["x"], *stacks, r["topk_weights"], r["topk_ids"]) for r in routings]


def _max_diff(out, reference) -> float:
    return float(np.abs(np.asarray(out, np.float32) - reference).max())


def _sweep(experts, routings, reference, floor_us, num_tokens, args, deadline, default: dict) -> list[dict]:
    """Each kernel config's op time, ratio to the floor and max abs difference (or its error, or "skipped" past
    ``deadline``); ``default``: the record of the default launch (the ``pallas`` form), reused for its config."""
    num_rows = num_tokens * args.top_k
    configs = (sweep_configs(num_rows, args.experts, args.weights) if args.configs == "auto"
               else [KernelConfig.parse(c) for c in args.configs.split(",") if c])
    stacks = experts["stacks"]
    records = []
    for config in configs:
        record = {"config": str(config)}
        if record["config"] == default["config"]:
            records.append(default)
            continue
        if time.monotonic() > deadline:
            records.append({**record, "skipped": "past --budget-s"})
            continue
        try:
            fn = jax.jit(_op(args, _kernel(args, config)))
            operands = _operands(routings, stacks)
            record["max_abs_diff"] = _max_diff(fn(*operands[0]), reference)
            micros = throughput_us(fn, operands, args.repeats)
            record.update(us=round(micros, 1), x_floor=round(micros / floor_us, 2))
        except Exception as error:  # a config the GPU cannot compile or run is reported, not fatal
            record["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        records.append(record)
    return records


def hlo_launches(compiled_text: str) -> dict:
    """Opcode -> count of the instructions that launch work in a compiled module's text: those of every computation
    but the ones fusions call and the ones applied as reducers or comparators (fusions, custom calls such as the
    Pallas kernels, sorts, scatters, copies...)."""
    computations, current = {}, None
    for line in compiled_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            current = computations.setdefault(header.group(1), [])
        elif current is not None and (op := re.match(r"^\s*(?:ROOT )?%?[\w.\-]+ = [^=]*? ([a-z][\w\-]*)\((.*)", line)):
            current.append((op.group(1), op.group(2)))
    inner = {callee for ops in computations.values() for opcode, rest in ops
             for key, callee in re.findall(r"(calls|to_apply)=%?([\w.\-]+)", rest)
             if key == "to_apply" or opcode == "fusion"}
    skip = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "call", "while", "conditional",
            "after-all"}
    return dict(collections.Counter(opcode for name, ops in computations.items() if name not in inner
                                    for opcode, _ in ops if opcode not in skip))


def _combine(out_sorted, order, topk_weights):
    num_tokens, top_k = topk_weights.shape
    out = in_pair_order(out_sorted, order).reshape(num_tokens, top_k, -1).astype(jnp.float32)
    return jnp.sum(out * topk_weights[:, :, None], axis=1).astype(out_sorted.dtype)


def split_record(experts: dict, routings: list[dict], args) -> dict:
    """The default op's parts timed alone (``throughput_us``), their sum, the whole op, and its ``hlo_launches``."""
    top_k = args.top_k
    kernel = _kernel(args)
    stacks = experts["stacks"]

    def sort(ids):
        order, group_sizes = sort_by_expert(ids, args.experts)
        return order, group_sizes, order // top_k

    sort_fn = jax.jit(sort)
    gate_up_fn = jax.jit(lambda x, w_gate, w_up, sizes, rows: kernel(x, w_gate, sizes, row_index=rows, up_rhs=w_up))
    down_fn = jax.jit(lambda act, w_down, sizes: kernel(act, w_down, sizes))
    sorted_ = [sort_fn(r["topk_ids"]) for r in routings]
    acts = [gate_up_fn(r["x"], stacks[0], stacks[1], s[1], s[2]) for r, s in zip(routings, sorted_)]
    outs = [down_fn(act, stacks[2], s[1]) for act, s in zip(acts, sorted_)]
    parts = {
        "route": (jax.jit(lambda x, router: route_top_k(x @ router, top_k, True)),
                  [(r["x"], experts["router"]) for r in routings]),
        "sort": (sort_fn, [(r["topk_ids"],) for r in routings]),
        "gate_up": (gate_up_fn, [(r["x"], stacks[0], stacks[1], s[1], s[2]) for r, s in zip(routings, sorted_)]),
        "down": (down_fn, [(act, stacks[2], s[1]) for act, s in zip(acts, sorted_)]),
        "combine": (jax.jit(_combine), [(o, s[0], r["topk_weights"]) for o, s, r in zip(outs, sorted_, routings)]),
    }
    record = {f"{name}_us": round(throughput_us(fn, ops, args.repeats), 1) for name, (fn, ops) in parts.items()}
    record["parts_sum_us"] = round(sum(record.values()), 1)
    op = jax.jit(functools.partial(moe_experts_with, kernel))
    operands = _operands(routings, stacks)
    record["op_us"] = round(throughput_us(op, operands, args.repeats), 1)
    record["hlo_launches"] = hlo_launches(op.lower(*operands[0]).compile().as_text())
    return record


def _default_launch(num_rows: int, args) -> str:
    """The default config of both grouped matmuls (``KernelConfig``'s spelling), or of each when they differ."""
    width = 2 * args.inter if args.weights == "mxfp4" else args.inter  # gpt-oss's gate|up in one matmul
    gate_up = default_config(num_rows, args.experts, width, args.hidden)
    down = default_config(num_rows, args.experts, args.hidden, args.inter)
    return str(gate_up) if gate_up == down else f"{gate_up} (gate_up), {down} (down)"


def run_case(experts: dict, num_tokens: int, args, seed: int, deadline: float, copy_bytes_per_s: float | None) -> dict:
    """Check, then time every form and sweep the kernel configs on one token count; returns the JSON record."""
    routings = _routings(num_tokens, args, seed)
    fns = _forms(experts, num_tokens, args)
    outs, errors = {}, {}
    for name, (fn, stacks) in list(fns.items()):
        try:
            outs[name] = np.asarray(fn(*_operands(routings[:1], stacks)[0]), np.float32)
        except Exception as error:  # a form the GPU cannot compile is reported; the others are still timed
            if name == "ragged_dot":
                raise
            errors[name] = f"{type(error).__name__}: {str(error)[:300]}"
            del fns[name]
    touched = float(np.mean([np.unique(np.asarray(r["topk_ids"])).size for r in routings]))
    weight_bytes = {"bf16": 2, "fp8": 1, "mxfp4": MXFP4_BITS_PER_WEIGHT / 8}[args.weights]
    floor = floor_bytes(num_tokens, args.hidden, args.inter, args.top_k, touched, weight_bytes)
    floor_us = floor / H200_HBM_BYTES_PER_S * 1e6
    reference = outs["ragged_dot"]
    record = {"tokens": num_tokens, "hidden": args.hidden, "inter": args.inter, "experts": args.experts,
              "top_k": args.top_k, "weights": args.weights, "experts_touched": touched, "floor_us": round(floor_us, 2),
              "default_config": _default_launch(num_tokens * args.top_k, args),
              "check": {f"{name}_max_abs_diff": _max_diff(out, reference) for name, out in outs.items()
                        if name != "ragged_dot"}}
    record["check"]["reference_max_abs"] = float(np.abs(reference).max())
    if errors:
        record["errors"] = errors
    if copy_bytes_per_s:
        record["floor_measured_us"] = round(floor / copy_bytes_per_s * 1e6, 2)
    for name, (fn, stacks) in fns.items():
        micros = throughput_us(fn, _operands(routings, stacks), args.repeats)
        record[f"{name}_us"] = round(micros, 1)
        record[f"{name}_x_floor"] = round(micros / floor_us, 2)
    if args.configs != "none" and "pallas" in fns:
        default = {"config": record["default_config"], "max_abs_diff": record["check"]["pallas_max_abs_diff"],
                   "us": record["pallas_us"], "x_floor": record["pallas_x_floor"]}
        record["configs"] = _sweep(experts, routings, reference, floor_us, num_tokens, args, deadline, default)
        timed = [c for c in record["configs"] if "us" in c]
        if timed:
            record["best_config"] = min(timed, key=lambda c: c["us"])["config"]
    if num_tokens in args.split_tokens:
        record["split"] = split_record(experts, routings, args)
    return record


def layer_shape(weights: str) -> dict:
    """The default expert shape (``hidden``, ``inter``, ``experts``, ``top_k``) from ``models.presets``: gpt-oss-20b's
    for ``weights`` "mxfp4", else Qwen3-30B-A3B's."""
    if weights == "mxfp4":
        preset = PRESETS["gpt-oss-20b"]
        return dict(hidden=preset["hidden_size"], inter=preset["intermediate_size"],
                    experts=preset["num_local_experts"], top_k=preset["num_experts_per_tok"])
    preset = PRESETS["qwen3-30b-a3b"]
    return dict(hidden=preset["hidden_size"], inter=preset["moe_intermediate_size"], experts=preset["num_experts"],
                top_k=preset["num_experts_per_tok"])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default=SWEEP_TOKENS, help="comma-separated token counts T")
    parser.add_argument("--hidden", type=int, default=None, help="default: layer_shape's")
    parser.add_argument("--inter", type=int, default=None, help="each expert's width (moe_intermediate_size)")
    parser.add_argument("--experts", type=int, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=20, help="calls per timing round")
    parser.add_argument("--rotations", type=int, default=4, help="routings cycled through while timing")
    parser.add_argument("--configs", default="auto",
                        help="kernel configs swept: 'auto' (sweep_configs), 'none', or comma-separated "
                             "block_m/block_n/block_k/split_k/num_warps/num_stages (split_k 'auto' allowed)")
    parser.add_argument("--gather-max-tokens", type=int, default=16, help="largest T timing the gather forms")
    parser.add_argument("--split-tokens", default=None,
                        help="comma-separated T whose op is also timed in parts (default 1; none with mxfp4)")
    parser.add_argument("--budget-s", type=float, default=210.0,
                        help="seconds after which the config sweeps are skipped (the forms are still timed)")
    parser.add_argument("--ceilings", action="store_true", help="also measure this device's copy bandwidth")
    parser.add_argument("--weights", choices=("bf16", "fp8", "mxfp4"), default="bf16",
                        help="the experts' storage: bf16, block-FP8 (float8_e4m3fn + float32 block scales), or "
                             "MXFP4 (gpt-oss's layer: packed fp4 codes + e8m0 scales per 32)")
    parser.add_argument("--fp8-block", type=int, default=128, help="--weights fp8: the side of one scale block")
    parser.add_argument("--interpret", action="store_true", help="the kernel in Pallas interpret mode (CPU)")
    parser.add_argument("--out", type=Path, default=None, help="write {'results': [...]} as JSON here")
    return parser


def main(argv=None) -> list[dict]:
    parser = _parser()
    args = parser.parse_args(argv)
    for name, value in layer_shape(args.weights).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.split_tokens is None:
        args.split_tokens = "" if args.weights == "mxfp4" else "1"
    args.split_tokens = {int(t) for t in args.split_tokens.split(",") if t}
    if args.split_tokens and args.weights == "mxfp4":
        parser.error("--split-tokens times the bf16 / fp8 op's parts; gpt-oss's MXFP4 layer is timed whole")
    deadline = time.monotonic() + args.budget_s
    ceilings = measure_ceilings(repeats=3, copy_bytes=1 << 30, matmul_size=4096) if args.ceilings else {}
    copy_bytes_per_s = ceilings.get("copy_GBps", 0) * 1e9 or None
    experts = _experts(args)
    results = []
    for seed, num_tokens in enumerate(int(t) for t in args.tokens.split(",")):
        record = run_case(experts, num_tokens, args, seed, deadline, copy_bytes_per_s)
        print(json.dumps(record), flush=True)
        results.append(record)
        if args.out is not None:  # rewritten after every T: a run cut short keeps what it measured
            args.out.write_text(json.dumps({"device": str(jax.devices()[0].device_kind), "ceilings": ceilings,
                                            "argv": sys.argv[1:] if argv is None else list(argv),
                                            "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
