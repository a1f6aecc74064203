"""paged_jax.research.generate: the jittable research API (CPU; 8 virtual devices from conftest for the sharding test)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.attention import dense_causal_attention
from models.config import ModelConfig
from models.llama import LlamaForCausalLM
from models.testing import tiny_config
from paged_jax.research.generate import GenerateOutput, generate
from paged_jax.worker.sampler import SamplingMode

# Ragged, right-padded prompts for the tiny models (vocab 256); lengths 5, 2, 1, 7.
TINY_PROMPTS = np.array(
    [[5, 6, 7, 8, 9, 0, 0], [10, 11, 0, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0, 0], [40, 41, 42, 43, 44, 45, 46]],
    np.int32,
)
TINY_LENGTHS = np.array([5, 2, 1, 7], np.int32)
NUM_NEW = 6  # most tiny-model calls share this and one sampling layout, so they share compiled programs


def _sampling(temperature=1.0, top_k=0, top_p=1.0) -> dict:
    """Per-row traced sampling parameters ([4] arrays): calls differing only in their values reuse one program."""
    return dict(temperature=jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (4,)),
                top_k=jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (4,)),
                top_p=jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (4,)))


def _tiny_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    config = ModelConfig.from_hf_config(tiny_config(**overrides))
    return LlamaForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def tiny_model():
    return _tiny_model()


@pytest.fixture(scope="module")
def tiny_greedy(tiny_model) -> GenerateOutput:
    """Statically greedy output of the tiny model on TINY_PROMPTS (no EOS)."""
    return generate(tiny_model, TINY_PROMPTS, TINY_LENGTHS, max_new_tokens=NUM_NEW)


def _dense_logits_fn(model, width: int):
    """Jitted cache-free forward of one right-padded sequence int32[width] -> float32[width, V] (one compile)."""
    config = model.config

    @jax.jit
    def logits(ids, length):
        # Padding tokens get segment -1: they only see themselves and never influence the real tokens.
        valid = jnp.arange(width) < length
        attention = dense_causal_attention(jnp.where(valid, 0, -1), config.head_dim ** -0.5, config.sliding_window)
        hidden, _ = model(ids, jnp.arange(width, dtype=jnp.int32), None, attention)
        return model.compute_logits(hidden)

    return logits


def _dense_greedy(logits_fn, width: int, prompt, num_new: int) -> list[int]:
    """Greedy continuation by re-running the whole sequence with cache-free dense attention each step."""
    sequence = np.zeros(width, np.int32)
    sequence[:len(prompt)] = prompt
    for length in range(len(prompt), len(prompt) + num_new):
        sequence[length] = int(jnp.argmax(logits_fn(sequence, length)[length - 1]))
    return sequence[len(prompt):len(prompt) + num_new].tolist()


# ---------------------------------------------------------------------------------------------------------------
# Correctness
# ---------------------------------------------------------------------------------------------------------------


def test_greedy_matches_transformers_on_smollm2(smollm2_dir, smollm2_tokenizer, hf_smollm2_model):
    torch = pytest.importorskip("torch")
    from models.loader import load_model

    model, config = load_model(smollm2_dir, dtype="float32")
    texts = [
        "The capital of France is",
        "Write a haiku about the sea.",
        "1, 2, 3, 4,",
        "Explain in one sentence why the sky is blue, as if talking to a child who keeps asking why.",
    ]
    prompts = [smollm2_tokenizer(text)["input_ids"] for text in texts]
    lengths = np.array([len(p) for p in prompts], np.int32)
    assert len(set(lengths.tolist())) == len(texts)  # genuinely ragged
    prompt_tokens = np.zeros((len(prompts), lengths.max()), np.int32)
    for row, prompt in enumerate(prompts):
        prompt_tokens[row, :len(prompt)] = prompt
    max_new_tokens = 10
    eos = tuple(config.eos_token_ids)

    out = generate(model, prompt_tokens, lengths, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0)

    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            hf_ids = hf_smollm2_model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(eos), pad_token_id=0,
            )[0, len(prompt):].tolist()
        length = int(out.lengths[row])
        assert out.tokens[row, :length].tolist() == hf_ids, f"row {row} ({texts[row]!r})"
        assert np.all(np.asarray(out.tokens[row, length:]) == 0)
        assert bool(out.finished[row]) == (hf_ids[-1] in eos)
    # Raw-model logprobs of greedy tokens: finite, <= 0, and exactly 0 after a row finished.
    logprobs = np.asarray(out.logprobs)
    valid = np.arange(max_new_tokens)[None, :] < np.asarray(out.lengths)[:, None]
    assert np.all(np.isfinite(logprobs)) and np.all(logprobs[valid] <= 0) and np.all(logprobs[~valid] == 0)


def test_greedy_matches_dense_recompute_with_sliding_window():
    # Window 4 with prompts up to 7 tokens + 6 new ones: the window cuts into the prompt and the generated tokens.
    model = _tiny_model(seed=3, architecture="mistral", sliding_window=4)
    out = generate(model, TINY_PROMPTS, TINY_LENGTHS, max_new_tokens=6, block_size=4)
    width = TINY_PROMPTS.shape[1] + 6
    logits_fn = _dense_logits_fn(model, width)
    for row in range(len(TINY_LENGTHS)):
        expected = _dense_greedy(logits_fn, width, TINY_PROMPTS[row, :TINY_LENGTHS[row]], 6)
        assert out.tokens[row].tolist() == expected
    assert out.lengths.tolist() == [6] * 4 and not np.any(out.finished)


def test_logprobs_are_raw_model_logprobs(tiny_model):
    out = generate(tiny_model, TINY_PROMPTS, TINY_LENGTHS, max_new_tokens=NUM_NEW, rng=jax.random.key(0),
                   **_sampling(temperature=0.7, top_k=20))
    width = TINY_PROMPTS.shape[1] + NUM_NEW
    logits_fn = _dense_logits_fn(tiny_model, width)
    for row in range(len(TINY_LENGTHS)):
        length = TINY_LENGTHS[row] + NUM_NEW
        sequence = np.zeros(width, np.int32)
        sequence[:length] = np.concatenate([TINY_PROMPTS[row, :TINY_LENGTHS[row]], np.asarray(out.tokens[row])])
        logprobs = np.asarray(jax.nn.log_softmax(logits_fn(sequence, length), axis=-1))
        positions = np.arange(TINY_LENGTHS[row] - 1, length - 1)
        expected = logprobs[positions, sequence[positions + 1]]
        np.testing.assert_allclose(np.asarray(out.logprobs[row]), expected, rtol=1e-5, atol=1e-5)


def test_python_top_k_beyond_int32_is_off(tiny_model):
    """A Python top_k past int32 (as past the vocabulary) keeps every token, as top_k 0 does, instead of failing
    to convert; a very negative one is off too, and so is a host int64 array's entry past int32 (not wrapped)."""
    def tokens(top_k):
        return generate(tiny_model, TINY_PROMPTS, TINY_LENGTHS, max_new_tokens=4, rng=jax.random.key(5),
                        temperature=1.0, top_k=top_k).tokens

    off = np.asarray(tokens(0))
    np.testing.assert_array_equal(np.asarray(tokens(2 ** 40)), off)
    np.testing.assert_array_equal(np.asarray(tokens(-(2 ** 40))), off)
    wrapping = np.full((len(TINY_LENGTHS),), 2 ** 32 + 1, np.int64)  # int32 of it is 1: greedy
    np.testing.assert_array_equal(np.asarray(tokens(wrapping)), np.asarray(tokens(np.zeros_like(wrapping))))


