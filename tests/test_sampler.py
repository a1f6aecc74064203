"""On-device sampler: greedy, seeded sampling, truncation, penalties and logprobs, checked against numpy (CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.worker.sampler import (
    BANNED_WIDTH,
    LOGIT_BIAS_WIDTH,
    SamplingMode,
    bias_table_width,
    build_sampling_tensors,
    check_request_fits,
    neutral_bias_table,
    pack_bias_table,
    pack_sampling_tensors,
    sample,
    seed_to_u32,
    unpack_sampling_tensors,
    SAMPLING_WORDS_PER_ROW,
)
from paged_jax.sampling_params import SamplingParams
from paged_jax.worker.logit_processing import (apply_allowed_token_mask, apply_logit_bias, apply_min_p, apply_penalties,
                                               gumbel_noise)
from paged_jax.worker.top_k import TOP_K_CANDIDATES, top_k_block_size, top_k_top_p_by_sort

VOCAB = 64


def _row(params, seed=0, step=0, prompt=(1, 2, 3), output=()):
    return (params, seed, step, list(prompt), list(output))


def _sample(rows, logits, pad_to=None, penalty_len=32, num_logprobs=0, mode=None, **kwargs):
    tensors, picked_mode = build_sampling_tensors(rows, pad_to or len(rows), penalty_len=penalty_len, **kwargs)
    out = sample(jnp.asarray(logits, jnp.float32), tensors, mode=mode or picked_mode, num_logprobs=num_logprobs)
    return jax.tree.map(np.asarray, out), picked_mode


def _random_logits(seed, rows, vocab=VOCAB, scale=3.0):
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * scale).astype(np.float32)


# ---------------------------------------------------------------------------------------------------------------
# Host side: tensors and mode selection
# ---------------------------------------------------------------------------------------------------------------


def test_mode_selection_and_padding():
    greedy = SamplingParams(temperature=0.0)
    tensors, mode = build_sampling_tensors([_row(greedy), None], pad_to=4)
    assert mode == SamplingMode.GREEDY
    assert tensors.temperature.shape == (4,) and tensors.temperature.dtype == np.float32
    assert tensors.seeds.dtype == np.uint32 and tensors.prev_token_ids.shape == (4, 0)
    assert tensors.banned_token_ids.shape == (4, 0)
    np.testing.assert_array_equal(tensors.temperature, 0.0)  # padding rows are greedy

    _, mode = build_sampling_tensors([_row(greedy), _row(SamplingParams(temperature=0.7))], pad_to=2)
    assert mode == SamplingMode.GREEDY_OR_TEMPERATURE
    # Truncation on a greedy row does not matter, so it does not force FULL.
    _, mode = build_sampling_tensors([_row(SamplingParams(temperature=0.0, top_k=3, top_p=0.5))], pad_to=1)
    assert mode == SamplingMode.GREEDY
    # Top-k / top-p that the candidates serve (paged_jax.worker.top_k.candidates_suffice) run without the sort: TOP_K.
    vocab = 1000
    expected = [(SamplingParams(top_k=3), SamplingMode.TOP_K), (SamplingParams(min_p=0.1), SamplingMode.TOP_K),
                (SamplingParams(top_k=20, top_p=0.95), SamplingMode.TOP_K),
                (SamplingParams(top_k=TOP_K_CANDIDATES, top_p=0.5), SamplingMode.TOP_K),
                (SamplingParams(top_k=vocab, min_p=0.2), SamplingMode.TOP_K),  # top_k >= V is off
                (SamplingParams(top_p=0.9), SamplingMode.FULL),  # top-p alone can need any number of tokens
                (SamplingParams(top_k=TOP_K_CANDIDATES + 1), SamplingMode.FULL),
                (SamplingParams(top_k=vocab, top_p=0.9), SamplingMode.FULL)]
    for params, want in expected:
        tensors, mode = build_sampling_tensors([_row(params)], pad_to=2, penalty_len=8, vocab_size=vocab)
        assert mode == want, params
        assert tensors.prev_token_ids.shape == (2, 0)
    # One row that needs the sort makes the whole step FULL.
    _, mode = build_sampling_tensors([_row(SamplingParams(top_k=3)), _row(SamplingParams(top_p=0.9))], pad_to=2,
                                     vocab_size=vocab)
    assert mode == SamplingMode.FULL
    # Without vocab_size a top_k past the candidates needs the sort, even one that would cover the vocabulary.
    _, mode = build_sampling_tensors([_row(SamplingParams(top_k=vocab, min_p=0.2))], pad_to=2)
    assert mode == SamplingMode.FULL
    tensors, mode = build_sampling_tensors([_row(SamplingParams(top_p=0.9))], pad_to=2, need_penalties=True,
                                           penalty_len=8)
    assert tensors.prev_token_ids.shape == (2, 8)

    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    tensors, mode = build_sampling_tensors([None, _row(penalised, prompt=[5, 6], output=[7])], pad_to=3,
                                           penalty_len=6)
    assert mode == SamplingMode.FULL
    np.testing.assert_array_equal(tensors.prev_token_ids[1], [5, 6, 7, -1, -1, -1])
    np.testing.assert_array_equal(tensors.prev_token_ids[0], -1)
    assert tensors.prompt_len[1] == 2


def test_build_errors():
    penalised = SamplingParams(frequency_penalty=0.5)
    with pytest.raises(ValueError, match="penalty_len"):
        build_sampling_tensors([_row(penalised, prompt=[1, 2, 3], output=[4, 5])], pad_to=1, penalty_len=4)
    with pytest.raises(ValueError, match="need_penalties"):
        build_sampling_tensors([_row(penalised)], pad_to=1, need_penalties=False, penalty_len=8)
    with pytest.raises(ValueError, match="pad_to"):
        build_sampling_tensors([_row(SamplingParams())] * 3, pad_to=2)


def test_seed_folding_keeps_high_bits():
    assert seed_to_u32(5) == 5
    assert seed_to_u32(5 + (1 << 32)) != seed_to_u32(5)
    assert 0 <= seed_to_u32(-1) < (1 << 32)


# ---------------------------------------------------------------------------------------------------------------
# Greedy
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [SamplingMode.GREEDY, SamplingMode.GREEDY_OR_TEMPERATURE, SamplingMode.FULL])
def test_greedy_is_argmax_with_lowest_index_on_ties(mode):
    logits = _random_logits(0, 6)
    logits[2, 10] = logits[2, 40] = logits[2].max() + 1.0  # a tie: argmax must pick 10
    greedy = SamplingParams(temperature=0.0)
    rows = [_row(greedy, seed=i) for i in range(6)]
    out, _ = _sample(rows, logits, mode=mode)
    np.testing.assert_array_equal(out.token_ids, np.argmax(logits, axis=-1))
    assert out.token_ids[2] == 10


def test_top_k_1_equals_greedy():
    logits = _random_logits(1, 8, vocab=4001)  # past the candidates: top_k mode's own path
    rows = [_row(SamplingParams(temperature=1.5, top_k=1), seed=100 + i, step=i) for i in range(8)]
    out, mode = _sample(rows, logits, vocab_size=4001)
    assert mode == SamplingMode.TOP_K
    np.testing.assert_array_equal(out.token_ids, np.argmax(logits, axis=-1))


def test_huge_top_k_keeps_every_token():
    """A top_k beyond int32 (accepted by SamplingParams, as in vLLM) must not overflow: it keeps every token."""
    logits = _random_logits(2, 4)
    huge = [_row(SamplingParams(temperature=1.0, top_k=2**40, top_p=0.999), seed=7 + i) for i in range(4)]
    off = [_row(SamplingParams(temperature=1.0, top_k=0, top_p=0.999), seed=7 + i) for i in range(4)]
    np.testing.assert_array_equal(_sample(huge, logits)[0].token_ids, _sample(off, logits)[0].token_ids)


# ---------------------------------------------------------------------------------------------------------------
# Seeded randomness
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.9, top_p=0.95)])
def test_seeded_sampling_independent_of_batch_and_position(params):
    logits_row = _random_logits(2, 1, scale=1.0)[0]  # flat-ish distribution: many tokens are likely
    other = SamplingParams(temperature=0.8, top_k=5)
    # Batch A: our request alone at row 0. Batch B: at row 3 of 5, among other requests, with padding.
    batch_a_logits = logits_row[None]
    batch_b_logits = _random_logits(3, 6)
    batch_b_logits[3] = logits_row
    tokens_a, tokens_b = [], []
    for step in range(6):
        out_a, _ = _sample([_row(params, seed=1234, step=step)], batch_a_logits, pad_to=2)
        rows_b = [_row(other, seed=1, step=step), None, _row(other, seed=99, step=0), _row(params, seed=1234, step=step),
                  _row(SamplingParams(temperature=0.0))]
        out_b, _ = _sample(rows_b, batch_b_logits, pad_to=6, mode=SamplingMode.FULL)
        tokens_a.append(int(out_a.token_ids[0]))
        tokens_b.append(int(out_b.token_ids[3]))
    assert tokens_a == tokens_b
    assert len(set(tokens_a)) > 1, "different steps must draw different randomness"
    # Re-running is reproducible.
    again, _ = _sample([_row(params, seed=1234, step=0)], batch_a_logits, pad_to=2)
    assert int(again.token_ids[0]) == tokens_a[0]


def test_top_k_mode_draws_what_full_mode_draws():
    """Rows the candidates serve (top_k 1..TOP_K_CANDIDATES with or without top_p, min_p alone, top_k past the
    vocabulary) draw the same tokens from the same seeds in TOP_K mode (no sort) as in FULL mode (the sort), on a
    vocabulary larger than the candidates, with top logprobs. Greedy and padding rows included."""
    vocab = 4001
    assert top_k_block_size(vocab, TOP_K_CANDIDATES), "the candidates' two-stage top-k must run"
    logits = _random_logits(11, 24, vocab=vocab, scale=1.5)
    params = [SamplingParams(temperature=0.6, top_k=20, top_p=0.95), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=1.2, top_k=TOP_K_CANDIDATES, top_p=0.8),
              SamplingParams(temperature=0.9, min_p=0.05), SamplingParams(temperature=1.0, top_k=vocab + 7),
              SamplingParams(temperature=0.7, top_k=5, top_p=0.3, min_p=0.1), SamplingParams(temperature=0.0)]
    rows = [_row(params[i % len(params)], seed=31 * i, step=i) for i in range(22)] + [None, None]
    out_top_k, mode = _sample(rows, logits, vocab_size=vocab, num_logprobs=3)
    assert mode == SamplingMode.TOP_K
    out_full, _ = _sample(rows, logits, vocab_size=vocab, num_logprobs=3, mode=SamplingMode.FULL)
    for field in out_full._fields:
        np.testing.assert_array_equal(getattr(out_top_k, field), getattr(out_full, field), err_msg=field)
    assert len(set(out_full.token_ids[:22].tolist())) > 10, "the rows must not all draw their argmax"


def test_temperature_only_modes_agree():
    # With no truncation, FULL and GREEDY_OR_TEMPERATURE must draw the same token from the same seed and step.
    logits = _random_logits(4, 16, scale=1.0)
    rows = [_row(SamplingParams(temperature=0.7), seed=7 * i, step=i) for i in range(16)]
    out_fast, mode = _sample(rows, logits)
    assert mode == SamplingMode.GREEDY_OR_TEMPERATURE
    out_full, _ = _sample(rows, logits, mode=SamplingMode.FULL)
    np.testing.assert_array_equal(out_fast.token_ids, out_full.token_ids)


def _draw_many(params, logits_row, count, mode=None):
    """Sample ``count`` tokens from one distribution, one row per seed (deterministic)."""
    logits = np.broadcast_to(logits_row, (count, logits_row.shape[0]))
    rows = [_row(params, seed=seed, step=3) for seed in range(count)]
    out, _ = _sample(rows, logits, mode=mode)
    return out.token_ids


def test_temperature_frequencies_match_softmax():
    logits_row = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2], np.float32)
    temperature = 0.7
    count = 4000
    tokens = _draw_many(SamplingParams(temperature=temperature), logits_row, count)
    expected = np.exp(logits_row / temperature)
    expected = expected / expected.sum() * count
    observed = np.bincount(tokens, minlength=logits_row.size)
    chi_square = float(((observed - expected) ** 2 / expected).sum())
    # 7 degrees of freedom: P(chi2 > 35) ~ 1e-5. Seeds are fixed, so this cannot flake.
    assert chi_square < 35.0, (observed, expected)


# ---------------------------------------------------------------------------------------------------------------
# Truncation
# ---------------------------------------------------------------------------------------------------------------

PEAKED_PROBS = np.array([0.45, 0.3, 0.15, 0.04, 0.03, 0.02, 0.01], np.float64)
PEAKED_LOGITS = np.log(PEAKED_PROBS).astype(np.float32)


@pytest.mark.parametrize(
    "params, allowed",
    [
        (SamplingParams(top_p=0.7), {0, 1}),  # 0.45 < 0.7 <= 0.75
        (SamplingParams(top_p=0.4), {0}),  # the top token alone already covers 0.4
        (SamplingParams(top_p=0.85), {0, 1, 2}),
        (SamplingParams(min_p=0.3), {0, 1, 2}),  # keep p >= 0.135
        (SamplingParams(min_p=0.7), {0}),
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_k=3, top_p=0.6), {0, 1}),  # renormalised over 3: 0.5, 0.33, 0.17
        (SamplingParams(top_k=2, min_p=0.05), {0, 1}),
    ],
)
def test_truncation_only_samples_allowed_tokens(params, allowed):
    tokens = _draw_many(params, PEAKED_LOGITS, 600)
    assert set(tokens.tolist()) == allowed


def test_top_p_keeps_renormalised_nucleus_frequencies():
    tokens = _draw_many(SamplingParams(top_p=0.7), PEAKED_LOGITS, 2000)
    share_of_top = float(np.mean(tokens == 0))
    assert abs(share_of_top - 0.45 / 0.75) < 0.05


def _numpy_top_k_top_p_mask(logits, top_k, top_p):
    keep = np.zeros_like(logits, dtype=bool)
    for row, row_logits in enumerate(logits.astype(np.float64)):
        order = np.argsort(-row_logits, kind="stable")
        k = top_k[row] if top_k[row] > 0 else row_logits.size
        order = order[:k]
        probs = np.exp(row_logits[order] - row_logits[order].max())
        probs /= probs.sum()
        mass_before = np.cumsum(probs) - probs
        kept = order[(mass_before < top_p[row]) | (top_p[row] >= 1.0)]
        keep[row, kept] = True
    return keep


def test_top_k_top_p_mask_matches_numpy_reference():
    rows = 12
    logits = _random_logits(5, rows, vocab=200, scale=2.0)
    rng = np.random.default_rng(6)
    top_k = rng.choice([0, 1, 5, 50, 200, 300], size=rows).astype(np.int32)
    top_p = rng.choice([1.0, 0.9, 0.5, 0.1, 0.99], size=rows).astype(np.float32)
    masked = np.asarray(jax.jit(top_k_top_p_by_sort)(jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p)))
    np.testing.assert_array_equal(np.isfinite(masked), _numpy_top_k_top_p_mask(logits, top_k, top_p))
    kept = np.isfinite(masked)
    np.testing.assert_array_equal(masked[kept], logits[kept])


def test_min_p_mask_matches_numpy_reference():
    logits = _random_logits(7, 4, vocab=100)
    min_p = np.array([0.0, 0.05, 0.5, 1.0], np.float32)
    masked = np.asarray(apply_min_p(jnp.asarray(logits), jnp.asarray(min_p)))
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    expected_keep = probs >= min_p[:, None] * probs.max(-1, keepdims=True)
    np.testing.assert_array_equal(np.isfinite(masked), expected_keep)


# ---------------------------------------------------------------------------------------------------------------
# Penalties and min_tokens
# ---------------------------------------------------------------------------------------------------------------


def _numpy_penalties(logits, prompt, output, presence, frequency, repetition):
    """vLLM's formulas, written out directly."""
    logits = logits.astype(np.float64).copy()
    seen = set(prompt) | set(output)
    for token in seen:
        logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
    counts = np.bincount(np.asarray(output, np.int64), minlength=logits.size) if output else np.zeros(logits.size)
    logits -= frequency * counts
    logits -= presence * (counts > 0)
    return logits


