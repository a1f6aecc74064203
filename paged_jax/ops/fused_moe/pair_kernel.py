"""The experts of a decode-sized MoE step as two Pallas (Triton) kernels over (token, expert) pairs, unsorted.

With a few tokens, nearly every (token, expert) pair has an expert to itself, so sorting the pairs by expert and
tiling the sorted rows (``kernel.py``) buys nothing: its 16-row tiles are one row and padding, every program first
scans the experts' row counts to find its tile, and the sort and the inverse permutation are kernels of their own.
Here a program takes pair ``p`` (token ``p // top_k``, the token-major order of ``topk_ids``) directly: it reads the
pair's expert id, then multiplies one row by ``block_n`` columns of the expert's ``[K, N]`` weights over its share
of K, as a broadcast multiply and a float32 sum over K (no 16-row matrix-unit tile, no shared-memory staging). The
grid is (pairs, column blocks, K splits), split so that the grid holds about ``PAIR_TARGET_PROGRAMS`` programs.

* gate / up: the token's row times both weights (two accumulators), written as float32 partial sums
  ``[splits, P, I]`` per weight;
* down: each program builds its K chunk of the pair's activation from those partial sums (their sum over the
  splits, ``silu(gate) * up`` in float32, rounded once to the rows' dtype, as the reference rounds it), so the
  activation never crosses memory, and writes float32 partial sums ``[splits, P, H]``, which XLA adds inside the
  weighted top-k sum that reads them.

A pair whose expert another pair of the step shares reads that expert again: the form suits steps of distinct
experts (``models.moe.PAIR_FORM_MAX_PAIRS``). Float experts only (bf16 / fp16 / fp32).

The oracle is ``models.moe.pair_experts_reference`` (each pair's expert gathered, batched products).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from models.moe import check_expert_shapes
from paged_jax.ops.fused_moe.kernel import KERNEL_DTYPES, split_steps
from paged_jax.ops.ragged_paged_attention.common import TRITON_COMPILER_PARAMS as _CompilerParams
from paged_jax.ops.ragged_paged_attention.common import next_pow2
from paged_jax.ops.ragged_paged_attention.common import triton_load as _load, triton_store as _store

# Programs a launch aims for when it picks its K split: several per SM of an H100 / H200 (132 SMs).
PAIR_TARGET_PROGRAMS = 1024
PAIR_BLOCK_N = 128  # contiguous output columns a program reads per weight row
PAIR_BLOCK_K = 64  # weight rows per loop step
PAIR_NUM_WARPS = 4


def pair_launch(num_pairs: int, k: int, n: int, block_n: int = PAIR_BLOCK_N,
                block_k: int = PAIR_BLOCK_K) -> tuple[int, int, int, int]:
    """``(block_n, column_blocks, splits, steps)`` of a launch over ``num_pairs`` pairs of ``[K, N]`` experts: the
    column block at most N's power of two, K split so the grid holds about ``PAIR_TARGET_PROGRAMS`` programs."""
    block_n = min(block_n, next_pow2(n))
    column_blocks = -(-n // block_n)
    splits, steps = split_steps(k, block_k, None, num_pairs * column_blocks, PAIR_TARGET_PROGRAMS)
    return block_n, column_blocks, splits, steps


def _activation_chunk(gate_ref, up_ref, pair, k0, k_ok, *, block_k: int, splits_in: int, num_pairs: int, dtype):
    """float32 ``[block_k]``: K chunk ``[k0, k0 + block_k)`` of pair ``pair``'s activation, from the gate / up
    partial sums ``gate_ref``, ``up_ref`` (float32 ``[splits_in * P, I]``): ``silu(sum gate) * sum up`` rounded to
    ``dtype``."""
    split = jnp.arange(next_pow2(splits_in), dtype=jnp.int32)
    mask = (split < splits_in)[:, None]
    if k_ok is not None:
        mask = mask & k_ok[None, :]
    rows = (jnp.where(split < splits_in, split, 0) * num_pairs + pair)[:, None]
    cols = k0 + jnp.arange(block_k, dtype=jnp.int32)[None, :]
    gate = jnp.sum(_load(gate_ref.at[rows, cols], mask=mask, other=0.0), axis=0)
    up = jnp.sum(_load(up_ref.at[rows, cols], mask=mask, other=0.0), axis=0)
    return (jax.nn.silu(gate) * up).astype(dtype).astype(jnp.float32)


def _pair_kernel(expert_ref, *refs, block_n: int, block_k: int, steps: int, k_masked: bool, top_k: int,
                 splits_in: int, num_pairs: int, dtype):
    """Program (pair, column block, K split). refs: the rows ``x [T, K]`` (``splits_in`` 0) or the gate / up
    partial sums (float32 ``[splits_in * P, K]`` each), then the weight stacks ``[E, K, N]`` (gate and up, or
    down), then one float32 ``[splits, P, N]`` output per weight."""
    num_lhs = 1 if splits_in == 0 else 2
    num_weights = 2 if splits_in == 0 else 1
    lhs_refs = refs[:num_lhs]
    weight_refs = refs[num_lhs:num_lhs + num_weights]
    out_refs = refs[num_lhs + num_weights:]
    pair, column_block, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    k_total, n_total = weight_refs[0].shape[1:]
    expert = expert_ref[pair]
    c0 = column_block * block_n
    cols = c0 + jnp.arange(block_n, dtype=jnp.int32)
    col_ok = cols < n_total if n_total % block_n else None

    def body(step, accs):
        k0 = (split * steps + step) * block_k
        k_ok = (k0 + jnp.arange(block_k, dtype=jnp.int32) < k_total) if k_masked else None
        if splits_in == 0:
            a_ref = lhs_refs[0].at[pair // top_k, pl.ds(k0, block_k)]
            a = (_load(a_ref) if k_ok is None else _load(a_ref, mask=k_ok, other=0.0)).astype(jnp.float32)
        else:
            a = _activation_chunk(*lhs_refs, pair, k0, k_ok, block_k=block_k, splits_in=splits_in,
                                  num_pairs=num_pairs, dtype=dtype)
        mask = None
        if k_ok is not None or col_ok is not None:
            mask = (k_ok[:, None] if k_ok is not None else True) & (col_ok[None, :] if col_ok is not None else True)
        out = []
        for acc, w_ref in zip(accs, weight_refs):
            tile_ref = w_ref.at[expert, pl.ds(k0, block_k), pl.ds(c0, block_n)]
            w = _load(tile_ref) if mask is None else _load(tile_ref, mask=mask, other=0.0)
            out.append(acc + jnp.sum(a[:, None] * w.astype(jnp.float32), axis=0))
        return tuple(out)

    accs = lax.fori_loop(0, steps, body, (jnp.zeros((block_n,), jnp.float32),) * num_weights)
    store_cols = cols if col_ok is None else jnp.where(col_ok, cols, n_total)
    for out_ref, acc in zip(out_refs, accs):
        _store(out_ref.at[split, pair, store_cols], acc, mask=col_ok)


def _launch(lhs_operands: tuple, weights: tuple, pair_expert, *, top_k: int, splits_in: int, dtype, interpret: bool,
            block_n: int, block_k: int, num_warps: int, name: str) -> tuple:
    """One kernel launch over the pairs: float32 ``[splits, P, N]`` partial sums per weight."""
    num_pairs = pair_expert.shape[0]
    _, k, n = weights[0].shape
    block_n, column_blocks, splits, steps = pair_launch(num_pairs, k, n, block_n, block_k)
    kernel = functools.partial(_pair_kernel, block_n=block_n, block_k=block_k, steps=steps,
                               k_masked=splits * steps * block_k != k, top_k=top_k, splits_in=splits_in,
                               num_pairs=num_pairs, dtype=dtype)
    return pl.pallas_call(
        kernel,
        grid=(num_pairs, column_blocks, splits),
        out_shape=(jax.ShapeDtypeStruct((splits, num_pairs, n), jnp.float32),) * len(weights),
        interpret=interpret,
        compiler_params=_CompilerParams(num_warps=num_warps, num_stages=2),
        name=f"moe_pair_{name}_bn{block_n}_bk{block_k}_s{splits}",
    )(pair_expert, *lhs_operands, *weights)


@functools.partial(jax.jit, static_argnames=("interpret", "block_n", "block_k", "num_warps"))
def pair_experts_pallas(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, topk_ids: jax.Array, *,
                        interpret: bool = False, block_n: int = PAIR_BLOCK_N, block_k: int = PAIR_BLOCK_K,
                        num_warps: int = PAIR_NUM_WARPS) -> jax.Array:
    """``models.moe.pair_experts_reference`` as two Pallas Triton kernels.

    Args:
      x: ``dtype[T, H]`` (bf16 / fp16 / fp32); w_gate, w_up: ``dtype[E, H, I]``; w_down: ``dtype[E, I, H]``.
      topk_ids: ``int32[T, k]`` in ``[0, E)``: pair ``p`` is token ``p // k``'s slot ``p % k``.
      interpret: Pallas interpret mode (CPU tests); block_n, block_k, num_warps: both launches'.
    Returns:
      float32 ``[T * k, H]``: each pair's ``down(silu(gate(x)) * up(x))`` (the activation rounded to ``dtype``),
      the sum of the down kernel's partial sums (an XLA reduce that fuses into the consumer).
    """
    check_expert_shapes(x.shape[1], w_gate, w_up, w_down)
    dtypes = {jnp.dtype(a.dtype) for a in (x, w_gate, w_up, w_down)}
    if len(dtypes) != 1 or not dtypes <= set(KERNEL_DTYPES):
        raise ValueError(f"x and the experts must share one of {', '.join(map(str, KERNEL_DTYPES))}; got "
                         f"{', '.join(map(str, dtypes))}")
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return jnp.zeros((0, x.shape[1]), jnp.float32)
    pair_expert = topk_ids.reshape(-1).astype(jnp.int32)
    launch = functools.partial(_launch, pair_expert=pair_expert, top_k=top_k, dtype=x.dtype, interpret=interpret,
                               block_n=block_n, block_k=block_k, num_warps=num_warps)
    gate, up = launch((x,), (w_gate, w_up), splits_in=0, name="gate_up")
    splits_in, _, inter = gate.shape
    flat = (gate.reshape(splits_in * num_pairs, inter), up.reshape(splits_in * num_pairs, inter))
    (down,) = launch(flat, (w_down,), splits_in=splits_in, name="down")
    return down.sum(axis=0)
