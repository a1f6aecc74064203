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

from paged_jax import generation_config as gen_config
from paged_jax.config import EngineArgs

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class LoadedModel:
    """A loaded model and what the engine needs beside it.

    ``run_config`` is the shape the runner executes (heads rewritten under tensor parallelism); ``memory_config``
    the per-device shape that sizes the KV pool; ``plan`` the ``paged_jax.parallel.ShardingPlan`` (None on one
    device); ``generation_config`` the checkpoint's generation config (``--generation-config``) as a dict.
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
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if on_accelerator else "float32")
    start = time.perf_counter()
    config = config or ModelConfig.from_pretrained(model_path)
    if args.pipeline_parallel_size > 1:
        from paged_jax.pipeline import load_pipeline_model

        model, plan, run_config, memory_config = load_pipeline_model(
            args, model_path, config, dtype, devices, _weight_cache_key(
                args, model_path, dtype, kind="pipeline_parallel", pp=args.pipeline_parallel_size,
                tp=args.tensor_parallel_size))
    elif args.tensor_parallel_size > 1:
        model, plan, run_config, memory_config = _load_tensor_parallel(args, model_path, config, dtype, devices)
    else:
        model, plan = _load_single_device(args, model_path, config, dtype), None
        if devices is not None:  # another replica's device: move the weights before the KV pool is sized there
            _move_to_device(model, devices[0])
        run_config = memory_config = config
    load_seconds = time.perf_counter() - start
    logger.info("model weights ready in %.2f s", load_seconds)
    generation = gen_config.read_generation_config(args.generation_config, model_path)
    eos = sorted(set(config.eos_token_ids) | set(gen_config.eos_token_ids(generation)))
    return LoadedModel(model=model, config=config, model_path=model_path, dtype=dtype, plan=plan,
                       run_config=run_config, memory_config=memory_config, tokenizer=load_tokenizer(args, model_path),
                       eos_token_ids=eos, generation_config=generation, load_seconds=load_seconds)


def _weight_cache_key(args: EngineArgs, model_path: str | None, dtype: str, **layout) -> dict | None:
    """The weights-cache key of this layout; None (no caching) for random weights or ``--no-weight-cache``."""
    from models import weight_cache

    if not args.weight_cache or args.load_format == "dummy":
        return None
    return weight_cache.cache_key(model_path, dtype=dtype, layout=layout)


def _load_single_device(args: EngineArgs, model_path: str | None, config, dtype: str):
    from flax import nnx

    from models import weight_cache
    from models.llama import LlamaForCausalLM, fuse_projections
    from models.loader import load_model, resolve_dtype

    jnp_dtype = resolve_dtype(dtype)

    def convert():
        model, _ = load_model(model_path, dtype=dtype, load_format=args.load_format, seed=args.seed, config=config)
        # One matmul for q/k/v and one for gate/up per layer (before the KV pool is sized from free memory).
        return fuse_projections(model)

    return weight_cache.load_or_convert(
        _weight_cache_key(args, model_path, dtype, kind="fused"), convert,
        lambda: nnx.eval_shape(lambda: fuse_projections(
            LlamaForCausalLM(config, dtype=jnp_dtype, param_dtype=jnp_dtype, rngs=nnx.Rngs(0)))))


def _move_to_device(model, device) -> None:
    import jax
    from flax import nnx

    nnx.update(model, jax.device_put(nnx.state(model), device))


def _load_tensor_parallel(args: EngineArgs, model_path: str | None, config, dtype: str, devices=None):
    from models import weight_cache
    from models.loader import resolve_dtype
    from models.tensor_parallel import abstract_model, load_sharded_model
    from paged_jax.parallel import ShardingPlan, make_mesh

    plan = ShardingPlan.create(config, make_mesh(args.tensor_parallel_size, devices=devices))
    model = weight_cache.load_or_convert(
        _weight_cache_key(args, model_path, dtype, kind="tensor_parallel", mesh=dict(plan.mesh.shape),
                          kv_layout=plan.kv_layout, head_layout=dataclasses.asdict(plan.head_layout)),
        lambda: load_sharded_model(model_path, plan, dtype=dtype, load_format=args.load_format, seed=args.seed),
        lambda: abstract_model(plan, resolve_dtype(dtype)), shardings=plan.state_shardings)
    # The runner builds the KV pool from the head-rewritten shape; memory is sized per device.
    return model, plan, plan.model_config, plan.per_device_model_config
