"""The real SmolLM2-135M-Instruct in fp32: greedy decoding is token-for-token identical to transformers.

Our side runs a small jitted greedy loop with a contiguous per-sequence KV cache threaded through the model's
``kv_caches`` (the same AttentionFn contract the paged engine uses): one ragged prefill of all prompts, then
fixed-shape decode steps, so only two programs are compiled.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.loader import load_model

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

MAX_NEW_TOKENS = 32

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Give me three tips for learning a new language.",
    "Explain what a prime number is in one sentence.",
]
RAW_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
    "Paris is",
]


def cached_attention(seq_idx, positions, sm_scale):
    """AttentionFn over a contiguous cache ``(k [B, L, Hkv, D], v [B, L, Hkv, D])`` per layer.

    Token t belongs to sequence ``seq_idx[t]`` (``-1`` = padding, whose writes are dropped) at ``positions[t]``; it
    writes its k/v there and attends to that sequence's cache entries ``0..positions[t]``.
    """

    def attention(layer_idx, q, k, v, kv_layer):
        k_cache, v_cache = kv_layer
        num_seqs, max_len = k_cache.shape[:2]
        write_seq = jnp.where(seq_idx >= 0, seq_idx, num_seqs)  # out of range -> dropped
        k_cache = k_cache.at[write_seq, positions].set(k, mode="drop")
        v_cache = v_cache.at[write_seq, positions].set(v, mode="drop")
        read_seq = jnp.clip(seq_idx, 0, num_seqs - 1)
        keys = k_cache[read_seq]  # [T, L, Hkv, D]
        values = v_cache[read_seq]
        group = q.shape[1] // k.shape[1]
        keys = jnp.repeat(keys, group, axis=2)
        values = jnp.repeat(values, group, axis=2)
        scores = jnp.einsum("thd,tlhd->thl", q, keys) * sm_scale
        visible = jnp.arange(max_len)[None, :] <= positions[:, None]  # [T, L]
        scores = jnp.where(visible[:, None, :], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        return jnp.einsum("thl,tlhd->thd", probs, values), (k_cache, v_cache)

    return attention


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def _step(model, input_ids, positions, seq_idx, kv_caches, *, sm_scale):
    """One forward over a flat batch; returns (greedy next token per token int32[T], kv_caches)."""
    hidden, kv_caches = model(input_ids, positions, kv_caches, cached_attention(seq_idx, positions, sm_scale))
    return jnp.argmax(model.compute_logits(hidden), axis=-1).astype(jnp.int32), kv_caches


def greedy_generate(model, config, prompts: list[list[int]], max_new_tokens: int, eos_ids) -> list[list[int]]:
    num_seqs = len(prompts)
    max_len = max(map(len, prompts)) + max_new_tokens
    kv_shape = (num_seqs, max_len, config.num_key_value_heads, config.head_dim)
    kv_caches = [(jnp.zeros(kv_shape, jnp.float32), jnp.zeros(kv_shape, jnp.float32))
                 for _ in range(config.num_hidden_layers)]
    sm_scale = config.head_dim ** -0.5

    # Ragged prefill: all prompts in one flat batch, padded to a multiple of 64 tokens.
    flat_ids = np.concatenate([np.asarray(p, np.int32) for p in prompts])
    flat_pos = np.concatenate([np.arange(len(p), dtype=np.int32) for p in prompts])
    flat_seq = np.concatenate([np.full(len(p), i, np.int32) for i, p in enumerate(prompts)])
    padded = -(-len(flat_ids) // 64) * 64
    pad = padded - len(flat_ids)
    flat_ids = np.concatenate([flat_ids, np.zeros(pad, np.int32)])
    flat_pos = np.concatenate([flat_pos, np.zeros(pad, np.int32)])
    flat_seq = np.concatenate([flat_seq, np.full(pad, -1, np.int32)])
    next_tokens, kv_caches = _step(model, jnp.asarray(flat_ids), jnp.asarray(flat_pos), jnp.asarray(flat_seq),
                                   kv_caches, sm_scale=sm_scale)
    last_index = np.cumsum([len(p) for p in prompts]) - 1
    current = np.asarray(next_tokens)[last_index]

    generated = [[int(t)] for t in current]
    positions = np.array([len(p) for p in prompts], np.int32)
    seq_idx = jnp.arange(num_seqs, dtype=jnp.int32)
    for _ in range(max_new_tokens - 1):
        next_tokens, kv_caches = _step(model, jnp.asarray(current), jnp.asarray(positions), seq_idx, kv_caches,
                                       sm_scale=sm_scale)
        current = np.asarray(next_tokens)
        positions = positions + 1
        for out, token in zip(generated, current):
            out.append(int(token))
    # Stop at the first EOS (inclusive), as transformers' generate does.
    finished = []
    for out in generated:
        stop = next((i for i, t in enumerate(out) if t in eos_ids), None)
        finished.append(out if stop is None else out[: stop + 1])
    return finished


@pytest.fixture(scope="module")
def prompt_ids(smollm2_tokenizer):
    chat = [
        smollm2_tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=False)
        for text in CHAT_PROMPTS
    ]
    texts = chat + RAW_PROMPTS
    special = [False] * len(chat) + [True] * len(RAW_PROMPTS)
    return [smollm2_tokenizer(t, add_special_tokens=s).input_ids for t, s in zip(texts, special)]


@pytest.fixture(scope="module")
def our_outputs(smollm2_dir, prompt_ids):
    model, config = load_model(smollm2_dir, dtype="float32")
    assert config.tie_word_embeddings and model.lm_head is None
    return greedy_generate(model, config, prompt_ids, MAX_NEW_TOKENS, set(config.eos_token_ids))


def test_greedy_matches_transformers_token_for_token(hf_greedy, smollm2_tokenizer, prompt_ids, our_outputs):
    assert len(prompt_ids) >= 8
    # transformers' greedy continuations (stopping after EOS id 2, the checkpoint's EOS), generated batched.
    for prompt, ours, reference in zip(prompt_ids, our_outputs, hf_greedy.many(prompt_ids, MAX_NEW_TOKENS),
                                       strict=True):
        assert ours == reference, (
            f"prompt {smollm2_tokenizer.decode(prompt)!r}:\nours: {smollm2_tokenizer.decode(ours)!r}\n"
            f"hf:   {smollm2_tokenizer.decode(reference)!r}"
        )


def test_capital_of_france(smollm2_tokenizer, our_outputs):
    answer = smollm2_tokenizer.decode(our_outputs[0], skip_special_tokens=True)
    assert answer.startswith("The capital of France is Paris."), answer
