"""Start-up compilation of the model runner's executables (``ModelRunner.warm_up``): every forward bucket, every
(sampler row count, sampler variant) and grammar bitmask, the prompt logprobs of every token bucket and every
swap-copy size (``all_jobs``), compiled once, none of them afterwards.

Two phases:

1. Compile or load (``Compiler``), on ``PAGED_JAX_COMPILE_THREADS`` threads: each executable is loaded from the
   executable cache (``paged_jax.worker.executable_cache``: a warm start neither traces nor lowers) or traced,
   lowered and compiled ahead of time (``jitted.lower(...).compile()``, then saved there) from abstract inputs
   (``jax.ShapeDtypeStruct`` with the very shardings the real inputs have), and put into its
   ``AheadOfTimeFunction``'s table, which the runner's calls use. XLA compiles release the GIL, so they overlap;
   tracing and lowering (Python) run one job at a time, in priority order (``compile_queue.LoweringTurns``: the
   largest forwards first). This runs before the KV pool is allocated (the runner allocates it on first use), so
   XLA's autotuning scratch memory in N concurrent GPU compiles does not compete with the pool. An input that is an
   output of another executable (the sampler's logits, the prompt logprobs' hidden states, the swap-in data) takes
   its shape and sharding from that executable once it is compiled.
2. Run (``run_jobs``): every executable is called once on padding-only inputs, in order (each call finds its
   executable in the table: nothing compiles). Padding tokens only ever write into the null block, so the pool
   stays clean.

``paged_jax.worker.background_compile`` runs both phases for a first set of executables only and compiles the rest
on a background thread while the engine serves. The pipeline-parallel runner's forward runs stage by stage (no
single jitted function to lower): it warms up with phase 2 only, which compiles through jit on each first call.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time

import jax
import numpy as np

from paged_jax.worker import sampler as sampler_lib
from paged_jax.worker.compile_queue import CompileSlots, JobQueue
from paged_jax.worker.device_memory import free_bytes, pool_allocation_error
from paged_jax.worker.executable_cache import AheadOfTimeFunction, ExecutableCache, load_or_compile
from paged_jax.worker.kv_pool_sizing import COMPILE_SCRATCH_SLOTS, autotune_scratch_bytes

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


@dataclasses.dataclass(frozen=True)
class CompileJob:
    """One compile (or load) job: ``kind`` "forward" (``shape`` (num_tokens, num_seqs)), "sampler" ((num_rows,
    SamplerVariant)), "bitmask" ((num_rows,)), "prompt_logprobs" ((num_tokens,)) or "swap" ((num_blocks,): its
    gather and its scatter)."""

    kind: str
    shape: tuple

    @property
    def label(self) -> str:
        if self.kind == "sampler":
            num_rows, variant = self.shape
            return (f"sampler[{num_rows},{variant.mode},{variant.num_logprobs}"
                    f"{',penalties' if variant.penalties else ''}{',bias' if variant.bias_table else ''}]")
        return f"{self.kind}{list(self.shape)}"


def all_jobs(runner) -> list[CompileJob]:
    """Every executable of ``runner`` (a ``ModelRunner``), in the order a full warm-up submits them: the forwards,
    largest first (the longest compiles start while threads are free), the swap sizes, then per sampler row count
    the bitmask and the sampler variants, then the prompt logprobs per token bucket (a pooling runner: forwards and
    swaps only)."""
    jobs = [CompileJob("forward", bucket) for bucket in sorted(runner.buckets, reverse=True)]
    jobs += [CompileJob("swap", (size,)) for size in _swap_sizes(runner)]
    if runner.pools:
        return jobs
    for num_rows in runner.sampler_seq_buckets:
        jobs.append(CompileJob("bitmask", (num_rows,)))
        jobs += [CompileJob("sampler", (num_rows, variant)) for variant in runner.sampler_variants]
    return jobs + [CompileJob("prompt_logprobs", (t,)) for t in sorted({t for t, _ in runner.buckets})]


def jobs_for_buckets(runner, buckets, modes) -> list[CompileJob]:
    """The forwards of ``buckets`` (some of ``runner.buckets``) and, at their sampler row counts, the sampler
    variants of ``modes`` (``SamplingMode`` values) without penalties or top logprobs: what steps of only those shapes
    and modes run (``ModelRunner.warm_up(jobs=...)``: a benchmark's few step shapes)."""
    jobs = [CompileJob("forward", tuple(bucket)) for bucket in sorted(set(buckets), reverse=True)]
    rows = sorted({runner.layout(*bucket).num_sample_rows for bucket in buckets})
    return jobs + [CompileJob("sampler", (num_rows, variant)) for num_rows in rows
                   for variant in runner.sampler_variants
                   if variant.mode in modes and not variant.penalties and not variant.num_logprobs]


def num_warm_up_executables(runner) -> int:
    """Steps of ``warm_up``'s progress bar: the executables it compiles, a swap size's gather and scatter as one,
    the LoRA slot write not counted."""
    return len(all_jobs(runner))


def warm_up(runner, use_tqdm: bool = True, threads: int | None = None) -> dict[str, float]:
    """Compile (or load) every executable of ``runner`` (a ``ModelRunner``) on ``threads`` threads (default
    ``compile_threads()``), then run each once. Returns seconds per phase: ``compile_s`` (phase 1, the executable
    cache's fingerprint included), ``kv_pool_s`` (allocating the KV pool), ``run_s`` (the run phase; for the
    pipeline-parallel runner it holds the compiles); ``threads`` (used; 1 for the pipeline-parallel runner) and
    ``executables_loaded`` (from the executable cache); ``compile_jobs``: every compile or load job as ``[label,
    start s, seconds, lowering s]`` (lowering: tracing and lowering, Python under the GIL; 0 for a load), by end time
    (the last ones are a cold start's critical path; a logged debug line names them)."""
    return warm_up_jobs(runner, all_jobs(runner), use_tqdm, threads)[0]


def allocate_kv_pool(runner) -> float:
    """Allocate ``runner``'s KV pool now, before any compile: its arrays then lie in memory that nothing has split
    yet (the compiler's autotuning allocates and frees buffers beside the executables it keeps, and a pool of few
    large arrays may not fit the pieces left between them). Returns the seconds it took. An allocator out-of-memory
    error becomes a RuntimeError naming the allocator's state and the flags that size the pool."""
    start = time.perf_counter()
    try:
        jax.block_until_ready(runner.kv_pool)
    except jax.errors.JaxRuntimeError as exc:
        if "RESOURCE_EXHAUSTED" not in str(exc):
            raise
        raise pool_allocation_error(runner.device, jax.tree.leaves(runner.abstract_kv_pool()), exc) from exc
    return time.perf_counter() - start


def warm_up_jobs(runner, jobs: list[CompileJob], use_tqdm: bool = True,
                 threads: int | None = None) -> tuple[dict[str, float], Compiler | None]:
    """``warm_up`` of ``jobs`` only (both phases); also returns its ``Compiler`` (None for the pipeline-parallel
    runner), which can compile more jobs later."""
    from tqdm.auto import tqdm

    threads = compile_threads() if threads is None else threads
    ahead_of_time = isinstance(runner._forward, AheadOfTimeFunction)
    bar = tqdm(total=len(jobs), desc="Compiling step executables", disable=not use_tqdm, leave=False)
    timings = {"threads": threads if ahead_of_time else 1, "compile_s": 0.0, "executables_loaded": 0,
               "kv_pool_s": allocate_kv_pool(runner)}
    start = time.perf_counter()
    compiler = None
    if ahead_of_time:
        cache = ExecutableCache.for_runner(runner)
        compiler = Compiler(runner, threads, cache)
        compiler.compile(jobs, on_landed=lambda job: bar.update(1))
        timings["compile_s"] = time.perf_counter() - start
        timings["compile_jobs"] = sorted(compiler.spans, key=lambda span: span[1] + span[2])
        logger.debug("compile jobs that ended last ([label, start s, seconds, lowering s]): %s",
                     timings["compile_jobs"][-LAST_COMPILES_LOGGED:])
        timings["executables_loaded"] = cache.hits if cache else 0
        logger.info("%d executables ready on %d threads in %.1f s (%d loaded from %s)", len(jobs), threads,
                    timings["compile_s"], timings["executables_loaded"], cache and cache.directory)
    start = time.perf_counter()
    run_jobs(runner, jobs, bar if not ahead_of_time else None)
    timings["run_s"] = time.perf_counter() - start
    bar.close()
    return timings, compiler


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


class _CompileJobs:
    """The compile (or load) job of each executable of ``runner``, from abstract inputs with the avals and shardings
    the run phase's inputs have. Each job is ``fn(..., seconds, turn)`` for ``load_or_compile`` (``seconds``: where
    it records its lowering time; ``turn``: the lowering turn it traces and lowers in) and returns the ``Compiled``.
    A job that takes a forward's outputs gets that forward's ended future first."""

    def __init__(self, runner, cache: ExecutableCache | None, compile_slots: CompileSlots | None = None):
        self.runner, self.cache, self.compile_slots = runner, cache, compile_slots
        self._host_input = runner.input_sharding()
        self.params = [_abstract(x) for x in runner._param_leaves]
        self.kv_pool = runner.abstract_kv_pool()
        self.prev_tokens = _abstract(runner._prev_tokens)
        self.lora = runner.lora_slots and jax.tree.map(_abstract, runner.lora_slots.arrays)

    def _load_or_compile(self, function, args, static, seconds, turn):
        return load_or_compile(self.cache, function, args, static, seconds, turn, compile_slots=self.compile_slots)

    def _host(self, x: np.ndarray) -> jax.ShapeDtypeStruct:
        """A host array as the run phase puts it on the device (the runner's input sharding)."""
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._host_input)

    def compile_forward(self, num_tokens, num_seqs, seconds, turn):
        """The forward of bucket ``(num_tokens, num_seqs)`` on a padding-only step buffer."""
        buf = self._host(_padding_step_buffer(self.runner, num_tokens, num_seqs))
        return self._load_or_compile(self.runner._forward, (self.params, self.kv_pool, buf, self.prev_tokens,
                                                                   self.lora),
                               {"num_tokens": num_tokens, "num_seqs": num_seqs}, seconds, turn)

    def compile_bitmask(self, forward, num_rows, seconds, turn):
        """The grammar bitmask of ``num_rows`` sampler rows, on the logits of ``forward`` (an ended future)."""
        logits, _, _ = _forward_outputs(forward, self.runner)
        return self._load_or_compile(self.runner._apply_grammar_bitmask,
                               (logits, self._host(_grammar_bitmask(self.runner, num_rows))), None, seconds, turn)

    def compile_sampler(self, forward, num_rows, variant, seconds, turn):
        """The sampler of ``num_rows`` rows and ``variant``, on the logits and sampling words of ``forward``."""
        logits, sampling_words, _ = _forward_outputs(forward, self.runner)
        empty = _abstract(self.runner._no_history[num_rows])
        history = self._host(_penalty_history(self.runner, num_rows)) if variant.penalties else empty
        bias_table = self._host(_bias_table(self.runner, num_rows)) if variant.bias_table else empty
        return self._load_or_compile(self.runner._sample, (logits, sampling_words, history, bias_table),
                               {"mode": variant.mode, "num_logprobs": variant.num_logprobs}, seconds, turn)

    def compile_prompt_logprobs(self, forward, num_tokens, seconds, turn):
        """The prompt logprobs of ``num_tokens`` tokens, on the hidden states of ``forward``."""
        _, _, hidden = _forward_outputs(forward, self.runner)
        targets = self._host(np.zeros((num_tokens,), np.int32))
        return self._load_or_compile(self.runner._prompt_logprobs, (self.params, hidden, targets), None,
                               seconds, turn)

    def compile_swap(self, size, seconds, turn):
        """The gather and the scatter of ``size`` swapped blocks (the scatter takes the gather's outputs: one
        array per block)."""
        ids = self._host(np.zeros((size,), np.int32))
        gathered = self._load_or_compile(self.runner._gather_blocks, (self.kv_pool, ids), None, seconds, turn)
        data = tuple(_compiled_outputs(gathered))
        return self._load_or_compile(self.runner._scatter_blocks, (self.kv_pool, ids, data), None, seconds,
                               turn)


