"""Warm-up (paged_jax/worker/warm_up.py) and the executable cache (paged_jax/worker/executable_cache.py) on the tiny random model
of tests/test_model_runner.py: concurrent compiles (each executable once, in lowering turns), a failed compile,
and a second runner loading what the first compiled."""

import collections
import os
import types
import unittest.mock

import jax
import numpy as np
import pytest

from models import moe
from models.moe import route_top_k
from paged_jax.core.hand_steps import HandScheduler
from paged_jax.worker import warm_up as warm_up_lib
from paged_jax.worker.model_runner import ModelRunner
from paged_jax.sampling_params import SamplingParams
from tests.test_model_runner import BLOCK_SIZE, MAX_MODEL_LEN, fresh_step, make_runner
from tests.test_model_runner import tiny_model  # noqa: F401 (a fixture)


def test_concurrent_warm_up_compiles_each_executable_once(tiny_model, monkeypatch):
    """Warm-up on 2 threads: each executable is compiled (or loaded from the persistent cache) exactly once, the run
    phase reusing the ahead-of-time compiles; afterwards steps of every bucket (swaps included) compile nothing and
    sample what the sequentially warmed runner samples."""
    from jax import monitoring

    from paged_jax.worker.buckets import planned_num_compiles
    from paged_jax.worker.warm_up import COMPILE_THREADS_ENV, compile_threads, num_warm_up_executables

    model, config = tiny_model
    monkeypatch.setenv(COMPILE_THREADS_ENV, "0")
    with pytest.raises(ValueError, match=COMPILE_THREADS_ENV):
        compile_threads()
    monkeypatch.setenv(COMPILE_THREADS_ENV, "2")
    assert compile_threads() == 2
    requests = []
    monitoring.register_event_listener(
        lambda name, **_: requests.append(name) if name == "/jax/compilation_cache/compile_requests_use_cache" else 0)
    runner = ModelRunner(model, config, num_blocks=20, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                         max_num_seqs=4, max_num_batched_tokens=32, num_host_blocks=4, eos_token_ids=[2])
    requests.clear()
    runner.warm_up(use_tqdm=False)  # threads from the environment
    num_executables = planned_num_compiles(32, 4, swap=True, num_blocks=20)
    assert runner.warm_up_timings["threads"] == 2 and runner.num_compiles() == num_executables
    jobs = runner.warm_up_timings["compile_jobs"]  # [label, start s, seconds, lowering s], by end time
    assert len(jobs) == num_warm_up_executables(runner)
    assert all(start >= 0 and took >= lowering >= 0 for _, start, took, lowering in jobs)
    # A compiled job traced and lowered first; a job loaded from the executable cache (an earlier run's) did not.
    loaded = runner.warm_up_timings["executables_loaded"]
    assert sum(lowering > 0 for *_, lowering in jobs) >= len(jobs) - loaded
    assert [a[1] + a[2] for a in jobs] == sorted(a[1] + a[2] for a in jobs)
    labels = collections.Counter(label.split("[")[0] for label, *_ in jobs)
    assert labels["forward"] == len(runner.buckets) and set(labels) == {"forward", "bitmask", "sampler",
                                                                        "prompt_logprobs", "swap"}
    # One XLA compile (or cache load) per executable; two more are the pool's zeros (one per distinct shape/dtype).
    assert len(requests) <= num_executables + 2
    sequential = make_runner(model, config, num_blocks=20, num_host_blocks=4, threads=1)
    rng = np.random.default_rng(4)
    params = SamplingParams(temperature=0.8, seed=5, logprobs=1)
    hs = HandScheduler()  # both runners get the same steps (the same diffs of their batches)
    for num_tokens, num_seqs in runner.buckets:  # one step filling each bucket
        lens = [1] * num_seqs
        lens[-1] += num_tokens - num_seqs
        step = fresh_step(hs, [(f"b{num_tokens}.{i}", rng.integers(3, config.vocab_size, size=n).tolist(),
                                [1 + 4 * i + j for j in range(4)], params, i) for i, n in enumerate(lens)])
        assert step.total_num_scheduled_tokens == num_tokens and step.num_rows == num_seqs
        got, want = runner.execute(step).result(), sequential.execute(step).result()
        np.testing.assert_array_equal(got.sampled_token_ids, want.sampled_token_ids)
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-6, atol=1e-6)
    assert runner.execute(hs.step({}, swap_out=[(1, 0), (2, 1)])) is None  # the swap copies each way
    assert runner.execute(hs.step({}, swap_out=[(3, 2)], swap_in=[(0, 3)])) is None
    assert runner.num_compiles_since_warmup == 0