def test_eos_stops_rows_and_pads(tiny_model, tiny_greedy):
    tokens = np.asarray(tiny_greedy.tokens)
    # Choose EOS ids that the greedy continuations hit at known steps: row 0 at step 2, row 3 at step 0.
    eos = (int(tokens[0, 2]), int(tokens[3, 0]))
    out = generate(tiny_model, TINY_PROMPTS, TINY_LENGTHS, max_new_tokens=6, eos_token_id=eos, pad_token_id=255)
    for row in range(len(TINY_LENGTHS)):
        hits = [step for step in range(6) if int(tokens[row, step]) in eos]
        expected_length = hits[0] + 1 if hits else 6
        assert int(out.lengths[row]) == expected_length
        assert bool(out.finished[row]) == bool(hits)
        assert out.tokens[row, :expected_length].tolist() == tokens[row, :expected_length].tolist()
        assert np.all(np.asarray(out.tokens[row, expected_length:]) == 255)
        np.testing.assert_array_equal(np.asarray(out.logprobs[row, expected_length:]), 0.0)
    assert int(out.lengths[0]) == 3 and int(out.lengths[3]) == 1

    # When every row hits EOS at the first token the loop exits at once; outputs are still full-shape.
    first = tuple(int(t) for t in tokens[:, 0])
    done = generate(tiny_model, TINY_PROMPTS, TINY_LENGTHS, max_new_tokens=6, eos_token_id=first)
    assert done.lengths.tolist() == [1] * 4 and np.all(done.finished)
    assert done.tokens.shape == (4, 6) and np.all(np.asarray(done.tokens[:, 1:]) == 0)


