"""Multi-head latent attention over the paged latent cache: the MLA Pallas kernel (``mla_kernel``, interpret mode)
vs the jnp reference vs a dense per-sequence numpy oracle, the ``"auto"`` choice and the refusals, and the GPU
benchmark's CPU smoke run.

Every case draws a fresh random ragged batch: one KV head of ``[latent | rope]`` rows (V pool of width 0), shuffled
block tables, large garbage in the pool slots no sequence owns, padded sequence slots (q_len 0, kv_len 0) and
padding tokens after ``cu_q_lens[S]`` (whose outputs must be exactly zero).
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.ops import ragged_paged_attention
from paged_jax.ops.ragged_paged_attention import choose_latent_impl
from paged_jax.ops.ragged_paged_attention.mla_kernel import default_tuning


def make_latent_batch(seed, q_lens, kv_lens, *, heads, latent, rope, block_size, dtype, pool_dtype=None,
                      garbage=30.0, pad_seqs=1, pad_tokens=3):
    """Random batch; kv_lens include the new tokens. ``garbage``: the value scale of unowned slots (NaN allowed)."""
    rng = np.random.default_rng(seed)
    q_lens = np.asarray(list(q_lens) + [0] * pad_seqs, np.int32)
    kv_lens = np.asarray(list(kv_lens) + [0] * pad_seqs, np.int32)
    blocks_needed = -(-kv_lens // block_size)
    max_blocks = int(blocks_needed.max()) + 1  # one spare column: padded entries must be ignored
    num_blocks = 1 + int(blocks_needed.sum()) + 3
    free = rng.permutation(np.arange(1, num_blocks)).tolist()
    tables = np.zeros((len(q_lens), max_blocks), np.int32)  # padded entries -> null block 0
    for s, n in enumerate(blocks_needed):
        tables[s, :n] = [free.pop() for _ in range(n)]
    width = latent + rope
    pool = garbage * rng.standard_normal((num_blocks, block_size, 1, width))
    for s in range(len(q_lens)):
        for pos in range(kv_lens[s]):
            pool[tables[s, pos // block_size], pos % block_size] = rng.standard_normal((1, width))
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(cu_q_lens[-1]) + pad_tokens, heads, width))
    k_pages = jnp.asarray(pool, pool_dtype or dtype)
    return dict(q=jnp.asarray(q, dtype), k_pages=k_pages, v_pages=k_pages[..., :0], kv_lens=jnp.asarray(kv_lens),
                block_tables=jnp.asarray(tables), cu_q_lens=jnp.asarray(cu_q_lens))


def numpy_oracle(batch, sm_scale, latent):
    """Dense float64 latent attention, one sequence at a time: every head against the sequence's causal rows, the
    values the rows' first ``latent`` columns."""
    q = np.asarray(batch["q"].astype(jnp.float32), np.float64)
    pool = np.asarray(batch["k_pages"].astype(jnp.float32), np.float64)[:, :, 0]
    kv_lens, tables, cu = (np.asarray(batch[n]) for n in ("kv_lens", "block_tables", "cu_q_lens"))
    block_size = pool.shape[1]
    out = np.zeros(q.shape[:2] + (latent,))
    for s in range(len(kv_lens)):
        q_len, ctx = cu[s + 1] - cu[s], kv_lens[s]
        rows = pool[tables[s, np.arange(ctx) // block_size], np.arange(ctx) % block_size]  # [ctx, L + R]
        for i in range(q_len):
            keys = rows[:ctx - q_len + i + 1]
            scores = sm_scale * q[cu[s] + i] @ keys.T  # [H, keys]
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[cu[s] + i] = weights @ keys[:, :latent] / weights.sum(axis=1, keepdims=True)
    return out


@functools.cache
def _jitted(impl, sm_scale, latent, options: tuple):
    """One jitted attention per static configuration: a case's reference runs in two tests on batches of the same
    shapes, and the second reuses the executable instead of tracing and compiling it again (CI time)."""
    return jax.jit(lambda q, kp, vp, kl, bt, cu: ragged_paged_attention(
        q, kp, vp, kl, bt, cu, sm_scale=sm_scale, impl=impl, v_head_dim=latent, interpret=impl == "triton",
        **dict(options)))


def attend(batch, impl, sm_scale, latent, **kwargs):
    options = tuple(sorted(kwargs.items()))
    try:
        fn = _jitted(impl, sm_scale, latent, options)
    except TypeError:  # an array among kwargs (unhashable): a function of its own
        fn = _jitted.__wrapped__(impl, sm_scale, latent, options)
    return fn(*(batch[name] for name in ("q", "k_pages", "v_pages", "kv_lens", "block_tables", "cu_q_lens")))


def assert_close(got, want, tol, n_real):
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got[:n_real], np.asarray(want, np.float64)[:n_real], atol=tol, rtol=tol)
    np.testing.assert_array_equal(got[n_real:], 0.0)  # padding tokens come out as exact zeros


# name: (q_lens, kv_lens, heads, latent, rope, block_size, q dtype, pool dtype, kernel tuning)
CASES = {
    "length_1": ([1], [1], 4, 32, 16, 8, jnp.float32, None, {}),
    "full_and_partial_last_blocks": ([1, 1, 1], [16, 17, 5], 8, 32, 16, 8, jnp.float32, None, {}),
    "decode_many_lengths_splits": ([1] * 6, [3, 8, 24, 31, 1, 40], 16, 32, 16, 8, jnp.float32, None,
                                   dict(block_k=16, num_kv_splits=3)),
    "ragged_prefill_and_decode": ([5, 1, 12, 8], [5, 9, 30, 8], 4, 32, 16, 8, jnp.float32, None,
                                  dict(block_q=4, block_k=16)),
    # Heads not a multiple of the head block, several tokens per tile and kv splits over a prefill chunk.
    "head_blocks_and_splits": ([7, 1], [20, 26], 6, 32, 16, 8, jnp.float32, None,
                               dict(block_h=4, block_q=2, block_k=16, num_kv_splits=2)),
    "deepseek_widths_bf16": ([1, 1, 3], [1, 33, 20], 16, 512, 64, 16, jnp.bfloat16, None, {}),
    "fp8_pool": ([1, 4], [19, 4], 8, 32, 16, 8, jnp.bfloat16, jnp.float8_e4m3fn, dict(block_k=16)),
}
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _case(name, seed_offset=0, **overrides):
    q_lens, kv_lens, heads, latent, rope, bs, dtype, pool_dtype, tuning = CASES[name]
    kwargs = dict(heads=heads, latent=latent, rope=rope, block_size=bs, dtype=dtype, pool_dtype=pool_dtype)
    batch = make_latent_batch(seed_offset + zlib.crc32(name.encode()), q_lens, kv_lens, **{**kwargs, **overrides})
    return batch, (latent + rope) ** -0.5, latent, tuning, TOL[dtype]


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_matches_numpy_oracle(name):
    batch, scale, latent, _, tol = _case(name)
    got = attend(batch, "reference", scale, latent)
    assert got.shape == batch["q"].shape[:2] + (latent,) and got.dtype == batch["q"].dtype
    assert_close(got, numpy_oracle(batch, scale, latent), tol, int(batch["cu_q_lens"][-1]))


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_reference(name):
    batch, scale, latent, tuning, tol = _case(name, seed_offset=1)
    got = attend(batch, "triton", scale, latent, **tuning)
    assert got.shape == batch["q"].shape[:2] + (latent,) and got.dtype == batch["q"].dtype
    assert_close(got, attend(batch, "reference", scale, latent), tol, int(batch["cu_q_lens"][-1]))


def test_kernel_never_reads_past_the_context():
    """NaN in every slot no sequence owns (stale rows of partial last blocks, spare table entries, the null block):
    the kernel's output is the one over a clean pool."""
    batch, scale, latent, tuning, tol = _case("ragged_prefill_and_decode", seed_offset=2, garbage=np.nan)
    clean = dict(batch, k_pages=jnp.nan_to_num(batch["k_pages"], nan=0.0))
    clean["v_pages"] = clean["k_pages"][..., :0]
    got = attend(batch, "triton", scale, latent, **tuning)
    assert_close(got, attend(clean, "reference", scale, latent), tol, int(batch["cu_q_lens"][-1]))


def test_default_tuning_shapes():
    lite_decode = default_tuning(128, 128, 16, 512, 512, 16)
    assert (lite_decode["block_h"], lite_decode["block_q"], lite_decode["rows"]) == (16, 1, 16)
    assert lite_decode["num_head_blocks"] == 1 and lite_decode["num_kv_splits"] == 3 and lite_decode["block_k"] == 32
    single = default_tuning(1, 1, 16, 512, 512, 16)
    assert single["num_tiles"] == 1 and single["num_kv_splits"] == 64  # flash decoding fills the GPU
    v3_decode = default_tuning(8, 8, 128, 512, 64, 64)
    assert v3_decode["block_h"] == 32 and v3_decode["num_head_blocks"] == 4 and v3_decode["rows"] == 32
    prefill = default_tuning(2048, 2, 16, 512, 256, 16)
    assert prefill["rows"] == 64 and prefill["block_q"] == 4 and prefill["num_warps"] == 8


def test_auto_runs_the_kernel_on_a_gpu_for_supported_shapes(monkeypatch):
    masks = dict(sm_scale=0.1, sliding_window=None, logit_soft_cap=None, attention_chunk_size=None)
    lite = ((4, 16, 576), (9, 16, 1, 576), 512)
    assert choose_latent_impl(*lite, masks, False) == "reference"  # the CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert choose_latent_impl(*lite, masks, False) == "triton"
    assert choose_latent_impl((4, 4, 24), (9, 8, 1, 24), 16, masks, False) == "reference"  # rope width 8
    assert choose_latent_impl(*lite, dict(masks, sliding_window=64), False) == "reference"
    assert choose_latent_impl(*lite, masks, True) == "reference"


def test_auto_is_the_reference_on_the_cpu():
    batch, scale, latent, _, _ = _case("length_1")
    np.testing.assert_array_equal(np.asarray(attend(batch, "auto", scale, latent)),
                                  np.asarray(attend(batch, "reference", scale, latent)))


@pytest.mark.parametrize("impl, kwargs, message", [
    ("mosaic", {}, "impl='mosaic' does not read a latent KV cache"),
    ("triton", dict(sliding_window=4), r"does not take \['sliding_window'\]"),
    ("triton", dict(sinks=jnp.zeros((4,), jnp.float32)), r"does not take \['sinks'\]"),
    ("triton", dict(block_m=16), "unknown tuning arguments"),
])
def test_refusals_name_what_the_kernel_lacks(impl, kwargs, message):
    batch, scale, latent, _, _ = _case("length_1")
    with pytest.raises(ValueError, match=message):
        attend(batch, impl, scale, latent, **kwargs)


def test_kernel_refuses_widths_triton_cannot_tile():
    batch = make_latent_batch(0, [1], [3], heads=4, latent=16, rope=8, block_size=8, dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"rope width .* power of two >= 16, got 8"):
        attend(batch, "triton", 0.2, 16)


# Runs with make test-all (slow): test_kernel_matches_reference checks the kernel against the reference, and
# test_decode_floor_reads_the_latent_row_once the floor it reports.
@pytest.mark.slow
def test_benchmark_checks_times_and_floors_each_case(tmp_path):
    """benchmarks/mla_kernel.py on tiny shapes with the kernel interpreted: the kernel agrees with the reference on
    a decode and a ragged prefill case, both are timed with the tuning sweep, the floors count the bytes once."""
    import json

    from benchmarks.mla_kernel import floors_us, main

    out = tmp_path / "mla.json"
    results = main(["--batches", "3", "--contexts", "20", "--prefill", "2x4x9", "--heads", "4", "--latent", "32",
                    "--rope", "16", "--block-size", "8", "--dtype", "float32", "--repeats", "1", "--interpret",
                    "--sweep", "bk64,splits_x2", "--out", str(out)])
    assert [(r["seqs"], r["q_len"], r["context"]) for r in results] == [(3, 1, 20), (2, 4, 9)]
    for r in results:
        assert r["check"]["kernel_max_abs_diff"] <= 1e-5 * max(1.0, r["check"]["reference_max_abs"])
        assert r["triton_us"] > 0 and r["reference_us"] > 0 and set(r["variants"]) == {"bk64", "splits_x2"}
    mem_us, compute_us = floors_us(3, 1, 20, 4, 32, 16, 2)
    assert mem_us == pytest.approx(2 * (3 * 20 * 48 + 3 * 4 * 48 + 3 * 4 * 32) / 4.3e12 * 1e6)
    assert compute_us == pytest.approx(2 * 4 * 3 * 20 * (2 * 32 + 16) / 785e12 * 1e6)
    assert len(json.loads(out.read_text())["results"]) == 2


def _paged_attend(meta, q, k, v, kv_layer, *, sm_scale, sliding_window=None, logit_soft_cap=None, impl):
    """``paged_jax.ops.write_and_attend`` with the kernel interpreted (the engine's attention, on the CPU)."""
    from paged_jax.ops import write_kv

    k_pages, v_pages = write_kv(kv_layer[0], kv_layer[1], k, v, meta["slot_mapping"])
    out = ragged_paged_attention(q, k_pages, v_pages, meta["kv_lens"], meta["block_tables"], meta["cu_q_lens"],
                                 sm_scale=sm_scale, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
                                 impl=impl, interpret=impl == "triton", v_head_dim=v.shape[-1])
    return out, (k_pages, v_pages)


def test_deepseek_model_over_the_paged_latent_cache_on_the_kernel(tmp_path):
    """A DeepSeek-V2-Lite-like tiny model (latent 32, rope 16): a ragged prefill of two prompts, then a decode step
    of both, over the paged latent cache, give the same logits on the kernel as on the reference."""
    import functools

    from models.attention_fn import ReusableAttention
    from models.loader import load_model
    from models.testing import save_random_hf_checkpoint, tiny_config

    path = save_random_hf_checkpoint(tiny_config("deepseek_v2", q_lora_rank=None, kv_lora_rank=32,
                                                 qk_rope_head_dim=16, topk_method="greedy", n_group=1,
                                                 topk_group=1), tmp_path)
    model, config = load_model(path, dtype="float32")
    bs, tables = 8, jnp.array([[3, 1, 0], [2, 4, 5]], jnp.int32)
    ids = np.random.default_rng(0).integers(3, config.vocab_size, size=20).astype(np.int32)
    prefill = dict(ids=ids[:17], positions=np.r_[np.arange(11), np.arange(6)],
                   slots=np.r_[np.arange(24, 32), np.arange(8, 11), np.arange(16, 22)],
                   kv_lens=[11, 6], cu_q_lens=[0, 11, 17])
    decode = dict(ids=ids[17:19], positions=np.array([11, 6]), slots=np.array([11, 22]), kv_lens=[12, 7],
                  cu_q_lens=[0, 1, 2])
    logits = {}
    for impl in ("triton", "reference"):
        pool = [(jnp.zeros((6, bs) + (1, config.kv_pool_head_dims[0]), jnp.float32),
                 jnp.zeros((6, bs, 1, 0), jnp.float32)) for _ in range(config.num_hidden_layers)]
        logits[impl] = []
        for step in (prefill, decode):
            meta = dict(slot_mapping=jnp.asarray(step["slots"], jnp.int32), block_tables=tables,
                        kv_lens=jnp.asarray(step["kv_lens"], jnp.int32),
                        cu_q_lens=jnp.asarray(step["cu_q_lens"], jnp.int32))
            attention = ReusableAttention(functools.partial(_paged_attend, impl=impl), meta)
            hidden, pool = model(jnp.asarray(step["ids"]), jnp.asarray(step["positions"], jnp.int32), pool,
                                 attention)
            logits[impl].append(np.asarray(model.compute_logits(hidden)))
    for got, want in zip(logits["triton"], logits["reference"]):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_tokens, num_seqs, heads, pool_dtype", [
    (1, 1, 16, jnp.bfloat16),  # batch-1 decode: kv splits and the combine kernel
    (128, 128, 16, jnp.bfloat16),  # batch decode
    (2048, 2, 16, jnp.bfloat16),  # ragged prefill: 64-row tiles, 8 warps
    (8, 8, 128, jnp.float8_e4m3fn),  # DeepSeek-V3's heads in four head blocks, an FP8 pool
])
def test_kernel_lowers_to_triton_on_cpu(num_tokens, num_seqs, heads, pool_dtype):
    """DeepSeek's shapes (latent 512, rope 64) lower to Triton IR for the GPU from a CPU-only jaxlib: an unsupported
    primitive or indexing in the kernel fails here, not first on the GPU."""
    from jax import export

    spec = jax.ShapeDtypeStruct
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]

    def attention(q, k_pages, kv_lens, block_tables, cu_q_lens):
        return ragged_paged_attention(q, k_pages, k_pages[..., :0], kv_lens, block_tables, cu_q_lens, sm_scale=0.07,
                                      impl="triton", v_head_dim=512)

    module = export.export(jax.jit(attention), platforms=["cuda"], disabled_checks=checks)(
        spec((num_tokens, heads, 576), jnp.bfloat16), spec((4096, 16, 1, 576), pool_dtype),
        spec((num_seqs,), jnp.int32), spec((num_seqs, 512), jnp.int32), spec((num_seqs + 1,), jnp.int32)).mlir_module()
    assert "mla_paged_attention" in module


def test_decode_floor_reads_the_latent_row_once():
    """The decode floor charges a latent cache's one ``[latent | rope key]`` row per token and layer (576 elements in
    DeepSeek-V2-Lite), not a K and a V."""
    from benchmarks.floors import kv_read_bytes
    from models.presets import preset_config

    lite = preset_config("deepseek-v2-lite")
    assert kv_read_bytes(lite, 1000, 1) == 27 * (512 + 64) * 2 * 1000
