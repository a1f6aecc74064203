"""How a runner's step runs the model: a ``StepForward`` strategy, injected into ``ModelRunner`` (its ``forward``
argument), builds the step's jitted forward and prompt-logprob functions from the runner's model parts.

``SingleProgramForward`` (the default) runs the whole model as one program per bucket, on one device or under a
tensor-parallel ``ShardingPlan`` (attention per device under ``shard_map``). Pipeline parallelism supplies its own
strategy (``paged_jax.parallel.pipeline.PipelineForward``: stage by stage, micro-batches overlapping). Everything
else of the step (packing, the sampler, dispatch, warm-up) is the runner's and the same for every strategy.

The functions a strategy builds keep ``ModelRunner``'s contracts:

* ``forward(param_leaves, kv_pool, buf, prev_tokens, lora_arrays=None, *, num_tokens, num_seqs) -> (kv_pool,
  logits f32[R, V] at each row's last token (a pooling forward: each row's pooled outputs f32[R, W],
  ``paged_jax.pooling``), sampling words int32[R * words], final hidden states [T, hidden]; with an EAGLE-3 drafter
  (``runner.aux_hidden_layers``) [T, hidden + 3 * hidden]: the drafter's target features after them)``,
  the KV pool donated; ``buf`` the int32 step buffer of the bucket's ``StepLayout``. With the runner's
  ``moe_outputs`` on, a fifth output: their dict (``paged_jax.worker.moe_outputs``).
* ``prompt_logprobs(param_leaves, hidden [T, hidden], targets int32[T]) -> (logprob f32[T], rank i32[T], top ids
  i32[T, K], top logprobs f32[T, K])``.

Both have ``_cache_size()`` (compiles counted by ``ModelRunner.num_compiles``); ``AheadOfTimeFunction``s are
compiled (or loaded) by warm-up ahead of time.
"""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from models.llama import ReusableAttention
from paged_jax.ops import write_and_attend
from paged_jax.worker.executable_cache import AheadOfTimeFunction
from paged_jax.worker.kv_group_pool import GroupedKVCaches, group_metadata
from paged_jax.worker.moe_outputs import device_outputs, inline_attention
from paged_jax.worker.prompt_logprobs import prompt_logprobs_on_device
from paged_jax.worker.step_io import apply_block_copies


class StepForward(Protocol):
    """Builds a runner's step functions (see the module docstring) once, at the runner's construction."""

    def build(self, runner) -> tuple:
        """``(forward, prompt_logprobs)`` for ``runner`` (a ``ModelRunner`` whose model parts, layout, buckets and
        configuration are set)."""
        ...


class SingleProgramForward:
    """The model as one jitted program per bucket (one device, or tensor parallel under the runner's plan).

    ``row_outputs(model, hidden [T, hidden], fields) -> f32[R, ...]``: what the forward gives per sampler row in place
    of the logits at each row's last token (``paged_jax.pooling``: pooled hidden states through the model's head);
    ``pools``: the step then ends there (no sampler)."""

    pools = False

    def __init__(self, row_outputs=None):
        self.row_outputs = row_outputs

    def build(self, runner) -> tuple:
        forward = AheadOfTimeFunction(
            "forward", jax.jit(_single_program_forward(runner, self.row_outputs),
                               static_argnames=("num_tokens", "num_seqs"),
                               donate_argnums=(1,), compiler_options=runner.compiler_options or None))
        graphdef, state_treedef, max_logprobs = runner._graphdef, runner._state_treedef, runner.max_logprobs
        batch_invariant = runner.batch_invariant

        width = runner.model_config.hidden_size

        def prompt_logprobs(param_leaves, hidden, targets):
            model = nnx.merge(graphdef, jax.tree.unflatten(state_treedef, param_leaves))
            return prompt_logprobs_on_device(model.compute_logits, hidden[:, :width], targets,
                                             num_logprobs=max_logprobs, batch_invariant=batch_invariant)

        return forward, AheadOfTimeFunction("prompt_logprobs", jax.jit(prompt_logprobs), shape_args=(2,))


def _last_token_logits(model, hidden, fields):
    """f32[R, V]: the logits at each row's last token of the step."""
    return model.compute_logits(hidden[fields["logits_indices"]])


