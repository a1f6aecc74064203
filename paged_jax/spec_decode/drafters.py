"""Loading a model drafter at start-up: a draft model with the target's vocabulary (``draft_model``), an EAGLE head
(``eagle``) or an EAGLE-3 head (``eagle3``) for the target (``speculative_config.model``), or the target
checkpoint's own multi-token prediction layer (``mtp``), as a ``DraftRunner`` for the model runner (on a
tensor-parallel target's mesh: ``paged_jax.spec_decode.sharding``).
Everything that cannot work is refused here, before any compile, with a ValueError naming the field."""

from __future__ import annotations

import logging
from pathlib import Path

import jax.numpy as jnp

from models.config import ModelConfig
from models.eagle import load_eagle_head
from models.eagle3 import load_eagle3_head
from models.loader import load_model
from models.mtp import init_dummy_mtp_head, load_mtp_head
from models.tensor_parallel import load_sharded_model
from paged_jax.parallel import ShardingPlan
from paged_jax.spec_decode.config import MODEL_METHODS, SpeculativeConfig
from paged_jax.spec_decode.draft_runner import DraftRunner
from paged_jax.spec_decode.sharding import drafter_plan, shard_head

logger = logging.getLogger(__name__)


def resolve_drafter_path(spec: SpeculativeConfig, *, download_dir: str | None = None) -> str:
    """``speculative_config.model`` as a local directory (a Hub repo id is downloaded like the target's model);
    ValueError naming the field for a path that does not exist."""
    from models.hub import resolve_checkpoint

    what = "model" if spec.method == "draft_model" else "draft_head"
    return str(resolve_checkpoint(spec.model, download_dir=download_dir, what=what, field="speculative_config.model"))


def check_same_vocabulary(draft_path: str, draft_config: ModelConfig, target_config: ModelConfig,
                          target_tokenizer) -> None:
    """A draft model proposes target token ids: its vocabulary must be the target's (size, and with tokenizers on
    both sides, every token's id). ValueError naming ``speculative_config.model`` otherwise."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"speculative_config.model {draft_path!r} has a vocabulary of {draft_config.vocab_size} "
                         f"tokens, the target's has {target_config.vocab_size}: a draft model needs the target's "
                         "tokenizer")
    if target_tokenizer is None or not any(Path(draft_path).glob("tokenizer*")):
        return
    from transformers import AutoTokenizer

    if AutoTokenizer.from_pretrained(draft_path).get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(f"speculative_config.model {draft_path!r} has another tokenizer vocabulary than the "
                         "target's: a draft model needs the target's tokenizer")


def load_drafter(spec: SpeculativeConfig, target_model, target_config: ModelConfig, target_tokenizer, *,
                 dtype: str | None = None, download_dir: str | None = None, target_path: str | None = None,
                 dummy: bool = False, plan: ShardingPlan | None = None) -> DraftRunner | None:
    """The ``DraftRunner`` of ``spec`` (None for the host proposers ngram / suffix), its weights in ``dtype``
    ("auto" / None: the target's). ``target_path``: the target's checkpoint directory (mtp reads its MTP layer
    there); ``dummy``: the target has random weights (``load_format="dummy"``), so has the MTP layer; ``plan``: the
    tensor-parallel target's ``ShardingPlan`` (the drafter is laid out on its mesh: ``paged_jax.spec_decode.sharding``),
    None on one device."""
    if spec is None or spec.method not in MODEL_METHODS:
        return None
    dtype = target_model.dtype if dtype in (None, "auto") else dtype
    if spec.method == "mtp":
        return _mtp(spec.num_speculative_tokens, target_model, target_config, dtype, target_path, dummy, plan)
    path = resolve_drafter_path(spec, download_dir=download_dir)
    if spec.method == "draft_model":
        return _draft_model(path, spec.num_speculative_tokens, dtype, target_config, target_tokenizer, plan)
    embedding = target_model.model.embed_tokens.embedding[...]
    if spec.method == "eagle":
        lm_head = None if target_model.lm_head is None else target_model.lm_head.kernel[...]
        head = load_eagle_head(path, target_config, dtype=jnp.dtype(dtype), target_embedding=embedding,
                               target_lm_head=lm_head)
        logger.info("EAGLE head %s: %d layers, %d speculative tokens", path, head.config.model.num_hidden_layers,
                    spec.num_speculative_tokens)
        return _head_runner("eagle", spec.num_speculative_tokens, head, plan, shared=(embedding, lm_head))
    head = load_eagle3_head(path, target_config, dtype=jnp.dtype(dtype), target_embedding=embedding)
    logger.info("EAGLE-3 head %s on target layers %s, %d speculative tokens", path, head.config.aux_hidden_layers,
                spec.num_speculative_tokens)
    return _head_runner("eagle3", spec.num_speculative_tokens, head, plan, shared=(embedding,),
                        aux_hidden_layers=head.config.aux_hidden_layers)


def _head_runner(method: str, k: int, head, target_plan: ShardingPlan | None, *, shared: tuple,
                 aux_hidden_layers: tuple[int, ...] = ()) -> DraftRunner:
    """The runner of an EAGLE / EAGLE-3 head or an MTP layer, laid out on the target's mesh under ``target_plan``."""
    config = head.config if method == "mtp" else head.config.model
    if target_plan is None:
        return DraftRunner(method, k, head, config, aux_hidden_layers=aux_hidden_layers, shared=shared)
    plan = drafter_plan(config, target_plan)
    return DraftRunner(method, k, shard_head(head, plan, shared), plan.model_config,
                       aux_hidden_layers=aux_hidden_layers, shared=shared, plan=plan)


def _mtp(k: int, target_model, target_config: ModelConfig, dtype, target_path: str | None, dummy: bool,
         target_plan: ShardingPlan | None) -> DraftRunner:
    shared = (target_model.model.embed_tokens.embedding[...],
              None if target_model.lm_head is None else target_model.lm_head.kernel[...])
    if dummy:
        head = init_dummy_mtp_head(target_config, target_embedding=shared[0], target_lm_head=shared[1],
                                   dtype=jnp.dtype(dtype))
    else:
        head = load_mtp_head(target_path, target_config, target_embedding=shared[0], target_lm_head=shared[1],
                             dtype=jnp.dtype(dtype))
    logger.info("MTP drafter: layer %d of %s%s, %d speculative tokens", target_config.num_hidden_layers,
                target_path or "the target", " (random weights)" if dummy else "", k)
    return _head_runner("mtp", k, head, target_plan, shared=shared)


def _draft_model(path: str, k: int, dtype, target_config: ModelConfig, target_tokenizer,
                 target_plan: ShardingPlan | None) -> DraftRunner:
    draft_config = ModelConfig.from_pretrained(path)
    check_same_vocabulary(path, draft_config, target_config, target_tokenizer)
    if draft_config.layer_sliding_windows is not None or any(draft_config.layer_chunks):
        raise ValueError(f"speculative_config.model {path!r} mixes sliding-window or chunked and full attention "
                         "layers: not supported as a draft model")
    if draft_config.mla is not None:
        raise ValueError(f"speculative_config.model {path!r} has a latent (MLA) KV cache: not supported as a draft "
                         "model")
    logger.info("draft model %s: %d layers, %d speculative tokens", path, draft_config.num_hidden_layers, k)
    if target_plan is None:
        model, draft_config = load_model(path, dtype=dtype, config=draft_config)
        return DraftRunner("draft_model", k, model, draft_config)
    plan = drafter_plan(draft_config, target_plan)
    return DraftRunner("draft_model", k, load_sharded_model(path, plan, dtype=dtype), plan.model_config, plan=plan)
