"""Pipeline parallelism (paged_jax.parallel.pipeline): layer stages on their own devices give the single-device engine's greedy
output, alone and with tp inside each stage, with steps split into overlapping micro-batches and not; weights and KV
pool split by stage; no compile after warm-up."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.parallel import pipeline
from paged_jax.config import EngineArgs
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.parallel.pipeline import (PipelineForward, PipelinePlan, microbatch_attention_metadata, pipeline_schedule,
                                stage_layer_ranges)
from paged_jax.sampling_params import SamplingParams
from tests.test_data_parallel import (MAX_TOKENS, QWEN3_PROMPTS, SMALL, SMOLLM2_PROMPTS, greedy, qwen3_checkpoint_in,
                                      transformers_greedy)


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory):
    # 3 layers: the stages are uneven (1 + 2), untied LM head on the last stage.
    return qwen3_checkpoint_in(tmp_path_factory.mktemp("qwen3pp"))


@pytest.fixture(autouse=True)
def small_microbatches(monkeypatch):
    """SMALL's buckets are (1 token, 1 seq) and (16, 2): with 8-token micro-batches the 16-token steps (prefill chunks,
    some cut by the boundary, and decodes padded to 16) run as 2 overlapping micro-batches, 1-token steps as one."""
    monkeypatch.setattr(pipeline, "MIN_MICROBATCH_TOKENS", 8)


def _record_dispatches(runner) -> list[list[int]]:
    """Wraps the runner's stage functions: each step's stages in dispatch order (a stage's k-th call in a step is its
    micro-batch k: its KV slices thread through them), appended to the returned list; the staged forward runs with
    implicit transfers disallowed (a host sync inside it would raise)."""
    steps: list[list[int]] = []

    def recording(fn):
        def call(*args, stage, **kwargs):
            if stage == 0 and (not steps or steps[-1][-1] != 0):  # a new step: stage 0 after a later stage
                steps.append([])
            steps[-1].append(stage)
            return fn(*args, stage=stage, **kwargs)
        return call

    strategy = runner.forward_strategy
    strategy.stage_fns = [recording(fn) for fn in strategy.stage_fns]
    staged = runner._forward._call

    def guarded(*args, **kwargs):
        with jax.transfer_guard("disallow"):
            return staged(*args, **kwargs)

    runner._forward._call = guarded
    return steps


def _assert_overlapped(steps: list[list[int]]):
    """pp = 2. Steps of 2 micro-batches: stage 0 has micro-batch 1 queued before stage 1 is handed micro-batch 0 (pp
    batches in flight); 1-token steps: stage after stage."""
    split = [step for step in steps if len(step) == 4]
    assert split and all(step == [0, 0, 1, 1] for step in split)
    assert all(step == [0, 1] for step in steps if len(step) != 4)
    assert len(split) < len(steps)  # both kinds ran


def _n2_greedy(engine: LLMEngine, prompt: list[int]) -> list[list[int]]:
    """Both sequences of an n = 2 greedy request (they share the prompt's partial block: a copy-on-write copy)."""
    engine.add_request("n2", prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, n=2))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step(finished_only=True):
            final = [list(c.token_ids) for c in out.outputs]
    return final


def _assert_staged(engine: LLMEngine, pp: int, tp: int):
    runner = engine.engine_core.runner
    assert isinstance(runner.forward_strategy, PipelineForward) and runner.num_compiles_since_warmup == 0
    plan: PipelinePlan = runner.sharding_plan
    assert plan.pipeline_parallel_size == pp and dict(plan.mesh.shape) == {"pp": pp, "tp": tp}
    for stage, (start, stop) in enumerate(plan.layer_ranges):
        stage_devices = set(plan.mesh.devices[stage])
        for k_pages, v_pages in runner.kv_pool[start:stop]:
            assert set(k_pages.sharding.device_set) == stage_devices == set(v_pages.sharding.device_set)
    # Every weight sits on exactly one stage's devices.
    assert all(len(leaf.sharding.device_set) <= tp for leaf in runner._param_leaves)


def test_pipeline_schedule_and_microbatch_metadata():
    assert pipeline_schedule(2, 1) == [(0, 0), (1, 0)]
    assert pipeline_schedule(3, 2) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert pipeline_schedule(2, 3) == [(0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (1, 2)]
    # Rows: a decode (1 token, context 7), a chunk of 6 tokens (context 10), a padding sequence; 7 tokens of 8.
    cu, kv = jnp.array([0, 1, 7, 7], jnp.int32), jnp.array([7, 10, 0], jnp.int32)
    first = microbatch_attention_metadata(cu, kv, 0, 4)  # the decode + the chunk's first 3 tokens
    second = microbatch_attention_metadata(cu, kv, 4, 8)  # the chunk's last 3 tokens, then a padding token
    assert [np.asarray(a).tolist() for a in first] == [[0, 1, 4, 4], [7, 7, 0]]
    assert [np.asarray(a).tolist() for a in second] == [[0, 0, 3, 3], [0, 10, 0]]
    assert pipeline.num_microbatches_for(16, 2, 8) == 2 and pipeline.num_microbatches_for(16, 2, 9) == 1
    assert pipeline.num_microbatches_for(15, 2, 1) == 1


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
def test_pp2_greedy_matches_single_device_on_random_qwen3(qwen3_checkpoint, qwen3_reference, tp, tmp_path):
    """Also after weight updates (paged_jax.worker.weight_update): a trainer's state from a device outside the
    pipeline, then a checkpoint on disk, each stage's parameters in its own shards, nothing compiled."""
    import jax
    from flax import nnx

    from models.loader import load_model

    reference = qwen3_reference
    engine = LLMEngine(EngineArgs(model=qwen3_checkpoint, pipeline_parallel_size=2, tensor_parallel_size=tp,
                                  **SMALL), use_tqdm=False)
    assert engine.engine_core.runner.forward_strategy.num_microbatches == {1: 1, 16: 2}
    steps = _record_dispatches(engine.engine_core.runner)
    assert greedy(engine, QWEN3_PROMPTS) == reference
    _assert_overlapped(steps)
    assert _n2_greedy(engine, QWEN3_PROMPTS[0]) == [reference[0]] * 2
    _assert_staged(engine, 2, tp)
    other = qwen3_checkpoint_in(tmp_path, seed=1)
    engine.update_weights(jax.device_put(nnx.state(load_model(other, dtype="float32")[0]), jax.devices()[7]))
    assert greedy(engine, QWEN3_PROMPTS, prefix="u") == transformers_greedy(other, QWEN3_PROMPTS) != reference
    engine.update_weights_from_disk(qwen3_checkpoint)
    assert greedy(engine, QWEN3_PROMPTS, prefix="d") == reference
    _assert_staged(engine, 2, tp)


@pytest.mark.slow
def test_pp2_by_tp2_greedy_matches_single_device_on_smollm2(hf_greedy):
    # Tied embeddings: the last stage holds a copy for the LM head.
    engine = LLMEngine(EngineArgs(model=None, pipeline_parallel_size=2, tensor_parallel_size=2, **SMALL),
                       use_tqdm=False)
    reference = [hf_greedy(p, MAX_TOKENS) for p in SMOLLM2_PROMPTS]
    assert greedy(engine, SMOLLM2_PROMPTS) == reference
    _assert_staged(engine, 2, 2)