# ---------------------------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible(tiny_model):
    def sample(seed):
        return generate(tiny_model, TINY_PROMPTS, TINY_LENGTHS, max_new_tokens=NUM_NEW, rng=jax.random.key(seed),
                        **_sampling(top_p=0.95))

    first, again, other = sample(0), sample(0), sample(1)
    np.testing.assert_array_equal(np.asarray(first.tokens), np.asarray(again.tokens))
    np.testing.assert_array_equal(np.asarray(first.logprobs), np.asarray(again.logprobs))
    assert not np.array_equal(np.asarray(first.tokens), np.asarray(other.tokens))
    # A legacy uint32[2] key works too and means the same as the typed key with that data.
    legacy = generate(tiny_model, TINY_PROMPTS, TINY_LENGTHS, max_new_tokens=NUM_NEW,
                      rng=jax.random.key_data(jax.random.key(0)), **_sampling(top_p=0.95))
    np.testing.assert_array_equal(np.asarray(legacy.tokens), np.asarray(first.tokens))


@pytest.mark.parametrize("traced", [False, True])
def test_top_k_mode_draws_what_the_sort_draws(tiny_model, monkeypatch, traced):
    """top_k 1..64 with any top_p runs the sampler's TOP_K mode (no sort), static or per-row traced parameters
    (then chosen at run time: the branch that ran is recorded); the tokens and logprobs equal those of FULL mode
    (forced by refusing the candidates), from the same key."""
    import paged_jax.research.generate as generate_module

    if traced:  # row 2 is greedy: its top-p alone does not call for the sort (the engine ignores it too)
        params = _sampling(temperature=[0.8, 0.8, 0.0, 0.8], top_k=[20, 1, 0, 64], top_p=[0.9, 1.0, 0.5, 0.8])
    else:
        params = dict(temperature=0.8, top_k=20, top_p=0.9)
    ran, real_sample = [], generate_module.sample

    def recording_sample(logits, tensors, *, mode, **kwargs):
        jax.debug.callback(lambda: ran.append(SamplingMode(mode)))  # fires for the branch that runs only
        return real_sample(logits, tensors, mode=mode, **kwargs)

    outs = []
    with monkeypatch.context() as patch:
        patch.setattr(generate_module, "sample", recording_sample)
        for refuse in (False, True):
            if refuse:
                patch.setattr(generate_module, "candidates_suffice",
                              lambda k, p, v: False if isinstance(k, int) else jnp.zeros_like(k, bool))
            generate_module._generate_jit(()).clear_cache()  # the patches are not part of jit's cache key
            ran.clear()
            outs.append(jax.block_until_ready(generate(tiny_model, TINY_PROMPTS, TINY_LENGTHS,
                                                       max_new_tokens=NUM_NEW, rng=jax.random.key(3), **params)))
            jax.effects_barrier()
            assert ran and set(ran) == {SamplingMode.FULL if refuse else SamplingMode.TOP_K}
    generate_module._generate_jit(()).clear_cache()  # later tests compile the real functions again
    np.testing.assert_array_equal(np.asarray(outs[0].tokens), np.asarray(outs[1].tokens))
    np.testing.assert_array_equal(np.asarray(outs[0].logprobs), np.asarray(outs[1].logprobs))
    assert len(set(np.asarray(outs[0].tokens).ravel().tolist())) > 4


