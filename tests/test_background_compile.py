"""Serving before every step executable is compiled (paged_jax/worker/background_compile.py): the runner and the engine
run steps on the first executables while the rest are held back in the background, with the outputs of a fully
warmed runner / engine and no compile on the step path; the limits grow to the full set once they land; a step that
needs a held-back executable waits for it; closing the engine while compiles run does not hang."""

import threading

import numpy as np
import pytest

from models.testing import save_random_hf_checkpoint, tiny_config
from paged_jax.config import EngineArgs
from paged_jax.core.hand_steps import HandScheduler
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.sampling_params import SamplingParams
from paged_jax.worker import warm_up as warm_up_lib
from paged_jax.worker.buckets import planned_num_compiles
from paged_jax.worker.model_runner import ModelRunner
from tests.test_model_runner import BLOCK_SIZE, MAX_MODEL_LEN, fresh_step, make_runner
from tests.test_model_runner import tiny_model  # noqa: F401 (a fixture)

BACKGROUND_THREAD = "paged-jax-background-compile"


@pytest.fixture
def held_back(monkeypatch):
    """An event: background compiles (and executable cache loads) wait for it; set at the end of the test."""
    gate = threading.Event()
    compile_ = warm_up_lib.load_or_compile

    def gated(*args, **kwargs):
        if threading.current_thread().name.startswith(BACKGROUND_THREAD):
            gate.wait()
        return compile_(*args, **kwargs)

    monkeypatch.setattr(warm_up_lib, "load_or_compile", gated)
    yield gate
    gate.set()


def _same(got, want) -> None:
    np.testing.assert_array_equal(got.sampled_token_ids, want.sampled_token_ids)
    if want.logprobs is not None:
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-6, atol=1e-6)
    if want.top_token_ids is not None:
        np.testing.assert_array_equal(got.top_token_ids, want.top_token_ids)


def test_runner_serves_on_the_first_executables_then_grows_to_the_full_set(tiny_model, held_back):
    """While everything but the first set is held back: the ready buckets are the (1, 1) decode and the smallest
    prefill bucket, greedy, temperature and top-k steps (the latter two in the general sampler) sample what a fully
    warmed runner samples, a step above the ready limits is refused, and a step wanting top logprobs waits for its
    executable. Released: every bucket and the full limits, nothing compiled on the step path."""
    model, config = tiny_model
    reference = make_runner(model, config, max_num_seqs=4, max_num_batched_tokens=32, threads=2)
    runner = ModelRunner(model, config, num_blocks=40, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                         max_num_seqs=4, max_num_batched_tokens=32, eos_token_ids=[2])
    runner.warm_up(use_tqdm=False, threads=2, background=True)
    ready = runner.ready
    assert not ready.complete and ready.buckets == [(1, 1), (16, 4)] and ready.limits == (16, 4)
    assert ready.sampler_mode(4, "greedy_or_temperature", 0, False) == "full"
    rng = np.random.default_rng(0)
    hs = HandScheduler()
    for params in (SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=0.8, seed=3, logprobs=0),
                   SamplingParams(temperature=0.9, top_k=5, top_p=0.9, seed=4, logprobs=0)):
        step = fresh_step(hs, [(f"r{i}", rng.integers(3, config.vocab_size, size=5).tolist(), [1 + 4 * i, 2 + 4 * i],
                                params, i) for i in range(3)])
        _same(runner.execute(step).result(), reference.execute(step).result())
    too_big = fresh_step(hs, [("long", rng.integers(3, config.vocab_size, size=20).tolist(), list(range(1, 6)),
                               SamplingParams(temperature=0.0), 0)])
    with pytest.raises(ValueError, match="exceeds every bucket"):
        runner.execute(too_big)
    runner.input_batch.remove("long")  # the refused step's row (a scheduler never makes such a step)
    top = fresh_step(hs, [("top", [5, 6, 7], [1, 2], SamplingParams(temperature=0.5, seed=1, logprobs=3), 0)])
    results = {}
    thread = threading.Thread(target=lambda: results.update(got=runner.execute(top).result()), daemon=True)
    thread.start()
    thread.join(timeout=2.0)
    assert thread.is_alive(), "a step wanting top logprobs ran before its executable landed"
    held_back.set()
    thread.join(timeout=300)
    _same(results["got"], reference.execute(top).result())
    assert runner.background.wait(timeout=300)
    assert ready.complete and ready.buckets == runner.buckets and ready.limits == (32, 4)
    step = fresh_step(hs, [("full", rng.integers(3, config.vocab_size, size=32).tolist(), list(range(1, 9)),
                            SamplingParams(temperature=0.0), 0)])
    _same(runner.execute(step).result(), reference.execute(step).result())
    assert runner.num_compiles() == planned_num_compiles(32, 4) and runner.num_compiles_since_warmup == 0


