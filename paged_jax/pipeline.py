"""Pipeline parallelism (``--pipeline-parallel-size``): contiguous layer stages, each on its own devices.

The engine's devices form a ``("pp", "tp")`` mesh (``make_pipeline_mesh``); stage s owns the devices at pp index s
and, on them, a ``(dp=1, tp)`` ``ShardingPlan`` (so tensor parallelism inside a stage is exactly the tp engine's):
its layers' weights in their tp shards, and its layers' part of the KV pool (every stage has all KV blocks for its
own layers, so the block tables are the same for every stage). Stage 0 also holds the embedding, the last stage the
final norm and the LM head (with tied embeddings, a copy of the embedding). Layers split as evenly as possible,
earlier stages taking one fewer when they do not divide (``stage_layer_ranges``).

``PipelinePlan`` is the layout: it places every parameter on its stage's mesh at load time (it implements the
``models.tensor_parallel.TensorParallelPlan`` protocol, so ``load_sharded_model`` and the weights cache put each
tensor straight into its stage's shards) and creates the staged KV pool. ``PipelineModelRunner`` is the
``ModelRunner`` whose forward runs stage by stage: one jitted function per stage and bucket (embedding + its layers
on stage 0, its layers in between, its layers + norm + logits on the last), the hidden states ``[T, hidden]`` copied
device to device between stages, the step's metadata buffer copied from the last stage (where the runner puts it,
beside the sampler) to the others. Everything else (buckets, sampler, warm-up of every shape, donated KV pools, no
compile after warm-up) is the ``ModelRunner``'s.

Overlap: every call is dispatched asynchronously, so the host builds the next step while the stages run, and with
``async_scheduling`` the next step is dispatched before the current one's tokens are fetched; stages of one step
still run one after the other (one batch in flight, not vLLM's one scheduled batch per stage). Swap preemption is
refused (its copies would span the stages' devices; ``EngineArgs`` checks it), and so are stages on other processes
(multi-host: use tensor parallelism across hosts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from models.config import ModelConfig
from models.llama import matmul_precision, rope_cos_sin, rope_inv_freq
from paged_jax.model_runner import ModelRunner
from paged_jax.parallel.mesh import DP_AXIS, TP_AXIS
from paged_jax.parallel.plan import ShardingPlan

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

    @classmethod
    def create(cls, config: ModelConfig, pipeline_parallel_size: int, tensor_parallel_size: int,
               devices: Sequence[jax.Device] | None = None) -> "PipelinePlan":
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
        raise ValueError("a pipeline-parallel model runs stage by stage (paged_jax.pipeline.PipelineModelRunner), "
                         "not as one call")

    def gather_logits(self, logits):
        return self.stage_plans[-1].gather_logits(logits)

    # -- what the ModelRunner asks of its plan ----------------------------------------------------------------------
    @property
    def replicated(self) -> NamedSharding:
        """Where the runner puts host inputs and runs the sampler: the last stage, beside the logits."""
        return self.stage_plans[-1].replicated

    def make_kv_caches(self, num_blocks: int, block_size: int, dtype=jnp.bfloat16) -> list:
        """The KV pool, layer by layer, each layer's pages on its stage's devices (all blocks, kv heads over tp)."""
        return [kv for plan, (start, stop) in zip(self.stage_plans, self.layer_ranges)
                for kv in plan.make_kv_caches(num_blocks, block_size, dtype, num_layers=stop - start)]


def load_pipeline_model(args, model_path: str | None, config: ModelConfig, dtype: str, devices, cache_key):
    """``(model, plan, run_config, memory_config)`` for ``paged_jax.model_loader``: every weight loaded (or restored
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


def runner_class(plan) -> type[ModelRunner]:
    """The runner for a loaded model's plan: ``PipelineModelRunner`` for a ``PipelinePlan``."""
    return PipelineModelRunner if isinstance(plan, PipelinePlan) else ModelRunner


class _Stage(nnx.Module):
    """One stage's modules (shared with the loaded model, nothing copied but a tied LM head): ``embed`` (stage 0),
    ``layers``, ``norm`` and ``head_kernel`` ``[hidden, vocab]`` or ``embedding`` ``[vocab, hidden]`` (last)."""

    def __init__(self, layers, embed=None, norm=None, head_kernel=None, tied_embedding=None):
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


class PipelineModelRunner(ModelRunner):
    """A ``ModelRunner`` over a ``PipelinePlan``-loaded model (``sharding_plan=plan``): its forward and prompt
    logprobs run stage by stage (see the module docstring); everything else is inherited."""

    def _build_jitted(self) -> None:
        super()._build_jitted()  # the sampler and the rest; the forward and prompt logprobs are replaced below
        plan: PipelinePlan = self.sharding_plan
        model = nnx.merge(self._graphdef, jax.tree.unflatten(self._state_treedef, self._param_leaves))
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
            stage = _Stage([model.model.layers[i] for i in range(start, stop)],
                           embed=model.model.embed_tokens if s == 0 else None,
                           norm=model.model.norm if s == last else None, head_kernel=head, tied_embedding=tied)
            graphdef, state = nnx.split(stage)
            leaves, treedef = jax.tree.flatten(state)
            stages.append((graphdef, treedef, leaves))
        config, dtype, max_blocks, impl = self.model_config, self.dtype, self.max_blocks_per_seq, self.attention_impl
        inv_freq = rope_inv_freq(config.head_dim, float(config.rope_theta), None if config.rope_scaling is None
                                 else tuple(sorted(config.rope_scaling.items())))
        layout_for = self._layout

        def stage_forward(leaves, kv_pool, buf, carry, *, num_tokens, num_seqs, stage):
            """Stage 0: carry = the previous step's sampled tokens; others: the hidden states [T, hidden].
            -> (kv_pool, hidden [T, hidden]) or, on the last stage, (kv_pool, logits f32[R, V], sampling words,
            final hidden states [T, hidden]) as ``ModelRunner``'s forward."""
            graphdef, treedef, _ = stages[stage]
            modules = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
            fields = {name: buf[a:b] for name, (a, b) in layout_for(num_tokens, num_seqs).fields.items()}
            with matmul_precision(dtype):
                if stage == 0:  # decode rows continuing from the previous step take their input token from it
                    prev_rows = fields["prev_rows"]
                    input_ids = jnp.where(prev_rows >= 0, carry[jnp.maximum(prev_rows, 0)], fields["input_ids"])
                    x = modules.embed(input_ids)
                else:
                    x = carry
                rope = rope_cos_sin(fields["positions"], inv_freq)
                attention = plan.stage_plans[stage].paged_attention(
                    slot_mapping=fields["slot_mapping"], kv_lens=fields["kv_lens"],
                    block_tables=fields["block_tables"].reshape(num_seqs, max_blocks), cu_q_lens=fields["cu_q_lens"],
                    sm_scale=config.head_dim ** -0.5, sliding_window=config.sliding_window, impl=impl)
                start = plan.layer_ranges[stage][0]
                new_pool = []
                for j, layer in enumerate(modules.layers):
                    x, kv_layer = layer(start + j, x, rope, kv_pool[j], attention)
                    new_pool.append(kv_layer)
                if stage != last:
                    return new_pool, x
                hidden = modules.norm(x)
                logits = _logits(modules, hidden[fields["logits_indices"]], dtype)
            return new_pool, plan.gather_logits(logits), fields["sampling"], hidden

        stage_fns = [jax.jit(stage_forward, static_argnames=("num_tokens", "num_seqs", "stage"), donate_argnums=(1,))
                     for _ in stages]
        shardings = [stage_plan.replicated for stage_plan in plan.stage_plans]

        def forward(param_leaves, kv_pool, buf, prev_tokens, lora_arrays=None, *, num_tokens, num_seqs):
            # param_leaves: the whole model's, unused (each stage passes its own); buf and prev_tokens are on the
            # last stage (the runner's device), copied to the others device to device. lora_arrays: always None
            # (EngineArgs refuses enable_lora with pipeline_parallel_size > 1).
            new_pool, carry = [], jax.device_put(prev_tokens, shardings[0])
            for s, (start, stop) in enumerate(plan.layer_ranges):
                stage_buf = buf if s == last else jax.device_put(buf, shardings[s])
                if s > 0:
                    carry = jax.device_put(carry, shardings[s])
                out = stage_fns[s](stages[s][2], kv_pool[start:stop], stage_buf, carry, num_tokens=num_tokens,
                                   num_seqs=num_seqs, stage=s)
                new_pool += out[0]
                carry = out[1]
            return (new_pool,) + tuple(out[1:])

        self._forward = _Staged(forward, stage_fns)
        from paged_jax.prompt_logprobs import prompt_logprobs_on_device

        max_logprobs = self.max_logprobs

        def prompt_logprobs(leaves, hidden, targets):
            modules = nnx.merge(stages[last][0], jax.tree.unflatten(stages[last][1], leaves))
            with matmul_precision(dtype):
                return prompt_logprobs_on_device(lambda h: plan.gather_logits(_logits(modules, h, dtype)), hidden,
                                                 targets, num_logprobs=max_logprobs)

        jitted = jax.jit(prompt_logprobs)
        self._prompt_logprobs = _Staged(lambda _param_leaves, hidden, targets: jitted(stages[last][2], hidden,
                                                                                      targets), [jitted])


def _logits(stage: _Stage, hidden: jax.Array, dtype) -> jax.Array:
    """The LM head on the last stage: ``LlamaForCausalLM.compute_logits`` (tied or untied) on its own weights."""
    weight = stage.head_kernel[...] if stage.head_kernel is not None else stage.tied_embedding[...].T
    return jnp.dot(hidden.astype(dtype), weight.astype(dtype), preferred_element_type=jnp.float32)
