"""Building an engine core from ``EngineArgs``: the model, the step limits, the KV pool's size, the runner, the KV-cache
manager and the scheduler, then compiling (or loading) every step executable.

``build_core_parts`` returns ``CoreParts``: what ``EngineCore`` runs, and its ``EngineCoreInfo`` (what a client of the
core needs to know of the model and the limits).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import jax

from paged_jax.config import EngineArgs
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.kv_groups import engine_kv_groups
from paged_jax.core.scheduler import Scheduler
from paged_jax.engine.messages import EngineCoreInfo
from paged_jax.lora.engine_api import make_lora_manager, make_lora_slots
from paged_jax.spec_decode.drafters import load_drafter
from paged_jax.parallel.multihost import agree_on_smallest, engine_devices, leader_channel, start_distributed
from paged_jax.worker.background_compile import background_compilation_enabled
from paged_jax.worker.buckets import planned_num_compiles, sample_rows_needed
from paged_jax.worker.device_check import warn_if_gpu_unused
from paged_jax.worker.device_memory import reserve_gpu_memory_fraction
from paged_jax.worker.host_kv_pool import DEVICE_COPY_BLOCKS
from paged_jax.worker.kv_pool_sizing import (dequantized_weight_bytes, determine_num_blocks, device_bytes,
                                             enable_compilation_cache, kv_bytes_per_block, num_host_blocks_for)
from paged_jax.worker.kv_group_pool import mixes_kv_groups
from paged_jax.worker.model_loader import LoadedModel, load_engine_model
from paged_jax.worker.model_runner import ModelRunner
from paged_jax.worker.moe_outputs import MoeStepOutputs

logger = logging.getLogger(__name__)

_CPU_MAX_NUM_SEQS, _GPU_MAX_NUM_SEQS = 32, 256
_CPU_MAX_BATCHED_TOKENS, _GPU_MAX_BATCHED_TOKENS = 512, 8192
_CPU_DEFAULT_MAX_MODEL_LEN = 2048


@dataclasses.dataclass
class CoreParts:
    """An engine core's parts: the loaded model (``loaded``: tokenizer, config, ...), ``runner``, ``scheduler``,
    ``kv_cache_manager``, ``lora_manager`` (None without ``enable_lora``) and ``info``."""

    loaded: LoadedModel
    runner: Any
    scheduler: Scheduler
    kv_cache_manager: KVCacheManager
    lora_manager: Any
    info: EngineCoreInfo


def default_max_model_len(requested: int | None, model_max: int, on_accelerator: bool) -> int:
    """``max_model_len``: the requested one (at most the model's ``max_position_embeddings``), else the model's
    own (vLLM). On the CPU the default is capped at ``_CPU_DEFAULT_MAX_MODEL_LEN``: the CPU attention (the jnp
    reference) reads a whole max_model_len context for every token, so the model's full length would make every step
    that many times slower; the note says how to ask for more."""
    if requested is not None:
        if requested > model_max:
            raise ValueError(f"max_model_len ({requested}) exceeds the model's max_position_embeddings "
                             f"({model_max})")
        return requested
    if not on_accelerator and model_max > _CPU_DEFAULT_MAX_MODEL_LEN:
        logger.info("max_model_len defaults to %d on the CPU (the model supports %d): the CPU attention reads "
                    "the whole max_model_len context for every token; pass --max-model-len %d (max_model_len=) "
                    "for the full length", _CPU_DEFAULT_MAX_MODEL_LEN, model_max, model_max)
        return _CPU_DEFAULT_MAX_MODEL_LEN
    return model_max


def step_limits(args: EngineArgs, max_model_len: int, on_accelerator: bool) -> tuple[int, int]:
    """``(max_num_seqs, max_num_batched_tokens)``: the flags, else vLLM's defaults for the platform; without chunked
    prefill a whole prompt fits one step; every scheduled sequence has >= 1 token."""
    max_num_seqs = args.max_num_seqs or (_GPU_MAX_NUM_SEQS if on_accelerator else _CPU_MAX_NUM_SEQS)
    max_num_batched_tokens = args.max_num_batched_tokens or (
        _GPU_MAX_BATCHED_TOKENS if on_accelerator else _CPU_MAX_BATCHED_TOKENS)
    if not args.enable_chunked_prefill and args.max_num_batched_tokens is None:
        max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
    return min(max_num_seqs, max_num_batched_tokens), max_num_batched_tokens


def long_prefill_threshold(args: EngineArgs, max_model_len: int) -> int:
    """``--long-prefill-token-threshold`` as given, else vLLM's default of 4% of ``max_model_len`` (at least 1)."""
    if args.long_prefill_token_threshold is not None:
        return args.long_prefill_token_threshold
    return max(1, int(max_model_len * 0.04))


def _num_speculative_tokens(args: EngineArgs) -> int:
    return 0 if args.speculative_config is None else args.speculative_config.num_speculative_tokens


def _size_kv_pool(args: EngineArgs, loaded: LoadedModel, kv_dtype, device, max_model_len: int, max_num_seqs: int,
                  max_num_batched_tokens: int, multi_node: bool, drafter=None) -> tuple[int, int, int]:
    """(device KV blocks, host swap blocks, host tier blocks) for the loaded model and the limits: what the device's
    memory leaves after the weights (``kv_pool_sizing``; a model drafter's weights and KV blocks too), the same count
    on every node of a multi-host job (``multi_node``); the host pools' blocks from ``swap_space`` and
    ``kv_offloading_size`` (GiB)."""
    model = loaded.model
    dequantization_bytes = dequantized_weight_bytes(model, max_num_batched_tokens, device)
    if dequantization_bytes and device.platform != "cpu":
        logger.info("KV cache sizing leaves %.2f GiB for weights XLA dequantizes in the wider steps (weight-only "
                    "quantized layers)", dequantization_bytes / 2**30)
    num_blocks = determine_num_blocks(
        loaded.memory_config, block_size=args.block_size, dtype=kv_dtype, max_model_len=max_model_len,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, num_blocks_override=args.num_gpu_blocks_override,
        device=device, dequantization_bytes=dequantization_bytes, compute_dtype=model.dtype,
        weight_bytes=device_bytes(model, device) + (drafter.weight_bytes() if drafter else 0),
        extra_block_bytes=drafter.kv_bytes_per_block(args.block_size) if drafter else 0,
        mixed_groups=mixes_kv_groups(loaded.plan),
        num_sample_rows=sample_rows_needed(max_num_batched_tokens, max_num_seqs, _num_speculative_tokens(args)),
        host_copy_blocks=DEVICE_COPY_BLOCKS if args.kv_offloading_size else 0)
    if multi_node:  # a compiled shape: one count on every node
        num_blocks = agree_on_smallest("num_gpu_blocks", num_blocks)

    def host_blocks(gib: float) -> int:
        return num_host_blocks_for(loaded.run_config, block_size=args.block_size, dtype=kv_dtype, swap_space_gib=gib,
                                   mixed_groups=mixes_kv_groups(loaded.plan))

    num_host_blocks = host_blocks(args.swap_space) if args.preemption_mode == "swap" else 0
    num_offload_blocks = host_blocks(args.kv_offloading_size) if args.kv_offloading_size else 0
    if args.kv_offloading_size and num_offload_blocks < 1:
        raise ValueError(f"kv_offloading_size={args.kv_offloading_size} GiB holds no KV block of this model "
                         f"({kv_bytes_per_block(loaded.run_config, args.block_size, kv_dtype)} bytes): raise it")
    return num_blocks, num_host_blocks, num_offload_blocks


def _log_pool_and_compiles(args: EngineArgs, runner, kv: KVCacheManager, block_bytes: int,
                           max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int) -> None:
    num_blocks, num_host_blocks = kv.num_blocks, kv.num_host_blocks
    num_offload_blocks = kv.offload.num_blocks if kv.offload is not None else 0
    kv_tokens = (num_blocks - 1) // kv.num_groups * args.block_size  # every KV-cache group's (vLLM's figure)
    concurrency = (num_blocks - 1) / kv.max_blocks_per_request(max_model_len, max_num_batched_tokens)
    logger.info("KV cache: %d blocks x %d tokens in %d group(s) = %d tokens (%.2f GiB), %d host swap blocks, %d host "
                "tier blocks (%.2f GiB); max_model_len %d (%.2fx concurrency at full length)", num_blocks - 1,
                args.block_size, kv.num_groups, kv_tokens, num_blocks * block_bytes / 2**30, num_host_blocks,
                num_offload_blocks, num_offload_blocks * block_bytes / 2**30, max_model_len, concurrency)
    num_compiles = planned_num_compiles(max_num_batched_tokens, max_num_seqs,
                                        swap=num_host_blocks + num_offload_blocks > 0,
                                        num_blocks=num_blocks, num_speculative_tokens=_num_speculative_tokens(args))
    logger.info("Compiling %d step executables (%d step shapes) %s%s", num_compiles, len(runner.buckets),
                "a first few before serving, the rest in the background"
                if background_compilation_enabled(args.background_compilation)
                else "ahead of serving", "" if args.compilation_cache_dir == "" else
                "; the JAX compilation cache makes later starts faster")


def _step_limits_setter(scheduler: Scheduler):
    """``ReadySet.on_limits``: the largest step the runner can run caps the scheduler's budget and seats
    (``Scheduler.ready_limits``; called from the background compile thread: one attribute store)."""
    def set_limits(tokens: int, seqs: int) -> None:
        scheduler.ready_limits = (min(tokens, scheduler.max_num_batched_tokens), min(seqs, scheduler.max_num_seqs))
    return set_limits


def prefix_caching(args: EngineArgs, pooler) -> bool:
    """Whether the KV-cache manager shares cached prefixes: ``enable_prefix_caching``, except for a pooler that reads
    every prompt token's hidden state (mean or first-token pooling: a cached prefix has none), as vLLM."""
    if args.enable_prefix_caching and pooler is not None and pooler.pooling_type != "LAST":
        logger.info("prefix caching is off: %s pooling reads the hidden state of every prompt token",
                    pooler.pooling_type)
        return False
    return args.enable_prefix_caching


def build_core_parts(args: EngineArgs, *, use_tqdm: bool = True, devices: Sequence | None = None) -> CoreParts:
    """Load the model, size the KV pool, build the runner, the KV-cache manager and the scheduler, and warm the runner
    up (every step executable compiled or loaded). ``devices``: this core's devices (default: the first local
    ones)."""
    start = time.perf_counter()
    # Before anything starts a JAX backend: its GPU allocator cap is fixed then (paged_jax.worker.device_memory), and
    # a multi-host job must be joined before (paged_jax.parallel.multihost).
    reserve_gpu_memory_fraction(args.gpu_memory_utilization)
    multi_node = start_distributed(args)
    devices = engine_devices(args, devices)
    warn_if_gpu_unused()
    enable_compilation_cache(args.compilation_cache_dir)
    device = devices[0] if devices else jax.local_devices()[0]  # a follower node sizes for its own devices
    on_accelerator = device.platform != "cpu"
    args.log_compatibility_notes(on_accelerator)
    timings = {"backend_s": time.perf_counter() - start}
    stage_start = time.perf_counter()

    logger.info("Loading model %s (dtype %s) on %s", args.model or "SmolLM2-135M-Instruct (built-in)", args.dtype,
                device)
    loaded = load_engine_model(args, on_accelerator, devices)
    timings["load_s"], stage_start = time.perf_counter() - stage_start, time.perf_counter()
    timings["model_load_s"] = loaded.load_seconds  # the weights alone (read, or restored from the weights cache)
    model, config, plan = loaded.model, loaded.config, loaded.plan
    max_model_len = default_max_model_len(args.max_model_len, config.max_position_embeddings, on_accelerator)
    max_num_seqs, max_num_batched_tokens = step_limits(args, max_model_len, on_accelerator)

    kv_dtype = loaded.kv_cache_dtype or model.dtype  # --kv-cache-dtype fp8: 1 byte per element
    drafter = load_drafter(args.speculative_config, model, config, loaded.tokenizer, download_dir=args.download_dir,
                           target_path=loaded.model_path, dummy=args.load_format == "dummy", plan=plan)
    num_blocks, num_host_blocks, num_offload_blocks = _size_kv_pool(args, loaded, kv_dtype, device, max_model_len,
                                                                    max_num_seqs, max_num_batched_tokens, multi_node,
                                                                    drafter)
    timings["kv_sizing_s"], stage_start = time.perf_counter() - stage_start, time.perf_counter()
    runner = ModelRunner(
        model, loaded.run_config, num_blocks=num_blocks, block_size=args.block_size, max_model_len=max_model_len,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        num_host_blocks=num_host_blocks + num_offload_blocks, eos_token_ids=loaded.eos_token_ids,
        attention_impl=args.attention_impl,
        device=device, sharding_plan=plan, dispatch_thread=bool(args.async_scheduling), kv_cache_dtype=kv_dtype,
        lora_slots=make_lora_slots(args, model, loaded.run_config, plan, device),  # None unless enable_lora
        forward=loaded.forward,  # the pipeline's staged forward with pipeline_parallel_size > 1
        logprobs_mode=args.logprobs_mode, num_speculative_tokens=_num_speculative_tokens(args),
        batch_invariant=args.batch_invariant, drafter=drafter,
        moe_outputs=MoeStepOutputs(routed_experts=args.enable_return_routed_experts,
                                   expert_load=args.enable_expert_load_metrics))
    kv_cache_manager = KVCacheManager(num_blocks, args.block_size, prefix_caching(args, loaded.pooler),
                                      num_host_blocks=num_host_blocks, num_offload_blocks=num_offload_blocks,
                                      group_windows=[group.sliding_window for group in engine_kv_groups(
                                          loaded.run_config.layer_kv_spans, mixed_groups=mixes_kv_groups(plan))])
    scheduler = Scheduler(kv_cache_manager, max_num_seqs, max_num_batched_tokens, max_model_len,
                          preemption_mode=args.preemption_mode, policy=args.scheduling_policy,
                          enable_chunked_prefill=args.enable_chunked_prefill,
                          max_loras=args.max_loras if args.enable_lora else 0,
                          long_prefill_token_threshold=long_prefill_threshold(args, max_model_len),
                          max_long_partial_prefills=args.max_long_partial_prefills,
                          num_lookahead_tokens=_num_speculative_tokens(args) if drafter is not None else 0)
    _log_pool_and_compiles(args, runner, kv_cache_manager,
                           kv_bytes_per_block(loaded.memory_config, args.block_size, kv_dtype,
                                              mixed_groups=mixes_kv_groups(plan)), max_model_len,
                           max_num_seqs, max_num_batched_tokens)
    compile_start = time.perf_counter()
    timings["runner_init_s"] = compile_start - stage_start
    runner.ready.on_limits = _step_limits_setter(scheduler)
    runner.warm_up(use_tqdm=use_tqdm, background=background_compilation_enabled(args.background_compilation))
    timings["warm_up_s"] = time.perf_counter() - compile_start
    runner.step_channel = leader_channel() if multi_node else None  # node 0: the other nodes replay its steps
    logger.info("%s in %.1f s; engine ready in %.1f s", "First executables compiled" if runner.background
                else "Compiled", time.perf_counter() - compile_start, time.perf_counter() - start)
    info = EngineCoreInfo(max_model_len=max_model_len, vocab_size=config.vocab_size,
                          eos_token_ids=list(loaded.eos_token_ids), max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, max_logprobs=runner.max_logprobs,
                          model_path=loaded.model_path, generation_config=dict(loaded.generation_config),
                          startup_timings=timings, pooler=loaded.pooler)
    return CoreParts(loaded=loaded, runner=runner, scheduler=scheduler, kv_cache_manager=kv_cache_manager,
                     lora_manager=make_lora_manager(args, runner), info=info)
