"""The ``mtp`` speculative method (DeepSeek-V3's multi-token prediction layer, ``models.mtp``): start-up refusals, and
on the engine (a tiny random DeepSeek-V3 with one MTP layer in the published layout, fp32 on the CPU): outputs in a
continuous batch identical to decoding without drafts, each step's drafts equal to the MTP layer's dense reference
math (transformers' DeepSeek-V3 decoder layer inside the published MTP formula, as vLLM's ``deepseek_mtp.py`` runs
it), vLLM's counters consistent, nothing compiled after warm-up."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from models.config import ModelConfig
from models.loader import load_model
from models.mtp import check_mtp_target, load_mtp_head
from models.testing import save_random_hf_checkpoint, save_random_mtp_checkpoint, tiny_config
from paged_jax.config import EngineArgs
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.sampling_params import SamplingParams
from paged_jax.spec_decode import parse_speculative_config
from tests.test_engine import assert_clean, run_to_completion
from tests.test_spec_decode import assert_same_outputs
from tests.test_spec_decode_models import assert_counters_consistent, assert_drafts_follow

K = 3  # more drafts than MTP layers: the layer drafts again on its own output
SETTINGS = dict(dtype="float32", max_model_len=96, block_size=8, max_num_seqs=4, max_num_batched_tokens=32,
                num_gpu_blocks_override=60, seed=0)
# The MTP layer's head has four large random rows among small ones: its drafts are mostly one of these four tokens
# (whichever the layer's output favours), so a target restricted to them (allowed_token_ids) accepts some drafts.
FAVOURED = [7, 11, 42, 131]
PARAMS = [
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, allowed_token_ids=FAVOURED, logprobs=2),
    SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, allowed_token_ids=FAVOURED),
    SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True, allowed_token_ids=FAVOURED),
]


# ---------------------------------------------------------------------------------------------------- config
def test_mtp_config_and_vllm_alias():
    assert parse_speculative_config('{"method": "deepseek_mtp", "num_speculative_tokens": 2}').method == "mtp"
    assert parse_speculative_config({"method": "mtp", "num_speculative_tokens": 1}).model is None
    with pytest.raises(ValueError, match="speculative_config.model applies to .* not 'mtp'"):
        parse_speculative_config({"method": "mtp", "num_speculative_tokens": 2, "model": "x"})


@pytest.mark.parametrize("field, value", [("enable_lora", True), ("preemption_mode", "swap")])
def test_mtp_combinations_refused(field, value):
    with pytest.raises(ValueError, match=f"{field} is not supported with speculative_config"):
        EngineArgs(speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **{field: value})


def test_mtp_needs_one_mtp_layer(tmp_path):
    """No MTP layers (a DeepSeek-V3 config with 0, or any other model): refused at load naming the method and
    num_nextn_predict_layers, as is a config of two (vLLM's cycling is not built); a config that claims a layer its
    checkpoint lacks is refused naming the tensors."""
    plain = save_random_hf_checkpoint(tiny_config("deepseek_v3", num_hidden_layers=1), tmp_path / "plain")
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"speculative_config.method='mtp' .* num_nextn_predict_layers=0"):
        LLMEngine(EngineArgs(model=str(plain), speculative_config=spec, **SETTINGS), use_tqdm=False)
    two = ModelConfig.from_hf_config(tiny_config("deepseek_v3", num_nextn_predict_layers=2))
    with pytest.raises(ValueError, match=r"method='mtp' runs one .* num_nextn_predict_layers=2"):
        check_mtp_target(two)
    model, config = load_model(str(plain), dtype="float32")
    with pytest.raises(ValueError, match=r"no model.layers.1.\* tensors"):
        load_mtp_head(plain, dataclasses.replace(config, num_nextn_predict_layers=1),
                      target_embedding=model.model.embed_tokens.embedding[...], target_lm_head=None)


# ---------------------------------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from safetensors.numpy import load_file, save_file

    hf_config = tiny_config("deepseek_v3")
    path = save_random_mtp_checkpoint(hf_config, tmp_path_factory.mktemp("mtp") / "ckpt")
    tensors = load_file(str(path / "model.safetensors"))
    name = f"model.layers.{hf_config['num_hidden_layers']}.shared_head.head.weight"
    rng = np.random.default_rng(1)
    head = (0.02 * rng.standard_normal(tensors[name].shape)).astype(np.float32)
    head[FAVOURED] = 0.1 * rng.standard_normal((len(FAVOURED), head.shape[1]))
    tensors[name] = head
    # Attention weights large enough that each position's output depends on which earlier positions it attends to
    # (at the checkpoint's std 0.02 the layer's output is mostly its own input): drafts then check the drafter's KV.
    for key in tensors:
        if key.startswith(f"model.layers.{hf_config['num_hidden_layers']}.self_attn.") and "layernorm" not in key:
            tensors[key] = tensors[key] * 8
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 256, n).tolist() for n in (20, 33, 9, 14)]


@pytest.fixture(scope="module")
def mtp_engine(checkpoint):
    spec = {"method": "mtp", "num_speculative_tokens": K}
    return LLMEngine(EngineArgs(model=str(checkpoint), speculative_config=spec, **SETTINGS), use_tqdm=False)


def test_mtp_outputs_equal_decoding_without_drafts(checkpoint, mtp_engine, prompts):
    """Four requests in one continuous batch (greedy, greedy among two tokens with logprobs, seeded sampling): the
    same outputs as the target alone; the restricted rows accept some drafts."""
    plain = LLMEngine(EngineArgs(model=str(checkpoint), **SETTINGS), use_tqdm=False)
    expected = run_to_completion(plain, prompts, PARAMS)
    assert_same_outputs(run_to_completion(mtp_engine, prompts, PARAMS), expected)
    stats = mtp_engine.stats()
    assert_counters_consistent(stats, K)
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    drafter = mtp_engine.engine_core.runner.drafter
    assert drafter.kv_bytes_per_block(8) == 8 * (16 + 8) * 4  # one latent layer: [latent | rope key] rows, fp32
    assert_clean(mtp_engine)


def _mtp_math(path):
    """``(mtp(hidden [n, H], following [n] token ids) -> out [n, H], logits(out) -> [n, V], target)``: the MTP formula
    (``models.mtp``'s docstring; vLLM's ``deepseek_mtp.py``) written with torch around transformers' DeepSeek-V3
    decoder layer L (loaded as layer L of an (L + 1)-layer model: the MTP layer's decoder tensors are stored as such),
    dense causal attention over positions 0 .. n - 1; ``target`` is transformers' target model."""
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    hf_config = json.loads((path / "config.json").read_text())
    layer_idx, eps = hf_config["num_hidden_layers"], hf_config["rms_norm_eps"]
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    stack = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                 num_hidden_layers=layer_idx + 1).eval()
    tensors = load_file(str(path / "model.safetensors"))
    w = {name: torch.from_numpy(tensors[f"model.layers.{layer_idx}.{name}.weight"])
         for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head")}
    embed, layer, rotary = target.model.embed_tokens.weight, stack.model.layers[layer_idx], stack.model.rotary_emb

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    @torch.no_grad()
    def mtp(hidden, following):
        n = hidden.shape[0]
        e = embed[following].clone()
        e[0] = 0  # vLLM masks position 0's embedding
        x = (torch.cat([rms(e, w["enorm"]), rms(hidden, w["hnorm"])], dim=-1) @ w["eh_proj"].T)[None]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        return layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rotary(x, positions))[0]

    def logits(out):
        return rms(out, w["shared_head.norm"]) @ w["shared_head.head"].T

    return mtp, logits, target


def _mtp_reference(path):
    """``token_ids -> K drafts``: ``_mtp_math`` on transformers' target hidden states (positions 0 .. n - 2, each
    with the token after it), then on each draft and the layer's own output, greedily."""
    mtp, logits, target = _mtp_math(path)

    @torch.no_grad()
    def drafts(token_ids: list[int]) -> list[int]:
        hidden = target.model(torch.tensor([token_ids])).last_hidden_state[0, :-1]
        following = list(token_ids[1:])
        out_tokens = []
        for _ in range(K):
            out = mtp(hidden, following)
            token = int(logits(out[-1]).argmax())
            out_tokens.append(token)
            hidden, following = torch.cat([hidden, out[-1:]]), following + [token]
        return out_tokens

    return drafts


def test_mtp_head_is_the_published_math(checkpoint):
    """The loaded MTP layer (checkpoint names, the stacked experts, the target's embedding) on random hidden states
    and tokens at positions 0 .. 6 against the torch formula: its output and its logits."""
    import jax.numpy as jnp

    from models.attention import dense_causal_attention

    model, config = load_model(str(checkpoint), dtype="float32")
    head = load_mtp_head(checkpoint, config, target_embedding=model.model.embed_tokens.embedding[...],
                         target_lm_head=model.lm_head.kernel[...], dtype=jnp.float32)
    mtp, logits, _ = _mtp_math(checkpoint)
    rng = np.random.default_rng(0)
    hidden, tokens = rng.standard_normal((7, config.hidden_size)).astype(np.float32), rng.integers(0, 256, 7)
    attention = dense_causal_attention(jnp.zeros(7, jnp.int32), config.softmax_scale)
    out, state, kv = head(jnp.asarray(tokens, jnp.int32), jnp.arange(7), jnp.asarray(hidden), [None], attention)
    expected = mtp(torch.from_numpy(hidden), torch.from_numpy(tokens))
    np.testing.assert_allclose(np.asarray(out), expected.numpy(), atol=2e-4, rtol=1e-3)
    np.testing.assert_allclose(np.asarray(head.compute_logits(out)), logits(expected).numpy(), atol=2e-4, rtol=1e-3)
    assert state is out and len(kv) == 1


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_proposals_are_the_mtp_layers_greedy_continuation(tp, checkpoint, mtp_engine, prompts):
    """After every step, each running sequence's drafts are the MTP reference's from its tokens, through steps that
    accepted all, some and none of their drafts (the drafter's latent KV is always the sequence's own); at tp = 2
    the MTP layer runs on the target's mesh (its q heads and experts split, its latent cache whole on each device)."""
    engine = mtp_engine if tp == 1 else LLMEngine(EngineArgs(
        model=str(checkpoint), speculative_config={"method": "mtp", "num_speculative_tokens": K},
        tensor_parallel_size=tp, **SETTINGS), use_tqdm=False)
    requests = {f"p{i}": ({"prompt_token_ids": prompt}, params) for i, (prompt, params) in
                enumerate(zip(prompts[:3], PARAMS[1:]))}
    stats = assert_drafts_follow(engine, requests, _mtp_reference(checkpoint), K)
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    if tp > 1:
        drafter = engine.engine_core.runner.drafter
        assert drafter.plan.mesh == engine.engine_core.runner.sharding_plan.mesh
        assert drafter.pool[0][0].sharding.is_equivalent_to(drafter.plan.kv_cache_sharding, 4)
    assert_clean(engine)


def test_block_fp8_mtp_layer_keeps_fp8_experts_and_equals_the_dequantized_one(tmp_path):
    """A block-FP8 DeepSeek-V3 checkpoint's MTP layer (as published): its experts load as the target's, float8
    beside their scales, and the layer computes what the dequantized checkpoint's does."""
    import jax.numpy as jnp

    from models.attention import dense_causal_attention
    from models.quantization.testing import save_block_fp8_checkpoint

    save_random_mtp_checkpoint(tiny_config("deepseek_v3", num_hidden_layers=2), tmp_path / "float", seed=1)
    save_block_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", tmp_path / "dequantized", block=(16, 16))
    rng = np.random.default_rng(0)
    outs = {}
    for name in ("fp8", "dequantized"):
        model, config = load_model(str(tmp_path / name), dtype="float32")
        head = load_mtp_head(tmp_path / name, config, target_embedding=model.model.embed_tokens.embedding[...],
                             target_lm_head=model.lm_head.kernel[...], dtype=jnp.float32)
        expert_dtype = head.mtp_block.mlp.experts.gate_proj[...].dtype
        assert expert_dtype == (jnp.float8_e4m3fn if name == "fp8" else jnp.float32)
        if not outs:
            hidden = rng.standard_normal((7, config.hidden_size)).astype(np.float32)
            tokens = jnp.asarray(rng.integers(0, 256, 7), jnp.int32)
        attention = dense_causal_attention(jnp.zeros(7, jnp.int32), config.softmax_scale)
        outs[name] = np.asarray(head(tokens, jnp.arange(7), jnp.asarray(hidden), [None], attention)[0])
    np.testing.assert_allclose(outs["fp8"], outs["dequantized"], atol=1e-5, rtol=0)
