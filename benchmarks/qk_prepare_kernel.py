"""``benchmarks/kernels.py --sections qk_prepare``: the one-kernel q/k transform + KV write
(``paged_jax.ops.qk_prepare``, ``impl="pallas"``) against its XLA reference (``impl="xla"``: ``apply_qk_transform``
+ ``write_kv``) on model shapes (``models.presets``).

Per case (preset, T tokens, pool dtype): first the check on the device, one layer, fresh random inputs: max abs
difference of q, of the written K rows and of the written V rows (float32), the fraction of elements that differ,
and whether every other slot of both pools is untouched. Then the timing of one step's worth: every decoder layer of
the preset (its own qkv activations, q/k norm weights and pool pair; shared RoPE tables and slot mapping, as in a
forward), q/k/v split from the fused qkv row as the model does, the pools donated: wall time per step (median of
``repeats`` calls after compile + warm-up, ``block_until_ready``) and, on a GPU, the kernels per step and their
summed device time from a profiler trace (``benchmarks.trace``). Each figure is one JSON line with the memory floor
of the bytes the step must move (qkv read, q write, K/V rows written) at ``floors.H200_HBM_BYTES_PER_S``.
"""

from __future__ import annotations

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.floors import H200_HBM_BYTES_PER_S
from benchmarks.report import median_seconds
from benchmarks.trace import trace_kernels
from models.presets import preset_config
from models.qk_transform import QKTransform, rope_cos_sin, rope_inv_freq
from paged_jax.ops.qk_prepare import qk_prepare

BLOCK_SIZE = 16
# (preset, tokens, pool dtype): batch-1 decode and a 256-row decode step, the FP8 KV cache (issue 17) on Llama.
GPU_CASES = [
    ("qwen3-0.6b", 1, "bfloat16"), ("qwen3-0.6b", 256, "bfloat16"),
    ("llama-3.1-8b", 1, "bfloat16"), ("llama-3.1-8b", 256, "bfloat16"),
    ("llama-3.1-8b", 1, "float8_e4m3fn"), ("qwen3-0.6b", 256, "float8_e4m3fn"),
]
# CPU smoke test (interpret mode): SmolLM2's shape (9 q heads: not a power of two) and Qwen3's q/k norm.
TINY_CASES = [("smollm2-135m", 1, "bfloat16"), ("qwen3-0.6b", 8, "float8_e4m3fn")]


def _case(config, num_tokens: int, pool_dtype, num_layers: int, seed: int):
    """Random inputs of one step: per layer a qkv row block [T, (Hq + 2 Hkv) D] (bf16), q/k norm weights (Qwen3)
    and a pool pair; shared cos / sin of random positions, slots on shuffled real blocks, kv_scale for FP8."""
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    num_blocks = max(64, 2 + math.ceil(num_tokens / BLOCK_SIZE))
    key = jax.random.key(seed)
    keys = iter(jax.random.split(key, 4 * num_layers + 2))
    width = (hq + 2 * hkv) * d
    qkv = [jax.random.normal(next(keys), (num_tokens, width), jnp.float32).astype(jnp.bfloat16)
           for _ in range(num_layers)]
    norms = [(1 + 0.1 * jax.random.normal(next(keys), (d,), jnp.float32).astype(jnp.bfloat16),
              1 + 0.1 * jax.random.normal(next(keys), (d,), jnp.float32).astype(jnp.bfloat16))
             if config.qk_norm else (None, None) for _ in range(num_layers)]
    pool_shape = (num_blocks, BLOCK_SIZE, hkv, d)
    pools = [tuple(jax.random.normal(k, pool_shape, jnp.float32).astype(pool_dtype)
                   for k in jax.random.split(next(keys), 2)) for _ in range(num_layers)]
    rng = np.random.default_rng(seed)
    slots = jnp.asarray(rng.permutation(np.arange(BLOCK_SIZE, num_blocks * BLOCK_SIZE))[:num_tokens], jnp.int32)
    positions = jnp.asarray(rng.integers(0, 4096, size=num_tokens), jnp.int32)
    scaling = None if config.rope_scaling is None else tuple(sorted(config.rope_scaling.items()))
    cos, sin = rope_cos_sin(positions, rope_inv_freq(d, float(config.rope_theta), scaling))
    kv_scale = jnp.asarray([0.5, 2.0], jnp.float32) if jnp.dtype(pool_dtype).itemsize == 1 else None
    return dict(qkv=qkv, norms=norms, pools=pools, slots=slots, cos=cos, sin=sin, kv_scale=kv_scale)


def _step(qkv, norms, pools, slots, cos, sin, kv_scale, *, config, impl: str, interpret: bool):
    """Every layer's q/k transform + KV write, as the model calls it: q/k/v split from the fused qkv row."""
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    num_tokens = slots.shape[0]
    qs, new_pools = [], []
    for layer_qkv, (q_norm, k_norm), (k_pages, v_pages) in zip(qkv, norms, pools):
        q, k, v = jnp.split(layer_qkv, [hq * d, (hq + hkv) * d], axis=-1)
        transform = QKTransform(cos, sin, q_norm_weight=q_norm, k_norm_weight=k_norm, kv_scale=kv_scale,
                                norm_eps=config.rms_norm_eps if config.qk_norm else None,
                                dtype=jnp.bfloat16 if config.qk_norm else None)
        q, k_pages, v_pages = qk_prepare(q.reshape(num_tokens, hq, d), k.reshape(num_tokens, hkv, d),
                                         v.reshape(num_tokens, hkv, d), k_pages, v_pages, slots, transform,
                                         impl=impl, interpret=interpret)
        qs.append(q)
        new_pools.append((k_pages, v_pages))
    return qs, new_pools


