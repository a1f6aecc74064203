"""score_tokens (per-token log-probs of given sequences) against transformers; load_pretrained from a Hub cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.config import ModelConfig
from models.llama import LlamaForCausalLM
from models.testing import tiny_config, write_hub_cache
from paged_jax.research.generate import generate
from paged_jax.research.scoring import load_pretrained, score_tokens

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def smollm2_hub(smollm2_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("hub")
    files = {path.name: path for path in smollm2_dir.iterdir() if path.is_file()}
    write_hub_cache(cache, "HuggingFaceTB/SmolLM2-135M-Instruct", {COMMIT: files}, {"main": COMMIT})
    return cache


@pytest.fixture(scope="module")
def smollm2_pretrained(smollm2_hub):
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    try:
        yield load_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", dtype="float32", download_dir=str(smollm2_hub))
    finally:
        mp.undo()


def test_load_pretrained_from_the_hub_cache(smollm2_pretrained):
    graphdef, state, config, tokenizer = smollm2_pretrained
    assert config.hidden_size == 576 and config.num_hidden_layers == 30
    assert tokenizer is not None and tokenizer.chat_template
    # Ready for generate as it is.
    prompt = tokenizer.encode("The capital of France is")
    out = generate((graphdef, state), np.array([prompt], np.int32), np.array([len(prompt)], np.int32),
                   max_new_tokens=2)
    assert out.tokens.shape == (1, 2)


def test_scores_match_transformers_on_smollm2(smollm2_pretrained, hf_smollm2_model):
    import torch

    graphdef, state, _, tokenizer = smollm2_pretrained
    texts = ["The capital of France is Paris.", "1, 2, 3, 4, 5, 6, 7", "Hi"]
    rows = [tokenizer.encode(text) for text in texts]
    width = max(map(len, rows)) + 3  # extra padding columns must not matter
    token_ids = np.full((len(rows), width), 7, np.int32)
    for b, row in enumerate(rows):
        token_ids[b, :len(row)] = row
    lengths = np.array([len(row) for row in rows], np.int32)

    scores = np.asarray(jax.jit(score_tokens)((graphdef, state), token_ids, lengths))

    assert scores.shape == token_ids.shape and scores.dtype == np.float32
    for b, row in enumerate(rows):
        with torch.no_grad():
            logits = hf_smollm2_model(torch.tensor([row])).logits[0].double()
        expected = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(row[1:])[:, None])[:, 0].numpy()
        np.testing.assert_allclose(scores[b, 1:len(row)], expected, atol=2e-4, rtol=0)
        assert scores[b, 0] == 0 and np.all(scores[b, len(row):] == 0)
        assert np.all(scores[b, 1:len(row)] < 0)


def test_padding_never_reaches_valid_rows_and_gradients_flow():
    config = ModelConfig.from_hf_config(tiny_config("qwen3"))
    model = LlamaForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(3))
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    token_ids = rng.integers(0, config.vocab_size, (3, 9)).astype(np.int32)
    lengths = np.array([9, 4, 1], np.int32)
    other_padding = token_ids.copy()
    other_padding[1, 4:] = rng.integers(0, config.vocab_size, 5)
    np.testing.assert_array_equal(np.asarray(score_tokens(model, token_ids, lengths)),
                                  np.asarray(score_tokens(model, other_padding, lengths)))

    def loss(state):
        return -jnp.sum(score_tokens((graphdef, state), token_ids, lengths))

    grads = jax.jit(jax.grad(loss))(state)
    leaves = [np.asarray(g) for g in jax.tree.leaves(grads)]
    assert all(np.all(np.isfinite(g)) for g in leaves) and any(np.any(g != 0) for g in leaves)


def test_generate_logprobs_equal_scores_of_the_generated_tokens():
    config = ModelConfig.from_hf_config(tiny_config("llama"))
    model = LlamaForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(5))
    prompts = np.array([[5, 9, 11, 3], [8, 2, 0, 0]], np.int32)
    prompt_lengths = np.array([4, 2], np.int32)
    out = generate(model, prompts, prompt_lengths, max_new_tokens=5, rng=jax.random.key(1),
                   temperature=jnp.float32(1.0))
    rows = [list(prompts[b, :prompt_lengths[b]]) + list(np.asarray(out.tokens[b])) for b in range(2)]
    rows[1] += [0, 0]  # right padding
    scores = np.asarray(score_tokens(model, np.array(rows, np.int32), np.array([9, 7], np.int32)))
    np.testing.assert_allclose(scores[0, 4:9], np.asarray(out.logprobs[0]), atol=1e-5)
    np.testing.assert_allclose(scores[1, 2:7], np.asarray(out.logprobs[1]), atol=1e-5)


@pytest.mark.parametrize("token_ids, lengths, field", [
    (np.zeros((2,), np.int32), np.ones((2,), np.int32), "token_ids"),
    (np.zeros((2, 3), np.float32), np.ones((2,), np.int32), "token_ids"),
    (np.zeros((2, 3), np.int32), np.ones((3,), np.int32), "lengths"),
])
def test_bad_arguments_name_the_field(token_ids, lengths, field):
    model = LlamaForCausalLM(ModelConfig.from_hf_config(tiny_config("llama")), dtype=jnp.float32, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=field):
        score_tokens(model, token_ids, lengths)
