"""Physical floors: what no engine can beat on a workload, from bytes moved and FLOPs done.

decode: every step reads all weights once, and every sequence in the batch reads its whole KV context;
prefill: 2 * params * prompt tokens of matmul work. The floor is the larger of the two times (perfect overlap),
so the reported fraction is conservative.
"""

from __future__ import annotations

import math

from benchmarks.workloads import Workload
from models.config import ModelConfig
from models.presets import kv_bytes_per_token, num_params

# Ceilings of the H200 measured on 2026-11-29 (benchmarks/RESULTS.md, "How these are measured").
H200_HBM_BYTES_PER_S = 4.3e12  # device copy through PyTorch
H200_BF16_FLOPS = 785e12  # 8192^3 bf16 matmul through JAX


def workload_floor(config: ModelConfig, workload: Workload, max_num_seqs: int, dtype_bytes: int = 2,
                   hbm: float = H200_HBM_BYTES_PER_S, flops: float = H200_BF16_FLOPS,
                   kv_dtype_bytes: int | None = None) -> dict:
    """``dtype_bytes``: bytes per weight; ``kv_dtype_bytes``: per KV element (default ``dtype_bytes``)."""
    weight_bytes = num_params(config) * dtype_bytes
    kv_per_tok = kv_bytes_per_token(config, dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes)
    max_out = max(r.max_tokens for r in workload.requests)
    decode_steps = max(max_out, math.ceil(workload.output_tokens / max_num_seqs))
    # Token t of a request (0-based) attends over prompt_len + t cached tokens.
    kv_read = sum(kv_per_tok * (len(r.prompt_token_ids) * r.max_tokens + r.max_tokens * (r.max_tokens - 1) // 2)
                  for r in workload.requests)
    memory_bytes = decode_steps * weight_bytes + kv_read
    memory_s = memory_bytes / hbm
    compute_s = 2 * num_params(config) * (workload.prompt_tokens + workload.output_tokens) / flops
    floor_s = max(memory_s, compute_s)
    return {
        "weight_bytes": weight_bytes, "decode_steps": decode_steps, "kv_read_bytes": kv_read,
        "memory_floor_s": memory_s, "compute_floor_s": compute_s, "floor_s": floor_s,
        "floor_output_tok_s": workload.output_tokens / floor_s,
    }


def decode_step_floor_s(config: ModelConfig, batch: int, context: int, dtype_bytes: int = 2,
                        hbm: float = H200_HBM_BYTES_PER_S) -> float:
    """One decode step: all weights plus every sequence's KV context, read once."""
    return (num_params(config) * dtype_bytes + batch * context * kv_bytes_per_token(config, dtype_bytes)) / hbm