PENALTY_CASES = [
    # (prompt, output, presence, frequency, repetition)
    ([1, 2, 3, 3], [4, 4, 4, 2, 9], 0.5, 0.3, 1.4),
    ([10, 11], [11, 12, 12], -1.0, 0.0, 1.0),
    ([5, 6, 7], [], 0.0, 0.0, 0.7),
    ([0], [0, 0, 63], 0.0, 2.0, 1.0),
    ([1, 2], [3], 0.0, 0.0, 1.0),  # neutral: must be unchanged
]


def test_apply_penalties_matches_vllm_formulas():
    logits = _random_logits(8, len(PENALTY_CASES))
    width = 12
    prev = np.full((len(PENALTY_CASES), width), -1, np.int32)
    prompt_len = np.zeros(len(PENALTY_CASES), np.int32)
    for row, (prompt, output, *_rest) in enumerate(PENALTY_CASES):
        prev[row, : len(prompt) + len(output)] = prompt + output
        prompt_len[row] = len(prompt)
    presence, frequency, repetition = (np.array([case[i] for case in PENALTY_CASES], np.float32) for i in (2, 3, 4))
    penalised = np.asarray(apply_penalties(jnp.asarray(logits), jnp.asarray(prev), jnp.asarray(prompt_len),
                                           jnp.asarray(presence), jnp.asarray(frequency), jnp.asarray(repetition)))
    for row, (prompt, output, pres, freq, rep) in enumerate(PENALTY_CASES):
        expected = _numpy_penalties(logits[row], prompt, output, pres, freq, rep)
        np.testing.assert_allclose(penalised[row], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(penalised[-1], logits[-1])  # neutral row is bit-identical


def test_greedy_with_penalties_follows_penalised_argmax():
    logits = _random_logits(9, len(PENALTY_CASES))
    # Make the raw argmax a token that appears in the output, so the penalty has to move the choice.
    for row, (prompt, output, *_rest) in enumerate(PENALTY_CASES):
        if output:
            logits[row, output[0]] = logits[row].max() + 0.5
    rows = [
        _row(SamplingParams(temperature=0.0, presence_penalty=pres, frequency_penalty=freq, repetition_penalty=rep),
             prompt=prompt, output=output, step=len(output))
        for prompt, output, pres, freq, rep in PENALTY_CASES
    ]
    out, mode = _sample(rows, logits, penalty_len=16, num_logprobs=2)
    assert mode == SamplingMode.FULL
    expected = [np.argmax(_numpy_penalties(logits[row], *case)) for row, case in enumerate(PENALTY_CASES)]
    np.testing.assert_array_equal(out.token_ids, expected)
    assert (out.token_ids != np.argmax(logits, -1)).any()
    # Logprobs stay those of the raw logits.
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    np.testing.assert_allclose(out.logprobs, raw[np.arange(len(rows)), out.token_ids], rtol=1e-5, atol=1e-5)


def test_min_tokens_bans_eos_and_stop_ids():
    eos = 7
    logits = np.zeros((4, VOCAB), np.float32)
    logits[:, eos] = 10.0
    logits[:, 3] = 9.0
    logits[:, 5] = 8.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    rows = [
        _row(params, step=0),  # below min_tokens: eos and 3 banned -> 5
        _row(params, step=2),  # reached: eos allowed
        _row(SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True), step=1),  # eos not banned
        _row(SamplingParams(temperature=0.0), step=0),
    ]
    out, mode = _sample(rows, logits, eos_token_ids=[eos])
    assert mode == SamplingMode.FULL
    np.testing.assert_array_equal(out.token_ids, [5, eos, eos, eos])


