"""Pipeline parallelism (``--pipeline-parallel-size``): contiguous layer stages, each on its own devices.

The engine's devices form a ``("pp", "tp")`` mesh (``make_pipeline_mesh``); stage s owns the devices at pp index s
and, on them, a ``(dp=1, tp)`` ``ShardingPlan`` (so tensor parallelism inside a stage is exactly the tp engine's):
its layers' weights in their tp shards, and its layers' part of the KV pool (every stage has all KV blocks for its
own layers, so the block tables are the same for every stage). Stage 0 also holds the embedding, the last stage the
final norm and the LM head (with tied embeddings, a copy of the embedding). Layers split as evenly as possible,
earlier stages taking one fewer when they do not divide (``stage_layer_ranges``).

``PipelinePlan`` is the layout: it places every parameter on its stage's mesh at load time (it implements the
``models.tensor_parallel.TensorParallelPlan`` protocol, so ``load_sharded_model`` and the weights cache put each
tensor straight into its stage's shards) and creates the staged KV pool. ``PipelineForward`` is the forward strategy
(``paged_jax.worker.step_forward``) the one ``ModelRunner`` is given for it: stage by stage, one jitted function per
stage and bucket, shared by the bucket's
micro-batches (embedding + its layers on stage 0, its layers in between, its layers + norm on the last), then the LM
head on the last stage; the hidden states ``[T / M, hidden]`` of M micro-batches copied device to device between
stages, the step's metadata buffer copied from the last stage (where the runner puts it,
beside the sampler) to the others. Everything else (buckets, sampler, warm-up of every shape, donated KV pools, no
compile after warm-up) is the ``ModelRunner``'s.

Overlap (micro-batches within a step): a step whose token bucket splits into ``pp`` token ranges of at least
``min_microbatch_tokens`` each (``num_microbatches_for``; fixed per bucket, so warm-up compiles every shape) runs as
``pp`` micro-batches dispatched wavefront by wavefront (``pipeline_schedule``): stage 0 gets micro-batch 1 queued
before stage 1 is handed micro-batch 0, and with JAX's asynchronous dispatch each stage's devices run their own
queue, so stage s + 1 works on micro-batch m while stage s works on m + 1, with no host sync anywhere in the step.
The split is by token range of the packed step (``microbatch_attention_metadata`` re-expresses each sequence's part
inside the range on device; a prefill chunk cut by the boundary becomes two consecutive chunks, the second reading
the first's K/V that the earlier micro-batch wrote on the same stage), so the host packing, the buffer, the sampler
and the scheduler are the ``ModelRunner``'s unchanged; the last stage joins the micro-batches' hidden states and runs
the LM head on them at once, and sampling follows on the merged logits. A step then takes ``(M + pp - 1) / M`` stage
times instead of ``pp`` when its stages are bound by their matmuls; steps too small to be (decodes of modest batches,
``MIN_MICROBATCH_TOKENS``) run as one batch, stage after stage, since each micro-batch reads the stage's weights
again. Every call is dispatched asynchronously either way, so the host builds the next step while the stages run.

Why not vLLM's way (as many scheduled batches of disjoint requests in flight as stages, each step of batch b
dispatched while batch b - 1's later stages run): it needs the scheduler to hold ``pp`` batches in flight and skip
their requests, the engine to keep ``pp`` pending steps and their outputs in order, and the runner ``pp`` decode feeds;
every one of those is a change to the shared engine loop. Micro-batches give the same stage overlap for the steps
that can gain from it (compute-bound ones: a memory-bound stage reads all its weights once per batch, so for it one
bigger batch gains as much as overlapping smaller ones) inside this module, with greedy output identical to pp = 1 by
construction (the same tokens, positions and K/V, only cut at a token boundary). What it does not give is vLLM's
cross-step overlap: a step's first micro-batch still waits for the previous step's tokens (a fill and drain of the
pipe per step).

Swap preemption is refused (its copies would span the stages' devices; ``EngineArgs`` checks it), and so are stages
on other processes (multi-host: use tensor parallelism across hosts).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from models.config import ModelConfig
from models.llama import matmul_precision, run_decoder_layers, scale_embedding, scale_logits
from models.qk_transform import rope_tables
from paged_jax.parallel.mesh import DP_AXIS, TP_AXIS
from paged_jax.parallel.plan import ShardingPlan
from paged_jax.worker.prompt_logprobs import prompt_logprobs_on_device
from paged_jax.worker.step_io import apply_block_copies

PP_AXIS = "pp"


def make_pipeline_mesh(pipeline_parallel_size: int, tensor_parallel_size: int,
                       devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``("pp", "tp")`` mesh of ``pp * tp`` devices (default the first ones of ``jax.devices()``); tp is the minor
    axis, so a stage's devices are neighbours."""
    num_devices = pipeline_parallel_size * tensor_parallel_size
    devices = list(jax.devices()[:num_devices] if devices is None else devices)
    if len(devices) != num_devices:
        raise ValueError(f"pipeline_parallel_size * tensor_parallel_size = {pipeline_parallel_size} * "
                         f"{tensor_parallel_size} = {num_devices} devices needed, {len(devices)} available")
    return Mesh(np.asarray(devices, dtype=object).reshape(pipeline_parallel_size, tensor_parallel_size),
                (PP_AXIS, TP_AXIS))


