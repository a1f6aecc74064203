"""EAGLE-3 draft heads (vLLM's ``eagle3`` speculative method; Li et al., "EAGLE-3", 2025) in the published layout
(e.g. ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``; vLLM's ``Eagle3LlamaForCausalLM``).

The head is one decoder layer that reads the target model: ``fc`` maps three of the target's hidden states
(the residual stream entering layers ``eagle_aux_hidden_state_layer_ids``, by default 2, L // 2 and L - 3 of an L-layer
target: ``default_aux_hidden_layers``) concatenated, [T, 3 * target_hidden] -> [T, hidden]. The layer's attention
takes ``[input_layernorm(embed(token)) | hidden_norm(h)]`` ([T, 2 * hidden]); the residual stream starts at ``h``
itself (or at ``hidden_norm(h)`` with ``norm_before_residual``); ``norm`` then ``lm_head`` give logits over a
reduced draft vocabulary, mapped to target ids by ``d2t`` (target id = draft id + d2t[draft id]); ``t2d`` is not
used. Position p's input is the target's hidden state at p and the token at p + 1; later drafts feed back the head's
own pre-norm output (``Eagle3Head.__call__`` returns both). A checkpoint without ``embed_tokens.weight`` shares the
target's embedding (``share_embedding``).

Tensor names (safetensors): ``fc.weight``, ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``,
``lm_head.weight``, ``d2t``, ``t2d`` and optionally ``embed_tokens.weight``; Linear weights [out, in] as torch's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.eagle import load_head_tensors, read_head_config
from models.llama import MLP, Attention, _linear, matmul_precision
from models.loader import read_checkpoint_tensors
from models.norm import RMSNorm
from models.qk_transform import rope_tables

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def default_aux_hidden_layers(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's default EAGLE-3 feature layers of a target with ``num_target_layers`` layers."""
    return (2, num_target_layers // 2, num_target_layers - 3)


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 head's shape: ``model`` (its one layer's ``ModelConfig``: hidden size, heads, MLP, rope, the target
    vocabulary ``vocab_size``), ``draft_vocab_size``, ``target_hidden_size``, ``aux_hidden_layers`` (the target
    layers whose input feeds ``fc``) and ``norm_before_residual``."""

    model: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    aux_hidden_layers: tuple[int, ...]
    norm_before_residual: bool = False

    @classmethod
    def from_pretrained(cls, path: str | Path, target: ModelConfig) -> "Eagle3Config":
        """Read ``<path>/config.json`` for a head on ``target``; ValueError naming what does not fit."""
        hf = read_head_config(path, "EAGLE-3 head", EAGLE3_ARCHITECTURES)
        model = ModelConfig.from_hf_config({**hf, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1})
        eagle = hf.get("eagle_config") or {}
        layers = eagle.get("eagle_aux_hidden_state_layer_ids") or default_aux_hidden_layers(target.num_hidden_layers)
        return cls(model=model, draft_vocab_size=int(hf.get("draft_vocab_size") or model.vocab_size),
                   target_hidden_size=int(hf.get("target_hidden_size") or model.hidden_size),
                   aux_hidden_layers=tuple(int(i) for i in layers),
                   norm_before_residual=bool(hf.get("norm_before_residual", False)))


class Eagle3Layer(nnx.Module):
    """The head's decoder layer (HF prefix ``midlayer``): q/k/v read [T, 2 * hidden]."""

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        norm = lambda: RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype, param_dtype=dtype)  # noqa: E731
        self.input_layernorm, self.hidden_norm, self.post_attention_layernorm = norm(), norm(), norm()
        self.self_attn = Attention(config, 0, dtype=dtype, param_dtype=dtype, rngs=rngs)
        attn, wide = self.self_attn, 2 * config.hidden_size
        for name, width in (("q_proj", attn.num_heads), ("k_proj", attn.num_kv_heads), ("v_proj", attn.num_kv_heads)):
            setattr(attn, name, _linear(wide, width * attn.head_dim, use_bias=config.attention_bias, dtype=dtype,
                                        param_dtype=dtype, rngs=rngs))
        self.mlp = MLP(config, dtype=dtype, param_dtype=dtype, rngs=rngs)


