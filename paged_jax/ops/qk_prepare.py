"""Everything between the qkv projection and paged attention as one kernel: the optional per-head q/k RMSNorm
(Qwen3; Gemma 3's by ``1 + weight``), RoPE on q and k, the optional FP8 KV scaling, and the write of K and V into the paged pool.

In XLA that chain is several small kernels per decoder layer (norm reduce + multiply for q and for k, RoPE
concatenates, one KV write per pool; at T > 1 two scatters), each paid at its launch cost whatever the batch.
``qk_prepare(impl="pallas")`` is one Pallas Triton kernel instead: program ``(i, h)`` of the grid
``(ceil(T / BT), Hq + Hkv)`` transforms head ``h`` of tokens ``i * BT ... (i + 1) * BT - 1`` (``BT`` =
``MAX_BLOCK_TOKENS`` or fewer): q head ``h < Hq`` (stored to the returned q) or K head ``h - Hq`` (stored to the K
pool at each token's slot, with V head ``h - Hq`` beside it), both pools aliased in place. The math is
``models.qk_transform.apply_qk_transform`` then ``paged_jax.ops.kv_write.write_kv`` (``qk_prepare_reference``),
op for op: RoPE's rotate-half is a second load of each row at the partner columns, so no value is ever sliced.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from models.qk_transform import QKTransform, apply_qk_transform, scale_q
from paged_jax.ops.kv_write import pool_saturation_max, write_kv
from paged_jax.ops.ragged_paged_attention.common import TRITON_COMPILER_PARAMS as _CompilerParams
from paged_jax.ops.ragged_paged_attention.common import next_pow2
from paged_jax.ops.ragged_paged_attention.common import triton_load as _load, triton_store as _store

QK_PREPARE_IMPLS = ("auto", "xla", "pallas")
MAX_BLOCK_TOKENS = 16  # tokens per program (a [16, D] tile per head)


def qk_prepare_reference(q, k, v, k_pages, v_pages, slot_mapping, transform: QKTransform):
    """The jnp oracle (and ``impl="xla"``): ``apply_qk_transform``, then ``write_kv``. Same contract as
    ``qk_prepare``."""
    q, k, v = apply_qk_transform(transform, q, k, v)
    k_pages, v_pages = write_kv(k_pages, v_pages, k, v, slot_mapping)
    return q, k_pages, v_pages


def _kernel(slot_ref, qkv_ref, cos_ref, sin_ref, *refs, num_q_heads: int, num_kv_heads: int, num_slots: int,
            block_tokens: int, drop_out_of_range: bool, has_qk_norm: bool, has_kv_scale: bool, norm_eps, norm_dtype,
            norm_unit_offset: bool, fp8_max, rope_interleaved: bool):
    """slot_ref int32[T]; qkv_ref [T, Hq + 2 Hkv, D] (q heads, then K, then V); cos_ref / sin_ref float32[T, D/2];
    then, if present, the q and k norm weights [D] and kv_scale float32[2]; then the K / V pools
    [num_slots, Hkv, D] (inputs, aliased to the outputs), then the outputs q [T, Hq, D], K pool, V pool.
    Program (i, h) does head h (q head, or K head h - Hq with V beside it) of tokens i * block_tokens ...; each
    token row is transformed on its own, so the block only amortizes the launch and the index math."""
    refs = list(refs)
    q_norm_ref, k_norm_ref = (refs.pop(0), refs.pop(0)) if has_qk_norm else (None, None)
    kv_scale_ref = refs.pop(0) if has_kv_scale else None
    _, _, q_out_ref, k_out_ref, v_out_ref = refs
    first_token = pl.program_id(0) * block_tokens  # outside pl.when: interpret mode resolves program ids here
    head = pl.program_id(1)
    num_tokens, _, head_dim = qkv_ref.shape
    half = head_dim // 2
    compute_dtype = qkv_ref.dtype
    # Only integer-array indexers (no slices): the same code then runs in interpret mode (see triton_kernel.py).
    token = first_token + jnp.arange(block_tokens, dtype=jnp.int32)
    token_valid = token < num_tokens
    load_token = jnp.where(token_valid, token, 0)[:, None]  # [BT, 1]; rows past T are masked off
    valid = jnp.broadcast_to(token_valid[:, None], (block_tokens, head_dim))
    dim = jnp.arange(head_dim, dtype=jnp.int32)[None, :]  # [1, D]
    first_half, partner, freq = _rope_columns(dim, half, rope_interleaved)
    cos = _load(cos_ref.at[load_token, freq], mask=valid, other=0.0)  # float32[BT, D]: cat(cos, cos)
    sin = _load(sin_ref.at[load_token, freq], mask=valid, other=0.0)
    sign = jnp.where(first_half, -1.0, 1.0).astype(jnp.float32)  # rotate_half(x) = cat(-x2, x1)

    def transformed(row, norm_ref):
        """Head ``row`` of the block's tokens: q/k norm (optional), then RoPE, as apply_qk_transform; [BT, D]."""
        x = _load(qkv_ref.at[load_token, row, dim], mask=valid, other=0.0)
        x_partner = _load(qkv_ref.at[load_token, row, partner], mask=valid, other=0.0)
        if norm_ref is not None:
            # models.norm.rms_norm_reference per token; the partner columns share their row's mean square.
            x32 = x.astype(jnp.float32)
            inv_rms = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=1) + norm_eps)[:, None]
            x = _normed(x32, inv_rms, _load(norm_ref.at[dim]), norm_dtype, norm_unit_offset)
            x_partner = _normed(x_partner.astype(jnp.float32), inv_rms, _load(norm_ref.at[partner]), norm_dtype,
                                norm_unit_offset)
        # models.qk_transform.apply_rope: x1 * cos - x2 * sin | x2 * cos + x1 * sin, in float32.
        rotated = x.astype(jnp.float32) * cos + (sign * x_partner.astype(jnp.float32)) * sin
        return rotated.astype(x.dtype)

    def to_pool(x, pool_dtype):
        if fp8_max is not None:  # as write_kv: an FP8 pool saturates instead of casting to NaN
            x = jnp.clip(x.astype(jnp.float32), -fp8_max, fp8_max)
        return x.astype(pool_dtype)

    @pl.when(head < num_q_heads)
    def _():
        q = transformed(head, q_norm_ref)
        if kv_scale_ref is not None:
            q = (q.astype(jnp.float32) * _load(kv_scale_ref.at[jnp.zeros((), jnp.int32)])).astype(compute_dtype)
        store_token = jnp.where(token_valid, token, num_tokens)[:, None]  # masked off; out of range when interpreted
        _store(q_out_ref.at[store_token, head, dim], q, mask=valid)

    @pl.when(head >= num_q_heads)
    def _():
        kv_head = head - num_q_heads
        k = transformed(head, k_norm_ref)
        v = _load(qkv_ref.at[load_token, num_q_heads + num_kv_heads + kv_head, dim], mask=valid, other=0.0)
        if kv_scale_ref is not None:
            k = (k.astype(jnp.float32) / _load(kv_scale_ref.at[jnp.zeros((), jnp.int32)])).astype(compute_dtype)
            v = (v.astype(jnp.float32) / _load(kv_scale_ref.at[jnp.ones((), jnp.int32)])).astype(compute_dtype)
        slot = _load(slot_ref.at[load_token[:, 0]], mask=token_valid, other=0)  # int32[BT]
        in_range = (slot >= 0) & (slot < num_slots)
        if drop_out_of_range:  # write_kv's scatter (T > 1): an out-of-range slot is dropped
            keep = token_valid & in_range
            row = jnp.where(keep, slot, num_slots)  # masked off; out of range for interpret mode too
        else:  # write_kv's T == 1 path: an out-of-range slot goes to slot 0 of the null block
            keep = token_valid
            row = jnp.where(in_range, slot, 0)
        mask = jnp.broadcast_to(keep[:, None], (block_tokens, head_dim))
        _store(k_out_ref.at[row[:, None], kv_head, dim], to_pool(k, k_out_ref.dtype), mask=mask)
        _store(v_out_ref.at[row[:, None], kv_head, dim], to_pool(v, v_out_ref.dtype), mask=mask)


