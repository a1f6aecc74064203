"""Research entry points beside ``generate``: load a checkpoint for jitted code, and score token sequences.

``load_pretrained`` turns a local checkpoint or Hub repo id into ``(graphdef, state, config, tokenizer)``, the pieces
``generate`` and ``score_tokens`` take. ``score_tokens`` is the second half of an RL step: the per-token log-probs of
given sequences under the model, differentiable with respect to the parameters, in one forward pass per row.
With ``batch_invariant=True`` it computes them as the engine's batch-invariant mode does (``score_tokens``).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import dense_causal_attention
from models.llama import ReusableAttention
from paged_jax.ops import write_and_attend
from paged_jax.research.generate import call_with_model_compiler_options, split_model
from paged_jax.worker.batch_invariant import engine_batch_invariant
from paged_jax.worker.logit_processing import temperature_and_filters
from paged_jax.worker.sampler import raw_logprob_outputs

# Tokens per KV block of the paged pool ``score_tokens`` builds in batch-invariant mode (any size gives the same
# bits: the attention walks keys in its own fixed blocks).
_INVARIANT_BLOCK_SIZE = 16


class Pretrained(NamedTuple):
    """What ``load_pretrained`` returns: ``generate((graphdef, state), ...)`` and ``score_tokens`` take the first
    two; ``config`` is the ``models.config.ModelConfig``; ``tokenizer`` the HF tokenizer (None if the checkpoint has
    none)."""

    graphdef: Any
    state: Any
    config: Any
    tokenizer: Any


def load_pretrained(model: str, *, dtype: str = "bfloat16", revision: str | None = None,
                    download_dir: str | None = None, tokenizer: str | None = None) -> Pretrained:
    """Load a checkpoint (local directory or Hub repo id) as an NNX split ready for ``jax.jit`` code.

    Args:
      model: local HF checkpoint directory or Hub repo id (downloaded through ``models.hub``).
      dtype: "bfloat16", "float16" or "float32" (float32 runs full-precision matmuls).
      revision, download_dir: Hub revision and cache directory (vLLM's ``--revision`` / ``--download-dir``).
      tokenizer: another directory or repo id for the tokenizer (default: ``model``'s).
    Returns:
      ``Pretrained(graphdef, state, config, tokenizer)``; weights on the default device, HF projection layout.
    Raises:
      ValueError naming the argument (unknown path or repo, unsupported dtype or architecture).
    """
    from transformers import AutoTokenizer

    from models.hub import resolve_checkpoint
    from models.loader import load_model

    path = resolve_checkpoint(model, revision=revision, download_dir=download_dir)
    module, config = load_model(path, dtype=dtype)
    graphdef, state = nnx.split(module)
    tokenizer_path = (path if tokenizer is None else
                      resolve_checkpoint(tokenizer, download_dir=download_dir, what="tokenizer", field="tokenizer"))
    hf_tokenizer = (AutoTokenizer.from_pretrained(str(tokenizer_path))
                    if any(tokenizer_path.glob("tokenizer*")) else None)
    return Pretrained(graphdef, state, config, hf_tokenizer)


def score_tokens(model, token_ids, lengths, *, temperature=None, top_k=0, top_p=1.0, min_p=0.0,
                 batch_invariant: bool = False) -> jax.Array:
    """Per-token log-probs of right-padded token sequences: ``out[b, t] = log p(token_ids[b, t] | token_ids[b, :t])``.

    Args:
      model: an NNX ``LlamaForCausalLM`` or its ``(graphdef, state, ...)`` split (state may be traced: call this inside
        ``jax.jit`` / ``jax.grad``; gradients flow to the parameters).
      token_ids: int32[B, T]; each row a prompt followed by its completion, right-padded.
      lengths: int32[B]; valid tokens per row, in [1, T].
      temperature, top_k, top_p, min_p: None (the default): the raw model distribution. Else (a number or one per
        row, float32[B] / int32[B]) the distribution the engine samples from with those parameters: logits /
        temperature, then min-p, top-k, top-p (``paged_jax.worker.logit_processing.temperature_and_filters``), renormalized;
        a filtered-out token scores -inf. What the engine reports with ``logprobs_mode="processed_logprobs"``.
      batch_invariant: static; the engine's batch-invariant mode (``paged_jax.worker.batch_invariant``): every row
        through the mode's matmuls and norms and the engine's paged attention, all rows as one ragged batch, so a
        raw log-prob is the same bits as the engine's (and ``generate``'s) with ``batch_invariant=True`` for that
        token after that prefix, whatever the other rows. Its gradient is the default computation's (the same
        function up to rounding): the mode's kernels have no gradient of their own.
    Returns:
      float32[B, T]: 0 at t = 0 (no context) and at t >= lengths[b]; log-probs of the raw model distribution
      (temperature 1, no truncation), the same quantity ``generate`` and the engine report (or of the processed one,
      given a ``temperature``). Mask with ``t >= prompt_length`` to keep the completion's terms.
    Memory: attention is dense per row (float32[Hq, T, T] per layer) and the logits are float32[B, T, vocab].
    """
    graphdef, states = split_model(model)
    token_ids = jnp.asarray(token_ids)
    lengths = jnp.asarray(lengths)
    if token_ids.ndim != 2 or not jnp.issubdtype(token_ids.dtype, jnp.integer):
        raise ValueError(f"token_ids must be int32[B, T], got {token_ids.dtype}{list(token_ids.shape)}")
    if lengths.shape != token_ids.shape[:1] or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths must be int32[B={token_ids.shape[0]}], got {lengths.dtype}{list(lengths.shape)}")
    transform = None
    if temperature is not None:
        rows = token_ids.shape[:1]
        transform = (jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), rows),  # temperature_and_filters' order
                     jnp.broadcast_to(jnp.asarray(min_p, jnp.float32), rows),
                     jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), rows),
                     jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), rows))
    score = _invariant_scores if batch_invariant else _score_on_device
    return call_with_model_compiler_options(_score_jit, graphdef, states, score, graphdef, states,
                                            token_ids.astype(jnp.int32), lengths.astype(jnp.int32), transform)


@functools.cache
def _score_jit(options: tuple[tuple[str, Any], ...]):
    """``score(graphdef, states, token_ids, lengths, transform)`` jitted with the XLA ``options``
    (``paged_jax.research.generate.model_compiler_options``); ``score`` is ``_score_on_device`` or
    ``_invariant_scores``."""

    def scores(score, *args):
        return score(*args)

    return jax.jit(scores, static_argnums=(0, 1), compiler_options=dict(options) or None)


def _score_on_device(graphdef, states: tuple, token_ids: jax.Array, lengths: jax.Array,
                     transform: tuple | None) -> jax.Array:
    """``score_tokens``' default computation: float32[B, T]."""
    model = nnx.merge(graphdef, *states)
    num_tokens = token_ids.shape[1]
    positions = jnp.arange(num_tokens, dtype=jnp.int32)
    sm_scale = model.config.head_dim ** -0.5

    def score_row(tokens: jax.Array, length: jax.Array, row_transform: tuple | None) -> jax.Array:
        valid = positions < length
        # Padding tokens form their own (ignored) segments so they never reach a valid token's context.
        attention = dense_causal_attention(jnp.where(valid, 0, -1), sm_scale)
        hidden, _ = model(tokens, positions, None, attention)
        logits = model.compute_logits(hidden[:-1])  # float32[T-1, V]: predicts tokens 1..T-1
        if row_transform is not None:  # the same parameters at every position of the row
            logits = temperature_and_filters(logits, *(jnp.broadcast_to(x, logits.shape[:1]) for x in row_transform))
        target = jnp.take_along_axis(logits, tokens[1:, None], axis=-1)[:, 0]
        logprobs = target - jax.nn.logsumexp(logits, axis=-1)
        return jnp.where(valid[1:], logprobs, 0.0)

    scored = jax.vmap(score_row)(token_ids, lengths, transform)  # [B, T-1]
    return jnp.concatenate([jnp.zeros((token_ids.shape[0], 1), jnp.float32), scored], axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _invariant_scores(graphdef, states: tuple, token_ids: jax.Array, lengths: jax.Array,
                      transform: tuple | None) -> jax.Array:
    """``score_tokens(batch_invariant=True)``: float32[B, T] (``_paged_scores``), differentiated as
    ``_score_on_device``."""
    return _paged_scores(graphdef, states, token_ids, lengths, transform)


def _invariant_scores_fwd(graphdef, states, token_ids, lengths, transform):
    return _paged_scores(graphdef, states, token_ids, lengths, transform), (states, token_ids, lengths, transform)


def _invariant_scores_bwd(graphdef, residuals, cotangent):
    states, token_ids, lengths, transform = residuals
    _, vjp = jax.vjp(lambda s: _score_on_device(graphdef, s, token_ids, lengths, transform), states)
    return vjp(cotangent)[0], None, None, None


_invariant_scores.defvjp(_invariant_scores_fwd, _invariant_scores_bwd)


def _paged_scores(graphdef, states: tuple, token_ids: jax.Array, lengths: jax.Array,
                  transform: tuple | None) -> jax.Array:
    """The rows ``int32[B, T]`` as one ragged batch of B sequences of T tokens (a row's padding after its valid
    tokens, which causal attention keeps out of their context) through the batch-invariant model and the engine's
    paged attention; log-probs by the engine sampler's ``raw_logprob_outputs``: float32[B, T]."""
    model = engine_batch_invariant(nnx.merge(graphdef, *states))
    config = model.config
    batch_size, num_tokens = token_ids.shape
    blocks_per_row = -(-num_tokens // _INVARIANT_BLOCK_SIZE)
    block_tables = (1 + jnp.arange(batch_size, dtype=jnp.int32)[:, None] * blocks_per_row
                    + jnp.arange(blocks_per_row, dtype=jnp.int32)[None, :])  # [B, blocks_per_row]; 0: null block
    positions = jnp.arange(num_tokens, dtype=jnp.int32)
    slots = (block_tables[:, :1] * _INVARIANT_BLOCK_SIZE + positions[None, :]).reshape(-1)  # [B * T]
    meta = dict(slot_mapping=slots, kv_lens=jnp.full((batch_size,), num_tokens, jnp.int32), block_tables=block_tables,
                cu_q_lens=jnp.arange(batch_size + 1, dtype=jnp.int32) * num_tokens)
    attention = ReusableAttention(functools.partial(write_and_attend, sm_scale=config.head_dim ** -0.5,
                                                    sliding_window=config.sliding_window, batch_invariant=True),
                                  meta, fuses_qk_transform=True)
    page_shape = (1 + batch_size * blocks_per_row, _INVARIANT_BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    kv_caches = [(jnp.zeros(page_shape, model.dtype), jnp.zeros(page_shape, model.dtype))
                 for _ in range(config.num_hidden_layers)]
    hidden, _ = model(token_ids.reshape(-1), jnp.tile(positions, batch_size), kv_caches, attention)
    logits = model.compute_logits(hidden)  # float32[B * T, V]; row b * T + t predicts token t + 1 of row b
    if transform is not None:
        logits = temperature_and_filters(logits, *(jnp.repeat(x, num_tokens) for x in transform))
    targets = jnp.roll(token_ids, -1, axis=1).reshape(-1)
    logprobs = raw_logprob_outputs(logits, targets, 0, batch_invariant=True)[0].reshape(batch_size, num_tokens)[:, :-1]
    valid = positions[None, 1:] < lengths[:, None]
    return jnp.concatenate([jnp.zeros((batch_size, 1), jnp.float32), jnp.where(valid, logprobs, 0.0)], axis=1)