class Eagle3Head(nnx.Module):
    """An EAGLE-3 head (module docstring). ``d2t``: int32[draft_vocab] offsets to target ids."""

    def __init__(self, config: Eagle3Config, *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        model = config.model
        self.config = config
        self.dtype = dtype
        self.fc = _linear(3 * config.target_hidden_size, model.hidden_size, use_bias=False, dtype=dtype,
                          param_dtype=dtype, rngs=rngs)
        self.midlayer = Eagle3Layer(model, dtype=dtype, rngs=rngs)
        self.norm = RMSNorm(model.hidden_size, eps=model.rms_norm_eps, dtype=dtype, param_dtype=dtype)
        self.lm_head = _linear(model.hidden_size, config.draft_vocab_size, use_bias=False, dtype=dtype,
                               param_dtype=dtype, rngs=rngs)
        self.d2t = nnx.Variable(jnp.zeros((config.draft_vocab_size,), jnp.int32))
        self.embed_tokens = nnx.Embed(model.vocab_size, model.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)

    def features(self, hidden: jax.Array) -> jax.Array:
        """The target forward's hidden states [T, target_hidden + 3 * target_hidden] (final, then the feature states)
        -> ``fc`` of the feature states [T, hidden]."""
        with matmul_precision(self.dtype):
            return self.fc(hidden[:, self.config.target_hidden_size:].astype(self.dtype))

    def __call__(self, input_ids: jax.Array, positions: jax.Array, hidden: jax.Array, kv_caches: list, attention):
        """input_ids int32[T] (the token after each position), positions int32[T], hidden [T, hidden] (``features``,
        or the head's own pre-norm output of the previous draft), kv_caches [its one layer's] -> (normed [T, hidden]
        for ``compute_logits``, pre-norm [T, hidden] for the next draft, kv_caches)."""
        with matmul_precision(self.dtype):
            layer = self.midlayer
            rope = rope_tables(self.config.model, positions)
            embeds = layer.input_layernorm(self.embed_tokens(input_ids))
            normed = layer.hidden_norm(hidden)
            residual = normed if self.config.norm_before_residual else hidden
            q, k, v = layer.self_attn.project(jnp.concatenate([embeds, normed], axis=-1))
            attn_out, kv_layer = layer.self_attn.attend(0, q, k, v, rope, kv_caches[0], attention)
            x, residual = layer.post_attention_layernorm(attn_out, residual)
            out, prenorm = self.norm(layer.mlp(x), residual)
            return out, prenorm, [kv_layer]

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """[N, hidden] -> float32[N, draft_vocab]."""
        with matmul_precision(self.dtype):
            return jnp.dot(hidden, self.lm_head.kernel[...], preferred_element_type=jnp.float32)

    def to_target_ids(self, draft_ids: jax.Array) -> jax.Array:
        """Draft-vocabulary ids -> target ids (``d2t``)."""
        return draft_ids + self.d2t[...][draft_ids]


# HF name -> (module path, transposed) of every tensor but the optional embedding and the ignored t2d.
def _hf_names(head: Eagle3Head) -> dict[str, tuple[tuple[str, ...], bool]]:
    names = {"fc.weight": (("fc", "kernel"), True), "norm.weight": (("norm", "scale"), False),
             "lm_head.weight": (("lm_head", "kernel"), True), "d2t": (("d2t",), False)}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        names[f"midlayer.{norm}.weight"] = (("midlayer", norm, "scale"), False)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        names[f"midlayer.self_attn.{proj}.weight"] = (("midlayer", "self_attn", proj, "kernel"), True)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        names[f"midlayer.mlp.{proj}.weight"] = (("midlayer", "mlp", proj, "kernel"), True)
    return names


def load_eagle3_head(path: str | Path, target: ModelConfig, *, dtype=jnp.bfloat16,
                     target_embedding: jax.Array | None = None) -> Eagle3Head:
    """The head at ``path`` (``config.json`` + safetensors, or a ``pytorch_model.bin``) for ``target``. Without
    ``embed_tokens.weight`` in the checkpoint the head uses ``target_embedding`` ([V, hidden], shared, not copied).
    ValueError naming the tensor for a missing, extra or misshapen one, or for a head of another target shape."""
    config = Eagle3Config.from_pretrained(path, target)
    if config.target_hidden_size != target.hidden_size or config.model.vocab_size != target.vocab_size:
        raise ValueError(f"EAGLE-3 head {path}: made for a target of hidden size {config.target_hidden_size} and "
                         f"vocabulary {config.model.vocab_size}, not {target.hidden_size} and {target.vocab_size}")
    layers = config.aux_hidden_layers
    if list(layers) != sorted(set(layers)) or layers[-1] >= target.num_hidden_layers or layers[0] < 1:
        raise ValueError(f"EAGLE-3 head {path}: feature layers {config.aux_hidden_layers} do not fit a target of "
                         f"{target.num_hidden_layers} layers")
    tensors = read_checkpoint_tensors(Path(path))
    head = nnx.eval_shape(lambda: Eagle3Head(config, dtype=dtype, rngs=nnx.Rngs(0)))
    load_head_tensors(head, tensors, _hf_names(head), f"EAGLE-3 head {path}", optional=("t2d", "embed_tokens.weight"))
    embedding = tensors.get("embed_tokens.weight")
    if embedding is None and target_embedding is None:
        raise ValueError(f"EAGLE-3 head {path} has no embed_tokens.weight: pass the target's embedding")
    head.embed_tokens.embedding.set_value(jnp.asarray(embedding, dtype) if embedding is not None
                                          else target_embedding)
    return head
