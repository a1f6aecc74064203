"""EAGLE draft heads (vLLM's ``eagle`` speculative method; Li et al., "EAGLE", 2024: the EAGLE-1 and EAGLE-2 heads
share this layout) as published (e.g. ``yuhuili/EAGLE-LLaMA3.1-Instruct-8B``; vLLM's ``EagleLlamaForCausalLM``),
and the checkpoint reading that the EAGLE-3 heads (``models.eagle3``) share.

The head is a Llama decoder stack (one layer in the published heads) on the target: position p's input is
``fc(concat(embed(token at p + 1), h_p))`` ([T, 2 * hidden] -> [T, hidden], the embedding first), ``h_p`` the target's
final hidden state at p (after its final norm: what its LM head reads). The first layer has no ``input_layernorm``
(its attention reads fc's output, which also starts the residual stream); later layers are Llama's. The output (the
last layer's ``x + residual``, no final norm) goes through the target's LM head, and is the next draft's ``h``
(``EagleHead.__call__`` returns it twice, as ``Eagle3Head`` returns its normed and pre-norm outputs). Embedding and
LM head are the target's, shared (vLLM's choice too): a checkpoint's own copies must have the target's shape.

Tensor names (safetensors, or a ``pytorch_model.bin`` as the EAGLE repository publishes them): ``fc.weight``
[hidden, 2 * hidden], ``fc.bias`` [hidden] (when the config's ``bias`` (EAGLE's key) or ``eagle_fc_bias`` (vLLM's)
says so; with neither, when the checkpoint has it), ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.post_attention_layernorm.weight``,
``layers.{i}.input_layernorm.weight`` for i >= 1; optionally ``embed_tokens.weight`` and ``lm_head.weight`` (not
used) and ``layers.0.input_layernorm.weight`` (not used: EAGLE's first layer has none; vLLM skips it too). Linear
weights [out, in] as torch's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.llama import DecoderLayer, _linear, matmul_precision, run_decoder_layers, scale_logits
from models.loader import hf_name_for, read_checkpoint_tensors
from models.qk_transform import rope_tables

# vLLM renames a Llama head's architecture to EagleLlamaForCausalLM; the published configs say LlamaForCausalLM.
EAGLE_ARCHITECTURES = ("LlamaForCausalLM", "EagleLlamaForCausalLM", "LlamaForCausalLMEagle")
# Tensors a head may ship that it takes from the target (checked against the target's shape), or has no use for.
_SHARED = ("embed_tokens.weight", "lm_head.weight")
_UNUSED = ("layers.0.input_layernorm.weight",)


def read_head_config(path: str | Path, what: str, architectures: tuple[str, ...]) -> dict:
    """``<path>/config.json`` of a draft head (``what``: "EAGLE head", "EAGLE-3 head") whose first architecture is one
    of ``architectures``; FileNotFoundError / ValueError naming the file otherwise."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{what} config not found: {config_path}")
    hf = json.loads(config_path.read_text())
    architecture = (hf.get("architectures") or ["?"])[0]
    if architecture not in architectures:
        raise ValueError(f"{config_path}: architecture {architecture!r} is not an {what} (one of "
                         f"{', '.join(architectures)})")
    return hf


def load_head_tensors(head: nnx.Module, tensors: dict[str, np.ndarray], names: dict[str, tuple[tuple, bool]],
                      what: str, *, optional: tuple[str, ...] = ()) -> None:
    """Set ``head``'s parameters from a checkpoint's ``tensors`` (``read_checkpoint_tensors``): ``names`` maps each
    tensor name to (parameter path, whether the parameter is its transpose); ``optional`` tensors may be there too
    (the caller's to use or check). ValueError naming ``what`` (the head and its path) and the tensor for a missing,
    unexpected or misshapen one."""
    unknown = sorted(set(tensors) - set(names) - set(optional))
    missing = sorted(set(names) - set(tensors))
    if unknown or missing:
        raise ValueError(f"{what}: missing tensors {missing}, unexpected tensors {unknown}")
    for name, (param_path, transposed) in names.items():
        variable = variable_at(head, param_path)
        expected = variable.get_value().shape
        array = tensors[name].T if transposed else tensors[name]
        if array.shape != expected:
            raise ValueError(f"{what}: tensor {name!r} has shape {tensors[name].shape}, expected "
                             f"{expected[::-1] if transposed else expected}")
        variable.set_value(jnp.asarray(array, variable.get_value().dtype))


