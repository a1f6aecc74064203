"""Start-up compilation of the model runner's executables (``ModelRunner.warm_up``): every forward bucket, every
(sampler row count, sampler variant) and grammar bitmask, the prompt logprobs of every token bucket and every
swap-copy size, compiled once, none of them afterwards.

Two phases:

1. Compile or load, on ``PAGED_JAX_COMPILE_THREADS`` threads: each executable is loaded from the executable cache
   (``paged_jax.worker.executable_cache``: a warm start neither traces nor lowers) or traced, lowered and compiled ahead of
   time (``jitted.lower(...).compile()``, then saved there) from abstract inputs (``jax.ShapeDtypeStruct`` with the
   very shardings the real inputs have), and put into its ``AheadOfTimeFunction``'s table, which the runner's calls
   use. XLA compiles release the GIL, so they overlap; tracing and lowering (Python) run one job at a time,
   in submission order (``_LoweringTurns``: the largest forwards first). This runs
   before the KV pool is allocated (the runner allocates it on first use), so XLA's autotuning scratch memory in N
   concurrent GPU compiles does not compete with the pool. An input that is an output of another executable (the
   sampler's logits, the prompt logprobs' hidden states, the swap-in data) takes its shape and sharding from that
   executable once it is compiled.
2. Run: every executable is called once on padding-only inputs, in order (each call finds its executable in the
   table: nothing compiles). Padding tokens only ever write into the null block, so the pool stays clean.

The pipeline-parallel runner's forward runs stage by stage (no single jitted function to lower): it warms up with
phase 2 only, which compiles through jit on each first call.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import logging
import os
import queue
import threading
import time

import jax
import numpy as np

from paged_jax.worker import sampler as sampler_lib
from paged_jax.worker.executable_cache import AheadOfTimeFunction, ExecutableCache, load_or_compile

logger = logging.getLogger(__name__)

COMPILE_THREADS_ENV = "PAGED_JAX_COMPILE_THREADS"
# More threads than this stop paying: tracing and lowering share one GIL, and each XLA compile is multi-threaded too.
MAX_DEFAULT_COMPILE_THREADS = 16
# Compile jobs that ended last, named in warm_up's debug log line (the critical path of a cold start).
LAST_COMPILES_LOGGED = 6


def compile_threads() -> int:
    """Threads that compile at warm-up: ``$PAGED_JAX_COMPILE_THREADS``, else ``os.cpu_count()`` capped at
    ``MAX_DEFAULT_COMPILE_THREADS``. 1 compiles one executable after another. Raises ValueError naming the
    variable for anything but a positive integer."""
    value = os.environ.get(COMPILE_THREADS_ENV, "").strip()
    if not value:
        return max(1, min(os.cpu_count() or 1, MAX_DEFAULT_COMPILE_THREADS))
    try:
        threads = int(value)
    except ValueError:
        threads = 0
    if threads < 1:
        raise ValueError(f"{COMPILE_THREADS_ENV}={value!r}: expected a positive integer (1 = sequential compiles)")
    return threads


def num_warm_up_executables(runner) -> int:
    """Steps of ``warm_up``'s progress bar: the executables it compiles, a swap size's gather and scatter as one,
    the LoRA slot write not counted."""
    if runner.pools:  # a pooling runner's step is its forward alone
        return len(runner.buckets) + len(_swap_sizes(runner))
    return (len(runner.buckets) + len(runner.sampler_seq_buckets) * (len(runner.sampler_variants) + 1)
            + len({t for t, _ in runner.buckets}) + len(_swap_sizes(runner)))


def warm_up(runner, use_tqdm: bool = True, threads: int | None = None) -> dict[str, float]:
    """Compile (or load) every executable of ``runner`` (a ``ModelRunner``) on ``threads`` threads (default
    ``compile_threads()``), then run each once. Returns seconds per phase: ``compile_s`` (phase 1, the executable
    cache's fingerprint included), ``kv_pool_s`` (allocating the KV pool), ``run_s`` (the run phase; for the
    pipeline-parallel runner it holds the compiles); ``threads`` (used; 1 for the pipeline-parallel runner) and
    ``executables_loaded`` (from the executable cache); ``compile_jobs``: every compile or load job as ``[label,
    start s, seconds, lowering s]`` (lowering: tracing and lowering, Python under the GIL; 0 for a load), by end time
    (the last ones are a cold start's critical path; a logged debug line names them)."""
    from tqdm.auto import tqdm

    threads = compile_threads() if threads is None else threads
    ahead_of_time = isinstance(runner._forward, AheadOfTimeFunction)
    bar = tqdm(total=num_warm_up_executables(runner), desc="Compiling step executables", disable=not use_tqdm,
               leave=False)
    timings = {"threads": threads if ahead_of_time else 1, "compile_s": 0.0, "executables_loaded": 0}
    start = time.perf_counter()
    if ahead_of_time:
        cache = ExecutableCache.for_runner(runner)
        spans = _compile_concurrently(runner, threads, bar, cache)
        timings["compile_s"] = time.perf_counter() - start
        timings["compile_jobs"] = sorted(spans, key=lambda span: span[1] + span[2])
        logger.debug("compile jobs that ended last ([label, start s, seconds, lowering s]): %s",
                     timings["compile_jobs"][-LAST_COMPILES_LOGGED:])
        timings["executables_loaded"] = cache.hits if cache else 0
        logger.info("%d executables ready on %d threads in %.1f s (%d loaded from %s)", bar.n, threads,
                    timings["compile_s"], timings["executables_loaded"], cache and cache.directory)
    start = time.perf_counter()
    jax.block_until_ready(runner.kv_pool)  # allocated here, after the compiles (its first use)
    timings["kv_pool_s"] = time.perf_counter() - start
    start = time.perf_counter()
    _run_every_executable(runner, bar if not ahead_of_time else None)
    timings["run_s"] = time.perf_counter() - start
    bar.close()
    return timings


# ----------------------------------------------------------------------------------------------------------------
# Inputs, shared by both phases: host arrays the run phase puts on the device and the compile phase describes
# ----------------------------------------------------------------------------------------------------------------

def _swap_sizes(runner) -> list[int]:
    return runner._swap_sizes() if runner.num_host_blocks else []


def _padding_step_buffer(runner, num_tokens: int, num_seqs: int) -> np.ndarray:
    """int32[layout size]: a step of padding only (no previous-step feed, every sampler row greedy)."""
    layout = runner.layout(num_tokens, num_seqs)
    buf = np.zeros((layout.size,), np.int32)
    a, b = layout.fields["prev_rows"]
    buf[a:b] = -1
    tensors, _ = sampler_lib.build_sampling_tensors([], layout.num_sample_rows, eos_token_ids=runner.eos_token_ids)
    a, b = layout.fields["sampling"]
    sampler_lib.pack_sampling_tensors(tensors, buf[a:b])
    return buf


def _grammar_bitmask(runner, num_rows: int) -> np.ndarray:
    return np.full((num_rows, sampler_lib.allowed_mask_words(runner.vocab_size)), -1, np.int32)


def _penalty_history(runner, num_rows: int) -> np.ndarray:
    return np.full((num_rows, runner.max_model_len), -1, np.int32)


def _bias_table(runner, num_rows: int) -> np.ndarray:
    return np.full((num_rows, sampler_lib.bias_table_width(runner.vocab_size)), -1, np.int32)


# ----------------------------------------------------------------------------------------------------------------
# Phase 1: concurrent ahead-of-time compiles (or executable cache loads)
# ----------------------------------------------------------------------------------------------------------------

def _abstract(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def _compiled_outputs(compiled) -> list[jax.ShapeDtypeStruct]:
    """The outputs of a ``Compiled`` as abstract values with the shardings its results will have."""
    infos = jax.tree.leaves(compiled.out_info)
    return [jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sharding)
            for info, sharding in zip(infos, jax.tree.leaves(compiled.output_shardings))]


class _LoweringTurns:
    """Tracing and lowering run one job at a time, the job submitted first (lowest ``priority``) first.

    Both are Python under the GIL: N jobs lowering at once each take about N times as long and end together, so the
    first XLA compile (which releases the GIL) starts only when nearly all lowering is done. In turns, the largest
    forwards (submitted first) reach XLA after their own lowering and their compiles overlap the lowering of the
    rest. A cold start stays bound by the CPU work of XLA's compiles (benchmarks/RESULTS.md, "Start-up to first
    token"): the forwards end earlier, and the sampler compiles of the smallest buckets, lowered last, end it."""

    def __init__(self):
        self._changed = threading.Condition()
        self._waiting: list[int] = []  # a heap of the waiting jobs' priorities
        self._busy = False

    def turn(self, priority: int) -> "_LoweringTurn":
        """A reusable context manager holding the turn for job ``priority`` (unique per job)."""
        return _LoweringTurn(self, priority)

    def _acquire(self, priority: int) -> None:
        with self._changed:
            heapq.heappush(self._waiting, priority)
            self._changed.wait_for(lambda: not self._busy and self._waiting[0] == priority)
            heapq.heappop(self._waiting)
            self._busy = True

    def _release(self) -> None:
        with self._changed:
            self._busy = False
            self._changed.notify_all()


class _LoweringTurn:
    def __init__(self, turns: _LoweringTurns, priority: int):
        self._turns, self._priority = turns, priority

    def __enter__(self):
        self._turns._acquire(self._priority)

    def __exit__(self, *exc):
        self._turns._release()


class _CompileJobs:
    """The compile (or load) job of each executable of ``runner``, from abstract inputs with the avals and shardings
    the run phase's inputs have. Each job is ``fn(..., seconds, turn)`` for ``load_or_compile`` (``seconds``: where
    it records its lowering time; ``turn``: the lowering turn it traces and lowers in) and returns the ``Compiled``.
    A job that takes a forward's outputs gets that forward's ended future first."""

    def __init__(self, runner, cache: ExecutableCache | None):
        self.runner, self.cache = runner, cache
        self._host_input = runner.input_sharding()
        self.params = [_abstract(x) for x in runner._param_leaves]
        self.kv_pool = runner.abstract_kv_pool()
        self.prev_tokens = _abstract(runner._prev_tokens)
        self.lora = runner.lora_slots and jax.tree.map(_abstract, runner.lora_slots.arrays)

    def _host(self, x: np.ndarray) -> jax.ShapeDtypeStruct:
        """A host array as the run phase puts it on the device (the runner's input sharding)."""
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._host_input)

    def compile_forward(self, num_tokens, num_seqs, seconds, turn):
        """The forward of bucket ``(num_tokens, num_seqs)`` on a padding-only step buffer."""
        buf = self._host(_padding_step_buffer(self.runner, num_tokens, num_seqs))
        return load_or_compile(self.cache, self.runner._forward, (self.params, self.kv_pool, buf, self.prev_tokens,
                                                                   self.lora),
                               {"num_tokens": num_tokens, "num_seqs": num_seqs}, seconds, turn)

    def compile_bitmask(self, forward, num_rows, seconds, turn):
        """The grammar bitmask of ``num_rows`` sampler rows, on the logits of ``forward`` (an ended future)."""
        logits, _, _ = _forward_outputs(forward, self.runner)
        return load_or_compile(self.cache, self.runner._apply_grammar_bitmask,
                               (logits, self._host(_grammar_bitmask(self.runner, num_rows))), None, seconds, turn)

    def compile_sampler(self, forward, num_rows, variant, seconds, turn):
        """The sampler of ``num_rows`` rows and ``variant``, on the logits and sampling words of ``forward``."""
        logits, sampling_words, _ = _forward_outputs(forward, self.runner)
        empty = _abstract(self.runner._no_history[num_rows])
        history = self._host(_penalty_history(self.runner, num_rows)) if variant.penalties else empty
        bias_table = self._host(_bias_table(self.runner, num_rows)) if variant.bias_table else empty
        return load_or_compile(self.cache, self.runner._sample, (logits, sampling_words, history, bias_table),
                               {"mode": variant.mode, "num_logprobs": variant.num_logprobs}, seconds, turn)

    def compile_prompt_logprobs(self, forward, num_tokens, seconds, turn):
        """The prompt logprobs of ``num_tokens`` tokens, on the hidden states of ``forward``."""
        _, _, hidden = _forward_outputs(forward, self.runner)
        targets = self._host(np.zeros((num_tokens,), np.int32))
        return load_or_compile(self.cache, self.runner._prompt_logprobs, (self.params, hidden, targets), None,
                               seconds, turn)

    def compile_swap(self, size, seconds, turn):
        """The gather and the scatter of ``size`` swapped blocks (the scatter takes the gather's output)."""
        ids = self._host(np.zeros((size,), np.int32))
        gathered = load_or_compile(self.cache, self.runner._gather_blocks, (self.kv_pool, ids), None, seconds, turn)
        data = _compiled_outputs(gathered)[0]
        return load_or_compile(self.cache, self.runner._scatter_blocks, (self.kv_pool, ids, data), None, seconds,
                               turn)