def test_warm_up_reraises_a_failed_compile(tiny_model, monkeypatch):
    """A forward that fails to compile fails warm-up with its error, with no hang: on one thread the failing forward
    is the first (largest) one and the smaller forwards, on which the sampler compiles wait, are still queued when
    the pool is shut down (cancelling them runs their callbacks, which must not queue anything then)."""
    import threading

    model, config = tiny_model
    compile_ = warm_up_lib.load_or_compile

    def failing(cache, fn, args, static=None, seconds=None, lowering_turn=None, compile_slots=None):
        if fn is runner._forward and (static["num_tokens"], static["num_seqs"]) == max(runner.buckets):
            with lowering_turn:  # a failure inside the turn must hand it on
                raise RuntimeError("compile failed on purpose")
        return compile_(cache, fn, args, static, seconds, lowering_turn, compile_slots)

    monkeypatch.setattr(warm_up_lib, "load_or_compile", failing)
    runner = ModelRunner(model, config, num_blocks=20, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                         max_num_seqs=4, max_num_batched_tokens=32, eos_token_ids=[2])
    assert len(runner.buckets) > 1
    errors = []

    def run():
        try:
            runner.warm_up(use_tqdm=False, threads=1)
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=300)
    assert not thread.is_alive() and len(errors) == 1 and "on purpose" in str(errors[0])