def test_per_row_traced_sampling_params(tiny_model, tiny_greedy):
    greedy = tiny_greedy
    # Rows 0 and 2 greedy, rows 1 and 3 sampled; top_k = 1 makes row 3 greedy again despite its temperature.
    out = generate(tiny_model, TINY_PROMPTS, TINY_LENGTHS, max_new_tokens=NUM_NEW, rng=jax.random.key(7),
                   **_sampling(temperature=[0.0, 1.5, 0.0, 2.0], top_k=[0, 0, 0, 1]))
    for row in (0, 2, 3):
        assert out.tokens[row].tolist() == greedy.tokens[row].tolist()
    assert out.tokens[1].tolist() != greedy.tokens[1].tolist()


def test_vmap_over_rngs_gives_independent_samples(tiny_model):
    keys = jax.random.split(jax.random.key(42), 3)

    @jax.jit
    def many_samples(keys):
        return jax.vmap(lambda key: generate(tiny_model, TINY_PROMPTS, TINY_LENGTHS, max_new_tokens=NUM_NEW,
                                             rng=key, **_sampling()))(keys)

    out = many_samples(keys)
    assert out.tokens.shape == (3, 4, NUM_NEW) and out.logprobs.shape == (3, 4, NUM_NEW)
    assert out.lengths.shape == (3, 4) and out.finished.shape == (3, 4)
    for a in range(3):
        for b in range(a + 1, 3):
            assert not np.array_equal(np.asarray(out.tokens[a]), np.asarray(out.tokens[b]))
    # Sample s is exactly what an unbatched call with keys[s] returns.
    for sample in range(3):
        single = generate(tiny_model, TINY_PROMPTS, TINY_LENGTHS, max_new_tokens=NUM_NEW, rng=keys[sample],
                          **_sampling())
        np.testing.assert_array_equal(np.asarray(out.tokens[sample]), np.asarray(single.tokens))
        np.testing.assert_allclose(np.asarray(out.logprobs[sample]), np.asarray(single.logprobs), atol=1e-5)


def test_vmap_over_prompts_and_over_weights(tiny_model, tiny_greedy):
    # Mapping over prompts (a batch of batches) is folded into one batch, like mapping over keys.
    stacked_prompts = np.stack([TINY_PROMPTS, TINY_PROMPTS[::-1]])
    stacked_lengths = np.stack([TINY_LENGTHS, TINY_LENGTHS[::-1]])
    out = jax.vmap(lambda p, n: generate(tiny_model, p, n, max_new_tokens=NUM_NEW))(stacked_prompts, stacked_lengths)
    greedy = tiny_greedy
    np.testing.assert_array_equal(np.asarray(out.tokens[0]), np.asarray(greedy.tokens))
    np.testing.assert_array_equal(np.asarray(out.tokens[1]), np.asarray(greedy.tokens)[::-1])

    # Mapping over the weights (an ensemble) falls back to vectorizing the whole program.
    graphdef, state = nnx.split(tiny_model)
    _, other_state = nnx.split(_tiny_model(seed=1))
    ensemble = jax.tree.map(lambda a, b: jnp.stack([a, b]), state, other_state)
    out = jax.vmap(lambda s: generate((graphdef, s), TINY_PROMPTS, TINY_LENGTHS, max_new_tokens=NUM_NEW))(ensemble)
    np.testing.assert_array_equal(np.asarray(out.tokens[0]), np.asarray(greedy.tokens))
    other_greedy = generate((graphdef, other_state), TINY_PROMPTS, TINY_LENGTHS, max_new_tokens=NUM_NEW)
    np.testing.assert_array_equal(np.asarray(out.tokens[1]), np.asarray(other_greedy.tokens))


