"""Sleep mode and pause / resume of an engine between RL rollouts (paged_jax.engine.rollout_control)."""

import pytest
from flax import nnx

from models.loader import load_model
from models.testing import save_random_hf_checkpoint, tiny_config
from paged_jax.config import EngineArgs
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.entrypoints.llm import LLM
from paged_jax.sampling_params import SamplingParams

PROMPT = {"prompt_token_ids": [3, 17, 42, 99, 7, 11, 5]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
              num_gpu_blocks_override=16, weight_cache=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_random_hf_checkpoint(tiny_config("llama"), tmp_path_factory.mktemp("ckpt") / "a")


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(model=str(checkpoint), enable_sleep_mode=True, use_tqdm=False, **ENGINE)


def _tokens(llm):
    return llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_sleep_levels_free_the_weights_and_the_kv_pool_and_wake_up_restores_them(llm, checkpoint):
    runner = llm.llm_engine.engine_core.runner
    expected = _tokens(llm)
    old_leaf, old_kv = runner.param_leaves[0], runner.kv_pool[0][0]
    memory = llm.sleep(level=1)
    assert set(memory) == {"bytes_in_use_before", "bytes_in_use_after"}
    assert llm.is_sleeping() and old_leaf.is_deleted() and old_kv.is_deleted()
    with pytest.raises(ValueError, match="sleeping"):
        _tokens(llm)
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping()  # the KV pool still sleeps
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert _tokens(llm) == expected  # weights back from host memory

    llm.sleep(level=2)
    llm.wake_up()
    with pytest.raises(ValueError, match="discarded by sleep"):
        _tokens(llm)
    model, _ = load_model(checkpoint, dtype="float32")
    llm.update_weights(nnx.state(model))
    assert _tokens(llm) == expected
    assert runner.num_compiles_since_warmup == 0


def test_sleep_refusals(llm, checkpoint):
    with pytest.raises(ValueError, match="enable_sleep_mode is not supported with pipeline_parallel_size"):
        EngineArgs(enable_sleep_mode=True, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        EngineArgs(logprobs_mode="logits")
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="tags: unknown tag 'kv'"):
        llm.wake_up(tags=["kv"])
    engine = llm.llm_engine
    engine.add_request("busy", PROMPT, GREEDY)
    with pytest.raises(ValueError, match="1 requests are unfinished"):
        llm.sleep()
    engine.abort_request("busy")
    assert not llm.is_sleeping()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pause_modes(checkpoint, async_scheduling):
    engine = LLMEngine(EngineArgs(model=str(checkpoint), async_scheduling=async_scheduling, **ENGINE), use_tqdm=False)
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        engine.sleep(1)
    _pause_modes(engine, checkpoint)
    assert engine.engine_core.runner.num_compiles_since_warmup == 0


def _step_until_finished(engine, request_ids):
    finished = {}
    while set(request_ids) - set(finished):
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def _pause_modes(engine, checkpoint):
    """keep: frozen requests continue after resume, with the tokens they would have had; abort: every unfinished
    request ends with finish_reason "abort"; wait: running requests finish, new ones wait for the resume."""
    engine.add_request("reference", PROMPT, GREEDY)
    expected = _step_until_finished(engine, ["reference"])["reference"].outputs[0].token_ids

    engine.add_request("kept", PROMPT, GREEDY)
    engine.step()
    engine.step()
    engine.pause_generation("keep")
    if engine.engine_core.async_scheduling:  # the step in flight at the pause completes (its outputs come)
        assert engine.has_unfinished_requests() and len(engine.step()) == 1
    assert engine.is_paused() and not engine.has_unfinished_requests()
    assert engine.step() == []
    engine.add_request("held", PROMPT, GREEDY)
    assert engine.step() == []
    engine.update_weights(nnx.state(load_model(checkpoint, dtype="float32")[0]))  # the same weights, reloaded
    engine.resume_generation()
    finished = _step_until_finished(engine, ["kept", "held"])
    assert [finished[r].outputs[0].token_ids for r in ("kept", "held")] == [expected, expected]

    engine.add_request("aborted", PROMPT, GREEDY)
    engine.step()
    engine.pause_generation("abort")
    outputs = engine.step()
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in outputs] == [("aborted", True, "abort")]
    engine.resume_generation()

    engine.add_request("drained", PROMPT, GREEDY)
    engine.step()
    engine.pause_generation("wait")
    engine.add_request("waits", PROMPT, GREEDY)
    assert not engine.is_paused()
    finished = _step_until_finished(engine, ["drained"])
    assert engine.is_paused() and "waits" not in finished
    assert finished["drained"].outputs[0].token_ids == expected
    engine.resume_generation()
    assert _step_until_finished(engine, ["waits"])["waits"].outputs[0].token_ids == expected
    with pytest.raises(ValueError, match="mode must be one of"):
        engine.pause_generation("later")


def test_data_parallel_replicas_update_sleep_and_pause_together(checkpoint, tmp_path):
    """data_parallel_size=2: every replica takes the new weights (on its own device), sleeps and wakes."""
    from models.testing import save_random_hf_checkpoint

    other = save_random_hf_checkpoint(tiny_config("llama"), tmp_path / "b", seed=1)
    llm = LLM(model=str(checkpoint), data_parallel_size=2, enable_sleep_mode=True, use_tqdm=False, **ENGINE)
    prompts = [PROMPT, {"prompt_token_ids": PROMPT["prompt_token_ids"][::-1]}]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    llm.update_weights_from_disk(str(other))
    llm.sleep(level=1)
    assert llm.is_sleeping()
    llm.wake_up()
    llm.pause_generation("keep")
    llm.resume_generation()
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    reference = LLM(model=str(other), use_tqdm=False, **ENGINE)
    assert after == [o.outputs[0].token_ids for o in reference.generate(prompts, GREEDY, use_tqdm=False)] != before
    assert all(core.runner.num_compiles_since_warmup == 0 for core in llm.llm_engine.engine_core.cores)