def test_lowering_turns_run_one_job_at_a_time_lowest_priority_first():
    """warm_up's lowering turns: while one job holds the turn, the waiting jobs get it one at a time in priority
    order (not in the order they started waiting), and a job that raises inside its turn hands it on."""
    import threading
    import time

    from paged_jax.worker.compile_queue import LoweringTurns as _LoweringTurns

    turns = _LoweringTurns()
    order, inside = [], []
    holder = turns.turn(0)
    holder.__enter__()

    def job(priority):
        turn = turns.turn(priority)
        try:
            with turn:
                inside.append(priority)
                assert len(inside) == 1  # nobody else holds the turn
                order.append(priority)
                time.sleep(0.01)
                inside.remove(priority)
                if priority == 3:
                    raise RuntimeError("lowering failed")
        except RuntimeError:
            pass

    threads = [threading.Thread(target=job, args=(p,), daemon=True) for p in (5, 2, 4, 1, 3)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while len(turns._waiting) < len(threads) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert sorted(turns._waiting) == [1, 2, 3, 4, 5]
    holder.__exit__(None, None, None)
    for thread in threads:
        thread.join(timeout=30)
    assert order == [1, 2, 3, 4, 5] and not turns._busy and not turns._waiting


def test_second_runner_loads_its_executables_from_the_executable_cache(tiny_model, tmp_path):
    """paged_jax.worker.executable_cache: a runner's fresh compiles are saved; a second runner of the same configuration
    loads every executable (nothing traced: jit's own caches stay empty), samples what the first samples and compiles
    nothing after warm-up; an unreadable file is compiled again; another configuration has another fingerprint."""
    from jax.experimental.compilation_cache import compilation_cache

    from paged_jax.worker.executable_cache import runner_fingerprint

    model, config = tiny_model
    previous_dir = jax.config.jax_compilation_cache_dir
    compilation_cache.reset_cache()  # JAX's cache empty too: the first runner compiles fresh (only those are saved)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    try:
        small = dict(num_blocks=12, max_num_seqs=2, max_num_batched_tokens=8, threads=2)
        first = make_runner(model, config, **small)
        assert first.warm_up_timings["executables_loaded"] == 0
        second = make_runner(model, config, **small)
        num_executables = second.num_compiles()
        assert second.warm_up_timings["executables_loaded"] == num_executables > 0
        assert second._forward.jitted._cache_size() == 0 and second._sample.jitted._cache_size() == 0
        step = fresh_step(HandScheduler(), [(f"s{i}", [3 + i, 7, 9], [1 + i],
                                             SamplingParams(temperature=0.7, seed=i, logprobs=2), i) for i in range(2)])
        got, want = second.execute(step).result(), first.execute(step).result()
        np.testing.assert_array_equal(got.sampled_token_ids, want.sampled_token_ids)
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-6, atol=1e-6)
        assert second.num_compiles_since_warmup == 0

        cache_dir = tmp_path / "paged_jax_executables" / runner_fingerprint(second)
        next(cache_dir.glob("forward-*.bin")).write_bytes(b"not an executable")
        third = make_runner(model, config, **small)
        assert third.warm_up_timings["executables_loaded"] == num_executables - 1
        assert third.num_compiles() == num_executables
        other = ModelRunner(model, config, num_blocks=12, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                            max_num_seqs=2, max_num_batched_tokens=8, eos_token_ids=[2], max_logprobs=3)
        assert runner_fingerprint(other) != runner_fingerprint(second)
        # Another GPU plugin (versioned apart from jaxlib) is another fingerprint.
        from importlib import metadata

        from paged_jax.worker import executable_cache

        plugin = types.SimpleNamespace(metadata={"Name": "jax_cuda13_plugin"}, version="0.0.1")
        with unittest.mock.patch.object(metadata, "distributions", lambda: [plugin]):
            assert executable_cache._versions()["jax-cuda13-plugin"] == "0.0.1"
            assert runner_fingerprint(second) != cache_dir.name
        # The MoE decode kernels' switch, or their registration, changes the traced step: another fingerprint.
        switched = "1" if os.environ.get("PAGED_JAX_MOE_DECODE_KERNELS", "1") == "0" else "0"
        with unittest.mock.patch.dict(os.environ, {"PAGED_JAX_MOE_DECODE_KERNELS": switched}):
            assert runner_fingerprint(second) != cache_dir.name
        with unittest.mock.patch.dict(moe._ROUTERS, {"pallas": route_top_k}):
            assert runner_fingerprint(second) != cache_dir.name
    finally:
        compilation_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", previous_dir)


def test_executable_cache_makes_the_mosaic_gpu_runtime_findable_first(tmp_path, monkeypatch):
    """On a GPU, the runner's executable cache imports jax's Mosaic GPU module before warm-up loads anything (it
    tells the custom call where its runtime library is; without it a cached executable holding a Mosaic kernel fails
    to link and the cache misses); elsewhere it does not."""
    from paged_jax.worker import executable_cache

    calls = []
    monkeypatch.setattr(executable_cache, "_load_mosaic_gpu_runtime", lambda: calls.append("runtime"))
    monkeypatch.setattr(executable_cache, "runner_fingerprint", lambda runner: "fingerprint")
    previous_dir = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    try:
        for backend, expect in (("gpu", ["runtime"]), ("cpu", [])):
            calls.clear()
            monkeypatch.setattr(executable_cache.jax, "default_backend", lambda backend=backend: backend)
            cache = executable_cache.ExecutableCache.for_runner(object())
            assert cache is not None and cache.fingerprint == "fingerprint"
            assert calls == expect
    finally:
        jax.config.update("jax_compilation_cache_dir", previous_dir)


def test_a_runner_counts_only_its_own_compiles(tiny_model):
    """jit's executable cache is shared by every ``jax.jit`` of one function object: a runner's step functions are
    its own, so another runner's calls (here a block gather of a new size) leave its compile count as it was."""
    model, config = tiny_model
    first = ModelRunner(model, config, num_blocks=20, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                        max_num_seqs=4, max_num_batched_tokens=32, num_host_blocks=4, eos_token_ids=[2])
    second = ModelRunner(model, config, num_blocks=20, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                         max_num_seqs=4, max_num_batched_tokens=32, num_host_blocks=4, eos_token_ids=[2])
    before = second.num_compiles()
    for fn in first.step_functions()[-2:]:  # the block gather and scatter
        assert fn.jitted is not second.step_functions()[-1].jitted
    jax.block_until_ready(first._gather_blocks(first.kv_pool, np.arange(3, dtype=np.int32)))  # a block per output
    assert first.num_compiles() >= 1 and second.num_compiles() == before