# ---------------------------------------------------------------------------------------------------------------
# Composition with user code: jit, transfer guard, sharding
# ---------------------------------------------------------------------------------------------------------------


def test_runs_inside_a_user_jitted_step(tiny_model, tiny_greedy):
    graphdef, state = nnx.split(tiny_model)

    @jax.jit
    def rollout_step(state, prompts, lengths, key, temperature):
        out = generate((graphdef, state), prompts, lengths, max_new_tokens=NUM_NEW, rng=key, temperature=temperature)
        mean_logprob = jnp.mean(out.logprobs)
        return out, mean_logprob

    key = jax.random.key(3)
    out, mean_logprob = rollout_step(state, TINY_PROMPTS, TINY_LENGTHS, key, jnp.float32(0.9))
    direct = generate(tiny_model, TINY_PROMPTS, TINY_LENGTHS, max_new_tokens=NUM_NEW, rng=key,
                      **_sampling(temperature=0.9))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(direct.tokens))
    np.testing.assert_allclose(float(mean_logprob), np.asarray(direct.logprobs).mean(), rtol=1e-5)

    # nnx.jit with the module itself as the argument works too.
    @nnx.jit
    def nnx_step(model, prompts, lengths):
        return generate(model, prompts, lengths, max_new_tokens=NUM_NEW)

    np.testing.assert_array_equal(np.asarray(nnx_step(tiny_model, TINY_PROMPTS, TINY_LENGTHS).tokens),
                                  np.asarray(tiny_greedy.tokens))


def test_policy_gradient_step_around_generate(tiny_model):
    # The RL pattern: sample inside the differentiated function, then score the samples with a forward pass.
    graphdef, state = nnx.split(tiny_model)
    config = tiny_model.config

    def loss(state, key):
        out = generate((graphdef, state), TINY_PROMPTS[:1], TINY_LENGTHS[:1], max_new_tokens=NUM_NEW, rng=key,
                       temperature=jnp.float32(1.0))
        model = nnx.merge(graphdef, state)
        sequence = jnp.concatenate([jnp.asarray(TINY_PROMPTS[0, :TINY_LENGTHS[0]]), out.tokens[0]])
        attention = dense_causal_attention(jnp.zeros(sequence.shape, jnp.int32), config.head_dim ** -0.5)
        hidden, _ = model(sequence, jnp.arange(sequence.shape[0], dtype=jnp.int32), None, attention)
        logprobs = jax.nn.log_softmax(model.compute_logits(hidden[TINY_LENGTHS[0] - 1:-1]), axis=-1)
        policy_logprobs = jnp.take_along_axis(logprobs, out.tokens[0][:, None], axis=-1)[:, 0]
        return -jnp.mean(policy_logprobs), (policy_logprobs, out.logprobs[0])

    grads, (policy_logprobs, sampled_logprobs) = jax.jit(jax.grad(loss, has_aux=True))(state, jax.random.key(9))
    # generate's own logprobs (which carry no gradient) agree with the differentiable forward pass.
    np.testing.assert_allclose(np.asarray(policy_logprobs), np.asarray(sampled_logprobs), atol=1e-5)
    grad_leaves = [np.asarray(g) for g in jax.tree.leaves(grads)]
    assert all(np.all(np.isfinite(g)) for g in grad_leaves)
    assert any(np.any(g != 0) for g in grad_leaves)


