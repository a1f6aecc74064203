"""What the engine loads before it can run: the checkpoint (local, Hub or built-in), the weights in the engine's
layout (through the converted-weights cache), the tokenizer and the generation config.

``load_engine_model(args, on_accelerator) -> LoadedModel`` is the one entry; ``LLMEngine`` sizes its KV pool and
builds its runner from what it returns.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

from paged_jax.engine import generation_config as gen_config
from paged_jax.config import EngineArgs
from paged_jax.parallel.expert_parallel import check_expert_parallel
from paged_jax.parallel.pipeline import PipelineForward, load_pipeline_model
from paged_jax.pooling.config import (checkpoint_head, pooler_config, pooling_model_config, read_hf_config,
                                      resolve_runner)
from paged_jax.pooling.pooler import PoolingForward

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class LoadedModel:
    """A loaded model and what the engine needs beside it.

    ``run_config`` is the shape the runner executes (heads rewritten under tensor parallelism); ``memory_config``
    the per-device shape that sizes the KV pool; ``plan`` the ``paged_jax.parallel.ShardingPlan`` (None on one
    device); ``forward`` how the runner's step runs the model (``paged_jax.worker.step_forward.StepForward``: the
    pipeline's stages, or None for the default one program); ``generation_config`` the checkpoint's generation
    config (``--generation-config``) as a dict. The runner is ``ModelRunner(model, run_config, ...,
    sharding_plan=plan, forward=forward, kv_cache_dtype=...)``.
    """

    model: Any
    config: Any
    model_path: str | None
    dtype: str
    plan: Any
    run_config: Any
    memory_config: Any
    tokenizer: Any
    eos_token_ids: list[int]
    generation_config: dict
    load_seconds: float
    quantization: Any = None  # models.quantization.QuantConfig or None
    kv_cache_dtype: Any = None  # the KV pool's element type (jnp dtype); None = the model dtype
    forward: Any = None  # the runner's StepForward; None = SingleProgramForward
    pooler: Any = None  # paged_jax.pooling.config.PoolerConfig of the pooling runner; None: the generate runner


def resolve_model(args: EngineArgs) -> tuple[str | None, Any]:
    """-> (local checkpoint dir or None, ModelConfig or None to read it from the dir).

    ``args.model``: None (the built-in SmolLM2-135M-Instruct), a local directory, a Hub repo id (downloaded with
    ``args.revision`` into ``args.download_dir``), or with ``load_format="dummy"`` a known shape name.
    """
    if args.model is None:
        from models.smollm2 import ensure_smollm2

        return str(ensure_smollm2()), None
    if args.load_format == "dummy" and not os.path.isdir(args.model):
        from models.presets import PRESETS, preset_config

        if args.model.lower() in PRESETS:
            return None, preset_config(args.model)
    from models.hub import resolve_checkpoint

    # Random weights need the config (and tokenizer) only, not the checkpoint's weight files.
    what = "tokenizer" if args.load_format == "dummy" else "model"
    return str(resolve_checkpoint(args.model, revision=args.revision, download_dir=args.download_dir,
                                  what=what)), None


def import_tokenizer_library() -> None:
    """Import what ``load_tokenizer`` uses (transformers' tokenizer classes, torch with them: seconds) ahead of it, on
    a thread while an engine process starts."""
    import transformers.models.auto.tokenization_auto  # noqa: F401


def local_tokenizer_path(args: EngineArgs) -> str | None:
    """The directory ``load_tokenizer`` reads when it is known without loading the model: a local ``tokenizer`` or
    ``model`` directory, the built-in model's once built; None otherwise (a Hub id, a shape name)."""
    from models.smollm2 import MODEL_NAME, default_cache_dir, is_complete

    if args.tokenizer is not None:
        return args.tokenizer if os.path.isdir(args.tokenizer) else None
    if args.model is None:
        built_in = default_cache_dir() / MODEL_NAME
        return str(built_in) if is_complete(built_in) else None
    return args.model if os.path.isdir(args.model) else None


def load_tokenizer(args: EngineArgs, model_path: str | None):
    """The HF tokenizer of ``args.tokenizer`` (local or Hub) or of the checkpoint; None when there is none (token-id
    prompts only)."""
    path = model_path
    if args.tokenizer is not None:
        from models.hub import resolve_checkpoint

        path = str(resolve_checkpoint(args.tokenizer, revision=args.tokenizer_revision,
                                      download_dir=args.download_dir, what="tokenizer", field="tokenizer"))
    if path is None:
        return None
    if not any(Path(path).glob("tokenizer*")):  # a weights-only checkpoint: token-id prompts only
        logger.warning("no tokenizer files in %s; only token-id prompts are accepted", path)
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:  # a weights-only directory: token-id prompts only
        logger.warning("no tokenizer loaded from %s (%s); only token-id prompts are accepted", path, exc)
        return None


def load_engine_model(args: EngineArgs, on_accelerator: bool, devices=None) -> LoadedModel:
    """Resolve, load (or restore from the weights cache) and lay out the model ``args`` name on ``devices`` (the
    ``pipeline_parallel_size * tensor_parallel_size`` devices of this engine; None: the first ones of
    ``jax.devices()``)."""
    from models.config import ModelConfig

    model_path, config = resolve_model(args)
    forward = None
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if on_accelerator else "float32")
    start = time.perf_counter()
    config = config or ModelConfig.from_pretrained(model_path)
    if config.attention_sinks and args.attention_impl == "mosaic":
        raise ValueError(f"attention_impl: 'mosaic' does not take the attention sinks of {config.architecture}; use "
                         "'triton' or 'auto' (which keeps such layers on the Triton kernel)")
    if config.mla is not None and args.attention_impl == "mosaic":
        raise ValueError(f"attention_impl: 'mosaic' does not read the latent KV cache of {config.architecture} "
                         "(multi-head latent attention); use 'triton' (the MLA kernel), 'reference' or 'auto'")
    if config.mla is not None and args.enable_lora:
        raise ValueError(f"enable_lora: LoRA adapters are unsupported for {config.architecture} (multi-head latent "
                         "attention and experts)")
    if config.mla is not None and args.batch_invariant:
        raise ValueError(f"batch_invariant: the batch-invariant attention does not read the latent KV cache of "
                         f"{config.architecture} (multi-head latent attention)")
    if any(config.layer_chunks) and args.attention_impl == "mosaic":
        raise ValueError(f"attention_impl: 'mosaic' does not take the chunked local attention of "
                         f"{config.architecture}; use 'triton' or 'auto' (which keeps such layers on the Triton kernel)")
    if args.max_model_len is not None:  # LongRoPE picks its factors by the engine's length, as vLLM does
        config = config.for_max_model_len(args.max_model_len)
    tokenizer = load_tokenizer(args, model_path)
    config, pooler = resolve_pooling(args, config, model_path, tokenizer)
    if pooler is not None:
        forward = PoolingForward(pooler)
    quant = resolve_engine_quantization(args, model_path)
    if args.enable_expert_parallel:  # the group is this engine's tp devices (one device: all experts there)
        check_expert_parallel(config, args.tensor_parallel_size)
    if args.pipeline_parallel_size > 1:
        if quant.config is not None:
            raise ValueError(f"quantization={quant.config.method!r} is not supported with pipeline_parallel_size > 1 "
                             "yet: use tensor_parallel_size")
        model, plan, run_config, memory_config = load_pipeline_model(
            args, model_path, config, dtype, devices, _weight_cache_key(
                args, model_path, dtype, kind="pipeline_parallel", pp=args.pipeline_parallel_size,
                tp=args.tensor_parallel_size))
        forward = PipelineForward()
    elif args.tensor_parallel_size > 1:
        model, plan, run_config, memory_config = _load_tensor_parallel(args, model_path, config, dtype, quant,
                                                                       devices)
    else:
        model, plan = _load_single_device(args, model_path, config, dtype, quant), None
        if devices is not None:  # another replica's device: move the weights before the KV pool is sized there
            _move_to_device(model, devices[0])
        run_config = memory_config = config
    load_seconds = time.perf_counter() - start
    logger.info("model weights ready in %.2f s", load_seconds)
    generation = gen_config.read_generation_config(args.generation_config, model_path)
    eos = sorted(set(config.eos_token_ids) | set(gen_config.eos_token_ids(generation)))
    return LoadedModel(model=model, config=config, model_path=model_path, dtype=dtype, plan=plan,
                       run_config=run_config, memory_config=memory_config, tokenizer=tokenizer,
                       eos_token_ids=eos, generation_config=generation, load_seconds=load_seconds,
                       quantization=quant.config, kv_cache_dtype=quant.kv_cache_dtype, forward=forward, pooler=pooler)