# ---------------------------------------------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [SamplingMode.GREEDY_OR_TEMPERATURE, SamplingMode.FULL])
def test_logprobs_are_raw_log_softmax_and_true_top_k(mode):
    logits = _random_logits(10, 5)
    rows = [_row(SamplingParams(temperature=1.3, top_k=20, repetition_penalty=1.2), seed=i, step=i,
                 output=[int(np.argmax(logits[i]))]) for i in range(4)] + [None]
    num_logprobs = 4
    tensors, _ = build_sampling_tensors(rows, 5, need_penalties=True, penalty_len=8)
    out = jax.tree.map(np.asarray, sample(jnp.asarray(logits), tensors, mode=mode, num_logprobs=num_logprobs))
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    np.testing.assert_allclose(out.logprobs, raw[np.arange(5), out.token_ids], rtol=1e-5, atol=1e-5)
    expected_top = np.argsort(-raw, axis=-1, kind="stable")[:, :num_logprobs]
    np.testing.assert_array_equal(out.top_ids, expected_top)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(raw, expected_top, -1), rtol=1e-5, atol=1e-5)
    expected_rank = 1 + (raw > raw[np.arange(5), out.token_ids][:, None]).sum(-1)
    np.testing.assert_array_equal(out.token_ranks, expected_rank)
    assert out.top_ids.dtype == np.int32 and out.token_ids.dtype == np.int32