def _single_program_forward(runner, row_outputs=None):
    """The forward ``SingleProgramForward`` jits (traced per bucket), closing over the runner's configuration."""
    row_outputs = row_outputs or _last_token_logits
    graphdef, state_treedef = runner._graphdef, runner._state_treedef
    config = runner.model_config
    sm_scale = config.head_dim ** -0.5
    sliding_window = config.sliding_window
    impl, qk_prepare_impl = runner.attention_impl, runner.qk_prepare_impl
    max_blocks = runner.max_blocks_per_seq
    layout_for = runner.layout
    plan = runner.sharding_plan
    lora_slots = runner.lora_slots
    kv_layout = runner.kv_layout
    batch_invariant = runner.batch_invariant
    moe_outputs = runner.moe_outputs
    aux_layers = runner.aux_hidden_layers

    def forward(param_leaves, kv_pool, buf, prev_tokens, lora_arrays=None, *, num_tokens, num_seqs):
        fields = {name: buf[a:b] for name, (a, b) in layout_for(num_tokens, num_seqs).fields.items()}
        prev_rows = fields["prev_rows"]
        # Decode rows continuing from the previous step take their input token from its on-device samples.
        input_ids = jnp.where(prev_rows >= 0, prev_tokens[jnp.maximum(prev_rows, 0)], fields["input_ids"])
        slot_mapping = fields["slot_mapping"]
        cu_q_lens = fields["cu_q_lens"]
        kv_lens = fields["kv_lens"]
        block_tables = fields["block_tables"].reshape(num_seqs, max_blocks)

        grouped = kv_layout.num_groups > 1
        if grouped:  # each layer attends through its group's table and slots (worker.kv_group_pool)
            group_meta = group_metadata(kv_layout.num_groups, block_tables, slot_mapping)
            block_tables, slot_mapping = group_meta[0]["block_tables"], group_meta[0]["slot_mapping"]
        if plan is None:  # one layer trace shared by every layer (models.llama.ReusableAttention)
            attention = ReusableAttention(
                functools.partial(write_and_attend, sm_scale=sm_scale, sliding_window=sliding_window, impl=impl,
                                  qk_prepare_impl=qk_prepare_impl, batch_invariant=batch_invariant),
                dict(slot_mapping=slot_mapping, kv_lens=kv_lens, block_tables=block_tables, cu_q_lens=cu_q_lens),
                fuses_qk_transform=True)  # q/k norm + RoPE + KV write: one kernel on a GPU (ops.qk_prepare)
            if moe_outputs.any:  # the layers record their routing: traced inline, not apart
                attention = inline_attention(attention)
        else:  # the same per device on its heads and KV shard (shard_map over tp)
            attention = plan.paged_attention(slot_mapping=slot_mapping, kv_lens=kv_lens, block_tables=block_tables,
                                             cu_q_lens=cu_q_lens, sm_scale=sm_scale, sliding_window=sliding_window,
                                             impl=impl)

        kv_pool = apply_block_copies(list(kv_pool), fields["copy_src"], fields["copy_dst"],  # before K/V writes
                                     impl="auto" if plan is None else "xla")  # one kernel on one GPU
        kv_caches = GroupedKVCaches(kv_pool, kv_layout, group_meta) if grouped else kv_pool
        model = nnx.merge(graphdef, jax.tree.unflatten(state_treedef, param_leaves))
        lora = None if lora_arrays is None else lora_slots.layers(lora_arrays, fields["lora_slot_ids"])
        if aux_layers:  # an EAGLE-3 drafter reads these target states: they travel after the final ones
            hidden, kv_caches, aux = model(input_ids, fields["positions"], kv_caches, attention, lora,
                                           aux_hidden_layers=aux_layers)
            states = jnp.concatenate([hidden, aux.astype(hidden.dtype)], axis=-1)
        else:
            hidden, kv_caches = model(input_ids, fields["positions"], kv_caches, attention, lora)
            states = hidden
        kv_pool = kv_caches.pool if grouped else kv_caches
        outputs = (kv_pool, row_outputs(model, hidden, fields), fields["sampling"], states)
        if moe_outputs.any:
            outputs += (device_outputs(model, moe_outputs, cu_q_lens[-1], config.moe.num_experts),)
        return outputs

    return forward
