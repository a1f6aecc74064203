"""Model drafters on the device (vLLM's ``draft_model``, ``eagle``, ``eagle3`` and ``mtp`` methods): after each step's sampler,
one jitted program per step bucket computes every sequence's drafts for its next step, and they come back with the
step's tokens (``StepOutput.proposed_draft_ids``); the core hands them to the scheduler as ``Request.spec_token_ids``.

The drafter's KV lives in its own donated pool indexed by the target's block ids (same block tables, same slot
mapping; its shape is the drafter's: layers, KV heads, head size, a latent pool for MTP), so the scheduler and the KV-cache manager see one
pool. With mixed sliding-window layers (several KV-cache groups) it follows the full-attention group's tables and
slots, whose blocks keep every position. Each step's program:

1. applies the step's copy-on-write block copies to the drafter's pool too;
2. finds, per sequence, how many of the drafts it verified the target accepted (the same rule as the host's
   ``verify``: the longest prefix equal to the target's samples) and its next token x (the target's sample after
   the last accepted draft), at position ``kv_len - drafts + accepted``;
3. catches the drafter up on the step's tokens, at the target's positions and slots (prompt chunks included, so the
   drafter's KV always covers what the target's does). ``draft_model`` runs the draft model on them; a head
   (``eagle``: ``models.eagle.EagleHead``, on the target's final hidden states; ``eagle3``:
   ``models.eagle3.Eagle3Head``, on ``fc`` of its feature states; ``mtp``: ``models.mtp.MtpHead``, on the target's
   final hidden states) runs on the target's states there, each position
   with the token after it (x after the last accepted one, the next prompt token after a chunk that does not sample);
4. drafts greedily (argmax; the proposal is one-hot, which is what ``verify``'s rule is exact for): ``draft_model``
   feeds x, then each draft, k steps of one token per sequence; a head takes its first draft from step 3 at the
   last accepted position and feeds each draft with its own output (``eagle3``: pre-norm), k - 1 steps.
   Python-unrolled (no XLA loop), so every step bucket is one fixed-shape program, compiled at warm-up.

Under a tensor-parallel target the drafter runs on the target's mesh (``paged_jax.spec_decode.sharding``: its weights
in their shards, its pool split over its KV heads, its attention under ``shard_map``); the program takes and returns
the arrays in those shardings, so nothing leaves the devices between the sampler and the drafts' fetch.

KV written at rejected positions is harmless: the next step's catch-up writes those positions again with the
sequence's real tokens before any drafter read. The draft positions after x need their blocks: the scheduler
allocates ``num_speculative_tokens`` look-ahead slots per scheduled request (vLLM's ``num_lookahead_tokens``); a
sequence that does not propose (a chunk that does not sample, a fork row, padding) writes its draft steps into the
null block.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention_fn import ReusableAttention
from models.config import ModelConfig
from paged_jax.core.kv_groups import engine_kv_groups
from paged_jax.ops import write_and_attend
from paged_jax.spec_decode.config import MODEL_METHODS
from paged_jax.spec_decode.sharding import buffer_key
from paged_jax.worker.kv_group_pool import group_metadata, mixes_kv_groups
from paged_jax.worker.kv_pool_sizing import device_bytes
from paged_jax.worker.step_io import SPEC_ROW_WORDS, apply_block_copies


class DraftRunner:
    """A drafter network and its KV pool (module docstring).

    Args:
      method: "draft_model" (``model``: a ``LlamaForCausalLM`` with the target's vocabulary), "eagle" (``model``: a
        ``models.eagle.EagleHead``), "eagle3" (``model``: a ``models.eagle3.Eagle3Head``) or "mtp" (``model``: a
        ``models.mtp.MtpHead``).
      num_speculative_tokens: k, the drafts per sequence per step.
      config: the drafter's ``ModelConfig`` (the KV pool's shape: layers, KV heads, head sizes
        (``kv_pool_head_dims``), sliding window; its attention scale).
      aux_hidden_layers: eagle3: the target layers whose inputs feed ``fc`` (``ModelRunner.aux_hidden_layers``).
      shared: arrays of ``model`` that are the target's own (a head's embedding, LM head): not counted in
        ``weight_bytes``.
      plan: under a tensor-parallel target, the drafter's ``ShardingPlan`` on the target's mesh
        (``paged_jax.spec_decode.sharding.drafter_plan``; ``config`` is its ``model_config``, ``model``'s weights are
        in their shards); None on one device.
    """

    def __init__(self, method: str, num_speculative_tokens: int, model, config: ModelConfig, *,
                 aux_hidden_layers: tuple[int, ...] = (), shared: tuple = (), plan=None):
        if method not in MODEL_METHODS:
            raise ValueError(f"speculative_config.method {method!r} has no drafter network")
        self.method = method
        self.k = num_speculative_tokens
        self.config = config
        self.aux_hidden_layers = tuple(aux_hidden_layers) if method == "eagle3" else ()
        self.dtype = jnp.dtype(model.dtype)
        graphdef, state = nnx.split(model)
        leaves, self._treedef = jax.tree.flatten(state)
        self._graphdef, self._leaves = graphdef, leaves
        self.plan = plan
        own = [x for x in leaves if not any(x is a for a in shared)]
        # (one device's share: shards are even over the mesh)
        self._own_bytes = device_bytes(own, next(iter(own[0].devices()))) if own else 0
        self._pool: list | None = None
        self._propose = None

    @property
    def num_layers(self) -> int:
        """The drafter's KV layers (a head's config has its own layer count: one for EAGLE-3)."""
        return self.config.num_hidden_layers

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block of the drafter's pool takes on one device (for the KV pool's sizing)."""
        c = self.config if self.plan is None else self.plan.per_device_model_config
        return self.num_layers * block_size * c.num_key_value_heads * sum(c.kv_pool_head_dims) * self.dtype.itemsize

    def weight_bytes(self) -> int:
        """Bytes of the drafter's own weights on one device (not those it shares with the target)."""
        return self._own_bytes

    def bind(self, runner) -> None:
        """Attach to ``runner`` (a ``ModelRunner``, at the end of its construction): its device, buckets, block
        tables and step layout (and mesh). ValueError naming ``speculative_config`` for a runner this cannot
        serve."""
        plan = runner.sharding_plan
        self._kv_group = _full_attention_group(runner, self.method)
        if (plan is None) != (self.plan is None) or (plan is not None and plan.mesh != self.plan.mesh):
            raise ValueError(f"speculative_config.method={self.method!r}: the drafter was laid out for "
                             f"{'one device' if self.plan is None else 'another mesh'}, not the runner's")
        self.device = runner.device
        if self.plan is None:  # on a mesh the weights already are in their shards
            self._leaves = [jax.device_put(x, runner.device) for x in self._leaves]
        # Which of its leaves are the target's (a head's embedding, LM head): (own index, the runner's leaf index).
        target = {buffer_key(leaf): i for i, leaf in enumerate(runner.param_leaves)}
        self._target_leaves = [(j, target[buffer_key(x)]) for j, x in enumerate(self._leaves)
                               if buffer_key(x) in target]
        c = self.config
        self._num_blocks, self._block_size = runner.num_blocks, runner.block_size
        self._pool_shapes = [(runner.num_blocks, runner.block_size, c.num_key_value_heads, dim)
                             for dim in c.kv_pool_head_dims]
        statics = _StepStatics.of(runner, self.plan, self._kv_group)
        self._propose = jax.jit(functools.partial(_propose, self, statics), static_argnames=("num_tokens", "num_seqs"),
                                donate_argnums=(1,))

    def target_params_replaced(self, runner) -> None:
        """Take the target's new parameter leaves where it shares them (a weight update,
        ``paged_jax.worker.weight_update``: the same shapes, so nothing compiles)."""
        for own, target in self._target_leaves:
            self._leaves[own] = runner.param_leaves[target]

    @property
    def pool(self) -> list:
        """The drafter's KV pool: per layer ``(k_pages, v_pages)`` [num_blocks, block_size, Hkv, D] (a latent pool's
        V pages of width 0; zeros at first use)."""
        if self._pool is None:
            self._pool = (self.plan.make_kv_caches(self._num_blocks, self._block_size, self.dtype,
                                                   num_layers=self.num_layers) if self.plan is not None else
                          [tuple(jnp.zeros(shape, self.dtype, device=self.device) for shape in self._pool_shapes)
                           for _ in range(self.num_layers)])
        return self._pool

    def propose(self, sampled: jax.Array, hidden: jax.Array, buf: jax.Array, prev_tokens: jax.Array,
                num_tokens: int, num_seqs: int) -> jax.Array:
        """After a step's sampler: ``sampled`` int32[max sample rows] its tokens (sample-row order), ``hidden`` the
        forward's hidden states [T, hidden] (eagle3: then the target's feature states), ``buf`` the step buffer,
        ``prev_tokens`` int32[max sample rows] the previous step's samples (the tokens async scheduling's
        placeholders stand for: ``prev_rows``) -> int32[S, k] each packed sequence's drafts for its next step (-1
        rows: no proposal)."""
        self._pool, drafts = self._propose(self._leaves, self.pool, buf, prev_tokens, sampled,
                                           None if self.method == "draft_model" else hidden,
                                           num_tokens=num_tokens, num_seqs=num_seqs)
        return drafts

    def num_compiles(self) -> int:
        return 0 if self._propose is None else self._propose._cache_size()

    def warm_up(self, runner, buckets: Sequence[tuple[int, int]] | None = None) -> None:
        """Compile the program of every step bucket (or of ``buckets``): a padding-only step (every write into the
        null block)."""
        for num_tokens, num_seqs in runner.buckets if buckets is None else buckets:
            buf = np.zeros((runner.layout(num_tokens, num_seqs).size,), np.int32)
            a, b = runner.layout(num_tokens, num_seqs).fields["prev_rows"]
            buf[a:b] = -1
            _, _, hidden, _, inputs = runner.run_forward(buf, num_tokens, num_seqs)
            jax.block_until_ready(self.propose(runner._prev_tokens, hidden, *inputs))


