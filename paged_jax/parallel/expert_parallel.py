"""Expert parallelism (vLLM's ``--enable-expert-parallel``): each device of the tp axis holds ``E / ep`` whole experts
(gate, up and down ``[E/ep, ...]``, split over the expert axis) instead of a slice of every expert's width; attention
stays tensor parallel. With the engine's tp-only meshes the EP group is the tp axis (vLLM: EP size = TP x DP; dp > 1
is refused, each data-parallel replica being an engine of its own here).

How a sparse layer runs (``ExpertParallel``, under ``shard_map``):

1. The router and top-k run on every device alike (replicated; the layer's input is already whole on every device
   after the attention block's all-reduce), so every device knows every token's experts: no dispatch collective.
2. Each device runs the grouped matmuls of its own experts over the (token, slot) pairs routed to them and takes
   their weighted sum per token in float32 (``models.moe_routing.local_experts_partial``: pairs of other devices'
   experts are sorted past every group and weighted 0).
3. Combine: one ``psum`` of the float32 partial sums over the axis, rounded to the model dtype once.

Exactness: a token's output is the same weighted sum as on one device, in float32 and rounded once; only the order
of the float32 additions differs (per device, then across devices), as tensor parallelism's all-reduce does.

Trade-off against the alternatives: the combine moves ``T x H`` float32 per layer (one all-reduce, the volume of the
tp-in-experts layout's), where an all-to-all dispatch / combine would move only each token's k expert rows but needs
tokens split over devices (data-parallel attention) to pay off, and variable-size exchanges. Every device sorts all
``T x k`` pairs and runs grouped matmuls with that static row count, of which only its own experts' rows are in a
group (a grouped kernel computes just their tiles; XLA's ``ragged_dot`` may compute more). Per device the weights
are ``1 / ep`` of the experts, whole, so each expert's matmuls keep their full width (no ``I / tp`` slivers), at the
price of load imbalance when the router favours one device's experts.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from models.moe import grouped_matmul_for
from models.moe_routing import local_experts_partial
from paged_jax.parallel.mesh import TP_AXIS


def check_expert_parallel(config, ep_size: int) -> None:
    """ValueError naming ``enable_expert_parallel`` when ``config`` (a ``models.config.ModelConfig``) cannot split its
    experts over ``ep_size`` devices."""
    if config.moe is None:
        raise ValueError(f"enable_expert_parallel: {config.architecture} has no mixture-of-experts layers")
    if config.moe.num_experts % ep_size != 0:
        raise ValueError(f"enable_expert_parallel: num_experts ({config.moe.num_experts}) must be divisible by the "
                         f"expert-parallel size ({ep_size} = tensor_parallel_size)")


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """``models.moe.moe_experts`` with the experts split over mesh axis ``axis`` (a ``SparseMoeBlock``'s static
    ``expert_parallel``; hashable, so it lives in the model's graphdef).

    ``whole_experts``: each device holds ``E / ep`` whole experts (split over E); False: a slice of every expert's
    width (``I / tp``; Llama 4's fused gate/up columns, which XLA's partitioner would split between gate and up,
    laid out per device by ``ShardingPlan.rewrite_param``; gpt-oss's interleaved gate/up columns and MXFP4 blocks,
    whose contiguous slices keep each gate next to its up), each device's partial sums then cover every expert.

    Call: ``(x dtype[T, H], w_gate / w_up [E, H, I], w_down [E, I, H], topk_weights float32[T, k], topk_ids
    int32[T, k], *, impl) -> dtype[T, H]``, the same as ``moe_experts``; ``impl`` picks each device's grouped
    matmul (``models.moe.MOE_IMPLS``) for its local arrays. ``partial_sums`` runs any such per-device share.
    """

    mesh: Mesh
    axis: str = TP_AXIS
    whole_experts: bool = True

    @property
    def size(self) -> int:
        return self.mesh.shape[self.axis]

    def weight_spec(self, width_dim: int | None) -> P:
        """The PartitionSpec of a stacked expert parameter (leading dim E) whose expert width ``I`` is dim
        ``width_dim`` (e.g. 2 for ``[E, H, I]``, 1 for ``[E, I, H]``); ``width_dim`` None: a parameter without the
        width (gpt-oss's down bias ``[E, H]``), whole on every device when the width is split."""
        if self.whole_experts:
            return P(self.axis)
        if width_dim is None:
            return P()
        return P(*[self.axis if dim == width_dim else None for dim in range(width_dim + 1)])

    def partial_sums(self, local_fn: Callable, replicated: tuple, weights: tuple, width_dims: tuple) -> jax.Array:
        """``psum`` over the axis of ``local_fn(*replicated, *local_weights, first_expert)`` (float32), the share of
        the layer one device computes from its part of the stacked expert ``weights`` (arrays or pytrees of them,
        e.g. ``Mxfp4Experts``; ``width_dims``: each one's ``I`` dim, ``weight_spec``); ``first_expert`` (int32
        scalar) is the global id of the device's expert 0 (0 when every device holds a slice of every expert)."""
        axis, whole, count = self.axis, self.whole_experts, len(replicated)

        def per_device(*args):
            local_weights = args[count:]
            first = jax.lax.axis_index(axis) * jax.tree.leaves(local_weights[0])[0].shape[0] if whole else 0
            return jax.lax.psum(local_fn(*args[:count], *local_weights, jnp.int32(first)), axis)

        specs = tuple(self.weight_spec(dim) for dim in width_dims)
        # check_vma off: a grouped-matmul kernel carries no varying-axis annotations; the specs are exact anyway.
        run = jax.shard_map(per_device, mesh=self.mesh, in_specs=(*(P(),) * count, *specs), out_specs=P(),
                            check_vma=False)
        return run(*replicated, *weights)

    def __call__(self, x, w_gate, w_up, w_down, topk_weights, topk_ids, *, impl: str = "xla") -> jax.Array:
        grouped_matmul = grouped_matmul_for(impl, topk_ids.size, x.shape[1], x.dtype, w_gate)

        def local(x, topk_weights, topk_ids, w_gate, w_up, w_down, first):
            return local_experts_partial(grouped_matmul, x, w_gate, w_up, w_down, topk_weights, topk_ids, first)

        return self.partial_sums(local, (x, topk_weights, topk_ids), (w_gate, w_up, w_down),
                                 (2, 2, 1)).astype(x.dtype)
