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
  ``ragged_paged_attention``), KV pool donated, logits at the sampled positions -> ``f32[R, V]`` (R >= S: ``sampler_rows_for``).
* ``_sample`` (compiled per sampler row count R x ``SamplerVariant``): on-device sampling -> token ids padded to the
  widest seq bucket (kept on device: the next step may take its decode inputs from them) and logprobs.

A third, ``_prompt_logprobs`` (compiled per token bucket T), runs only on steps where some chunk asked for prompt
logprobs (``paged_jax.worker.prompt_logprobs``): it takes the forward's hidden states of all T tokens (the forward always
returns them; other steps drop them unread) and that step's prompt-logprob targets, a second small transfer.

A pooling runner (``paged_jax.pooling.pooler.PoolingForward`` as its ``forward``) ends each step with the forward:
its per-row outputs are the rows' pooled hidden states through the model's head, fetched instead of sampled tokens
(``StepOutput.pooled``); it compiles no sampler and no prompt logprobs.

Splitting the sampler from the forward keeps compile counts additive (buckets + row counts x modes), not multiplicative.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.moe_routing import set_routing_capture
from models.quantization import compiler_options
from paged_jax.worker import sampler as sampler_lib
from paged_jax.worker import warm_up as warm_up_lib
from paged_jax.worker.background_compile import ReadySet, can_compile_in_background, warm_up_in_background
from paged_jax.worker.executable_cache import AheadOfTimeFunction, own_function
from paged_jax.worker.batch_invariant import make_batch_invariant
from paged_jax.worker.device_memory import check_pool_fits
from paged_jax.worker.buckets import bucket_sample_rows, make_buckets, sampler_rows_for, swap_sizes_for
from paged_jax.worker.host_kv_pool import HostKVPool, gather_blocks, scatter_blocks
from paged_jax.worker.step_dispatch import SamplingArgs, StepDispatcher
from paged_jax.worker.step_forward import SingleProgramForward, StepForward
from paged_jax.core.sched_output import SchedulerOutput, encode_step
from paged_jax.worker.step_io import PendingStep, SamplerVariant, StepLayout
from paged_jax.worker.input_batch import InputBatch
from paged_jax.worker.kv_group_pool import KVPoolLayout, kv_page_shapes, mixes_kv_groups
from paged_jax.worker.moe_outputs import MoeStepOutputs
from paged_jax.worker.step_packing import StepRows, pack_step
from paged_jax.ops.qk_prepare import check_qk_prepare_impl
from paged_jax.parallel import ShardingPlan
from paged_jax.parallel.multihost import local_copies
from paged_jax.structured_output import fill_step_bitmask, step_grammars
from paged_jax.sampling_params import MAX_LOGPROBS

logger = logging.getLogger(__name__)

NULL_BLOCK_ID = 0


# ----------------------------------------------------------------------------------------------------------------
# The runner
# ----------------------------------------------------------------------------------------------------------------

