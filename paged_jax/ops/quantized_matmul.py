"""Skinny-M quantized matmuls (decode: M <= 64) in Pallas (Triton lowering), built for memory bandwidth: the
packed int4 / int8 weight-only matmul (AWQ / GPTQ layout, any group size, zero points, act-order ``g_idx``) and the
FP8 weight-only matmul (float8_e4m3fn weights, or ``Int8Linear``'s int8, upcast in registers, per-channel or
per-tensor scale; activations are not quantized).

Int formats: ``y[M, N] = x[M, K] @ w``, ``w[k, n] = (q[k, n] - zeros[g(k), n]) * scales[g(k), n]``, ``q`` packed as
in ``models.quantization.linear`` (``qweight int32[K * bits / 32, N]``; bits ``j*bits..`` of word ``[r, n]`` hold
input row ``pack * r + j``, ``pack = 32 / bits``). Each packed word is read once and becomes ``pack`` weights in
registers, so the matmul reads ``bits / 16`` of the bf16 weight bytes.

Kernel layout (whole-array refs, integer-array indexers with masks, no BlockSpecs, so interpret mode runs the same
code on CPU; the knobs and their table: ``paged_jax.ops.quantized_matmul_tuning``):
  * grid ``(ceil(M / block_m), ceil(N / block_n), split_k)``; program ``(i, j, s)`` owns output tile ``(i, j)`` and
    the ``s``-th share of the K steps, and writes an fp32 partial sum that XLA adds up (``split_k`` > 1 fills the
    132 SMs at batch 1, where M gives a single row of tiles);
  * a K step = ``block_k`` input rows = one ``[block_k / pack, block_n]`` load of packed words (columns contiguous:
    coalesced along N; FP8's ``[N, K]`` weights along K); ``steps`` K steps are loaded together per loop iteration
    (bytes in flight);
  * plane ``j`` of a word holds input rows ``pack * r + j``; their activations are one contiguous load from
    ``x_planes = x.reshape(M, K / pack, pack)`` transposed to ``[pack, M, K / pack]`` (a cheap shuffle by XLA);
  * integers become floats without a conversion instruction: ``bitcast(q | 0x4B000000) - 2**23`` is ``q`` exactly
    (q sits in the mantissa of 2**23);
  * post-scaled groups (contiguous groups, a K step inside one group): the step's raw sum ``r = sum_k x_k q_kn`` is
    scaled once per step, ``acc += s_gn * (r - z_gn * sum_k x_k)`` (``sum_k x_k`` per step precomputed by XLA), so
    weights are never dequantized one by one; otherwise (act-order ``g_idx``, or groups smaller than the smallest
    step of the path) each weight is dequantized with its gathered group's scale and zero point before the sum;
  * two paths by ``block_m``: 1 = GEMV (one row per program; ``x * w`` broadcast-multiplied into a
    ``[block_k / pack, block_n]`` fp32 accumulator and reduced along K once per step, no padded ``dot``; the
    planes' mask-in-place trick below saves a shift per weight), >= 16 = ``dot`` on the tensor cores.
    GEMV post-scaled planes: plane ``j < pack/2`` is ``word & (mask << bits*j)`` = ``q * 2**(bits*j)`` exactly, the
    upper half the same on ``word >> 16``; the activations of plane ``j`` come pre-multiplied by ``2**-(bits*j')``.
FP8: the same grid and paths on ``weight float8_e4m3fn[N, K]`` (``Fp8Linear``'s layout; a ``[block_k, block_n]``
tile is gathered from it transposed); the per-column scale multiplies the sum at the end.

``weight_only_matmul_reference`` / ``fp8_weight_only_matmul_reference`` are the jnp oracles. Importing this module
registers the kernels as ``matmul_impl="pallas"`` and the M threshold of ``"auto"`` (``models.quantization.linear``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from models.quantization.linear import (fp8_weight_only_matmul_reference, register_fp8_matmul,
                                        register_matmul_selector, register_weight_only_matmul,
                                        weight_only_matmul_reference)
from paged_jax.ops import quantized_matmul_tuning as tuning_table

_CompilerParams = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")
_load = getattr(plgpu, "load", None) or pl.load
_store = getattr(plgpu, "store", None) or pl.store
_dot = getattr(plgpu, "dot", None) or pl.dot

_MAGIC = 0x4B000000  # float32 bits of 2**23: OR-ing an integer below 2**23 into its mantissa gives 2**23 + q
_TWO_23 = float(1 << 23)
_MIN_DOT = 16  # Triton's smallest dot tile side


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, int(v)).bit_length() - 1)


def _pow2_ceil(v: int) -> int:
    return 1 << max(0, int(v) - 1).bit_length()


def default_tuning(fmt: str, m: int, n: int, k: int, *, group_size: int | None = None, act_order: bool = False,
                   **overrides) -> dict:
    """Knobs for ``x[m, k] @ w`` (``[k, n]`` unpacked; fp8 stores ``[n, k]``) in ``fmt`` ("int4" | "int8" | "fp8"):
    the tuning table's entry (``quantized_matmul_tuning.tuned``) with ``overrides`` (None = the table's), made valid
    for the shape:
    ``block_m`` 1 (GEMV) or a power of two >= 16 no larger than M needs, ``block_n`` / ``block_k`` powers of two
    no larger than the shape needs, ``block_k`` shrunk to fit a group when that keeps the post-scaled path (with
    ``steps`` scaled up by as much, so the bytes in flight stay), ``split_k`` so that about
    ``TARGET_PROGRAMS`` programs run when not given. Adds ``post_scale`` (bool) for int formats."""
    t = tuning_table.tuned(fmt, m, k, n)
    t.update({key: v for key, v in overrides.items() if v is not None})
    unknown = set(t) - set(tuning_table.KNOBS)
    if unknown:
        raise ValueError(f"unknown tuning knobs {sorted(unknown)}")
    pack = 1 if fmt == "fp8" else 32 // int(fmt[3:])
    gemv = t["block_m"] == 1
    block_m = 1 if gemv else max(_MIN_DOT, min(_pow2_floor(t["block_m"]), _pow2_ceil(m)))
    block_n = max(_MIN_DOT, min(_pow2_floor(t["block_n"]), _pow2_ceil(n)))
    min_k = pack if gemv else _MIN_DOT * pack  # one packed row (GEMV) or a dot's K side of packed rows
    block_k = max(min_k, min(_pow2_floor(t["block_k"]), _pow2_ceil(k)))
    steps = max(1, int(t["steps"]))
    post_scale = False
    if fmt != "fp8" and not act_order:
        group = k if group_size in (None, -1) else group_size
        fit = block_k
        while fit >= min_k and group % fit:
            fit //= 2
        if fit >= min_k:
            post_scale = True
            steps *= block_k // fit
            block_k = fit
    k_steps = -(-k // block_k)
    steps = min(steps, k_steps)
    iters = -(-k_steps // steps)
    split_k = t["split_k"]
    if split_k is None:
        tiles = -(-m // block_m) * -(-n // block_n)
        split_k = 1
        while split_k * 2 <= iters and tiles * split_k * 2 <= tuning_table.TARGET_PROGRAMS:
            split_k *= 2
    out = dict(block_m=block_m, block_n=block_n, block_k=block_k, steps=steps,
               split_k=max(1, min(int(split_k), iters)), num_warps=int(t["num_warps"]),
               num_stages=int(t["num_stages"]))
    if fmt != "fp8":
        out["post_scale"] = post_scale
    return out


def _to_float(q):
    """int32 values in [0, 2**23) -> the same values in float32, without an int-to-float conversion."""
    return lax.bitcast_convert_type(q | _MAGIC, jnp.float32) - _TWO_23


def _tile_indices(pid, block, total):
    """Rows or columns ``pid * block + [0, block)`` of a tile: ``(indices, in range, indices clamped to 0)``."""
    indices = pid * block + jnp.arange(block, dtype=jnp.int32)
    ok = indices < total
    return indices, ok, jnp.where(ok, indices, 0)


def _split_range(split, iters_per_split, iters):
    lo = jnp.minimum(split * iters_per_split, iters)
    return lo, jnp.minimum(lo + iters_per_split, iters)


def _int_kernel(x_ref, xs_ref, w_ref, s_ref, z_ref, g_ref, out_ref, *, bits, block_m, block_n, block_kp, steps,
                iters_per_split, post_scale, group_kp, precision):
    pack = 32 // bits
    half = pack // 2
    mask_bits = (1 << bits) - 1
    gemv = block_m == 1
    _, m_total, kp_total = x_ref.shape
    n_total = w_ref.shape[1]
    num_groups = s_ref.shape[0]
    pid_m, pid_n, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols, col_ok, cols_c = _tile_indices(pid_n, block_n, n_total)
    if gemv:
        row = pid_m
    else:
        rows, row_ok, rows_c = _tile_indices(pid_m, block_m, m_total)
    k_steps = (kp_total + block_kp - 1) // block_kp
    it_lo, it_hi = _split_range(split, iters_per_split, (k_steps + steps - 1) // steps)
    offsets = jnp.arange(block_kp, dtype=jnp.int32)

    def plane_values(words, hi, j):
        """float32 ``[block_kp, block_n]`` of plane ``j`` (times ``2**(bits*j')`` on the GEMV post-scaled path)."""
        if gemv and post_scale:
            src, shift = (words, bits * j) if j < half else (hi, bits * (j - half))
            return _to_float(src & (mask_bits << shift))
        return _to_float(jnp.right_shift(words, bits * j) & mask_bits)

    def gathered_scale_zero(kr_c, k_ok, w_mask, j):
        group = _load(g_ref.at[kr_c, j], mask=k_ok, other=0)[:, None]  # [bkp, 1]
        scale = _load(s_ref.at[group, cols_c[None, :]], mask=w_mask, other=0.0).astype(jnp.float32)
        zero = _load(z_ref.at[group, cols_c[None, :]], mask=w_mask, other=0.0).astype(jnp.float32)
        return scale, zero

    def step(t, words, kr_c, k_ok, acc):
        w_mask = k_ok[:, None] & col_ok[None, :]
        hi = jnp.right_shift(words, 16) if gemv and post_scale else None
        if gemv:
            prod = jnp.zeros((block_kp, block_n), jnp.float32)
        else:
            raw = jnp.zeros((block_m, block_n), jnp.float32)
            x_mask = row_ok[:, None] & k_ok[None, :]
        for j in range(pack):
            w = plane_values(words, hi, j)
            if not post_scale:
                scale, zero = gathered_scale_zero(kr_c, k_ok, w_mask, j)
                w = (w - zero) * scale
            if gemv:
                x = _load(x_ref.at[j, row, kr_c], mask=k_ok, other=0.0)  # [bkp] float32
                prod += x[:, None] * w
            else:
                x = _load(x_ref.at[j, rows_c[:, None], kr_c[None, :]], mask=x_mask, other=0.0)  # [bm, bkp]
                raw += _dot(x, w.astype(x_ref.dtype), precision=precision)
        if gemv:
            raw = jnp.sum(prod, axis=0)  # [bn]
        if not post_scale:
            return acc + raw
        step_ok = t < k_steps
        group = jnp.minimum((t * block_kp) // group_kp, num_groups - 1)
        scale = _load(s_ref.at[group, cols_c], mask=col_ok, other=0.0).astype(jnp.float32)
        zero = _load(z_ref.at[group, cols_c], mask=col_ok, other=0.0).astype(jnp.float32)
        t_c = jnp.where(step_ok, t, 0)
        if gemv:
            x_sum = _load(xs_ref.at[row, t_c], mask=step_ok, other=0.0)
            return acc + scale * (raw - zero * x_sum)
        x_sum = _load(xs_ref.at[rows_c, t_c], mask=row_ok & step_ok, other=0.0)[:, None]  # [bm, 1]
        return acc + scale[None, :] * (raw - zero[None, :] * x_sum)

    def body(it, acc):
        loaded = []
        for u in range(steps):  # issue every load of the iteration before any arithmetic
            t = it * steps + u
            kr = t * block_kp + offsets
            k_ok = kr < kp_total
            kr_c = jnp.where(k_ok, kr, 0)
            words = _load(w_ref.at[kr_c[:, None], cols_c[None, :]], mask=k_ok[:, None] & col_ok[None, :], other=0)
            loaded.append((t, words, kr_c, k_ok))
        for t, words, kr_c, k_ok in loaded:
            acc = step(t, words, kr_c, k_ok, acc)
        return acc

    acc = lax.fori_loop(it_lo, it_hi, body, jnp.zeros((block_n,) if gemv else (block_m, block_n), jnp.float32))
    _store_tile(out_ref, split, acc, cols, col_ok, n_total, row if gemv else None,
                None if gemv else (rows, row_ok, m_total))


def _store_tile(out_ref, split, acc, cols, col_ok, n_total, row, rows_info):
    # Masked-off rows / columns store out of range: dropped by the GPU mask and by interpret-mode scatter.
    store_cols = jnp.where(col_ok, cols, n_total)
    if rows_info is None:
        _store(out_ref.at[split, row, store_cols], acc, mask=col_ok)
        return
    rows, row_ok, m_total = rows_info
    store_rows = jnp.where(row_ok, rows, m_total)[:, None]
    _store(out_ref.at[split, store_rows, store_cols[None, :]], acc, mask=row_ok[:, None] & col_ok[None, :])


def _fp8_kernel(x_ref, w_ref, s_ref, out_ref, *, block_m, block_n, block_k, steps, iters_per_split, precision):
    gemv = block_m == 1
    m_total, k_total = x_ref.shape
    n_total = w_ref.shape[0]
    pid_m, pid_n, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols, col_ok, cols_c = _tile_indices(pid_n, block_n, n_total)
    if gemv:
        row = pid_m
    else:
        rows, row_ok, rows_c = _tile_indices(pid_m, block_m, m_total)
    k_steps = (k_total + block_k - 1) // block_k
    it_lo, it_hi = _split_range(split, iters_per_split, (k_steps + steps - 1) // steps)
    offsets = jnp.arange(block_k, dtype=jnp.int32)

    def body(it, acc):
        loaded = []
        for u in range(steps):
            kr = (it * steps + u) * block_k + offsets
            k_ok = kr < k_total
            kr_c = jnp.where(k_ok, kr, 0)
            w = _load(w_ref.at[cols_c[None, :], kr_c[:, None]], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            loaded.append((w, kr_c, k_ok))
        for w, kr_c, k_ok in loaded:
            if gemv:  # acc: [block_k, block_n] products, reduced along K once at the end
                x = _load(x_ref.at[row, kr_c], mask=k_ok, other=0.0).astype(jnp.float32)
                acc += x[:, None] * w.astype(jnp.float32)
            else:
                x = _load(x_ref.at[rows_c[:, None], kr_c[None, :]], mask=row_ok[:, None] & k_ok[None, :],
                          other=0.0)
                acc += _dot(x, w.astype(x_ref.dtype), precision=precision)
        return acc

    shape = (block_k, block_n) if gemv else (block_m, block_n)
    acc = lax.fori_loop(it_lo, it_hi, body, jnp.zeros(shape, jnp.float32))
    scale = _load(s_ref.at[cols_c], mask=col_ok, other=0.0)
    if gemv:
        acc = jnp.sum(acc, axis=0) * scale
    else:
        acc = acc * scale[None, :]
    _store_tile(out_ref, split, acc, cols, col_ok, n_total, row if gemv else None,
                None if gemv else (rows, row_ok, m_total))


_KNOB_ARGS = ("block_m", "block_n", "block_k", "steps", "split_k", "num_warps", "num_stages")


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "interpret") + _KNOB_ARGS)
def weight_only_matmul_pallas(x, qweight, scales, zeros, g_idx=None, *, bits: int, group_size: int,
                              interpret: bool = False, block_m: int | None = None, block_n: int | None = None,
                              block_k: int | None = None, steps: int | None = None, split_k: int | None = None,
                              num_warps: int | None = None, num_stages: int | None = None) -> jax.Array:
    """``x[M, K] @ dequantized(qweight int32[K*bits/32, N], scales [G, N], zeros [G, N], g_idx int32[K] | None)``
    -> ``[M, N]`` in ``x.dtype`` (fp32 accumulation); same contract as ``weight_only_matmul_reference``.
    ``interpret=True`` runs the kernel on CPU. Knobs (None = ``default_tuning``'s): see the tuning module."""
    m, k = x.shape
    pack = 32 // bits
    n = qweight.shape[1]
    if qweight.shape[0] * pack != k:
        raise ValueError(f"qweight {qweight.shape} packs {qweight.shape[0] * pack} input rows, x has {k}")
    t = default_tuning(f"int{bits}", m, n, k, group_size=group_size, act_order=g_idx is not None, block_m=block_m,
                       block_n=block_n, block_k=block_k, steps=steps, split_k=split_k, num_warps=num_warps,
                       num_stages=num_stages)
    gemv, post_scale = t["block_m"] == 1, t["post_scale"]
    block_kp = t["block_k"] // pack
    k_steps = -(-(k // pack) // block_kp)
    iters_per_split = -(-(-(-k_steps // t["steps"])) // t["split_k"])
    x_planes = x.reshape(m, k // pack, pack).transpose(2, 0, 1)  # [pack, M, K/pack]: plane j = rows pack*r + j
    if gemv:
        x_planes = x_planes.astype(jnp.float32)
        if post_scale:  # plane j's weights arrive multiplied by 2**(bits * (j mod pack/2)): fold it into x
            shifts = (jnp.arange(pack) % (pack // 2)) * bits
            x_planes = x_planes * jnp.exp2(-shifts.astype(jnp.float32))[:, None, None]
    if post_scale:  # sum of x over each K step (the zero point's term), float32 [M, K / block_k]
        x_sums = x.astype(jnp.float32).reshape(m, k // t["block_k"], t["block_k"]).sum(-1)
        groups = jnp.zeros((1, pack), jnp.int32)
    else:
        x_sums = jnp.zeros((1, 1), jnp.float32)
        groups = (jnp.arange(k, dtype=jnp.int32) // group_size) if g_idx is None else g_idx.astype(jnp.int32)
        groups = groups.reshape(k // pack, pack)
    kernel = functools.partial(
        _int_kernel, bits=bits, block_m=t["block_m"], block_n=t["block_n"], block_kp=block_kp, steps=t["steps"],
        iters_per_split=iters_per_split, post_scale=post_scale, group_kp=max(1, group_size // pack),
        precision=lax.Precision.HIGHEST if x.dtype == jnp.float32 else None)
    splits = t["split_k"]
    partial_sums = pl.pallas_call(
        kernel,
        grid=(-(-m // t["block_m"]), -(-n // t["block_n"]), splits),
        out_shape=jax.ShapeDtypeStruct((splits, m, n), jnp.float32),
        interpret=interpret,
        compiler_params=_CompilerParams(num_warps=t["num_warps"], num_stages=t["num_stages"]),
        name=(f"weight_only_int{bits}_matmul_bm{t['block_m']}_bn{t['block_n']}_bk{t['block_k']}_st{t['steps']}"
              f"_s{splits}{'' if post_scale else '_g'}"),
    )(x_planes, x_sums, qweight, scales, zeros, groups)
    return (partial_sums[0] if splits == 1 else jnp.sum(partial_sums, axis=0)).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",) + _KNOB_ARGS)
def fp8_weight_only_matmul_pallas(x, weight, weight_scale, *, interpret: bool = False, block_m: int | None = None,
                                  block_n: int | None = None, block_k: int | None = None, steps: int | None = None,
                                  split_k: int | None = None, num_warps: int | None = None,
                                  num_stages: int | None = None) -> jax.Array:
    """``x[M, K] @ (weight float8_e4m3fn[N, K] * weight_scale f32[N, 1] | [1]).T`` -> ``[M, N]`` in ``x.dtype``; the
    weights are upcast in registers, the activations stay in ``x.dtype`` (fp32 accumulation). Same contract as
    ``fp8_weight_only_matmul_reference``."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight {weight.shape} (out, in) has {weight.shape[1]} inputs, x has {k}")
    t = default_tuning("fp8", m, n, k, block_m=block_m, block_n=block_n, block_k=block_k, steps=steps,
                       split_k=split_k, num_warps=num_warps, num_stages=num_stages)
    k_steps = -(-k // t["block_k"])
    iters_per_split = -(-(-(-k_steps // t["steps"])) // t["split_k"])
    scale = jnp.broadcast_to(weight_scale.astype(jnp.float32).reshape(-1), (n,))
    kernel = functools.partial(
        _fp8_kernel, block_m=t["block_m"], block_n=t["block_n"], block_k=t["block_k"], steps=t["steps"],
        iters_per_split=iters_per_split, precision=lax.Precision.HIGHEST if x.dtype == jnp.float32 else None)
    splits = t["split_k"]
    partial_sums = pl.pallas_call(
        kernel,
        grid=(-(-m // t["block_m"]), -(-n // t["block_n"]), splits),
        out_shape=jax.ShapeDtypeStruct((splits, m, n), jnp.float32),
        interpret=interpret,
        compiler_params=_CompilerParams(num_warps=t["num_warps"], num_stages=t["num_stages"]),
        name=f"fp8_weight_only_matmul_bm{t['block_m']}_bn{t['block_n']}_bk{t['block_k']}_st{t['steps']}_s{splits}",
    )(x, weight, scale)
    return (partial_sums[0] if splits == 1 else jnp.sum(partial_sums, axis=0)).astype(x.dtype)


def select_matmul_impl(fmt: str, m: int) -> str:
    """``matmul_impl="auto"`` for ``m`` rows (static) in ``fmt``: the tuning table's choice on the GPU
    (``quantized_matmul_tuning.AUTO_IMPL``), XLA elsewhere."""
    return tuning_table.auto_impl(fmt, m, jax.default_backend())


register_weight_only_matmul("pallas", weight_only_matmul_pallas)
register_fp8_matmul("pallas", fp8_weight_only_matmul_pallas)
register_matmul_selector(select_matmul_impl, tuning_table.storage)

__all__ = ["default_tuning", "fp8_weight_only_matmul_pallas", "fp8_weight_only_matmul_reference",
           "select_matmul_impl", "weight_only_matmul_pallas", "weight_only_matmul_reference"]
