"""``ShardingPlan``: how one model runs on a ``(dp, tp)`` mesh (parameter PartitionSpecs, the head rewrite, the
KV pool's sharding and head-parallel attention under ``shard_map``).

Layout (Megatron-style, over the mesh axis ``"tp"``):

* q/k/v projections and the MLP gate/up projections are column-parallel (output features split over tp), o_proj and
  down_proj are row-parallel (input features split), so each attention block and each MLP ends in exactly one
  all-reduce, which XLA's SPMD partitioner inserts from the shardings alone.
* The embedding table is vocabulary-parallel (``[V/tp, H]`` per device) and so is the LM head (``[H, V/tp]``);
  logits come out vocabulary-sharded and are gathered (``ShardingPlan.gather_logits``) before sampling.
* Norm scales and the o_proj bias are replicated.
* Mixture-of-experts layers (``models.moe``): every device holds every expert, each expert split as a dense MLP is
  (gate/up ``[E, H, I]`` over I, down ``[E, I, H]`` over I: one all-reduce per layer); the router is replicated.
  With ``expert_parallel`` each device holds ``E / tp`` whole experts instead (split over E) and the sparse layers
  run them under ``shard_map`` (``paged_jax.parallel.expert_parallel``: one all-reduce per layer too; where dp > 1
  ``E / (dp x tp)`` each, the tokens all-gathered over dp, the sums reduce-scattered over dp and all-reduced over
  tp); so do Llama 4's width-split experts, whose fused gate/up columns ``rewrite_param`` lays out per device.
  Shared experts split as a dense MLP.
* The paged KV pool ``[num_blocks, block_size, Hkv, D]`` is sharded over its KV-head axis; attention runs under
  ``shard_map`` so each device runs the kernel (or the jnp reference) on its own q heads and its own KV shard.
  Latent attention (DeepSeek's MLA, ``models.mla``): the q heads split (q / q_b, kv_b and o projections), the
  latent projections and the latent cache (one KV head) are whole on every device (``splits_kv_heads``).
* Heads that do not divide tp are rewritten into an equivalent layout (``head_layout.HeadLayout``); the rewritten
  shape is ``ShardingPlan.model_config``: build the model and the KV pool from it.

Data parallelism (mesh axis ``"dp"``): weights are replicated over dp (but whole experts under ``expert_parallel``,
split over dp x tp); the flat token batch, the attention metadata and the KV pool's block axis are split over dp, so
each dp group owns ``num_blocks / dp`` blocks addressed by *local* block ids (local block 0 is that group's null
block) and its own sequences. This is a model-level layout (used by ``benchmarks/sharding.py``); the engine runs
dp = 1.

The plan implements ``models.tensor_parallel.TensorParallelPlan``: ``models.tensor_parallel`` builds, shards and
loads the model that runs on it (``TensorParallelLlamaForCausalLM``, ``shard_model``, ``load_sharded_model``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models.config import ModelConfig
from models.llama import AttentionFn
from models.moe import EXPERT_SCALES
from paged_jax.parallel.expert_parallel import ExpertParallel, check_expert_parallel, expert_axes
from paged_jax.parallel.head_layout import HeadLayout
from paged_jax.parallel.mesh import DP_AXIS, TP_AXIS

KV_LAYOUTS = ("sharded", "replicated")


def _param_kind(path: tuple) -> str:
    """Classify a model parameter by its nnx path, e.g. ('model', 'layers', 0, 'self_attn', 'q_proj', 'kernel')."""
    names = [str(p) for p in path]
    leaf = names[-1]
    if names[-2:] == ["embed_tokens", "embedding"]:
        return "embedding"
    if names[0] == "lm_head" and leaf == "kernel":
        return "lm_head"
    if leaf == "scale":
        return "norm"
    if len(names) >= 3 and names[-3] in _BLOCKS and leaf in ("kernel", "bias", *_QUANT_LEAF_DIMS):
        return f"{names[-2]}.{leaf}"
    if leaf == "e_score_correction_bias":
        return "norm"  # DeepSeek-V3's router bias: replicated with its router
    if len(names) >= 3 and names[-3:-1] == ["mlp", "experts"]:
        return f"experts.{leaf}"
    if names[-2:] == ["self_attn", "kv_scale"]:
        return "norm"  # per-layer FP8 KV-cache scales: replicated
    if names[-2:] == ["self_attn", "sinks"]:
        return "sinks"  # gpt-oss's attention-sink logits [Hq]: split with their q heads
    raise ValueError(f"no sharding rule for model parameter {'.'.join(names)}")


# The modules whose projections the rules below name: attention, the MLP, a sparse MLP's shared experts (DeepSeek's
# shared_experts, Llama 4's shared_expert: dense MLPs, split as one).
_BLOCKS = ("self_attn", "mlp", "shared_experts", "shared_expert")
# Megatron rules: which tensor dim of each parameter kind is split over tp (None = replicated). Latent attention
# (models.mla): the q and kv_b projections are split by heads, the latent's (q_a, kv_a) replicated, as its cache.
_ATTENTION_KINDS = {"q_proj.kernel": 1, "k_proj.kernel": 1, "v_proj.kernel": 1, "q_proj.bias": 0,
                    "k_proj.bias": 0, "v_proj.bias": 0, "o_proj.kernel": 0, "o_proj.bias": None,
                    "q_a_proj.kernel": None, "q_b_proj.kernel": 1, "kv_a_proj_with_mqa.kernel": None,
                    "kv_b_proj.kernel": 1, "sinks": 0}
_MLP_KINDS = {"gate_proj.kernel": 1, "up_proj.kernel": 1, "down_proj.kernel": 0,
              # a sparse layer: its router (Llama 4's and gpt-oss's "router"), and its experts stacked [E, in, out]
              # (models.moe; Llama 4's gate_up_proj [E, H, 2I], laid out per device by ShardingPlan.rewrite_param;
              # gpt-oss's interleaved gate/up, its biases and MXFP4 blocks [E, out, in / 32, 16] / scales
              # [E, out, in / 32], split by the expert width, the down bias added once: models.gpt_oss)
              "gate.kernel": None, "router.kernel": None, "router.bias": None, "experts.gate_proj": 2,
              "experts.up_proj": 2, "experts.down_proj": 1, "experts.gate_up_proj": 2,
              "experts.gate_up_proj_bias": 1, "experts.down_proj_bias": None, "experts.gate_up_proj_blocks": 1,
              "experts.gate_up_proj_scales": 1, "experts.down_proj_blocks": 2, "experts.down_proj_scales": 2}
_OTHER_KINDS = {"embedding": 0, "lm_head": 1, "norm": None}
# Block-FP8 experts' scales [E, out blocks, in blocks] (models.moe): split with their experts, under expert
# parallelism only (ShardingPlan.create refuses the other layouts).
_EXPERT_SCALE_KINDS = {f"experts.{name}" for name in EXPERT_SCALES}
# Quantized projections (models.quantization.linear): the split dim of each leaf in a column-parallel (output split)
# and a row-parallel (input split) layer. Packed integer weights are packed along the inputs, so rows stay
# contiguous; scales / zero points of a row-parallel layer are replicated (act-order groups scatter over rows).
# FP8 weights are stored [out, in] (models.quantization.linear.Fp8Linear).
_QUANT_LEAF_DIMS = {"qweight": (1, 0), "scales": (1, None), "zeros": (1, None), "g_idx": (None, 0),
                    "weight": (0, 1), "weight_scale": (0, None), "input_scale": (None, None)}
_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Everything needed to run one model on a ``(dp, tp)`` mesh; a ``models.tensor_parallel.TensorParallelPlan``.

    Build with ``ShardingPlan.create(config, mesh)``. Fields:
      mesh: the ``("dp", "tp")`` mesh.
      config: the checkpoint's model shape.
      model_config: the shape actually built and run (``config`` with heads rewritten by ``head_layout``); the KV
        pool has ``model_config.num_key_value_heads`` heads.
      head_layout: see ``HeadLayout``.
      kv_layout: "sharded" (attention weights and the KV pool split over kv heads; attention under shard_map) or
        "replicated" (the whole attention block and the KV pool replicated on every tp device; only the MLP,
        embedding and LM head are split).
      expert_parallel: the experts of sparse layers split over tp (dp x tp where dp > 1) along the expert axis
        (each device holds ``num_experts / tp`` whole experts, ``num_experts / (dp x tp)``; ``moe_experts``) instead
        of along their width.
    """

    mesh: Mesh
    config: ModelConfig
    model_config: ModelConfig
    head_layout: HeadLayout
    kv_layout: str = "sharded"
    expert_parallel: bool = False
    # A layer of a KV-cache group attends through its group's block tables (``shard_attention`` passes them).
    mixes_kv_groups: ClassVar[bool] = True

    @classmethod
    def create(cls, config: ModelConfig, mesh: Mesh, *, kv_layout: str = "sharded",
               pad_heads: bool = True, expert_parallel: bool = False) -> "ShardingPlan":
        """ValueError for a mesh of other axes, an unknown ``kv_layout``, or a model the layout does not fit
        (``_check_shardable``: block-FP8 experts split by width, ``expert_parallel`` on experts that do not split
        over tp, latent attention's heads or Llama 4's / gpt-oss's expert width not divisible by tp)."""
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
        if tuple(mesh.axis_names) != (DP_AXIS, TP_AXIS):
            raise ValueError(f"mesh axes must be {(DP_AXIS, TP_AXIS)} (use make_mesh), got {mesh.axis_names}")
        tp = mesh.shape[TP_AXIS]
        _check_shardable(config, tp, expert_parallel, mesh.shape[DP_AXIS])
        if config.mla is not None:  # one latent KV head, replicated: the q heads split as they are
            layout = HeadLayout(tp, config.num_attention_heads, 1, 1, config.num_attention_heads)
        elif kv_layout == "sharded":
            layout = HeadLayout.for_heads(config.num_attention_heads, config.num_key_value_heads, tp,
                                          pad_heads=pad_heads)
        else:  # attention is not split, the heads stay as they are
            group = config.num_attention_heads // config.num_key_value_heads
            layout = HeadLayout(tp, config.num_attention_heads, config.num_key_value_heads, 1, group)
        model_config = dataclasses.replace(
            config, num_attention_heads=layout.num_q_heads_padded, num_key_value_heads=layout.num_kv_heads_padded
        )
        return cls(mesh, config, model_config, layout, kv_layout, bool(expert_parallel))

    @property
    def tensor_parallel_size(self) -> int:
        return self.mesh.shape[TP_AXIS]

    @property
    def splits_kv_heads(self) -> bool:
        """Whether the KV pool (and the k / v an attention gets) is split over tp by kv heads: the "sharded"
        layout, but for a latent cache (multi-head latent attention), whose one KV head every device holds whole
        (each device's q heads attend over all of it, as vLLM's MLA under tensor parallelism)."""
        return self.kv_layout == "sharded" and self.config.mla is None

    @property
    def data_parallel_size(self) -> int:
        return self.mesh.shape[DP_AXIS]

    @property
    def moe_experts(self) -> ExpertParallel | None:
        """What the sparse layers run their experts through (``SparseMoeBlock.expert_parallel``): an
        ``ExpertParallel`` over tp (dp x tp where dp > 1: ``expert_axes``) with ``expert_parallel``; for Llama 4's
        and gpt-oss's fused gate/up experts one over their width (``ExpertParallel.whole_experts`` False); else None
        (XLA partitions the width-split experts). Where dp > 1 the tokens are split over dp (``token_axis``)."""
        token_axis = DP_AXIS if self.data_parallel_size > 1 else None
        if self.expert_parallel:
            return ExpertParallel(self.mesh, expert_axes(self.data_parallel_size), token_axis=token_axis)
        if (_fused_gate_up(self.config) or _gpt_oss_experts(self.config)) and self.tensor_parallel_size > 1:
            return ExpertParallel(self.mesh, whole_experts=False, token_axis=token_axis)
        return None

    # -- parameters --------------------------------------------------------------------------------------------------

    def param_spec(self, path: tuple, shape: tuple[int, ...]) -> P:
        """PartitionSpec of one parameter of the (rewritten) model, by its nnx path and shape.

        A dimension that tp does not divide (e.g. an odd vocabulary) is replicated instead of split.
        Raises ValueError for a parameter no rule covers, so a new parameter is never silently replicated.
        """
        kind = _param_kind(path)
        proj, _, leaf = kind.partition(".")
        if leaf in _QUANT_LEAF_DIMS:
            split_dim = _QUANT_LEAF_DIMS[leaf][0 if proj in _COLUMN_PARALLEL else 1]
            if self.kv_layout != "sharded" and proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                split_dim = None
        elif kind in _ATTENTION_KINDS:
            split_dim = _ATTENTION_KINDS[kind] if self.kv_layout == "sharded" else None
        elif self.expert_parallel and (kind.startswith("experts.") and kind in _MLP_KINDS
                                       or kind in _EXPERT_SCALE_KINDS):  # whole experts (block-FP8 scales too)
            experts = self.moe_experts
            return P(experts.axis, *[None] * (len(shape) - 1)) if shape[0] % experts.size == 0 else P()
        elif kind in _MLP_KINDS:
            split_dim = _MLP_KINDS[kind]
        elif kind in _OTHER_KINDS:
            split_dim = _OTHER_KINDS[kind]
        else:
            raise ValueError(f"no sharding rule for model parameter {'.'.join(map(str, path))} ({kind})")
        if split_dim is None or shape[split_dim] % self.tensor_parallel_size != 0:
            return P()
        return P(*[TP_AXIS if dim == split_dim else None for dim in range(len(shape))])

    def state_shardings(self, state: nnx.State) -> nnx.State:
        """NamedSharding for every leaf of a model state (concrete or abstract), same tree structure."""
        flat = nnx.to_flat_state(state)
        shardings = []
        for path, leaf in flat:
            value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
            sharding = NamedSharding(self.mesh, self.param_spec(path, tuple(value.shape)))
            shardings.append((path, leaf.replace(sharding) if isinstance(leaf, nnx.Variable) else sharding))
        return nnx.from_flat_state(shardings)

    def rewrite_param(self, path: tuple, value, xp=np):
        """Apply the head rewrite to one parameter in model layout (``[in, out]`` kernels) of the ``config`` shape:
        host (``xp=np``) or traced (``xp=jnp``). Depends only on the parameter's kind, never on its layer."""
        kind = _param_kind(path)
        if kind == "experts.gate_up_proj" and _fused_gate_up(self.config) and not self.expert_parallel:
            return _gate_up_per_device(value, self.tensor_parallel_size, xp)
        if self.head_layout.is_identity:
            return value
        head_dim = self.config.head_dim
        if kind == "sinks":  # one logit per q head
            return self.head_layout.expand_q_columns(value, 1, xp)
        if kind in ("q_proj.kernel", "q_proj.bias"):
            return self.head_layout.expand_q_columns(value, head_dim, xp)
        if kind in ("k_proj.kernel", "k_proj.bias", "v_proj.kernel", "v_proj.bias"):
            return self.head_layout.expand_kv_columns(value, head_dim, xp)
        if kind == "o_proj.kernel":
            return self.head_layout.expand_q_rows(value, head_dim, xp)
        return value

    # -- KV pool, activations ----------------------------------------------------------------------------------------

    @property
    def kv_cache_spec(self) -> P:
        """Spec of one ``[num_blocks, block_size, Hkv', D]`` page array: blocks over dp, kv heads over tp
        (``splits_kv_heads``)."""
        return P(DP_AXIS, None, TP_AXIS if self.splits_kv_heads else None, None)

    @property
    def kv_cache_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.kv_cache_spec)

    @property
    def num_kv_heads_per_device(self) -> int:
        """KV heads each device stores (the KV pool's per-device head count)."""
        heads = self.model_config.num_key_value_heads
        return heads // self.tensor_parallel_size if self.splits_kv_heads else heads

    @property
    def per_device_model_config(self) -> ModelConfig:
        """``model_config`` with the per-device head counts and MLP width: what one device stores and computes, for
        memory accounting (e.g. ``determine_num_blocks(plan.per_device_model_config, ...)`` sizes the KV pool
        by the bytes each device holds)."""
        tp = self.tensor_parallel_size
        if self.kv_layout == "replicated":
            heads = {}
        else:
            heads = {"num_attention_heads": self.model_config.num_attention_heads // tp,
                     "num_key_value_heads": self.num_kv_heads_per_device}
        inter = self.model_config.intermediate_size
        return dataclasses.replace(self.model_config, intermediate_size=inter // tp if inter % tp == 0 else inter,
                                   **heads)

    @property
    def token_sharding(self) -> NamedSharding:
        """Flat per-token inputs (``input_ids``, ``positions``, metadata with a leading token/sequence axis)."""
        return NamedSharding(self.mesh, P(DP_AXIS))

    @property
    def logits_sharding(self) -> NamedSharding:
        """Logits ``[N, V]`` gathered over tp (rows stay split over dp) so sampling sees the whole vocabulary."""
        return NamedSharding(self.mesh, P(DP_AXIS, None))

    def gather_logits(self, logits: jax.Array) -> jax.Array:
        """Call on ``model.compute_logits(hidden)`` inside jit: ``float32[N, V]`` -> the same, gathered over tp.

        The first constraint pins the LM-head matmul's output to vocabulary shards (so each device multiplies by
        its own ``[H, V/tp]`` slice); the second gathers the ``[N, V]`` logits. Without it XLA may gather the whole
        ``[H, V]`` LM head instead when N is small.
        """
        rows = DP_AXIS if logits.shape[0] % self.data_parallel_size == 0 else None
        if logits.shape[-1] % self.tensor_parallel_size == 0:  # else the LM head is replicated (param_spec)
            logits = jax.lax.with_sharding_constraint(logits, NamedSharding(self.mesh, P(rows, TP_AXIS)))
        return jax.lax.with_sharding_constraint(logits, NamedSharding(self.mesh, P(rows, None)))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def make_kv_caches(self, num_blocks: int, block_size: int, dtype=jnp.bfloat16,
                       num_layers: int | None = None) -> list[tuple[jax.Array, jax.Array]]:
        """Zeroed paged KV pool, one ``(k_pages, v_pages)`` per layer (``num_layers``, default all of the model's;
        a pipeline stage holds only its own), created directly in its shards.

        ``num_blocks`` is the total over dp groups (each group gets ``num_blocks / dp``, its local block 0 null).
        """
        if num_blocks % self.data_parallel_size != 0:
            raise ValueError(f"num_blocks ({num_blocks}) must be divisible by data_parallel_size "
                             f"({self.data_parallel_size})")
        # K and V widths: a latent cache's V pool has none (ModelConfig.kv_pool_head_dims).
        k_shape, v_shape = ((num_blocks // self.data_parallel_size, block_size, self.num_kv_heads_per_device, dim)
                            for dim in self.model_config.kv_pool_head_dims)
        # Created by a shard_map inside jit, exactly as the attention's shard_map returns the pages, so the pool
        # has the very sharding a step returns (jax normalizes specs, e.g. drops size-1 axes): feeding a step's
        # output back never looks like a new input sharding to jit (no recompile).
        spec = self.kv_cache_spec
        create = jax.jit(jax.shard_map(lambda: (jnp.zeros(k_shape, dtype), jnp.zeros(v_shape, dtype)),
                                       mesh=self.mesh, in_specs=(), out_specs=(spec, spec), check_vma=False))
        return [create() for _ in range(self.model_config.num_hidden_layers if num_layers is None else num_layers)]

    # -- attention ---------------------------------------------------------------------------------------------------

    def shard_attention(self, local_attention: Callable[..., tuple[jax.Array, Any]], metadata: Any = (),
                        metadata_specs: Any = None) -> AttentionFn:
        """Wrap a per-device attention into a mesh-wide ``AttentionFn`` (``shard_map`` over dp and tp).

        Args:
          local_attention: ``(layer_idx, q[T/dp, Hq'/tp, D], k[T/dp, Hkv'/tp, D], v, kv_layer_shard, metadata_shard)
            -> (out[T/dp, Hq'/tp, D], kv_layer_shard)``: the kernel or reference on one device's heads, tokens and
            KV shard (with the "replicated" layout, all heads). It sees ordinary local arrays. For a model whose
            layers attend differently it also gets the layer's ``sm_scale=, sliding_window=, logit_soft_cap=``
            keywords (``models.attention_fn.LayerAttention``), and with attention sinks ``sinks=`` (``[Hq'/tp]``, its
            q heads' logits).
          metadata: pytree of arrays passed to every call (block tables, lengths, slot mapping, segment ids, ...).
          metadata_specs: their PartitionSpecs; default ``P("dp")`` for every leaf (leading axis split over dp, i.e.
            each dp group gets its own sequences' metadata; with dp = 1 that is plain replication).
        Returns:
          ``attention(layer_idx, q, k, v, kv_layer, **layer_attention) -> (out, kv_layer)`` for
          ``LlamaForCausalLM.__call__`` (``takes_layer_attention``); ``kv_layer`` is None or a pytree of page arrays
          sharded as ``kv_cache_spec``.
        """
        token_spec = P(DP_AXIS, TP_AXIS if self.kv_layout == "sharded" else None, None)
        kv_token_spec = P(DP_AXIS, TP_AXIS if self.splits_kv_heads else None, None)  # k, v [T, Hkv', D]
        sinks_spec = P(token_spec[1])  # attention sinks [Hq']: with their q heads
        if metadata_specs is None:
            metadata_specs = jax.tree.map(lambda _: P(DP_AXIS), metadata)
        mesh = self.mesh
        kv_spec = self.kv_cache_spec

        def attention(layer_idx: int, q: jax.Array, k: jax.Array, v: jax.Array, kv_layer, sinks=None,
                      **layer_attention):
            if kv_layer is not None and len(kv_layer) == 3:
                # A KV-cache group's layer (paged_jax.worker.kv_group_pool): its group's block tables and slots
                # travel with its pages, split over dp as the step's other metadata; the pages come back alone.
                pages_specs = (kv_spec, kv_spec)
                in_kv_specs = (*pages_specs, jax.tree.map(lambda _: P(DP_AXIS), kv_layer[2]))
            else:
                pages_specs = in_kv_specs = jax.tree.map(lambda _: kv_spec, kv_layer)

            def per_device(q, k, v, kv_layer, metadata, sinks):
                sink_option = {} if sinks is None else {"sinks": sinks}  # the device's q heads' sinks
                return local_attention(layer_idx, q, k, v, kv_layer, metadata, **layer_attention, **sink_option)

            # check_vma off: kernels (Pallas/Triton) carry no varying-axis annotations; the specs are exact anyway.
            sharded = jax.shard_map(
                per_device, mesh=mesh, out_specs=(token_spec, pages_specs), check_vma=False,
                in_specs=(token_spec, kv_token_spec, kv_token_spec, in_kv_specs, metadata_specs, sinks_spec),
            )
            return sharded(q, k, v, kv_layer, metadata, sinks)

        attention.runs_on_mesh = mesh  # wrap_attention passes it through unwrapped
        attention.takes_layer_attention = attention.takes_attention_sinks = True
        return attention

    def wrap_attention(self, attention: AttentionFn) -> AttentionFn:
        """Run an ordinary single-device ``AttentionFn`` on each device's heads (tp only, dp = 1).

        ``attention`` is written for one device (e.g. ``write_kv`` + ``ragged_paged_attention`` closing over its
        metadata); inside ``shard_map`` it sees ``q[T, Hq'/tp, D]``, ``k, v[T, Hkv'/tp, D]`` and the local KV shard
        ``[num_blocks, block_size, Hkv'/tp, D]``, and what it closes over (block tables, lengths, slot mapping) is
        read as replicated. ``TensorParallelLlamaForCausalLM`` applies this automatically, so ``generate`` and other
        callers need no attention changes.

        Limitation (jax's): the arrays the closure captures must not descend from jit inputs committed to the mesh
        (``jax.device_put(x, NamedSharding(...))``): jax refuses to index such an array inside ``shard_map``.
        Pass host metadata uncommitted (numpy, or computed inside the jit), or build the attention with
        ``paged_attention`` / ``shard_attention``, which take the metadata as explicit ``shard_map`` inputs (the
        engine's runner does that).
        Raises ValueError for dp > 1 (the metadata would have to be split; use ``shard_attention``).
        """
        if getattr(attention, "runs_on_mesh", None) is not None:
            return attention
        if self.data_parallel_size != 1:
            raise ValueError(
                f"data_parallel_size={self.data_parallel_size}: a single-device attention cannot be split over dp; "
                f"build it with ShardingPlan.shard_attention / paged_attention"
            )
        wrapped = self.shard_attention(lambda layer_idx, q, k, v, kv_layer, _, **options: attention(
            layer_idx, q, k, v, kv_layer, **options))
        # The options reach ``attention`` as given: it takes them only if it declares so.
        wrapped.takes_layer_attention = getattr(attention, "takes_layer_attention", False)
        wrapped.takes_attention_sinks = getattr(attention, "takes_attention_sinks", False)
        return wrapped

    def paged_attention(self, *, slot_mapping: jax.Array, kv_lens: jax.Array, block_tables: jax.Array,
                        cu_q_lens: jax.Array, sm_scale: float, sliding_window: int | None = None,
                        impl: str = "auto") -> AttentionFn:
        """Mesh-wide paged attention: ``write_kv`` then ``ragged_paged_attention`` on each device's heads.

        Metadata shapes are the global ones with the dp groups stacked: ``slot_mapping int32[T]`` (local slots),
        ``kv_lens int32[dp*S]``, ``block_tables int32[dp*S, max_blocks]`` (local block ids), ``cu_q_lens
        int32[dp*(S+1)]`` (each group's offsets start at 0). With dp = 1 these are exactly the ops' arguments.
        """
        from paged_jax.ops import write_and_attend

        def local(layer_idx, q, k, v, kv_layer, meta, **layer_attention):
            options = dict(dict(sm_scale=sm_scale, sliding_window=sliding_window), **layer_attention)
            return write_and_attend(meta, q, k, v, kv_layer, impl=impl, **options)

        return self.shard_attention(local, dict(slot_mapping=slot_mapping, kv_lens=kv_lens,
                                                block_tables=block_tables, cu_q_lens=cu_q_lens))


def _fused_gate_up(config: ModelConfig) -> bool:
    """Whether the model's experts hold gate and up in one ``gate_up_proj`` (Llama 4, ``models.llama4``)."""
    return config.moe is not None and config.moe.router == "sigmoid_input"


def _gate_up_per_device(value, tp: int, xp):
    """Llama 4's ``gate_up_proj`` ``[E, H, 2I]`` (gate columns, then up) -> the same columns as ``tp`` slices of
    ``[gate slice | up slice]``, so that split over its last dim each device holds its gate and up slices side by
    side (``models.llama4.llama4_experts`` splits its local columns in half)."""
    num_experts, hidden, width = value.shape
    per_device = value.reshape(num_experts, hidden, 2, tp, width // (2 * tp))
    return xp.transpose(per_device, (0, 1, 3, 2, 4)).reshape(num_experts, hidden, width)


def _gpt_oss_experts(config: ModelConfig) -> bool:
    """Whether the model's experts are gpt-oss's (``models.gpt_oss``: biases, clamped SwiGLU, interleaved gate/up)."""
    return config.moe is not None and config.moe.swiglu_limit is not None


def _check_shardable(config: ModelConfig, tp: int, expert_parallel: bool, dp: int = 1) -> None:
    """ValueError, naming the field, for a model ``ShardingPlan`` cannot lay out over ``tp`` devices (its experts
    over dp x tp with ``expert_parallel``)."""
    if _gpt_oss_experts(config) and not expert_parallel:
        width = config.moe.moe_intermediate_size
        # MXFP4 experts split their down projection by whole 32-input scale blocks.
        unit = 32 if config.moe.expert_format == "mxfp4" else 1
        if width % (unit * tp):
            raise ValueError(f"tensor_parallel_size={tp} must divide the experts' intermediate_size ({width}) of "
                             f"{config.architecture}" + (f" in whole {unit}-wide MXFP4 scale blocks ({width // unit})"
                                                         if unit > 1 else "")
                             + " (or enable_expert_parallel: whole experts per device)")
    if config.moe is not None and config.moe.expert_format == "fp8" and not expert_parallel:
        raise ValueError(f"{config.architecture} with block-FP8 experts (quantization_config weight_block_size "
                         f"{list(config.fp8_weight_block)}) splits its experts over devices only whole "
                         "(enable_expert_parallel): their block scales have no rule to split an expert's width "
                         "(tensor parallelism without expert parallelism, and pipeline parallelism, are "
                         "unsupported for it)")
    if expert_parallel:
        check_expert_parallel(config, dp * tp, dp)
    if config.mla is not None and config.num_attention_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide num_attention_heads ({config.num_attention_heads}) "
                         f"of {config.architecture}: latent attention splits whole q heads (no head padding)")
    if _fused_gate_up(config) and not expert_parallel and config.moe.moe_intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the experts' intermediate_size "
                         f"({config.moe.moe_intermediate_size}) of {config.architecture} (or enable_expert_parallel: "
                         "whole experts per device)")
