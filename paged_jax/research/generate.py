"""A jittable ``generate`` for research code: prefill + decode loop as one pure JAX function.

``generate`` takes an NNX model (or its ``(graphdef, state)`` split), a right-padded batch of prompts and a PRNG key,
and returns fixed-shape arrays. Everything runs on device inside one jit: a paged KV pool is built for exactly this
batch, all prompts are prefilled as one ragged batch, and a ``lax.while_loop`` decodes one token per row until every
row has produced EOS or ``max_new_tokens``. It uses the same model code, KV layout (``paged_jax.ops.write_kv``) and
``ragged_paged_attention`` kernel as the serving engine, so research results match serving.

Composability:
  * ``jax.jit``: ``generate`` is itself jitted (``max_new_tokens``, ``block_size``, ``eos_token_id``,
    ``pad_token_id``, ``attention_impl`` and Python-number sampling parameters are static) and can be called inside
    a user's own ``jax.jit`` / ``nnx.jit``, with the model state as an ordinary traced pytree. Called directly it
    compiles with the model's XLA options (``models.quantization.compiler_options``: FP8 models with float8 dots);
    inside a user's jit, that jit's own options apply (pass the model's there to get them).
  * Sharding: nothing is placed on a device explicitly; jit follows the shardings of the inputs, so weights sharded
    over a mesh stay sharded (no gather of the parameters). Passing the ``paged_jax.parallel.ShardingPlan`` the
    weights were placed with (``sharding_plan=``) also shards the KV pool over kv heads and runs attention under
    ``shard_map`` on each device's own heads, as the engine does; without it XLA's sharding propagation decides the
    KV pool's layout, and a custom-call kernel (the GPU Pallas kernel) runs on replicated q/k/v.
  * ``jax.vmap`` over ``rng`` (several samples per prompt), over prompts or over sampling parameters: a custom
    batching rule folds the mapped axis into the batch (``S`` samples of ``B`` prompts run as one batch of
    ``S * B`` rows), so the paged kernel never sees a vmapped call and the decode loop exits when every row of every
    sample is done. Mapping over the model parameters themselves falls back to plain vectorization.
  * No host callbacks and no host synchronization inside: under ``jax.transfer_guard("disallow")`` a call whose
    inputs already live on device performs no transfer.

Randomness: row ``b`` of a call uses ``row_key = jax.random.split(rng, B)[b]`` and draws the Gumbel noise of output
token ``i`` from ``fold_in(row_key, i)``; a row's tokens therefore depend on (model, prompt, rng, row index) and not
on the other rows (but for one thing: the other rows' top_k / top_p decide whether a step finds the top-k / top-p
cutoffs among the candidates or by the sort, which can differ by one token where top_p is within float32 rounding
of a prefix's mass). Sampling is the engine's sampler itself (``paged_jax.worker.sampler.sample``, with the row keys as its
per-row keys): greedy when temperature < ``SAMPLING_EPS`` (argmax, lowest index on ties), else Gumbel-max on
``logits / temperature`` after top-k then top-p. Returned logprobs are those of the raw model distribution
(``log_softmax(logits)`` at temperature 1, no truncation), like the engine's default.

Outputs carry no gradient (the parameters enter through ``stop_gradient``), so ``generate`` may run inside a function
that ``jax.grad`` differentiates; compute training logprobs with a separate forward pass on the returned tokens.
"""

from __future__ import annotations

import functools
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.custom_batching import custom_vmap

from models.llama import ReusableAttention
from models.quantization import compiler_options
from paged_jax.worker.attention_impl import resolve_attention_impl
from paged_jax.ops import write_and_attend
from paged_jax.parallel.plan import ShardingPlan
from paged_jax.worker.batch_invariant import engine_batch_invariant
from paged_jax.worker.sampler import SamplingMode, sample, temperature_top_k_top_p_tensors
from paged_jax.sampling_params import SAMPLING_EPS
from paged_jax.worker.top_k import candidates_suffice

_INT32_MAX = int(np.iinfo(np.int32).max)


class GenerateOutput(NamedTuple):
    """Result of ``generate``; B = batch size, N = ``max_new_tokens``.

    tokens: int32[B, N]; generated ids, the EOS token included, ``pad_token_id`` after a row finished.
    logprobs: float32[B, N]; log_softmax of the raw logits at each generated token, 0.0 after a row finished.
    lengths: int32[B]; number of generated tokens of each row (EOS included), in [1, N].
    finished: bool[B]; True when the row stopped on an EOS token, False when it was cut at ``max_new_tokens``.
    """

    tokens: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    finished: jax.Array