@pytest.mark.parametrize("num_speculative_tokens, rows", [(0, 8), (4, 32), (15, 32)])
def test_background_order_covers_every_executable_once(tiny_model, num_speculative_tokens, rows):
    """The first set is the (1, 1) decode and the smallest prefill bucket (not the single-sequence verify bucket of
    speculative decoding) with the greedy and general samplers at their row count; the background order holds every
    other executable once, the forwards smallest first, each sampler / bitmask / prompt-logprobs job after a forward
    it takes its inputs from."""
    from paged_jax.worker.background_compile import background_jobs, first_jobs

    model, config = tiny_model
    runner = ModelRunner(model, config, num_blocks=40, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                         max_num_seqs=32, max_num_batched_tokens=512, num_host_blocks=8, eos_token_ids=[2],
                         num_speculative_tokens=num_speculative_tokens)
    assert num_speculative_tokens == 0 or (1 + num_speculative_tokens, 1) in runner.buckets  # (16, 1) for k = 15
    first = first_jobs(runner)
    assert [job.label for job in first] == ["forward[1, 1]", "forward[16, 8]", f"sampler[{rows},greedy,0]",
                                            f"sampler[{rows},full,0,bias]"]
    rest = background_jobs(runner, first)
    everything = warm_up_lib.all_jobs(runner)
    assert len(first) + len(rest) == len(everything) and set(first) | set(rest) == set(everything)
    forwards = [job.shape for job in rest if job.kind == "forward"]
    assert forwards == sorted(forwards)
    seen = [job.shape for job in first if job.kind == "forward"]
    for job in rest:
        if job.kind == "forward":
            seen.append(job.shape)
        elif job.kind in ("sampler", "bitmask"):
            assert any(runner.layout(*bucket).num_sample_rows == job.shape[0] for bucket in seen), job.label
        elif job.kind == "prompt_logprobs":
            assert any(bucket[0] == job.shape[0] for bucket in seen), job.label


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_random_hf_checkpoint(tiny_config("llama", vocab_size=128, bos_token_id=0, eos_token_id=1),
                                     tmp_path_factory.mktemp("tiny") / "ckpt", seed=2)


def _engine(checkpoint, background: bool) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(checkpoint), max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64,
                                num_gpu_blocks_override=64, background_compilation=background), use_tqdm=False)


def _generate(engine: LLMEngine, prompts, params) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"q{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.outputs[0].token_ids)
    return tokens


def test_engine_serves_within_the_ready_limits_before_the_rest_lands(checkpoint, held_back):
    """An engine whose background compiles are held back schedules steps of at most the first prefill bucket
    (16 tokens, 8 sequences), chunking the prompts, and generates what an engine compiled before serving does;
    released, its scheduler's limits grow to the configured maxima, nothing compiled on the step path."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, 128, size=n).tolist() for n in (30, 7, 21, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = _generate(_engine(checkpoint, background=False), prompts, params)
    engine = _engine(checkpoint, background=True)
    core = engine.engine_core
    assert core.scheduler.ready_limits == (16, 8) and not core.runner.ready.complete
    step_tokens = []
    schedule = core.scheduler.schedule

    def recorded():
        out = schedule()
        step_tokens.append(out.total_num_scheduled_tokens)
        return out

    core.scheduler.schedule = recorded
    assert _generate(engine, prompts, params) == want
    assert max(step_tokens) == 16
    held_back.set()
    assert core.runner.background.wait(timeout=300)
    assert core.scheduler.ready_limits == (64, 8) and core.runner.ready.complete
    assert core.runner.num_compiles_since_warmup == 0 and engine.engine_core.stats()["num_compiles_since_warmup"] == 0
    engine.close()


def test_closing_the_engine_while_executables_compile_does_not_wait_for_them(checkpoint, held_back):
    """close() with background compiles held back returns at once; the compile thread ends once released."""
    engine = _engine(checkpoint, background=True)
    background = engine.engine_core.runner.background
    closer = threading.Thread(target=engine.close, daemon=True)
    closer.start()
    closer.join(timeout=30)
    assert not closer.is_alive() and not background.done.is_set()
    held_back.set()
    assert background.wait(timeout=300) and not engine.engine_core.runner.ready.complete