def _forward_outputs(future, runner) -> tuple:
    """A compiled forward's (ended ``future``'s) abstract outputs the other executables take: ``(logits, sampling
    words, hidden)``."""
    _, logits, sampling_words, hidden = _split_forward_outputs(_compiled_outputs(future.result()), runner)
    return logits, sampling_words, hidden


class _JobQueue:
    """Compile jobs on ``pool``: each timed (``spans``: ``[label, start s since ``started``, seconds, lowering s]``),
    lowering in turns in submission order (``_LoweringTurns``); a job that takes a forward's outputs is queued only
    once that forward has ended, so that no thread sits blocked on another job while compiles wait for a thread."""

    def __init__(self, pool: concurrent.futures.ThreadPoolExecutor, started: float):
        self._pool, self._started = pool, started
        self.spans: list[list] = []
        self._turns = _LoweringTurns()
        self._submitted = itertools.count()  # each job's lowering priority: its submission order
        self._finished: queue.SimpleQueue = queue.SimpleQueue()  # every job's future, as it ends
        # Set before the pool is shut down after a failure: shutting down cancels the queued forwards, which runs
        # their callbacks under the pool's lock, so a callback must not submit then (pool.submit would wait on that
        # lock).
        self._stopping = threading.Event()
        self._num_jobs = 0

    def _timed(self, label: str, fn, *args):
        """``fn(*args, seconds=, turn=)`` as a pool job that records its span."""
        turn = self._turns.turn(next(self._submitted))

        def job():
            begin = time.perf_counter()
            seconds: dict = {}  # load_or_compile's lowering time
            try:
                return fn(*args, seconds=seconds, turn=turn)
            finally:
                self.spans.append([label, round(begin - self._started, 4), round(time.perf_counter() - begin, 4),
                                   round(seconds.get("lower", 0.0), 4)])
        return job

    def _submit(self, label: str, fn, *args) -> concurrent.futures.Future:
        future = self._pool.submit(self._timed(label, fn, *args))
        future.add_done_callback(self._finished.put)
        return future

    def submit(self, label: str, fn, *args) -> concurrent.futures.Future:
        """Queue ``fn(*args, seconds, turn)`` now; its future."""
        self._num_jobs += 1
        return self._submit(label, fn, *args)

    def submit_after(self, dependency: concurrent.futures.Future, label: str, fn, *args) -> None:
        """Queue ``fn(dependency, *args, seconds, turn)`` once ``dependency`` (a forward whose outputs it takes) has
        ended."""
        self._num_jobs += 1

        def ready(done):
            if self._stopping.is_set() or done.cancelled():
                self._finished.put(None)
                return
            try:
                self._submit(label, fn, done, *args)
            except RuntimeError:  # the pool is shutting down after an earlier failure, which is re-raised
                self._finished.put(None)
        dependency.add_done_callback(ready)

    def wait(self, bar) -> None:
        """Wait for every job submitted (``bar`` advanced per job); the first failure is re-raised once the pool has
        dropped the queued jobs."""
        try:
            for _ in range(self._num_jobs):
                done = self._finished.get()
                if done is not None:
                    done.result()  # re-raises a failed compile
                    bar.update(1)
        except BaseException:
            self._stopping.set()
            self._pool.shutdown(wait=True, cancel_futures=True)  # the queued compiles are not wanted any more
            raise


