"""Model drafters (``draft_model``, ``eagle``, ``eagle3``): start-up refusals, the look-ahead slots, the target's
EAGLE-3 feature states against transformers, the published head layouts, and on the engine: outputs identical to
decoding without drafts (greedy with logprobs, stop strings with n = 2, seeded sampling with penalties; constrained
sequences, their drafts cut to the grammar), each step's drafts equal to the drafter's dense reference math, vLLM's
counters consistent, nothing compiled after warm-up."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from models.attention import dense_causal_attention
from models.config import ModelConfig
from models.eagle import load_eagle_head
from models.eagle3 import default_aux_hidden_layers, load_eagle3_head
from models.loader import load_model
from models.testing import (save_random_eagle3_head, save_random_eagle_head, save_random_hf_checkpoint,
                            save_truncated_checkpoint, tiny_config)
from paged_jax.config import EngineArgs
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import Request
from paged_jax.core.scheduler import Scheduler
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.sampling_params import SamplingParams, StructuredOutputsParams
from paged_jax.spec_decode import parse_speculative_config
from paged_jax.spec_decode.verify import per_position
from tests.test_engine import assert_clean, make_engine, run_to_completion
from tests.test_spec_decode import TEXT, Params, StepRecorder, assert_same_outputs, spec_counters

K = 3
SETTINGS = dict(max_model_len=192, max_num_seqs=4, max_num_batched_tokens=32, num_gpu_blocks_override=120, seed=0)
PARAMS = [
    SamplingParams(max_tokens=14, temperature=0, logprobs=2),
    SamplingParams(max_tokens=14, temperature=0, stop=["seven", "mat."], n=2),
    SamplingParams(max_tokens=8, temperature=0.9, seed=3, repetition_penalty=1.2),
]


# ---------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("value, message", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model .* is required"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "model": ""}, "speculative_config.model .* is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "speculative_config.model applies to"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.model .* is required"),
    ({"method": "mtp", "num_speculative_tokens": 2, "model": "x"}, "speculative_config.model applies to"),
])
def test_bad_model_drafter_config_is_refused(value, message):
    with pytest.raises(ValueError, match=message):
        parse_speculative_config(value)


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
@pytest.mark.parametrize("field, value", [("preemption_mode", "swap"), ("enable_sleep_mode", True)])
def test_model_drafter_combinations_refused(method, field, value):
    with pytest.raises(ValueError, match=f"{field} is not supported with speculative_config method '{method}'"):
        EngineArgs(speculative_config={"method": method, "model": "x", "num_speculative_tokens": 2},
                   **{field: value})
    EngineArgs(speculative_config={"method": method, "model": "x", "num_speculative_tokens": 2},
               tensor_parallel_size=2)  # tests/test_spec_decode_tp.py


def test_missing_drafter_path_is_refused_at_start_up(smollm2_dir, tmp_path):
    spec = {"method": "draft_model", "model": str(tmp_path / "nowhere" / "draft"), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="speculative_config.model"):
        LLMEngine(EngineArgs(model=str(smollm2_dir), speculative_config=spec, **SETTINGS), use_tqdm=False)


def test_draft_model_with_another_vocabulary_is_refused(smollm2_dir, tmp_path):
    other = save_random_hf_checkpoint(tiny_config("llama", vocab_size=512), tmp_path / "other")
    spec = {"method": "draft_model", "model": str(other), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="speculative_config.model .* vocabulary of 512 tokens"):
        LLMEngine(EngineArgs(model=str(smollm2_dir), speculative_config=spec, **SETTINGS), use_tqdm=False)


# ---------------------------------------------------------------------------------------------------- pieces
def test_lookahead_slots_cover_the_draft_positions_within_max_model_len():
    kv = KVCacheManager(num_blocks=40, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=20, num_lookahead_tokens=5)
    scheduler.add_request(Request("a", list(range(7)), params=Params()))
    scheduler.add_request(Request("b", list(range(17)), params=Params()))
    scheduler.schedule()
    a, b = scheduler.requests["a"], scheduler.requests["b"]
    assert len(a.block_ids) == 3  # 7 tokens + 5 look-ahead = 12 slots
    assert len(b.block_ids) == 5  # 17 tokens + 3 look-ahead (max_model_len 20)


def test_target_returns_the_eagle3_feature_states(smollm2_dir, hf_smollm2_model):
    """The residual stream entering layers 2, L // 2 and L - 3 is transformers' hidden_states at those indices."""
    model, config = load_model(str(smollm2_dir), dtype="float32")
    ids = np.array([1, 422, 1345, 314, 5248, 253, 3544, 30], np.int32)
    layers = default_aux_hidden_layers(config.num_hidden_layers)
    attention = dense_causal_attention(jnp.zeros_like(ids), config.head_dim ** -0.5)
    hidden, _, aux = model(jnp.asarray(ids), jnp.arange(len(ids)), None, attention, aux_hidden_layers=layers)
    plain, _ = model(jnp.asarray(ids), jnp.arange(len(ids)), None, attention)
    with torch.no_grad():
        ref = hf_smollm2_model(torch.tensor(ids[None], dtype=torch.long), output_hidden_states=True).hidden_states
    expected = np.concatenate([ref[i][0].numpy() for i in layers], axis=-1)
    np.testing.assert_allclose(np.asarray(aux), expected, atol=2e-4, rtol=1e-3)
    np.testing.assert_array_equal(np.asarray(hidden), np.asarray(plain))