class _StaticConfig(NamedTuple):
    """Everything that changes the compiled program (hashable; a jit static argument)."""

    graphdef: Any
    max_new_tokens: int
    block_size: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    attention_impl: str
    sharding_plan: Any  # paged_jax.parallel.ShardingPlan with dp == 1, or None
    # Python-number sampling parameters are compiled in (None: the value is a traced argument instead).
    static_temperature: float | None
    static_top_k: int | None
    static_top_p: float | None
    batch_invariant: bool


class _RowParams(NamedTuple):
    """Per-row sampling parameters, each with leading dimension B (a pytree passed through custom_vmap)."""

    temperature: jax.Array  # float32[B]
    top_k: jax.Array  # int32[B]; <= 0 = off
    top_p: jax.Array  # float32[B]; >= 1 = off


# ---------------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------------


def generate(
    model,
    prompt_tokens,
    prompt_lengths,
    *,
    max_new_tokens: int,
    rng=None,
    temperature=0.0,
    top_k=0,
    top_p=1.0,
    eos_token_id: int | tuple[int, ...] | list[int] | None = None,
    pad_token_id: int = 0,
    block_size: int = 16,
    attention_impl: str = "auto",
    sharding_plan=None,
    batch_invariant: bool = False,
) -> GenerateOutput:
    """Generate up to ``max_new_tokens`` tokens for every prompt of a batch, entirely on device.

    Args:
      model: an NNX ``LlamaForCausalLM``, or ``(graphdef, state)`` / ``(graphdef, state, *more_states)`` as returned
        by ``nnx.split`` (the states may be traced, e.g. inside the caller's ``jax.jit``; sharded arrays stay
        sharded).
      prompt_tokens: int32[B, P]; prompts, right-padded (entries at or past a row's length are ignored).
      prompt_lengths: int32[B]; length of each prompt, in [1, P] (values outside are clipped into that range, since
        traced values cannot be checked).
      max_new_tokens: static N >= 1; shape of the outputs and the most tokens a row generates.
      rng: a JAX PRNG key (``jax.random.key`` or a legacy uint32[2] key). Required unless sampling is statically
        greedy (``temperature`` given as a Python number below ``SAMPLING_EPS``).
      temperature: scalar or float[B]; < ``SAMPLING_EPS`` (1e-5) means greedy for that row.
      top_k: scalar or int[B]; <= 0 disables top-k.
      top_p: scalar or float[B] in (0, 1]; 1 disables top-p.
        Python numbers for ``temperature`` / ``top_k`` / ``top_p`` are compiled in (a greedy call has no sampling
        code at all); pass jax arrays to vary them without recompiling.
      eos_token_id: static int or tuple of ints; a row stops after generating one of them. None: rows never stop
        early (pass e.g. ``config.eos_token_ids`` to stop at the model's EOS).
      pad_token_id: static int written after a row finished.
      block_size: static KV page size (tokens per block) of the paged pool.
      attention_impl: one of ``paged_jax.worker.attention_impl.ATTENTION_IMPLS``: "auto" (Pallas kernels on GPU, jnp
        reference elsewhere), "reference", "triton" (Triton lowering; "pallas" is its deprecated name) or "mosaic"
        (Mosaic GPU prefill kernel, Hopper); passed to ``ragged_paged_attention``.
      sharding_plan: static ``paged_jax.parallel.ShardingPlan`` (data_parallel_size 1) whose layout the weights
        have (``models.tensor_parallel.shard_model`` / ``load_sharded_model``): the KV pool is sharded over kv
        heads and attention runs per device under ``shard_map``. None: follow the input shardings (see the module
        docstring).
      batch_invariant: static; the engine's batch-invariant mode (``paged_jax.worker.batch_invariant``): a row's
        tokens and logprobs are the same bits as the engine's with ``batch_invariant=True`` for the same prompt
        (greedy rows; sampled rows draw their noise from ``rng``, not from a request seed), whatever the other rows.
        One device only (no ``sharding_plan``).
    Returns:
      ``GenerateOutput(tokens int32[B, N], logprobs float32[B, N], lengths int32[B], finished bool[B])``.
    Raises:
      ValueError: bad shapes, dtypes or static arguments (the message names the argument).

    The KV pool holds ``1 + B * ceil((P + N - 1) / block_size)`` blocks per layer (block 0 is the null block):
    memory grows with the padded prompt length P, so do not over-pad prompts.
    """
    graphdef, states = split_model(model)
    max_new_tokens = _check_positive_int(max_new_tokens, "max_new_tokens")
    block_size = _check_positive_int(block_size, "block_size")
    eos_token_ids = _normalize_eos(eos_token_id)
    if not isinstance(pad_token_id, numbers.Integral) or isinstance(pad_token_id, bool):
        raise ValueError(f"pad_token_id must be a Python int (it is static), got {pad_token_id!r}")
    attention_impl = resolve_attention_impl(attention_impl, "attention_impl")
    _check_sharding_plan(sharding_plan)
    if batch_invariant and sharding_plan is not None:
        raise ValueError("batch_invariant is not supported with a sharding_plan (one device only)")
    prompt_tokens, prompt_lengths = _check_prompts(prompt_tokens, prompt_lengths)
    static_params, dynamic_params = _sampling_params(temperature, top_k, top_p, prompt_tokens.shape[0])
    static_temperature, static_top_k, static_top_p = static_params
    _check_rng(rng, statically_greedy=static_temperature is not None and static_temperature < SAMPLING_EPS)

    static = _StaticConfig(
        graphdef=graphdef, max_new_tokens=max_new_tokens, block_size=block_size, eos_token_ids=eos_token_ids,
        pad_token_id=int(pad_token_id), attention_impl=attention_impl, sharding_plan=sharding_plan,
        static_temperature=static_temperature,
        static_top_k=static_top_k, static_top_p=static_top_p, batch_invariant=bool(batch_invariant),
    )
    return call_with_model_compiler_options(_generate_jit, graphdef, states, static, states, prompt_tokens,
                                            prompt_lengths, rng, *dynamic_params)