def test_no_host_transfer_inside_the_call(tiny_model):
    graphdef, state = nnx.split(tiny_model)
    prompts = jax.device_put(TINY_PROMPTS)
    lengths = jax.device_put(TINY_LENGTHS)
    key = jax.random.key(5)
    temperature = jax.device_put(np.full(4, 0.8, np.float32))
    top_p = jax.device_put(np.float32(0.9))
    jax.block_until_ready((state, prompts, lengths, key, temperature, top_p))
    with jax.transfer_guard("disallow"):
        # Compilation and execution both happen under the guard: no constant or output crosses the host boundary.
        out = generate((graphdef, state), prompts, lengths, max_new_tokens=4, rng=key, temperature=temperature,
                       top_p=top_p, eos_token_id=(2, 3))
        greedy = generate((graphdef, state), prompts, lengths, max_new_tokens=NUM_NEW)
        jax.block_until_ready((out, greedy))
    assert isinstance(out, GenerateOutput) and out.tokens.shape == (4, 4) and greedy.tokens.shape == (4, NUM_NEW)


def _tp_spec(path) -> PartitionSpec:
    """Megatron-style tensor parallelism: column-parallel q/k/v/gate/up/lm_head, row-parallel o/down."""
    names = [str(entry.key) for entry in path if isinstance(entry, jax.tree_util.DictKey)]
    if names[-1] == "kernel" and names[-2] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head"):
        return PartitionSpec(None, "tp")
    if names[-1] == "kernel" and names[-2] in ("o_proj", "down_proj"):
        return PartitionSpec("tp", None)
    return PartitionSpec()


def test_sharded_params_match_unsharded_without_gathering_weights():
    num_devices = 4
    assert len(jax.devices()) >= num_devices, "conftest should give 8 virtual CPU devices"
    # 8 query heads, 4 kv heads and intermediate 128 all divide over 4 devices.
    model = _tiny_model(seed=5, num_attention_heads=8, num_key_value_heads=4, head_dim=16, intermediate_size=128)
    graphdef, state = nnx.split(model)
    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("tp",))
    specs = jax.tree_util.tree_map_with_path(lambda path, _: _tp_spec(path), state)
    sharded_state = jax.tree.map(lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), state, specs)
    sharded_kernels = [x for x, spec in zip(jax.tree.leaves(sharded_state), jax.tree.leaves(specs))
                       if spec != PartitionSpec()]
    assert len(sharded_kernels) == 7 * model.config.num_hidden_layers + 1
    shardings_before = [x.sharding for x in sharded_kernels]

    kwargs = dict(max_new_tokens=NUM_NEW, rng=jax.random.key(11), **_sampling(temperature=0.8))

    # Called inside the user's jit with the sharded state as an argument; compiled once, HLO inspected below.
    @jax.jit
    def step(state):
        return generate((graphdef, state), TINY_PROMPTS, TINY_LENGTHS, **kwargs)

    compiled = step.lower(sharded_state).compile()
    sharded = compiled(sharded_state)
    unsharded = generate((graphdef, state), TINY_PROMPTS, TINY_LENGTHS, **kwargs)
    np.testing.assert_array_equal(np.asarray(sharded.tokens), np.asarray(unsharded.tokens))
    np.testing.assert_allclose(np.asarray(sharded.logprobs), np.asarray(unsharded.logprobs), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(sharded.lengths), np.asarray(unsharded.lengths))

    # The weights keep their sharding, and the compiled program is really partitioned over the mesh...
    assert [x.sharding for x in sharded_kernels] == shardings_before
    assert all(len(x.sharding.device_set) == num_devices for x in sharded_kernels)
    assert set(sharded.tokens.sharding.device_set) == set(mesh.devices.flat)

    # ...and never all-gathers a weight: every all-gather in it is smaller than the smallest sharded kernel.
    hlo = compiled.as_text()
    assert "all-reduce" in hlo  # row-parallel projections reduce their partial sums
    smallest_kernel = min(x.size for x in sharded_kernels)
    gathered_sizes = [
        int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        for dims in re.findall(r"= \w+\[([\d,]*)\][^=]*? all-gather\(", hlo)
    ]
    assert all(size < smallest_kernel for size in gathered_sizes), gathered_sizes


