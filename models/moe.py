"""The sparse mixture-of-experts MLP of Qwen3-MoE and Mixtral: router, top-k, and the experts' SwiGLU over the tokens
sorted by expert (vLLM's ``fused_moe``).

For ``x: dtype[T, H]`` (HF's math, ``models.config.MoeConfig``):

    probs = softmax(float32(x @ router))                       # [T, E]
    weights, ids = top_k(probs, k)                             # [T, k]; / sum(weights) when norm_topk_prob
    out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))   with e = ids[t, j]

The experts run as grouped matmuls over the ``T * k`` (token, expert) pairs sorted by expert: gate and up (one pass
over the rows, ``silu(gate) * up`` in float32 and rounded once), then down, then the weighted top-k sum in float32.
``moe_experts_reference`` (``lax.ragged_dot``) is the ``"xla"`` implementation and the oracle of any other; the
Pallas grouped matmul of ``paged_jax.ops.fused_moe`` registers itself here as ``"pallas"`` (with the ``"auto"``
selector) when ``paged_jax.ops`` is imported, so ``models`` never imports ``paged_jax``.

Expert weights are stacked over experts in model layout (``[in, out]`` per expert): ``gate_proj`` / ``up_proj``
``[E, H, I]``, ``down_proj`` ``[E, I, H]``; the loader stacks a checkpoint's per-expert tensors into them. Block-FP8
experts (``MoeConfig.expert_format`` "fp8": DeepSeek-V2 / V3 and Qwen3-MoE FP8 checkpoints) stay in
``float8_e4m3fn`` beside their ``<proj>_scale_inv`` blocks and reach the grouped matmuls as
``models.quantization.block_fp8.BlockFp8Experts``: the reference dequantizes them to the rows' dtype, the kernel
dequantizes each tile it reads. MXFP4 experts (gpt-oss, ``models.gpt_oss``) reach them the same way as
``models.quantization.mxfp4.Mxfp4Experts``.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.dense import dense_linear
from models.impl_registry import ImplRegistry
from models.quantization.block_fp8 import SCALE_SUFFIX, BlockFp8Experts
from models.quantization.mxfp4 import Mxfp4Experts

MOE_IMPLS = ("auto", "xla", "pallas")
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
EXPERT_SCALES = tuple(name + SCALE_SUFFIX for name in EXPERT_PROJECTIONS)  # block-FP8 experts' scale parameters
ROUTED_EXPERTS = "routed_experts"  # the nnx.Intermediate a capturing sparse layer sows (models.moe_routing)
# in_pair_order's inverse permutation by comparing all pairs (M^2 work, one launch) up to this many rows.
COMPARE_INVERSE_ROWS = 1024
# Mixtral's checkpoint names: the block is "block_sparse_moe", its experts' projections w1 (gate), w3 (up), w2 (down).
_MIXTRAL_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}

# name -> grouped_matmul(lhs [R, K], rhs [E, K, N], group_sizes int32[E], *, row_index int32[M] | None,
#                        up_rhs [E, K, N] | None) -> dtype[M, N] (grouped_matmul_reference's contract); "auto" selector
# fn(num_rows, hidden, dtype) -> implementation name
_REGISTRY = ImplRegistry("moe_impl", MOE_IMPLS)
# name -> pair_experts (pair_experts_reference's contract): the implementation's unsorted form for a few pairs.
_PAIR_EXPERTS: dict[str, Callable] = {}
# name -> route_top_k (route_top_k's contract): the implementation's router softmax and top-k.
_ROUTERS: dict[str, Callable] = {}
# (token, expert) pairs up to which an implementation with a pair form multiplies each pair by its expert unsorted
# (moe_experts_pairs): a decode step of one or two tokens, whose pairs nearly all have an expert to themselves.
PAIR_FORM_MAX_PAIRS = 16


def register_grouped_matmul(name: str, fn: Callable) -> None:
    """Make ``fn`` (``grouped_matmul_reference``'s contract) the implementation ``name`` (one of ``MOE_IMPLS``)."""
    _REGISTRY.register(name, fn)


def register_pair_experts(name: str, fn: Callable) -> None:
    """Make ``fn`` (``pair_experts_reference``'s contract) the unsorted form of implementation ``name``, which
    ``moe_experts`` runs for float experts up to ``PAIR_FORM_MAX_PAIRS`` pairs."""
    check_moe_impl(name)
    _PAIR_EXPERTS[name] = fn


def register_route_top_k(name: str, fn: Callable) -> None:
    """Make ``fn`` (``route_top_k``'s contract) the router softmax and top-k of implementation ``name`` for steps of
    up to ``PAIR_FORM_MAX_PAIRS`` (token, expert) pairs (``SparseMoeBlock.route``; otherwise, and for "xla":
    ``route_top_k``)."""
    check_moe_impl(name)
    _ROUTERS[name] = fn


def decode_forms() -> list[tuple[str, str, str]]:
    """``(implementation, "pair_experts" | "route_top_k", function)`` for each form registered besides the grouped
    matmul: what a traced step runs beyond its source (``paged_jax.worker.executable_cache`` keys executables by it)."""
    return sorted((name, kind, _function_name(fn))
                  for kind, table in (("pair_experts", _PAIR_EXPERTS), ("route_top_k", _ROUTERS))
                  for name, fn in table.items())


def _function_name(fn: Callable) -> str:
    """``module.qualname`` of ``fn``; a ``functools.partial``: its function's, with its bound arguments."""
    if isinstance(fn, functools.partial):
        return f"partial({_function_name(fn.func)}, {fn.args!r}, {sorted(fn.keywords.items())!r})"
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def register_moe_selector(fn: Callable[..., str]) -> None:
    """``fn(num_rows, hidden, dtype, scale_block) -> name`` decides ``impl="auto"`` from static shapes
    (``scale_block``: the block-FP8 experts' scale block, or None)."""
    _REGISTRY.register_selector(fn)


def check_moe_impl(impl: str) -> str:
    """``impl`` itself, or a ValueError naming ``moe_impl``."""
    return _REGISTRY.check(impl)


def resolve_moe_impl(impl: str, num_rows: int, hidden: int, dtype, scale_block: tuple[int, int] | None = None) -> str:
    """The grouped-matmul implementation ``impl`` runs for ``num_rows`` sorted (token, expert) rows of ``hidden``;
    ``scale_block``: the experts' block-FP8 scale block (``BlockFp8Experts.block``), None for float experts."""
    return _REGISTRY.resolve(impl, num_rows, hidden, jnp.dtype(dtype), scale_block)


def grouped_matmul_for(impl: str, num_rows: int, hidden: int, dtype, expert_weight=None) -> Callable:
    """The grouped matmul (``grouped_matmul_reference``'s contract) that ``impl`` runs for the static shape, of
    experts like ``expert_weight`` (a stacked array or ``BlockFp8Experts``; None: float experts)."""
    return _REGISTRY[resolve_moe_impl(impl, num_rows, hidden, dtype, fp8_scale_block(expert_weight))]


def fp8_scale_block(expert_weight) -> tuple[int, int] | None:
    """The scale block of block-FP8 experts (``BlockFp8Experts.block``), None for a float stack."""
    return expert_weight.block if isinstance(expert_weight, BlockFp8Experts) else None


def route_top_k(router_logits: jax.Array, top_k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """``router_logits [T, E]`` -> ``(weights float32[T, top_k], ids int32[T, top_k])``: the top-k experts of the
    float32 softmax, largest first, the weights renormalized to sum to 1 when ``norm_topk_prob``."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def sort_by_expert(topk_ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """``topk_ids int32[T, k]`` -> ``(order int32[T * k], group_sizes int32[E])``: the flat (token, slot) pairs
    ``t * k + j`` in expert order (stable, so each expert's rows keep token order) and each expert's row count.
    Sorted row ``r`` is token ``order[r] // k``; ids outside ``[0, E)`` sort by value and count in no group.

    The counts compare every id with every expert (one reduction XLA fuses, deterministic) rather than scatter-add
    into a zeroed buffer (two launches, atomics on a few bins)."""
    flat = topk_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    experts = jnp.arange(num_experts, dtype=flat.dtype)
    group_sizes = jnp.sum(flat[None, :] == experts[:, None], axis=1, dtype=jnp.int32)
    return order, group_sizes


def in_pair_order(sorted_rows: jax.Array, order: jax.Array) -> jax.Array:
    """Rows sorted by expert back in (token, slot) pair order: ``sorted_rows [M, H]`` (row ``r`` is pair
    ``order[r]``; ``sort_by_expert``) -> ``[M, H]``, row ``p`` pair ``p``. A gather through the inverse permutation,
    so the consumer (the weighted top-k sum) can fuse it, and no zero-filled buffer exists for XLA to allocate ahead
    of the layer. Up to ``COMPARE_INVERSE_ROWS`` rows (decode) the inverse compares every pair with every row (one
    reduction launch); beyond, it is a scatter."""
    rows = jnp.arange(order.shape[0], dtype=order.dtype)
    if order.shape[0] <= COMPARE_INVERSE_ROWS:
        position = jnp.sum(jnp.where(order[None, :] == rows[:, None], rows[None, :], 0), axis=1, dtype=order.dtype)
    else:
        position = jnp.zeros_like(order).at[order].set(rows, unique_indices=True)
    return sorted_rows[position]


def grouped_matmul_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                             row_index: jax.Array | None = None, up_rhs: jax.Array | None = None) -> jax.Array:
    """The grouped matmul of rows sorted by expert, in jnp (``lax.ragged_dot``; float32 accumulation).

    Args:
      lhs: ``dtype[R, K]``; the sorted rows are ``lhs[row_index]`` (``row_index int32[M]``), or ``lhs`` itself
        (``M == R``) when ``row_index`` is None.
      rhs: ``dtype[E, K, N]`` or ``BlockFp8Experts`` / ``Mxfp4Experts`` of that shape (dequantized to ``dtype``
        here: the whole stack, for the oracle's simplicity); rows ``[sum(group_sizes[:e]),
        sum(group_sizes[:e + 1]))`` are multiplied by ``rhs[e]``.
      group_sizes: ``int32[E]``, summing to ``M``.
      up_rhs: None, or as ``rhs``: then the result is ``silu(rows @ rhs[e]) * (rows @ up_rhs[e])`` (float32, one
        rounding), the experts' SwiGLU activation.
    Returns:
      ``lhs.dtype[M, N]``.
    """
    rhs, up_rhs = (w.dequantize(lhs.dtype) if isinstance(w, (BlockFp8Experts, Mxfp4Experts)) else w
                   for w in (rhs, up_rhs))
    rows = lhs if row_index is None else lhs[row_index]
    out = jax.lax.ragged_dot(rows, rhs, group_sizes, preferred_element_type=jnp.float32)
    if up_rhs is not None:
        out = jax.nn.silu(out) * jax.lax.ragged_dot(rows, up_rhs, group_sizes, preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)


register_grouped_matmul("xla", grouped_matmul_reference)


def moe_experts(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, topk_weights: jax.Array,
                topk_ids: jax.Array, *, impl: str = "auto") -> jax.Array:
    """The experts' weighted SwiGLU of every token (vLLM's ``fused_experts``), its grouped matmuls by ``impl``.

    Args:
      x: ``dtype[T, H]``; w_gate, w_up: ``[E, H, I]``; w_down: ``[E, I, H]`` (model layout, cast to ``dtype``), or
        each a ``BlockFp8Experts`` or ``Mxfp4Experts`` of that shape (dequantized by the grouped matmul).
      topk_weights: ``float32[T, k]``; topk_ids: ``int32[T, k]`` in ``[0, E)`` (``route_top_k``).
      impl: ``MOE_IMPLS``; "auto": the registered selector's choice for the static shape, else "xla".
    Returns:
      ``dtype[T, H]``: ``sum_j topk_weights[t, j] * expert_{ids[t, j]}(x[t])``, the sum in float32.
    """
    name = resolve_moe_impl(impl, topk_ids.size, x.shape[1], x.dtype, fp8_scale_block(w_gate))
    pair_experts = _PAIR_EXPERTS.get(name)
    if (pair_experts is not None and topk_ids.size <= PAIR_FORM_MAX_PAIRS
            and not isinstance(w_gate, (BlockFp8Experts, Mxfp4Experts))):
        return moe_experts_pairs(pair_experts, x, w_gate, w_up, w_down, topk_weights, topk_ids)
    return moe_experts_with(_REGISTRY[name], x, w_gate, w_up, w_down, topk_weights, topk_ids)


def moe_experts_with(grouped_matmul: Callable, x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                     topk_weights: jax.Array, topk_ids: jax.Array) -> jax.Array:
    """``moe_experts`` on a given grouped matmul (``grouped_matmul_reference``'s contract; e.g. a kernel in
    interpret mode): sort, gate/up with the SwiGLU, down, then the weighted top-k sum. Same arguments and result."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts = w_gate.shape[0]
    check_expert_shapes(hidden, w_gate, w_up, w_down)
    order, group_sizes = sort_by_expert(topk_ids, num_experts)
    dtype = x.dtype
    w_gate, w_up, w_down = (expert_operand(w, dtype) for w in (w_gate, w_up, w_down))
    act = grouped_matmul(x, w_gate, group_sizes, row_index=order // top_k, up_rhs=w_up)  # [T * k, I]
    out_sorted = grouped_matmul(act, w_down, group_sizes)  # [T * k, H]
    out = in_pair_order(out_sorted, order).reshape(num_tokens, top_k, hidden).astype(jnp.float32)
    return jnp.sum(out * topk_weights[:, :, None], axis=1).astype(dtype)


def check_expert_shapes(hidden: int, w_gate, w_up, w_down) -> None:
    """ValueError naming the shapes unless gate / up are ``[E, hidden, I]`` and down ``[E, I, hidden]``."""
    if w_up.shape != w_gate.shape or w_down.shape != (w_gate.shape[0], w_gate.shape[2], hidden):
        raise ValueError(f"expert weights must be gate/up [E, {hidden}, I] and down [E, I, {hidden}]; got "
                         f"{w_gate.shape}, {w_up.shape}, {w_down.shape}")


def _pair_product(rows: jax.Array, w, pair_expert: jax.Array, reduce: bool) -> jax.Array:
    """float32 ``[P, N]``: row ``p`` of ``rows [P, K]`` times expert ``pair_expert[p]`` of ``w`` (``[E, K, N]``,
    gathered and dequantized to the rows' dtype)."""
    taken = _take_experts(w, pair_expert, rows.dtype)
    if reduce:
        return jnp.sum(rows.astype(jnp.float32)[:, :, None] * taken.astype(jnp.float32), axis=1)
    return jnp.einsum("pk,pkn->pn", rows, taken, preferred_element_type=jnp.float32)


def pair_experts_reference(x: jax.Array, w_gate, w_up, w_down, topk_ids: jax.Array, *,
                           reduce: bool = False) -> jax.Array:
    """Every (token, slot) pair's expert SwiGLU, unsorted: the oracle of the pair kernels.

    Args:
      x: ``dtype[T, H]``; w_gate, w_up: ``[E, H, I]``; w_down: ``[E, I, H]`` (or ``BlockFp8Experts`` /
        ``Mxfp4Experts``); topk_ids: ``int32[T, k]``: pair ``p`` is token ``p // k``'s slot ``p % k``.
      reduce: each product as a broadcast multiply and a float32 sum (which XLA can fuse with the gather of the
        experts, reading the weights in place) instead of a batched dot.
    Returns:
      float32 ``[T * k, H]``: each pair's ``down(silu(gate(x)) * up(x))`` (the activation rounded to ``dtype``).
    """
    ids = topk_ids.reshape(-1)
    rows = jnp.repeat(x, topk_ids.shape[1], axis=0)  # pair t * k + j is token t
    gate, up = (_pair_product(rows, w, ids, reduce) for w in (w_gate, w_up))
    act = (jax.nn.silu(gate) * up).astype(x.dtype)  # [T * k, I]
    return _pair_product(act, w_down, ids, reduce)


def moe_experts_pairs(pair_experts: Callable, x: jax.Array, w_gate, w_up, w_down, topk_weights: jax.Array,
                      topk_ids: jax.Array) -> jax.Array:
    """``moe_experts`` without sorting, for a few tokens: every (token, slot) pair through its own expert
    (``pair_experts``, ``pair_experts_reference``'s contract), then the weighted top-k sum in pair order. It reads
    an expert once per pair routed to it (twice when two tokens share it), so it suits steps whose pairs are nearly
    all distinct experts (decode of one or two tokens); no sort, tile schedule or inverse permutation. Same
    arguments and result as ``moe_experts``."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    check_expert_shapes(hidden, w_gate, w_up, w_down)
    dtype = x.dtype
    w_gate, w_up, w_down = (expert_operand(w, dtype) for w in (w_gate, w_up, w_down))
    out = pair_experts(x, w_gate, w_up, w_down, topk_ids)  # float32[T * k, H]
    out = out.astype(dtype).reshape(num_tokens, top_k, hidden).astype(jnp.float32)
    return jnp.sum(out * topk_weights[:, :, None], axis=1).astype(dtype)


def moe_experts_gathered(x: jax.Array, w_gate, w_up, w_down, topk_weights: jax.Array, topk_ids: jax.Array, *,
                         reduce: bool = False) -> jax.Array:
    """``moe_experts_pairs`` in XLA (``pair_experts_reference``: every pair's expert gathered with ``jnp.take``,
    one batched product per projection, or with ``reduce`` a multiply and sum). Same arguments and result as
    ``moe_experts``."""
    return moe_experts_pairs(functools.partial(pair_experts_reference, reduce=reduce), x, w_gate, w_up, w_down,
                             topk_weights, topk_ids)


def _take_experts(w, ids: jax.Array, dtype) -> jax.Array:
    """``dtype[P, K, N]``: the experts ``ids int32[P]`` of a stack (block-FP8 or MXFP4 ones gathered with their
    scales, then dequantized)."""
    if isinstance(w, BlockFp8Experts):
        taken = BlockFp8Experts(jnp.take(w.weight, ids, axis=0), jnp.take(w.scale_inv, ids, axis=0), w.block)
        return taken.dequantize(dtype)
    if isinstance(w, Mxfp4Experts):
        return Mxfp4Experts(jnp.take(w.blocks, ids, axis=0), jnp.take(w.scales, ids, axis=0)).dequantize(dtype)
    return jnp.take(w, ids, axis=0).astype(dtype)


def expert_operand(w, dtype):
    """A stacked expert weight as the grouped matmuls take it: a float stack cast to ``dtype``, block-FP8 or MXFP4
    experts (``BlockFp8Experts``, ``Mxfp4Experts``) as they are (the grouped matmul dequantizes them)."""
    return w if isinstance(w, (BlockFp8Experts, Mxfp4Experts)) else w.astype(dtype)


def moe_experts_reference(x, w_gate, w_up, w_down, topk_weights, topk_ids) -> jax.Array:
    """``moe_experts`` with ``impl="xla"`` (``lax.ragged_dot``): the oracle of the kernels."""
    return moe_experts(x, w_gate, w_up, w_down, topk_weights, topk_ids, impl="xla")


class MoeExperts(nnx.Module):
    """The experts' stacked weights: ``gate_proj``, ``up_proj`` ``[E, H, I]`` and ``down_proj`` ``[E, I, H]`` in
    ``param_dtype``; with ``fp8_block`` (block-FP8 experts, ``(rows, cols)`` of one scale) in ``float8_e4m3fn``,
    each beside its ``<proj>_scale_inv`` ``float32[E, ceil(out / rows), ceil(in / cols)]`` (``BlockFp8Experts``)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, *, param_dtype, rngs: nnx.Rngs, init_std: float,
                 fp8_block: tuple[int, int] | None = None):
        init = nnx.initializers.normal(stddev=init_std)
        self.fp8_block = fp8_block
        dtype = param_dtype if fp8_block is None else jnp.float8_e4m3fn
        for name, (k, n) in zip(EXPERT_PROJECTIONS, ((hidden, inter), (hidden, inter), (inter, hidden))):
            value = init(rngs.params(), (num_experts, k, n), param_dtype if fp8_block is None else jnp.float32)
            setattr(self, name, nnx.Param(value.astype(dtype)))
            if fp8_block is not None:
                scales = (num_experts, -(-n // fp8_block[0]), -(-k // fp8_block[1]))
                setattr(self, name + SCALE_SUFFIX, nnx.Param(jnp.ones(scales, jnp.float32)))

    def projections(self) -> tuple:
        """``(gate, up, down)``: the stacked arrays, or ``BlockFp8Experts`` for block-FP8 experts."""
        if self.fp8_block is None:
            return tuple(getattr(self, name)[...] for name in EXPERT_PROJECTIONS)
        return tuple(BlockFp8Experts(getattr(self, name)[...], getattr(self, name + SCALE_SUFFIX)[...],
                                     self.fp8_block) for name in EXPERT_PROJECTIONS)


class SparseMoeBlock(nnx.Module):
    """The sparse MLP of one decoder layer: the router ``gate`` (an ``nnx.Linear`` ``[H, E]``, HF ``mlp.gate``) and
    the ``experts``. ``impl`` (static, ``MOE_IMPLS``) picks the grouped matmul; ``set_moe_impl`` sets it.

    Static hooks (``models.moe_routing``): ``capture_routing`` sows the top-k ids as an ``nnx.Intermediate`` named
    ``ROUTED_EXPERTS``; ``expert_parallel`` (None, or a hashable callable with ``moe_experts``' arguments and
    ``impl=``) runs the experts in its place (``paged_jax.parallel.expert_parallel``: experts split over devices)."""

    def __init__(self, config: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs, init_std: float,
                 impl: str = "auto"):
        moe = config.moe
        self.num_experts_per_tok = moe.num_experts_per_tok
        self.norm_topk_prob = moe.norm_topk_prob
        self.dtype = dtype
        self.impl = check_moe_impl(impl)
        self.capture_routing = False
        self.expert_parallel = None
        self.gate = dense_linear(config.hidden_size, moe.num_experts, use_bias=False, dtype=dtype,
                                 param_dtype=param_dtype, init_std=init_std, rngs=rngs)
        self.experts = MoeExperts(moe.num_experts, config.hidden_size, moe.moe_intermediate_size,
                                  param_dtype=param_dtype, rngs=rngs, init_std=init_std,
                                  fp8_block=expert_fp8_block(config))

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``x [T, H]`` -> ``(weights float32[T, k], ids int32[T, k])``: ``route_top_k`` of the router logits, as the
        implementation ``impl`` resolves to for the step's pairs runs it on a decode-sized step on one device
        (``register_route_top_k``; experts over devices route with XLA's, which the mesh partitions)."""
        num_pairs = x.shape[0] * self.num_experts_per_tok
        name = resolve_moe_impl(self.impl, num_pairs, x.shape[1], x.dtype)
        decode_step = num_pairs <= PAIR_FORM_MAX_PAIRS and self.expert_parallel is None
        router = _ROUTERS.get(name, route_top_k) if decode_step else route_top_k
        return router(self.gate(x), self.num_experts_per_tok, self.norm_topk_prob)

    def __call__(self, x: jax.Array, lora=None) -> jax.Array:
        """``x: [T, H]`` -> ``[T, H]``. ``lora``: the layer's LoRA state (``models.llama.with_lora``); an adapter
        of the MLP projections has no expert form here: ValueError."""
        refuse_mlp_lora(lora)
        weights, ids = self.route(x)
        if self.capture_routing:
            self.sow(nnx.Intermediate, ROUTED_EXPERTS, ids)
        run = moe_experts if self.expert_parallel is None else self.expert_parallel
        return run(x, *self.experts.projections(), weights, ids, impl=self.impl)


def expert_fp8_block(config: ModelConfig) -> tuple[int, int] | None:
    """The scale block of a model's block-FP8 experts (``MoeConfig.expert_format`` "fp8"), else None."""
    return config.fp8_weight_block if config.moe.expert_format == "fp8" else None


def refuse_mlp_lora(lora) -> None:
    """ValueError naming the MLP projections a layer's LoRA state (``models.llama.with_lora``) adapts: the experts
    have no LoRA form."""
    mlp_targets = sorted(set(getattr(lora, "weights", None) or ()) & {"gate_proj", "up_proj", "down_proj",
                                                                      "gate_up_proj"})
    if mlp_targets:
        raise ValueError(f"LoRA target modules {mlp_targets} are unsupported on mixture-of-experts layers")


def set_moe_impl(model, impl: str):
    """In place: the grouped-matmul implementation (``MOE_IMPLS``) of every sparse layer of ``model`` (a
    ``models.llama.LlamaForCausalLM``). A model on a mesh runs "xla" only (a pallas_call is not partitioned; XLA
    partitions ``ragged_dot`` over the experts' sharded width): ValueError for anything else, unless its sparse
    layers run ``expert_parallel`` (each device's grouped matmuls then run on its own arrays). Returns ``model``."""
    check_moe_impl(impl)
    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    per_device = all(block.expert_parallel is not None for block in blocks)
    if getattr(model, "sharding_plan", None) is not None and impl != "xla" and not per_device:
        raise ValueError(f"moe_impl={impl!r}: a model on a mesh (tensor or pipeline parallel) runs 'xla' experts")
    for block in blocks:
        block.impl = impl
    return model


def expert_checkpoint_names(config: ModelConfig, param_path: tuple) -> list[str] | None:
    """The checkpoint tensors stacked into one expert parameter (``(..., "mlp", "experts", "gate_proj")``), one per
    expert in order (each the ``[out, in]`` weight of that expert; for a block-FP8 ``<proj>_scale_inv`` parameter its
    ``weight_scale_inv``), or None for any other parameter."""
    names = [str(p) for p in param_path]
    if len(names) < 3 or names[-2] != "experts" or names[-1] not in EXPERT_PROJECTIONS + EXPERT_SCALES:
        return None
    if config.moe.swiglu_limit is not None or config.moe.router == "sigmoid_input":
        return None  # gpt-oss, Llama 4: the checkpoint stacks its experts itself (models.gpt_oss, models.llama4)
    prefix = checkpoint_prefix(config, ".".join(names[:-1]))
    projection = names[-1].removesuffix(SCALE_SUFFIX)
    suffix = SCALE_SUFFIX if names[-1].endswith(SCALE_SUFFIX) else ""
    leaf = _MIXTRAL_EXPERT_NAMES[projection] if config.architecture == "MixtralForCausalLM" else projection
    return [f"{prefix}.{e}.{leaf}.weight{suffix}" for e in range(config.moe.num_experts)]


def checkpoint_prefix(config: ModelConfig, name: str) -> str:
    """A model tensor name in the checkpoint's spelling: Mixtral's sparse block is ``block_sparse_moe``, Llama 4's
    MLPs (dense and sparse) ``feed_forward``."""
    if config.architecture == "MixtralForCausalLM":
        return name.replace(".mlp.", ".block_sparse_moe.")
    if config.architecture == "Llama4ForCausalLM":
        return name.replace(".mlp.", ".feed_forward.")
    return name