# ---------------------------------------------------------------------------------------------------------------
# Argument handling (host side, trace time)
# ---------------------------------------------------------------------------------------------------------------


_COMPILER_OPTIONS_BY_GRAPHDEF: dict[Any, tuple[tuple[str, Any], ...]] = {}


def model_compiler_options(graphdef, states: tuple) -> tuple[tuple[str, Any], ...]:
    """``models.quantization.compiler_options`` of the model ``(graphdef, states)``, as sorted (name, value) pairs
    (hashable: the key of the jitted function compiled with them). They follow from the graphdef's static
    attributes alone, so they are kept per graphdef (the module is rebuilt once, not per call)."""
    options = _COMPILER_OPTIONS_BY_GRAPHDEF.get(graphdef)
    if options is None:
        if len(_COMPILER_OPTIONS_BY_GRAPHDEF) >= 64:  # research code may build many models
            _COMPILER_OPTIONS_BY_GRAPHDEF.clear()
        options = tuple(sorted(compiler_options(nnx.merge(graphdef, *states)).items()))
        _COMPILER_OPTIONS_BY_GRAPHDEF[graphdef] = options
    return options


def call_with_model_compiler_options(jitted_with, graphdef, states: tuple, *args):
    """``jitted_with(options)(*args)`` with the model's compiler options, which jit accepts at the top level only:
    called inside another trace (a caller's ``jax.jit``, ``jax.grad``), the program is part of the caller's and
    ``jitted_with(())`` runs without them (the caller's own jit decides its options)."""
    options = model_compiler_options(graphdef, states)
    if options:
        try:
            return jitted_with(options)(*args)
        except ValueError as exc:
            if "compiler_options" not in str(exc):
                raise
    return jitted_with(())(*args)


def split_model(model) -> tuple[Any, tuple]:
    """``model`` (an NNX module, or ``(graphdef, state, *more_states)`` from ``nnx.split``) as ``(graphdef,
    states)``; ValueError naming ``model`` otherwise. Shared by ``generate`` and ``paged_jax.research.scoring``."""
    if isinstance(model, nnx.Module):
        graphdef, state = nnx.split(model)
        return graphdef, (state,)
    if isinstance(model, (tuple, list)) and len(model) >= 2 and isinstance(model[0], nnx.GraphDef):
        return model[0], tuple(model[1:])
    raise ValueError(
        f"model must be an nnx.Module or a (graphdef, state, ...) tuple from nnx.split, got {type(model).__name__}"
    )


def _check_positive_int(value, name: str) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive Python int (it is static), got {value!r}")
    return int(value)