class ModelRunner:
    """Runs the model on paged KV for a stream of ragged steps.

    Args:
      model: ``LlamaForCausalLM`` (weights already on ``device``).
      model_config: its ``ModelConfig``.
      num_blocks: device KV blocks including the null block 0 (see ``determine_num_blocks``).
      block_size: tokens per block.
      max_model_len: most tokens per sequence (sets the block-table width and the penalty-history width).
      max_num_seqs / max_num_batched_tokens: the largest step (sets the buckets).
      num_host_blocks: host pool blocks (0: no swapping): swap preemption's and the prefix cache's host tier's
        (``paged_jax.worker.host_kv_pool``).
      eos_token_ids: banned (with stop_token_ids) while a row is below its min_tokens.
      attention_impl: one of ``paged_jax.worker.attention_impl.ATTENTION_IMPLS``, passed to ``ragged_paged_attention``.
      buckets: override of ``make_buckets(...)`` (list of (num_tokens, num_seqs)).
      max_logprobs: the top-logprob width of the compiled logprob variants (requests may ask for up to this many).
      device: where the pool lives (default ``jax.devices()[0]``); ignored with ``sharding_plan``.
      sharding_plan: the ``paged_jax.parallel.ShardingPlan`` (dp = 1) a tensor-parallel ``model`` was built for
        (``models.tensor_parallel``), or None for a single-device model. With a plan the weights stay in their
        shards, host inputs go to every device of its mesh (replicated), the KV pool is split over kv heads and
        attention runs per device under ``shard_map``.
      dispatch_thread: dispatch each step (the jitted calls) on a worker thread instead of the caller's
        (``paged_jax.worker.step_dispatch.StepDispatcher``, the runner's ``dispatcher``).
      lora_slots: ``paged_jax.lora.slots.LoRASlots`` (multi-LoRA; a step argument, written by ``write_lora_slot``).
      forward: how the step runs the model (``paged_jax.worker.step_forward.StepForward``; default
        ``SingleProgramForward``: one program per bucket; pipeline parallelism passes its ``PipelineForward``).
      batch_invariant: every row's outputs the same bits whatever the step's other rows and bucket
        (``paged_jax.worker.batch_invariant``).
      num_speculative_tokens: most draft tokens a row verifies per step (speculative decoding; 0: none): each
        bucket samples that many more positions per sequence (``buckets.sample_rows_needed``).
      moe_outputs: ``paged_jax.worker.moe_outputs.MoeStepOutputs``: the routing a mixture-of-experts model's steps
        return (``StepOutput.routed_experts`` / ``expert_load``); default none.
      drafter: a model drafter (``paged_jax.spec_decode.draft_runner.DraftRunner``: draft_model / eagle / eagle3), run
        after each step's sampler on the device; its proposals come back with the step
        (``StepOutput.proposed_draft_ids``).

    Multi-host: with ``step_channel`` set (node 0, ``paged_jax.parallel.multihost``), each ``execute`` first
    publishes its ``SchedulerOutput`` (and a grammar step its bitmask at ``dispatch_sampling``); the other nodes run
    the same ``execute`` on it (``paged_jax.parallel.follower``).
    """

    def __init__(self, model, model_config: ModelConfig, *, num_blocks: int, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, num_host_blocks: int = 0,
                 eos_token_ids: Sequence[int] = (), attention_impl: str = "auto",
                 buckets: Sequence[tuple[int, int]] | None = None, max_logprobs: int | None = None,
                 device: jax.Device | None = None, sharding_plan: ShardingPlan | None = None,
                 dispatch_thread: bool = False, kv_cache_dtype=None, lora_slots=None, qk_prepare_impl: str = "auto",
                 forward: StepForward | None = None, logprobs_mode: str = "raw_logprobs",
                 num_speculative_tokens: int = 0, batch_invariant: bool = False,
                 moe_outputs: MoeStepOutputs | None = None, drafter=None):
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
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.attention_impl = attention_impl
        self.qk_prepare_impl = check_qk_prepare_impl(qk_prepare_impl)  # paged_jax.ops.qk_prepare (benchmarks' A/B)
        if sharding_plan is not None and qk_prepare_impl != "auto":
            # Sharded steps attend under shard_map with the model applying q/k norm + RoPE itself (XLA).
            raise ValueError(f"qk_prepare_impl={qk_prepare_impl!r} applies to one device; a sharding plan (tensor or "
                             "pipeline parallel) runs the q/k transform in XLA: leave qk_prepare_impl='auto'")
        # KV-cache groups (paged_jax.worker.kv_group_pool): a row's block table holds every group's entries.
        self.kv_layout = KVPoolLayout.for_config(model_config, mixed_groups=mixes_kv_groups(sharding_plan))
        self.max_blocks_per_seq = -(-max_model_len // block_size) * self.kv_layout.num_groups
        # A model drafter runs after the sampler; an EAGLE-3 one reads these target layers' inputs (the forward's).
        self.drafter, self.aux_hidden_layers = drafter, tuple(getattr(drafter, "aux_hidden_layers", ()))
        self._plan_shapes(buckets, num_speculative_tokens)
        self.max_logprobs = MAX_LOGPROBS if max_logprobs is None else int(max_logprobs)
        self.logprobs_mode = logprobs_mode  # vLLM's: what the sampler's logprobs are taken of (sampler.LOGPROBS_MODES)
        self.sampler_variants = _sampler_variants(self.max_logprobs)
        self.dtype = jnp.dtype(model.dtype)
        # The KV pool's element type: the model dtype, or float8_e4m3fn (--kv-cache-dtype fp8).
        self.kv_dtype = jnp.dtype(kv_cache_dtype or model.dtype)
        self.vocab_size = model_config.vocab_size
        self.batch_invariant = bool(batch_invariant)  # the model's matmuls and norms, the attention's tiling
        self.moe_outputs = _capture_routing(model, model_config, moe_outputs or MoeStepOutputs(), forward)
        self._split_model(model)
        shape, _ = self._kv_block_shapes = kv_page_shapes(model_config, num_blocks, block_size,
                                                          host_pool=bool(num_host_blocks))
        # Allocated on first use (the ``kv_pool`` property): warm-up compiles before it exists, so the compilers'
        # scratch memory (GPU autotuning, several compiles at once) never competes with it.
        self._kv_pool: list[tuple[jax.Array, jax.Array]] | None = None
        self.num_host_blocks = num_host_blocks

        # Last step's sampled tokens, on device (int32[max seq bucket]).
        self._max_seq_bucket = self.sampler_seq_buckets[-1]
        self._prev_tokens = jnp.zeros((self._max_seq_bucket,), jnp.int32, device=self.device)
        # The requests it holds, one persistent row each (updated by each step's diff).
        self.input_batch = InputBatch(max_num_seqs, max_model_len, self.max_blocks_per_seq,
                                      eos_token_ids=self.eos_token_ids, vocab_size=self.vocab_size)
        # Empty penalty history / bias table per seq bucket (steps without such rows), and the neutral bias table of
        # a full-mode step without a bias-table row (i32[R, bias_table_width(V)]: a few MB, inside the KV pool
        # sizing's headroom), created once at start-up: no step pays their transfer.
        self._no_history = {r: jax.device_put(np.zeros((r, 0), np.int32), self.device)
                            for r in self.sampler_seq_buckets}
        self._neutral_bias_tables = {r: jax.device_put(sampler_lib.neutral_bias_table(r, self.vocab_size), self.device)
                                     for r in self.sampler_seq_buckets}

        self._layouts: dict[tuple[int, int], StepLayout] = {}
        self.dispatcher = StepDispatcher(self, dispatch_thread=dispatch_thread)
        # Multi-host node 0: announces each step to the other processes first (paged_jax.parallel.multihost).
        self.step_channel = None
        self.forward_strategy = forward if forward is not None else SingleProgramForward()
        # A pooling step ends with the forward's per-row pooled outputs: no sampler (paged_jax.pooling).
        self.pools = bool(getattr(self.forward_strategy, "pools", False))
        self._single_process = jax.process_count() == 1
        devices = self.device.device_set if isinstance(self.device, jax.sharding.Sharding) else {self.device}
        self._copies_to_host = any(device.platform != "cpu" for device in devices)
        self._build_jitted()
        self.host_pool = HostKVPool(num_host_blocks, (self.kv_layout.num_slots, 2) + shape[1:], self.kv_dtype,
                                    gather=self._gather_blocks, scatter=self._scatter_blocks,
                                    device=self.device) if num_host_blocks else None  # swap's and the host tier's
        self._init_warm_up_state()

    def _init_warm_up_state(self) -> None:
        """Nothing compiled yet. ``ready``: what steps can run now (everything, unless executables still land in the
        background: ``background``, their ``BackgroundCompiles``; paged_jax.worker.background_compile)."""
        self._compiles_at_warmup: int | None = None
        self.warm_up_timings: dict[str, float] = {}
        self.ready = ReadySet(self)
        self.background = None

    def _plan_shapes(self, buckets: Sequence[tuple[int, int]] | None, num_speculative_tokens: int) -> None:
        """The compiled step shapes: ``buckets`` (default ``make_buckets``), their seq counts, and the sampler's row
        counts (coarser than the seq buckets: fewer compiles)."""
        self.buckets = (sorted(buckets) if buckets is not None else
                        make_buckets(self.max_num_batched_tokens, self.max_num_seqs, num_speculative_tokens))
        self.seq_buckets = sorted({s for _, s in self.buckets})
        self.num_speculative_tokens = num_speculative_tokens
        self._bucket_sample_rows = dict(zip(self.buckets, bucket_sample_rows(self.buckets, num_speculative_tokens)))
        self._max_sample_rows = max(self._bucket_sample_rows.values())
        self.sampler_seq_buckets = sorted({sampler_rows_for(r, self._max_sample_rows, self.max_num_seqs)
                                           for r in self._bucket_sample_rows.values()})

    def _split_model(self, model) -> None:
        """Split the model once; the jitted step receives the flat parameter list and rebuilds the module only while
        tracing, so no NNX graph traversal happens per call. In batch-invariant mode the model's layers are switched
        first (``paged_jax.worker.batch_invariant``)."""
        if self.batch_invariant:
            if self.sharding_plan is not None:
                raise ValueError("batch_invariant needs a model on one device (no tensor / pipeline parallelism)")
            make_batch_invariant(model)
        graphdef, state = nnx.split(model)
        param_leaves, state_treedef = jax.tree.flatten(state)
        self._param_leaves = (param_leaves if self.sharding_plan else
                              [jax.device_put(x, self.device) for x in param_leaves])
        self._graphdef = graphdef
        self._state_treedef = state_treedef
        # XLA options of the programs that run the model's layers (the forwards): models.quantization.
        self.compiler_options = compiler_options(model)

    # ------------------------------------------------------------------ jitted functions
    def _build_jitted(self) -> None:
        # Each jitted function runs the executables warm-up compiled or loaded for it (paged_jax.worker.executable_cache),
        # keyed by its static arguments and the shapes of the arguments listed.
        self._forward, self._prompt_logprobs = self.forward_strategy.build(self)
        if self.drafter is not None:  # its program per bucket (paged_jax.spec_decode.draft_runner)
            self.drafter.bind(self)

        max_seq_bucket, logprobs_mode, batch_invariant = self._max_seq_bucket, self.logprobs_mode, self.batch_invariant
        greedy = sampler_lib.SamplingMode.GREEDY.value  # the tokens only (``_sampler_variants``)

        def sample(logits, sampling_words, prev_token_ids, bias_table, *, mode, num_logprobs):
            """-> (token ids int32[max seq bucket] (padded), logprob f32[S], top ids i32[S, K], top lps f32[S, K])."""
            num_seqs = logits.shape[0]
            tensors = sampler_lib.unpack_sampling_tensors(sampling_words, prev_token_ids, num_seqs, bias_table)
            out = sampler_lib.sample(logits, tensors, mode=mode, num_logprobs=num_logprobs, logprobs_mode=logprobs_mode,
                                     batch_invariant=batch_invariant, token_logprobs=mode != greedy)  # greedy: tokens
            # Padded to the widest seq bucket so the next forward's input feed always has one shape.
            padded = jnp.zeros((max_seq_bucket,), jnp.int32).at[:num_seqs].set(out.token_ids)
            return padded, out.logprobs, out.top_ids, out.top_logprobs, out.token_ranks

        self._sample = AheadOfTimeFunction("sample", jax.jit(sample, static_argnames=("mode", "num_logprobs")),
                                           shape_args=(0, 2, 3))
        # Structured outputs: the grammar bitmask i32[R, ceil(V/32)] masks the logits before the sampler (vLLM's
        # order), per sampler row count, only on steps with a constrained row (structured_output.bitmask).
        self._apply_grammar_bitmask = AheadOfTimeFunction(
            "grammar_bitmask", jax.jit(own_function(sampler_lib.apply_allowed_token_mask)), shape_args=(1,))

        self._gather_blocks = AheadOfTimeFunction("gather_blocks", jax.jit(own_function(gather_blocks)),
                                                  shape_args=(1,))
        self._scatter_blocks = AheadOfTimeFunction(
            "scatter_blocks", jax.jit(own_function(scatter_blocks), donate_argnums=(0,)), shape_args=(1,))

    @property
    def param_leaves(self) -> list:
        """The model's parameter arrays, flat (the step programs' first argument). Weight updates and sleep mode
        replace them (``paged_jax.worker.weight_update``, ``sleep_mode``) with arrays of the same shapes, dtypes and
        shardings, so nothing compiles; None entries while the weights sleep."""
        return self._param_leaves

    @param_leaves.setter
    def param_leaves(self, leaves: list) -> None:
        self._param_leaves = leaves

    @property
    def kv_pool_allocated(self) -> bool:
        """Whether the KV pool exists (``kv_pool`` allocates it on first use)."""
        return self._kv_pool is not None

    @property
    def kv_pool(self) -> list[tuple[jax.Array, jax.Array]]:
        """The device KV pool, one ``(k_pages, v_pages)`` ``[num_blocks, block_size, Hkv, D]`` per layer, or per slot
        of ``kv_layout`` with KV-cache groups (zeros when first used)."""
        if self._kv_pool is None:
            if self.sharding_plan is None:
                check_pool_fits(self.device, jax.tree.leaves(self.abstract_kv_pool()))
            self._kv_pool = (
                self.sharding_plan.make_kv_caches(self.num_blocks, self.block_size, self.kv_dtype,
                                                  num_layers=self.kv_layout.num_slots)
                if self.sharding_plan else [tuple(jnp.zeros(shape, self.kv_dtype, device=self.device)
                                                  for shape in self._kv_block_shapes)
                                            for _ in range(self.kv_layout.num_slots)])
        return self._kv_pool

    @kv_pool.setter
    def kv_pool(self, value: list[tuple[jax.Array, jax.Array]]) -> None:
        self._kv_pool = value

    def abstract_kv_pool(self) -> list[tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]]:
        """The pool's shapes, dtypes and shardings, without allocating it on a single device (a sharded pool's
        sharding is the one its creation returns, so that one is allocated)."""
        if self.sharding_plan is not None or self._kv_pool is not None:
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.kv_pool)
        pages = tuple(jax.ShapeDtypeStruct(shape, self.kv_dtype, sharding=self.input_sharding())
                      for shape in self._kv_block_shapes)
        return [pages for _ in range(self.kv_layout.num_slots)]

    def input_sharding(self) -> jax.sharding.Sharding:
        """Where ``jax.device_put(host_array, self.device)`` puts a step input (the runner's device or the plan's
        replicated sharding)."""
        if isinstance(self.device, jax.sharding.Sharding):
            return self.device
        return jax.sharding.SingleDeviceSharding(self.device)

    def layout(self, num_tokens: int, num_seqs: int) -> StepLayout:
        """The buffer layout of a bucket (cached: one per bucket, its field offsets computed once)."""
        layout = self._layouts.get((num_tokens, num_seqs))
        if layout is None:
            rows = self._bucket_sample_rows[(num_tokens, num_seqs)]
            layout = StepLayout(num_tokens, num_seqs, self.max_blocks_per_seq,
                                sampler_rows_for(rows, self._max_sample_rows, self.max_num_seqs), self.lora_slots is not None,
                                self.kv_layout.num_groups, spec_rows=self.drafter is not None)
            self._layouts[(num_tokens, num_seqs)] = layout
        return layout

    def step_functions(self) -> tuple:
        """The jitted functions a step calls (``AheadOfTimeFunction``s, or the pipeline's forward)."""
        return (self._forward, self._sample, self._apply_grammar_bitmask, self._prompt_logprobs, self._gather_blocks,
                self._scatter_blocks)

    def num_compiles(self) -> int:
        """Executables compiled (or loaded) so far for this runner's jitted functions: those warm-up put into their
        tables plus jit's dispatch-cache entries of any other call."""
        return self._side_compiles() + sum(f._cache_size() for f in self.step_functions())

    def _side_compiles(self) -> int:  # the LoRA slot write's and the drafter's programs
        return sum(part.num_compiles() for part in (self.lora_slots, self.drafter) if part)

    def _step_path_compiles(self) -> int:
        """Compiles by calls (jit's caches and the LoRA slot write): not the executables warm-up put into tables."""
        return self._side_compiles() + sum(f.jit_compiles() if isinstance(f, AheadOfTimeFunction) else f._cache_size()
                          for f in self.step_functions())

    @property
    def num_compiles_since_warmup(self) -> int:
        """Compiles on calls after ``warm_up`` (executables landing from background compiles do not count); anything
        but 0 means a step hit a shape that was not pre-compiled."""
        if self._compiles_at_warmup is None:
            return 0
        return self._step_path_compiles() - self._compiles_at_warmup

    # ------------------------------------------------------------------ warm-up
    def warm_up(self, use_tqdm: bool = True, threads: int | None = None, background: bool = False,
                jobs: list | None = None) -> None:
        """Compile every executable once (``paged_jax.worker.warm_up``: concurrently on ``threads`` threads, default
        ``$PAGED_JAX_COMPILE_THREADS`` or the CPU count, then one padding-only run of each); afterwards nothing
        compiles again (``num_compiles_since_warmup``). ``background``: return once a first set is ready and compile
        the rest on a background thread (``paged_jax.worker.background_compile``; ``ready`` grows as they land),
        where the runner allows it. ``jobs``: only these (``warm_up.jobs_for_buckets``: a benchmark's few step
        shapes; other steps would compile). ``warm_up_timings``: seconds per phase and the thread count."""
        if background and jobs is None and can_compile_in_background(self):
            self.warm_up_timings = warm_up_in_background(self, use_tqdm=use_tqdm, threads=threads)
        else:
            jobs = warm_up_lib.all_jobs(self) if jobs is None else jobs
            self.warm_up_timings = warm_up_lib.warm_up_jobs(self, jobs, use_tqdm, threads)[0]
        if self.drafter is not None:
            self.drafter.warm_up(self, None if jobs is None else [job.shape for job in jobs if job.kind == "forward"])
        self._compiles_at_warmup = self._step_path_compiles()

    def _swap_sizes(self) -> list[int]:
        return swap_sizes_for(self.num_blocks)

    # ------------------------------------------------------------------ one step
    def execute(self, scheduler_output: SchedulerOutput, lora_slots: dict[int, int] | None = None, *,
                defer_sampling: bool = False) -> PendingStep | None:
        """Apply a step's diff to the persistent batch and pack it, run its swap copies, then dispatch it; nothing
        here waits for the device. Returns the step's handle (``.result()``: a ``StepOutput`` aligned with the step's rows), or
        None when the step has no rows.

        ``lora_slots``: ``{lora_int_id: slot}`` of the step's adapters (``paged_jax.lora``). Raises ValueError when
        a row's block table does not cover its tokens, the step exceeds the largest bucket, or a diff names a request
        the batch cannot serve.

        A step with grammar rows goes in two halves (``paged_jax.worker.step_dispatch``): the forward, then, while it runs,
        the grammar bitmask is filled and mask + sampler are dispatched. ``defer_sampling`` (async scheduling)
        returns after the forward: the caller first advances the grammars with the previous step's tokens (fetched
        while this forward runs), then calls ``dispatch_sampling(handle)``. Without a grammar row the whole step is
        dispatched at once and ``defer_sampling`` changes nothing.
        """
        if self.dispatcher.deferred is not None:
            raise RuntimeError("execute: the previous step's sampling was never dispatched (dispatch_sampling)")
        rows = self._update_batch(scheduler_output)
        batch = self.input_batch
        previous = batch.last_packed
        packed = None if rows is None else pack_step(
            batch, rows, buckets=self.ready.buckets, layout_for=self.layout, block_size=self.block_size,
            num_blocks=self.num_blocks, max_logprobs=self.max_logprobs, block_copies=scheduler_output.block_copies,
            lora_slots=lora_slots, lora=self.lora_slots is not None)
        if self.step_channel is not None:  # multi-host node 0: the other nodes run this same step, from here on
            self.step_channel.publish("step", encode_step(scheduler_output, lora_slots))
        self.swap(scheduler_output.swap_out, scheduler_output.swap_in, defer_saves=rows is not None)
        if rows is None:
            return None
        # The next step feeds its placeholders from this step's samples (a step repacked from the last one, same
        # rows in the same order, finds them as that one set them).
        if previous is None or packed.packed_sampled is not previous.packed_sampled:
            batch.prev_sample[:batch.num_rows] = -1
            batch.prev_sample[packed.packed_batch_rows[packed.packed_sampled]] = np.flatnonzero(packed.packed_sampled)
        handle = PendingStep(None, packed.rows_to_packed, packed.sampled, packed.prompt_spans,
                             packed.draft_sample_rows, pooled=self.pools,
                             token_spans=packed.token_spans() if self.moe_outputs.routed_experts else None,
                             in_order=packed.reusable)
        layout = packed.layout
        sampling = SamplingArgs(packed.history, packed.bias_table, packed.prompt_targets, packed.mode.value,
                                packed.num_logprobs, packed.wants_logprobs)
        # Grammar rows: the forward first, the bitmask is filled while it runs (only the sampling needs it).
        self.dispatcher.dispatch(handle, packed.buf, layout.num_tokens, layout.num_seqs, sampling,
                                 grammars=step_grammars(scheduler_output.grammars, scheduler_output.spec_token_ids,
                                                        self.input_batch.req_ids, packed),
                                 num_rows=layout.num_sample_rows)
        if self.host_pool is not None:  # the saves' transfers, dispatched off the forward's path
            self.host_pool.finish_saves()
        if not defer_sampling:
            self.dispatch_sampling(handle)
        return handle

    def dispatch_sampling(self, handle: PendingStep, grammar_bitmask: np.ndarray | None = None) -> None:
        """Second half of a step ``execute(..., defer_sampling=True)`` left without its sampling: fill the grammar
        bitmask from the rows' grammars now (they must have seen every token before this step's), or take
        ``grammar_bitmask`` int32[R, ceil(V/32)] (a multi-host follower: node 0's), and dispatch mask + sampler
        (+ prompt logprobs). A no-op for a step dispatched whole."""
        pending = self.dispatcher.pending_bitmask_rows(handle)
        if pending is None:
            return
        if grammar_bitmask is None:
            (grammars, drafts), num_rows = pending
            grammar_bitmask = fill_step_bitmask(grammars, num_rows, self.vocab_size, drafts)
        if self.step_channel is not None:
            self.step_channel.publish("bitmask", grammar_bitmask)
        self.dispatcher.dispatch_sampling(handle, grammar_bitmask)

    def waits_for_bitmask(self, handle: PendingStep) -> bool:
        """Whether ``handle``'s step has its forward dispatched and its sampling waiting for ``dispatch_sampling``."""
        return self.dispatcher.pending_bitmask_rows(handle) is not None

    # ------------------------------------------------------------------ device calls (StepDevice)
    def run_forward(self, buf: np.ndarray, num_tokens: int, num_seqs: int) -> tuple:
        """-> (logits f32[R, V], sampling words, hidden [T, hidden], the ``moe_outputs`` dict or None, the drafter's
        step inputs or None) on device; the KV pool updated in place."""
        # One process: the executable takes the numpy buffer itself (its C++ call path transfers it, far cheaper
        # than ``jax.device_put``'s); several, or a drafter reading the same buffer: it is put on the device first.
        if not self._single_process or self.drafter is not None:
            buf = jax.device_put(buf, self.device)
        self.kv_pool, logits, sampling_words, hidden, *moe = self._forward(
            self._param_leaves, self.kv_pool, buf, self._prev_tokens, self.lora_slots and self.lora_slots.arrays,
            num_tokens=num_tokens, num_seqs=num_seqs)
        # (the previous step's samples too: the drafter reads the tokens they fed, as the forward did)
        draft_inputs = (buf, self._prev_tokens, num_tokens, num_seqs) if self.drafter is not None else None
        return logits, sampling_words, hidden, (moe[0] if moe else None), draft_inputs

    def run_sampling(self, forward_outputs: tuple, grammar_bitmask: np.ndarray | None,
                     sampling: SamplingArgs) -> tuple:
        """Mask (grammar), sample, prompt logprobs -> the device outputs to fetch (sampler's, prompt logprobs'),
        their host copies started."""
        logits, sampling_words, hidden, moe, draft_inputs = forward_outputs
        if self.pools:  # the pooled outputs f32[R, W] are the step's result
            fetch = local_copies((logits,))
            fetch[0].copy_to_host_async()
            return fetch, ()
        num_rows = logits.shape[0]
        mode = self.ready.sampler_mode(num_rows, sampling.mode, sampling.num_logprobs, sampling.history is not None)
        if grammar_bitmask is not None:
            logits = self._apply_grammar_bitmask(logits, jax.device_put(grammar_bitmask, self.device))
        # Full mode's variants all take the bias table (ModelRunner.sampler_variants): without a row that uses it,
        # a neutral one (no logit_bias entries, every token allowed).
        bias_table = (jax.device_put(sampling.bias_table, self.device) if sampling.bias_table is not None
                      else self._neutral_bias_tables[num_rows] if mode == sampler_lib.SamplingMode.FULL.value
                      else self._no_history[num_rows])
        history = (jax.device_put(sampling.history, self.device) if sampling.history is not None
                   else self._no_history[num_rows])
        outs = self._sample(logits, sampling_words, history, bias_table, mode=mode, num_logprobs=sampling.num_logprobs)
        self._prev_tokens = outs[0]
        fetch = outs if sampling.wants_logprobs else outs[:1]
        fetch = fetch if self._single_process else local_copies(fetch)  # one process: every array is addressable
        prompt_fetch = () if sampling.prompt_targets is None else local_copies(self._prompt_logprobs(
            self._param_leaves, hidden, jax.device_put(sampling.prompt_targets, self.device)))
        moe_fetch = {} if moe is None else dict(zip(moe, local_copies(tuple(moe.values()))))
        draft_fetch = () if draft_inputs is None else local_copies((self.drafter.propose(outs[0], hidden,
                                                                                          *draft_inputs),))
        for array in (*fetch, *prompt_fetch, *moe_fetch.values(), *draft_fetch) if self._copies_to_host else ():
            array.copy_to_host_async()  # the device->host copy starts now (a CPU's arrays are read in place)
        return fetch, prompt_fetch, moe_fetch, draft_fetch

    def write_lora_slot(self, slot: int, loaded) -> None:
        """Put a LoRA adapter (``LoadedLoRA``) into device slot ``slot`` after the steps already dispatched."""
        self.dispatcher.submit(self.lora_slots.write, slot, loaded)

    def wait_for_dispatch(self) -> None:
        """Block until every step handed to the dispatch thread has been dispatched (``StepDispatcher.wait``)."""
        self.dispatcher.wait()

    def close(self) -> None:
        """Stop the dispatch thread (after the steps already handed to it) and the background compiles, and wait
        for the host pool's saves."""
        if self.background is not None:
            self.background.stop()
        self.dispatcher.close()
        if self.host_pool is not None:
            self.host_pool.close()

    def _update_batch(self, scheduler_output: SchedulerOutput) -> StepRows | None:
        """Drop finished and preempted rows, apply the running rows' diffs, make the new and fork rows; returns the
        step's rows (None: no rows)."""
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids:
            batch.remove(req_id)
        for req_id in scheduler_output.preempted_req_ids:
            batch.remove(req_id)
        cached = scheduler_output.scheduled_cached_reqs
        cached_rows = batch.apply_cached(cached)
        new_reqs = scheduler_output.scheduled_new_reqs
        new_rows = [batch.add(new) for new in new_reqs]
        fork_rows = [batch.add(child) for child, _ in scheduler_output.fork_rows]
        if not scheduler_output.has_rows:
            return None
        num_forks = len(fork_rows)
        fork_parents: list[int] = []
        if num_forks:
            step_row_of = {req_id: i for i, req_id in enumerate(scheduler_output.row_req_ids())}
            fork_parents = [step_row_of[parent] for _, parent in scheduler_output.fork_rows]
        batch_rows = (np.concatenate([cached_rows, np.asarray(new_rows + fork_rows, np.int64)])
                      if new_rows or fork_rows else cached_rows)  # running rows only (a decode step): no copy
        num_rows = len(batch_rows)
        num_new = np.fromiter(scheduler_output.num_scheduled_tokens + [0] * num_forks, np.int64, num_rows)
        starts = np.fromiter(scheduler_output.row_num_computed_tokens(), np.int64, num_rows)
        if int((starts + num_new).max()) > self.max_model_len:
            raise ValueError(f"a step reaches {int((starts + num_new).max())} tokens, over max_model_len="
                             f"{self.max_model_len}")
        return StepRows(batch_rows, num_new, starts, fork_parents,
                        self.input_batch.feed_drafts(scheduler_output.row_req_ids(), scheduler_output.spec_token_ids,
                                                     batch_rows) if scheduler_output.spec_token_ids else None)

    # ------------------------------------------------------------------ swapping
    def swap(self, swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]], *,
             defer_saves: bool = False) -> None:
        """Apply one step's swap copies: ``swap_out = [(device_block, host_block)]`` device -> host, then
        ``swap_in = [(host_block, device_block)]`` host -> device (``HostKVPool.swap``: a step's swap-ins read
        what earlier steps stored, its own stores land after it, without the step waiting for them;
        ``defer_saves``: the stores' transfers wait for ``HostKVPool.finish_saves``, after the forward)."""
        if not swap_out and not swap_in:
            return
        self.wait_for_dispatch()  # the pool must be the one after every step dispatched so far
        if self.host_pool is None:
            raise ValueError("swap requested but the runner has no host pool (swap_space=0)")
        self.kv_pool = self.host_pool.swap(self.kv_pool, swap_out, swap_in, defer_saves=defer_saves)

