"""dtype=float32 means full-precision matmuls (JAX's GPU default for float32 is TF32): checked on the traced program."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from models.attention import dense_causal_attention
from models.config import ModelConfig
from models.llama import LlamaForCausalLM
from models.testing import tiny_config


def _dot_precisions(dtype):
    config = ModelConfig.from_hf_config(tiny_config("llama"))
    model = LlamaForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0))
    tokens = jnp.arange(5, dtype=jnp.int32)
    attention = dense_causal_attention(jnp.zeros(5, jnp.int32), config.head_dim ** -0.5)

    def forward(tokens):
        hidden, _ = model(tokens, tokens, None, attention)
        return model.compute_logits(hidden)

    # Nested jaxprs (pjit) hold the layer matmuls: walk them too.
    precisions, stack = [], list(jax.make_jaxpr(forward)(tokens).jaxpr.eqns)
    while stack:
        eqn = stack.pop()
        if eqn.primitive.name == "dot_general":
            precisions.append(eqn.params["precision"])
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", None)
            if inner is not None:
                stack.extend(getattr(inner, "eqns", []))
    return precisions


def test_float32_model_traces_every_matmul_at_highest_precision():
    precisions = _dot_precisions(jnp.float32)
    assert len(precisions) >= 7  # q, k, v, o, gate, up, down, attention, LM head
    highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    assert all(p == highest for p in precisions), precisions


@pytest.mark.parametrize("dtype", [jnp.bfloat16])
def test_half_precision_model_keeps_default_precision(dtype):
    precisions = _dot_precisions(dtype)
    assert precisions and all(p is None for p in precisions), precisions