def test_sharding_plan_runs_attention_per_device(tiny_model):
    from models.tensor_parallel import shard_model
    from paged_jax.parallel import ShardingPlan, make_mesh

    # 4 q heads / 2 kv heads over tp = 4: the plan replicates each kv head twice, and the KV pool is head-sharded.
    plan = ShardingPlan.create(tiny_model.config, make_mesh(4))
    sharded_model = shard_model(tiny_model, plan)
    kwargs = dict(max_new_tokens=NUM_NEW, rng=jax.random.key(2), **_sampling(temperature=0.7))
    expected = generate(tiny_model, TINY_PROMPTS, TINY_LENGTHS, **kwargs)
    out = generate(sharded_model, TINY_PROMPTS, TINY_LENGTHS, sharding_plan=plan, **kwargs)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(expected.tokens))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(expected.logprobs), atol=1e-5)
    # The program really runs on all 4 devices.
    assert len(out.tokens.sharding.device_set) == 4
    with pytest.raises(ValueError, match="data_parallel_size"):
        generate(sharded_model, TINY_PROMPTS, TINY_LENGTHS, max_new_tokens=2,
                 sharding_plan=ShardingPlan.create(tiny_model.config, make_mesh(2, 2)))


# ---------------------------------------------------------------------------------------------------------------
# Argument checking
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(prompt_tokens=np.zeros((4,), np.int32)), "prompt_tokens"),
        (dict(prompt_tokens=np.zeros((4, 7), np.float32)), "prompt_tokens"),
        (dict(prompt_lengths=np.array([1, 2, 3], np.int32)), "prompt_lengths"),
        (dict(prompt_lengths=np.array([1, 2, 3, 8], np.int32)), "prompt_lengths"),
        (dict(prompt_lengths=np.array([0, 2, 3, 4], np.int32)), "prompt_lengths"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(block_size=0), "block_size"),
        (dict(temperature=0.5), "rng"),
        (dict(temperature=-1.0, rng=jax.random.key(0)), "temperature"),
        (dict(temperature=np.ones(3, np.float32), rng=jax.random.key(0)), "temperature"),
        (dict(top_p=0.0, rng=jax.random.key(0)), "top_p"),
        (dict(top_k=np.ones(4, np.float32)), "top_k"),
        (dict(rng=jax.random.split(jax.random.key(0), 2), temperature=1.0), "rng"),
        (dict(eos_token_id=-1), "eos_token_id"),
        (dict(attention_impl="flash"), "attention_impl"),
        (dict(model="not a model"), "model"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_field(tiny_model, kwargs, field):
    call = dict(model=tiny_model, prompt_tokens=TINY_PROMPTS, prompt_lengths=TINY_LENGTHS, max_new_tokens=3)
    call.update(kwargs)
    model = call.pop("model")
    prompt_tokens = call.pop("prompt_tokens")
    prompt_lengths = call.pop("prompt_lengths")
    with pytest.raises(ValueError, match=field):
        generate(model, prompt_tokens, prompt_lengths, **call)


def test_fused_projection_model_generates_the_same_tokens(tiny_greedy):
    """generate runs the engine's fused layout too (models.llama.fuse_projections): same greedy tokens and
    logprobs as the HF-layout model."""
    from models.llama import fuse_projections

    fused = fuse_projections(_tiny_model())  # a fresh copy of the same weights (same seed)
    assert fused.model.layers[0].self_attn.qkv_proj is not None
    out = generate(fused, TINY_PROMPTS, TINY_LENGTHS, max_new_tokens=NUM_NEW)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(tiny_greedy.tokens))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(tiny_greedy.logprobs), atol=1e-5)


def test_package_exports_the_generate_function():
    """``from paged_jax import generate`` is the function, also once its module has been imported."""
    import importlib

    import paged_jax

    module = importlib.import_module("paged_jax.research.generate")
    from paged_jax import generate as exported

    assert callable(exported) and exported is module.generate and paged_jax.generate is module.generate