def resolve_pooling(args: EngineArgs, config, model_path: str | None, tokenizer=None):
    """``(the ModelConfig to load, PoolerConfig or None)``: the runner ``args`` ask for this checkpoint
    (``paged_jax.pooling.config``). ValueError naming the field for a pooling model under a setting it does not run
    with."""
    head = checkpoint_head(config, read_hf_config(model_path))
    runner, convert = resolve_runner(args.runner, args.convert, args.task, head)
    if runner == "generate":
        return config, None
    for field in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        if getattr(args, field) != 1:
            raise ValueError(f"{field}={getattr(args, field)}: the pooling runner runs on one device")
    for field in ("async_scheduling", "enable_lora", "quantization", "speculative_config"):
        if getattr(args, field):
            raise ValueError(f"{field}={getattr(args, field)!r} is not supported with the pooling runner")
    pooler = pooler_config(convert, config, model_path, tokenizer)
    logger.info("pooling runner: %s, %s pooling%s", pooler.task, pooler.pooling_type,
                ", normalized" if pooler.normalize else "")
    return pooling_model_config(config, pooler), pooler


@dataclasses.dataclass(frozen=True)
class EngineQuantization:
    """``config``: the weights' ``QuantConfig`` (None: unquantized); ``kv_cache_dtype``: jnp dtype of the KV pool
    (None: the model dtype); ``kv_cache_scales``: each attention carries the checkpoint's k/v scales."""

    config: Any
    kv_cache_dtype: Any
    kv_cache_scales: bool

    def layout(self, matmul_impl: str = "auto") -> dict:
        """What the weights cache key adds for it (nothing for an unquantized model without KV scales): the method,
        the KV scales and, for integer weights, the storage the modules of ``matmul_impl`` hold (packed words or
        native int4 / int8: "auto" follows the tuning table, so an entry written under another table is not
        restored into the wrong layout)."""
        if self.config is None and not self.kv_cache_scales:
            return {}
        layout = {"quantization": None if self.config is None else self.config.to_json(),
                  "kv_cache_scales": self.kv_cache_scales}
        if self.config is not None and self.config.kind == "weight_only":
            from models.quantization.linear import weight_storage

            layout["weight_storage"] = weight_storage(matmul_impl, f"int{self.config.bits}")
        return layout


