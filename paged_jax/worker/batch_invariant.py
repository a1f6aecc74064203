"""Batch-invariant mode (``EngineArgs.batch_invariant``, ``--batch-invariant``, vLLM's ``VLLM_BATCH_INVARIANT=1``): a
request's tokens and logprobs are the same bits whatever else runs in its steps: alone or among many others, in any
bucket, its prompt in one step or in chunks, after a prefix-cache hit or a preemption.

A token's numbers are computed only from its own row in every op, in an order that depends on the model's shapes
alone, never on the step's:

* every matmul over the token dimension (the projections, ``nnx.Linear.dot_general``, and the LM head,
  ``LlamaForCausalLM.logits_dot_general``) is ``paged_jax.ops.batch_invariant``'s matmul: fixed row chunks through
  XLA's own dot, each chunk one program of one shape;
* attention (``ragged_paged_attention(batch_invariant=True)``): each query token's softmax and sums run over its
  own keys in fixed ``block_k`` blocks from position 0, in one program (no split-KV, whose split count a library
  picks by the batch), with query tiles of a fixed row count, whether the token is decoded or prefilled, in one
  chunk or another; on the CPU the jnp reference in fixed token chunks;
* the decoder norms run as ``rms_norm_impl="batch_invariant"`` (one program per row on a GPU, fixed row tiles on the
  CPU, whose XLA emits a fused row reduction differently by the row count);
* the q/k transform and embeddings are elementwise or gathers; the sampler's argmax is exact, its logprobs'
  normalizer runs in the matmul's row chunks (``raw_logprob_outputs(batch_invariant=True)``, also for prompt
  logprobs); sampling noise is keyed by each request's seed and step.

``generate`` and ``score_tokens`` with ``batch_invariant=True`` run the model as the engine does
(``engine_batch_invariant``), so a trainer's logprobs are the engine's bits.

Not covered, and refused at start-up with a ValueError naming ``batch_invariant``: quantized weights (their kernels
pick tiles by the row count), LoRA (its low-rank matmuls), sparse mixture-of-experts layers (tokens grouped by
expert across the batch), models on several devices (tensor / pipeline parallel) and classifier heads (the engine
settings by ``EngineArgs``, the model's layers here).
"""

from __future__ import annotations

from flax import nnx

from models.llama import fuse_projections, set_rms_norm_impl
from paged_jax.ops.batch_invariant import batch_invariant_dot_general


def make_batch_invariant(model: nnx.Module) -> nnx.Module:
    """In place, before tracing: every ``nnx.Linear`` of ``model`` and its LM head multiply through the
    batch-invariant matmul, its norms run as ``rms_norm_impl="batch_invariant"``. ValueError naming ``batch_invariant`` for a model
    with other matmul layers (quantized projections, sparse MoE experts, a classifier head). Returns ``model``."""
    config = getattr(model, "config", None)
    if config is not None and config.moe is not None:
        raise ValueError("batch_invariant is not supported for mixture-of-experts models: their grouped matmuls "
                         "sort tokens by expert across the batch")
    if config is not None and config.head == "score":
        raise ValueError("batch_invariant is not supported for classifier heads (head='score')")
    if not hasattr(model, "logits_dot_general"):
        raise ValueError(f"batch_invariant is not supported for {type(model).__name__}")
    for path, node in nnx.iter_graph(model):
        if type(node) is nnx.Linear:
            node.dot_general = batch_invariant_dot_general
        elif isinstance(node, nnx.Module) and type(node).__name__.endswith("Linear"):
            raise ValueError(f"batch_invariant is not supported for {type(node).__name__} layers "
                             f"({'.'.join(map(str, path))}): quantized matmuls are not batch invariant")
    model.logits_dot_general = batch_invariant_dot_general
    set_rms_norm_impl(model, "batch_invariant")
    return model


def engine_batch_invariant(model: nnx.Module) -> nnx.Module:
    """In place: ``model`` (the checkpoint's layout or the engine's) as the engine runs it in this mode: q/k/v and
    gate/up fused (``models.llama.fuse_projections``, the engine's matmul shapes: a column's bits follow its matmul's
    shape) and ``make_batch_invariant``. What ``generate`` and ``score_tokens`` run with ``batch_invariant=True``, so
    that their tokens and logprobs are the engine's bits. Returns ``model``."""
    return make_batch_invariant(fuse_projections(model))