def stage_layer_ranges(num_layers: int, pipeline_parallel_size: int) -> tuple[tuple[int, int], ...]:
    """Contiguous ``(start, stop)`` layer ranges per stage; the last stages take the extra layers when
    ``num_layers`` does not divide (stage 0 also runs the embedding, the last the LM head: they even out a bit).

    Raises:
      ValueError naming ``pipeline_parallel_size`` when some stage would get no layer.
    """
    if pipeline_parallel_size > num_layers:
        raise ValueError(f"pipeline_parallel_size={pipeline_parallel_size} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, pipeline_parallel_size)
    sizes = [base + (1 if s >= pipeline_parallel_size - extra else 0) for s in range(pipeline_parallel_size)]
    starts = np.cumsum([0] + sizes)
    return tuple((int(starts[s]), int(starts[s + 1])) for s in range(pipeline_parallel_size))


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """Layers in contiguous stages over the ``"pp"`` mesh axis, each stage a tp ``ShardingPlan`` on its devices.

    Fields: ``mesh`` (``("pp", "tp")``), ``stage_plans`` (one ``ShardingPlan`` per stage, on that stage's devices as
    a ``(1, tp)`` mesh), ``layer_ranges`` (``stage_layer_ranges``). Hashable (static model data, as a
    ``TensorParallelPlan`` must be).
    """

    mesh: Mesh
    stage_plans: tuple[ShardingPlan, ...]
    layer_ranges: tuple[tuple[int, int], ...]
    # Each stage attends with one block table per sequence: a model mixing sliding-window and full layers keeps
    # every layer's K/V in one group (paged_jax.worker.kv_group_pool.mixes_kv_groups).
    mixes_kv_groups: ClassVar[bool] = False

    @classmethod
    def create(cls, config: ModelConfig, pipeline_parallel_size: int, tensor_parallel_size: int,
               devices: Sequence[jax.Device] | None = None) -> "PipelinePlan":
        if config.mla is not None or config.attention_sinks or (config.moe is not None
                                                                and config.moe.router == "sigmoid_input"):
            what = ("latent attention" if config.mla is not None else "attention sinks and experts"
                    if config.attention_sinks else "fused gate/up experts")
            raise ValueError(f"pipeline_parallel_size={pipeline_parallel_size}: {config.architecture}'s {what} "
                             "have no pipeline-stage layout (tensor_parallel_size splits them)")
        mesh = make_pipeline_mesh(pipeline_parallel_size, tensor_parallel_size, devices)
        if any(device.process_index != jax.process_index() for device in mesh.devices.flat):
            raise ValueError(f"pipeline_parallel_size={pipeline_parallel_size}: the stages hand their hidden states "
                             "over device to device within one process; across hosts use tensor parallelism")
        stage_plans = tuple(
            ShardingPlan.create(config, Mesh(mesh.devices[s][None, :], (DP_AXIS, TP_AXIS)))
            for s in range(pipeline_parallel_size))
        return cls(mesh, stage_plans, stage_layer_ranges(config.num_hidden_layers, pipeline_parallel_size))

    @property
    def pipeline_parallel_size(self) -> int:
        return len(self.stage_plans)

    @property
    def config(self) -> ModelConfig:
        return self.stage_plans[0].config

    @property
    def model_config(self) -> ModelConfig:
        return self.stage_plans[0].model_config

    @property
    def per_device_model_config(self) -> ModelConfig:
        """What one device of the largest stage stores per layer, with that stage's layer count (KV pool sizing)."""
        most = max(stop - start for start, stop in self.layer_ranges)
        return dataclasses.replace(self.stage_plans[0].per_device_model_config, num_hidden_layers=most)

    def stage_of(self, path: tuple) -> int:
        """The stage that holds a model parameter (by its nnx path): its layer's; the embedding on stage 0; the
        final norm and the LM head on the last."""
        names = [str(p) for p in path]
        if "layers" in names:
            layer = int(path[names.index("layers") + 1])
            return next(s for s, (start, stop) in enumerate(self.layer_ranges) if start <= layer < stop)
        return 0 if "embed_tokens" in names else self.pipeline_parallel_size - 1

    # -- models.tensor_parallel.TensorParallelPlan ----------------------------------------------------------------
    def state_shardings(self, state: nnx.State) -> nnx.State:
        """Each leaf's ``NamedSharding`` on its stage's mesh (the stage plan's tp spec)."""
        shardings = []
        for path, leaf in nnx.to_flat_state(state):
            value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
            plan = self.stage_plans[self.stage_of(path)]
            sharding = NamedSharding(plan.mesh, plan.param_spec(path, tuple(value.shape)))
            shardings.append((path, leaf.replace(sharding) if isinstance(leaf, nnx.Variable) else sharding))
        return nnx.from_flat_state(shardings)

    def rewrite_param(self, path: tuple, value, xp=np):
        return self.stage_plans[0].rewrite_param(path, value, xp)  # every stage has the same head layout

    def wrap_attention(self, attention):
        raise ValueError("a pipeline-parallel model runs stage by stage (paged_jax.parallel.pipeline.PipelineForward), "
                         "not as one call")

    def gather_logits(self, logits):
        return self.stage_plans[-1].gather_logits(logits)

    # -- what the ModelRunner asks of its plan ----------------------------------------------------------------------
    @property
    def replicated(self) -> NamedSharding:
        """Where the runner puts host inputs and runs the sampler: the last stage, beside the logits."""
        return self.stage_plans[-1].replicated

    def make_kv_caches(self, num_blocks: int, block_size: int, dtype=jnp.bfloat16, num_layers: int | None = None
                       ) -> list:
        """The KV pool, layer by layer, each layer's pages on its stage's devices (all blocks, kv heads over tp);
        ``num_layers``, if given, must be the model's (the stages keep one KV-cache group)."""
        if num_layers is not None and num_layers != self.config.num_hidden_layers:
            raise ValueError(f"a pipeline's KV pool has one slot per layer ({self.config.num_hidden_layers}), "
                             f"not {num_layers}: KV-cache groups are not split over pipeline stages")
        return [kv for plan, (start, stop) in zip(self.stage_plans, self.layer_ranges)
                for kv in plan.make_kv_caches(num_blocks, block_size, dtype, num_layers=stop - start)]


def load_pipeline_model(args, model_path: str | None, config: ModelConfig, dtype: str, devices, cache_key):
    """``(model, plan, run_config, memory_config)`` for ``paged_jax.worker.model_loader``: every weight loaded (or restored
    from the weights cache under ``cache_key``) straight into its stage's shards."""
    from models import weight_cache
    from models.loader import resolve_dtype
    from models.tensor_parallel import abstract_model, load_sharded_model

    plan = PipelinePlan.create(config, args.pipeline_parallel_size, args.tensor_parallel_size, devices)
    model = weight_cache.load_or_convert(
        cache_key, lambda: load_sharded_model(model_path, plan, dtype=dtype, load_format=args.load_format,
                                              seed=args.seed),
        lambda: abstract_model(plan, resolve_dtype(dtype)), shardings=plan.state_shardings)
    return model, plan, plan.model_config, plan.per_device_model_config


class _Stage(nnx.Module):
    """One stage's modules (shared with the loaded model, nothing copied but a tied LM head): ``embed`` (stage 0),
    ``layers``, ``norm`` and ``head_kernel`` ``[hidden, vocab]`` or ``embedding`` ``[vocab, hidden]`` (last);
    ``config`` (static) for the embedding multiplier and the logits' scaling."""

    def __init__(self, config: ModelConfig, layers, embed=None, norm=None, head_kernel=None, tied_embedding=None):
        self.config = config
        self.layers = nnx.List(layers)
        self.embed = embed
        self.norm = norm
        self.head_kernel = head_kernel
        self.tied_embedding = tied_embedding


class _Staged:
    """A callable with a jitted function's ``_cache_size`` (the runner counts compiles through it)."""

    def __init__(self, call, jitted: Sequence):
        self._call = call
        self._jitted = list(jitted)

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def _cache_size(self) -> int:
        return sum(fn._cache_size() for fn in self._jitted)


def num_microbatches_for(num_tokens: int, pipeline_parallel_size: int, min_microbatch_tokens: int) -> int:
    """Micro-batches of a token bucket: ``pipeline_parallel_size`` equal token ranges when the bucket divides into
    that many of at least ``min_microbatch_tokens`` each, else 1 (the stages run the whole batch one after the
    other)."""
    parts = pipeline_parallel_size
    if parts > 1 and num_tokens % parts == 0 and num_tokens // parts >= min_microbatch_tokens:
        return parts
    return 1


def pipeline_schedule(num_stages: int, num_microbatches: int) -> list[tuple[int, int]]:
    """The dispatch order ``[(stage, micro-batch)]`` of one step: wavefront by wavefront (``stage + micro-batch``
    constant), the upstream stage first within one, so stage s already has micro-batch m + 1 queued when stage s + 1
    is handed micro-batch m. Each stage gets its micro-batches in order (its KV slices thread through them)."""
    return [(stage, wave - stage) for wave in range(num_stages + num_microbatches - 1)
            for stage in range(num_stages) if 0 <= wave - stage < num_microbatches]


def microbatch_attention_metadata(cu_q_lens: jax.Array, kv_lens: jax.Array, start, stop):
    """A step's sequences seen from its tokens ``[start, stop)`` (ints or traced int32[]): ``(cu_q_lens
    int32[S + 1] from 0, kv_lens int32[S])``. A sequence keeps its tokens in the range (a prefill chunk split by the
    boundary becomes two consecutive chunks: the first attends to what it wrote, the second also to the first's K/V,
    written by the earlier micro-batch on the same stage); every other sequence gets q_len 0 and kv_len 0 (the ops'
    padding)."""
    seq_start = jnp.clip(cu_q_lens[:-1], start, stop)
    seq_stop = jnp.clip(cu_q_lens[1:], start, stop)
    q_lens = seq_stop - seq_start
    # Tokens of the sequence after this range are not in its context yet.
    kv = jnp.where(q_lens > 0, kv_lens - (cu_q_lens[1:] - seq_stop), 0)
    cu = jnp.concatenate([jnp.zeros((1,), cu_q_lens.dtype), jnp.cumsum(q_lens).astype(cu_q_lens.dtype)])
    return cu, kv.astype(kv_lens.dtype)


# Fewest tokens per micro-batch: below this a stage's forward is bound by reading its weights rather than by its
# matmuls (about the peak-FLOP/s over HBM-bytes/s ratio of current GPUs in 16-bit), so splitting it would read every
# weight once more per micro-batch and lengthen the step instead of overlapping the stages. Decode steps of modest
# batches therefore stay one batch; prefill and large mixed steps are split.
MIN_MICROBATCH_TOKENS = 256


class PipelineForward:
    """The ``StepForward`` of a ``PipelinePlan``-loaded model (``ModelRunner(..., sharding_plan=plan,
    forward=PipelineForward())``): the forward and prompt logprobs run stage by stage, a large step as micro-batches
    that overlap across stages (see the module docstring); everything else of the step is the runner's.

    ``min_microbatch_tokens`` (default ``MIN_MICROBATCH_TOKENS``): a token bucket is split into
    ``pipeline_parallel_size`` micro-batches when each gets at least this many tokens (``num_microbatches_for``).
    After ``build``: ``num_microbatches`` ``{token bucket: micro-batches}`` (fixed, so warm-up compiles them all) and
    ``stage_fns``, one jitted function per stage, looked up per step (a test may wrap them).
    """

    def __init__(self, min_microbatch_tokens: int | None = None):
        self.min_microbatch_tokens = MIN_MICROBATCH_TOKENS if min_microbatch_tokens is None else min_microbatch_tokens
        self.num_microbatches: dict[int, int] = {}
        self.stage_fns: list = []
        self._stages: list = []  # per stage (graphdef, state treedef, leaves), read by the step functions

    def build(self, runner) -> tuple:
        plan = runner.sharding_plan
        if not isinstance(plan, PipelinePlan):
            raise ValueError("PipelineForward runs a model loaded with a PipelinePlan (sharding_plan)")
        model = nnx.merge(runner._graphdef, jax.tree.unflatten(runner._state_treedef, runner._param_leaves))
        self.num_microbatches = {t: num_microbatches_for(t, plan.pipeline_parallel_size, self.min_microbatch_tokens)
                                 for t, _ in runner.buckets}
        stages = self._stages = _split_stages(model, plan)
        stage_forward = _stage_forward_fn(runner, plan, stages)
        head = _head_fn(plan, stages, runner.layout, runner.dtype)
        static = ("num_tokens", "num_seqs", "stage", "num_microbatches")
        self.stage_fns = [jax.jit(stage_forward, static_argnames=static, donate_argnums=(1,),
                                  compiler_options=runner.compiler_options or None) for _ in stages]
        head_fn = jax.jit(head, static_argnames=("num_tokens", "num_seqs"))
        forward = _Staged(self._pipelined_forward(plan, stages, head_fn), [*self.stage_fns, head_fn])
        return forward, _staged_prompt_logprobs(plan, stages, runner.dtype, runner.max_logprobs)

    def param_leaves_replaced(self, runner) -> None:
        """Run the runner's new ``param_leaves`` (a weight update, ``paged_jax.worker.weight_update``: the same
        shapes and shardings, so nothing compiles): each stage's leaves are taken from them again, a tied LM head
        copied to the last stage again."""
        model = nnx.merge(runner._graphdef, jax.tree.unflatten(runner._state_treedef, runner.param_leaves))
        self._stages[:] = _split_stages(model, runner.sharding_plan)  # the list the step functions read

    def _pipelined_forward(self, plan: PipelinePlan, stages: list, head_fn):
        """The runner's forward over the stages: ``forward(param_leaves, kv_pool, buf, prev_tokens, lora_arrays,
        *, num_tokens, num_seqs) -> (kv_pool leaves, logits, sampling words, hidden)`` as ``ModelRunner``'s, each
        step's micro-batches dispatched in ``pipeline_schedule`` order to ``self.stage_fns``, then ``head_fn``."""
        last = plan.pipeline_parallel_size - 1
        shardings = [stage_plan.replicated for stage_plan in plan.stage_plans]
        # Micro-batch indices, int32[] on each stage's devices, created once (no per-step transfer).
        max_microbatches = max(self.num_microbatches.values())
        microbatch_ids = [[jax.device_put(np.int32(m), sharding) for m in range(max_microbatches)]
                          for sharding in shardings]

        def forward(param_leaves, kv_pool, buf, prev_tokens, lora_arrays=None, *, num_tokens, num_seqs):
            # param_leaves: the whole model's, unused (each stage passes its own); buf (host int32) goes to the last
            # stage (the runner's device) and from there to the others device to device, once per step, as
            # prev_tokens (on the last stage) to stage 0. lora_arrays: always None (EngineArgs refuses enable_lora with
            # pipeline_parallel_size > 1). Nothing here waits for a device: every call and copy is queued on its
            # stage's devices, which run their queues concurrently.
            num_microbatches = self.num_microbatches[num_tokens]
            buf = jax.device_put(buf, shardings[last])  # one host transfer (the runner's device: the last stage)
            bufs = [buf if s == last else jax.device_put(buf, shardings[s]) for s in range(len(stages))]
            pools = [list(kv_pool[start:stop]) for start, stop in plan.layer_ranges]
            first_carry = jax.device_put(prev_tokens, shardings[0])
            handed_on, finished = {}, []  # (stage, micro-batch) -> hidden; the last stage's outputs in order
            for s, m in pipeline_schedule(len(stages), num_microbatches):
                carry = first_carry if s == 0 else jax.device_put(handed_on.pop((s - 1, m)), shardings[s])
                pools[s], hidden = self.stage_fns[s](stages[s][2], pools[s], bufs[s], carry, microbatch_ids[s][m],
                                                     num_tokens=num_tokens, num_seqs=num_seqs, stage=s,
                                                     num_microbatches=num_microbatches)
                if s == last:
                    finished.append(hidden)
                else:
                    handed_on[(s, m)] = hidden
            outs = head_fn(stages[last][2], buf, tuple(finished), num_tokens=num_tokens, num_seqs=num_seqs)
            return ([kv for pool in pools for kv in pool],) + tuple(outs)

        return forward


def _split_stages(model, plan: PipelinePlan) -> list[tuple]:
    """Per stage ``(graphdef, state treedef, state leaves)`` of its ``_Stage``: its layers, the embedding (stage 0),
    the final norm and the LM head (last; a tied head is a copy of the embedding put on the last stage's
    devices)."""
    last = plan.pipeline_parallel_size - 1
    stages = []
    for s, (start, stop) in enumerate(plan.layer_ranges):
        head = tied = None
        if s == last and model.lm_head is not None:
            head = model.lm_head.kernel
        elif s == last:  # tied: the LM head is the embedding, which lives on stage 0
            embedding = model.model.embed_tokens.embedding
            tied = nnx.Param(jax.device_put(embedding[...], NamedSharding(
                plan.stage_plans[s].mesh, plan.stage_plans[s].param_spec(("model", "embed_tokens", "embedding"),
                                                                        tuple(embedding.shape)))))
        stage = _Stage(model.config, [model.model.layers[i] for i in range(start, stop)],
                       embed=model.model.embed_tokens if s == 0 else None,
                       norm=model.model.norm if s == last else None, head_kernel=head, tied_embedding=tied)
        graphdef, state = nnx.split(stage)
        leaves, treedef = jax.tree.flatten(state)
        stages.append((graphdef, treedef, leaves))
    return stages


def _stage_forward_fn(runner, plan: PipelinePlan, stages: list):
    """``stage_forward``, the function each stage's jit traces (one stage on one micro-batch), closing over the
    runner's model config, dtype, layout, pool size and attention implementation as they are now."""
    last = plan.pipeline_parallel_size - 1
    config, dtype = runner.model_config, runner.dtype
    max_blocks, impl = runner.max_blocks_per_seq, runner.attention_impl
    layout_for = runner.layout

    num_blocks = runner.num_blocks

    def stage_forward(leaves, kv_pool, buf, carry, microbatch, *, num_tokens, num_seqs, stage, num_microbatches):
        """One stage on one micro-batch: tokens ``[lo, lo + T / M)``, ``lo = microbatch * T / M`` (``microbatch``
        int32[] on the stage's devices: traced, so every micro-batch runs the same executable). Stage 0: carry =
        the previous step's sampled tokens; others: the micro-batch's hidden states [T / M, hidden].
        -> (kv_pool, hidden [T / M, hidden]), normed on the last stage."""
        graphdef, treedef, _ = stages[stage]
        modules = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        fields = {name: buf[a:b] for name, (a, b) in layout_for(num_tokens, num_seqs).fields.items()}
        size = num_tokens // num_microbatches
        lo = microbatch * size

        def tokens(name):
            return jax.lax.dynamic_slice_in_dim(fields[name], lo, size)

        # Copy-on-write copies before the step's first K/V write into these layers: micro-batch 0 only (later
        # ones drop them: a copy after micro-batch 0's writes would undo them).
        copy_dst = jnp.where(microbatch == 0, fields["copy_dst"], num_blocks)
        kv_pool = apply_block_copies(list(kv_pool), fields["copy_src"], copy_dst)
        cu_q_lens, kv_lens = fields["cu_q_lens"], fields["kv_lens"]
        if num_microbatches > 1:
            cu_q_lens, kv_lens = microbatch_attention_metadata(cu_q_lens, kv_lens, lo, lo + size)
        with matmul_precision(dtype):
            if stage == 0:  # decode rows continuing from the previous step take their input token from it
                prev_rows = tokens("prev_rows")
                x = scale_embedding(config.embedding_multiplier, modules.embed(
                    jnp.where(prev_rows >= 0, carry[jnp.maximum(prev_rows, 0)], tokens("input_ids"))))
            else:
                x = carry
            rope = rope_tables(config, tokens("positions"))
            attention = plan.stage_plans[stage].paged_attention(
                slot_mapping=tokens("slot_mapping"), kv_lens=kv_lens,
                block_tables=fields["block_tables"].reshape(num_seqs, max_blocks), cu_q_lens=cu_q_lens,
                sm_scale=config.head_dim ** -0.5, sliding_window=config.sliding_window, impl=impl)
            start = plan.layer_ranges[stage][0]
            x, residual, new_pool = run_decoder_layers(modules.layers, x, None, rope, kv_pool, attention,
                                                       first_layer_idx=start)
            # The residual stream is folded back at the stage boundary (one array handed on; the next stage's
            # first layer starts it again, as layer 0 does): the same sums as one device.
            return new_pool, (modules.norm(x, residual)[0] if stage == last else x + residual)

    return stage_forward


def _head_fn(plan: PipelinePlan, stages: list, layout_for, dtype):
    """``head``, the function the head's jit traces (the LM head on the last stage's joined micro-batches)."""
    last = plan.pipeline_parallel_size - 1

    def head(leaves, buf, hiddens, *, num_tokens, num_seqs):
        """The last stage's micro-batches' normed hidden states joined -> (logits f32[R, V] at each row's last
        token, sampling words, final hidden states [T, hidden]) as ``ModelRunner``'s forward."""
        modules = nnx.merge(stages[last][0], jax.tree.unflatten(stages[last][1], leaves))
        fields = {name: buf[a:b] for name, (a, b) in layout_for(num_tokens, num_seqs).fields.items()}
        hidden = jnp.concatenate(hiddens) if len(hiddens) > 1 else hiddens[0]
        with matmul_precision(dtype):
            logits = _logits(modules, hidden[fields["logits_indices"]], dtype)
        return plan.gather_logits(logits), fields["sampling"], hidden

    return head


def _staged_prompt_logprobs(plan: PipelinePlan, stages: list, dtype, max_logprobs: int) -> _Staged:
    """The runner's prompt logprobs on the last stage: ``(param_leaves (unused), hidden [T, hidden], targets) ->``
    as ``ModelRunner``'s, jitted over the last stage's own weights."""
    last = plan.pipeline_parallel_size - 1

    def prompt_logprobs(leaves, hidden, targets):
        modules = nnx.merge(stages[last][0], jax.tree.unflatten(stages[last][1], leaves))
        with matmul_precision(dtype):
            return prompt_logprobs_on_device(lambda h: plan.gather_logits(_logits(modules, h, dtype)), hidden,
                                             targets, num_logprobs=max_logprobs)

    jitted = jax.jit(prompt_logprobs)
    return _Staged(lambda _param_leaves, hidden, targets: jitted(stages[last][2], hidden, targets), [jitted])


def _logits(stage: _Stage, hidden: jax.Array, dtype) -> jax.Array:
    """The LM head on the last stage: ``LlamaForCausalLM.compute_logits`` (tied or untied) on its own weights."""
    weight = stage.head_kernel[...] if stage.head_kernel is not None else stage.tied_embedding[...].T
    return scale_logits(stage.config, jnp.dot(hidden.astype(dtype), weight.astype(dtype),
                                               preferred_element_type=jnp.float32))
