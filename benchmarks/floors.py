"""Physical floors: what no engine can beat on a workload, from the bytes it must move and the FLOPs it must do.

Only the work a step cannot avoid is charged:
- a decode step reads every decoder-layer weight and the LM head once, but only the batch's rows of an untied input
  embedding (a tied embedding is the LM head, read whole anyway), plus every sequence's KV context (a sliding-window
  layer's window only); of a mixture-of-experts model only the experts its rows route to (expected under uniform
  routing);
- compute is 2 x (decoder-layer params a token multiplies by) per token, the LM head only for sampled rows (one per output token), and
  causal attention (QK^T and PV over the keys each query attends to); the input embedding is a gather, no FLOPs.
A workload's floor is the larger of its memory time and its compute time (perfect overlap), so the fraction of the
floor that a measurement reaches is conservative. Report figures against both these fixed H200 ceilings and the
ceilings measured in the same run (`measure_ceilings`).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

from benchmarks.workloads import Workload
from models.config import ModelConfig
from models.presets import expert_params, num_params

# Ceilings of the H200 measured on 2026-11-29 (benchmarks/RESULTS.md, "How these are measured").
H200_HBM_BYTES_PER_S = 4.3e12  # device copy through PyTorch
H200_BF16_FLOPS = 785e12  # 8192^3 bf16 matmul through JAX


def embedding_params(config: ModelConfig) -> int:
    """Parameters of the input embedding table (vocab x hidden)."""
    return config.vocab_size * config.hidden_size


def lm_head_params(config: ModelConfig) -> int:
    """Parameters the LM head multiplies by (the embedding table itself when tied)."""
    return config.vocab_size * config.hidden_size


def body_params(config: ModelConfig) -> int:
    """Parameters of the decoder layers and the final norm: everything but the input embedding and the LM head."""
    untied_head = 0 if config.tie_word_embeddings else lm_head_params(config)
    return num_params(config) - embedding_params(config) - untied_head


def num_sparse_layers(config: ModelConfig) -> int:
    """Decoder layers that run experts (0 for a dense shape)."""
    return 0 if config.moe is None else sum(config.moe.is_sparse(i) for i in range(config.num_hidden_layers))


def experts_routed(config: ModelConfig, rows: float) -> float:
    """Experts of one sparse layer that ``rows`` tokens route to, expected under uniform routing (random weights
    route near-uniformly): ``E * (1 - (1 - k / E) ** rows)``."""
    num_experts, top_k = config.moe.num_experts, config.moe.num_experts_per_tok
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)


def dense_body_params(config: ModelConfig) -> int:
    """``body_params`` without the experts (every parameter a token of the body always reads)."""
    if config.moe is None:
        return body_params(config)
    return body_params(config) - num_sparse_layers(config) * config.moe.num_experts * expert_params(config)


def active_body_params(config: ModelConfig) -> int:
    """Body parameters one token multiplies by: the dense ones and its ``num_experts_per_tok`` experts per sparse
    layer."""
    if config.moe is None:
        return body_params(config)
    return dense_body_params(config) + num_sparse_layers(config) * config.moe.num_experts_per_tok * expert_params(
        config)


def decode_weight_bytes(config: ModelConfig, batch: int, dtype_bytes: int = 2, routed_rows: float | None = None
                        ) -> float:
    """Weight bytes one decode step of ``batch`` rows must read: decoder layers + LM head whole, plus ``batch`` rows
    of an untied input embedding; of a mixture-of-experts shape only the experts ``routed_rows`` tokens (default
    ``batch``) route to (``experts_routed``), one byte each for block-FP8 experts (their scales add under 0.1%)."""
    embed_rows = 0 if config.tie_word_embeddings else batch * config.hidden_size
    weight_bytes = (dense_body_params(config) + lm_head_params(config) + embed_rows) * dtype_bytes
    if config.moe is not None:
        rows = batch if routed_rows is None else routed_rows
        expert_bytes = 1 if config.moe.expert_format == "fp8" else dtype_bytes
        weight_bytes += num_sparse_layers(config) * experts_routed(config, rows) * expert_params(config) * expert_bytes
    return weight_bytes


def attention_flops(config: ModelConfig, num_keys: int) -> int:
    """FLOPs of one query token attending over ``num_keys`` keys in every layer (QK^T and PV)."""
    return 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * num_keys


def _sum_keys(first: int, count: int, window: int | None) -> int:
    """``sum(min(first + j, window) for j in range(count))``: the keys ``count`` consecutive queries read, the first
    over ``first`` keys, in a layer attending over at most ``window`` (None: all)."""
    last = first + count - 1
    if count <= 0:
        return 0
    if window is None or last <= window:
        return count * (first + last) // 2
    if first >= window:
        return count * window
    return (window - first + 1) * (first + window) // 2 + (last - window) * window


def kv_read_bytes(config: ModelConfig, first: int, count: int, kv_dtype_bytes: int = 2) -> int:
    """KV bytes ``count`` consecutive decode queries read, the first over ``first`` cached tokens: every layer's K
    and V of the keys it attends to (a sliding-window layer only its window's; a latent cache, DeepSeek's, its one
    ``[latent | rope key]`` row: ``ModelConfig.kv_pool_head_dims``)."""
    per_layer_token = config.num_key_value_heads * sum(config.kv_pool_head_dims) * kv_dtype_bytes
    return per_layer_token * sum(_sum_keys(first, count, window) for window in config.layer_windows)


def workload_floor(config: ModelConfig, workload: Workload, max_num_seqs: int, dtype_bytes: int = 2,
                   hbm: float = H200_HBM_BYTES_PER_S, flops: float = H200_BF16_FLOPS,
                   kv_dtype_bytes: int | None = None) -> dict:
    """Floor of one offline run of ``workload`` with at most ``max_num_seqs`` sequences per decode step.
    ``dtype_bytes``: bytes per weight; ``kv_dtype_bytes``: per KV element (default ``dtype_bytes``)."""
    kv_bytes = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
    max_out = max(r.max_tokens for r in workload.requests)
    decode_steps = max(max_out, math.ceil(workload.output_tokens / max_num_seqs))
    # Every output token after a request's first is one decode row; rows share the steps' weight reads.
    decode_rows = workload.output_tokens - len(workload.requests)
    # A mixture-of-experts step reads the experts its rows route to: charged at the average rows per step (an
    # upper estimate of the average over steps, the routed count being concave in the rows).
    weight_read = decode_steps * decode_weight_bytes(config, 0, dtype_bytes, decode_rows / decode_steps) + decode_rows * (
        0 if config.tie_word_embeddings else config.hidden_size * dtype_bytes)
    # A request's output token t >= 1 is fed back once and reads the prompt_len + t - 1 cached tokens before it
    # (the first output token comes from the prompt's last row; the last one is never fed back).
    kv_read = sum(kv_read_bytes(config, len(r.prompt_token_ids), r.max_tokens - 1, kv_bytes)
                  for r in workload.requests)
    memory_s = (weight_read + kv_read) / hbm
    fed_tokens = workload.prompt_tokens + workload.output_tokens - len(workload.requests)
    # Prompt token p (0-based) attends over p + 1 keys; fed-back output token t >= 1 over prompt_len + t keys.
    attn = sum(attention_flops(config, 1) * (n * (n + 1) // 2 + (m - 1) * n + (m - 1) * m // 2)
               for r in workload.requests for n, m in [(len(r.prompt_token_ids), r.max_tokens)])
    matmul = 2 * active_body_params(config) * fed_tokens + 2 * lm_head_params(config) * workload.output_tokens
    compute_s = (matmul + attn) / flops
    floor_s = max(memory_s, compute_s)
    return {
        "weight_read_bytes": weight_read, "decode_steps": decode_steps, "kv_read_bytes": kv_read,
        "matmul_flops": matmul, "attention_flops": attn, "hbm_bytes_per_s": hbm, "flops_per_s": flops,
        "memory_floor_s": memory_s, "compute_floor_s": compute_s, "floor_s": floor_s,
        "floor_output_tok_s": workload.output_tokens / floor_s,
    }


def decode_step_floor_s(config: ModelConfig, batch: int, context: int, dtype_bytes: int = 2,
                        hbm: float = H200_HBM_BYTES_PER_S) -> float:
    """One decode step of ``batch`` rows at ``context`` cached tokens each: its weight reads plus every row's KV."""
    return (decode_weight_bytes(config, batch, dtype_bytes) + batch * kv_read_bytes(config, context, 1, dtype_bytes)
            ) / hbm