def resolve_engine_quantization(args: EngineArgs, model_path: str | None) -> EngineQuantization:
    """``--quantization`` against the checkpoint's ``quantization_config`` (``models.quantization``), and
    ``--kv-cache-dtype``. Raises the ValueError naming ``quantization`` for an unknown or mismatched method."""
    import json

    from models.quantization.config import resolve_quantization

    hf_config = {}
    if model_path is not None and os.path.isfile(os.path.join(model_path, "config.json")):
        with open(os.path.join(model_path, "config.json")) as f:
            hf_config = json.load(f)
    quant = resolve_quantization(args.quantization, hf_config)
    if quant is not None:
        logger.info("quantization: %s (%s%s)", quant.method, "checkpoint" if quant.serialized else "at load time",
                    {"fp8": "", "int8": ", int8 weight-only per channel"}.get(
                        quant.kind, f", int{quant.bits} weight-only, group size {quant.group_size}"))
    if args.kv_cache_dtype == "auto":
        return EngineQuantization(quant, None, False)
    import jax.numpy as jnp

    scales = quant is not None and quant.kv_cache_scheme
    if not scales:
        # vLLM's behaviour for a checkpoint without KV scales.
        logger.warning("kv_cache_dtype=%s: the checkpoint has no k/v scales; using scale 1.0 (values beyond the "
                       "e4m3 range of +-448 are clipped)", args.kv_cache_dtype)
    return EngineQuantization(quant, jnp.float8_e4m3fn, scales)


def _weight_cache_key(args: EngineArgs, model_path: str | None, dtype: str, **layout) -> dict | None:
    """The weights-cache key of this layout; None (no caching) for random weights or ``--no-weight-cache``."""
    from models import weight_cache

    if not args.weight_cache or args.load_format == "dummy":
        return None
    return weight_cache.cache_key(model_path, dtype=dtype, layout=layout)


def _load_quantized(args: EngineArgs, model_path: str | None, config, dtype: str, quant: EngineQuantization):
    from models.quantization.load import load_quantized_model

    return load_quantized_model(model_path, config, quant.config, dtype=dtype, load_format=args.load_format,
                                seed=args.seed, kv_cache_scales=quant.kv_cache_scales)