def _normalize_eos(eos_token_id) -> tuple[int, ...]:
    if eos_token_id is None:
        return ()
    ids = (eos_token_id,) if isinstance(eos_token_id, numbers.Integral) else tuple(eos_token_id)
    for token_id in ids:
        if not isinstance(token_id, numbers.Integral) or isinstance(token_id, bool) or token_id < 0:
            raise ValueError(f"eos_token_id must be a non-negative int or a tuple of them, got {eos_token_id!r}")
    return tuple(sorted({int(token_id) for token_id in ids}))


def _as_array(value, name: str):
    """Host inputs become numpy (checked, transferred once by jit); jax arrays and tracers pass through."""
    if isinstance(value, (jax.Array, np.ndarray)):
        return value
    try:
        return np.asarray(value)
    except Exception as exc:
        raise ValueError(f"{name} must be an array, got {type(value).__name__}") from exc


def _split_param(value, name: str, batch_size: int, kind: type):
    """(static Python value, None) for a Python number, else (None, array broadcastable to [B])."""
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        if kind is int and not isinstance(value, numbers.Integral):
            raise ValueError(f"{name} must be an int, got {value!r}")
        return kind(value), None
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{name} must be a number or an array, got {value!r}")
    array = _as_array(value, name)
    if array.shape not in ((), (batch_size,)):
        raise ValueError(f"{name} must be a scalar or have shape [B={batch_size}], got shape {array.shape}")
    if kind is int and not jnp.issubdtype(array.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array, got dtype {array.dtype}")
    return None, array


def _check_key(rng) -> None:
    if not isinstance(rng, (jax.Array, np.ndarray)):
        raise ValueError(f"rng must be a jax.random.key or a legacy uint32[2] key, got {type(rng).__name__}")
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        if rng.shape != ():
            raise ValueError(f"rng must be a single PRNG key (shape ()), got shape {rng.shape}; use jax.vmap to map "
                             f"over several keys")
    elif rng.shape != (2,) or rng.dtype != jnp.uint32:
        raise ValueError(f"rng must be a jax.random.key or a legacy uint32[2] key, got {rng.dtype}{list(rng.shape)}")


def _check_sharding_plan(sharding_plan) -> None:
    """ValueError unless ``sharding_plan`` is None or a ``ShardingPlan`` with data_parallel_size 1."""
    if sharding_plan is None:
        return
    if not isinstance(sharding_plan, ShardingPlan):
        raise ValueError(f"sharding_plan must be a paged_jax.parallel.ShardingPlan or None, "
                         f"got {type(sharding_plan).__name__}")
    if sharding_plan.data_parallel_size != 1:
        raise ValueError(f"sharding_plan must have data_parallel_size 1 (split the batch yourself for data "
                         f"parallelism), got {sharding_plan.data_parallel_size}")


def _check_prompts(prompt_tokens, prompt_lengths) -> tuple:
    """``(prompt_tokens int[B, P], prompt_lengths int[B])`` as arrays (``_as_array``), checked: B, P >= 1, integer
    dtypes, and host lengths in [1, P] (traced ones are clipped on device); ValueError naming the argument."""
    prompt_tokens = _as_array(prompt_tokens, "prompt_tokens")
    prompt_lengths = _as_array(prompt_lengths, "prompt_lengths")
    if prompt_tokens.ndim != 2 or prompt_tokens.shape[0] < 1 or prompt_tokens.shape[1] < 1:
        raise ValueError(f"prompt_tokens must be int32[B, P] with B, P >= 1, got shape {prompt_tokens.shape}")
    if not jnp.issubdtype(prompt_tokens.dtype, jnp.integer):
        raise ValueError(f"prompt_tokens must be an integer array, got dtype {prompt_tokens.dtype}")
    batch_size, prompt_width = prompt_tokens.shape
    if prompt_lengths.shape != (batch_size,):
        raise ValueError(f"prompt_lengths must be int32[B={batch_size}], got shape {prompt_lengths.shape}")
    if not jnp.issubdtype(prompt_lengths.dtype, jnp.integer):
        raise ValueError(f"prompt_lengths must be an integer array, got dtype {prompt_lengths.dtype}")
    if isinstance(prompt_lengths, np.ndarray) and (
        np.any(prompt_lengths < 1) or np.any(prompt_lengths > prompt_width)
    ):
        raise ValueError(f"prompt_lengths must lie in [1, P={prompt_width}], got {prompt_lengths.tolist()}")
    return prompt_tokens, prompt_lengths


def _sampling_params(temperature, top_k, top_p, batch_size: int) -> tuple[tuple, tuple]:
    """``((static temperature, top_k, top_p), (dynamic temperature, top_k, top_p))``: each parameter is either a
    static Python number (compiled in; its dynamic entry None) or an array broadcastable to ``[B]`` (its static
    entry None); see ``_split_param``. top_k is clamped into int32; ValueError for a static temperature < 0 or
    top_p outside (0, 1]."""
    static_temperature, dynamic_temperature = _split_param(temperature, "temperature", batch_size, float)
    static_top_k, dynamic_top_k = _split_param(top_k, "top_k", batch_size, int)
    static_top_p, dynamic_top_p = _split_param(top_p, "top_p", batch_size, float)
    # Any top_k >= the vocabulary keeps every token, as <= 0 does: clamped into int32 as the engine's rows are (a
    # host int64 array would otherwise wrap when cast).
    if static_top_k is not None:
        static_top_k = min(max(static_top_k, 0), _INT32_MAX)
    elif isinstance(dynamic_top_k, np.ndarray) and dynamic_top_k.dtype.itemsize > 4:
        dynamic_top_k = np.clip(dynamic_top_k, 0, _INT32_MAX).astype(np.int32)
    if static_temperature is not None and static_temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {static_temperature}")
    if static_top_p is not None and not 0.0 < static_top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {static_top_p}")
    return (static_temperature, static_top_k, static_top_p), (dynamic_temperature, dynamic_top_k, dynamic_top_p)


def _check_rng(rng, *, statically_greedy: bool) -> None:
    """``rng`` may be None only for a statically greedy call; else it must be one PRNG key (``_check_key``)."""
    if rng is None:
        if not statically_greedy:
            raise ValueError("rng is required unless temperature is a Python number below SAMPLING_EPS (greedy)")
    else:
        _check_key(rng)


# ---------------------------------------------------------------------------------------------------------------
# Device side
# ---------------------------------------------------------------------------------------------------------------


@functools.cache
def _generate_jit(options: tuple[tuple[str, Any], ...]):
    """``_generate_on_device`` jitted with the XLA ``options`` (``model_compiler_options``)."""
    return jax.jit(_generate_on_device, static_argnums=0, compiler_options=dict(options) or None)


def _generate_on_device(static: _StaticConfig, states, prompt_tokens, prompt_lengths, rng,
                        dynamic_temperature, dynamic_top_k, dynamic_top_p) -> GenerateOutput:
    batch_size = prompt_tokens.shape[0]
    if rng is None:
        rng = jax.random.key(0)  # statically greedy: the key is never used (a trace-time constant, no transfer)
    elif not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.wrap_key_data(rng)

    def per_row(static_value, dynamic_value, dtype):
        value = static_value if dynamic_value is None else dynamic_value
        return jnp.broadcast_to(jnp.asarray(value, dtype), (batch_size,))

    row_params = _RowParams(
        temperature=per_row(static.static_temperature, dynamic_temperature, jnp.float32),
        top_k=per_row(static.static_top_k, dynamic_top_k, jnp.int32),
        top_p=per_row(static.static_top_p, dynamic_top_p, jnp.float32),
    )
    # Generation is not differentiable (custom_vmap has no autodiff rule and sampling is discrete): cutting the
    # gradient here lets generate sit inside a function that jax.grad traces, with zero gradient through it.
    states, row_params = jax.lax.stop_gradient((states, row_params))
    return _batch_folding_generate(static)(
        states, prompt_tokens.astype(jnp.int32), prompt_lengths.astype(jnp.int32), rng, row_params
    )


@functools.lru_cache(maxsize=64)
def _batch_folding_generate(static: _StaticConfig):
    """``generate_one_key`` wrapped with a vmap rule that folds a mapped axis into the batch dimension."""

    def generate_one_key(states, prompt_tokens, prompt_lengths, rng, row_params):
        row_keys = jax.random.split(rng, prompt_tokens.shape[0])
        return _generate_rows(static, states, prompt_tokens, prompt_lengths, row_keys, row_params)

    folded = custom_vmap(generate_one_key)

    @folded.def_vmap
    def fold_into_batch(axis_size, in_batched, states, prompt_tokens, prompt_lengths, rng, row_params):
        states_batched, tokens_batched, lengths_batched, rng_batched, params_batched = in_batched
        output_batched = GenerateOutput(True, True, True, True)
        if any(jax.tree.leaves(states_batched)):
            # Mapping over the weights (e.g. an ensemble) cannot share one batch; vectorize the whole program.
            in_axes = jax.tree.map(lambda batched: 0 if batched else None, tuple(in_batched))
            return jax.vmap(generate_one_key, in_axes=in_axes)(
                states, prompt_tokens, prompt_lengths, rng, row_params), output_batched

        num_samples = axis_size
        batch_size = prompt_tokens.shape[-2]

        def lead(x, batched):
            """[S, ...] view of an argument: mapped ones already have it, the others are broadcast."""
            return x if batched else jnp.broadcast_to(x[None], (num_samples,) + x.shape)

        def flatten(x):
            return x.reshape((num_samples * batch_size,) + x.shape[2:])

        prompt_tokens = lead(prompt_tokens, tokens_batched)
        prompt_lengths = lead(prompt_lengths, lengths_batched)
        rng = lead(rng, rng_batched)
        row_params = jax.tree.map(lead, row_params, params_batched)
        # Same row keys as S unbatched calls with rng[s]: row (s, b) gets split(rng[s], B)[b].
        row_keys = jax.vmap(lambda key: jax.random.split(key, batch_size))(rng)
        outputs = _generate_rows(
            static, states, flatten(prompt_tokens), flatten(prompt_lengths), flatten(row_keys),
            jax.tree.map(flatten, row_params),
        )
        outputs = jax.tree.map(lambda x: x.reshape((num_samples, batch_size) + x.shape[1:]), outputs)
        return outputs, output_batched

    return folded


def _generate_rows(static: _StaticConfig, states, prompt_tokens, prompt_lengths, row_keys,
                   row_params: _RowParams) -> GenerateOutput:
    """The generation program for B rows with their own keys (row_keys: key[B]); see ``generate``."""
    model = nnx.merge(static.graphdef, *states)
    if static.batch_invariant:
        model = engine_batch_invariant(model)
    prompt_width = prompt_tokens.shape[1]
    rows = _Rows(static, model, jnp.clip(prompt_lengths, 1, prompt_width), prompt_width, row_keys, row_params)
    last_hidden, kv_caches = rows.prefill(prompt_tokens, rows.empty_kv_caches())
    first_tokens, first_logprobs = rows.sample(last_hidden, 0)
    return rows.decode(first_tokens, first_logprobs, kv_caches)


class _Rows:
    """B rows of one ``_generate_rows`` trace over their own paged KV pool: the model and the rows' lengths, keys and
    sampling parameters, with the pieces of the program (prefill, sampling, the decode loop) as methods.

    KV pool: row b owns blocks ``[1 + b * blocks_per_row, 1 + (b + 1) * blocks_per_row)``; block 0 is the null
    block. A row's context never exceeds ``P + N - 1`` tokens (the last generated token is never fed back), so
    ``blocks_per_row = ceil((P + N - 1) / block_size)``. ``block_tables int32[B, blocks_per_row]``;
    ``row_first_slot int32[B]`` (contiguous blocks make a token's slot ``row_first_slot[b] + position``).
    ``prompt_lengths int32[B]`` are already clipped into ``[1, P]``."""

    def __init__(self, static: _StaticConfig, model, prompt_lengths, prompt_width: int, row_keys,
                 row_params: _RowParams):
        self.static, self.model, self.config = static, model, model.config
        self.prompt_lengths, self.row_keys, self.row_params = prompt_lengths, row_keys, row_params
        self.batch_size = batch_size = prompt_lengths.shape[0]
        blocks_per_row = -(-(prompt_width + static.max_new_tokens - 1) // static.block_size)
        self.num_blocks = 1 + batch_size * blocks_per_row
        self.block_tables = (1 + jnp.arange(batch_size, dtype=jnp.int32)[:, None] * blocks_per_row
                             + jnp.arange(blocks_per_row, dtype=jnp.int32)[None, :])  # [B, blocks_per_row]
        self.row_first_slot = self.block_tables[:, 0] * static.block_size  # [B]
        self.sm_scale = self.config.head_dim ** -0.5

    def empty_kv_caches(self) -> list[tuple[jax.Array, jax.Array]]:
        """Per layer ``(k, v)`` pages ``[num_blocks, block_size, kv heads, head_dim]`` of zeros in the model's dtype
        (sharded over kv heads under a sharding plan)."""
        config, plan = self.config, self.static.sharding_plan
        kv_dtype = getattr(self.model, "dtype", jnp.float32)
        def empty_pages(head_dim):  # a latent cache's V pages have no width (ModelConfig.kv_pool_head_dims)
            pages = jnp.zeros((self.num_blocks, self.static.block_size, config.num_key_value_heads, head_dim),
                              kv_dtype)
            return pages if plan is None else jax.lax.with_sharding_constraint(pages, plan.kv_cache_sharding)

        return [tuple(map(empty_pages, config.kv_pool_head_dims)) for _ in range(config.num_hidden_layers)]

    def attention(self, slot_mapping, kv_lens, cu_q_lens):
        """The model's attention for one forward: write the new k/v at ``slot_mapping`` and attend over the rows'
        blocks (``kv_lens int32[B]``, ``cu_q_lens int32[B + 1]``); per device under the sharding plan."""
        static, config = self.static, self.config
        if static.sharding_plan is not None:
            return static.sharding_plan.paged_attention(
                slot_mapping=slot_mapping, kv_lens=kv_lens, block_tables=self.block_tables, cu_q_lens=cu_q_lens,
                sm_scale=self.sm_scale, sliding_window=config.sliding_window, impl=static.attention_impl)

        return ReusableAttention(
            functools.partial(write_and_attend, sm_scale=self.sm_scale, sliding_window=config.sliding_window,
                              impl=static.attention_impl, batch_invariant=static.batch_invariant),
            dict(slot_mapping=slot_mapping, kv_lens=kv_lens, block_tables=self.block_tables, cu_q_lens=cu_q_lens),
            fuses_qk_transform=True)

    def sample(self, hidden, step):
        """One token per row from ``hidden [B, H]`` (output token ``step``): ``(int32[B], raw logprob
        float32[B])``."""
        logits = self.model.compute_logits(hidden)
        plan = self.static.sharding_plan
        logits = logits if plan is None else plan.gather_logits(logits)
        return _sample(self.static, logits, self.row_keys, step, self.row_params)

    def prefill(self, prompt_tokens, kv_caches) -> tuple[jax.Array, list]:
        """All prompts (``int32[B, P]``) as one ragged batch of ``B * P`` flat tokens, valid ones first (row-major),
        padding after: ``(each prompt's last hidden state [B, H], kv_caches)``."""
        batch_size, prompt_width = prompt_tokens.shape
        prompt_lengths = self.prompt_lengths
        num_flat = batch_size * prompt_width
        cu_q_lens = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(prompt_lengths, dtype=jnp.int32)])
        flat_index = jnp.arange(num_flat, dtype=jnp.int32)
        flat_row = jnp.searchsorted(cu_q_lens[1:], flat_index, side="right", method="compare_all")  # no while loop
        flat_row = jnp.minimum(flat_row, batch_size - 1)
        flat_valid = flat_index < cu_q_lens[batch_size]
        flat_position = jnp.where(flat_valid, flat_index - cu_q_lens[flat_row], 0).astype(jnp.int32)
        flat_tokens = jnp.where(flat_valid, prompt_tokens[flat_row, flat_position], 0)
        # Padding tokens write into the null block 0 (slot 0); their outputs are ignored.
        flat_slots = jnp.where(flat_valid, self.row_first_slot[flat_row] + flat_position, 0)
        hidden, kv_caches = self.model(flat_tokens, flat_position, kv_caches,
                                       self.attention(flat_slots, prompt_lengths, cu_q_lens))
        return hidden[cu_q_lens[1:] - 1], kv_caches

    def is_eos(self, tokens, eos_ids):
        """bool[B]: whether each of ``tokens int32[B]`` is one of ``eos_ids`` (the static EOS ids as an array)."""
        if not self.static.eos_token_ids:
            return jnp.zeros(tokens.shape, bool)
        return jnp.any(tokens[:, None] == eos_ids[None, :], axis=-1)

    def decode(self, first_tokens, first_logprobs, kv_caches) -> GenerateOutput:
        """From each row's first output token, a ``lax.while_loop`` of one token per row until every row hit EOS or
        ``max_new_tokens`` tokens are out."""
        static, batch_size, max_new_tokens = self.static, self.batch_size, self.static.max_new_tokens
        eos_ids = jnp.asarray(static.eos_token_ids, jnp.int32)
        out_tokens = jnp.full((batch_size, max_new_tokens), static.pad_token_id, jnp.int32).at[:, 0].set(first_tokens)
        out_logprobs = jnp.zeros((batch_size, max_new_tokens), jnp.float32).at[:, 0].set(first_logprobs)
        lengths = jnp.ones((batch_size,), jnp.int32)
        hit_eos = self.is_eos(first_tokens, eos_ids)
        decode_cu_q_lens = jnp.arange(batch_size + 1, dtype=jnp.int32)  # one query token per row

        def not_done(carry):
            step, _, hit_eos, *_ = carry
            return (step < max_new_tokens) & ~jnp.all(hit_eos)

        def decode_step(carry):
            """Feed output token step-1 of every row (position len + step - 1) and sample output token ``step``."""
            step, last_tokens, hit_eos, out_tokens, out_logprobs, lengths, kv_caches = carry
            positions = self.prompt_lengths + step - 1
            # Finished rows keep running (static shapes) on their own blocks; their results are discarded.
            hidden, kv_caches = self.model(last_tokens, positions, kv_caches,
                                           self.attention(self.row_first_slot + positions, positions + 1,
                                                          decode_cu_q_lens))
            tokens, logprobs = self.sample(hidden, step)
            tokens = jnp.where(hit_eos, static.pad_token_id, tokens)
            logprobs = jnp.where(hit_eos, 0.0, logprobs)
            out_tokens = jax.lax.dynamic_update_slice_in_dim(out_tokens, tokens[:, None], step, axis=1)
            out_logprobs = jax.lax.dynamic_update_slice_in_dim(out_logprobs, logprobs[:, None], step, axis=1)
            lengths = lengths + (~hit_eos).astype(jnp.int32)
            hit_eos = hit_eos | self.is_eos(tokens, eos_ids)
            return step + 1, tokens, hit_eos, out_tokens, out_logprobs, lengths, kv_caches

        carry = (jnp.int32(1), first_tokens, hit_eos, out_tokens, out_logprobs, lengths, kv_caches)
        _, _, hit_eos, out_tokens, out_logprobs, lengths, _ = jax.lax.while_loop(not_done, decode_step, carry)
        return GenerateOutput(tokens=out_tokens, logprobs=out_logprobs, lengths=lengths, finished=hit_eos)


