"""The model runner: owns the device KV pool and runs one bucketed, jitted, fixed-shape step per engine step.

A step's ragged batch (decodes first, then prefill chunks) is padded to one of a small fixed set of
``(num_tokens, num_seqs)`` buckets. Every bucket is compiled once at start-up (``warm_up``) and never again; a compile
after warm-up is a bug and shows up in ``num_compiles_since_warmup``.

Per step the host builds ONE int32 numpy buffer holding all step metadata (token ids, positions, slot mapping,
cu_q_lens, kv_lens, block tables, logits indices and the per-row sampling words, ``sampler.pack_sampling_tensors``)
and sends it with one ``jax.device_put`` (plus the penalty token history and the bias table, each only on steps
that have a row using it); the jitted step unpacks it by static slicing. Two jitted functions run per step,
dispatched back to back without a host sync:

* ``_forward`` (compiled per token/seq bucket): model forward with paged attention (``write_kv`` then
  ``ragged_paged_attention``), KV pool donated, logits computed only at the sampled positions -> ``f32[R, V]``, R =
  ``sampler_rows_for(S)`` >= S (a coarser set of row counts, so fewer sampler executables).
* ``_sample`` (compiled per sampler row count R x ``SamplerVariant``): on-device sampling -> token ids padded to the
  widest seq bucket (kept on device: the next step may take its decode inputs from them) and logprobs.

A third, ``_prompt_logprobs`` (compiled per token bucket T), runs only on steps where some chunk asked for prompt
logprobs (``paged_jax.prompt_logprobs``): it takes the forward's hidden states of all T tokens (the forward always
returns them; other steps drop them unread) and that step's prompt-logprob targets, a second small transfer.

Splitting the sampler from the forward keeps compile counts additive (buckets + seq buckets x modes) instead of
multiplicative.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.llama import ReusableAttention
from models.quantization import compiler_options
from paged_jax import sampler as sampler_lib
from paged_jax import warm_up as warm_up_lib
from paged_jax.executable_cache import AheadOfTimeFunction
from paged_jax.buckets import MAX_SWAP_CHUNK, make_buckets, pick_bucket, sampler_rows_for, swap_sizes_for
from paged_jax.prompt_logprobs import pack_prompt_logprob_targets, prompt_logprobs_on_device
from paged_jax.step_dispatch import StepDispatchMixin, DeferredSampling
from paged_jax.step_io import (PendingStep, SamplerVariant, SeqInput, StepLayout, apply_block_copies,
                               pack_block_copies, point_fork_rows)
from paged_jax.ops import write_and_attend
from paged_jax.ops.qk_prepare import check_qk_prepare_impl
from paged_jax.parallel import ShardingPlan
from paged_jax.sampling_params import MAX_LOGPROBS

logger = logging.getLogger(__name__)

NULL_BLOCK_ID = 0


# ----------------------------------------------------------------------------------------------------------------
# The runner
# ----------------------------------------------------------------------------------------------------------------

class ModelRunner(StepDispatchMixin):
    """Runs the model on paged KV for a stream of ragged steps.

    Args:
      model: ``LlamaForCausalLM`` (weights already on ``device``).
      model_config: its ``ModelConfig``.
      num_blocks: device KV blocks including the null block 0 (see ``determine_num_blocks``).
      block_size: tokens per block.
      max_model_len: most tokens per sequence (sets the block-table width and the penalty-history width).
      max_num_seqs / max_num_batched_tokens: the largest step (sets the buckets).
      num_host_blocks: host swap pool blocks (0: no swapping).
      eos_token_ids: banned (with stop_token_ids) while a row is below its min_tokens.
      attention_impl: one of ``paged_jax.attention_impl.ATTENTION_IMPLS``, passed to ``ragged_paged_attention``.
      buckets: override of ``make_buckets(...)`` (list of (num_tokens, num_seqs)).
      max_logprobs: the top-logprob width of the compiled logprob variants (requests may ask for up to this many).
      device: where the pool lives (default ``jax.devices()[0]``); ignored with ``sharding_plan``.
      sharding_plan: the ``paged_jax.parallel.ShardingPlan`` (dp = 1) a tensor-parallel ``model`` was built for
        (``models.tensor_parallel``), or None for a single-device model. With a plan the weights stay in their
        shards, host inputs go to every device of its mesh (replicated), the KV pool is split over kv heads and
        attention runs per device under ``shard_map``.
      dispatch_thread: dispatch each step (the host->device copy of its buffer and the two jitted calls) on a
        worker thread instead of the caller's. Dispatching a step means launching a few hundred kernels, which takes
        the host milliseconds with the GIL released; on the worker it overlaps the caller's Python work for the next
        step (the engine's async scheduling). Steps still run in the order ``execute`` was called: every use of
        the KV pool and of the previous step's tokens goes through the one worker.
      lora_slots: ``paged_jax.lora.slots.LoRASlots`` (multi-LoRA; a step argument, written by ``write_lora_slot``).
    """

    def __init__(self, model, model_config: ModelConfig, *, num_blocks: int, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, num_host_blocks: int = 0,
                 eos_token_ids: Sequence[int] = (), attention_impl: str = "auto",
                 buckets: Sequence[tuple[int, int]] | None = None, max_logprobs: int | None = None,
                 device: jax.Device | None = None, sharding_plan: ShardingPlan | None = None,
                 dispatch_thread: bool = False, kv_cache_dtype=None, lora_slots=None, qk_prepare_impl: str = "auto"):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.model_config = model_config
        self.sharding_plan = sharding_plan
        self.lora_slots = lora_slots
        self.device = self.sharding_plan.replicated if self.sharding_plan else (device or jax.devices()[0])
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.attention_impl = attention_impl
        self.qk_prepare_impl = check_qk_prepare_impl(qk_prepare_impl)  # paged_jax.ops.qk_prepare (benchmarks' A/B)
        if sharding_plan is not None and qk_prepare_impl != "auto":
            # Sharded steps attend under shard_map with the model applying q/k norm + RoPE itself (XLA).
            raise ValueError(f"qk_prepare_impl={qk_prepare_impl!r} applies to one device; a sharding plan (tensor or "
                             "pipeline parallel) runs the q/k transform in XLA: leave qk_prepare_impl='auto'")
        self.buckets = sorted(buckets) if buckets is not None else make_buckets(max_num_batched_tokens, max_num_seqs)
        self.seq_buckets = sorted({s for _, s in self.buckets})
        # The sampler runs on a coarser set of row counts than the forward's seq buckets (fewer compiles).
        self.sampler_seq_buckets = sorted({sampler_rows_for(s, self.seq_buckets[-1]) for s in self.seq_buckets})
        self.max_logprobs = MAX_LOGPROBS if max_logprobs is None else int(max_logprobs)
        # Every mode has a lean variant without top-k logprobs (the common case: nobody asked for alternatives) and
        # the random modes also one with the top max_logprobs, paid only on steps where some row asked for it. A
        # greedy step that wants top logprobs runs the greedy_or_temperature variant (all rows greedy: the same
        # argmax). The top_k mode is top-k / top-p without a sort of the vocabulary, for the steps whose rows allow
        # it (Qwen3's generation config, for one). Full mode always takes the bias table, and once more with the
        # penalty history; each is sent only on steps that need it. A full step without a bias-table row gets a
        # neutral table (``_run_sampling``; one bit per vocabulary entry and row, plus the logit_bias slots: a mask
        # pass over rows x vocabulary, next to the sort such a step runs anyway): two executables fewer per row
        # count and logprob width (sampler compiles are a large share of a cold start's CPU work). The other way
        # round a neutral history would cost rows x max_model_len entries of device memory and two scatters that
        # size per step, so the variant without penalties stays.
        greedy, full = sampler_lib.SamplingMode.GREEDY, sampler_lib.SamplingMode.FULL
        self.sampler_variants = [SamplerVariant(greedy.value, False, 0)] + [
            SamplerVariant(mode.value, penalties, num_logprobs, bias_table)
            for num_logprobs in (0, self.max_logprobs)
            for mode in sampler_lib.SamplingMode if mode != greedy
            for penalties, bias_table in (((False, True), (True, True)) if mode == full else ((False, False),))
        ]
        self.dtype = jnp.dtype(model.dtype)
        # The KV pool's element type: the model dtype, or float8_e4m3fn (--kv-cache-dtype fp8).
        self.kv_dtype = jnp.dtype(kv_cache_dtype or model.dtype)
        self.vocab_size = model_config.vocab_size

        # Split the model once; the jitted step receives the flat parameter list and rebuilds the module only while
        # tracing, so no NNX graph traversal happens per call.
        graphdef, state = nnx.split(model)
        param_leaves, state_treedef = jax.tree.flatten(state)
        self._param_leaves = (param_leaves if self.sharding_plan else
                              [jax.device_put(x, self.device) for x in param_leaves])
        self._graphdef = graphdef
        self._state_treedef = state_treedef
        # XLA options of the programs that run the model's layers (the forwards): models.quantization.
        self.compiler_options = compiler_options(model)

        shape = (num_blocks, block_size, model_config.num_key_value_heads, model_config.head_dim)
        self._kv_block_shape = shape
        # Allocated on first use (the ``kv_pool`` property): warm-up compiles before it exists, so the compilers'
        # scratch memory (GPU autotuning, several compiles at once) never competes with it.
        self._kv_pool: list[tuple[jax.Array, jax.Array]] | None = None
        self.num_host_blocks = num_host_blocks
        # Host swap pool [layers, 2 (k|v), host_blocks, block_size, Hkv, D]; np.zeros is backed lazily by the OS.
        self.host_pool = (np.zeros((model_config.num_hidden_layers, 2, num_host_blocks) + shape[1:],
                                   dtype=self.kv_dtype) if num_host_blocks else None)

        # Last step's sampled tokens, on device (int32[max seq bucket]), and the packed row each key sampled in.
        self._max_seq_bucket = self.sampler_seq_buckets[-1]
        self._prev_tokens = jnp.zeros((self._max_seq_bucket,), jnp.int32, device=self.device)
        self._prev_rows: dict[str, int] = {}
        # Empty penalty history / bias table per seq bucket (steps without such rows), and the neutral bias table of
        # a full-mode step without a bias-table row (i32[R, bias_table_width(V)]: a few MB, inside the KV pool
        # sizing's headroom), created once at start-up: no step pays their transfer.
        self._no_history = {r: jax.device_put(np.zeros((r, 0), np.int32), self.device)
                            for r in self.sampler_seq_buckets}
        self._neutral_bias_tables = {r: jax.device_put(sampler_lib.neutral_bias_table(r, self.vocab_size), self.device)
                                     for r in self.sampler_seq_buckets}

        self._layouts: dict[tuple[int, int], StepLayout] = {}
        self._dispatcher = (concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="paged-jax-dispatch")
                            if dispatch_thread else None)
        self._last_dispatch: concurrent.futures.Future | None = None
        self._deferred: DeferredSampling | None = None  # a step whose sampling waits for dispatch_sampling
        # Multi-host node 0: announces each device call to the other processes first (paged_jax.parallel.multihost).
        self.step_channel = None
        self._build_jitted()
        self._compiles_at_warmup: int | None = None
        self.warm_up_timings: dict[str, float] = {}

    # ------------------------------------------------------------------ jitted functions
    def _build_jitted(self) -> None:
        graphdef, state_treedef = self._graphdef, self._state_treedef
        config = self.model_config
        sm_scale = config.head_dim ** -0.5
        sliding_window = config.sliding_window
        impl = self.attention_impl
        max_blocks = self.max_blocks_per_seq
        layout_for = self._layout
        plan = self.sharding_plan

        def forward(param_leaves, kv_pool, buf, prev_tokens, lora_arrays=None, *, num_tokens, num_seqs):
            """-> (kv_pool, logits f32[R, V] at each row's last token, sampling words int32[R * words], final hidden
            states [T, hidden] of every token, for prompt logprobs); R = ``sampler_rows_for(num_seqs)``."""
            fields = {name: buf[a:b] for name, (a, b) in layout_for(num_tokens, num_seqs).fields.items()}
            prev_rows = fields["prev_rows"]
            # Decode rows continuing from the previous step take their input token from its on-device samples.
            input_ids = jnp.where(prev_rows >= 0, prev_tokens[jnp.maximum(prev_rows, 0)], fields["input_ids"])
            slot_mapping = fields["slot_mapping"]
            cu_q_lens = fields["cu_q_lens"]
            kv_lens = fields["kv_lens"]
            block_tables = fields["block_tables"].reshape(num_seqs, max_blocks)

            if plan is None:  # one layer trace shared by every layer (models.llama.ReusableAttention)
                attention = ReusableAttention(
                    functools.partial(write_and_attend, sm_scale=sm_scale, sliding_window=sliding_window, impl=impl,
                                      qk_prepare_impl=self.qk_prepare_impl),
                    dict(slot_mapping=slot_mapping, kv_lens=kv_lens, block_tables=block_tables, cu_q_lens=cu_q_lens),
                    fuses_qk_transform=True)  # q/k norm + RoPE + KV write: one kernel on a GPU (ops.qk_prepare)
            else:  # the same per device on its heads and KV shard (shard_map over tp)
                attention = plan.paged_attention(slot_mapping=slot_mapping, kv_lens=kv_lens, block_tables=block_tables,
                                                 cu_q_lens=cu_q_lens, sm_scale=sm_scale, sliding_window=sliding_window,
                                                 impl=impl)

            kv_pool = apply_block_copies(list(kv_pool), fields["copy_src"], fields["copy_dst"],  # before K/V writes
                                         impl="auto" if plan is None else "xla")  # one kernel on one GPU
            model = nnx.merge(graphdef, jax.tree.unflatten(state_treedef, param_leaves))
            lora = None if lora_arrays is None else self.lora_slots.layers(lora_arrays, fields["lora_slot_ids"])
            hidden, kv_pool = model(input_ids, fields["positions"], kv_pool, attention, lora)
            logits = model.compute_logits(hidden[fields["logits_indices"]])
            return kv_pool, logits, fields["sampling"], hidden

        # Each jitted function runs the executables warm-up compiled or loaded for it (paged_jax.executable_cache),
        # keyed by its static arguments and the shapes of the arguments listed.
        self._forward = AheadOfTimeFunction(
            "forward", jax.jit(forward, static_argnames=("num_tokens", "num_seqs"), donate_argnums=(1,),
                               compiler_options=self.compiler_options or None))

        max_seq_bucket = self._max_seq_bucket

        def sample(logits, sampling_words, prev_token_ids, bias_table, *, mode, num_logprobs):
            """-> (token ids int32[max seq bucket] (padded), logprob f32[S], top ids i32[S, K], top lps f32[S, K])."""
            num_seqs = logits.shape[0]
            tensors = sampler_lib.unpack_sampling_tensors(sampling_words, prev_token_ids, num_seqs, bias_table)
            out = sampler_lib.sample(logits, tensors, mode=mode, num_logprobs=num_logprobs)
            # Padded to the widest seq bucket so the next forward's input feed always has one shape.
            padded = jnp.zeros((max_seq_bucket,), jnp.int32).at[:num_seqs].set(out.token_ids)
            return padded, out.logprobs, out.top_ids, out.top_logprobs, out.token_ranks

        self._sample = AheadOfTimeFunction("sample", jax.jit(sample, static_argnames=("mode", "num_logprobs")),
                                           shape_args=(0, 2, 3))
        # Structured outputs: the grammar bitmask i32[R, ceil(V/32)] masks the logits before the sampler (vLLM's
        # order), per sampler row count, only on steps with a constrained row (structured_output.bitmask).
        # A function of this runner's own: jit's executable cache is per function object, so num_compiles counts
        # only this runner's compiles.
        self._apply_grammar_bitmask = AheadOfTimeFunction(
            "grammar_bitmask", jax.jit(lambda logits, mask: sampler_lib.apply_allowed_token_mask(logits, mask)),
            shape_args=(1,))

        max_logprobs = self.max_logprobs

        def prompt_logprobs(param_leaves, hidden, targets):
            """hidden [T, hidden], targets int32[T] -> (logprob f32[T], rank i32[T], top ids i32[T, K], top logprobs
            f32[T, K]), K = max_logprobs."""
            model = nnx.merge(graphdef, jax.tree.unflatten(state_treedef, param_leaves))
            return prompt_logprobs_on_device(model.compute_logits, hidden, targets, num_logprobs=max_logprobs)

        self._prompt_logprobs = AheadOfTimeFunction("prompt_logprobs", jax.jit(prompt_logprobs), shape_args=(2,))

        def gather_blocks(kv_pool, block_ids):
            """-> [layers, 2, n, block_size, Hkv, D]."""
            return jnp.stack([jnp.stack([k[block_ids], v[block_ids]]) for k, v in kv_pool])

        def scatter_blocks(kv_pool, block_ids, data):
            return [(k.at[block_ids].set(data[i, 0]), v.at[block_ids].set(data[i, 1]))
                    for i, (k, v) in enumerate(kv_pool)]

        self._gather_blocks = AheadOfTimeFunction("gather_blocks", jax.jit(gather_blocks), shape_args=(1,))
        self._scatter_blocks = AheadOfTimeFunction("scatter_blocks", jax.jit(scatter_blocks, donate_argnums=(0,)),
                                                   shape_args=(1,))

    @property
    def kv_pool(self) -> list[tuple[jax.Array, jax.Array]]:
        """The device KV pool, one ``(k_pages, v_pages)`` ``[num_blocks, block_size, Hkv, D]`` per layer (zeros
        when first used)."""
        if self._kv_pool is None:
            self._kv_pool = (
                self.sharding_plan.make_kv_caches(self.num_blocks, self.block_size, self.kv_dtype)
                if self.sharding_plan else [(jnp.zeros(self._kv_block_shape, self.kv_dtype, device=self.device),
                                             jnp.zeros(self._kv_block_shape, self.kv_dtype, device=self.device))
                                            for _ in range(self.model_config.num_hidden_layers)])
        return self._kv_pool

    @kv_pool.setter
    def kv_pool(self, value: list[tuple[jax.Array, jax.Array]]) -> None:
        self._kv_pool = value

    def abstract_kv_pool(self) -> list[tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]]:
        """The pool's shapes, dtypes and shardings, without allocating it on a single device (a sharded pool's
        sharding is the one its creation returns, so that one is allocated)."""
        if self.sharding_plan is not None or self._kv_pool is not None:
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.kv_pool)
        page = jax.ShapeDtypeStruct(self._kv_block_shape, self.kv_dtype, sharding=self.input_sharding())
        return [(page, page) for _ in range(self.model_config.num_hidden_layers)]

    def input_sharding(self) -> jax.sharding.Sharding:
        """Where ``jax.device_put(host_array, self.device)`` puts a step input (the runner's device or the plan's
        replicated sharding)."""
        if isinstance(self.device, jax.sharding.Sharding):
            return self.device
        return jax.sharding.SingleDeviceSharding(self.device)

    def _layout(self, num_tokens: int, num_seqs: int) -> StepLayout:
        """The buffer layout of a bucket (cached: one per bucket, its field offsets computed once)."""
        layout = self._layouts.get((num_tokens, num_seqs))
        if layout is None:
            layout = StepLayout(num_tokens, num_seqs, self.max_blocks_per_seq,
                                sampler_rows_for(num_seqs, self.sampler_seq_buckets[-1]), self.lora_slots is not None)
            self._layouts[(num_tokens, num_seqs)] = layout
        return layout

    def num_compiles(self) -> int:
        """Executables compiled (or loaded) so far for this runner's jitted functions: those warm-up put into their
        tables plus jit's dispatch-cache entries of any other call."""
        lora = self.lora_slots.num_compiles() if self.lora_slots else 0
        return lora + sum(f._cache_size() for f in (self._forward, self._sample, self._apply_grammar_bitmask,
                                                    self._prompt_logprobs, self._gather_blocks, self._scatter_blocks))

    @property
    def num_compiles_since_warmup(self) -> int:
        """Compiles after ``warm_up``; anything but 0 means a step hit a shape that was not pre-compiled."""
        if self._compiles_at_warmup is None:
            return 0
        return self.num_compiles() - self._compiles_at_warmup

    # ------------------------------------------------------------------ warm-up
    def warm_up(self, use_tqdm: bool = True, threads: int | None = None) -> None:
        """Compile every executable once (``paged_jax.warm_up``: concurrently on ``threads`` threads, default
        ``$PAGED_JAX_COMPILE_THREADS`` or the CPU count, then one padding-only run of each); afterwards nothing
        compiles again (``num_compiles_since_warmup``). ``warm_up_timings``: seconds per phase and the thread count
        (``paged_jax.warm_up.warm_up``)."""
        self.warm_up_timings = warm_up_lib.warm_up(self, use_tqdm=use_tqdm, threads=threads)
        self._compiles_at_warmup = self.num_compiles()

    def _swap_sizes(self) -> list[int]:
        return swap_sizes_for(self.num_blocks)

    # ------------------------------------------------------------------ one step
    def execute(self, seqs: Sequence[SeqInput], block_copies: Sequence[tuple[int, int]] = (), *,
                defer_sampling: bool = False) -> PendingStep:
        """Dispatch one step; nothing here waits for the device. ``.result()`` of the return value fetches outputs.

        ``seqs`` may come in any order; they are packed decodes first, then prefill chunks, then fork rows
        (``SeqInput.sample_from``). ``block_copies`` ``[(src_block, dst_block)]`` are applied before the step's K/V
        writes (copy-on-write, at most one per sequence). Raises ValueError if the batch exceeds the largest bucket,
        a block table is too short, or ``feed_from_previous`` / ``sample_from`` names a key the step cannot serve.

        A step with grammar rows goes in two halves (``paged_jax.step_dispatch``): the forward, then, while it runs,
        the grammar bitmask is filled and mask + sampler are dispatched. ``defer_sampling`` (async scheduling)
        returns after the forward: the caller first advances the grammars with the previous step's tokens (fetched
        while this forward runs), then calls ``dispatch_sampling(handle)``. Without a grammar row the whole step is
        dispatched at once and ``defer_sampling`` changes nothing.
        """
        if not seqs:
            raise ValueError("execute needs at least one sequence")
        if self._deferred is not None:
            raise RuntimeError("execute: the previous step's sampling was never dispatched (dispatch_sampling)")
        num_rows = len(seqs)
        # Per row only C-speed iteration (fromiter / chain) and whole-array numpy; no per-row numpy calls.
        q_lens = np.fromiter(map(len, (s.token_ids for s in seqs)), np.int64, num_rows)
        starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, num_rows)
        # Decodes first (stable), then multi-token chunks: the layout the attention kernel is tuned for; fork rows
        # (no tokens) last, where the kernels see them as padding sequences (q_len 0, kv_len 0).
        multi = q_lens > 1
        forks = q_lens == 0
        if multi.any() or forks.any():
            order = np.argsort(np.where(forks, 2, multi), kind="stable")
            packed_seqs = [seqs[i] for i in order.tolist()]
            q_lens, starts = q_lens[order], starts[order]
            rows_to_packed = np.empty((num_rows,), np.int64)
            rows_to_packed[order] = np.arange(num_rows)
        else:
            packed_seqs = list(seqs)
            rows_to_packed = np.arange(num_rows)
        ends = starts + q_lens
        num_forks = int(forks.sum())
        if ends.max() > self.max_model_len:
            raise ValueError(f"sequence {packed_seqs[int(np.argmax(ends))].key!r} reaches {int(ends.max())} tokens, "
                             f"over max_model_len={self.max_model_len}")
        num_tokens = int(q_lens.sum())
        bucket_tokens, bucket_seqs = pick_bucket(self.buckets, num_tokens, num_rows)
        layout = self._layout(bucket_tokens, bucket_seqs)
        buf = np.zeros((layout.size,), np.int32)

        def view(name):
            a, b = layout.fields[name]
            return buf[a:b]

        input_ids, positions, slot_mapping, prev_rows = (view("input_ids"), view("positions"),
                                                         view("slot_mapping"), view("prev_rows"))
        cu_q_lens, kv_lens, logits_indices = view("cu_q_lens"), view("kv_lens"), view("logits_indices")
        block_tables = view("block_tables").reshape(bucket_seqs, self.max_blocks_per_seq)
        prev_rows[:] = -1

        sampling_rows = [s.sampling if s.sample else None for s in packed_seqs]
        tensors, mode = sampler_lib.build_sampling_tensors(
            sampling_rows, layout.num_sample_rows, penalty_len=self.max_model_len, eos_token_ids=self.eos_token_ids,
            vocab_size=self.vocab_size)
        sampler_lib.pack_sampling_tensors(tensors, view("sampling"))
        bias_table = sampler_lib.pack_bias_table(tensors)  # None unless a row uses logit_bias / allowed_token_ids
        penalties = tensors.prev_token_ids.shape[1] > 0
        grammars = [s.grammar if s.sample else None for s in packed_seqs]
        constrained = any(grammar is not None for grammar in grammars)
        requested = [n for n in (row[0].sampled_logprobs for row in sampling_rows if row is not None) if n is not None]
        wants_logprobs = bool(requested)
        wants_top = any(n > 0 for n in requested)
        if wants_top and mode == sampler_lib.SamplingMode.GREEDY:
            mode = sampler_lib.SamplingMode.GREEDY_OR_TEMPERATURE  # all rows greedy: same argmax, plus top-K
        num_logprobs = self.max_logprobs if wants_top else 0

        # Block tables: one flat fill of every row's blocks.
        table_lens = np.fromiter(map(len, (s.block_ids for s in packed_seqs)), np.int64, num_rows)
        bad = (table_lens * self.block_size < ends) | (table_lens > self.max_blocks_per_seq)
        if bad.any():
            packed = int(np.argmax(bad))
            raise ValueError(f"sequence {packed_seqs[packed].key!r}: a block table of {int(table_lens[packed])} blocks "
                             f"does not fit {int(ends[packed])} tokens within max_model_len={self.max_model_len}")
        num_table_entries = int(table_lens.sum())
        table_starts = np.cumsum(table_lens) - table_lens
        table_rows = np.repeat(np.arange(num_rows), table_lens)
        table_cols = np.arange(num_table_entries) - np.repeat(table_starts, table_lens)
        block_tables[table_rows, table_cols] = np.fromiter(
            itertools.chain.from_iterable(s.block_ids for s in packed_seqs), np.int32, num_table_entries)

        cu = np.cumsum(q_lens)
        cu_q_lens[1:num_rows + 1] = cu
        cu_q_lens[num_rows + 1:] = num_tokens  # padded seqs: q_len 0, kv_len 0; padded tokens -> null block slot 0
        kv_lens[:num_rows] = ends
        logits_indices[:num_rows] = cu - 1
        if num_forks:
            point_fork_rows(packed_seqs, num_forks, cu, logits_indices)
        pack_block_copies(block_copies, view("copy_src"), view("copy_dst"), self.num_blocks)
        if num_tokens == num_rows and not num_forks:  # all decodes: one token per row at position kv_len - 1
            token_rows = np.arange(num_rows)
            token_positions = starts
        else:
            token_rows = np.repeat(np.arange(num_rows), q_lens)
            token_positions = np.arange(num_tokens) - np.repeat(cu - q_lens, q_lens) + np.repeat(starts, q_lens)
        positions[:num_tokens] = token_positions
        slot_mapping[:num_tokens] = (block_tables[token_rows, token_positions // self.block_size] * self.block_size
                                     + token_positions % self.block_size)
        if self.lora_slots is not None:
            view("lora_slot_ids")[:num_tokens] = np.repeat(np.fromiter((s.lora_slot for s in packed_seqs), np.int32,
                                                                       num_rows), q_lens)
        input_ids[:num_tokens] = np.fromiter(
            itertools.chain.from_iterable(s.token_ids if not s.feed_from_previous else (0,) for s in packed_seqs),
            np.int32, num_tokens)
        new_prev_rows = {s.key: packed for packed, s in enumerate(packed_seqs) if s.sample}
        feed_packed = [packed for packed, s in enumerate(packed_seqs) if s.feed_from_previous]
        if feed_packed:  # (async scheduling: every decode row)
            previous = self._prev_rows
            feed_rows = np.fromiter((previous.get(packed_seqs[packed].key, -1) for packed in feed_packed), np.int64,
                                    len(feed_packed))
            bad = (q_lens[feed_packed] != 1) | (feed_rows < 0)
            if bad.any():
                raise ValueError(f"sequence {packed_seqs[feed_packed[int(np.argmax(bad))]].key!r}: feed_from_previous "
                                 "needs one new token and a sample from the previous step")
            prev_rows[cu[feed_packed] - 1] = feed_rows

        prompt_targets, prompt_spans = pack_prompt_logprob_targets(packed_seqs, q_lens, cu, bucket_tokens,
                                                                   rows_to_packed)
        history = tensors.prev_token_ids if penalties else None
        self._prev_rows = new_prev_rows
        sampled = np.fromiter((s.sample for s in seqs), bool, num_rows)
        handle = PendingStep(None, rows_to_packed, sampled, prompt_spans)
        if not constrained:
            handle.set_device_outputs(self._submit(
                self._dispatch, buf, history, bias_table, None, prompt_targets, bucket_tokens, bucket_seqs,
                mode.value, num_logprobs, wants_logprobs))
            return handle
        # Grammar rows: the forward first, the bitmask is filled while it runs (only the sampling needs it).
        forward = self._submit(self._dispatch_forward, buf, bucket_tokens, bucket_seqs)
        self._deferred = DeferredSampling(handle, forward, grammars, layout.num_sample_rows,
                                          (history, bias_table, prompt_targets, mode.value, num_logprobs,
                                           wants_logprobs))
        if not defer_sampling:
            self.dispatch_sampling(handle)
        return handle

    # ------------------------------------------------------------------ swapping
    def swap(self, swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]]) -> None:
        """Apply one step's swap copies: ``swap_out = [(device_block, host_block)]`` device -> host, then
        ``swap_in = [(host_block, device_block)]`` host -> device.

        The swap-in data is read from the host pool before the swap-out data lands there, and the swap-out gather is
        dispatched before the swap-in scatter, so a block freed by one list and reused by the other within the same
        step is copied correctly either way. Copies go in chunks of at most ``MAX_SWAP_CHUNK`` blocks (one
        transfer each way per chunk), padded to a power of two with the null block.
        """
        if not swap_out and not swap_in:
            return
        self.wait_for_dispatch()  # the pool must be the one after every step dispatched so far
        if self.step_channel is not None:
            self.step_channel.publish("swap", (swap_out, swap_in))
        if self.host_pool is None:
            raise ValueError("swap requested but the runner has no host pool (swap_space=0)")
        gathered = []
        for chunk in _chunks(list(swap_out), MAX_SWAP_CHUNK):
            device_ids = self._padded_ids([d for d, _ in chunk])
            gathered.append((chunk, self._gather_blocks(self.kv_pool, device_ids)))
        for chunk in _chunks(list(swap_in), MAX_SWAP_CHUNK):
            host_ids = [h for h, _ in chunk]
            device_ids = self._padded_ids([d for _, d in chunk])
            data = np.zeros(self.host_pool.shape[:2] + (device_ids.shape[0],) + self.host_pool.shape[3:],
                            self.host_pool.dtype)
            data[:, :, :len(host_ids)] = self.host_pool[:, :, host_ids]
            # Padding entries write zeros into the null block, which no valid token reads.
            self.kv_pool = self._scatter_blocks(self.kv_pool, device_ids, jax.device_put(data, self.device))
        for chunk, device_data in gathered:
            host = np.asarray(jax.device_get(device_data))
            self.host_pool[:, :, [h for _, h in chunk]] = host[:, :, :len(chunk)]

    def _padded_ids(self, ids: list[int]) -> jax.Array:
        size = 1 << max(len(ids) - 1, 0).bit_length()
        padded = np.full((size,), NULL_BLOCK_ID, np.int32)
        padded[:len(ids)] = ids
        return jax.device_put(padded, self.device)


def _chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]