def compiles_beside_steps(runner, threads: int, device) -> int:
    """How many of ``threads`` compiles may run at once while ``runner`` serves steps on ``device`` (its weights and KV
    pool allocated): what the allocator's free bytes hold of one compile's autotuning scratch
    (``autotune_scratch_bytes``), less one share for the steps' own buffers, and never fewer than the
    ``COMPILE_SCRATCH_SLOTS`` the KV sizing kept free; ``threads`` without memory statistics (the CPU)."""
    free = free_bytes(device)
    if free is None:
        return threads
    scratch = autotune_scratch_bytes(runner.model_config, runner.dtype, logits_rows=runner.sampler_seq_buckets[-1],
                                     max_num_batched_tokens=runner.max_num_batched_tokens)
    return min(threads, max(COMPILE_SCRATCH_SLOTS, free // scratch - 1))


def compile_forward_apart(runner, num_tokens: int, num_seqs: int) -> jax.stages.Compiled:
    """The runner's forward of bucket ``(num_tokens, num_seqs)`` compiled from the abstract inputs warm-up uses (the
    KV pool is not allocated) and kept out of the runner's table: its ``memory_analysis()`` tells what a step holds
    beside its arguments (``benchmarks.pool_memory``: the donated pool must be updated in place)."""
    jobs = _CompileJobs(runner, None)
    buf = jobs._host(_padding_step_buffer(runner, num_tokens, num_seqs))
    return runner._forward.lower(jobs.params, jobs.kv_pool, buf, jobs.prev_tokens, jobs.lora, num_tokens=num_tokens,
                                 num_seqs=num_seqs).compile()


def _forward_outputs(future, runner) -> tuple:
    """A compiled forward's (ended ``future``'s) abstract outputs the other executables take: ``(logits, sampling
    words, hidden)``."""
    _, logits, sampling_words, hidden = _split_forward_outputs(_compiled_outputs(future.result()), runner)
    return logits, sampling_words, hidden


def _split_forward_outputs(outputs: list, runner) -> tuple[list, object, object, object]:
    """The forward's flat outputs -> (kv pool leaves, logits, sampling words, hidden); the arrays of the runner's
    ``moe_outputs`` that follow them are dropped."""
    outputs = outputs[:len(outputs) - runner.moe_outputs.num_arrays]
    return outputs[:-3], outputs[-3], outputs[-2], outputs[-1]


class Compiler:
    """Phase 1 for lists of jobs (``compile``), on ``threads`` threads, into the runner's ``AheadOfTimeFunction``
    tables: each executable loaded from ``cache`` or traced, lowered and compiled from abstract inputs. The forwards
    it compiled are remembered across calls: a later call's sampler, bitmask and prompt-logprobs jobs take their
    input shapes from them (``paged_jax.worker.background_compile`` compiles a first set, then the rest). ``spans``:
    every job's ``[label, start s, seconds, lowering s]``, from this compiler's creation."""

    def __init__(self, runner, threads: int, cache: ExecutableCache | None):
        self.runner, self.threads, self.cache = runner, threads, cache
        self.started = time.perf_counter()
        self.slots = CompileSlots(threads)
        self._jobs = _CompileJobs(runner, cache, self.slots)
        self._forwards: dict[tuple[int, int], concurrent.futures.Future] = {}  # bucket -> its compile, by submission
        self.spans: list[list] = []
        self.queue: JobQueue | None = None  # the last ``compile``'s

    def compile(self, jobs: list[CompileJob], on_landed=None, stop: threading.Event | None = None,
                raise_failures: bool = True, name: str = "paged-jax-compile") -> None:
        """Compile (or load) ``jobs``, the first ones first (lowering in that order too); ``on_landed(job)`` (in
        this thread) as each executable lands in its table. A failure is re-raised (the queued jobs dropped), or
        with ``raise_failures`` False logged (the jobs that take its outputs fail too). ``stop``: when set, the
        queued jobs are dropped and this returns (those in flight still land)."""
        queue = self.queue = JobQueue(self.threads, self.started, name)
        for job in jobs:
            self._submit(queue, job)

        def done(job: CompileJob, future) -> None:
            if future is None:
                return  # dropped: stopped, or what it takes failed
            try:
                future.result()
            except Exception:
                if raise_failures:
                    raise
                logger.exception("compiling %s failed; steps that need it compile it when they run", job.label)
                return
            if on_landed is not None:
                on_landed(job)
        try:
            queue.wait(done, stop)
        finally:
            self.spans += queue.spans

    def _submit(self, queue: JobQueue, job: CompileJob) -> None:
        jobs = self._jobs
        if job.kind == "forward":
            self._forwards[job.shape] = queue.submit(job, job.label, jobs.compile_forward, *job.shape)
        elif job.kind == "swap":
            queue.submit(job, job.label, jobs.compile_swap, *job.shape)
        elif job.kind == "prompt_logprobs":
            queue.submit_after(self._forward_with(tokens=job.shape[0]), job, job.label, jobs.compile_prompt_logprobs,
                               *job.shape)
        else:
            fn = jobs.compile_sampler if job.kind == "sampler" else jobs.compile_bitmask
            queue.submit_after(self._forward_with(rows=job.shape[0]), job, job.label, fn, *job.shape)

    def _forward_with(self, rows: int | None = None, tokens: int | None = None) -> concurrent.futures.Future:
        """The compile of a forward whose outputs have ``rows`` sampler rows / ``tokens`` tokens: one already done
        if any, else the smallest bucket submitted (its compile ends first)."""
        runner = self.runner
        candidates = sorted(bucket for bucket in self._forwards
                            if (rows is None or runner.layout(*bucket).num_sample_rows == rows)
                            and (tokens is None or bucket[0] == tokens))
        if not candidates:
            raise RuntimeError(f"no forward of {rows} sampler rows / {tokens} tokens is compiled or queued first")
        done = [bucket for bucket in candidates if self._forwards[bucket].done()
                and not self._forwards[bucket].exception()]
        return self._forwards[(done or candidates)[0]]


# ----------------------------------------------------------------------------------------------------------------
# Phase 2: run each executable once
# ----------------------------------------------------------------------------------------------------------------

def run_jobs(runner, jobs: list[CompileJob], bar=None) -> None:
    """Call each executable of ``jobs`` once on padding-only inputs (compiling it unless phase 1 did: the
    pipeline-parallel runner), the forwards first; ``bar`` (or None) counts them. A sampler / bitmask / prompt
    logprobs job needs a forward of its rows / tokens among ``jobs``."""
    outputs = _run_forwards(runner, sorted(job.shape for job in jobs if job.kind == "forward"), bar)
    outs = _run_samplers(runner, [job for job in jobs if job.kind in ("bitmask", "sampler")], outputs, bar)
    device = runner.device
    for job in jobs:
        if job.kind == "prompt_logprobs":
            (num_tokens,) = job.shape
            targets = jax.device_put(np.zeros((num_tokens,), np.int32), device)
            outs = (outs, runner._prompt_logprobs(runner._param_leaves, outputs[1][num_tokens], targets))
        elif job.kind == "swap":
            ids = jax.device_put(np.zeros(job.shape, np.int32), device)
            runner.kv_pool, _ = runner._scatter_blocks(runner.kv_pool, ids, runner._gather_blocks(runner.kv_pool, ids))
        else:
            continue
        if bar is not None:
            bar.update(1)
    jax.block_until_ready((runner.kv_pool, outs))


def _run_forwards(runner, buckets: list[tuple[int, int]], bar) -> tuple[dict, dict]:
    """Run the forward of each bucket once; returns ({sampler rows: (logits, sampling words)}, {tokens: hidden})
    of the smallest bucket of each."""
    logits_by_rows, hidden_by_tokens = {}, {}
    for num_tokens, num_seqs in buckets:
        buf = _padding_step_buffer(runner, num_tokens, num_seqs)
        runner.kv_pool, logits, sampling_words, hidden, *_ = runner._forward(
            runner._param_leaves, runner.kv_pool, jax.device_put(buf, runner.device), runner._prev_tokens,
            runner.lora_slots and runner.lora_slots.arrays, num_tokens=num_tokens, num_seqs=num_seqs)
        logits_by_rows.setdefault(runner.layout(num_tokens, num_seqs).num_sample_rows, (logits, sampling_words))
        hidden_by_tokens.setdefault(num_tokens, hidden)
        if bar is not None:
            bar.update(1)
    if runner.lora_slots is not None:
        runner.lora_slots.write(0, None)  # compiles the slot write (slot 0, no adapter, stays zeros)
    return logits_by_rows, hidden_by_tokens


def _run_samplers(runner, jobs: list[CompileJob], outputs: tuple[dict, dict], bar):
    """Run each grammar bitmask / sampler job once on its rows' logits; returns the last outputs."""
    device, outs = runner.device, None
    for job in jobs:
        num_rows = job.shape[0]
        logits, sampling_words = outputs[0][num_rows]
        if job.kind == "bitmask":
            outs = runner._apply_grammar_bitmask(logits, jax.device_put(_grammar_bitmask(runner, num_rows), device))
        else:
            variant = job.shape[1]
            empty = runner._no_history[num_rows]
            history = jax.device_put(_penalty_history(runner, num_rows), device) if variant.penalties else empty
            bias_table = jax.device_put(_bias_table(runner, num_rows), device) if variant.bias_table else empty
            outs = runner._sample(logits, sampling_words, history, bias_table, mode=variant.mode,
                                  num_logprobs=variant.num_logprobs)
        if bar is not None:
            bar.update(1)
    return outs
