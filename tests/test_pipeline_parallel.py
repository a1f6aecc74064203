"""Pipeline parallelism (paged_jax.pipeline): layer stages on their own devices give the single-device engine's greedy
output, alone and with tp inside each stage; weights and KV pool split by stage; no compile after warm-up."""

from __future__ import annotations

import pytest

from paged_jax.config import EngineArgs
from paged_jax.engine import LLMEngine
from paged_jax.pipeline import PipelineModelRunner, PipelinePlan, stage_layer_ranges
from tests.test_data_parallel import (MAX_TOKENS, QWEN3_PROMPTS, SMALL, SMOLLM2_PROMPTS, greedy, qwen3_checkpoint_in,
                                      transformers_greedy)


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory):
    # 3 layers: the stages are uneven (1 + 2), untied LM head on the last stage.
    return qwen3_checkpoint_in(tmp_path_factory.mktemp("qwen3pp"))


def _assert_staged(engine: LLMEngine, pp: int, tp: int):
    runner = engine.runner
    assert isinstance(runner, PipelineModelRunner) and runner.num_compiles_since_warmup == 0
    plan: PipelinePlan = runner.sharding_plan
    assert plan.pipeline_parallel_size == pp and dict(plan.mesh.shape) == {"pp": pp, "tp": tp}
    for stage, (start, stop) in enumerate(plan.layer_ranges):
        stage_devices = set(plan.mesh.devices[stage])
        for k_pages, v_pages in runner.kv_pool[start:stop]:
            assert set(k_pages.sharding.device_set) == stage_devices == set(v_pages.sharding.device_set)
    # Every weight sits on exactly one stage's devices.
    assert all(len(leaf.sharding.device_set) <= tp for leaf in runner._param_leaves)


def test_stage_layer_ranges():
    assert stage_layer_ranges(30, 2) == ((0, 15), (15, 30))
    assert stage_layer_ranges(3, 2) == ((0, 1), (1, 3))
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        stage_layer_ranges(2, 4)
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineArgs(pipeline_parallel_size=2, preemption_mode="swap")


@pytest.fixture(scope="module")
def qwen3_reference(qwen3_checkpoint):
    return transformers_greedy(qwen3_checkpoint, QWEN3_PROMPTS)  # = the single-device engine's (test_data_parallel)


@pytest.mark.parametrize("tp", [1, 2])
def test_pp2_greedy_matches_single_device_on_random_qwen3(qwen3_checkpoint, qwen3_reference, tp):
    reference = qwen3_reference
    engine = LLMEngine(EngineArgs(model=qwen3_checkpoint, pipeline_parallel_size=2, tensor_parallel_size=tp,
                                  **SMALL), use_tqdm=False)
    assert greedy(engine, QWEN3_PROMPTS) == reference
    _assert_staged(engine, 2, tp)


def test_pp2_by_tp2_greedy_matches_single_device_on_smollm2(hf_greedy):
    # Tied embeddings: the last stage holds a copy for the LM head.
    engine = LLMEngine(EngineArgs(model=None, pipeline_parallel_size=2, tensor_parallel_size=2, **SMALL),
                       use_tqdm=False)
    reference = [hf_greedy(p, MAX_TOKENS) for p in SMOLLM2_PROMPTS]
    assert greedy(engine, SMOLLM2_PROMPTS) == reference
    _assert_staged(engine, 2, 2)
