"""paged_jax.worker.device_memory: the KV pool's allocation checked against the allocator's state (a fake GPU's
memory statistics, as JAX reports them)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from paged_jax.worker.device_memory import check_pool_fits, pool_allocation_error


ARRAYS = [jax.ShapeDtypeStruct((3 << 29,), np.int16)] * 12  # a pool of 12 arrays of 3 GiB: 36 GiB


class FakeGpu:
    """A device with the memory stats of a GPU (``memory_stats`` keys as JAX reports them)."""

    platform = "gpu"

    def __init__(self, bytes_limit: int, bytes_in_use: int, largest_free_block: int | None = None) -> None:
        self._stats = {"bytes_limit": bytes_limit, "bytes_in_use": bytes_in_use,
                       "largest_free_block_bytes": (bytes_limit - bytes_in_use if largest_free_block is None
                                                    else largest_free_block)}

    def memory_stats(self) -> dict:
        return dict(self._stats)


GIB = 1 << 30
TOTAL = 80 * GIB


def test_a_pool_larger_than_the_allocator_has_free_is_refused_before_allocating():
    """The pool is allocated after the compiles: when the allocator then has less free than the pool needs, or its
    free memory is split into regions smaller than one of the pool's arrays, the error names the allocator's state
    and the flags to change, instead of an allocator failure part way through."""
    check_pool_fits(FakeGpu(60 * GIB, 24 * GIB), ARRAYS)
    with pytest.raises(RuntimeError, match=r"needs 36.00 GiB in arrays of 3.00 GiB; JAX's allocator: 25.00 GiB in "
                                           r"use of its 60.00 GiB limit.*--gpu-memory-utilization"):
        check_pool_fits(FakeGpu(60 * GIB, 25 * GIB), ARRAYS)
    with pytest.raises(RuntimeError, match=r"largest free region 2.50 GiB"):
        check_pool_fits(FakeGpu(60 * GIB, 20 * GIB, largest_free_block=5 * GIB // 2), ARRAYS)
    error = pool_allocation_error(FakeGpu(60 * GIB, 50 * GIB, largest_free_block=GIB), ARRAYS, MemoryError("oom"))
    assert "KV pool (36.00 GiB)" in str(error) and "largest free region 1.00 GiB" in str(error)
    assert "--num-gpu-blocks-override" in str(error)


def test_the_kv_sizing_keeps_two_compiles_autotuning_scratch_free_of_the_pool():
    """XLA autotunes a matmul on fresh copies of its operands: for Gemma 3's tied 262k-vocabulary embedding that is
    about 1.9 GiB a compile, and compiles at once ran out of memory beside a pool that filled the rest. The sizing
    keeps COMPILE_SCRATCH_SLOTS such shares free beside the steps' headroom."""
    from models.presets import preset_config
    from paged_jax.worker.kv_pool_sizing import (COMPILE_SCRATCH_SLOTS, autotune_scratch_bytes, determine_num_blocks,
                                                 kv_bytes_per_block, step_headroom_bytes)

    config = preset_config("gemma-3-12b")
    scratch = autotune_scratch_bytes(config, "bfloat16", logits_rows=256, max_num_batched_tokens=2048)
    assert scratch > config.vocab_size * config.hidden_size * 2  # at least the embedding's copy
    limit, weights = int(0.9 * TOTAL), 22 * GIB
    steps = step_headroom_bytes(config, "bfloat16", max_num_seqs=256, max_num_batched_tokens=2048,
                                dequantization_bytes=0)
    for kv_dtype in ("bfloat16", "float8_e4m3fn"):  # the scratch is the bf16 model's whatever the KV cache's dtype
        blocks = determine_num_blocks(config, block_size=16, dtype=kv_dtype, max_model_len=4096, max_num_seqs=256,
                                      max_num_batched_tokens=2048, gpu_memory_utilization=0.9,
                                      device=FakeGpu(limit, weights), weight_bytes=weights, compute_dtype="bfloat16")
        free = limit - weights - blocks * kv_bytes_per_block(config, 16, kv_dtype)
        assert free - steps >= COMPILE_SCRATCH_SLOTS * scratch


def test_the_allocator_line_of_a_sharded_pool_names_its_first_devices_state():
    """A tensor-parallel runner's device is a sharding: the out-of-memory error still describes an allocator (its
    first device's; none on the CPU) instead of failing on the sharding."""
    from paged_jax.worker.device_memory import describe_allocator

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    assert describe_allocator(sharding) == describe_allocator(jax.devices()[0]) == ""
    assert "KV pool (36.00 GiB)" in str(pool_allocation_error(sharding, ARRAYS, MemoryError("oom")))
