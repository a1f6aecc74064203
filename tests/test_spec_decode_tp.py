"""Model drafters under tensor parallelism (tp devices among the 8 virtual CPU devices, as tests/test_sharding.py runs
them): a tiny random Llama target (6 q heads over 2 KV heads: at tp = 4 its heads are padded and its KV heads
copied) with an EAGLE-3 head, a draft model (the target itself) and an EAGLE head. Greedy outputs equal decoding
without drafts (transformers; the tensor-parallel engine without drafts), every step's drafts are the drafter's (the
published EAGLE-3 math; the one-device engine's drafts with the same drafter, step by step: its KV and weights are the
same sequence's, only split over devices), the drafter's weights and KV pool are in their shards (the target's
embedding and LM head shared, not copied), and nothing compiles after warm-up. Also: a draft model for a target with
sliding-window KV-cache groups."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding

from models.testing import save_random_eagle3_head, save_random_eagle_head, save_random_hf_checkpoint, tiny_config
from paged_jax.config import EngineArgs
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.sampling_params import SamplingParams
from tests.test_engine import assert_clean, run_to_completion
from tests.test_spec_decode import assert_same_outputs
from tests.test_spec_decode_models import _eagle3_reference

K = 3
SETTINGS = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                num_gpu_blocks_override=40, seed=0)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [40, 41, 42, 43, 44, 45, 46] * 3]
MAX_TOKENS = 10
# The EAGLE-3 run: the target restricted to the head's four draft tokens, so its drafts are accepted at some
# positions and rejected at others. The draft model is the target itself: every draft accepted.
TOKENS = [17, 60, 99, 200]
PARAMS = {"eagle3": SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, allowed_token_ids=TOKENS),
          "draft_model": SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)}
PARAMS["eagle"] = PARAMS["eagle3"]
METHODS = {"eagle3": 4, "draft_model": 2, "eagle": 2}  # method -> tensor_parallel_size


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from safetensors.numpy import load_file, save_file

    root = tmp_path_factory.mktemp("tp_drafters")
    # 7 layers: the EAGLE-3 head reads layers 2, 3 and 4 (vLLM's default for the depth).
    hf_config = tiny_config("llama", num_hidden_layers=7, hidden_size=96, num_attention_heads=6,
                            num_key_value_heads=2)
    target = save_random_hf_checkpoint(hf_config, root / "target", seed=2)
    eagle3 = save_random_eagle3_head(hf_config, root / "eagle3", draft_vocab_size=len(TOKENS), intermediate_size=64)
    tensors = load_file(str(eagle3 / "model.safetensors"))
    tensors["d2t"] = (np.asarray(TOKENS) - np.arange(len(TOKENS))).astype(np.int64)
    save_file(tensors, str(eagle3 / "model.safetensors"))
    return {"target": str(target), "draft_model": str(target), "eagle3": str(eagle3),
            "eagle": str(save_random_eagle_head(hf_config, root / "eagle", intermediate_size=64))}


def _engine(paths, tp: int, method: str | None = None) -> LLMEngine:
    spec = None if method is None else {"method": method, "model": paths[method], "num_speculative_tokens": K}
    return LLMEngine(EngineArgs(model=paths["target"], tensor_parallel_size=tp, speculative_config=spec, **SETTINGS),
                     use_tqdm=False)


def _recording(engine: LLMEngine, drafts: list):
    """``engine.step`` that also appends, after each step, (request id, its tokens, its drafts) of every running
    request to ``drafts``."""
    step = engine.step

    def recording_step(*args, **kwargs):
        outputs = step(*args, **kwargs)
        drafts.append(sorted((r.request_id, tuple(r.all_token_ids), tuple(r.spec_token_ids))
                             for r in engine.engine_core.scheduler.running))
        return outputs

    return recording_step


def _run_recording_drafts(engine: LLMEngine, params: SamplingParams) -> tuple[list, list]:
    """(outputs of ``PROMPTS``, each step's (request id, its tokens, its drafts) per running request)."""
    engine.step = _recording(engine, drafts := [])
    return run_to_completion(engine, [{"prompt_token_ids": p} for p in PROMPTS], params), drafts


@pytest.fixture(scope="module")
def drafting(paths):
    """method -> (its tensor-parallel engine, (outputs, drafts) of its run) (built on first use)."""
    cache = {}

    def get(method: str):
        if method not in cache:
            engine = _engine(paths, METHODS[method], method)
            cache[method] = engine, _run_recording_drafts(engine, PARAMS[method])
        return cache[method]

    return get


def _assert_drafter_on_mesh(engine: LLMEngine, tp: int) -> None:
    runner = engine.engine_core.runner
    drafter, plan = runner.drafter, runner.sharding_plan
    assert drafter.plan.mesh == plan.mesh and drafter.plan.tensor_parallel_size == tp
    k_pages = drafter.pool[0][0]
    assert k_pages.sharding.is_equivalent_to(drafter.plan.kv_cache_sharding, k_pages.ndim)
    assert k_pages.sharding.shard_shape(k_pages.shape)[2] == drafter.plan.num_kv_heads_per_device
    assert all(isinstance(leaf.sharding, NamedSharding) and leaf.sharding.mesh == plan.mesh
               for leaf in drafter._leaves)
    assert any(leaf.sharding.shard_shape(leaf.shape) != leaf.shape for leaf in drafter._leaves)  # split over tp
    # A head's embedding (and EAGLE's LM head): the runner's own arrays, not copies.
    shared = {"draft_model": 0, "eagle3": 1, "eagle": 2}[drafter.method]
    assert len(drafter._target_leaves) == shared
    assert all(drafter._leaves[own] is runner.param_leaves[target] for own, target in drafter._target_leaves)


def test_eagle3_head_on_a_tensor_parallel_engine(paths, drafting):
    """tp = 4: outputs are transformers' greedy tokens (among the allowed ones), every step's drafts the published
    EAGLE-3 math on transformers' hidden states."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(paths["target"], dtype=torch.float32).eval()
    hf_config = json.loads((Path(paths["target"]) / "config.json").read_text())
    reference = _eagle3_reference(paths["eagle3"], target, hf_config)
    engine, (got, drafts) = drafting("eagle3")
    with torch.no_grad():
        for prompt, out in zip(PROMPTS, got, strict=True):
            ids = list(prompt)
            for _ in range(MAX_TOKENS):
                ids.append(TOKENS[int(target(torch.tensor([ids])).logits[0, -1, TOKENS].argmax())])
            assert list(out.outputs[0].token_ids) == ids[len(prompt):]
    checked = [(tokens, proposed) for step in drafts for _, tokens, proposed in step if proposed]
    assert len(checked) >= 6
    for tokens, proposed in checked:
        assert list(proposed) == reference(list(tokens))
    stats = engine.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    _assert_drafter_on_mesh(engine, METHODS["eagle3"])
    assert_clean(engine)


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_model_drafter_on_a_tensor_parallel_engine_equals_the_other_engines(method, paths, drafting):
    """Outputs equal the tensor-parallel engine's without drafts and the one-device engine's with the same drafter;
    every step's drafts equal the latter's."""
    engine, (got, drafts) = drafting(method)
    assert_same_outputs(got, run_to_completion(_engine(paths, METHODS[method]),
                                               [{"prompt_token_ids": p} for p in PROMPTS], PARAMS[method]))
    expected, expected_drafts = _run_recording_drafts(_engine(paths, 1, method), PARAMS[method])
    assert_same_outputs(got, expected)
    assert drafts == expected_drafts
    stats = engine.stats()
    assert stats["spec_decode_num_drafts"] > 0
    if method == "draft_model":  # the target drafting for itself
        assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    _assert_drafter_on_mesh(engine, METHODS[method])
    assert_clean(engine)


@pytest.mark.slow  # `make test-all`; CI runs the refusal below
def test_draft_model_on_a_target_with_sliding_window_groups(tmp_path):
    """A Gemma 3 target (every third layer full, the others an 8-token window: three KV-cache groups) drafted for by
    a one-layer Llama: the drafter's pool follows the full-attention group (the sliding groups drop blocks behind
    the window, which a pool of 20 blocks soon gives to the other sequence), so every step's drafts are
    transformers' greedy continuation of the draft model over the whole sequence, and the outputs are the target's
    own greedy tokens (transformers)."""
    from safetensors.numpy import load_file, save_file
    from transformers import AutoModelForCausalLM

    from tests.test_spec_decode_models import _draft_model_reference

    target = save_random_hf_checkpoint(tiny_config("gemma3", num_hidden_layers=6, sliding_window_pattern=3),
                                       tmp_path / "gemma3", seed=3)
    draft = save_random_hf_checkpoint(tiny_config("llama", num_hidden_layers=1), tmp_path / "draft", seed=4)
    # Attention weights large enough that each position's output depends on the earlier ones it attends to: the
    # drafts then check the drafter's KV of the whole sequence.
    tensors = load_file(str(draft / "model.safetensors"))
    save_file({name: t * 8 if ".self_attn." in name else t for name, t in tensors.items()},
              str(draft / "model.safetensors"), metadata={"format": "pt"})
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}
    engine = LLMEngine(EngineArgs(model=str(target), speculative_config=spec, dtype="float32", max_model_len=64,
                                  block_size=8, max_num_batched_tokens=16, max_num_seqs=2, num_gpu_blocks_override=20,
                                  seed=0), use_tqdm=False)
    assert engine.engine_core.runner.kv_layout.num_groups == 3
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (17, 22)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.step = _recording(engine, drafts := [])
    got = run_to_completion(engine, [{"prompt_token_ids": p} for p in prompts], params)
    hf_target = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    with torch.no_grad():
        for prompt, out in zip(prompts, got, strict=True):
            expected = hf_target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
            assert list(out.outputs[0].token_ids) == expected.tolist()
    reference = _draft_model_reference(draft)
    checked = [(tokens, proposed) for step in drafts for _, tokens, proposed in step if proposed]
    assert len(checked) >= 6 and any(len(tokens) > 24 for tokens, _ in checked)  # past three windows
    for tokens, proposed in checked:
        assert list(proposed) == reference(list(tokens))
    assert_clean(engine)


def test_eagle3_head_on_a_target_with_sliding_window_groups_is_refused(tmp_path):
    hf_config = tiny_config("gemma3", num_hidden_layers=6, sliding_window_pattern=3)
    target = save_random_hf_checkpoint(hf_config, tmp_path / "gemma3")
    head = save_random_eagle3_head(hf_config, tmp_path / "eagle3", draft_vocab_size=4, intermediate_size=64)
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, "eagle_config": {
        "eagle_aux_hidden_state_layer_ids": [1, 2, 4]}}))
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": K}
    with pytest.raises(ValueError, match="speculative_config.method='eagle3' is not supported with this model's "
                                         "mixed sliding-window layers"):
        LLMEngine(EngineArgs(model=str(target), speculative_config=spec, dtype="float32", max_model_len=64,
                             block_size=8, max_num_batched_tokens=16, max_num_seqs=2), use_tqdm=False)
