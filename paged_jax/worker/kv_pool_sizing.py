"""Where the KV pool's size comes from, and JAX's persistent compilation cache that the engine turns on before it
builds the runner: both are settled once, at engine start-up, before the first executable compiles.

``determine_num_blocks`` sizes the device pool (vLLM's ``gpu_memory_utilization``: a fraction of the device's
total memory, after the weights and headroom for the widest step's activations and logits), ``num_host_blocks_for``
the host swap pool, ``kv_bytes_per_block`` the bytes of one block across all layers.
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from paged_jax.core.kv_groups import engine_kv_groups, max_blocks_per_request
from paged_jax.worker.device_memory import usable_device_bytes
from paged_jax.worker.prompt_logprobs import LOGITS_CHUNK_ROWS

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------------
# Compilation cache
# ----------------------------------------------------------------------------------------------------------------

def enable_compilation_cache(cache_dir: str | None) -> str | None:
    """Turn on JAX's persistent compilation cache in ``cache_dir`` (None: ``~/.cache/paged_jax/jax_cache``;
    "" leaves it off). Thresholds are lowered so every executable is cached, small ones included. Returns the dir."""
    if cache_dir == "":
        return None
    if cache_dir is None:
        cache_dir = os.path.join(os.path.expanduser("~"), ".cache", "paged_jax", "jax_cache")
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return cache_dir


# ----------------------------------------------------------------------------------------------------------------
# KV pool sizing
# ----------------------------------------------------------------------------------------------------------------

def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype, *, mixed_groups: bool = True) -> int:
    """Bytes one block takes across all layers (K and V: ``ModelConfig.kv_pool_head_dims``, a latent cache's
    ``kv_lora_rank + qk_rope_head_dim`` per token and layer), or across one KV-cache group's layers
    (``paged_jax.core.kv_groups``: a block holds one group's pages; ``mixed_groups``: see ``engine_kv_groups``)."""
    groups = engine_kv_groups(config.layer_kv_spans, mixed_groups=mixed_groups)
    layers_per_block = max(len(group.layers) for group in groups)
    return (layers_per_block * block_size * config.num_key_value_heads * sum(config.kv_pool_head_dims)
            * jnp.dtype(dtype).itemsize)


def max_addressable_blocks(config: ModelConfig, block_size: int, dtype) -> int | None:
    """The most blocks one layer's K (or V) pool may hold for the Pallas Triton kernels to address it (None: any).

    Pallas' Triton lowering computes element offsets in 32 signed bits for arrays of at most 2**32 bytes and in 64
    bits above: a pool of 1-byte elements (FP8) between 2**31 and 2**32 elements would wrap its offsets past element
    2**31 and read or write outside the array, i.e. another layer's or another request's KV. Wider dtypes pass 2**32
    bytes before they pass 2**31 elements."""
    if jnp.dtype(dtype).itemsize != 1:
        return None
    elements_per_block = block_size * config.num_key_value_heads * config.head_dim
    return (2 ** 31 - 1) // elements_per_block


# Compiles whose autotuning scratch the KV sizing keeps free beside the pool: background compiles run beside serving
# steps (whose own headroom is apart), and fewer compiles at once would make a cold start slower.
COMPILE_SCRATCH_SLOTS = 2
# XLA's redzone allocator pads each autotuning buffer on both sides.
AUTOTUNE_REDZONE_BYTES = 64 << 20


def determine_num_blocks(config: ModelConfig, *, block_size: int, dtype, max_model_len: int, max_num_seqs: int,
                         max_num_batched_tokens: int, gpu_memory_utilization: float,
                         num_blocks_override: int | None = None, device: jax.Device | None = None,
                         cpu_pool_cap_bytes: int = 1 << 30, weight_bytes: int | None = None,
                         dequantization_bytes: int = 0, mixed_groups: bool = True,
                         num_sample_rows: int | None = None, host_copy_blocks: int = 0,
                         extra_block_bytes: int = 0, compute_dtype=None) -> int:
    """Number of device KV blocks (including the null block 0). ``dtype``: the KV cache's; ``compute_dtype``: the
    model's activations and unquantized weights (default ``dtype``), what the headroom is counted in.

    Accelerators (vLLM's meaning of ``gpu_memory_utilization``: a fraction of the device's total memory):
    ``gpu_memory_utilization * total - bytes_in_use`` (measured after the weights are placed) minus headroom for
    the largest step's activations and logits, divided by the per-block size; ``total`` and the allocator cap come
    from ``memory_stats()`` (``paged_jax.worker.device_memory.usable_device_bytes``). CPU (no memory stats): enough for
    ``max_num_seqs`` full-length sequences, capped at ``cpu_pool_cap_bytes``. ``num_blocks_override`` wins.

    ``weight_bytes`` (the loaded weights' bytes on ``device``, ``device_bytes(model, device)``) replaces the
    allocator's ``bytes_in_use``, which also counts buffers left over from loading (a converted load leaves others
    than a weights-cache restore) and so varies from start to start: the block count is a compiled shape (the KV
    pool is a step argument), and a start with another count misses the persistent compilation cache for every
    step executable.

    ``dequantization_bytes`` (``dequantized_weight_bytes``) joins the headroom: weight-only quantized layers whose
    matmul dequantizes in XLA need that scratch beside the activations. ``num_sample_rows``: the most rows a step
    samples when more than ``max_num_seqs`` (speculative decoding samples every draft position).
    ``host_copy_blocks``: blocks the host KV pool's copies hold on the device at once (the host tier's saves on
    their way to host memory and a chunk of loads, ``paged_jax.worker.host_kv_pool``), kept free of the pool too.
    ``extra_block_bytes``: what another pool indexed by the same block ids takes per block (a model drafter's KV).
    ``COMPILE_SCRATCH_SLOTS`` compiles' autotuning scratch (``autotune_scratch_bytes``) joins the headroom.

    An FP8 pool is capped at ``max_addressable_blocks`` (a warning says so).

    One sequence needs ``blocks_per_sequence`` blocks (``paged_jax.core.kv_groups``: fewer than ``max_model_len``
    tokens' in a sliding-window group, one table per group; ``mixed_groups``: see ``engine_kv_groups``).

    Raises:
      ValueError naming ``max_model_len`` when the pool cannot hold one ``max_model_len`` sequence, with the number
      of tokens it can hold; ValueError naming ``num_gpu_blocks_override`` above ``max_addressable_blocks``.
    """
    per_block = kv_bytes_per_block(config, block_size, dtype, mixed_groups=mixed_groups) + extra_block_bytes
    blocks_per_seq = blocks_per_sequence(config, block_size, max_model_len, max_num_batched_tokens,
                                         mixed_groups=mixed_groups)
    if num_blocks_override is not None:
        return _checked_override(config, int(num_blocks_override), block_size=block_size, dtype=dtype,
                                 blocks_per_seq=blocks_per_seq, max_model_len=max_model_len)
    device = device or jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        wanted = max_num_seqs * blocks_per_seq + 1
        return int(max(blocks_per_seq + 1, min(wanted, cpu_pool_cap_bytes // per_block)))
    headroom = pool_headroom_bytes(config, compute_dtype or dtype,
                                   max_num_seqs=max(max_num_seqs, num_sample_rows or 0),
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   dequantization_bytes=dequantization_bytes) + host_copy_blocks * per_block
    _, usable = usable_device_bytes(stats, device.platform, gpu_memory_utilization)
    held = stats["bytes_in_use"] if weight_bytes is None else weight_bytes
    budget = usable - held - headroom
    num_blocks = int(budget // per_block)
    logger.info("KV cache sizing: %.2f GiB usable (allocator limit %.2f GiB, %.2f GiB in use), weights %.2f GiB, "
                "step and compile headroom %.2f GiB: %d blocks of %.2f MiB", usable / 2**30,
                stats["bytes_limit"] / 2**30, stats["bytes_in_use"] / 2**30, held / 2**30, headroom / 2**30,
                num_blocks, per_block / 2**20)
    if num_blocks - 1 < blocks_per_seq:
        capacity = max(num_blocks - 1, 0) * block_size
        raise ValueError(
            f"To serve at least one request with max_model_len={max_model_len}, "
            f"{blocks_per_seq * per_block / 2**30:.2f} GiB of KV cache is needed, more than the "
            f"{max(budget, 0) / 2**30:.2f} GiB available at gpu_memory_utilization={gpu_memory_utilization} "
            f"(weights, activations and weights dequantized for the wider steps take the rest): the KV pool can hold "
            f"{capacity} tokens. Lower "
            f"max_model_len (--max-model-len {capacity} or less), raise --gpu-memory-utilization, or set "
            f"--num-gpu-blocks-override")
    limit = max_addressable_blocks(config, block_size, dtype)
    if limit is not None and num_blocks > limit:
        logger.warning("KV pool capped at %d blocks (memory for %d): one layer's %s pool must stay under 2**31 "
                       "elements for the attention kernels to address it", limit, num_blocks, jnp.dtype(dtype))
        num_blocks = limit
    return num_blocks


def blocks_per_sequence(config: ModelConfig, block_size: int, max_model_len: int, max_num_batched_tokens: int, *,
                        mixed_groups: bool = True) -> int:
    """The most blocks one sequence of ``max_model_len`` tokens holds at once, every KV-cache group's
    (``kv_groups.max_blocks_per_request`` of each of ``engine_kv_groups``)."""
    return sum(max_blocks_per_request(max_model_len, group.sliding_window, block_size, max_num_batched_tokens)
               for group in engine_kv_groups(config.layer_kv_spans, mixed_groups=mixed_groups))


def _checked_override(config: ModelConfig, num_blocks: int, *, block_size: int, dtype, blocks_per_seq: int,
                      max_model_len: int) -> int:
    """``num_gpu_blocks_override`` as given, once checked: ValueError when it cannot hold one ``max_model_len``
    sequence (``blocks_per_seq`` blocks; block 0 is reserved) or passes ``max_addressable_blocks``."""
    if num_blocks - 1 < blocks_per_seq:
        raise ValueError(
            f"max_model_len={max_model_len} needs {blocks_per_seq} KV blocks of {block_size} tokens, but "
            f"num_gpu_blocks_override={num_blocks} leaves {num_blocks - 1} (block 0 is reserved), i.e. "
            f"{(num_blocks - 1) * block_size} tokens: lower max_model_len (--max-model-len) to at most "
            f"{(num_blocks - 1) * block_size} or raise --num-gpu-blocks-override")
    limit = max_addressable_blocks(config, block_size, dtype)
    if limit is not None and num_blocks > limit:
        raise ValueError(f"num_gpu_blocks_override={num_blocks} makes each layer's {jnp.dtype(dtype)} KV pool "
                         f"hold 2**31 elements or more, which the attention kernels cannot address: at most "
                         f"{limit} blocks of {block_size} tokens")
    return num_blocks


def pool_headroom_bytes(config: ModelConfig, dtype, *, max_num_seqs: int, max_num_batched_tokens: int,
                        dequantization_bytes: int) -> int:
    """Device bytes an accelerator's KV sizing keeps free of the pool: the widest step's (``step_headroom_bytes``)
    and ``COMPILE_SCRATCH_SLOTS`` compiles' autotuning scratch (``autotune_scratch_bytes``; ``max_num_seqs``: the
    most rows a step samples)."""
    return (step_headroom_bytes(config, dtype, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                dequantization_bytes=dequantization_bytes)
            + COMPILE_SCRATCH_SLOTS * autotune_scratch_bytes(config, dtype, logits_rows=max_num_seqs,
                                                             max_num_batched_tokens=max_num_batched_tokens))


def step_headroom_bytes(config: ModelConfig, dtype, *, max_num_seqs: int, max_num_batched_tokens: int,
                         dequantization_bytes: int) -> int:
    """Device bytes kept free of the KV pool for the widest step: its activations, the sampler's logits (or the
    prompt-logprobs chunks), ``dequantization_bytes`` and 512 MiB."""
    itemsize = jnp.dtype(dtype).itemsize
    # Peak live activations of the widest step, generously: residual + q/k/v + attention out + MLP (gate, up, act),
    # a few copies each, plus fp32 logits and the sampler's sort buffers for every sequence.
    per_token = (4 * config.hidden_size + 3 * config.intermediate_size
                 + (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim)
    activations = 4 * max_num_batched_tokens * per_token * max(itemsize, 4)
    # The sampler's logits and the prompt-logprobs chunks belong to different executables, never live together. The
    # sampler's widest variant (penalties, top-k/top-p sorts with their indices, logprobs) holds about eight
    # [rows, vocab] f32 buffers at its peak (an H200 warm-up with 256 rows ran out of memory at six).
    logits = 8 * max(max_num_seqs, LOGITS_CHUNK_ROWS) * config.vocab_size * 4
    return activations + logits + int(dequantization_bytes) + (512 << 20)


def autotune_scratch_bytes(config: ModelConfig, dtype, *, logits_rows: int, max_num_batched_tokens: int) -> int:
    """Device bytes one XLA compile may hold while it autotunes a matmul: fresh copies of the operands of the
    largest one (the logits' ``[rows, hidden] x [hidden, vocab]`` or the widest step's MLP input projection), its
    output twice (each candidate's and the reference it is checked against; fp32 logits) and the buffers' redzones.
    Compiles that autotune at once each need this beside the weights and the KV pool (``paged_jax.worker.compile_queue
    .CompileSlots`` runs fewer at once after one runs out of memory)."""
    itemsize = jnp.dtype(dtype).itemsize
    hidden, vocab, mlp_width = config.hidden_size, config.vocab_size, 2 * config.intermediate_size
    logits = (vocab + logits_rows) * hidden * itemsize + 2 * logits_rows * vocab * 4
    mlp = (hidden * mlp_width + max_num_batched_tokens * (hidden + 2 * mlp_width)) * itemsize
    return max(logits, mlp) + AUTOTUNE_REDZONE_BYTES


def device_bytes(tree, device: jax.Device) -> int:
    """Bytes the arrays of ``tree`` (an NNX module or any pytree; other leaves ignored) hold on ``device`` (of a
    sharded array, its shards there)."""
    from flax import nnx

    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree)
    return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array)
               for shard in leaf.addressable_shards if shard.device == device)


def dequantized_weight_bytes(model, rows: int, device: jax.Device) -> int:
    """Bytes of the dequantized weights a forward of ``rows`` rows holds at once: the weight-only quantized projections
    whose matmul dequantizes in XLA (``XLA_DEQUANTIZING_IMPLS``), in the compute dtype, their shards on ``device``,
    summed per decoder layer (the projections under one list entry of the module tree), largest layer. Each such
    matmul ties its weights to its input (``WeightOnlyLinear``), so XLA dequantizes a layer's weights only once the
    layer runs; a layer's projections that share an input may be dequantized together. 0 without such layers."""
    from flax import nnx

    from models.quantization.linear import XLA_DEQUANTIZING_IMPLS, WeightOnlyLinear, resolve_matmul_impl

    per_layer: dict[tuple, int] = {}
    for path, layer in nnx.iter_graph(model):
        if not isinstance(layer, WeightOnlyLinear) or resolve_matmul_impl(
                layer.matmul_impl, f"int{layer.bits}", rows) not in XLA_DEQUANTIZING_IMPLS:
            continue
        per_element = jnp.dtype(layer.dtype).itemsize * (32 // layer.bits if layer.storage == "packed" else 1)
        qweight = layer.qweight[...]
        if isinstance(qweight, jax.Array):
            index = next((k for k, key in enumerate(path) if isinstance(key, int)), len(path) - 1)
            layer_path = tuple(path[:index + 1])
            per_layer[layer_path] = per_layer.get(layer_path, 0) + sum(
                shard.data.size * per_element for shard in qweight.addressable_shards if shard.device == device)
    return max(per_layer.values(), default=0)


def num_host_blocks_for(config: ModelConfig, *, block_size: int, dtype, swap_space_gib: float,
                        mixed_groups: bool = True) -> int:
    """Host pool size in blocks for ``swap_space_gib`` GiB (the swap pool's, or the host tier's)."""
    return int(swap_space_gib * (1 << 30) // kv_bytes_per_block(config, block_size, dtype, mixed_groups=mixed_groups))