def test_zero_logprobs_gives_empty_alternatives():
    logits = _random_logits(11, 2)
    out, _ = _sample([_row(SamplingParams(temperature=0.0))] * 2, logits, num_logprobs=0)
    assert out.top_ids.shape == (2, 0) and out.top_logprobs.shape == (2, 0)
    np.testing.assert_array_equal(out.token_ranks, [1, 1])


# ---------------------------------------------------------------------------------------------------------------
# logit_bias, allowed_token_ids, bad_words
# ---------------------------------------------------------------------------------------------------------------


def _with_bad_words(params, *token_sequences):
    """``params`` with its bad words already tokenized (what the engine's ``update_from_tokenizer`` fills in)."""
    params._bad_words_token_ids = [list(ids) for ids in token_sequences]
    return params


def _numpy_logit_processing(logits, params, output, eos_token_ids=()):
    """vLLM's order, written out directly: allowed_token_ids -> bad words -> min_tokens -> logit_bias -> penalties."""
    logits = logits.astype(np.float64).copy()
    if params.allowed_token_ids is not None:
        disallowed = np.ones(logits.size, bool)
        disallowed[params.allowed_token_ids] = False
        logits[disallowed] = -np.inf
    for word in params.bad_words_token_ids:
        if len(word) == 1 or list(output[len(output) - (len(word) - 1):]) == word[:-1] and len(output) >= len(word) - 1:
            logits[word[-1]] = -np.inf
    if len(output) < params.min_tokens:
        logits[list(params.stop_token_ids or []) + ([] if params.ignore_eos else list(eos_token_ids))] = -np.inf
    for token_id, bias in (params.logit_bias or {}).items():
        logits[token_id] += bias
    return _numpy_penalties(logits, [1, 2, 3], list(output), params.presence_penalty, params.frequency_penalty,
                            params.repetition_penalty)