def prefill_flops(config: ModelConfig, num_seqs: int, prompt_len: int) -> int:
    """Matmul + attention FLOPs of prefilling ``num_seqs`` prompts of ``prompt_len`` tokens, one sampled row each."""
    return num_seqs * (2 * active_body_params(config) * prompt_len + 2 * lm_head_params(config)
                       + attention_flops(config, 1) * prompt_len * (prompt_len + 1) // 2)


def measure_ceilings(repeats: int = 5, copy_bytes: int | None = None, matmul_size: int | None = None) -> dict:
    """Same-run ceilings of the default device: a jitted ``jnp.copy`` of ``copy_bytes`` bf16 (read + write bytes per
    second) and a bf16 ``matmul_size``^3 matmul (FLOP/s). Fresh random inputs; compilation and one call excluded;
    median of ``repeats``. Defaults: 4 GiB and 8192 on an accelerator (beyond its caches), 64 MiB and 1024 on the
    CPU (a smoke test). Returns {"copy_GBps", "matmul_TFLOPs"}."""
    import jax
    import jax.numpy as jnp

    from benchmarks.report import median_seconds

    def median_s(fn, *args) -> float:
        return median_seconds(lambda: fn(*args), repeats)

    on_cpu = jax.default_backend() == "cpu"
    copy_bytes = copy_bytes or (64 << 20 if on_cpu else 4 << 30)
    matmul_size = matmul_size or (1024 if on_cpu else 8192)
    x = jax.random.normal(jax.random.key(1), (copy_bytes // 2,), jnp.bfloat16)
    copy_s = median_s(jax.jit(jnp.copy), x)
    del x
    a = jax.random.normal(jax.random.key(2), (matmul_size, matmul_size), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(3), (matmul_size, matmul_size), jnp.bfloat16)
    matmul_s = median_s(jax.jit(jnp.matmul), a, b)
    return {"copy_GBps": 2 * copy_bytes / copy_s / 1e9, "matmul_TFLOPs": 2 * matmul_size ** 3 / matmul_s / 1e12}


def measure_ceilings_apart(timeout_s: float = 300.0) -> dict:
    """``measure_ceilings()`` in a child process, run before this one starts its JAX backend: the ceilings'
    multi-GiB buffers never pass through the engine's allocator, so its KV pool is allocated from memory they did
    not split. Same dict."""
    child = subprocess.run(
        [sys.executable, "-c", "import json; from benchmarks.floors import measure_ceilings; "
                               "print(json.dumps(measure_ceilings()))"],
        check=True, capture_output=True, text=True, timeout=timeout_s)
    return json.loads(child.stdout.strip().splitlines()[-1])
