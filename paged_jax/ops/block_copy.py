"""Copy-on-write block copies inside the jitted step: block ``dst[i]`` of every layer's K and V pool becomes a copy
of block ``src[i]``.

The step carries a fixed number of copy slots (``paged_jax.worker.step_io.StepLayout``), almost always all padding. In
XLA (``impl="xla"``) each layer's K and V copy is its own in-place ``dynamic_update_slice`` kernel (plus a select
keeping a padding destination out), paid on every step: two launches per layer at batch-1 decode. The Pallas
kernel (``impl="pallas"``, GPU) copies every layer's K and V in ONE launch, the pools aliased in place; its programs
return at once on padding slots, so a step without copies costs one near-empty launch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from paged_jax.ops.ragged_paged_attention.common import TRITON_COMPILER_PARAMS as _CompilerParams
from paged_jax.ops.ragged_paged_attention.common import next_pow2 as _next_pow2
from paged_jax.ops.ragged_paged_attention.common import triton_load as _load, triton_store as _store

BLOCK_COPY_IMPLS = ("auto", "xla", "pallas")
# Elements of one block each program moves per pool array (a 1D tile: 32 per thread at 4 warps).
_MAX_TILE = 4096


def _copy_kernel(src_ref, dst_ref, *refs, num_arrays: int, num_blocks: int, block_elems: int, tile: int):
    """src_ref / dst_ref int32[C]; refs: ``num_arrays`` pools [num_blocks, E] in, then the same buffers out."""
    pools_in, pools_out = refs[:num_arrays], refs[num_arrays:]
    src = src_ref[pl.program_id(0)]
    dst = dst_ref[pl.program_id(0)]
    first_col = pl.program_id(1) * tile  # outside pl.when: interpret mode resolves program ids at the top level

    @pl.when((dst >= 0) & (dst < num_blocks) & (src >= 0) & (src < num_blocks))
    def _():
        col = first_col + jnp.arange(tile, dtype=jnp.int32)
        in_range = col < block_elems
        load_col = jnp.where(in_range, col, 0)
        store_col = jnp.where(in_range, col, block_elems)  # masked off; out of range for interpret mode too
        for pool_in, pool_out in zip(pools_in, pools_out):
            block = _load(pool_in.at[src, load_col], mask=in_range)
            _store(pool_out.at[dst, store_col], block, mask=in_range)


def _copy_blocks_pallas(kv_pool: list, src: jax.Array, dst: jax.Array, *, interpret: bool) -> list:
    flat = [pages for layer in kv_pool for pages in layer]
    live = [i for i, pages in enumerate(flat) if pages.size]  # a latent cache's V pools have no width (MLA)
    shape = flat[live[0]].shape
    num_blocks = shape[0]
    block_elems = 1
    for size in shape[1:]:
        block_elems *= size
    arrays = [flat[i].reshape(num_blocks, block_elems) for i in live]
    tile = min(_MAX_TILE, _next_pow2(block_elems))
    num_arrays = len(arrays)
    kernel = functools.partial(_copy_kernel, num_arrays=num_arrays, num_blocks=num_blocks, block_elems=block_elems,
                               tile=tile)
    outs = pl.pallas_call(
        kernel,
        grid=(src.shape[0], pl.cdiv(block_elems, tile)),
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays],
        input_output_aliases={2 + i: i for i in range(num_arrays)},
        interpret=interpret,
        compiler_params=_CompilerParams(num_warps=4, num_stages=1),
        name="copy_blocks",
    )(src.astype(jnp.int32), dst.astype(jnp.int32), *arrays)
    for i, out in zip(live, outs):
        flat[i] = out.reshape(shape)
    return [(flat[2 * i], flat[2 * i + 1]) for i in range(len(kv_pool))]


def copy_blocks(kv_pool: list, src: jax.Array, dst: jax.Array, *, impl: str = "xla", interpret: bool = False) -> list:
    """Block ``dst[i]`` of every pool becomes a copy of block ``src[i]``; pairs whose ``dst`` is outside
    ``[0, num_blocks)`` (padding slots) are skipped; ``src`` must be in range wherever ``dst`` is.

    Args:
      kv_pool: per layer ``(k_pages, v_pages)``, each ``[num_blocks, block_size, Hkv, D]`` (all the same shape and
        dtype, but for a latent cache's V pools of width 0, ``ModelConfig.kv_pool_head_dims``);
        donated by the caller's jit so the copies happen in place.
      src, dst: int32[C]. A destination is never also a source in the same call (copy-on-write copies into fresh
        blocks), so the order of the copies does not matter.
      impl: "xla" (per-pool scatters; any device layout), "pallas" (one Pallas Triton kernel for every pool; one
        device: a pallas_call is not partitioned over a mesh) or "auto" ("pallas" on a GPU, else "xla").
      interpret: run the Pallas kernel in interpret mode (CPU tests).
    Returns:
      the pools, same structure, shapes and dtypes.
    """
    if impl not in BLOCK_COPY_IMPLS:
        raise ValueError(f"impl must be one of {', '.join(BLOCK_COPY_IMPLS)}, got {impl!r}")
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "gpu" else "xla"
    if impl == "pallas" and kv_pool:
        return _copy_blocks_pallas(kv_pool, src, dst, interpret=interpret)
    return [(k.at[dst].set(k[src], mode="drop"), v.at[dst].set(v[src], mode="drop")) for k, v in kv_pool]
