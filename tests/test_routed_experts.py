"""Routed experts (``--enable-return-routed-experts``, vLLM's RL router replay) and per-expert load
(``--enable-expert-load-metrics``) on the tiny Qwen3-MoE checkpoint (fp32, CPU): each finished sequence's routing
equals the model's own routing of its whole sequence in one forward (chunked prefill, preemption, forks, tp with
expert parallelism); the load counts every forwarded token's experts; the server returns vLLM's base64 ``.npy``."""

import base64
import io
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.attention import dense_causal_attention
from models.loader import load_model
from models.moe_routing import pop_routed_experts, set_routing_capture
from models.testing import save_random_hf_checkpoint, tiny_config
from paged_jax.config import EngineArgs
from paged_jax.sampling_params import BeamSearchParams, SamplingParams

pytest.importorskip("transformers")

ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, use_tqdm=False,
              enable_prefix_caching=False, enable_return_routed_experts=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2_dir):
    # Layer 1 dense: the routing has the two sparse layers 0 and 2. SmolLM2's tokenizer, for stop strings.
    hf_config = tiny_config("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1], eos_token_id=None)
    path = save_random_hf_checkpoint(hf_config, tmp_path_factory.mktemp("routed"), seed=3)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def oracle(checkpoint):
    """``routing(token_ids) -> int32[n, 2, k]``: the model's routing of one sequence in one dense forward."""
    model, config = load_model(checkpoint, dtype="float32")
    set_routing_capture(model, True)

    @nnx.jit
    def forward(model, ids):
        positions = jnp.arange(ids.shape[0], dtype=jnp.int32)
        attention = dense_causal_attention(jnp.zeros_like(positions), config.head_dim ** -0.5, positions=positions)
        model(ids, positions, None, attention)
        return pop_routed_experts(model)

    return lambda token_ids: np.asarray(forward(model, jnp.asarray(token_ids, jnp.int32)))


def _prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 256, size=n).tolist() for n in (5, 40, 17)]  # 40: chunked over two steps


def _check_against_oracle(outputs, prompts, oracle):
    for prompt, output in zip(prompts, outputs):
        for completion in output.outputs:
            routed = completion.routed_experts
            sequence = prompt + list(completion.token_ids)
            assert routed.dtype == np.uint8 and routed.shape == (len(sequence) - 1, 2, 2)
            np.testing.assert_array_equal(routed, oracle(sequence[:-1]))


def test_routed_experts_equal_the_models_routing(checkpoint, oracle):
    """A tight pool (preemption by recompute), a 40-token prompt in chunks and n = 2 (a fork row starts from its
    parent's routing): every sequence's routed experts are its own forward's."""
    from paged_jax.entrypoints.llm import LLM

    llm = LLM(model=str(checkpoint), block_size=8, num_gpu_blocks_override=14, **ENGINE)
    prompts = _prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, n=2, seed=5, max_tokens=12, ignore_eos=True)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    _check_against_oracle(outputs, prompts, oracle)
    core = llm.llm_engine.engine_core
    assert core.stats()["num_preemptions"] > 0
    assert core.runner.num_compiles_since_warmup == 0
    assert not core.routed_experts._by_request  # nothing kept after the sequences finished
    # A stop string ends a sequence in the output processor (the core may forward one more token before its abort):
    # the routing is trimmed to the tokens kept.
    text = outputs[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    stopped = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]), use_tqdm=False)
    assert stopped[0].outputs[0].finish_reason == "stop" and stopped[0].outputs[0].stop_reason == stop
    assert len(stopped[0].outputs[0].token_ids) < 12
    _check_against_oracle(stopped, prompts[:1], oracle)
    with pytest.raises(ValueError, match="^beam_search: not supported with enable_return_routed_experts"):
        llm.beam_search([{"prompt_token_ids": prompts[0]}], BeamSearchParams(beam_width=2, max_tokens=2))