def _load_single_device(args: EngineArgs, model_path: str | None, config, dtype: str, quant: EngineQuantization):
    from flax import nnx

    from models import weight_cache
    from models.architectures import model_class
    from models.llama import fuse_projections
    from models.loader import load_model, resolve_dtype

    jnp_dtype = resolve_dtype(dtype)

    def convert():
        if quant.config is not None:
            model = _load_quantized(args, model_path, config, dtype, quant)
        else:
            model, _ = load_model(model_path, dtype=dtype, load_format=args.load_format, seed=args.seed,
                                  config=config)
        # One matmul for q/k/v and one for gate/up per layer (before the KV pool is sized from free memory).
        model = fuse_projections(model)
        if quant.config is not None and (not quant.config.serialized or args.load_format == "dummy"):
            from paged_jax.worker.device_memory import place_contiguously

            place_contiguously(model)  # quantized on the device: the freed full-precision buffers split free memory
        return model

    def abstract():
        if quant.config is not None:
            from models.quantization.load import abstract_quantized_model

            return abstract_quantized_model(config, quant.config, jnp_dtype, kv_cache_scales=quant.kv_cache_scales,
                                            transform=fuse_projections)
        return nnx.eval_shape(lambda: fuse_projections(
            model_class(config)(config, dtype=jnp_dtype, param_dtype=jnp_dtype, rngs=nnx.Rngs(0))))

    head = {} if config.head == "lm_head" else {"head": config.head}  # an embedder keeps no LM head
    return weight_cache.load_or_convert(
        _weight_cache_key(args, model_path, dtype, kind="fused", **quant.layout(), **head), convert, abstract)


def _move_to_device(model, device) -> None:
    import jax
    from flax import nnx

    nnx.update(model, jax.device_put(nnx.state(model), device))


def _load_tensor_parallel(args: EngineArgs, model_path: str | None, config, dtype: str, quant: EngineQuantization,
                          devices=None):
    from models import weight_cache
    from models.loader import resolve_dtype
    from models.tensor_parallel import TensorParallelLlamaForCausalLM, abstract_model, load_sharded_model
    from paged_jax.parallel import ShardingPlan, make_mesh

    plan = ShardingPlan.create(config, make_mesh(args.tensor_parallel_size, devices=devices),
                               expert_parallel=args.enable_expert_parallel)
    jnp_dtype = resolve_dtype(dtype)
    matmul_impl = "xla"  # of quantized modules: an XLA form (the Pallas kernels run on one device's arrays)
    if quant.config is not None:
        from flax import nnx

        from models.quantization.load import (abstract_quantized_model, shard_quantized_model,
                                              tensor_parallel_matmul_impl)

        matmul_impl = tensor_parallel_matmul_impl(quant.config)
        convert = lambda: shard_quantized_model(  # noqa: E731
            _load_quantized(args, model_path, config, dtype, quant), plan, quant.config,
            kv_cache_scales=quant.kv_cache_scales)
        abstract = lambda: abstract_quantized_model(  # noqa: E731
            plan.model_config, quant.config, jnp_dtype, kv_cache_scales=quant.kv_cache_scales,
            matmul_impl=matmul_impl,
            make_model=lambda: TensorParallelLlamaForCausalLM(plan, dtype=jnp_dtype, param_dtype=jnp_dtype,
                                                              rngs=nnx.Rngs(0)))
    else:
        convert = lambda: load_sharded_model(model_path, plan, dtype=dtype,  # noqa: E731
                                             load_format=args.load_format, seed=args.seed)
        abstract = lambda: abstract_model(plan, jnp_dtype)  # noqa: E731
    model = weight_cache.load_or_convert(
        _weight_cache_key(args, model_path, dtype, kind="tensor_parallel", mesh=dict(plan.mesh.shape),
                          kv_layout=plan.kv_layout, head_layout=dataclasses.asdict(plan.head_layout),
                          **({"expert_parallel": True} if plan.expert_parallel else {}),
                          **quant.layout(matmul_impl=matmul_impl)),
        convert, abstract, shardings=plan.state_shardings)
    # The runner builds the KV pool from the head-rewritten shape; memory is sized per device.
    return model, plan, plan.model_config, plan.per_device_model_config