def variable_at(module: nnx.Module, path: tuple) -> nnx.Variable:
    """The variable of ``module`` at a flat-state ``path`` (attribute names, list indices)."""
    for name in path:
        module = module[name] if isinstance(name, int) else getattr(module, name)
    return module


def save_head_checkpoint(head_tensors: dict[str, np.ndarray], hf_config: dict, out_dir: str | Path) -> Path:
    """Write a draft head checkpoint (``config.json`` + ``model.safetensors``) in the published layout."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config, indent=1))
    save_file({name: np.ascontiguousarray(t) for name, t in head_tensors.items()}, str(out / "model.safetensors"))
    return out


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """An EAGLE head's shape: ``model`` (its layers' ``ModelConfig``: hidden size, heads, MLP, rope, layer count,
    the target's vocabulary ``vocab_size``) and ``fc_bias`` (None: as the checkpoint has it)."""

    model: ModelConfig
    fc_bias: bool | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "EagleConfig":
        """Read ``<path>/config.json``; ValueError naming what this engine does not run."""
        hf = read_head_config(path, "EAGLE head", EAGLE_ARCHITECTURES)
        if hf.get("add_para_norm"):
            raise ValueError(f"EAGLE head {path}: add_para_norm (HASS heads' embedding and hidden-state norms) is "
                             "not supported")
        model = ModelConfig.from_hf_config({**hf, "architectures": ["LlamaForCausalLM"]})
        bias = hf.get("eagle_fc_bias", hf.get("bias"))
        return cls(model=model, fc_bias=None if bias is None else bool(bias))

    def check_target(self, target: ModelConfig, path) -> None:
        """ValueError naming ``hidden_size`` / ``vocab_size`` for a head made for another target shape."""
        for field in ("hidden_size", "vocab_size"):
            own, wanted = getattr(self.model, field), getattr(target, field)
            if own != wanted:
                raise ValueError(f"speculative_config.model {str(path)!r}: the EAGLE head's {field} is {own}, the "
                                 f"target's is {wanted}")