LOGIT_PROCESSING_CASES = [
    # (params, output ids)
    (SamplingParams(temperature=0.0, logit_bias={5: 30.0, 9: -100.0, 0: 2.5}), []),
    (SamplingParams(temperature=0.0, allowed_token_ids=[3, 17, 40, 63]), [1]),
    (SamplingParams(temperature=0.8, allowed_token_ids=[3, 17, 40, 63], logit_bias={17: 4.0}), [2, 2]),
    (_with_bad_words(SamplingParams(temperature=0.0), [11], [20, 21], [30, 31, 32]), [4, 30, 31]),
    (_with_bad_words(SamplingParams(temperature=0.9, top_k=10, logit_bias={21: 50.0}), [20, 21], [7]), [20]),
    (_with_bad_words(SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[6]), [20, 21]), [9, 21]),
    (SamplingParams(temperature=0.0, logit_bias={4: 100.0}, repetition_penalty=1.5, presence_penalty=1.0), [4]),
    (SamplingParams(temperature=0.7), [1, 2]),  # no processing in the same batch: unchanged
]


def test_logit_bias_allowed_ids_and_bad_words_match_numpy_reference():
    """Greedy rows follow the argmax of the processed logits, random rows the Gumbel-max over them (the same noise
    the sampler draws), for each combination of the three fields, penalties and min_tokens, in one batch."""
    eos = [63]
    logits = _random_logits(12, len(LOGIT_PROCESSING_CASES) + 1)
    rows = [_row(params, seed=50 + i, step=len(output), output=output)
            for i, (params, output) in enumerate(LOGIT_PROCESSING_CASES)] + [None]
    tensors, mode = build_sampling_tensors(rows, len(rows), penalty_len=16, eos_token_ids=eos, vocab_size=VOCAB)
    assert mode == SamplingMode.FULL
    out = jax.tree.map(np.asarray, sample(jnp.asarray(logits), tensors, mode=mode, num_logprobs=3))
    noise = np.asarray(gumbel_noise(jnp.asarray(tensors.seeds), jnp.asarray(tensors.steps), VOCAB))
    for i, (params, output) in enumerate(LOGIT_PROCESSING_CASES):
        processed = _numpy_logit_processing(logits[i], params, output, eos)
        if params.is_greedy:
            expected = int(np.argmax(processed))
        else:
            scaled = processed / params.temperature
            if params.top_k:
                scaled[scaled < np.sort(scaled)[-params.top_k]] = -np.inf
            expected = int(np.argmax(scaled + noise[i]))
        assert out.token_ids[i] == expected, (i, params)
    # The processing moved the choice away from the raw argmax, and logprobs stay those of the raw logits.
    assert (out.token_ids[:3] != np.argmax(logits[:3], -1)).all()
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    np.testing.assert_allclose(out.logprobs, raw[np.arange(len(rows)), out.token_ids], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-raw, axis=-1, kind="stable")[:, :3])


