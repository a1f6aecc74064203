"""The KV pool's capacity with and without KV-cache groups (``paged_jax.core.kv_groups``) for a named model shape with
dummy weights: tokens, and requests of ``--context-len`` tokens that fit at once.

    python -m benchmarks.kv_capacity --shape gemma-3-12b --context-len 32768

On a GPU the budget is what the engine's sizing leaves on the device (``kv_pool_sizing``: ``gpu_memory_utilization``
of its memory, less the weights' bytes, the widest step's headroom and the compiles' autotuning scratch), and ``engine_num_blocks`` is
``determine_num_blocks``' own count for each layout; elsewhere the same arithmetic on ``--device-memory-gib`` (default
an 80 GB H100's 79.6 GiB), without a device. Nothing is allocated: the weights' bytes are the shape's parameter count
times the dtype's size. ``--max-chunk-tokens`` is the step a request's sliding groups hold blocks for (1: every
request decoding, ``ceil(W / block_size) + 1`` blocks per sliding group; the scheduler admits by
``max_num_batched_tokens``).

One JSON line: per layout ("flat": every layer keeps every token in one table; "grouped"), the ``PoolCapacity``
fields, and ``requests_ratio`` (grouped / flat).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp

from models.presets import PRESETS, num_params, preset_config
from paged_jax.core.kv_groups import kv_pool_capacity
from paged_jax.worker.device_memory import reserve_gpu_memory_fraction, usable_device_bytes
from paged_jax.worker.kv_pool_sizing import determine_num_blocks, pool_headroom_bytes

H100_GIB = 79.6  # an H100 80GB's memory as the driver reports it (81559 MiB)


def capacity_report(shape: str, *, context_len: int, block_size: int, dtype: str, gpu_memory_utilization: float,
                    max_num_seqs: int, max_num_batched_tokens: int, max_chunk_tokens: int,
                    device_memory_gib: float | None) -> dict:
    """The report's dict (see the module docstring); ``device_memory_gib`` None: the first device's memory (an
    accelerator's), else that many GiB without a device."""
    config = preset_config(shape)
    itemsize = jnp.dtype(dtype).itemsize
    weight_bytes = num_params(config) * itemsize
    device = None
    if device_memory_gib is None:
        device = jax.devices()[0]
        stats = device.memory_stats() if device.platform != "cpu" else None
        if not stats or "bytes_limit" not in stats:
            raise ValueError(f"device {device} reports no memory: pass --device-memory-gib")
        _, usable = usable_device_bytes(stats, device.platform, gpu_memory_utilization)
    else:
        usable = int(gpu_memory_utilization * device_memory_gib * 2**30)
    headroom = pool_headroom_bytes(config, dtype, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, dequantization_bytes=0)
    budget = usable - weight_bytes - headroom
    page_bytes = 2 * block_size * config.num_key_value_heads * config.head_dim * itemsize
    report = dict(shape=shape, context_len=context_len, block_size=block_size, dtype=dtype,
                  max_chunk_tokens=max_chunk_tokens, usable_bytes=usable, weight_bytes=weight_bytes,
                  headroom_bytes=headroom, kv_budget_bytes=budget,
                  device=str(device) if device is not None else f"{device_memory_gib} GiB (analytic)")
    for name, grouped in (("flat", False), ("grouped", True)):
        capacity = kv_pool_capacity(config.layer_kv_spans, kv_budget_bytes=budget, page_bytes=page_bytes,
                                    block_size=block_size, context_len=context_len,
                                    max_chunk_tokens=max_chunk_tokens, grouped=grouped)
        report[name] = dataclasses.asdict(capacity)
        if device is not None:
            report[name]["engine_num_blocks"] = determine_num_blocks(
                config, block_size=block_size, dtype=dtype, max_model_len=context_len, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens, gpu_memory_utilization=gpu_memory_utilization,
                device=device, weight_bytes=weight_bytes, mixed_groups=grouped)
    flat_requests = report["flat"]["max_requests"]
    report["requests_ratio"] = report["grouped"]["max_requests"] / flat_requests if flat_requests else None
    return report


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="gemma-3-12b", choices=sorted(PRESETS))
    p.add_argument("--context-len", type=int, default=32768)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-chunk-tokens", type=int, default=1)
    p.add_argument("--device-memory-gib", type=float, default=None,
                   help=f"compute for this much device memory without a device (an H100: {H100_GIB})")
    args = p.parse_args(argv)
    if args.device_memory_gib is None:
        reserve_gpu_memory_fraction(args.gpu_memory_utilization)  # before the backend starts, as the engine does
    report = capacity_report(args.shape, context_len=args.context_len, block_size=args.block_size, dtype=args.dtype,
                             gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             max_chunk_tokens=args.max_chunk_tokens, device_memory_gib=args.device_memory_gib)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
