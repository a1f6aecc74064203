"""On-device sampler: greedy, seeded sampling, truncation, penalties and logprobs, checked against numpy (CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.sampler import (
    SamplingMode,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    build_sampling_tensors,
    sample,
    seed_to_u32,
)
from paged_jax.sampling_params import SamplingParams

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
    for params in (SamplingParams(top_k=3), SamplingParams(top_p=0.9), SamplingParams(min_p=0.1)):
        tensors, mode = build_sampling_tensors([_row(params)], pad_to=2, penalty_len=8)
        assert mode == SamplingMode.FULL and tensors.prev_token_ids.shape == (2, 0)
    tensors, mode = build_sampling_tensors([_row(SamplingParams(top_k=3))], pad_to=2, need_penalties=True,
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
    logits = _random_logits(1, 8)
    rows = [_row(SamplingParams(temperature=1.5, top_k=1), seed=100 + i, step=i) for i in range(8)]
    out, mode = _sample(rows, logits)
    assert mode == SamplingMode.FULL
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
    masked = np.asarray(jax.jit(apply_top_k_top_p)(jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p)))
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
