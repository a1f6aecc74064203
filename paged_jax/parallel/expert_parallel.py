"""Expert parallelism (vLLM's ``--enable-expert-parallel``): each device of the EP group holds ``E / ep`` whole experts
(gate, up and down ``[E/ep, ...]``, split over the expert axis) instead of a slice of every expert's width; attention
stays tensor parallel. The EP group is the tp axis, or on a mesh with dp > 1 (data-parallel attention:
``ShardingPlan``'s model-level dp layout, each dp group with its own tokens) dp x tp, as vLLM's EP size = TP x DP. The
engine runs dp = 1 (each data-parallel replica is an engine of its own), so there the group is its tp devices.

How a sparse layer runs (``ExpertParallel``, under ``shard_map``):

1. The router and top-k run on every device of a dp group alike (the layer's input is whole on every tp device after
   the attention block's all-reduce), so every device knows its group's tokens' experts.
2. Dispatch (dp > 1 only): the tokens, their top-k ids and weights are all-gathered over dp, so each device sees every
   token of the EP group.
3. Each device runs the grouped matmuls of its own experts over the (token, slot) pairs routed to them and takes
   their weighted sum per token in float32 (``models.moe_routing.local_experts_partial``: pairs of other devices'
   experts are sorted past every group and weighted 0).
4. Combine: the float32 partial sums are reduce-scattered over dp (each dp group gets its own tokens' sums) and
   summed over tp, then rounded to the model dtype once. Steps 2 and 4 are vLLM's ``allgather_reducescatter``
   all-to-all backend; a ragged all-to-all of each token's k rows instead (XLA's ``ragged-all-to-all``) has no CPU
   lowering, where this is tested.

Exactness: a token's output is the same weighted sum as on one device, in float32 and rounded once; only the order
of the float32 additions differs (per device, then across devices), as tensor parallelism's all-reduce does.

Trade-off against the alternatives: the combine moves ``T x H`` float32 per layer (one all-reduce, the volume of the
tp-in-experts layout's); the dispatch moves tokens once each (not once per chosen expert, k times, as an all-to-all
of pairs would). Every device sorts all ``T x k`` pairs of its group and runs grouped matmuls with that static row
count, of which only its own experts' rows are in a group (a grouped kernel computes just their tiles; XLA's
``ragged_dot`` may compute more). Per device the weights are ``1 / ep`` of the experts, whole, so each expert's
matmuls keep their full width (no ``I / tp`` slivers), at the price of load imbalance when the router favours one
device's experts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from models.moe import grouped_matmul_for
from models.moe_routing import local_experts_partial
from paged_jax.parallel.mesh import DP_AXIS, TP_AXIS


def check_expert_parallel(config, ep_size: int, data_parallel_size: int = 1) -> None:
    """ValueError naming ``enable_expert_parallel`` when ``config`` (a ``models.config.ModelConfig``) cannot split its
    experts over ``ep_size`` devices (tp, times ``data_parallel_size`` where dp > 1)."""
    if config.moe is None:
        raise ValueError(f"enable_expert_parallel: {config.architecture} has no mixture-of-experts layers")
    if config.moe.num_experts % ep_size != 0:
        raise ValueError(f"enable_expert_parallel: num_experts ({config.moe.num_experts}) must be divisible by the "
                         f"expert-parallel size ({ep_size} = "
                         + ("data_parallel_size x tensor_parallel_size)" if data_parallel_size > 1
                            else "tensor_parallel_size)"))


def expert_axes(data_parallel_size: int) -> str | tuple[str, ...]:
    """The mesh axes whole experts split over (the EP group): tp, or dp x tp (dp major) where dp > 1."""
    return (DP_AXIS, TP_AXIS) if data_parallel_size > 1 else TP_AXIS


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """``models.moe.moe_experts`` with the experts split over mesh axes ``axis`` (a ``SparseMoeBlock``'s static
    ``expert_parallel``; hashable, so it lives in the model's graphdef).

    ``axis``: one mesh axis name or several (``expert_axes``: dp major, then tp). ``whole_experts``: each device holds
    ``E / ep`` whole experts (split over E); False: a slice of every expert's width (``I / tp``; Llama 4's fused
    gate/up columns, which XLA's partitioner would split between gate and up, laid out per device by
    ``ShardingPlan.rewrite_param``; gpt-oss's interleaved gate/up columns and MXFP4 blocks, whose contiguous slices
    keep each gate next to its up), each device's partial sums then cover every expert. ``token_axis``: the mesh axis
    the tokens are split over (dp under data-parallel attention; a token count it does not divide is taken whole),
    else None (every device has every token); where the experts span it too, the tokens are all-gathered over it and
    the sums reduce-scattered back.

    Call: ``(x dtype[T, H], w_gate / w_up [E, H, I], w_down [E, I, H], topk_weights float32[T, k], topk_ids
    int32[T, k], *, impl) -> dtype[T, H]``, the same as ``moe_experts`` (T split over ``token_axis``); ``impl`` picks
    each device's grouped matmul (``models.moe.MOE_IMPLS``) for its local arrays. ``partial_sums`` runs any such
    per-device share.
    """

    mesh: Mesh
    axis: str | tuple[str, ...] = TP_AXIS
    whole_experts: bool = True
    token_axis: str | None = None

    @property
    def axes(self) -> tuple[str, ...]:
        return (self.axis,) if isinstance(self.axis, str) else tuple(self.axis)

    @property
    def size(self) -> int:
        return math.prod(self.mesh.shape[name] for name in self.axes)

    def weight_spec(self, width_dim: int | None) -> P:
        """The PartitionSpec of a stacked expert parameter (leading dim E) whose expert width ``I`` is dim
        ``width_dim`` (e.g. 2 for ``[E, H, I]``, 1 for ``[E, I, H]``); ``width_dim`` None: a parameter without the
        width (gpt-oss's down bias ``[E, H]``), whole on every device when the width is split."""
        if self.whole_experts:
            return P(self.axis)
        if width_dim is None:
            return P()
        return P(*[self.axis if dim == width_dim else None for dim in range(width_dim + 1)])

    def split_axis(self, num_tokens: int) -> str | None:
        """``token_axis`` where it divides ``num_tokens``, else None: the tokens are then taken whole on every device
        (resharded by XLA), as without a token axis."""
        token_axis = self.token_axis
        return token_axis if token_axis is not None and num_tokens % self.mesh.shape[token_axis] == 0 else None

    def partial_sums(self, local_fn: Callable, per_token: tuple, weights: tuple, width_dims: tuple) -> jax.Array:
        """The sum over the EP group of ``local_fn(*per_token, *local_weights, first_expert)`` (float32 ``[T, ...]``),
        the share of the layer one device computes from its part of the stacked expert ``weights`` (arrays or pytrees
        of them, e.g. ``Mxfp4Experts``; ``width_dims``: each one's ``I`` dim, ``weight_spec``) for the ``per_token``
        arrays (leading dim T: the tokens, their top-k ids and weights); ``first_expert`` (int32 scalar) is the global
        id of the device's expert 0 (0 when every device holds a slice of every expert)."""
        axes, whole, count = self.axes, self.whole_experts, len(per_token)
        token_axis = self.split_axis(per_token[0].shape[0])
        gathered = token_axis is not None and token_axis in axes
        summed = tuple(name for name in axes if not (gathered and name == token_axis))

        def per_device(*args):
            tokens, local_weights = args[:count], args[count:]
            if gathered:  # dispatch: every device of the EP group sees every token of it
                tokens = tuple(jax.lax.all_gather(a, token_axis, axis=0, tiled=True) for a in tokens)
            first = jax.lax.axis_index(axes) * jax.tree.leaves(local_weights[0])[0].shape[0] if whole else 0
            partial = local_fn(*tokens, *local_weights, jnp.int32(first))
            if gathered:  # combine: each token's sum lands back on its own dp group
                partial = jax.lax.psum_scatter(partial, token_axis, scatter_dimension=0, tiled=True)
            return jax.lax.psum(partial, summed) if summed else partial

        token_spec = P() if token_axis is None else P(token_axis)
        specs = tuple(self.weight_spec(dim) for dim in width_dims)
        # check_vma off: a grouped-matmul kernel carries no varying-axis annotations; the specs are exact anyway.
        run = jax.shard_map(per_device, mesh=self.mesh, in_specs=(*(token_spec,) * count, *specs),
                            out_specs=token_spec, check_vma=False)
        return run(*per_token, *weights)

    def __call__(self, x, w_gate, w_up, w_down, topk_weights, topk_ids, *, impl: str = "xla") -> jax.Array:
        local_pairs = topk_ids.size  # each device's: all of the EP group's (gathered over the token axis, or whole)
        token_axis = self.split_axis(x.shape[0])
        if token_axis is not None and token_axis not in self.axes:
            local_pairs //= self.mesh.shape[token_axis]
        grouped_matmul = grouped_matmul_for(impl, local_pairs, x.shape[1], x.dtype, w_gate)

        def local(x, topk_weights, topk_ids, w_gate, w_up, w_down, first):
            return local_experts_partial(grouped_matmul, x, w_gate, w_up, w_down, topk_weights, topk_ids, first)

        return self.partial_sums(local, (x, topk_weights, topk_ids), (w_gate, w_up, w_down),
                                 (2, 2, 1)).astype(x.dtype)