class EagleHead(nnx.Module):
    """An EAGLE head (module docstring) for the target of ``target`` (its logit scaling is applied to the head's
    logits, as the target's LM head does). ``fc_bias``: whether ``fc`` has a bias (``EagleConfig.fc_bias``,
    resolved)."""

    def __init__(self, config: EagleConfig, target: ModelConfig, *, fc_bias: bool, dtype=jnp.bfloat16,
                 rngs: nnx.Rngs):
        model = config.model
        self.config, self.target, self.dtype = config, target, dtype
        self.fc = _linear(2 * model.hidden_size, model.hidden_size, use_bias=fc_bias, dtype=dtype, param_dtype=dtype,
                          rngs=rngs)
        self.layers = nnx.List([DecoderLayer(model, i, dtype=dtype, param_dtype=dtype, rngs=rngs)
                                for i in range(model.num_hidden_layers)])
        self.layers[0].input_layernorm = nnx.data(None)
        self.embed_tokens = nnx.Embed(model.vocab_size, model.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        # The target's LM head kernel [hidden, vocab], or None for a target that ties it to the embedding.
        self.lm_head = nnx.data(None if target.tie_word_embeddings else
                                nnx.Param(jnp.zeros((model.hidden_size, model.vocab_size), dtype)))

    def features(self, hidden: jax.Array) -> jax.Array:
        """The target forward's hidden states [T, hidden (+ feature states)] -> the head's ``hidden`` input."""
        return hidden[:, :self.target.hidden_size]

    def __call__(self, input_ids: jax.Array, positions: jax.Array, hidden: jax.Array, kv_caches: list, attention):
        """input_ids int32[T] (the token after each position), positions int32[T], hidden [T, hidden] (the target's,
        or the head's own output of the previous draft), kv_caches per layer -> (out [T, hidden] for
        ``compute_logits``, the same for the next draft, kv_caches)."""
        with matmul_precision(self.dtype):
            x = self.fc(jnp.concatenate([self.embed_tokens(input_ids), hidden.astype(self.dtype)], axis=-1))
            rope = rope_tables(self.config.model, positions)
            first = self.layers[0]
            attn_out, kv_first = first.self_attn(0, x, rope, kv_caches[0], attention)
            normed, residual = first.post_attention_layernorm(attn_out, x)
            x, residual, kv_rest = run_decoder_layers(list(self.layers)[1:], first.mlp(normed), residual, rope,
                                                      list(kv_caches[1:]), attention, first_layer_idx=1)
            out = x + residual
            return out, out, [kv_first, *kv_rest]

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """[N, hidden] -> float32[N, vocab] through the target's LM head (tied: its embedding)."""
        weight = self.embed_tokens.embedding[...].T if self.lm_head is None else self.lm_head[...]
        with matmul_precision(self.dtype):
            logits = jnp.dot(hidden.astype(self.dtype), weight.astype(self.dtype), preferred_element_type=jnp.float32)
        return scale_logits(self.target, logits)

    def to_target_ids(self, draft_ids: jax.Array) -> jax.Array:
        """The head drafts over the target's vocabulary: ids unchanged."""
        return draft_ids


def _hf_names(head: EagleHead) -> dict[str, tuple[tuple, bool]]:
    """HF name -> (parameter path, transposed) of the head's own parameters (not the shared embedding / LM head)."""
    names = {}
    for path, _ in nnx.to_flat_state(nnx.state(head, nnx.Param)):
        if path[0] not in ("embed_tokens", "lm_head"):
            names[hf_name_for(path)[0]] = (tuple(path), hf_name_for(path)[1])
    return names


def load_eagle_head(path: str | Path, target: ModelConfig, *, target_embedding: jax.Array,
                    target_lm_head: jax.Array | None, dtype=jnp.bfloat16) -> EagleHead:
    """The head at ``path`` (``config.json`` + safetensors or ``pytorch_model.bin``) for ``target``, sharing (not
    copying) the target's ``target_embedding`` [vocab, hidden] and ``target_lm_head`` kernel [hidden, vocab] (None:
    tied to the embedding).
    ValueError naming the field for a head of another target shape, the tensor for a missing, extra or misshapen
    one."""
    config = EagleConfig.from_pretrained(path)
    config.check_target(target, path)
    tensors = read_checkpoint_tensors(Path(path))
    fc_bias = "fc.bias" in tensors if config.fc_bias is None else config.fc_bias  # neither key: as shipped
    head = nnx.eval_shape(lambda: EagleHead(config, target, fc_bias=fc_bias, dtype=dtype, rngs=nnx.Rngs(0)))
    load_head_tensors(head, tensors, _hf_names(head), f"EAGLE head {path}", optional=_SHARED + _UNUSED)
    for name in _SHARED:
        if name in tensors and tuple(tensors[name].shape) != (target.vocab_size, target.hidden_size):
            raise ValueError(f"EAGLE head {path}: tensor {name!r} has shape {tensors[name].shape}, the target's is "
                             f"{(target.vocab_size, target.hidden_size)}")
    head.embed_tokens.embedding.set_value(target_embedding)
    if head.lm_head is not None:
        if target_lm_head is None:
            raise ValueError(f"EAGLE head {path}: the target has no LM head of its own to share")
        head.lm_head.set_value(target_lm_head)
    return head