def _full_attention_group(runner, method: str) -> tuple[int, int]:
    """(the runner's KV-cache groups G, the full-attention group whose block tables and slots the drafter's pool
    follows): with mixed sliding-window layers only that group's blocks keep every position's KV, as a drafter
    reads. ValueError naming ``speculative_config`` where no group does, or for eagle3 (the target's feature states
    are taken per layer, not through the groups' caches)."""
    groups = runner.kv_layout.num_groups
    if groups == 1:
        return 1, 0
    windows = [group.sliding_window for group in engine_kv_groups(
        runner.model_config.layer_kv_spans, mixed_groups=mixes_kv_groups(runner.sharding_plan))]
    if method == "eagle3" or None not in windows:
        raise ValueError(f"speculative_config.method={method!r} is not supported with this model's mixed "
                         f"sliding-window layers{' (EAGLE-3 feature states)' if method == 'eagle3' else ''}")
    return groups, windows.index(None)


class _StepStatics:
    """What the program takes from the runner: step layouts, block size, block-table width (all groups' entries),
    attention options, the drafter's plan on the runner's mesh (None: one device) and its KV-cache group (G, g)."""

    def __init__(self, layout_for, block_size: int, table_width: int, attention_impl: str, qk_prepare_impl: str,
                 plan=None, kv_group: tuple[int, int] = (1, 0)):
        self.layout_for, self.block_size, self.table_width = layout_for, block_size, table_width
        self.attention_impl, self.qk_prepare_impl, self.plan = attention_impl, qk_prepare_impl, plan
        self.kv_group, self.max_blocks = kv_group, table_width // kv_group[0]

    @classmethod
    def of(cls, runner, plan=None, kv_group: tuple[int, int] = (1, 0)) -> "_StepStatics":
        return cls(runner.layout, runner.block_size, runner.max_blocks_per_seq, runner.attention_impl,
                   runner.qk_prepare_impl, plan, kv_group)

    def step_tables(self, fields: dict, num_seqs: int) -> tuple[jax.Array, jax.Array]:
        """The drafter's (block tables int32[S, B], slot mapping int32[T]): its KV-cache group's."""
        block_tables = fields["block_tables"].reshape(num_seqs, self.table_width)
        num_groups, group = self.kv_group
        if num_groups == 1:
            return block_tables, fields["slot_mapping"]
        meta = group_metadata(num_groups, block_tables, fields["slot_mapping"])[group]
        return meta["block_tables"], meta["slot_mapping"]

    def attention(self, config: ModelConfig, meta: dict):
        """The drafter's paged attention over ``meta`` (slot mapping, lengths, block tables, cu_q_lens): on a mesh,
        each device's heads and KV shard under ``shard_map`` (the metadata as its explicit inputs)."""
        if self.plan is not None:
            return self.plan.paged_attention(**meta, sm_scale=config.softmax_scale,
                                             sliding_window=config.sliding_window, impl=self.attention_impl)
        fn = functools.partial(write_and_attend, sm_scale=config.softmax_scale, sliding_window=config.sliding_window,
                               impl=self.attention_impl, qk_prepare_impl=self.qk_prepare_impl)
        return ReusableAttention(fn, meta, fuses_qk_transform=True)