def _sample(static: _StaticConfig, logits, row_keys, step, row_params: _RowParams):
    """One token per row by the engine's ``paged_jax.worker.sampler.sample``: (int32[B], raw logprob float32[B])."""
    batch_size = logits.shape[0]
    tensors = temperature_top_k_top_p_tensors(row_params.temperature, row_params.top_k, row_params.top_p,
                                              seeds=row_keys, steps=jnp.full((batch_size,), step, jnp.int32))

    def run(mode: SamplingMode):
        out = sample(logits, tensors, mode=mode, batch_invariant=static.batch_invariant)
        return out.token_ids, out.logprobs

    vocab_size = logits.shape[1]
    if static.static_temperature is not None and static.static_temperature < SAMPLING_EPS:
        return run(SamplingMode.GREEDY)
    if static.static_top_k is not None and static.static_top_p is not None:
        if static.static_top_k <= 0 and static.static_top_p >= 1.0:
            return run(SamplingMode.GREEDY_OR_TEMPERATURE)
        suffice = candidates_suffice(static.static_top_k, static.static_top_p, vocab_size)
        return run(SamplingMode.TOP_K if suffice else SamplingMode.FULL)
    # Traced top_k / top_p: the mode the engine's host side would pick (greedy rows ignore truncation), chosen at
    # run time. TOP_K finds top-k / top-p among each row's largest logits; FULL sorts every row (min-p, penalties
    # and bans are off there: no effect).
    random_rows = row_params.temperature >= SAMPLING_EPS
    needs_truncation = jnp.any(random_rows & ((row_params.top_k > 0) | (row_params.top_p < 1.0)))
    all_suffice = jnp.all(~random_rows | candidates_suffice(row_params.top_k, row_params.top_p, vocab_size))
    branch = jnp.where(needs_truncation, jnp.where(all_suffice, 1, 2), 0)
    return jax.lax.switch(branch, [lambda: run(SamplingMode.GREEDY_OR_TEMPERATURE), lambda: run(SamplingMode.TOP_K),
                                   lambda: run(SamplingMode.FULL)])