def _normed(x32, inv_rms, weight, norm_dtype, unit_offset: bool):
    """``models.norm.rms_norm_reference``'s scaling of float32 rows ``x32`` [BT, D] by ``inv_rms`` [BT, 1]: by
    ``weight`` [D] in ``norm_dtype``, or (``unit_offset``, Gemma) by ``1 + weight`` in float32, cast after."""
    if unit_offset:
        return (x32 * inv_rms * (1.0 + weight.astype(jnp.float32))).astype(norm_dtype)
    return weight.astype(norm_dtype) * (x32 * inv_rms).astype(norm_dtype)


def _rope_columns(dim: jax.Array, half: int, interleaved: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For head columns ``dim`` int32[1, D]: (whether each is the first of its rotated pair, its partner column, its
    frequency). Halves: column ``c < D/2`` pairs with ``c + D/2`` (rotate_half); interleaved (Llama 4): ``2i`` with
    ``2i + 1``, frequency ``i``."""
    if interleaved:
        first = dim % 2 == 0
        return first, jnp.where(first, dim + 1, dim - 1), dim // 2
    first = dim < half
    return first, jnp.where(first, dim + half, dim - half), jnp.where(first, dim, dim - half)


def _qk_prepare_pallas(q, k, v, k_pages, v_pages, slot_mapping, transform: QKTransform, *, interpret: bool):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    num_blocks, block_size = k_pages.shape[:2]
    num_slots = num_blocks * block_size
    # One [T, Hq + 2 Hkv, D] operand. When q, k, v are the column split of one fused qkv projection (the engine's
    # layout), XLA folds this concatenate of its adjacent slices back into that projection's output: no copy.
    qkv = jnp.concatenate([q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v.reshape(num_tokens, -1)],
                          axis=1).reshape(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim)
    cos = transform.cos.reshape(num_tokens, head_dim // 2).astype(jnp.float32)
    sin = transform.sin.reshape(num_tokens, head_dim // 2).astype(jnp.float32)
    extra = []
    if transform.has_qk_norm:
        extra += [transform.q_norm_weight, transform.k_norm_weight]
    if transform.kv_scale is not None:
        extra.append(transform.kv_scale.astype(jnp.float32))
    pool_shape = (num_slots, num_kv_heads, head_dim)
    pool_dtype = k_pages.dtype
    fp8_max = pool_saturation_max(pool_dtype)
    # Tokens per program: one head row each is a single warp's work, so a large batch would be a grid of tiny
    # programs (their launch rate, not the bytes, would bound it); a block of rows amortizes that.
    block_tokens = min(MAX_BLOCK_TOKENS, next_pow2(num_tokens))
    kernel = functools.partial(
        _kernel, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, num_slots=num_slots, block_tokens=block_tokens,
        drop_out_of_range=num_tokens > 1, has_qk_norm=transform.has_qk_norm,
        has_kv_scale=transform.kv_scale is not None, norm_eps=transform.norm_eps,
        norm_dtype=transform.dtype, norm_unit_offset=transform.norm_unit_offset, fp8_max=fp8_max,
        rope_interleaved=transform.rope_interleaved)
    inputs = [slot_mapping.astype(jnp.int32), qkv, cos, sin, *extra,
              k_pages.reshape(pool_shape), v_pages.reshape(pool_shape)]
    num_inputs = len(inputs)
    q_out, k_flat, v_flat = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_tokens, block_tokens), num_q_heads + num_kv_heads),
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(pool_shape, pool_dtype),
                   jax.ShapeDtypeStruct(pool_shape, pool_dtype)],
        input_output_aliases={num_inputs - 2: 1, num_inputs - 1: 2},
        interpret=interpret,
        compiler_params=_CompilerParams(num_warps=max(1, min(4, block_tokens * head_dim // 512)), num_stages=1),
        name="qk_prepare",
    )(*inputs)
    return scale_q(transform, q_out), k_flat.reshape(k_pages.shape), v_flat.reshape(v_pages.shape)


def check_qk_prepare_impl(impl: str) -> str:
    """``impl`` itself, or a ValueError naming ``qk_prepare_impl``."""
    if impl not in QK_PREPARE_IMPLS:
        raise ValueError(f"qk_prepare_impl must be one of {', '.join(QK_PREPARE_IMPLS)}, got {impl!r}")
    return impl


def resolve_qk_prepare_impl(impl: str, q, k_pages, transform: QKTransform) -> str:
    """``impl`` -> "xla" or "pallas". "auto": the kernel on a GPU when the head dim is a power of two >= 16 (Triton
    tiles), the q/k norms (if any) cast to q's dtype and, for an FP8 pool, the device converts to float8 (sm_89+);
    XLA otherwise. ValueError naming ``impl`` for an unknown name."""
    if check_qk_prepare_impl(impl) != "auto":
        return impl
    if jax.default_backend() != "gpu" or _kernel_unsupported(q, k_pages, transform, check_device=True):
        return "xla"
    return "pallas"


def _kernel_unsupported(q, k_pages, transform: QKTransform, *, check_device: bool) -> str | None:
    """Why the Pallas kernel cannot run these operands (None: it can): its Triton tiles need a power-of-two head dim
    >= 16, it rotates whole heads, its q/k norms (by ``weight`` or Gemma's ``1 + weight``) return q's dtype, and an
    FP8 pool needs a device that converts to float8."""
    head_dim = q.shape[-1]
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two >= 16"
    if transform.cos is None:
        return "no RoPE (a NoPE layer)"
    if 2 * transform.cos.shape[-1] != head_dim:
        return f"partial rotary ({2 * transform.cos.shape[-1]} of {head_dim} dims)"
    if transform.has_qk_norm and jnp.dtype(transform.dtype) != q.dtype:
        return f"transform.dtype {jnp.dtype(transform.dtype)} differs from q's dtype {q.dtype}"
    if check_device and jnp.dtype(k_pages.dtype).itemsize == 1:
        capability = getattr(jax.devices()[0], "compute_capability", None)
        if capability is None or tuple(int(p) for p in str(capability).split(".")[:2]) < (8, 9):
            return f"a {jnp.dtype(k_pages.dtype)} pool needs a GPU of compute capability >= 8.9"
    return None


def qk_prepare(q, k, v, k_pages, v_pages, slot_mapping, transform: QKTransform, *, impl: str = "auto",
               interpret: bool = False):
    """Transform q/k (``QKTransform``: q/k norm, RoPE, FP8 KV scaling) and write K/V into the paged pool.

    Args:
      q: [T, Hq, D]; k, v: [T, Hkv, D] in the compute dtype: the projections' outputs, not yet normed or rotated.
      k_pages, v_pages: one layer's pools ``[num_blocks, block_size, Hkv, D]`` (donated by the caller's jit, so
        the kernel writes them in place).
      slot_mapping: int32[T], as ``write_kv``: padding tokens write slots of the null block 0; an out-of-range slot
        is dropped when T > 1 and written to slot 0 of the null block when T == 1.
      transform: the layer's ``QKTransform`` (cos / sin float32[T, 1, R/2], R <= D the rotated dims, or None: no
        RoPE, which the kernel leaves to XLA).
      impl: "xla" (``qk_prepare_reference``), "pallas" (one Pallas Triton kernel; one device: a pallas_call is not
        partitioned over a mesh; head dim a power of two) or "auto" (``resolve_qk_prepare_impl``).
      interpret: run the Pallas kernel in interpret mode (CPU tests).
    Returns:
      (q [T, Hq, D] ready for attention, k_pages, v_pages updated), q in its input dtype.
    """
    if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q must be [T, Hq, D] and k, v [T, Hkv, D]; got {q.shape}, {k.shape}, {v.shape}")
    head_dim = q.shape[2]
    rope_shape = None if transform.cos is None else (q.shape[0], 1, transform.cos.shape[-1])
    if rope_shape is not None and (head_dim % 2 or transform.cos.shape != rope_shape
                                   or transform.sin.shape != rope_shape or not 0 < rope_shape[2] <= head_dim // 2):
        raise ValueError(f"transform.cos / sin must be [T={q.shape[0]}, 1, R/2 <= {head_dim // 2}], got "
                         f"{transform.cos.shape} / {transform.sin.shape}")
    impl = resolve_qk_prepare_impl(impl, q, k_pages, transform)
    if impl == "xla" or q.shape[0] == 0:
        return qk_prepare_reference(q, k, v, k_pages, v_pages, slot_mapping, transform)
    if k_pages.ndim != 4 or v_pages.shape != k_pages.shape or k_pages.shape[2:] != k.shape[1:]:
        raise ValueError(f"k_pages / v_pages must be [num_blocks, block_size, {k.shape[1]}, {head_dim}], got "
                         f"{k_pages.shape} / {v_pages.shape}")
    if v_pages.dtype != k_pages.dtype:
        raise ValueError(f"v_pages dtype {v_pages.dtype} must equal k_pages dtype {k_pages.dtype}")
    if slot_mapping.shape != (q.shape[0],):
        raise ValueError(f"slot_mapping must be [T={q.shape[0]}], got shape {slot_mapping.shape}")
    reason = _kernel_unsupported(q, k_pages, transform, check_device=not interpret)
    if reason is not None:
        raise ValueError(f"qk_prepare impl='pallas': {reason}; use impl='auto' or 'xla'")
    if q.dtype != k.dtype or v.dtype != k.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    return _qk_prepare_pallas(q, k, v, k_pages, v_pages, slot_mapping, transform, interpret=interpret)