def _capture_routing(model, model_config: ModelConfig, options: MoeStepOutputs, forward) -> MoeStepOutputs:
    """``options``, the sparse layers of ``model`` set to record their routing (static) when any is on; ValueError
    for a model without them, or a pooling or pipelined step (which does not return it)."""
    if options.any:
        options.check(model_config)
        if forward is not None and (getattr(forward, "pools", False) or not isinstance(forward, SingleProgramForward)):
            raise ValueError("enable_return_routed_experts / enable_expert_load_metrics: the step of a pooling or "
                             "pipelined model does not return its routing")
        set_routing_capture(model, True)
    return options


def _sampler_variants(max_logprobs: int) -> list[SamplerVariant]:
    """The compiled sampler variants."""
    # Every mode has a lean variant without top-k logprobs (the common case: nobody asked for alternatives) and the
    # random modes also one with the top max_logprobs, paid only on steps where some row asked for it. The greedy
    # variant gives the tokens only: a greedy step that wants logprobs runs greedy_or_temperature (all rows greedy:
    # the same argmax). The top_k mode is top-k / top-p without a sort of the vocabulary, for the steps whose rows
    # allow it (Qwen3's generation config, for one). Full mode always takes the bias table, and once more with the
    # penalty history; each is sent only on steps that need it. A full step without a bias-table row gets a neutral
    # table (``run_sampling``; one bit per vocabulary entry and row, plus the logit_bias slots: a mask pass over
    # rows x vocabulary, next to the sort such a step runs anyway): two executables fewer per row count and logprob
    # width (sampler compiles are a large share of a cold start's CPU work). The other way round a neutral history
    # would cost rows x max_model_len entries of device memory and two scatters that size per step.
    greedy, full = sampler_lib.SamplingMode.GREEDY, sampler_lib.SamplingMode.FULL
    return [SamplerVariant(greedy.value, False, 0)] + [
        SamplerVariant(mode.value, penalties, num_logprobs, bias_table)
        for num_logprobs in (0, max_logprobs)
        for mode in sampler_lib.SamplingMode if mode != greedy
        for penalties, bias_table in (((False, True), (True, True)) if mode == full else ((False, False),))
    ]