def _accepted(fields: dict, sampled: jax.Array, k: int, num_seqs: int):
    """Per sequence: (drafts verified n, accepted a, next token x, whether it proposes, block capacity), int32[S]
    each (bool for the flag), from the step buffer's fields and the sampler's tokens."""
    words = fields["spec_rows"].reshape(num_seqs, SPEC_ROW_WORDS)
    n, first, proposes, capacity = words[:, 0], words[:, 1], words[:, 3] > 0, words[:, 4]
    ends = fields["cu_q_lens"][1:]
    j = jnp.arange(k)
    input_ids = fields["input_ids"]
    drafts = input_ids[jnp.clip(ends[:, None] - n[:, None] + j, 0, input_ids.shape[0] - 1)]
    targets = sampled[jnp.clip(first[:, None] + j, 0, sampled.shape[0] - 1)]
    match = (j < n[:, None]) & (drafts == targets)
    accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
    after_last = jnp.take_along_axis(targets, jnp.minimum(accepted, k - 1)[:, None], axis=1)[:, 0]
    x = jnp.where(accepted < n, after_last, sampled[:num_seqs])
    return n, accepted, x, proposes, capacity


def _decode_meta(positions: jax.Array, ok: jax.Array, block_tables: jax.Array, statics: _StepStatics):
    """One token per sequence at ``positions`` int32[S]: (positions, attention metadata); rows not ``ok`` write into
    the null block and attend one slot."""
    bs, num_seqs = statics.block_size, positions.shape[0]
    block = jnp.clip(positions // bs, 0, statics.max_blocks - 1)
    slot = block_tables[jnp.arange(num_seqs), block] * bs + positions % bs
    positions = jnp.where(ok, positions, 0)
    meta = dict(slot_mapping=jnp.where(ok, slot, positions % bs), kv_lens=positions + 1, block_tables=block_tables,
                cu_q_lens=jnp.arange(num_seqs + 1, dtype=jnp.int32))
    return positions, meta


def _propose(drafter: DraftRunner, statics: _StepStatics, leaves, pool, buf, prev_tokens, sampled, hidden, *,
             num_tokens, num_seqs):
    """The jitted program (module docstring) -> (pool, drafts int32[S, k])."""
    fields = {name: buf[a:b] for name, (a, b) in statics.layout_for(num_tokens, num_seqs).fields.items()}
    prev_rows = fields["prev_rows"]  # placeholders: the forward's input tokens, as ``step_forward`` feeds them
    fields["input_ids"] = jnp.where(prev_rows >= 0, prev_tokens[jnp.maximum(prev_rows, 0)], fields["input_ids"])
    model = nnx.merge(drafter._graphdef, jax.tree.unflatten(drafter._treedef, leaves))
    pool = apply_block_copies(list(pool), fields["copy_src"], fields["copy_dst"])
    n, accepted, x, proposes, capacity = _accepted(fields, sampled, drafter.k, num_seqs)
    block_tables, slot_mapping = statics.step_tables(fields, num_seqs)
    step_meta = dict(slot_mapping=slot_mapping, kv_lens=fields["kv_lens"], block_tables=block_tables,
                     cu_q_lens=fields["cu_q_lens"])
    x_positions = fields["kv_lens"] - n + accepted
    step = (drafter, statics, model, fields, block_tables, step_meta, proposes, capacity)
    if drafter.method == "draft_model":
        pool, drafts = _draft_model_drafts(step, pool, x, x_positions)
    else:
        pool, drafts = _head_drafts(step, pool, hidden, n, accepted, x, x_positions)
    return pool, jnp.where(proposes[:, None], jnp.stack(drafts, axis=1), -1).astype(jnp.int32)


def _draft_model_drafts(step, pool, x, x_positions):
    drafter, statics, model, fields, block_tables, step_meta, proposes, capacity = step
    config = drafter.config
    _, pool = model(fields["input_ids"], fields["positions"], pool, statics.attention(config, step_meta))
    drafts, token = [], x
    for j in range(drafter.k):
        positions = x_positions + j
        positions, meta = _decode_meta(positions, proposes & (positions < capacity), block_tables, statics)
        hidden, pool = model(token, positions, pool, statics.attention(config, meta))
        token = jnp.argmax(model.compute_logits(hidden), axis=-1).astype(jnp.int32)
        drafts.append(token)
    return pool, drafts


def _head_drafts(step, pool, hidden, n, accepted, x, x_positions):
    """eagle / eagle3 / mtp: the head (``features``, ``__call__``, ``compute_logits``, ``to_target_ids``) caught up on the
    step's positions, then k - 1 one-token steps (module docstring)."""
    drafter, statics, head, fields, block_tables, step_meta, proposes, capacity = step
    config = drafter.config
    input_ids, cu = fields["input_ids"], fields["cu_q_lens"]
    num_tokens, num_seqs = input_ids.shape[0], n.shape[0]
    # Each position's input is the token after it: the step's next token within the kept ones, then x (or, after a
    # chunk that does not sample, the next prompt token); positions past the kept ones are rewritten next step.
    index = jnp.arange(num_tokens)
    seq = jnp.clip(jnp.searchsorted(cu[1:], index, side="right"), 0, num_seqs - 1)
    kept_end = cu[1:] - n + accepted  # one past the last kept token of each sequence
    after = jnp.where(proposes, x, fields["spec_rows"].reshape(num_seqs, SPEC_ROW_WORDS)[:, 2])
    following = jnp.where(index + 1 < kept_end[seq], input_ids[jnp.minimum(index + 1, num_tokens - 1)], after[seq])
    out, state, pool = head(following, fields["positions"], head.features(hidden), pool,
                            statics.attention(config, step_meta))
    last = jnp.clip(kept_end - 1, 0, num_tokens - 1)
    token = head.to_target_ids(jnp.argmax(head.compute_logits(out[last]), axis=-1)).astype(jnp.int32)
    drafts, state = [token], state[last]
    for j in range(1, drafter.k):
        positions = x_positions + j - 1
        positions, meta = _decode_meta(positions, proposes & (positions < capacity), block_tables, statics)
        out, state, pool = head(token, positions, state, pool, statics.attention(config, meta))
        token = head.to_target_ids(jnp.argmax(head.compute_logits(out), axis=-1)).astype(jnp.int32)
        drafts.append(token)
    return pool, drafts
