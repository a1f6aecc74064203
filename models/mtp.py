"""DeepSeek-V3's multi-token prediction (MTP) layers as a draft head (vLLM's ``mtp`` speculative method, alias
``deepseek_mtp``; vLLM's ``DeepSeekMTP``; DeepSeek-V3 technical report, section 2.2).

The checkpoint stores MTP module i after the decoder layers, as ``model.layers.{num_hidden_layers + i}``
(``num_nextn_predict_layers`` of them; DeepSeek-V3 and R1 publish one). For position p, ``t`` the token after p and
``h`` the target's final hidden state at p (after its final norm: what its LM head reads, as vLLM feeds it)::

    e = embed(t), zero at position 0 (vLLM's masking)          # the target's embedding, [T, H]
    x = eh_proj(concat(enorm(e), hnorm(h)))                    # [T, 2H] -> [T, H], the embedding first
    out = decoder_layer(x)                                     # the target's layer at index num_hidden_layers:
                                                               # latent attention (its own KV), MoE or dense MLP
    logits = head(shared_head.norm(out))                       # shared_head.head, else the target's LM head

``out`` (before ``shared_head.norm``) is the next draft's ``h``: with more drafts than MTP layers the layer drafts
again on its own output, as vLLM does. ``MtpHead`` has the call signature of ``models.eagle.EagleHead``, so the
EAGLE machinery (``paged_jax.spec_decode.draft_runner``) drives it.

Checkpoint names (``L = num_hidden_layers``): ``model.layers.L.{enorm,hnorm}.weight``, ``model.layers.L.eh_proj.weight``
[H, 2H], ``model.layers.L.shared_head.norm.weight``, optionally ``model.layers.L.shared_head.head.weight`` [V, H] and
``model.layers.L.embed_tokens.weight`` (not read: the target's embedding is shared, as vLLM does), and the decoder
layer's tensors under ``model.layers.L.`` as any DeepSeek layer's (block-FP8 ones dequantized, experts stacked).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.eagle import variable_at
from models.llama import DecoderLayer, _linear, matmul_precision, scale_logits
from models.loader import checkpoint_tensor_files, iter_checkpoint_params, to_model_layout
from models.norm import RMSNorm
from models.qk_transform import rope_tables

# Parameters shared with the target (set from its arrays, never read from the MTP layer's tensors).
_SHARED = ("embed_tokens", "lm_head")


def check_mtp_target(config: ModelConfig) -> None:
    """ValueError naming ``speculative_config.method`` and ``num_nextn_predict_layers`` for a target without
    exactly one MTP layer."""
    layers = config.num_nextn_predict_layers
    if layers == 0:
        raise ValueError(f"speculative_config.method='mtp' needs a model with multi-token prediction layers "
                         f"(num_nextn_predict_layers >= 1, as DeepSeek-V3 ships); this {config.architecture} has "
                         "num_nextn_predict_layers=0")
    if layers != 1:
        raise ValueError(f"speculative_config.method='mtp' runs one multi-token prediction layer (as DeepSeek-V3 / "
                         f"R1 publish); this model has num_nextn_predict_layers={layers}")


class SharedHead(nnx.Module):
    """``shared_head``: its ``norm`` and, when the checkpoint has one, its own ``head`` (None: the target's)."""

    def __init__(self, norm: RMSNorm, head: nnx.Module | None):
        self.norm = norm
        self.head = nnx.data(head)


class MtpHead(nnx.Module):
    """One MTP module of the target ``target`` (module docstring). ``own_head``: ``shared_head.head`` is the
    checkpoint's; otherwise ``lm_head`` holds the target's LM head kernel [H, V] (None for a tied target: its
    embedding). ``config``: the drafter's KV shape (one latent layer, the target's attention)."""

    def __init__(self, target: ModelConfig, *, own_head: bool, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        hidden = target.hidden_size
        self.target, self.dtype = target, dtype
        self.config = dataclasses.replace(target, num_hidden_layers=1, num_nextn_predict_layers=0)
        norm = functools.partial(RMSNorm, hidden, eps=target.rms_norm_eps, dtype=dtype, param_dtype=dtype)
        self.enorm, self.hnorm = norm(), norm()
        self.eh_proj = _linear(2 * hidden, hidden, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        # Layer num_hidden_layers of the stack the checkpoint stores (per-layer options are read by that index).
        stack = dataclasses.replace(target, num_hidden_layers=target.num_hidden_layers + 1)
        self.mtp_block = DecoderLayer(stack, target.num_hidden_layers, dtype=dtype, param_dtype=dtype, rngs=rngs)
        head = (_linear(hidden, target.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
                if own_head else None)
        self.shared_head = SharedHead(norm(), head)
        self.embed_tokens = nnx.Embed(target.vocab_size, hidden, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.lm_head = nnx.data(None if own_head or target.tie_word_embeddings else
                                nnx.Param(jnp.zeros((hidden, target.vocab_size), dtype)))

    def features(self, hidden: jax.Array) -> jax.Array:
        """The target forward's hidden states [T, H] -> the head's ``hidden`` input."""
        return hidden[:, :self.target.hidden_size]

    def __call__(self, input_ids: jax.Array, positions: jax.Array, hidden: jax.Array, kv_caches: list, attention):
        """input_ids int32[T] (the token after each position), positions int32[T], hidden [T, H] (the target's, or
        the head's own output of the previous draft), kv_caches [one layer's] -> (out [T, H] for
        ``compute_logits``, the same for the next draft, kv_caches)."""
        with matmul_precision(self.dtype):
            embedded = jnp.where((positions == 0)[:, None], 0, self.embed_tokens(input_ids)).astype(self.dtype)
            x = self.eh_proj(jnp.concatenate([self.enorm(embedded), self.hnorm(hidden.astype(self.dtype))], axis=-1))
            rope = rope_tables(self.config, positions)
            out, residual, kv_layer = self.mtp_block(0, x, None, rope, kv_caches[0], attention)
            out = out + residual
            return out, out, [kv_layer]

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """[N, H] -> float32[N, V]: ``shared_head.norm``, then its head (or the target's LM head, or tied
        embedding)."""
        if self.shared_head.head is not None:
            weight = self.shared_head.head.kernel[...]
        else:
            weight = self.embed_tokens.embedding[...].T if self.lm_head is None else self.lm_head[...]
        with matmul_precision(self.dtype):
            normed = self.shared_head.norm(hidden.astype(self.dtype))
            logits = jnp.dot(normed, weight.astype(self.dtype), preferred_element_type=jnp.float32)
        return scale_logits(self.target, logits)

    def to_target_ids(self, draft_ids: jax.Array) -> jax.Array:
        """The head drafts over the target's vocabulary: ids unchanged."""
        return draft_ids

    def share_target(self, embedding: jax.Array, lm_head: jax.Array | None) -> None:
        """Use the target's ``embedding`` [V, H] and LM head kernel [H, V] (None: tied); ValueError when the head
        needs an LM head the target does not have."""
        self.embed_tokens.embedding.set_value(embedding)
        if self.lm_head is not None:
            if lm_head is None:
                raise ValueError("speculative_config.method='mtp': the checkpoint has no shared_head.head and the "
                                 "target no LM head of its own to share")
            self.lm_head.set_value(lm_head)


def _loader_paths(head: MtpHead) -> dict[tuple, tuple]:
    """The head's own parameter paths -> the target loader's path of the same tensor (``model.layers.L.…``)."""
    layer = head.target.num_hidden_layers
    paths = {}
    for path, _ in nnx.to_flat_state(nnx.state(head)):
        if path[0] not in _SHARED:
            paths[tuple(path)] = ("model", "layers", layer, *(path[1:] if path[0] == "mtp_block" else path))
    return paths


def load_mtp_head(path: str | Path, target: ModelConfig, *, target_embedding: jax.Array,
                  target_lm_head: jax.Array | None, dtype=jnp.bfloat16) -> MtpHead:
    """The MTP layer of the checkpoint at ``path`` (the target's, ``target`` its config) with weights in ``dtype``,
    sharing the target's ``target_embedding`` [V, H] and ``target_lm_head`` kernel [H, V] (None: tied).
    ValueError naming ``speculative_config.method`` / ``num_nextn_predict_layers`` for a model without one MTP layer,
    the tensor for a missing, extra or misshapen one."""
    check_mtp_target(target)
    prefix = f"model.layers.{target.num_hidden_layers}."
    files = {name: file for name, file in checkpoint_tensor_files(Path(path)).items() if name.startswith(prefix)}
    if not files:
        raise ValueError(f"speculative_config.method='mtp': checkpoint {path} has no {prefix}* tensors (its "
                         "multi-token prediction layer), though its config has num_nextn_predict_layers=1")
    files.pop(prefix + "embed_tokens.weight", None)
    own_head = prefix + "shared_head.head.weight" in files
    head = nnx.eval_shape(lambda: MtpHead(target, own_head=own_head, dtype=dtype, rngs=nnx.Rngs(0)))
    by_loader_path = {loader: own for own, loader in _loader_paths(head).items()}
    expected = {loader: tuple(variable_at(head, own).get_value().shape) for loader, own in by_loader_path.items()}
    # The target's loader reads layers past num_hidden_layers as MTP layers (skipped): this one is read here.
    config = dataclasses.replace(target, num_hidden_layers=target.num_hidden_layers + 1)
    for loader_path, array, transposed in iter_checkpoint_params(files, expected, config):
        variable = variable_at(head, by_loader_path[loader_path])
        variable.set_value(to_model_layout(jnp.asarray(array).astype(variable.get_value().dtype), transposed))
    head.share_target(target_embedding, target_lm_head)
    return head


def init_dummy_mtp_head(target: ModelConfig, *, target_embedding: jax.Array, target_lm_head: jax.Array | None,
                        dtype=jnp.bfloat16, seed: int = 0) -> MtpHead:
    """A random MTP layer for ``target`` (``load_format="dummy"``, benchmarks), sharing the target's embedding and
    LM head as ``load_mtp_head``'s does."""
    check_mtp_target(target)
    head = MtpHead(target, own_head=False, dtype=dtype, rngs=nnx.Rngs(seed))
    head.share_target(target_embedding, target_lm_head)
    return head