def _sampler_label(num_rows: int, variant) -> str:
    return (f"sampler[{num_rows},{variant.mode},{variant.num_logprobs}"
            f"{',penalties' if variant.penalties else ''}{',bias' if variant.bias_table else ''}]")


def _compile_concurrently(runner, threads: int, bar, cache: ExecutableCache | None) -> list[list]:
    """Load (from ``cache``) or lower and compile every executable on ``threads`` threads, with the exact input
    avals and shardings of the run phase, into the runner's ``AheadOfTimeFunction`` tables. Returns each job's
    ``[label, start s, seconds, lowering s]``. A job that takes a forward's outputs is queued when that forward has
    ended. Jobs trace and lower in turns, in the order they were submitted (``_LoweringTurns``)."""
    started = time.perf_counter()
    jobs = _CompileJobs(runner, cache)
    with concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="paged-jax-compile") as pool:
        work = _JobQueue(pool, started)
        # The forwards first, largest first (the longest compiles start while threads are free); each row count's
        # / token count's smallest bucket is the one its sampler / prompt-logprobs compiles take outputs from.
        forwards = {bucket: work.submit(f"forward{list(bucket)}", jobs.compile_forward, *bucket)
                    for bucket in sorted(runner.buckets, reverse=True)}
        by_rows, by_tokens = {}, {}
        for num_tokens, num_seqs in runner.buckets:
            by_rows.setdefault(runner.layout(num_tokens, num_seqs).num_sample_rows, forwards[num_tokens, num_seqs])
            by_tokens.setdefault(num_tokens, forwards[num_tokens, num_seqs])
        for size in _swap_sizes(runner):
            work.submit(f"swap[{size}]", jobs.compile_swap, size)
        for num_rows in [] if runner.pools else runner.sampler_seq_buckets:
            work.submit_after(by_rows[num_rows], f"bitmask[{num_rows}]", jobs.compile_bitmask, num_rows)
            for variant in runner.sampler_variants:
                work.submit_after(by_rows[num_rows], _sampler_label(num_rows, variant), jobs.compile_sampler,
                                  num_rows, variant)
        for t in [] if runner.pools else sorted(by_tokens):
            work.submit_after(by_tokens[t], f"prompt_logprobs[{t}]", jobs.compile_prompt_logprobs, t)
        work.wait(bar)
    return work.spans