def test_warm_up_allocates_the_kv_pool_before_any_compile(tiny_model, monkeypatch):
    """The pool's arrays are allocated before the compiles, whose autotuning buffers could otherwise split the
    memory they need; warm-up still times the allocation (``kv_pool_s``)."""
    model, config = tiny_model
    runner = ModelRunner(model, config, num_blocks=20, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                         max_num_seqs=4, max_num_batched_tokens=32, eos_token_ids=[2])
    pool_at_compile = []
    compile_jobs = warm_up_lib.Compiler.compile

    def compile_and_record(self, jobs, **kwargs):
        pool_at_compile.append(runner.kv_pool_allocated)
        return compile_jobs(self, jobs, **kwargs)

    monkeypatch.setattr(warm_up_lib.Compiler, "compile", compile_and_record)
    runner.warm_up(use_tqdm=False)
    assert pool_at_compile and all(pool_at_compile) and runner.warm_up_timings["kv_pool_s"] >= 0


def test_compile_slots_halve_after_an_out_of_memory_compile_and_run_it_again():
    """XLA's autotuning can run out of device memory when many compiles run at once: ``CompileSlots`` then halves how
    many run at once and runs the failed compile again, so every compile lands; an out-of-memory error of a compile
    that ran alone, and any other error, is raised."""
    import threading
    import time

    from paged_jax.worker.compile_queue import CompileSlots

    slots, lock, running, peak = CompileSlots(8), threading.Lock(), [0], []

    def compile_fits_two_at_once(index):
        def compile_():
            with lock:
                running[0] += 1
                peak.append(running[0])
                too_many = running[0] > 2
            try:
                time.sleep(0.02)
                if too_many:
                    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
                return index
            finally:
                with lock:
                    running[0] -= 1
        return compile_

    results = [None] * 8
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, slots.run(compile_fits_two_at_once(i))))
               for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == list(range(8)) and max(peak) > 2 and slots.limit <= 2

    def out_of_memory():
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory")

    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        CompileSlots(4).run(out_of_memory)
    with pytest.raises(ValueError, match="other"):
        CompileSlots(4).run(lambda: (_ for _ in ()).throw(ValueError("other")))


def test_background_compiles_beside_steps_are_bounded_by_the_free_memory():
    """While the engine serves, a compile's autotuning out-of-memory could fail a step instead: background compiles
    run at most as many at once as the free bytes hold of one compile's scratch, less one share for the steps, never
    fewer than the shares the KV sizing kept (COMPILE_SCRATCH_SLOTS); the CPU keeps every thread."""
    from models.presets import preset_config
    from paged_jax.worker.compile_queue import CompileSlots
    from paged_jax.worker.kv_pool_sizing import COMPILE_SCRATCH_SLOTS, autotune_scratch_bytes
    from tests.test_device_memory import GIB, FakeGpu

    config = preset_config("gemma-3-12b")
    runner = types.SimpleNamespace(model_config=config, dtype=jax.numpy.bfloat16, sampler_seq_buckets=[8, 256],
                                   max_num_batched_tokens=2048)
    scratch = autotune_scratch_bytes(config, "bfloat16", logits_rows=256, max_num_batched_tokens=2048)
    beside = warm_up_lib.compiles_beside_steps
    assert beside(runner, 16, FakeGpu(70 * GIB, 70 * GIB - 6 * scratch)) == 5
    assert beside(runner, 4, FakeGpu(70 * GIB, 70 * GIB - 6 * scratch)) == 4
    assert beside(runner, 16, FakeGpu(70 * GIB, 70 * GIB - scratch)) == COMPILE_SCRATCH_SLOTS
    assert beside(runner, 16, jax.devices("cpu")[0]) == 16
    slots = CompileSlots(16)
    slots.cap(5)
    slots.cap(9)
    assert slots.limit == 5
