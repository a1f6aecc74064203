"""Batch-invariant mode (paged_jax.worker.batch_invariant): a request's tokens and logprobs are the same bits alone and
among others of other lengths, in other buckets, with its prompt chunked, after a prefix-cache hit and after a
preemption; its kernels (paged_jax.ops.batch_invariant, the attention's batch-invariant tiling) row by row."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.testing import save_random_hf_checkpoint, tiny_config
from paged_jax.config import EngineArgs
from paged_jax.entrypoints.llm import LLM
from paged_jax.ops.batch_invariant import (IMPL_ENV, SPLIT_K_ENV, batch_invariant_matmul, block_n_for, matmul_pallas,
                                           resolve_impl, resolve_split_k, split_k_for, split_steps)
from paged_jax.sampling_params import SamplingParams

# float32: on the CPU its matmuls change a row's last bits with the row count (the control test below).
ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, weight_cache=False,
              enable_prefix_caching=True)
TARGET = {"prompt_token_ids": [(7 * i + 3) % 250 + 3 for i in range(45)]}  # 45 tokens: chunked at 32 per step
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(temperature=0.9, seed=11, max_tokens=10, ignore_eos=True, logprobs=3)


def _others(count: int) -> tuple[list, list]:
    """``count`` prompts of other lengths (3..40 tokens) and sampling settings."""
    prompts = [{"prompt_token_ids": [(13 * i + 5 * j) % 240 + 4 for j in range(3 + (11 * i) % 38)]}
               for i in range(count)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.7, seed=i, max_tokens=4 + i % 9, ignore_eos=True)
              for i in range(count)]
    return prompts, params


def _bits(output) -> tuple:
    """(token ids, each token's logprob and top logprobs) of the one sequence, as exact floats."""
    seq = output.outputs[0]
    return tuple(seq.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in step.items()))
                                       for step in seq.logprobs)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = tiny_config("llama", hidden_size=128, intermediate_size=384, num_attention_heads=8,
                         num_key_value_heads=2)
    return save_random_hf_checkpoint(config, tmp_path_factory.mktemp("ckpt") / "a")


@pytest.fixture(scope="module")
def invariant_llm(checkpoint):
    return LLM(model=str(checkpoint), batch_invariant=True, num_gpu_blocks_override=64, use_tqdm=False, **ENGINE)


@pytest.fixture(scope="module")
def crowded_llm(checkpoint):
    """8 blocks of 16 tokens: a batch of the target and five others preempts a sequence."""
    return LLM(model=str(checkpoint), batch_invariant=True, num_gpu_blocks_override=9, use_tqdm=False, **ENGINE)


def _run(llm: LLM, target_params: SamplingParams, num_others: int, position: int = 0) -> tuple:
    prompts, params = _others(num_others)
    prompts.insert(position, TARGET)
    params.insert(position, target_params)
    return _bits(llm.generate(prompts, params, use_tqdm=False)[position])


@pytest.mark.parametrize("target_params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_request_is_the_same_bits_alone_in_a_batch_after_a_prefix_hit_and_a_preemption(invariant_llm, crowded_llm,
                                                                                       target_params):
    llm = invariant_llm
    llm.reset_prefix_cache()
    alone = _run(llm, target_params, 0)  # prompt in 2 chunks, then the (1, 1) decode bucket
    assert _run(llm, target_params, 0) == alone  # the prompt's full blocks from the prefix cache
    llm.reset_prefix_cache()
    assert _run(llm, target_params, 7, position=3) == alone  # chunks beside other prompts, wider buckets
    assert llm.llm_engine.engine_core.runner.num_compiles_since_warmup == 0

    scheduler = crowded_llm.llm_engine.engine_core.scheduler
    preemptions = scheduler.num_preemptions
    crowded_llm.reset_prefix_cache()
    assert _run(crowded_llm, target_params, 5, position=5) == alone
    assert scheduler.num_preemptions > preemptions


def test_without_the_mode_the_logprobs_change_with_the_batch(checkpoint):
    """The control: the same engine without batch_invariant gives the request other logprob bits in a batch."""
    llm = LLM(model=str(checkpoint), num_gpu_blocks_override=64, use_tqdm=False, **ENGINE)
    alone = _run(llm, GREEDY, 0)
    llm.reset_prefix_cache()
    assert _run(llm, GREEDY, 7, position=3)[1] != alone[1]