def test_allowed_token_ids_restrict_every_sample():
    allowed = [2, 33, 34, 65]  # a vocabulary that is not a multiple of 32: the mask's last word is partial
    vocab = 70
    params = SamplingParams(temperature=2.0, allowed_token_ids=allowed)
    logits = np.broadcast_to(_random_logits(13, 1, vocab=vocab)[0], (64, vocab))
    rows = [_row(params, seed=seed) for seed in range(64)]
    tensors, _ = build_sampling_tensors(rows, 64, vocab_size=vocab)
    assert tensors.allowed_token_mask.shape == (64, 3)
    tokens = np.asarray(sample(jnp.asarray(logits), tensors, mode=SamplingMode.FULL).token_ids)
    assert set(tokens.tolist()) == set(allowed)  # every allowed id turns up at temperature 2, nothing else


def test_device_helpers_match_numpy():
    vocab = 70
    logits = _random_logits(14, 3, vocab=vocab)
    mask = np.full((3, 3), -1, np.int32)
    mask[1] = 0
    mask[1, 0] = np.array([(1 << 31) | 1], np.uint32).view(np.int32)[0]  # ids 0 and 31 (the sign bit)
    mask[1, 2] = 1 << 1  # id 65
    masked = np.asarray(apply_allowed_token_mask(jnp.asarray(logits), jnp.asarray(mask)))
    np.testing.assert_array_equal(masked[[0, 2]], logits[[0, 2]])
    assert np.flatnonzero(np.isfinite(masked[1])).tolist() == [0, 31, 65]
    ids = np.array([[3, 69, -1], [-1, -1, -1], [0, 1, 2]], np.int32)
    bias = np.array([[1.5, -2.0, 9.0], [5.0, 5.0, 5.0], [-100.0, 100.0, 0.25]], np.float32)
    biased = np.asarray(apply_logit_bias(jnp.asarray(logits), jnp.asarray(ids), jnp.asarray(bias)))
    expected = logits.copy()
    for row in range(3):
        for token_id, value in zip(ids[row], bias[row]):
            if token_id >= 0:
                expected[row, token_id] += value
    np.testing.assert_allclose(biased, expected, rtol=1e-6)