def _check(config, num_tokens, pool_dtype, interpret: bool, seed: int) -> dict:
    """Kernel vs reference on one layer: max abs differences (float32) and untouched slots."""
    inputs = _case(config, num_tokens, pool_dtype, 1, seed)
    args = (inputs["qkv"], inputs["norms"], inputs["pools"], inputs["slots"], inputs["cos"], inputs["sin"],
            inputs["kv_scale"])
    outs = {impl: jax.jit(functools.partial(_step, config=config, impl=impl, interpret=interpret))(*args)
            for impl in ("pallas", "xla")}
    (q_p, [(k_p, v_p)]), (q_x, [(k_x, v_x)]) = outs["pallas"], outs["xla"]
    slots = np.asarray(inputs["slots"])
    k_in, v_in = inputs["pools"][0]

    def rows(pages):
        return np.asarray(pages.astype(jnp.float32)).reshape(-1, *pages.shape[2:])

    def diff(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        return dict(max_abs=float(np.max(np.abs(a - b))), frac_differ=float(np.mean(a != b)))

    untouched = np.ones(rows(k_in).shape[0], bool)
    untouched[slots] = False
    return {
        "q": diff(q_p[0].astype(jnp.float32), q_x[0].astype(jnp.float32)),
        "k_rows": diff(rows(k_p)[slots], rows(k_x)[slots]),
        "v_rows": diff(rows(v_p)[slots], rows(v_x)[slots]),
        "untouched_slots_equal": bool(all(np.array_equal(rows(out)[untouched], rows(ref)[untouched])
                                          for out, ref in ((k_p, k_in), (v_p, v_in)))),
    }


def _time(config, num_tokens, pool_dtype, impl: str, repeats: int, interpret: bool, num_layers: int,
          seed: int) -> dict:
    inputs = _case(config, num_tokens, pool_dtype, num_layers, seed)
    step = jax.jit(functools.partial(_step, config=config, impl=impl, interpret=interpret), donate_argnums=(2,))
    state = {"pools": inputs.pop("pools")}

    def run():
        qs, state["pools"] = step(inputs["qkv"], inputs["norms"], state["pools"], inputs["slots"], inputs["cos"],
                                  inputs["sin"], inputs["kv_scale"])
        return qs, state["pools"]

    wall_s = median_seconds(run, repeats, warmup=2)
    out = {"wall_us_per_step": round(wall_s * 1e6, 1)}
    if jax.default_backend() == "gpu":
        trace = trace_kernels(lambda: jax.block_until_ready(run()), 1, 6)
        out.update(gpu_busy_us_per_step=trace.get("busy_us_per_step"),
                   kernels_per_step=trace.get("kernels_per_step"), top_kernels=trace.get("top"))
    return out


def floor_us(config, num_tokens: int, pool_dtype, num_layers: int) -> float:
    """Memory floor of one step of this op: per layer read the qkv rows, write q and the K / V rows (bf16
    activations), at the H200's copy bandwidth."""
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    per_layer = num_tokens * d * (2 * (hq + 2 * hkv) + 2 * hq + 2 * hkv * jnp.dtype(pool_dtype).itemsize)
    return num_layers * per_layer / H200_HBM_BYTES_PER_S * 1e6


def run_section(repeats: int, *, log, results: list, interpret: bool = False, tiny: bool = False,
                over_budget=lambda what: False, flush=lambda: None) -> None:
    """Check then time every case; one JSON line per figure through ``log``, appended to ``results``."""
    log("== qk_prepare: fused q/k norm + RoPE + KV write (pallas) vs the XLA reference ==")
    for seed, (preset, num_tokens, pool_name) in enumerate(TINY_CASES if tiny else GPU_CASES):
        name = f"{preset} T={num_tokens} pool={pool_name}"
        if over_budget(name):
            break
        config = preset_config(preset)
        pool_dtype = jnp.dtype(pool_name)
        num_layers = 2 if tiny else config.num_hidden_layers
        record = {"section": "qk_prepare", "preset": preset, "tokens": num_tokens, "pool_dtype": pool_name,
                  "layers": num_layers, "check": _check(config, num_tokens, pool_dtype, interpret, seed)}
        for impl in ("pallas", "xla"):
            record[impl] = _time(config, num_tokens, pool_dtype, impl, repeats, interpret, num_layers, seed)
        record["floor_us_per_step"] = round(floor_us(config, num_tokens, pool_dtype, num_layers), 2)
        if "gpu_busy_us_per_step" in record["xla"]:
            record["gpu_busy_us_saved_per_step"] = round(
                record["xla"]["gpu_busy_us_per_step"] - record["pallas"]["gpu_busy_us_per_step"], 1)
            record["kernels_saved_per_layer"] = round(
                (record["xla"]["kernels_per_step"] - record["pallas"]["kernels_per_step"]) / num_layers, 2)
        log(json.dumps(record))
        results.append(record)
        flush()
