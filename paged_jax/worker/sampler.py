"""Batched on-device sampling: one jitted computation per step samples a token for every row of the batch.

Every row carries its own parameters (``SamplingTensors``, all with leading dimension S = padded number of rows).
The host side, ``build_sampling_tensors``, turns per-request ``SamplingParams`` into those arrays and picks the
cheapest ``SamplingMode`` that serves every row; the mode is a static argument so the model runner can compile
each variant once at start-up.

Randomness: row i draws Gumbel noise from ``fold_in(key(seeds[i]), steps[i])``; the token therefore depends only on
(logits row, parameters, seed, step) and never on the batch size, the row's position or the other rows.
Sampling is Gumbel-max (``argmax(logits / T + Gumbel)``), which draws exactly from ``softmax(logits / T)``
restricted to the tokens that survive top-k / top-p / min-p.

Order of operations in ``FULL`` mode (vLLM's v1 sampler): allowed_token_ids mask -> bans (bad words, min_tokens)
-> logit_bias -> penalties -> (greedy rows: argmax) -> temperature -> min-p -> top-k -> top-p -> Gumbel-max.
``TOP_K`` mode is the same from temperature on, without the sort (``paged_jax.worker.top_k``), for steps whose rows need
none of the steps before temperature and whose top-k / top-p the candidates serve.
Returned logprobs follow vLLM's ``logprobs_mode`` (static per engine): ``raw_logprobs`` (the default) /
``raw_logits`` of the model's logits, ``processed_logprobs`` / ``processed_logits`` of the values sampled from
(after bans, bias, penalties, temperature, min-p, top-k and top-p; tokens filtered out are -inf). Greedy rows are
never divided by a temperature.

Per-request logit processing, each in a fixed-width form so that nothing compiles after warm-up and requests that
do not use it pay nothing:
* bans (``banned_token_ids``, BANNED_WIDTH ids per row in the step buffer): stop ids / EOS below ``min_tokens``, and
  ``bad_words``, whose bans the host computes per step from the row's output tail.
* the bias table (``logit_bias`` pairs and the ``allowed_token_ids`` bitmask, ``bias_table_width(V)`` words per row),
  a separate transfer sent only on steps where some row uses one of them, like the penalty history (a FULL step
  without such a row applies a device-resident ``neutral_bias_table`` instead: fewer compiled variants).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.ops.batch_invariant import logsumexp_batch_invariant
from paged_jax.sampling_params import SAMPLING_EPS, SamplingParams, validate_token_ids
from paged_jax.worker.logit_processing import (apply_allowed_token_mask, apply_logit_bias, apply_penalties, ban_tokens,
                                                 gumbel_noise, temperature_and_filters)
from paged_jax.worker.top_k import candidates_suffice, top_k_top_p_by_sort, top_k_top_p_from_candidates, vocab_top_k

# Width of ``banned_token_ids`` (stop_token_ids + EOS ids of a row below its min_tokens, bad-word tokens) when some
# row needs bans. Fixed so that the sampler compiles once; the engine rejects requests that would need more
# (ValueError naming stop_token_ids / bad_words, ``check_request_fits``).
BANNED_WIDTH = 32
# Most ``logit_bias`` entries per request (the OpenAI API's limit): the bias table's (id, bias) slots per row.
LOGIT_BIAS_WIDTH = 300
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


def allowed_mask_words(vocab_size: int) -> int:
    """Int32 words of one row's ``allowed_token_ids`` bitmask: one bit per vocabulary entry."""
    return -(-vocab_size // 32)


def bias_table_width(vocab_size: int) -> int:
    """Int32 words per row of the bias table: LOGIT_BIAS_WIDTH ids, their biases (f32 bits), the allowed bitmask."""
    return 2 * LOGIT_BIAS_WIDTH + allowed_mask_words(vocab_size)


class SamplingMode(str, enum.Enum):
    """Static variant of ``sample``; each is a superset of the previous one.

    GREEDY: every row is greedy (argmax of the raw logits); no random numbers are drawn.
    GREEDY_OR_TEMPERATURE: greedy rows via argmax, the others via Gumbel-max on logits / temperature.
    TOP_K: as GREEDY_OR_TEMPERATURE after min-p, top-k and top-p, for steps where every row's top-k / top-p
      ``candidates_suffice`` (``paged_jax.worker.top_k``: no sort of the vocabulary).
    FULL: allowed_token_ids, bans, logit_bias, penalties, min-p, top-k, top-p, then greedy / temperature sampling.
    """

    GREEDY = "greedy"
    GREEDY_OR_TEMPERATURE = "greedy_or_temperature"
    TOP_K = "top_k"
    FULL = "full"


class SamplingTensors(NamedTuple):
    """Per-row sampling parameters (a pytree; numpy on the host, jax arrays on device). S = padded rows.

    temperature: f32[S]; < SAMPLING_EPS means greedy (padding rows are 0 = greedy).
    top_k: i32[S]; 0 = off.
    top_p: f32[S]; 1.0 = off.
    min_p: f32[S]; 0.0 = off.
    presence: f32[S]; presence penalty (0 = off).
    frequency: f32[S]; frequency penalty (0 = off).
    repetition: f32[S]; repetition penalty (1 = off).
    seeds: u32[S]; per-request seed (the row's key is ``key(seed)``), or key[S]: a typed PRNG key per row, used as
      is (``generate`` splits the caller's key).
    steps: i32[S]; index of the token being sampled within the request's output (0 for the first output token).
    prev_token_ids: i32[S, L]; prompt ids then output ids, padded with -1; L = 0 when no penalties are applied.
    prompt_len: i32[S]; how many leading entries of ``prev_token_ids`` are prompt tokens.
    banned_token_ids: i32[S, B]; ids whose logits are set to -inf (stop ids / EOS of rows that have not reached
      ``min_tokens``, bad-word tokens), padded with -1; B = 0 when no row needs it.
    logit_bias_ids: i32[S, K]; ``logit_bias`` token ids, padded with -1; K = LOGIT_BIAS_WIDTH when some row uses
      ``logit_bias`` or ``allowed_token_ids`` (the bias table), else 0.
    logit_bias: f32[S, K]; the biases added to those ids' logits.
    allowed_token_mask: i32[S, M]; bit v % 32 of word v // 32 is set when token v may be sampled (every bit set
      for rows without ``allowed_token_ids``); M = ``allowed_mask_words(V)`` with the bias table, else 0.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array
    seeds: jax.Array
    steps: jax.Array
    prev_token_ids: jax.Array
    prompt_len: jax.Array
    banned_token_ids: jax.Array
    logit_bias_ids: jax.Array
    logit_bias: jax.Array
    allowed_token_mask: jax.Array


class SamplerOutput(NamedTuple):
    """Result of ``sample``; K = num_logprobs.

    token_ids: i32[S]; the sampled tokens.
    logprobs: f32[S]; log_softmax(raw logits) at the sampled token.
    top_ids: i32[S, K]; the K most likely tokens under the raw logits, most likely first (ties: lower id first).
    top_logprobs: f32[S, K]; their raw logprobs.
    token_ranks: i32[S]; 1-based rank of the sampled token under the raw logits (1 + number of strictly more
      likely tokens), vLLM's ``Logprob.rank``.
    """

    token_ids: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    token_ranks: jax.Array


# ---------------------------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------------------------

SamplingRow = tuple[SamplingParams, int, int, Sequence[int], Sequence[int]]


_INT32_MAX = int(np.iinfo(np.int32).max)  # hoisted: np.iinfo is not free, and this runs per row per step


def seed_to_u32(seed: int) -> int:
    """Fold an arbitrary Python int seed into 32 bits (both halves of its 64-bit value contribute)."""
    seed64 = int(seed) % (1 << 64)
    return (seed64 ^ (seed64 >> 32)) & 0xFFFFFFFF


def _banned_ids_for(params: SamplingParams, step: int, eos_token_ids: Sequence[int],
                    output_ids: Sequence[int]) -> list[int]:
    """Ids that must not be sampled at output index ``step``: stop ids and EOS while ``min_tokens`` is not reached,
    and the last token of every bad word whose other tokens end ``output_ids`` (vLLM's bad-words rule)."""
    banned = set()
    if step < params.min_tokens:
        banned.update(params.stop_token_ids or ())
        if not params.ignore_eos:
            banned.update(int(token_id) for token_id in eos_token_ids)
    for word in params.bad_words_token_ids:
        prefix_len = len(word) - 1
        if prefix_len == 0 or (len(output_ids) >= prefix_len and list(output_ids[-prefix_len:]) == word[:-1]):
            banned.add(word[-1])
    return sorted(banned)


def check_request_fits(params: SamplingParams, *, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
    """Raise ValueError naming the field when a request's token ids fall outside the vocabulary or do not fit the
    sampler's fixed widths (``logit_bias`` entries, bans of ``bad_words`` plus min_tokens' stop ids and EOS). The
    engine calls it on ``add_request`` (after ``params.update_from_tokenizer``), so a step never fails on them."""
    if params.logit_bias:
        if len(params.logit_bias) > LOGIT_BIAS_WIDTH:
            raise ValueError(f"logit_bias: at most {LOGIT_BIAS_WIDTH} entries are supported, got "
                             f"{len(params.logit_bias)}")
        validate_token_ids(list(params.logit_bias), vocab_size, "logit_bias")
    if params.allowed_token_ids is not None:
        validate_token_ids(params.allowed_token_ids, vocab_size, "allowed_token_ids")
    for word in params.bad_words_token_ids:
        validate_token_ids(word, vocab_size, "bad_words")
    min_tokens_bans = set(params.stop_token_ids or ()) if params.min_tokens > 0 else set()
    if params.min_tokens > 0 and not params.ignore_eos:
        min_tokens_bans.update(int(token_id) for token_id in eos_token_ids)
    bad_word_bans = {word[-1] for word in params.bad_words_token_ids}
    if len(min_tokens_bans | bad_word_bans) > BANNED_WIDTH:
        field = "bad_words" if bad_word_bans else "stop_token_ids"
        raise ValueError(f"{field}: at most {BANNED_WIDTH} distinct banned ids are supported (the last tokens of "
                         f"bad_words' sequences, plus stop_token_ids and EOS while below min_tokens), this request "
                         f"needs {len(min_tokens_bans | bad_word_bans)}")


def _allowed_mask_row(allowed_token_ids: Sequence[int], num_words: int) -> np.ndarray:
    """i32[num_words]: bit v % 32 of word v // 32 set for each allowed id v."""
    bits = np.zeros(num_words * 32, np.bool_)
    bits[np.fromiter(allowed_token_ids, np.int64, len(allowed_token_ids))] = True
    return np.packbits(bits, bitorder="little").view("<i4")


def build_sampling_tensors(
    rows: Sequence[SamplingRow | None],
    pad_to: int,
    need_penalties: bool | None = None,
    penalty_len: int = 0,
    *,
    eos_token_ids: Sequence[int] = (),
    vocab_size: int | None = None,
) -> tuple[SamplingTensors, SamplingMode]:
    """Build the host (numpy) ``SamplingTensors`` for one step and the cheapest mode that serves every row.

    Args:
      rows: one entry per batch row, ``(params, seed, step, prompt_ids, output_ids)`` or None for a padding row.
        ``seed`` is the request's seed (user-given or drawn by the engine), ``step`` the index of the token being
        sampled within the output (== len(output_ids) for normal decoding). ``prompt_ids`` / ``output_ids`` are
        only read for rows that use penalties (both) or bad words (``output_ids``).
      pad_to: S, the padded number of rows (>= len(rows)); rows past ``len(rows)`` are greedy padding.
      need_penalties: None = auto (penalty arrays are built iff some row uses penalties); True = build them
        whenever the mode is FULL (stable shapes); False = never (ValueError if a row uses penalties).
      penalty_len: L, width of ``prev_token_ids`` when penalty arrays are built; must be >= len(prompt) +
        len(output) of every row that uses penalties.
      eos_token_ids: the model's EOS ids, banned (with each row's ``stop_token_ids``) while a row is below its
        ``min_tokens`` unless it sets ``ignore_eos``.
      vocab_size: V, needed when a row uses ``logit_bias`` or ``allowed_token_ids`` (the bias table's mask width);
        without it a top_k of V or more counts as a top-k that needs the sort (FULL) rather than as off.
    Returns:
      (tensors, mode). ``prev_token_ids`` is i32[S, penalty_len] when penalties are applied in FULL mode, else
      i32[S, 0]; ``banned_token_ids`` is i32[S, 0] unless a row needs bans (then FULL mode, i32[S, BANNED_WIDTH]);
      the bias table fields are [S, 0] unless a row uses ``logit_bias`` / ``allowed_token_ids`` (then FULL mode,
      ``logit_bias_ids`` / ``logit_bias`` [S, LOGIT_BIAS_WIDTH], ``allowed_token_mask`` [S, allowed_mask_words(V)]).
    Raises:
      ValueError: bad ``pad_to`` / ``penalty_len`` / ``step``, a row banning more than BANNED_WIDTH ids or with more
      than LOGIT_BIAS_WIDTH ``logit_bias`` entries (``check_request_fits`` rules both out up front), or a bias table
      without ``vocab_size``.
    """
    if pad_to < len(rows):
        raise ValueError(f"pad_to must be >= the number of rows ({len(rows)}), got {pad_to}")
    if penalty_len < 0:
        raise ValueError(f"penalty_len must be non-negative, got {penalty_len}")
    vectors = _RowVectors(pad_to)
    usage = _fill_row_vectors(vectors, rows, eos_token_ids, vocab_size)
    if usage.penalty_rows and need_penalties is False:
        raise ValueError(f"need_penalties=False but row {usage.penalty_rows[0]} uses presence/frequency/repetition "
                         "penalties")
    if usage.penalty_rows or usage.needs_sort or usage.banned_per_row or usage.table_rows:
        mode = SamplingMode.FULL
    elif usage.any_truncation:
        mode = SamplingMode.TOP_K
    elif usage.any_random:
        mode = SamplingMode.GREEDY_OR_TEMPERATURE
    else:
        mode = SamplingMode.GREEDY
    build_penalties = mode == SamplingMode.FULL and (bool(usage.penalty_rows) or need_penalties is True)
    prev_token_ids = _penalty_history(rows, usage.penalty_rows, vectors.prompt_len, pad_to,
                                      penalty_len if build_penalties else 0, penalty_len)
    banned_width = BANNED_WIDTH if usage.banned_per_row else 0
    banned_token_ids = np.full((pad_to, banned_width), -1, np.int32)
    for row_index, ids in usage.banned_per_row.items():
        banned_token_ids[row_index, : len(ids)] = ids
    logit_bias_ids, logit_bias, allowed_token_mask = _bias_table_fields(rows, usage.table_rows, pad_to, vocab_size)
    tensors = SamplingTensors(
        **vars(vectors), prev_token_ids=prev_token_ids, banned_token_ids=banned_token_ids,
        logit_bias_ids=logit_bias_ids, logit_bias=logit_bias, allowed_token_mask=allowed_token_mask)
    return tensors, mode


class _RowVectors:
    """The per-row [S] vectors of ``SamplingTensors``, at their neutral values (greedy, filters off)."""

    def __init__(self, pad_to: int):
        self.temperature = np.zeros(pad_to, np.float32)
        self.top_k = np.zeros(pad_to, np.int32)
        self.top_p = np.ones(pad_to, np.float32)
        self.min_p = np.zeros(pad_to, np.float32)
        self.presence = np.zeros(pad_to, np.float32)
        self.frequency = np.zeros(pad_to, np.float32)
        self.repetition = np.ones(pad_to, np.float32)
        self.seeds = np.zeros(pad_to, np.uint32)
        self.steps = np.zeros(pad_to, np.int32)
        self.prompt_len = np.zeros(pad_to, np.int32)


@dataclasses.dataclass
class _RowUsage:
    """What a step's rows use: which sampler features, and the rows needing penalties, bans or the bias table."""

    any_random: bool = False
    any_truncation: bool = False
    needs_sort: bool = False
    penalty_rows: list = dataclasses.field(default_factory=list)
    table_rows: list = dataclasses.field(default_factory=list)
    banned_per_row: dict = dataclasses.field(default_factory=dict)


def _fill_row_vectors(vectors: _RowVectors, rows: Sequence[SamplingRow | None], eos_token_ids: Sequence[int],
                      vocab_size: int | None) -> _RowUsage:
    """Write each row's parameters into ``vectors``; returns what the rows use."""
    usage = _RowUsage()
    for row_index, row in enumerate(rows):
        if row is None:
            continue
        params, seed, step, _, output_ids = row
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step} for row {row_index}")
        greedy = params.is_greedy
        vectors.temperature[row_index] = 0.0 if greedy else params.temperature
        vectors.seeds[row_index] = seed_to_u32(seed)
        vectors.steps[row_index] = step
        if not greedy:
            usage.any_random = True
            # Greedy rows ignore truncation entirely (argmax always survives it), so only random rows fill it in.
            # Clamp to int32: any k beyond the vocabulary keeps every token, as k = vocab_size would.
            vectors.top_k[row_index] = min(max(params.top_k, 0), _INT32_MAX)
            vectors.top_p[row_index] = params.top_p
            vectors.min_p[row_index] = params.min_p
            if params.uses_truncation:
                usage.any_truncation = True
                usage.needs_sort = usage.needs_sort or not candidates_suffice(params.top_k, params.top_p, vocab_size)
        if params.uses_penalties:
            vectors.presence[row_index] = params.presence_penalty
            vectors.frequency[row_index] = params.frequency_penalty
            vectors.repetition[row_index] = params.repetition_penalty
            usage.penalty_rows.append(row_index)
        # Plain attribute checks first: this loop runs per row of the general path, and most rows use none of these.
        if params.logit_bias or params.allowed_token_ids is not None:  # params.uses_bias_table
            usage.table_rows.append(row_index)
        if step < params.min_tokens or params.bad_words_token_ids:
            banned = _banned_ids_for(params, step, eos_token_ids, output_ids)
            if len(banned) > BANNED_WIDTH:
                raise ValueError(f"stop_token_ids: row {row_index} bans {len(banned)} ids (bad words, stop ids + "
                                 f"EOS below min_tokens), more than {BANNED_WIDTH}")
            if banned:
                usage.banned_per_row[row_index] = banned
    return usage


def _penalty_history(rows: Sequence[SamplingRow | None], penalty_rows: list[int], prompt_len: np.ndarray,
                     pad_to: int, width: int, penalty_len: int) -> np.ndarray:
    """i32[pad_to, width] each penalty row's prompt then outputs, padded with -1 (width 0: no history); sets those
    rows' ``prompt_len``."""
    prev_token_ids = np.full((pad_to, width), -1, np.int32)
    for row_index in penalty_rows:
        _, _, _, prompt_ids, output_ids = rows[row_index]
        total = len(prompt_ids) + len(output_ids)
        if total > penalty_len:
            raise ValueError(
                f"penalty_len ({penalty_len}) is smaller than prompt + output length ({total}) of row {row_index}"
            )
        prev_token_ids[row_index, : len(prompt_ids)] = prompt_ids
        prev_token_ids[row_index, len(prompt_ids) : total] = output_ids
        prompt_len[row_index] = len(prompt_ids)
    return prev_token_ids


def _bias_table_fields(rows: Sequence[SamplingRow | None], table_rows: list[int], pad_to: int,
                       vocab_size: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logit_bias_ids i32[S, K], logit_bias f32[S, K], allowed_token_mask i32[S, M]) of the rows using the bias
    table; K = M = 0 when none does."""
    if table_rows and vocab_size is None:
        raise ValueError(f"vocab_size is needed: row {table_rows[0]} uses logit_bias / allowed_token_ids")
    bias_width = LOGIT_BIAS_WIDTH if table_rows else 0
    mask_width = allowed_mask_words(vocab_size) if table_rows else 0
    logit_bias_ids = np.full((pad_to, bias_width), -1, np.int32)
    logit_bias = np.zeros((pad_to, bias_width), np.float32)
    allowed_token_mask = np.full((pad_to, mask_width), -1, np.int32)
    for row_index in table_rows:
        params = rows[row_index][0]
        if params.logit_bias:
            count = len(params.logit_bias)
            if count > LOGIT_BIAS_WIDTH:
                raise ValueError(f"logit_bias: row {row_index} has {count} entries, more than {LOGIT_BIAS_WIDTH}")
            logit_bias_ids[row_index, :count] = list(params.logit_bias)
            logit_bias[row_index, :count] = list(params.logit_bias.values())
        if params.allowed_token_ids is not None:
            allowed_token_mask[row_index] = _allowed_mask_row(params.allowed_token_ids, mask_width)
    return logit_bias_ids, logit_bias, allowed_token_mask


def temperature_top_k_top_p_tensors(temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, seeds: jax.Array,
                                    steps: jax.Array) -> SamplingTensors:
    """Device ``SamplingTensors`` for rows that use temperature, top-k and top-p only (min-p, penalties, bans and
    the bias table off): temperature f32[S], top_k i32[S], top_p f32[S], seeds u32[S] or key[S], steps i32[S].
    Jittable."""
    num_rows = temperature.shape[0]
    zeros = jnp.zeros((num_rows,), jnp.float32)
    no_ids = jnp.zeros((num_rows, 0), jnp.int32)
    return SamplingTensors(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=zeros, presence=zeros, frequency=zeros,
        repetition=jnp.ones((num_rows,), jnp.float32), seeds=seeds, steps=steps, prev_token_ids=no_ids,
        prompt_len=jnp.zeros((num_rows,), jnp.int32), banned_token_ids=no_ids, logit_bias_ids=no_ids,
        logit_bias=jnp.zeros((num_rows, 0), jnp.float32), allowed_token_mask=no_ids,
    )


# ---------------------------------------------------------------------------------------------------------------
# Wire format: SamplingTensors <-> int32 words of the model runner's step buffer
# ---------------------------------------------------------------------------------------------------------------

# The per-row [S] vectors that travel in the step buffer (all 4-byte dtypes, floats bitcast), then
# ``banned_token_ids`` at BANNED_WIDTH. ``prev_token_ids`` (penalty history, [S, max_model_len]) and the bias table
# (``pack_bias_table``) do not: they are large and only needed on steps with a row that uses them, so the runner
# sends each apart then.
_WIRE_VECTOR_DTYPES = {"temperature": jnp.float32, "top_k": jnp.int32, "top_p": jnp.float32, "min_p": jnp.float32,
                       "presence": jnp.float32, "frequency": jnp.float32, "repetition": jnp.float32,
                       "seeds": jnp.uint32, "steps": jnp.int32, "prompt_len": jnp.int32}
SAMPLING_WORDS_PER_ROW = len(_WIRE_VECTOR_DTYPES) + BANNED_WIDTH


def pack_sampling_tensors(tensors: SamplingTensors, out: np.ndarray) -> None:
    """Write host ``tensors`` (S rows, from ``build_sampling_tensors``) into ``out``: int32[S * SAMPLING_WORDS_PER_ROW],
    each vector field as S words, then the ban list as [S, BANNED_WIDTH] padded with -1."""
    num_rows = tensors.temperature.shape[0]
    for i, name in enumerate(_WIRE_VECTOR_DTYPES):
        out[i * num_rows:(i + 1) * num_rows] = np.ascontiguousarray(getattr(tensors, name)).view(np.int32)
    banned = tensors.banned_token_ids
    banned_words = out[len(_WIRE_VECTOR_DTYPES) * num_rows:].reshape(num_rows, BANNED_WIDTH)
    banned_words[:] = -1
    banned_words[:, :banned.shape[1]] = banned


def pack_bias_table(tensors: SamplingTensors) -> np.ndarray | None:
    """The bias table of host ``tensors``: i32[S, bias_table_width(V)] (``logit_bias_ids``, ``logit_bias`` as f32
    bits, ``allowed_token_mask``), or None when no row uses it (``build_sampling_tensors`` left it zero-width)."""
    if tensors.logit_bias_ids.shape[1] == 0:
        return None
    return np.concatenate([tensors.logit_bias_ids, tensors.logit_bias.view(np.int32), tensors.allowed_token_mask],
                          axis=1)


def neutral_bias_table(num_rows: int, vocab_size: int) -> np.ndarray:
    """A bias table (``pack_bias_table``'s layout, i32[num_rows, bias_table_width(vocab_size)]) that changes nothing:
    no ``logit_bias`` entries (ids -1, biases 0.0) and every token allowed (mask bits all set)."""
    ids = np.full((num_rows, LOGIT_BIAS_WIDTH), -1, np.int32)
    biases = np.zeros((num_rows, LOGIT_BIAS_WIDTH), np.float32).view(np.int32)
    mask = np.full((num_rows, allowed_mask_words(vocab_size)), -1, np.int32)
    return np.concatenate([ids, biases, mask], axis=1)


# Index of each field in a row of ``sampling_row_words``; the row order of ``SamplingMode`` (each a superset).
SAMPLING_WIRE_FIELDS = tuple(_WIRE_VECTOR_DTYPES)
_STEPS_FIELD = SAMPLING_WIRE_FIELDS.index("steps")
MODE_ORDER = tuple(SamplingMode)


def sampling_row_words(params: SamplingParams, seed: int, num_prompt_tokens: int, *, eos_token_ids: Sequence[int],
                       vocab_size: int) -> tuple[np.ndarray, int, bool]:
    """A request's sampling row, computed once when the runner's batch takes it: (int32[len(SAMPLING_WIRE_FIELDS)]
    its vector words (``steps`` left 0: set per step), the index in ``MODE_ORDER`` of the cheapest mode serving it,
    whether its steps need the general ``build_sampling_tensors`` (penalty history, bad words, the bias table; the
    steps below ``min_tokens`` need it too, which the caller checks per step))."""
    tensors, mode = build_sampling_tensors([(params, seed, params.min_tokens, (), ())], 1,
                                           eos_token_ids=eos_token_ids, vocab_size=vocab_size)
    words = np.array([np.asarray(getattr(tensors, name))[:1].view(np.int32)[0] for name in SAMPLING_WIRE_FIELDS],
                     np.int32)
    words[SAMPLING_WIRE_FIELDS.index("prompt_len")] = num_prompt_tokens
    needs_general = params.uses_penalties or params.uses_bias_table or bool(params.bad_words_token_ids)
    return words, MODE_ORDER.index(mode), needs_general


def padding_row_words() -> np.ndarray:
    """The vector words of a padding row (greedy, every filter off): int32[len(SAMPLING_WIRE_FIELDS)]."""
    tensors, _ = build_sampling_tensors([], 1)
    return np.array([np.asarray(getattr(tensors, name))[:1].view(np.int32)[0] for name in SAMPLING_WIRE_FIELDS],
                    np.int32)


def pack_sampling_rows(row_words: np.ndarray, steps: np.ndarray, padding_words: np.ndarray, out: np.ndarray) -> None:
    """``pack_sampling_tensors`` for rows whose words were computed once (``sampling_row_words``) and that need no
    bans: row_words int32[n, F] (F = len(SAMPLING_WIRE_FIELDS)), steps int[n] (each row's output index being
    sampled), padding_words int32[F]; ``out`` int32[R * SAMPLING_WORDS_PER_ROW], R >= n."""
    num_rows = len(row_words)
    num_padded = len(out) // SAMPLING_WORDS_PER_ROW
    vectors = out[:len(SAMPLING_WIRE_FIELDS) * num_padded].reshape(len(SAMPLING_WIRE_FIELDS), num_padded)
    vectors[:, :num_rows] = row_words.T
    vectors[_STEPS_FIELD, :num_rows] = steps
    vectors[:, num_rows:] = padding_words[:, None]
    out[len(SAMPLING_WIRE_FIELDS) * num_padded:] = -1  # no bans


def unpack_sampling_tensors(words: jax.Array, prev_token_ids: jax.Array, num_rows: int,
                            bias_table: jax.Array | None = None) -> SamplingTensors:
    """Inverse of ``pack_sampling_tensors`` (and ``pack_bias_table``) inside jit: int32[num_rows *
    SAMPLING_WORDS_PER_ROW] words, the penalty history i32[num_rows, L] (L = 0 without penalties) and the bias table
    i32[num_rows, bias_table_width(V)] (None or width 0 without it) -> device ``SamplingTensors``."""
    fields = {}
    for i, (name, dtype) in enumerate(_WIRE_VECTOR_DTYPES.items()):
        fields[name] = jax.lax.bitcast_convert_type(words[i * num_rows:(i + 1) * num_rows], dtype)
    banned = words[len(_WIRE_VECTOR_DTYPES) * num_rows:].reshape(num_rows, BANNED_WIDTH)
    fields["banned_token_ids"] = banned  # -1 entries are dropped by ban_tokens' scatter
    fields["prev_token_ids"] = prev_token_ids
    if bias_table is None or bias_table.shape[1] == 0:
        fields["logit_bias_ids"] = fields["allowed_token_mask"] = jnp.zeros((num_rows, 0), jnp.int32)
        fields["logit_bias"] = jnp.zeros((num_rows, 0), jnp.float32)
    else:
        fields["logit_bias_ids"] = bias_table[:, :LOGIT_BIAS_WIDTH]
        fields["logit_bias"] = jax.lax.bitcast_convert_type(bias_table[:, LOGIT_BIAS_WIDTH:2 * LOGIT_BIAS_WIDTH],
                                                            jnp.float32)
        fields["allowed_token_mask"] = bias_table[:, 2 * LOGIT_BIAS_WIDTH:]
    return SamplingTensors(**fields)


# ---------------------------------------------------------------------------------------------------------------
# Device side
# ---------------------------------------------------------------------------------------------------------------


def raw_logprob_outputs(
    logits: jax.Array, token_ids: jax.Array, num_logprobs: int, normalize: bool = True, batch_invariant: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(logprob f32[S], top_ids i32[S, K], top_logprobs f32[S, K], rank i32[S]) under log_softmax(logits), or of
    the logits themselves when not ``normalize``. ``batch_invariant``: the normalizer by
    ``paged_jax.ops.batch_invariant.logsumexp_batch_invariant`` (a row's bits whatever S and the program)."""
    if not normalize:
        log_normalizer = jnp.zeros(logits.shape[:1], logits.dtype)
    elif batch_invariant:
        log_normalizer = logsumexp_batch_invariant(logits)
    else:
        log_normalizer = jax.nn.logsumexp(logits, axis=-1)
    sampled_logit = jnp.take_along_axis(logits, token_ids[:, None], axis=-1)[:, 0]
    sampled_logprob = sampled_logit - log_normalizer
    rank = 1 + jnp.sum(logits > sampled_logit[:, None], axis=-1, dtype=jnp.int32)
    if num_logprobs > 0:
        top_logits, top_ids = vocab_top_k(logits, num_logprobs)
        top_logprobs = top_logits - log_normalizer[:, None]
    else:
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
        top_logprobs = jnp.zeros((logits.shape[0], 0), jnp.float32)
    return sampled_logprob, top_ids.astype(jnp.int32), top_logprobs, rank


@functools.partial(jax.jit, static_argnames=("mode", "num_logprobs", "logprobs_mode", "batch_invariant",
                                             "token_logprobs"))
def sample(
    logits: jax.Array, t: SamplingTensors, *, mode: SamplingMode | str, num_logprobs: int = 0,
    logprobs_mode: str = "raw_logprobs", batch_invariant: bool = False, token_logprobs: bool = True
) -> SamplerOutput:
    """Sample one token per row.

    Args:
      logits: f32[S, V] (other float dtypes are upcast) raw logits of the last position of each row.
      t: ``SamplingTensors`` with leading dimension S.
      mode: static ``SamplingMode`` (or its string value); see ``build_sampling_tensors``.
      num_logprobs: static K >= 0, number of top alternatives to return (the runner uses the max over rows).
      logprobs_mode: static, one of ``LOGPROBS_MODES`` (see the module docstring).
      batch_invariant: static; the engine's batch-invariant mode: logprobs by ``raw_logprob_outputs``'s.
      token_logprobs: static; False in GREEDY mode without top logprobs: the tokens only (logprobs and ranks zeros),
        no pass over the vocabulary but the argmax's (the model runner's greedy steps that fetch no logprobs).
    Returns:
      ``SamplerOutput``. Greedy rows (temperature < SAMPLING_EPS) get argmax (lowest index on ties) of the raw
      logits, or of the penalised logits in FULL mode.
    """
    mode = SamplingMode(mode)
    if num_logprobs < 0:
        raise ValueError(f"num_logprobs must be non-negative, got {num_logprobs}")
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
    logits = logits.astype(jnp.float32)
    vocab_size = logits.shape[1]
    greedy_rows = t.temperature < SAMPLING_EPS

    reported = logits  # what the logprobs are taken of
    if mode == SamplingMode.GREEDY:
        token_ids = jnp.argmax(logits, axis=-1)
        if not token_logprobs and not num_logprobs:
            zeros = jnp.zeros(logits.shape[:1], jnp.float32)
            return SamplerOutput(token_ids.astype(jnp.int32), zeros, jnp.zeros((len(zeros), 0), jnp.int32),
                                 jnp.zeros((len(zeros), 0), jnp.float32), zeros.astype(jnp.int32))
    else:
        processed = logits
        if mode == SamplingMode.FULL:
            processed = apply_allowed_token_mask(processed, t.allowed_token_mask)
            processed = ban_tokens(processed, t.banned_token_ids)
            processed = apply_logit_bias(processed, t.logit_bias_ids, t.logit_bias)
            processed = apply_penalties(
                processed, t.prev_token_ids, t.prompt_len, t.presence, t.frequency, t.repetition
            )
        greedy_ids = jnp.argmax(processed, axis=-1)
        # Greedy rows divide by 1 (their sample is discarded) to avoid dividing by zero.
        safe_temperature = jnp.where(greedy_rows, 1.0, t.temperature)
        if mode in (SamplingMode.TOP_K, SamplingMode.FULL):
            filters = top_k_top_p_by_sort if mode == SamplingMode.FULL else top_k_top_p_from_candidates
            scaled = temperature_and_filters(processed, safe_temperature, t.min_p, t.top_k, t.top_p, filters)
        else:
            scaled = temperature_and_filters(processed, safe_temperature)
        sampled_ids = jnp.argmax(scaled + gumbel_noise(t.seeds, t.steps, vocab_size), axis=-1)
        token_ids = jnp.where(greedy_rows, greedy_ids, sampled_ids)
        if logprobs_mode.startswith("processed"):
            reported = jnp.where(greedy_rows[:, None], processed, scaled)

    token_ids = token_ids.astype(jnp.int32)
    sampled_logprob, top_ids, top_logprobs, rank = raw_logprob_outputs(
        reported, token_ids, num_logprobs, normalize=logprobs_mode.endswith("logprobs"),
        batch_invariant=batch_invariant)
    return SamplerOutput(
        token_ids=token_ids, logprobs=sampled_logprob, top_ids=top_ids, top_logprobs=top_logprobs, token_ranks=rank
    )