def test_bias_table_shapes_and_wire_round_trip():
    plain = SamplingParams(temperature=0.0)
    tensors, mode = build_sampling_tensors([_row(plain)], 2, vocab_size=VOCAB)
    assert mode == SamplingMode.GREEDY and tensors.logit_bias_ids.shape == (2, 0)
    assert pack_bias_table(tensors) is None  # steps without such rows send no table
    rows = [_row(SamplingParams(temperature=0.0, logit_bias={7: -3.5, 60: 1.0})), None,
            _row(SamplingParams(temperature=0.0, allowed_token_ids=[1, 40]))]
    tensors, mode = build_sampling_tensors(rows, 4, vocab_size=VOCAB)
    assert mode == SamplingMode.FULL
    assert tensors.logit_bias_ids.shape == (4, LOGIT_BIAS_WIDTH) and tensors.allowed_token_mask.shape == (4, 2)
    np.testing.assert_array_equal(tensors.logit_bias_ids[0, :3], [7, 60, -1])
    np.testing.assert_array_equal(tensors.allowed_token_mask[[0, 1, 3]], -1)  # rows without allowed ids: all on
    table = pack_bias_table(tensors)
    assert table.shape == (4, bias_table_width(VOCAB)) and table.dtype == np.int32
    words = np.zeros(4 * SAMPLING_WORDS_PER_ROW, np.int32)
    pack_sampling_tensors(tensors, words)
    unpacked = unpack_sampling_tensors(jnp.asarray(words), jnp.zeros((4, 0), jnp.int32), 4, jnp.asarray(table))
    for name in ("logit_bias_ids", "logit_bias", "allowed_token_mask", "temperature"):
        np.testing.assert_array_equal(np.asarray(getattr(unpacked, name)), getattr(tensors, name), err_msg=name)
    no_table = unpack_sampling_tensors(jnp.asarray(words), jnp.zeros((4, 0), jnp.int32), 4)
    assert no_table.logit_bias_ids.shape == (4, 0) and no_table.allowed_token_mask.shape == (4, 0)
    with pytest.raises(ValueError, match="vocab_size"):
        build_sampling_tensors(rows, 4)