def test_async_scheduling_routing_and_load(checkpoint, oracle):
    """With async scheduling (steps reported one behind, a stop token resolved after the next step was scheduled)
    the routing is the same, and the load counts every forwarded token, in steps without a sampled row too."""
    from paged_jax.entrypoints.llm import LLM

    llm = LLM(model=str(checkpoint), num_gpu_blocks_override=24, async_scheduling=True,
              enable_expert_load_metrics=True, **ENGINE)
    core = llm.llm_engine.engine_core
    prompts = _prompts()
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    load = sum(v for k, v in core.stats().items() if k.startswith("moe_expert_tokens.0."))
    assert load == 2 * sum(len(o.outputs[0].routed_experts) for o in first)  # top 2, every forwarded token
    stop_token = first[1].outputs[0].token_ids[4]  # the second prompt's fifth token ends it early now
    params = [greedy, SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_token]),
              SamplingParams(temperature=1.0, n=2, seed=5, max_tokens=10, ignore_eos=True)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert len(outputs[1].outputs[0].token_ids) <= 5
    _check_against_oracle(first + outputs, prompts + prompts, oracle)
    assert not core.routed_experts._by_request and core.runner.num_compiles_since_warmup == 0


def test_tensor_and_expert_parallel_routing_and_expert_load(checkpoint, oracle):
    from paged_jax.entrypoints.llm import LLM
    from paged_jax.metrics import Counter

    llm = LLM(model=str(checkpoint), tensor_parallel_size=2, enable_expert_parallel=True,
              enable_expert_load_metrics=True, num_gpu_blocks_override=16, **ENGINE)
    prompts = _prompts()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    _check_against_oracle(outputs, prompts, oracle)
    assert llm.llm_engine.engine_core.runner.num_compiles_since_warmup == 0
    counters = [m for m in llm.get_metrics() if m.name == "vllm:moe_expert_tokens"]
    assert all(isinstance(m, Counter) for m in counters)
    assert sorted({m.labels["layer"] for m in counters}) == ["0", "2"] and len(counters) == 2 * 8
    # Every forwarded token counts once per top-k slot in every sparse layer.
    forwarded = sum(len(p) + 6 - 1 for p in prompts)
    for layer in ("0", "2"):
        assert sum(m.value for m in counters if m.labels["layer"] == layer) == 2 * forwarded
    expected = np.bincount(np.concatenate([o.outputs[0].routed_experts[:, 0].reshape(-1) for o in outputs]),
                           minlength=8)
    assert [m.value for m in counters if m.labels["layer"] == "0"] == expected.tolist()


def test_off_by_default_and_refusals(checkpoint, tmp_path):
    from paged_jax.entrypoints.llm import LLM

    assert EngineArgs().enable_return_routed_experts is False and EngineArgs().enable_expert_load_metrics is False
    for field, value in (("enable_prefix_caching", True),
                         ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2}),
                         ("pipeline_parallel_size", 2)):
        kwargs = {"enable_return_routed_experts": True, "enable_prefix_caching": False, field: value}
        with pytest.raises(ValueError, match=f"^enable_return_routed_experts is not supported with {field}"):
            EngineArgs(**kwargs)
    save_random_hf_checkpoint(tiny_config("qwen3"), tmp_path)
    with pytest.raises(ValueError, match="^enable_expert_load_metrics: Qwen3ForCausalLM has no mixture-of-experts"):
        LLM(model=str(tmp_path), dtype="float32", enable_expert_load_metrics=True, use_tqdm=False)


def test_routed_experts_cross_the_core_process_wire():
    from paged_jax.engine.messages import (CORE_MESSAGE_DECODER, EngineCoreOutput, EngineCoreOutputs, RoutedExperts,
                                           encode)

    routing = np.arange(2 * 3 * 2, dtype=np.uint8).reshape(2, 3, 2)
    message = EngineCoreOutputs([EngineCoreOutput("r", 0, [5], finish_reason="length",
                                                  routed_experts=RoutedExperts.from_array(routing))])
    decoded = CORE_MESSAGE_DECODER.decode(encode(message))
    np.testing.assert_array_equal(decoded.outputs[0].routed_experts.to_array(), routing)


def test_server_returns_vllms_base64_npy(checkpoint, oracle):
    import httpx

    from paged_jax.engine.llm_engine import LLMEngine
    from serving.app import create_app
    from tests.test_serving import ServerThread

    args = {k: v for k, v in ENGINE.items() if k != "use_tqdm"}
    engine = LLMEngine(EngineArgs(model=str(checkpoint), num_gpu_blocks_override=16, **args), use_tqdm=False)
    app = create_app(engine, served_model_name="tiny")
    prompt = _prompts()[0]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    try:
        with ServerThread(app) as server:
            response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
    finally:
        app.state.server.engine.shutdown()
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    tokens = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    routed = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])))
    np.testing.assert_array_equal(routed, oracle((prompt + tokens)[:-1]))