def _split_forward_outputs(outputs: list, runner) -> tuple[list, object, object, object]:
    """The forward's flat outputs -> (kv pool leaves, logits, sampling words, hidden); the arrays of the runner's
    ``moe_outputs`` that follow them are dropped."""
    outputs = outputs[:len(outputs) - runner.moe_outputs.num_arrays]
    return outputs[:-3], outputs[-3], outputs[-2], outputs[-1]


# ----------------------------------------------------------------------------------------------------------------
# Phase 2: run every executable once
# ----------------------------------------------------------------------------------------------------------------

def _run_every_executable(runner, bar) -> None:
    """Call each executable on padding-only inputs (compiling it unless phase 1 did: the pipeline-parallel
    runner); ``bar`` (or None) counts them."""
    device = runner.device

    def done():
        if bar is not None:
            bar.update(1)

    logits_by_rows, hidden_by_tokens = {}, {}
    for num_tokens, num_seqs in runner.buckets:
        buf = _padding_step_buffer(runner, num_tokens, num_seqs)
        runner.kv_pool, logits, sampling_words, hidden, *_ = runner._forward(
            runner._param_leaves, runner.kv_pool, jax.device_put(buf, device), runner._prev_tokens,
            runner.lora_slots and runner.lora_slots.arrays, num_tokens=num_tokens, num_seqs=num_seqs)
        logits_by_rows.setdefault(runner.layout(num_tokens, num_seqs).num_sample_rows, (logits, sampling_words))
        hidden_by_tokens.setdefault(num_tokens, hidden)
        done()
    outs = None
    for num_rows in [] if runner.pools else runner.sampler_seq_buckets:  # pooling: no sampler, no prompt logprobs
        logits, sampling_words = logits_by_rows[num_rows]
        outs = runner._apply_grammar_bitmask(logits, jax.device_put(_grammar_bitmask(runner, num_rows), device))
        done()
        history = jax.device_put(_penalty_history(runner, num_rows), device)
        bias_table = jax.device_put(_bias_table(runner, num_rows), device)
        for variant in runner.sampler_variants:
            outs = runner._sample(logits, sampling_words,
                                  history if variant.penalties else runner._no_history[num_rows],
                                  bias_table if variant.bias_table else runner._no_history[num_rows],
                                  mode=variant.mode, num_logprobs=variant.num_logprobs)
            done()
    for num_tokens in [] if runner.pools else sorted(hidden_by_tokens):
        targets = jax.device_put(np.zeros((num_tokens,), np.int32), device)
        outs = (outs, runner._prompt_logprobs(runner._param_leaves, hidden_by_tokens[num_tokens], targets))
        done()
    for size in _swap_sizes(runner):
        ids = jax.device_put(np.zeros((size,), np.int32), device)
        runner.kv_pool = runner._scatter_blocks(runner.kv_pool, ids, runner._gather_blocks(runner.kv_pool, ids))
        done()
    if runner.lora_slots is not None:
        runner.lora_slots.write(0, None)  # compiles the slot write (slot 0, no adapter, stays zeros)
    jax.block_until_ready((runner.kv_pool, outs))