def test_the_mode_is_refused_where_it_does_not_hold_and_read_from_vllm_env(monkeypatch):
    for kwargs, field in ((dict(quantization="fp8"), "quantization"), (dict(enable_lora=True), "enable_lora"),
                          (dict(tensor_parallel_size=2), "tensor_parallel_size")):
        with pytest.raises(ValueError, match=f"^{field} is not supported with batch_invariant"):
            EngineArgs(batch_invariant=True, **kwargs)
    assert not EngineArgs().batch_invariant
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert EngineArgs().batch_invariant


@pytest.mark.parametrize("impl", ["chunks", "pallas"])
def test_the_matmul_gives_each_row_the_same_bits_whatever_the_other_rows(impl):
    """XLA's own dot on the CPU changes a row's bits with the row count (a matrix-vector path for one row); the
    fixed-tile matmul (the Pallas kernel in interpret mode) does not, and agrees with float32 to bfloat16 rounding."""
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (130, 200), jnp.float32).astype(jnp.bfloat16)
    w = (0.05 * jax.random.normal(keys[1], (200, 72), jnp.float32)).astype(jnp.bfloat16)
    xla_rows = [np.asarray(jnp.dot(x[:m], w, preferred_element_type=jnp.float32)[0]) for m in (1, 2, 130)]
    assert any((r != xla_rows[0]).any() for r in xla_rows[1:])  # the problem the mode solves
    full = np.asarray(batch_invariant_matmul(x, w, impl=impl, interpret=True, out_dtype=jnp.float32))
    exact = np.asarray(jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest"))
    np.testing.assert_allclose(full, exact, rtol=0, atol=1e-4)
    other = x.at[1:].multiply(-3.0)
    for rows in (x[:1], x[:5], x[:64], x[:65], other):
        got = np.asarray(batch_invariant_matmul(rows, w, impl=impl, interpret=True, out_dtype=jnp.float32))
        assert (got[0] == full[0]).all()


def _split_k_contract(x, w, block_k: int, split_k: int) -> np.ndarray:
    """``matmul_pallas``'s reduction order by hand, float32: per split, its ``[64, block_k] @ [block_k, N]`` step
    dots added from the split's first step; then split 0 + split 1 + ... left to right. Zero-padded to the kernel's
    tiles: the CPU's dot rounds by shape."""
    (m, k), n = x.shape, block_n_for(w.shape[1])
    splits, per = split_steps(k, block_k, split_k)
    steps = -(-k // block_k)
    xp = jnp.zeros((64, steps * block_k), jnp.float32).at[:m, :k].set(x)
    wp = jnp.zeros((steps * block_k, n), jnp.float32).at[:k, :w.shape[1]].set(w)
    total = None
    for s in range(splits):
        acc = jnp.zeros((64, n), jnp.float32)
        for t in range(s * per, min((s + 1) * per, steps)):
            acc = acc + jnp.dot(xp[:, t * block_k:(t + 1) * block_k], wp[t * block_k:(t + 1) * block_k],
                                precision="highest", preferred_element_type=jnp.float32)
        total = acc if total is None else total + acc
    return np.asarray(total)[:m, :w.shape[1]]


def test_the_split_k_matmul_keeps_a_rows_bits_in_its_fixed_order():
    """With K split (K = 300 in 10 steps of 32: splits of 4 + 4 + 2 or 3 + 3 + 3 + 1 steps) a row's result is
    its splits' float32 partials added left to right, the same bits alone, among other rows and at another row
    offset, and close to float32's product; one split is the unsplit kernel's order."""
    keys = jax.random.split(jax.random.key(3), 2)
    x = jax.random.normal(keys[0], (70, 300), jnp.float32)
    w = 0.05 * jax.random.normal(keys[1], (300, 40), jnp.float32)
    exact = np.asarray(jnp.dot(x, w, precision="highest"))
    outs = {}
    for split_k in (1, 3, 4):
        full = np.asarray(matmul_pallas(x, w, interpret=True, block_k=32, split_k=split_k))
        assert (full[:3] == _split_k_contract(x[:3], w, 32, split_k)).all(), split_k
        np.testing.assert_allclose(full, exact, rtol=0, atol=1e-4)
        moved = x.at[:66].multiply(-2.0).at[65].set(x[0])  # row 0 as row 65: the second row tile, other rows
        for rows, at in ((x[:1], 0), (x[:64], 0), (moved, 65)):
            got = np.asarray(matmul_pallas(rows, w, interpret=True, block_k=32, split_k=split_k))
            assert (got[at] == full[0]).all(), (split_k, rows.shape, at)
        outs[split_k] = full
    assert all((outs[s] != outs[1]).any() for s in (3, 4))  # the splits do change the order
    bf16 = np.asarray(matmul_pallas(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), interpret=True, block_k=32,
                                    split_k=3).astype(jnp.float32))
    one = np.asarray(matmul_pallas(x[5:6].astype(jnp.bfloat16), w.astype(jnp.bfloat16), interpret=True,
                                   block_k=32, split_k=3).astype(jnp.float32))
    assert (one[0] == bf16[5]).all()
    np.testing.assert_allclose(bf16, exact, rtol=0, atol=2e-2)


def test_the_split_k_matmul_lowers_to_triton_for_the_gpu():
    """The kernel, unsplit and with K in uneven splits, lowers to Triton IR from a CPU-only jaxlib: an unsupported
    primitive (the split's loop bounds) fails here, not first on the GPU."""
    from jax import export

    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    spec = jax.ShapeDtypeStruct
    for split_k in (1, 3):
        fn = jax.jit(lambda x, w, split_k=split_k: matmul_pallas(x, w, split_k=split_k))
        module = export.export(fn, platforms=["cuda"], disabled_checks=checks)(
            spec((3, 1000), jnp.bfloat16), spec((1000, 256), jnp.bfloat16)).mlir_module()
        assert module.count("xla.gpu.triton") == 1


def test_the_split_k_rule_is_a_function_of_the_weights_shape(monkeypatch):
    """``split_k_for``: Llama-3.1-8B's narrow projections (32 or 48 column tiles) split K in 4, the wide ones not;
    off by default, picked by ``SPLIT_K_ENV``; a split is never empty and other values are refused."""
    assert [split_k_for(k, n) for k, n in ((4096, 6144), (4096, 4096), (14336, 4096), (4096, 28672),
                                           (4096, 128256), (512, 256))] == [4, 4, 4, 1, 1, 1]
    assert split_steps(300, 32, 4) == (4, 3) and split_steps(64, 128, 4) == (1, 1) and split_steps(96, 32, 4) == (3, 1)
    monkeypatch.delenv(SPLIT_K_ENV, raising=False)
    assert resolve_split_k(None, 4096, 4096) == 1
    monkeypatch.setenv(SPLIT_K_ENV, "auto")
    assert resolve_split_k(None, 4096, 4096) == 4 and resolve_split_k(2, 4096, 4096) == 2
    monkeypatch.setenv(SPLIT_K_ENV, "3")
    assert resolve_split_k(None, 4096, 4096) == 3
    monkeypatch.setenv(SPLIT_K_ENV, "many")
    with pytest.raises(ValueError, match=SPLIT_K_ENV):
        resolve_split_k(None, 4096, 4096)
    for bad in (0, "x2", 1.5):
        with pytest.raises(ValueError, match="split_k"):
            resolve_split_k(bad, 4096, 4096)


def test_the_benchmark_flags_reach_the_engine_and_the_kernel_benchmark_runs(monkeypatch):
    """``--batch-invariant`` of ``bench latency`` (an engine flag) and of ``benchmarks.throughput`` reach the
    engine's arguments; the per-matmul benchmark runs on its CPU smoke shapes, where both of the mode's matmuls
    keep a row's bits at any row count and position."""
    import paged_jax
    from benchmarks import batch_invariant as kernel_bench, latency, throughput
    from paged_jax.entrypoints.cli import engine_kwargs

    assert engine_kwargs(latency.build_parser().parse_args(["--batch-invariant"]))["batch_invariant"] is True
    engine_kwargs_seen = {}

    def stop_at_the_engine(**kwargs):
        engine_kwargs_seen.update(kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(paged_jax, "LLM", stop_at_the_engine)
    with pytest.raises(KeyboardInterrupt):
        throughput.main(["--shape", "smollm2-135m", "--batch-invariant", "--num-prompts", "1"])
    assert engine_kwargs_seen["batch_invariant"] is True
    lines = kernel_bench.main(["--tiny", "--sections", "matmul", "--rows", "1,70", "--repeats", "1",
                               "--impls", "chunks,pallas,pallas:16x32,pallas:16x32x2"])
    assert len(lines) == 4  # 16x32: N and K in several masked tiles; x2: K (64) in two splits
    impls = ("chunks", "pallas", "pallas:16x32", "pallas:16x32x2")
    assert all(line[f"{impl}_{check}"] for line in lines for impl in impls for check in ("row0_same", "moved_same"))
    assert all(line[f"{impl}_err"] <= 2 * line["xla_err"] + 1e-6 for line in lines for impl in impls[2:])
    assert [line["pallas:16x32x2_split_k"] for line in lines] == [2, 2, 2, 2]
    for bad in ("pallas:16x32x0", "pallas:16x32xmany", "pallas:16"):
        with pytest.raises(ValueError, match="split_k|pallas:BNxBK"):
            kernel_bench.main(["--tiny", "--sections", "matmul", "--impls", bad])


@pytest.mark.slow
def test_the_benchmark_checks_the_engine_generate_and_score_tokens_bits():
    """``benchmarks.batch_invariant``'s invariance section on a tiny random checkpoint: every check holds."""
    from benchmarks import batch_invariant as bench

    lines = bench.main(["--tiny", "--sections", "invariance", "--dtype", "float32", "--crowds", "5"])
    assert [line["check"] for line in lines] == ["engine", "engine", "generate", "score_tokens", "score_tokens"]
    assert all(line.get("same_bits", True) and line.get("same_tokens", True) and line.get("same_logprobs", True)
               for line in lines), lines


@pytest.mark.slow
def test_the_benchmark_times_both_modes():
    from benchmarks import batch_invariant as bench

    (line,) = bench.main(["--tiny", "--sections", "engine"])
    assert line["cost_ratio"] > 0


@pytest.mark.parametrize("impl,interpret", [("reference", False), ("triton", True)])
def test_attention_gives_a_token_the_same_bits_decoded_batched_prefilled_or_chunked(impl, interpret):
    """``ragged_paged_attention(batch_invariant=True)``: the last token of a 40-token sequence (3 KV blocks of the
    kernel), decoded alone, decoded beside another sequence's prefill, in the whole prompt's prefill, in a chunk's
    and through a wider block table (``generate``'s pool is not the engine's), the default attention's value to
    bfloat16 rounding."""
    from paged_jax.ops.ragged_paged_attention import ragged_paged_attention

    rng = np.random.default_rng(0)
    num_blocks, block_size, kv_heads, head_dim, q_heads, max_blocks, length = 24, 16, 2, 16, 8, 4, 40
    k_pages, v_pages = (jnp.asarray(rng.standard_normal((num_blocks, block_size, kv_heads, head_dim)), jnp.bfloat16)
                        for _ in range(2))
    queries = jnp.asarray(rng.standard_normal((length, q_heads, head_dim)), jnp.bfloat16)
    table = np.array([5, 9, 2, 0], np.int32)
    empty = np.zeros(max_blocks, np.int32)

    def attend(q, kv_lens, tables, cu_q_lens):
        return np.asarray(ragged_paged_attention(
            q, k_pages, v_pages, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(np.stack(tables), jnp.int32),
            jnp.asarray(cu_q_lens, jnp.int32), sm_scale=0.25, impl=impl, interpret=interpret,
            batch_invariant=True).astype(jnp.float32))

    alone = attend(queries[-1:], [length], [table], [0, 1])[0]
    beside = jnp.asarray(rng.standard_normal((32, q_heads, head_dim)), jnp.bfloat16).at[12].set(queries[-1])
    batched = attend(beside, [12, length, 0], [np.array([7, 0, 0, 0], np.int32), table, empty], [0, 12, 13, 13])[12]
    prefill = attend(jnp.zeros((64, q_heads, head_dim), jnp.bfloat16).at[:length].set(queries), [length, 0],
                     [table, empty], [0, length, length])[length - 1]
    chunk = attend(queries[-9:], [length], [table], [0, 9])[8]
    wider_table = attend(queries[-1:], [length], [np.concatenate([table, empty])], [0, 1])[0]
    for other in (batched, prefill, chunk, wider_table):
        assert (other == alone).all()
    exact = ragged_paged_attention(queries[-1:], k_pages, v_pages, jnp.asarray([length], jnp.int32),
                                   jnp.asarray(table[None]), jnp.asarray([0, 1], jnp.int32), sm_scale=0.25,
                                   impl="reference")
    np.testing.assert_allclose(alone, np.asarray(exact.astype(jnp.float32))[0], atol=2e-2)
    with pytest.raises(ValueError, match="not batch invariant"):
        ragged_paged_attention(queries, k_pages, v_pages, jnp.asarray([length], jnp.int32),
                               jnp.asarray(table[None]), jnp.asarray([0, length], jnp.int32), sm_scale=0.25,
                               impl="mosaic", batch_invariant=True)


def test_generate_and_score_tokens_give_the_engines_tokens_and_logprobs(checkpoint, invariant_llm):
    """With ``batch_invariant=True`` the jittable ``generate`` (the target among other prompts) gives the engine's
    greedy tokens and logprobs bit for bit, and ``score_tokens`` (the target's completions among other rows) the
    engine's logprobs of its greedy and seeded samples and of the prompt bit for bit, so a trainer's
    scores equal the sampler's; its gradient is the default computation's."""
    from paged_jax.research.generate import generate
    from paged_jax.research.scoring import load_pretrained, score_tokens

    graphdef, state, _, _ = load_pretrained(str(checkpoint), dtype="float32")
    prompt = TARGET["prompt_token_ids"]
    engine = {}
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=0)
    for name, params in (("greedy", greedy), ("seeded", SEEDED)):
        invariant_llm.reset_prefix_cache()
        request = invariant_llm.generate([TARGET], params, use_tqdm=False)[0]
        seq = request.outputs[0]
        engine[name] = (np.asarray(seq.token_ids, np.int32),
                        np.asarray([lp[t].logprob for lp, t in zip(seq.logprobs, seq.token_ids)], np.float32))
        if name == "greedy":  # the prompt's logprobs, computed in the prompt's two prefill chunks
            engine["prompt"] = np.asarray([lp[t].logprob for lp, t in zip(request.prompt_logprobs[1:], prompt[1:])],
                                          np.float32)

    others, _ = _others(3)
    rows = [o["prompt_token_ids"] for o in others[:1]] + [prompt] + [o["prompt_token_ids"] for o in others[1:]]
    width = max(map(len, rows))
    tokens = np.array([r + [0] * (width - len(r)) for r in rows], np.int32)
    out = generate((graphdef, state), tokens, np.array([len(r) for r in rows], np.int32), max_new_tokens=10,
                   batch_invariant=True)
    np.testing.assert_array_equal(np.asarray(out.tokens[1]), engine["greedy"][0])
    assert (np.asarray(out.logprobs[1]) == engine["greedy"][1]).all()

    sequences = [prompt + engine["greedy"][0].tolist(), others[2]["prompt_token_ids"],
                 prompt + engine["seeded"][0].tolist()]
    width = max(map(len, sequences)) + 3
    ids = np.array([s + [1] * (width - len(s)) for s in sequences], np.int32)
    lengths = np.array([len(s) for s in sequences], np.int32)
    scores = np.asarray(score_tokens((graphdef, state), ids, lengths, batch_invariant=True))
    for row, name in ((0, "greedy"), (2, "seeded")):
        assert (scores[row, len(prompt):lengths[row]] == engine[name][1]).all(), name
    assert (scores[0, 1:len(prompt)] == engine["prompt"]).all()
    default = np.asarray(score_tokens((graphdef, state), ids, lengths))
    np.testing.assert_allclose(scores, default, atol=1e-4)

    def loss(s, batch_invariant):
        return score_tokens((graphdef, s), ids, lengths, batch_invariant=batch_invariant).sum()

    grads = [jax.tree.leaves(jax.grad(loss)(state, mode)) for mode in (True, False)]
    assert all((a == b).all() for a, b in zip(*grads))


def test_the_environment_picks_what_auto_runs(monkeypatch):
    monkeypatch.delenv(IMPL_ENV, raising=False)
    assert resolve_impl("auto") == "chunks"  # the CPU's default
    monkeypatch.setenv(IMPL_ENV, "pallas")
    assert resolve_impl("auto") == "pallas"
    assert resolve_impl("chunks") == "chunks"  # an explicit choice stays
    monkeypatch.setenv(IMPL_ENV, "cublas")
    with pytest.raises(ValueError, match=IMPL_ENV):
        resolve_impl("auto")