def test_neutral_bias_table_changes_nothing():
    """Full mode's penalty variant always takes a bias table: a step with penalties but no logit_bias /
    allowed_token_ids row gets ``neutral_bias_table``. Tokens, logprobs and ranks are then exactly those of the step
    without a table, for penalty rows, plain rows and padding rows."""
    penalised = SamplingParams(temperature=0.8, presence_penalty=1.5, repetition_penalty=1.3, seed=5)
    greedy_penalised = SamplingParams(temperature=0.0, frequency_penalty=0.4)
    plain = SamplingParams(temperature=0.9, top_p=0.8, seed=7)
    logits = jnp.asarray(_random_logits(11, 4))
    rows = [_row(penalised, output=(7, 7, 9)), _row(plain), _row(greedy_penalised, output=(3,)), None]
    tensors, mode = build_sampling_tensors(rows, 4, penalty_len=32, vocab_size=VOCAB)
    assert mode == SamplingMode.FULL and pack_bias_table(tensors) is None
    words = np.zeros(4 * SAMPLING_WORDS_PER_ROW, np.int32)
    pack_sampling_tensors(tensors, words)
    history = jnp.asarray(tensors.prev_token_ids)
    without = unpack_sampling_tensors(jnp.asarray(words), history, 4)
    neutral = unpack_sampling_tensors(jnp.asarray(words), history, 4, jnp.asarray(neutral_bias_table(4, VOCAB)))
    assert neutral.logit_bias_ids.shape == (4, LOGIT_BIAS_WIDTH)
    want = sample(logits, without, mode=mode, num_logprobs=3)
    got = sample(logits, neutral, mode=mode, num_logprobs=3)
    for name, a, b in zip(want._fields, want, got):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)


def test_bad_words_ban_the_last_token_after_the_prefix():
    params = _with_bad_words(SamplingParams(temperature=0.0), [5], [8, 9], [1, 2, 3])
    cases = [([], [5]), ([8], [5, 9]), ([4, 8], [5, 9]), ([1, 2], [3, 5]), ([2], [5]), ([1, 2, 4], [5])]
    for output, banned in cases:
        tensors, mode = build_sampling_tensors([_row(params, step=len(output), output=output)], 1)
        assert mode == SamplingMode.FULL
        assert sorted(set(tensors.banned_token_ids[0].tolist()) - {-1}) == banned, output
    # Banned only after the prefix: with no single-token word and no match, the step needs no bans at all.
    params = _with_bad_words(SamplingParams(temperature=0.0), [8, 9])
    tensors, mode = build_sampling_tensors([_row(params, step=1, output=[4])], 1)
    assert mode == SamplingMode.GREEDY and tensors.banned_token_ids.shape == (1, 0)


def test_check_request_fits():
    check_request_fits(SamplingParams(logit_bias={i: 1.0 for i in range(LOGIT_BIAS_WIDTH)}), vocab_size=1000,
                       eos_token_ids=[2])
    too_many = SamplingParams(logit_bias={i: 1.0 for i in range(LOGIT_BIAS_WIDTH + 1)})
    with pytest.raises(ValueError, match=f"logit_bias: at most {LOGIT_BIAS_WIDTH}"):
        check_request_fits(too_many, vocab_size=1000, eos_token_ids=[2])
    for params, field in ((SamplingParams(logit_bias={VOCAB: 1.0}), "logit_bias"),
                          (SamplingParams(logit_bias={-1: 1.0}), "logit_bias"),
                          (SamplingParams(allowed_token_ids=[1, VOCAB]), "allowed_token_ids"),
                          (_with_bad_words(SamplingParams(), [1, VOCAB + 3]), "bad_words")):
        with pytest.raises(ValueError, match=f"^{field} token id"):
            check_request_fits(params, vocab_size=VOCAB, eos_token_ids=[2])
    # Bans share BANNED_WIDTH with min_tokens' stop ids and EOS.
    words = [[i] for i in range(10, 10 + BANNED_WIDTH - 1)]
    check_request_fits(_with_bad_words(SamplingParams(min_tokens=2), *words), vocab_size=VOCAB, eos_token_ids=[2])
    with pytest.raises(ValueError, match="^bad_words: at most"):
        check_request_fits(_with_bad_words(SamplingParams(min_tokens=2, stop_token_ids=[3]), *words),
                           vocab_size=VOCAB, eos_token_ids=[2])
    with pytest.raises(ValueError, match="^stop_token_ids: at most"):
        check_request_fits(SamplingParams(min_tokens=1, stop_token_ids=list(range(3, 3 + BANNED_WIDTH))),
                           vocab_size=VOCAB, eos_token_ids=[2])
