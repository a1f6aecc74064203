"""Batch-1 quantized GEMV in Pallas (Triton lowering) on block-sliced refs: ``matmul_impl="pallas_blocked"``.

The second formulation of the M = 1 path of ``paged_jax.ops.quantized_matmul`` (same operands, same results; that
module's GEMV stays selectable as "pallas"). Here every operand reaches the kernel through a ``BlockSpec`` and is
read with static-size ``pl.ds`` slices at ``multiple_of`` offsets and no masks, so Triton sees ``base + arange``
pointers it can prove contiguous and aligned (16-byte vector loads along the contiguous axis, pipelined over the K
loop by ``num_stages``), instead of the gathered, masked pointers of integer-array indexers. The price: the shape
must tile exactly (``blocked_tuning`` returns None otherwise and the call falls back to the "pallas" kernel, as it
does for M > 1 and act-order ``g_idx``).

Grid ``(N / block_n, split_k)``: program ``(j, s)`` owns columns ``[j * block_n, (j + 1) * block_n)`` and the ``s``-th
of ``split_k`` equal K shares, and writes an fp32 partial row ``[block_n]`` that XLA sums over the shares (fp8 with
one share: the output row itself, in the activations' dtype).

* int4 / int8 (packed storage, ``qweight int32[K / pack, N]``): a K step is one ``[block_k / pack, block_n]`` tile
  of words; plane ``j`` of the words (input rows ``pack * r + j``) is masked in place (``word & (mask << bits*j)``,
  upper half on ``word >> 16``) and turned into floats by the ``2**23`` mantissa trick (see ``quantized_matmul``), its
  activations ``x_planes[j]`` pre-multiplied by ``2**-(bits * (j mod pack/2))``. The products of a step are summed
  over planes into a ``[block_k / pack, block_n]`` tile, multiplied by the step's group scale row and added to a
  2-D fp32 accumulator, which is reduced along K once, at the end (no cross-thread reduction per step). The zero
  point's term ``scale * zero * sum(x over the step)`` (the sums precomputed by XLA) goes to a ``[block_n]``
  accumulator. Per-channel weights (one group) apply the scale and zero point once, at the end.
  Needs ``block_k | group_size`` (a step inside one group) and groups not straddling K shares.
* fp8 (``weight float8_e4m3fn[N, K]``, ``Fp8Linear``'s layout: K contiguous; or ``Int8Linear``'s int8 in the same
  layout, which takes the fp8 tuning entries): a K step is one ``[block_n, block_k]`` tile upcast in registers
  (int8 through float16's bits, not a conversion instruction per weight), in one of two ways (knob ``dot_rows``):
  - 0: upcast to float32 and multiplied by ``x[block_k]`` into a 2-D fp32 accumulator, reduced and scaled per column
    at the end (every weight costs conversions to float32 on the CUDA cores);
  - 16: upcast to float16 (e4m3 -> f16 is one conversion per two weights on sm_90; e4m3 -> bf16 and -> f32 take
    more) and multiplied on the tensor cores, as the transposed operand of a dot with a ``[16, block_k]`` float16
    operand whose row 0 is ``x`` (clipped to float16's range) and whose other rows are zeros, accumulating ``[16,
    block_n]`` in fp32; row sums give ``x @ w`` exactly (the other rows add zeros). float32 activations keep a
    float32 dot at full precision. The K-contiguous tile is the layout Hopper's tensor cores take 8-bit operands in:
    with ``[K, N]`` weights the same kernel ran at about two thirds of the speed.
  - Prologues: the fp8 GEMV can also compute its activations from the kernels before it, so that at batch 1 they
    are not launches of their own: ``fp8_rms_norm_gemv_blocked`` (vLLM's ``fused_add_rms_norm``: every program
    reduces the whole row's sum of squares, then normalizes the K steps it reads; program (0, 0) stores the new
    residual) and ``fp8_silu_mul_gemv_blocked`` (SwiGLU's ``silu(gate) * up``, from this program's shares of the two
    halves). ``models.llama.norm_then_project`` and ``MLP.down`` call them through ``Fp8Linear``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from models.quantization.linear import register_fp8_matmul, register_weight_only_matmul
from paged_jax.ops import quantized_matmul_tuning as tuning_table
from paged_jax.ops.quantized_matmul import (_MAGIC, _MIN_DOT, _TWO_23, _CompilerParams, _dot, _pow2_floor,
                                            fp8_weight_only_matmul_pallas, weight_only_matmul_pallas)

_MIN_BLOCK_N = 16


def blocked_tuning(fmt: str, n: int, k: int, *, group_size: int | None = None, **overrides) -> dict | None:
    """Knobs of the blocked GEMV for ``x[1, k] @ w`` (``[k, n]`` unpacked; fp8 stores ``[n, k]``) in ``fmt``:
    ``BLOCKED_TUNING``'s entry with ``overrides`` (None = the table's), made to tile the shape exactly, or None
    when it cannot (the caller falls back). ``block_k`` shrinks to fit a group (``steps`` grows by as much);
    ``split_k`` None = the largest power of two that tiles K (whole groups per share) with about
    ``TARGET_PROGRAMS`` programs; a given ``split_k`` that does not tile K is halved until it does."""
    t = tuning_table.blocked_tuned(fmt, k, n)
    t.update({key: v for key, v in overrides.items() if v is not None})
    unknown = set(t) - set(tuning_table.BLOCKED_KNOBS)
    if unknown:
        raise ValueError(f"unknown tuning knobs {sorted(unknown)}")
    pack = 1 if fmt == "fp8" else 32 // int(fmt[3:])
    dot_rows = int(t.get("dot_rows") or 0)
    if dot_rows not in (0, _MIN_DOT) or (dot_rows and fmt != "fp8"):
        raise ValueError(f"dot_rows={dot_rows}: 0, or {_MIN_DOT} for fp8 (the tensor-core path)")
    block_n = max(_MIN_BLOCK_N, _pow2_floor(t["block_n"]))
    min_k = _MIN_DOT if dot_rows else pack  # a dot's K side, or one packed row
    block_k = max(min_k, _pow2_floor(t["block_k"]))
    steps = max(1, int(t["steps"]))
    group = k if fmt == "fp8" or group_size in (None, -1) else int(group_size)
    while block_k > min_k and group % block_k:
        block_k //= 2
        steps *= 2
    if n % block_n or k % block_k or group % block_k or k % group:
        return None
    per_channel = group == k
    share_unit = block_k if per_channel else group  # a K share holds whole steps and whole groups

    def tiles(split):
        return k % (split * share_unit) == 0

    split_k = t["split_k"]
    if split_k is None:
        split_k = 1
        while tiles(split_k * 2) and (n // block_n) * split_k * 2 <= tuning_table.TARGET_PROGRAMS:
            split_k *= 2
    split_k = max(1, _pow2_floor(int(split_k)))
    while split_k > 1 and not tiles(split_k):
        split_k //= 2
    if not tiles(split_k):
        return None
    steps = min(steps, k // split_k // block_k)
    out = dict(block_n=block_n, block_k=block_k, steps=steps, split_k=split_k, num_warps=int(t["num_warps"]),
               num_stages=int(t["num_stages"]))
    if fmt == "fp8":
        out["dot_rows"] = dot_rows
    return out


def _to_float(q):
    return lax.bitcast_convert_type(q | _MAGIC, jnp.float32) - _TWO_23


# int8 -> float16 without an integer-to-float conversion (a quarter-rate instruction on the GPU, which bound the int8
# GEMV): the sign-extended q plus these bits is the float16 of 1152 + q (1024..1279, where float16 steps by 1).
_INT8_F16_BITS = 0x6480
_INT8_F16_OFFSET = 1152.0


def _upcast_weights(w, dtype):
    """A weight tile (float8_e4m3fn, or ``Int8Linear``'s int8) as ``dtype`` for the products, exactly: e4m3 values
    are float16 values; int8 goes through float16 by its bits (``_INT8_F16_BITS``)."""
    if w.dtype == jnp.int8:
        biased = lax.bitcast_convert_type(w.astype(jnp.int16) + jnp.int16(_INT8_F16_BITS), jnp.float16)
        return (biased - jnp.float16(_INT8_F16_OFFSET)).astype(dtype)
    return w.astype(dtype)


def _aligned(offset, multiple: int):
    return offset if isinstance(offset, int) else pl.multiple_of(offset, multiple)


def _k_loop(num_steps: int, steps: int, load, compute, carry):
    """``compute(load(t), carry)`` for K steps ``t`` in ``[0, num_steps)``: ``steps`` loads issued together per
    loop iteration, the remainder unrolled after the loop."""
    def body(it, c):
        tiles = [load(it * steps + u) for u in range(steps)]
        for tile in tiles:
            c = compute(tile, c)
        return c

    iters = num_steps // steps
    carry = lax.fori_loop(0, iters, body, carry)
    for t in range(iters * steps, num_steps):
        carry = compute(load(t), carry)
    return carry


def _int_gemv_kernel(xp_ref, xs_ref, w_ref, s_ref, z_ref, out_ref, *, bits, block_kp, steps, group_steps,
                     per_channel):
    """``xp_ref f32[pack, Kp share]`` (pre-scaled planes), ``xs_ref f32[1, steps per share]`` (sum of x per step;
    per channel ``[1, 1]``: over the share),
    ``w_ref int32[Kp share, block_n]``, ``s_ref / z_ref [groups per share | 1, block_n]``, ``out_ref f32[1,
    block_n]``."""
    pack = 32 // bits
    half = pack // 2
    mask = (1 << bits) - 1
    block_n = w_ref.shape[1]
    num_steps = w_ref.shape[0] // block_kp

    def load(t):
        r0 = _aligned(t * block_kp, block_kp)
        return t, w_ref[pl.ds(r0, block_kp), :], [xp_ref[j, pl.ds(r0, block_kp)] for j in range(pack)]

    def compute(tile, carry):
        t, words, xp = tile
        acc, zacc = carry
        hi = jnp.right_shift(words, 16)
        prod = None
        for j in range(pack):
            src, shift = (words, bits * j) if j < half else (hi, bits * (j - half))
            term = xp[j][:, None] * _to_float(src & (mask << shift))
            prod = term if prod is None else prod + term
        if per_channel:
            return acc + prod, zacc
        g = t // group_steps
        scale = s_ref[g, :].astype(jnp.float32)
        zero = z_ref[g, :].astype(jnp.float32)
        return acc + prod * scale[None, :], zacc + (scale * zero) * xs_ref[0, t]

    acc, zacc = _k_loop(num_steps, steps, load, compute,
                        (jnp.zeros((block_kp, block_n), jnp.float32), jnp.zeros((block_n,), jnp.float32)))
    raw = jnp.sum(acc, axis=0)
    if per_channel:
        scale = s_ref[0, :].astype(jnp.float32)
        zero = z_ref[0, :].astype(jnp.float32)
        out_ref[0, :] = scale * (raw - zero * xs_ref[0, 0])
    else:
        out_ref[0, :] = raw - zacc


# The rms_norm prologue loads the whole row in power-of-two chunks (Triton's load shapes), unrolled; a K whose
# largest power-of-two divisor needs more chunks than this is declined (the norm and the GEMV then run apart).
_MAX_ROW_CHUNKS = 32


def _row_chunk(k: int) -> int:
    """The largest power of two dividing ``k``, at most 4096: the rms_norm prologue's row load size."""
    chunk = k & -k
    while chunk > 4096:
        chunk //= 2
    return chunk


def _rms_norm_prologue(x_ref, res_ref, nw_ref, new_res_ref, *, k_share, block_k, eps, act_dtype):
    """The ``x_tile(k0)`` of the rms_norm prologue (refs: full rows ``[1, K]``): ``rms_norm_reference(x,
    norm_weight, residual)``'s normed row, K step ``k0`` of this program's share, with its rounding steps (the
    residual add in x's dtype, the normalization in float32 rounded to ``act_dtype``, the weight product rounded
    once). Every program reduces the whole row's sum of squares itself (the row is a few kilobytes, read from L2:
    cheaper than a launch); program (0, 0) stores the new residual row."""
    k = x_ref.shape[1]
    base = pl.program_id(1) * k_share
    chunk = _row_chunk(k)

    def summed(k0, size):
        total = x_ref[0, pl.ds(k0, size)].astype(jnp.float32) + res_ref[0, pl.ds(k0, size)].astype(jnp.float32)
        return total.astype(x_ref.dtype)

    rows = [summed(c * chunk, chunk) for c in range(k // chunk)]  # unrolled: the loads are issued together
    sum_sq = functools.reduce(lambda a, b: a + b, [jnp.sum(jnp.square(r.astype(jnp.float32))) for r in rows])
    rstd = lax.rsqrt(sum_sq / k + eps)

    @pl.when((pl.program_id(0) == 0) & (pl.program_id(1) == 0))
    def _():
        for c, r in enumerate(rows):
            new_res_ref[0, pl.ds(c * chunk, chunk)] = r

    def x_tile(k0):
        g0 = _aligned(base + k0, block_k)
        normed = (summed(g0, block_k).astype(jnp.float32) * rstd).astype(act_dtype)
        weight = nw_ref[0, pl.ds(g0, block_k)].astype(act_dtype)
        return (weight.astype(jnp.float32) * normed.astype(jnp.float32)).astype(act_dtype)

    return x_tile


def _silu_mul_prologue(gate_ref, up_ref, *, block_k, act_dtype):
    """The ``x_tile(k0)`` of the silu_mul prologue (refs: this program's shares of the gate and up halves):
    ``silu(gate) * up`` with ``jax.nn.silu``'s rounding steps in ``act_dtype`` (the sigmoid, its product with
    gate, the product with up, each rounded)."""
    def x_tile(k0):
        gate = gate_ref[0, pl.ds(k0, block_k)].astype(jnp.float32)
        up = up_ref[0, pl.ds(k0, block_k)].astype(jnp.float32)
        sigmoid = (1.0 / (1.0 + jnp.exp(-gate))).astype(act_dtype).astype(jnp.float32)
        silu = (gate * sigmoid).astype(act_dtype).astype(jnp.float32)
        return (silu * up).astype(act_dtype)

    return x_tile


def _fp8_gemv_kernel(*refs, block_k, steps, dot_rows, prologue, eps, act_dtype):
    """``w_ref float8_e4m3fn[block_n, K share]``, ``s_ref f32[1, block_n]``, ``out_ref [1, block_n]`` (an fp32
    partial row, or with one K share the output row in the activations' dtype); the
    activations by ``prologue``: None: ``x_ref [1, K share]``; "rms_norm": ``x_ref``, ``res_ref``, ``nw_ref``
    (full rows ``[1, K]``) and the output ``new_res_ref [1, K]``; "silu_mul": ``gate_ref``, ``up_ref [1, K
    share]``. ``dot_rows`` 0 (CUDA-core products) or 16 (tensor-core dot, see the module docstring)."""
    if prologue == "rms_norm":
        x_ref, res_ref, nw_ref, w_ref, s_ref, out_ref, new_res_ref = refs
    elif prologue == "silu_mul":
        gate_ref, up_ref, w_ref, s_ref, out_ref = refs
    else:
        x_ref, w_ref, s_ref, out_ref = refs
    block_n, k_share = w_ref.shape
    if prologue == "rms_norm":
        x_tile = _rms_norm_prologue(x_ref, res_ref, nw_ref, new_res_ref, k_share=k_share, block_k=block_k,
                                    eps=eps, act_dtype=act_dtype)
    elif prologue == "silu_mul":
        x_tile = _silu_mul_prologue(gate_ref, up_ref, block_k=block_k, act_dtype=act_dtype)
    else:
        def x_tile(k0):
            return x_ref[0, pl.ds(k0, block_k)]

    def load(t):
        k0 = _aligned(t * block_k, block_k)
        return w_ref[:, pl.ds(k0, block_k)], x_tile(k0)

    if dot_rows:
        dot_dtype = jnp.float32 if act_dtype == jnp.float32 else jnp.float16
        first_row = lax.broadcasted_iota(jnp.int32, (dot_rows, block_k), 0) == 0
        limit = float(jnp.finfo(dot_dtype).max)

        def compute(tile, acc):
            w, x = tile
            x = jnp.clip(x.astype(jnp.float32), -limit, limit).astype(dot_dtype)
            x_rows = jnp.where(first_row, x[None, :], jnp.zeros((), dot_dtype))
            precision = lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None
            return acc + _dot(x_rows, _upcast_weights(w, dot_dtype), trans_b=True, precision=precision)

        acc_shape, reduce_axis = (dot_rows, block_n), 0
    else:
        def compute(tile, acc):
            w, x = tile
            return acc + x.astype(jnp.float32)[None, :] * _upcast_weights(w, jnp.float32)

        acc_shape, reduce_axis = (block_n, block_k), 1
    acc = _k_loop(k_share // block_k, steps, load, compute, jnp.zeros(acc_shape, jnp.float32))
    out_ref[0, :] = (jnp.sum(acc, axis=reduce_axis) * s_ref[0, :]).astype(out_ref.dtype)


_KNOB_ARGS = ("block_n", "block_k", "steps", "split_k", "num_warps", "num_stages")


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "interpret") + _KNOB_ARGS)
def weight_only_gemv_blocked(x, qweight, scales, zeros, g_idx=None, *, bits: int, group_size: int,
                             interpret: bool = False, block_n: int | None = None, block_k: int | None = None,
                             steps: int | None = None, split_k: int | None = None, num_warps: int | None = None,
                             num_stages: int | None = None) -> jax.Array:
    """``x[M, K] @ dequantized(qweight int32[K*bits/32, N], scales [G, N], zeros [G, N])`` -> ``[M, N]`` in
    ``x.dtype``: the blocked GEMV at M = 1 when the shape tiles (``blocked_tuning``), else (M > 1, ``g_idx``, a
    shape that does not tile) ``weight_only_matmul_pallas`` with its table's knobs. Same contract as
    ``weight_only_matmul_reference``."""
    m, k = x.shape
    pack = 32 // bits
    n = qweight.shape[1]
    t = None
    if m == 1 and g_idx is None and qweight.shape[0] * pack == k:
        t = blocked_tuning(f"int{bits}", n, k, group_size=group_size, block_n=block_n, block_k=block_k,
                           steps=steps, split_k=split_k, num_warps=num_warps, num_stages=num_stages)
    if t is None:
        return weight_only_matmul_pallas(x, qweight, scales, zeros, g_idx, bits=bits, group_size=group_size,
                                         interpret=interpret)
    splits, bn, bk = t["split_k"], t["block_n"], t["block_k"]
    kp_share = k // pack // splits
    steps_share = k // splits // bk
    groups = scales.shape[0]
    per_channel = groups == 1
    groups_share = 1 if per_channel else groups // splits
    shifts = (jnp.arange(pack) % (pack // 2)) * bits
    x_planes = x.astype(jnp.float32).reshape(k // pack, pack).T * jnp.exp2(-shifts.astype(jnp.float32))[:, None]
    x_sums = x.astype(jnp.float32).reshape(splits, steps_share, bk).sum(-1)  # [split_k, steps per share]
    if per_channel:
        x_sums = x_sums.sum(-1, keepdims=True)  # [split_k, 1]: the scale and zero point apply once per share
    sz_index = (lambda j, s: (0, j)) if per_channel else (lambda j, s: (s, j))
    kernel = functools.partial(_int_gemv_kernel, bits=bits, block_kp=bk // pack, steps=t["steps"],
                               group_steps=max(1, group_size // bk), per_channel=per_channel)
    partial_sums = pl.pallas_call(
        kernel,
        grid=(n // bn, splits),
        in_specs=[pl.BlockSpec((pack, kp_share), lambda j, s: (0, s)),
                  pl.BlockSpec((1, x_sums.shape[1]), lambda j, s: (s, 0)),
                  pl.BlockSpec((kp_share, bn), lambda j, s: (s, j)),
                  pl.BlockSpec((groups_share, bn), sz_index),
                  pl.BlockSpec((groups_share, bn), sz_index)],
        out_specs=pl.BlockSpec((1, bn), lambda j, s: (s, j)),
        out_shape=jax.ShapeDtypeStruct((splits, n), jnp.float32),
        interpret=interpret,
        compiler_params=_CompilerParams(num_warps=t["num_warps"], num_stages=t["num_stages"]),
        name=f"int{bits}_gemv_blocked_bn{bn}_bk{bk}_st{t['steps']}_s{splits}",
    )(x_planes, x_sums, qweight, scales, zeros)
    return jnp.sum(partial_sums, axis=0, keepdims=True).astype(x.dtype)


def _knobs(block_n, block_k, steps, split_k, num_warps, num_stages, dot_rows) -> dict:
    """The FP8 entry points' knob arguments as ``blocked_tuning`` overrides."""
    return dict(block_n=block_n, block_k=block_k, steps=steps, split_k=split_k, num_warps=num_warps,
                num_stages=num_stages, dot_rows=dot_rows)


def _fp8_tuning(m: int, k: int, weight, knobs: dict) -> dict | None:
    """The blocked GEMV's knobs for ``[m, k]`` activations on ``weight [N, K]``, or None (M > 1, K not the weight's,
    a shape that does not tile)."""
    if m != 1 or weight.shape[1] != k:
        return None
    return blocked_tuning("fp8", weight.shape[0], k, **knobs)


def _fp8_gemv_call(prologue: str | None, activations: tuple, weight, weight_scale, t: dict, *, act_dtype,
                   eps: float | None, interpret: bool):
    """The blocked FP8 GEMV's ``pallas_call`` with knobs ``t``: ``(y act_dtype[1, N], new residual or None)``. With
    K shares the kernel writes fp32 partial rows that XLA sums (its reduce fusion rounds them); with one share it
    writes ``act_dtype`` itself, so no lone convert kernel follows when the consumer is another kernel."""
    splits, bn, bk = t["split_k"], t["block_n"], t["block_k"]
    n, k = weight.shape
    k_share = k // splits
    scale = jnp.broadcast_to(weight_scale.astype(jnp.float32).reshape(1, -1), (1, n))
    share = pl.BlockSpec((1, k_share), lambda j, s: (0, s))
    out_shape = [jax.ShapeDtypeStruct((splits, n), jnp.float32 if splits > 1 else act_dtype)]
    out_specs = [pl.BlockSpec((1, bn), lambda j, s: (s, j))]
    if prologue == "rms_norm":
        row = pl.BlockSpec((1, k), lambda j, s: (0, 0))
        in_specs = [row, row, row]
        out_shape.append(jax.ShapeDtypeStruct((1, k), activations[0].dtype))
        out_specs.append(row)
    elif prologue == "silu_mul":  # one [1, 2K] array, read as its gate half and its up half
        in_specs = [share, pl.BlockSpec((1, k_share), lambda j, s: (0, s + splits))]
    else:
        in_specs = [share]
    name = (f"fp8_gemv_blocked_bn{bn}_bk{bk}_st{t['steps']}_s{splits}{'_dot' if t['dot_rows'] else ''}"
            f"{'_' + prologue if prologue else ''}")
    outs = pl.pallas_call(
        functools.partial(_fp8_gemv_kernel, block_k=bk, steps=t["steps"], dot_rows=t["dot_rows"],
                          prologue=prologue, eps=eps, act_dtype=act_dtype),
        grid=(n // bn, splits),
        in_specs=in_specs + [pl.BlockSpec((bn, k_share), lambda j, s: (j, s)),
                             pl.BlockSpec((1, bn), lambda j, s: (0, j))],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=_CompilerParams(num_warps=t["num_warps"], num_stages=t["num_stages"]),
        name=name,
    )(*activations, weight, scale)
    y = jnp.sum(outs[0], axis=0, keepdims=True).astype(act_dtype) if splits > 1 else outs[0]
    return y, (outs[1] if prologue == "rms_norm" else None)


@functools.partial(jax.jit, static_argnames=("interpret", "dot_rows") + _KNOB_ARGS)
def fp8_gemv_blocked(x, weight, weight_scale, *, interpret: bool = False, block_n: int | None = None,
                     block_k: int | None = None, steps: int | None = None, split_k: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None,
                     dot_rows: int | None = None) -> jax.Array:
    """``x[M, K] @ (weight float8_e4m3fn | int8 [N, K] * weight_scale f32[N, 1] | [1]).T`` -> ``[M, N]`` in
    ``x.dtype``: the blocked GEMV at M = 1 when the shape tiles, else ``fp8_weight_only_matmul_pallas``. Same
    contract as ``fp8_weight_only_matmul_reference``, except that on the tensor-core path (``dot_rows`` 16) 16-bit
    activations beyond float16's range are clipped to it."""
    knobs = _knobs(block_n, block_k, steps, split_k, num_warps, num_stages, dot_rows)
    t = _fp8_tuning(x.shape[0], x.shape[1], weight, knobs)
    if t is None:
        return fp8_weight_only_matmul_pallas(x, weight, weight_scale, interpret=interpret)
    y, _ = _fp8_gemv_call(None, (x,), weight, weight_scale, t, act_dtype=x.dtype, eps=None, interpret=interpret)
    return y


@functools.partial(jax.jit, static_argnames=("eps", "norm_dtype", "interpret", "dot_rows") + _KNOB_ARGS)
def fp8_rms_norm_gemv_blocked(x, residual, norm_weight, weight, weight_scale, *, eps: float, norm_dtype=None,
                              interpret: bool = False, block_n: int | None = None, block_k: int | None = None,
                              steps: int | None = None, split_k: int | None = None, num_warps: int | None = None,
                              num_stages: int | None = None, dot_rows: int | None = None):
    """vLLM's ``fused_add_rms_norm`` and the FP8 GEMV after it, in one kernel: with ``normed, new_residual =
    models.norm.rms_norm_reference(x, norm_weight, residual, eps=eps, dtype=norm_dtype)``, returns
    ``(fp8_gemv_blocked(normed, weight, weight_scale) norm_dtype[1, N], new_residual x.dtype[1, K])``.

    x, residual: ``[1, K]`` (16- or 32-bit float, the same dtype); norm_weight: ``[K]``; weight / weight_scale as
    ``fp8_gemv_blocked``; norm_dtype: the normed row's dtype (default x's). Returns None (at trace time) when the
    shape does not tile the blocked GEMV (M > 1, or the knobs' ``blocked_tuning`` is None) or K would take the
    row load more than ``_MAX_ROW_CHUNKS`` chunks: the caller runs the norm and the matmul apart."""
    norm_dtype = x.dtype if norm_dtype is None else jnp.dtype(norm_dtype)
    m, k = x.shape
    knobs = _knobs(block_n, block_k, steps, split_k, num_warps, num_stages, dot_rows)
    if residual.shape != x.shape or residual.dtype != x.dtype or norm_weight.shape != (k,):
        raise ValueError(f"residual must match x {x.shape} {x.dtype} and norm_weight be [{k}]; got "
                         f"{residual.shape} {residual.dtype}, {norm_weight.shape}")
    t = _fp8_tuning(m, k, weight, knobs)
    if t is None or k // _row_chunk(k) > _MAX_ROW_CHUNKS:
        return None
    y, new_residual = _fp8_gemv_call("rms_norm", (x, residual, norm_weight.reshape(1, k)), weight, weight_scale,
                                     t, act_dtype=norm_dtype, eps=float(eps), interpret=interpret)
    return y, new_residual


@functools.partial(jax.jit, static_argnames=("interpret", "dot_rows") + _KNOB_ARGS)
def fp8_silu_mul_gemv_blocked(gate_up, weight, weight_scale, *, interpret: bool = False, block_n: int | None = None,
                              block_k: int | None = None, steps: int | None = None, split_k: int | None = None,
                              num_warps: int | None = None, num_stages: int | None = None,
                              dot_rows: int | None = None):
    """SwiGLU's activation and the FP8 GEMV after it, in one kernel: ``gate_up [1, 2K]`` = [gate | up] ->
    ``fp8_gemv_blocked(jax.nn.silu(gate) * up, weight, weight_scale)`` (``gate_up.dtype[1, N]``). Returns None (at
    trace time) when the shape does not tile the blocked GEMV: the caller runs the two apart."""
    m, two_k = gate_up.shape
    knobs = _knobs(block_n, block_k, steps, split_k, num_warps, num_stages, dot_rows)
    t = _fp8_tuning(m, two_k // 2, weight, knobs) if two_k % 2 == 0 else None
    if t is None:
        return None
    y, _ = _fp8_gemv_call("silu_mul", (gate_up, gate_up), weight, weight_scale, t, act_dtype=gate_up.dtype,
                          eps=None, interpret=interpret)
    return y


register_weight_only_matmul("pallas_blocked", weight_only_gemv_blocked)
register_fp8_matmul("pallas_blocked", fp8_gemv_blocked, rms_norm=fp8_rms_norm_gemv_blocked,
                    silu_mul=fp8_silu_mul_gemv_blocked)

__all__ = ["blocked_tuning", "fp8_gemv_blocked", "fp8_rms_norm_gemv_blocked", "fp8_silu_mul_gemv_blocked",
           "weight_only_gemv_blocked"]