def test_eagle3_head_loads_the_published_layout_and_refuses_others(smollm2_dir, tmp_path):
    hf_config = json.loads((smollm2_dir / "config.json").read_text())
    target = ModelConfig.from_hf_config(hf_config)
    path = save_random_eagle3_head(hf_config, tmp_path / "head", draft_vocab_size=32, intermediate_size=64)
    embedding = jnp.ones((target.vocab_size, target.hidden_size), jnp.float32)
    head = load_eagle3_head(path, target, dtype=jnp.float32, target_embedding=embedding)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    np.testing.assert_array_equal(np.asarray(head.fc.kernel[...]), tensors["fc.weight"].T)
    d2t = tensors["d2t"]
    np.testing.assert_array_equal(np.asarray(head.to_target_ids(jnp.arange(32))), np.arange(32) + d2t)
    assert head.config.aux_hidden_layers == default_aux_hidden_layers(target.num_hidden_layers)
    assert head.embed_tokens.embedding[...] is embedding  # shared, not copied
    del tensors["midlayer.hidden_norm.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors \\['midlayer.hidden_norm.weight'\\]"):
        load_eagle3_head(path, target, dtype=jnp.float32, target_embedding=embedding)


def test_eagle_head_loads_the_published_layout_and_refuses_others(smollm2_dir, tmp_path):
    """EAGLE names (``fc``, ``layers.0.*`` without an input norm), ``fc.bias`` as shipped or as the config's ``bias``
    says, bf16 tensors as published (safetensors, or a pytorch_model.bin), the target's embedding (and tied LM head)
    shared; a tensor missing or extra, or an EAGLE-3 checkpoint, is refused."""
    from safetensors.numpy import load_file, save_file
    from safetensors.torch import save_file as save_torch

    hf_config = json.loads((smollm2_dir / "config.json").read_text())
    target = ModelConfig.from_hf_config(hf_config)
    path = save_random_eagle_head(hf_config, tmp_path / "head", intermediate_size=64, fc_bias=True)
    embedding = jnp.ones((target.vocab_size, target.hidden_size), jnp.float32)
    load = lambda: load_eagle_head(path, target, dtype=jnp.float32, target_embedding=embedding,  # noqa: E731
                                   target_lm_head=None)
    tensors = load_file(str(path / "model.safetensors"))
    save_torch({name: torch.from_numpy(t).to(torch.bfloat16) for name, t in tensors.items()},
               str(path / "model.safetensors"))
    head = load()
    as_bf16 = lambda name: torch.from_numpy(tensors[name]).to(torch.bfloat16).float().numpy()  # noqa: E731
    np.testing.assert_array_equal(np.asarray(head.fc.kernel[...]), as_bf16("fc.weight").T)
    np.testing.assert_array_equal(np.asarray(head.fc.bias[...]), as_bf16("fc.bias"))
    np.testing.assert_array_equal(np.asarray(head.layers[0].mlp.down_proj.kernel[...]),
                                  as_bf16("layers.0.mlp.down_proj.weight").T)
    assert head.layers[0].input_layernorm is None and head.lm_head is None  # SmolLM2 ties its LM head
    assert head.embed_tokens.embedding[...] is embedding  # shared, not copied
    (path / "model.safetensors").unlink()  # published as a pytorch_model.bin alone
    torch.save({name: torch.from_numpy(t).to(torch.bfloat16) for name, t in tensors.items()},
               path / "pytorch_model.bin")
    np.testing.assert_array_equal(np.asarray(load().fc.kernel[...]), as_bf16("fc.weight").T)
    (path / "pytorch_model.bin").unlink()
    del tensors["fc.bias"]
    save_file(tensors, str(path / "model.safetensors"))
    assert load().fc.bias is None
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "bias": True}))
    with pytest.raises(ValueError, match="missing tensors \\['fc.bias'\\]"):
        load()
    (path / "config.json").write_text(json.dumps(config))
    save_file({**tensors, "layers.0.self_attn.rotary_emb.inv_freq": np.ones(32, np.float32)},
              str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensors \\['layers.0.self_attn.rotary_emb.inv_freq'\\]"):
        load()
    eagle3 = save_random_eagle3_head(hf_config, tmp_path / "eagle3", draft_vocab_size=4, intermediate_size=64)
    with pytest.raises(ValueError, match="'LlamaForCausalLMEagle3' is not an EAGLE head"):
        load_eagle_head(eagle3, target, dtype=jnp.float32, target_embedding=embedding, target_lm_head=None)


def test_eagle_head_of_two_layers_is_the_published_math(smollm2_dir, tmp_path):
    """A head of two layers (the second a Llama layer with its input norm) against the dense torch math."""
    hf_config = json.loads((smollm2_dir / "config.json").read_text())
    target = ModelConfig.from_hf_config(hf_config)
    path = save_random_eagle_head(hf_config, tmp_path / "head", intermediate_size=64, num_layers=2, fc_bias=True)
    rng = np.random.default_rng(0)
    embed = rng.standard_normal((target.vocab_size, target.hidden_size)).astype(np.float32) * 0.1
    head = load_eagle_head(path, target, dtype=jnp.float32, target_embedding=jnp.asarray(embed), target_lm_head=None)
    hidden, tokens = rng.standard_normal((7, target.hidden_size)).astype(np.float32), rng.integers(0, 1000, 7)
    attention = dense_causal_attention(jnp.zeros(7, jnp.int32), target.head_dim ** -0.5)
    out, state, kv = head(jnp.asarray(tokens, jnp.int32), jnp.arange(7), jnp.asarray(hidden), [None, None], attention)
    expected = _eagle_head_math(path, torch.from_numpy(embed), hf_config["rms_norm_eps"])(
        torch.from_numpy(hidden), torch.from_numpy(tokens))
    np.testing.assert_allclose(np.asarray(out), expected.numpy(), atol=2e-4, rtol=1e-3)
    assert state is out and len(kv) == 2


@pytest.mark.parametrize("field, change", [("hidden_size", {"hidden_size": 64}), ("vocab_size", {"vocab_size": 512})])
def test_eagle_head_for_another_target_is_refused_at_start_up(field, change, smollm2_dir, tmp_path):
    hf_config = {**json.loads((smollm2_dir / "config.json").read_text()), **change}
    head = save_random_eagle_head(hf_config, tmp_path / "head", intermediate_size=64)
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": 2}
    message = f"speculative_config.model .* the EAGLE head's {field} is {change[field]}, the target's is"
    with pytest.raises(ValueError, match=message):
        LLMEngine(EngineArgs(model=str(smollm2_dir), speculative_config=spec, **SETTINGS), use_tqdm=False)


# ---------------------------------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(TEXT)
    return [ids[:40], ids[10:50], smollm2_tokenizer.encode("Hello, my name is")]


@pytest.fixture(scope="module")
def plain_engine():
    """tests/test_engine.py's roomy engine, without drafts (its compiled shapes are in the persistent compilation
    cache when that file ran first: CI time)."""
    return make_engine()


@pytest.fixture(scope="module")
def plain_outputs(plain_engine, prompts):
    return [run_to_completion(plain_engine, prompts, params) for params in PARAMS]


@pytest.fixture(scope="module")
def drafter_paths(smollm2_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafters")
    hf_config = json.loads((smollm2_dir / "config.json").read_text())
    # A draft vocabulary of 4 tokens: a target restricted to them (allowed_token_ids) accepts some drafts.
    return {"draft_model": str(save_truncated_checkpoint(smollm2_dir, root / "draft2", 2)),
            "eagle3": str(save_random_eagle3_head(hf_config, root / "eagle3", draft_vocab_size=4,
                                                  intermediate_size=128)),
            "eagle": str(save_random_eagle_head(hf_config, root / "eagle", intermediate_size=128, fc_bias=True))}


def assert_counters_consistent(stats: dict, k: int) -> None:
    drafts, tokens, accepted = (stats[f"spec_decode_num_{name}"] for name in ("drafts", "draft_tokens",
                                                                              "accepted_tokens"))
    per_pos = per_position(stats)
    assert 0 < drafts and drafts <= tokens <= k * drafts and accepted <= tokens
    assert sum(per_pos) == accepted and all(a >= b for a, b in zip(per_pos, per_pos[1:]))


@pytest.fixture(scope="module")
def drafter_engines(smollm2_dir, drafter_paths):
    """name -> an engine of SmolLM2 with that drafter, or ("self") of its 2-layer copy drafting for itself (built on
    first use)."""
    cache = {}

    def get(name: str) -> LLMEngine:
        if name not in cache:
            method = "draft_model" if name == "self" else name
            target = drafter_paths["draft_model"] if name == "self" else str(smollm2_dir)
            spec = {"method": method, "model": drafter_paths[method], "num_speculative_tokens": K}
            cache[name] = LLMEngine(EngineArgs(model=target, speculative_config=spec, **SETTINGS), use_tqdm=False)
        return cache[name]

    return get


# EAGLE-1 (slow) verifies through the same path as EAGLE-3; its drafts are checked step by step below.
@pytest.mark.parametrize("method", [pytest.param("draft_model", marks=pytest.mark.slow),
                                    pytest.param("eagle", marks=pytest.mark.slow), "eagle3"])
def test_model_drafter_outputs_equal_decoding_without_drafts(method, drafter_engines, prompts, plain_outputs):
    engine = drafter_engines(method)
    for params, expected in zip(PARAMS, plain_outputs):
        assert_same_outputs(run_to_completion(engine, prompts, params), expected)
    stats = engine.stats()
    assert_counters_consistent(stats, K)
    if method == "draft_model":  # two of the target's own layers draft some of its tokens
        assert stats["spec_decode_num_accepted_tokens"] > 0
    assert_clean(engine)


# CI time: drafts cut to a grammar stay in CI through the ngram case (test_spec_decode); this is a model drafter's.
@pytest.mark.slow
def test_model_drafter_drafts_are_cut_to_the_grammar(drafter_engines, plain_engine, prompts, smollm2_tokenizer,
                                                     monkeypatch):
    """Constrained sequences (regex, choice, JSON schema; the target's favourite token one no grammar allows) on the
    draft model: its drafts, proposed on the device, are cut on the host to what the grammar allows before they are
    scheduled, each verified position is masked, and the outputs equal the engine's without drafts."""
    from paged_jax.structured_output.manager import SequenceGrammar
    from tests.test_spec_decode import GRAMMAR_CHOICES, GRAMMAR_SCHEMA

    banned = {smollm2_tokenizer.encode(" banana")[0]: 100.0}
    specs = [StructuredOutputsParams(regex="(one two )+three"), StructuredOutputsParams(choice=GRAMMAR_CHOICES),
             StructuredOutputsParams(json=GRAMMAR_SCHEMA, disable_any_whitespace=True)]
    params = [SamplingParams(max_tokens=16, temperature=0, structured_outputs=spec, logit_bias=banned)
              for spec in specs]
    expected = run_to_completion(plain_engine, prompts, params)
    validated = []  # (drafts proposed, drafts kept)
    validate = SequenceGrammar.validate_tokens
    monkeypatch.setattr(SequenceGrammar, "validate_tokens",
                        lambda self, drafts: validated.append((drafts, validate(self, drafts))) or validated[-1][1])
    engine = drafter_engines("draft_model")
    before = engine.stats()
    assert_same_outputs(run_to_completion(engine, prompts, params), expected)
    assert any(kept for _, kept in validated) and any(len(kept) < len(drafts) for drafts, kept in validated)
    stats = {key: engine.stats()[key] - before.get(key, 0) for key in before if key.startswith("spec_decode_num")}
    assert_counters_consistent(stats, K)  # drafts verified: the 2-layer drafter's guesses the grammar allows
    assert_clean(engine)


def test_async_scheduling_drafts_as_the_synchronous_engine(drafter_engines, prompts, plain_outputs, monkeypatch):
    """Async scheduling on the draft model engine, drafting off while two or more sequences run
    (``disable_by_batch_size``: those steps overlap, the drafter catching up on the tokens their placeholders stand
    for) and on once one is left: greedy outputs equal the engine's without drafts, and each sequence's proposals
    (drafts from a drafter KV written in the overlapped steps) and the counters equal the synchronous run's."""
    engine = drafter_engines("draft_model")
    core = engine.engine_core
    config = dataclasses.replace(core.spec_decoder.config, disable_by_batch_size=2)
    lengths = (4, 6, 14)
    params = [SamplingParams(max_tokens=n, temperature=0) for n in lengths]
    runs = {}
    for async_scheduling in (False, True):
        monkeypatch.setattr(core, "async_scheduling", async_scheduling)
        monkeypatch.setattr(core.spec_decoder, "config", config)
        core.reset_prefix_cache()  # the same prefills in both runs
        steps, before = StepRecorder(engine, monkeypatch), engine.stats()
        outputs = run_to_completion(engine, prompts, params, prefix=f"{async_scheduling:d}")
        runs[async_scheduling] = ([out.outputs[0].token_ids for out in outputs], spec_counters(engine, before),
                                  steps.proposals, steps.overlapped)
        monkeypatch.undo()
    assert runs[True][0] == [out.outputs[0].token_ids[:n] for out, n in zip(plain_outputs[0], lengths)]
    assert runs[True][1:3] == runs[False][1:3] and runs[True][1]["spec_decode_num_drafts"] > 0
    assert runs[True][3] >= 4 and runs[False][3] == 0
    assert_clean(engine)


def _draft_model_reference(draft_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()

    def drafts(token_ids: list[int]) -> list[int]:
        ids = list(token_ids)
        with torch.no_grad():
            for _ in range(K):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(token_ids):]

    return drafts


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _dense_attention(x, w, heads: int, kv_heads: int, dim: int, rope_theta: float):
    """One Llama layer's causal self-attention over x [m, in] at positions 0..m-1 (``w(name)``: its weights)."""
    inv_freq = 1.0 / rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)

    def rope(y):  # [m, heads, dim]
        angles = torch.arange(y.shape[0], dtype=torch.float32)[:, None] * inv_freq
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
        return y * cos + torch.cat([-y[..., dim // 2:], y[..., :dim // 2]], -1) * sin

    m = x.shape[0]
    q = rope((x @ w("self_attn.q_proj").T).view(m, heads, dim))
    k = rope((x @ w("self_attn.k_proj").T).view(m, kv_heads, dim)).repeat_interleave(heads // kv_heads, 1)
    v = (x @ w("self_attn.v_proj").T).view(m, kv_heads, dim).repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / dim ** 0.5
    scores = scores.masked_fill(torch.ones(m, m, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(m, heads * dim) @ w("self_attn.o_proj").T


def _dense_mlp_block(residual, w, eps):
    """``residual`` plus the layer's MLP on its post-attention norm."""
    h = _rms(residual, w("post_attention_layernorm"), eps)
    return residual + (torch.nn.functional.silu(h @ w("mlp.gate_proj").T) * (h @ w("mlp.up_proj").T)
                       ) @ w("mlp.down_proj").T


def _head_tensors(head_dir) -> tuple[dict, dict]:
    from safetensors.numpy import load_file

    config = json.loads((Path(head_dir) / "config.json").read_text())
    return {name: torch.from_numpy(np.asarray(v)) for name, v in load_file(f"{head_dir}/model.safetensors").items()}, \
        (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"], config["rope_theta"])


def _eagle3_reference(head_dir, target, hf_config):
    """The published EAGLE-3 math (vLLM's Eagle3LlamaForCausalLM), dense and causal, from the checkpoint's tensors."""
    t, attention = _head_tensors(head_dir)
    eps = hf_config["rms_norm_eps"]
    embed = target.get_input_embeddings().weight.detach()
    layers = default_aux_hidden_layers(hf_config["num_hidden_layers"])

    def head(hidden, tokens):
        w = lambda name: t[f"midlayer.{name}.weight"]  # noqa: E731
        x = torch.cat([_rms(embed[tokens], w("input_layernorm"), eps), _rms(hidden, w("hidden_norm"), eps)], -1)
        prenorm = _dense_mlp_block(hidden + _dense_attention(x, w, *attention), w, eps)
        return _rms(prenorm, t["norm.weight"], eps), prenorm

    def drafts(token_ids: list[int]) -> list[int]:
        with torch.no_grad():
            states = target(torch.tensor([token_ids[:-1]]), output_hidden_states=True).hidden_states
            hidden = torch.cat([states[i][0] for i in layers], -1) @ t["fc.weight"].T
            tokens, out = list(token_ids[1:]), []
            for _ in range(K):
                normed, prenorm = head(hidden, torch.tensor(tokens))
                draft = int((normed[-1] @ t["lm_head.weight"].T).argmax())
                out.append(draft + int(t["d2t"][draft]))
                hidden, tokens = torch.cat([hidden, prenorm[-1:]]), tokens + [out[-1]]
        return out

    return drafts


def _eagle_head_math(head_dir, embed, eps):
    """hidden [m, hidden], tokens [m] -> the head's output [m, hidden] (its layers at positions 0..m-1)."""
    t, attention = _head_tensors(head_dir)
    num_layers = json.loads((Path(head_dir) / "config.json").read_text())["num_hidden_layers"]

    def head(hidden, tokens):
        x = torch.cat([embed[tokens], hidden], -1) @ t["fc.weight"].T + t.get("fc.bias", 0.0)
        for i in range(num_layers):
            w = lambda name: t[f"layers.{i}.{name}.weight"]  # noqa: B023, E731
            x = _dense_mlp_block(x + _dense_attention(_rms(x, w("input_layernorm"), eps) if i else x, w, *attention),
                                 w, eps)
        return x

    return head


def _eagle_reference(head_dir, target, hf_config):
    """The published EAGLE math (EAGLE's cnets, vLLM's EagleLlamaForCausalLM), dense and causal, from the
    checkpoint's tensors: fc of [embedding | the target's final hidden state], a first layer without input norm,
    no final norm, the target's LM head."""
    head = _eagle_head_math(head_dir, target.get_input_embeddings().weight.detach(), hf_config["rms_norm_eps"])
    lm_head = target.get_output_embeddings().weight.detach()

    def drafts(token_ids: list[int]) -> list[int]:
        with torch.no_grad():
            hidden = target.model(torch.tensor([token_ids[:-1]])).last_hidden_state[0]  # after the final norm
            tokens, out = list(token_ids[1:]), []
            for _ in range(K):
                state = head(hidden, torch.tensor(tokens))
                out.append(int((state[-1] @ lm_head.T).argmax()))
                hidden, tokens = torch.cat([hidden, state[-1:]]), tokens + [out[-1]]
        return out

    return drafts


def _head_tokens(head_dir) -> list[int]:
    from safetensors.numpy import load_file

    d2t = load_file(f"{head_dir}/model.safetensors")["d2t"]
    return (np.arange(len(d2t)) + d2t).tolist()


def _self_proposed_tokens(target, count: int) -> list[int]:
    """``count`` tokens whose embedding's logits through the (tied) LM head peak at the token itself: the random
    EAGLE head, which mostly proposes the token it is fed, repeats them."""
    embed = target.get_input_embeddings().weight.detach()
    candidates = torch.arange(1000, 1400)
    own = (embed[candidates] @ target.get_output_embeddings().weight.detach().T).argmax(-1) == candidates
    return candidates[own][:count].tolist()


def assert_drafts_follow(engine: LLMEngine, requests: dict, reference, k: int) -> dict:
    """Run ``requests`` (id -> (prompt, params)) to completion; after every step each running sequence's drafts must
    be ``reference(its tokens)`` (at least 6 checked) and vLLM's counters stay consistent. -> the counters' growth."""
    before = engine.stats()
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.engine_core.scheduler.running:
            if request.spec_token_ids:
                assert request.spec_token_ids == reference(request.all_token_ids), request.request_id
                checked += 1
    assert checked >= 6
    stats = {key: engine.stats()[key] - before.get(key, 0) for key in before if key.startswith("spec_decode_num")}
    assert_counters_consistent(stats, k)
    return stats


# "self" runs with make test-all (slow): the draft_model case runs the same drafter, and the EAGLE cases accept some
# drafts and reject others.
@pytest.mark.parametrize("name", ["draft_model", pytest.param("self", marks=pytest.mark.slow), "eagle", "eagle3"])
def test_proposals_are_the_drafters_greedy_continuation(name, drafter_engines, drafter_paths, prompts,
                                                        smollm2_dir, hf_smollm2_model):
    """After every step, each running sequence's drafts are what the drafter computes densely from the sequence's
    tokens (transformers for the draft model, the published EAGLE / EAGLE-3 math on transformers' hidden states),
    through steps that accepted all, some and none of their drafts: the drafter's KV is always the sequence's own.
    "self" (a model drafting for itself) disagrees only where the repetition penalty changes the target's choice; the
    EAGLE-3 target samples among the head's 4 draft tokens, the EAGLE one among 2 tokens its head repeats."""
    hf_config = json.loads((smollm2_dir / "config.json").read_text())
    if name == "eagle3":
        reference = _eagle3_reference(drafter_paths[name], hf_smollm2_model, hf_config)
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=1,
                                allowed_token_ids=_head_tokens(drafter_paths[name]))
    elif name == "eagle":
        reference = _eagle_reference(drafter_paths[name], hf_smollm2_model, hf_config)
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=1,
                                allowed_token_ids=_self_proposed_tokens(hf_smollm2_model, 2))
    else:
        reference = _draft_model_reference(drafter_paths["draft_model"])
        params = SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.5 if name == "self" else 1.0)
    engine = drafter_engines(name)
    stats = assert_drafts_follow(engine, {f"p{i}": (prompt, params) for i, prompt in enumerate(prompts[:2])},
                                 reference, K)
    if name != "draft_model":
        assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert_clean(engine)


@pytest.mark.slow
def test_the_target_as_its_own_draft_model_is_accepted_throughout(smollm2_dir, prompts, plain_outputs):
    """SmolLM2 drafting for itself: its drafter KV and positions are the target's, so greedy drafts all agree."""
    spec = {"method": "draft_model", "model": str(smollm2_dir), "num_speculative_tokens": K}
    engine = LLMEngine(EngineArgs(model=str(smollm2_dir), speculative_config=spec, **SETTINGS), use_tqdm=False)
    assert_same_outputs(run_to_completion(engine, prompts, PARAMS[0]), plain_outputs[0])
    stats = engine.stats()
    assert_counters_consistent(stats, K)
    assert stats["spec_decode_num_accepted_tokens"] >= 0.95 * stats["spec_decode_num_draft_tokens"]
    assert_clean(engine)


@pytest.mark.parametrize("drafter", [pytest.param("eagle3", marks=pytest.mark.slow),
                                     pytest.param("eagle", marks=pytest.mark.slow),
                                     pytest.param("mtp", marks=pytest.mark.slow),
                                     pytest.param("draft_model", marks=pytest.mark.slow)])
def test_drafter_benchmark_runs_on_cpu(drafter, tmp_path):
    """benchmarks/spec_decode.py drafter on tiny shapes: plain, verify and propose + verify rows per batch, nothing
    compiled after warm-up."""
    from benchmarks.spec_decode import main

    result = main(["drafter", "--drafter", drafter, "--tiny", "--batches", "1,2", "--k", "2", "--context", "16",
                   "--repeats", "1", "--dtype", "float32", "--out", str(tmp_path / "d.json")])
    assert [(c["step"], c["batch"]) for c in result["cases"]] == [
        (step, batch) for step in ("plain", "verify", "propose_verify") for batch in (1, 2)]
    assert all(c["num_compiles_since_warmup"] == 0 and c["step_ms"] > 0 for c in result["cases"])
    assert json.loads((tmp_path / "d.json").read_text())["drafter"] == drafter
