"""Serving before every step executable is compiled: warm-up compiles a first set, the engine starts serving, and a
background thread compiles the rest in priority order (``--background-compilation``, on by default; off: every
executable before serving, ``paged_jax.worker.warm_up``).

* The first set (``first_jobs``): the forwards of the single-sequence decode bucket ``(1, 1)`` and of the smallest
  bucket of the token ladder (``buckets.make_buckets``; not a single sequence's verify bucket), and at their sampler
  row count the greedy sampler and the most general one without penalties or top logprobs (``FULL`` with the bias
  table), which serves every other request's rows with the same tokens.
* The rest (``background_jobs``): first what the first shapes still lack (the other sampler variants, the grammar
  bitmask, prompt logprobs, swap copies), then the other buckets from the smallest up, each followed by what its
  sampler row count and token count add.
* ``ReadySet`` says what runs now. A bucket is ready once its forward and its rows' general sampler have landed;
  steps are padded to the smallest ready bucket that holds them (``ModelRunner.execute``), and the scheduler's
  token budget and seats are capped by ``limits``: the largest ready bucket that holds the previous limits (so they
  only grow). A sampler mode not ready yet runs as the next more general one that is (``sampler_mode``: each mode
  gives the same tokens and logprobs as the ones before it on the rows those serve). A step that needs an
  executable nothing stands in for (penalties, top logprobs, prompt logprobs, a grammar bitmask, a swap size) waits
  for it (``AheadOfTimeFunction`` waits for its key): those come early in the order. Nothing compiles on the step
  path: ``num_compiles_since_warmup`` stays 0.
* Once everything has landed, ``ReadySet`` holds every bucket and the full limits: steps run exactly as after a full
  warm-up. Background executables are not run once on padding first (the step thread owns the KV pool).
* The background compiles run beside the KV pool: on a GPU, XLA's autotuning scratch memory comes from what the
  pool's sizing leaves (the widest step's activations), ``PAGED_JAX_COMPILE_THREADS`` compiles at once.
* At the interpreter's exit the queued compiles are dropped and the ones in flight waited for (a daemon thread
  still inside XLA at finalization aborts the process); a core process ends without waiting
  (``compiles_in_flight``, ``serving.engine_process``).

Not used (a full warm-up instead) when the forward is not one jitted program (pipeline parallelism) or the job spans
several processes (each node must pick the same buckets as node 0).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref

import jax

from paged_jax.worker import warm_up as warm_up_lib
from paged_jax.worker.buckets import make_buckets
from paged_jax.worker.executable_cache import AheadOfTimeFunction, Landing
from paged_jax.worker.sampler import MODE_ORDER, SamplingMode
from paged_jax.worker.step_io import SamplerVariant
from paged_jax.worker.warm_up import CompileJob

logger = logging.getLogger(__name__)

BACKGROUND_COMPILATION_ENV = "PAGED_JAX_BACKGROUND_COMPILATION"

_GENERAL_MODES = tuple(mode.value for mode in MODE_ORDER)  # each a superset of the ones before it
_RUNNING: "weakref.WeakSet[BackgroundCompiles]" = weakref.WeakSet()


def _general(num_rows: int) -> CompileJob:
    """The sampler job every ready bucket needs: full mode (with the bias table), no penalties, no top logprobs."""
    return CompileJob("sampler", (num_rows, SamplerVariant(SamplingMode.FULL.value, False, 0, True)))


class ReadySet:
    """What a runner can run now (complete unless ``start`` was called): ``buckets`` (sorted, the ones steps are
    padded to), ``limits`` ``(tokens, sequences)`` (the largest step; ``on_limits(tokens, seqs)`` is called as it
    grows), ``complete``. Updated by the background thread (``landed``), read by the step thread: each attribute is
    replaced whole."""

    def __init__(self, runner):
        self._all_buckets = list(runner.buckets)
        self._rows = {bucket: runner.layout(*bucket).num_sample_rows for bucket in runner.buckets}
        self._pools = runner.pools
        self._forwards: set[tuple[int, int]] = set()
        self._samplers: set[tuple] = set()  # (rows, mode, num_logprobs, penalties)
        self._lock = threading.Lock()
        self.on_limits = None
        self.complete, self.buckets, self.limits = True, self._all_buckets, max(self._all_buckets)

    def start(self) -> None:
        """Nothing is ready: executables land one by one (``landed``) until ``finish``."""
        self.complete, self.buckets, self.limits = False, [], (0, 0)

    def landed(self, job: CompileJob) -> None:
        """``job``'s executable is in its table: grow ``buckets`` and ``limits``."""
        with self._lock:
            if job.kind == "forward":
                self._forwards.add(job.shape)
            elif job.kind == "sampler":
                num_rows, variant = job.shape
                self._samplers.add((num_rows, variant.mode, variant.num_logprobs, variant.penalties))
            else:
                return
            general = _general(0).shape[1]
            self.buckets = sorted(bucket for bucket in self._forwards if self._pools or (
                self._rows[bucket], general.mode, 0, False) in self._samplers)
            tokens, seqs = self.limits
            grown = [bucket for bucket in self.buckets if bucket[0] >= tokens and bucket[1] >= seqs]
            if grown:
                self._set_limits(max(grown, key=lambda bucket: (bucket[0] * bucket[1], bucket[0])))

    def finish(self) -> None:
        """Every executable has landed: every bucket, the full limits."""
        with self._lock:
            self.buckets = self._all_buckets
            self.complete = True
            self._set_limits(max(self._all_buckets))

    def _set_limits(self, limits: tuple[int, int]) -> None:
        if limits != self.limits:
            self.limits = limits
            if self.on_limits is not None:
                self.on_limits(*limits)

    def sampler_mode(self, num_rows: int, mode: str, num_logprobs: int, penalties: bool) -> str:
        """The mode to run a step of ``mode`` on ``num_rows`` rows with: ``mode`` itself, or while it is not ready
        the first more general one that is (the same results); a penalty step's own (it waits for it)."""
        if self.complete or penalties:
            return mode
        samplers = self._samplers
        for candidate in _GENERAL_MODES[_GENERAL_MODES.index(mode):]:
            if (num_rows, candidate, num_logprobs, False) in samplers:
                return candidate
        return mode


def background_compilation_enabled(flag: bool | None) -> bool:
    """``background_compilation`` as given, else on unless ``$PAGED_JAX_BACKGROUND_COMPILATION`` is ``0``."""
    if flag is not None:
        return bool(flag)
    return os.environ.get(BACKGROUND_COMPILATION_ENV, "1").strip() != "0"


def can_compile_in_background(runner) -> bool:
    """Whether ``runner``'s executables can land while it serves: one jitted forward, one process, no model drafter
    (whose warm-up runs the target's forward of every bucket)."""
    return (isinstance(runner._forward, AheadOfTimeFunction) and jax.process_count() == 1
            and runner.drafter is None)


def first_jobs(runner) -> list[CompileJob]:
    """The executables compiled before serving (module docstring)."""
    buckets = sorted(runner.buckets)
    # A verify bucket (S * (1 + k), S) serves only steps that verify drafts: not the first multi-sequence shape.
    limits = (runner.max_num_batched_tokens, runner.max_num_seqs)
    verify = set(make_buckets(*limits, runner.num_speculative_tokens)) - set(make_buckets(*limits))
    multi = [bucket for bucket in buckets if bucket[0] > 1 and bucket not in verify]
    first = [bucket for bucket in buckets if bucket == (1, 1)] + multi[:1]
    jobs = [CompileJob("forward", bucket) for bucket in first or buckets[:1]]
    if runner.pools:
        return jobs
    num_rows = runner.layout(*jobs[-1].shape).num_sample_rows
    greedy = CompileJob("sampler", (num_rows, runner.sampler_variants[0]))
    return jobs + [greedy, _general(num_rows)]


def background_jobs(runner, first: list[CompileJob]) -> list[CompileJob]:
    """The other executables, in the order they are compiled (module docstring)."""
    everything = warm_up_lib.all_jobs(runner)
    done = set(first)
    order: list[CompileJob] = []

    def add(jobs) -> None:
        for job in jobs:
            if job not in done and job in everything:
                done.add(job)
                order.append(job)

    def for_rows(num_rows: int) -> list[CompileJob]:
        variants = sorted(runner.sampler_variants, key=lambda v: (v.num_logprobs, v.penalties))  # lean first
        return ([CompileJob("sampler", (num_rows, runner.sampler_variants[0])), _general(num_rows)]
                + [CompileJob("sampler", (num_rows, v)) for v in variants] + [CompileJob("bitmask", (num_rows,))])

    first_forwards = [job.shape for job in first if job.kind == "forward"]
    for bucket in first_forwards:
        add([] if runner.pools else for_rows(runner.layout(*bucket).num_sample_rows)
            + [CompileJob("prompt_logprobs", (bucket[0],))])
    add(job for job in everything if job.kind == "swap")
    for bucket in sorted(runner.buckets):
        add([CompileJob("forward", bucket)])
        add([] if runner.pools else for_rows(runner.layout(*bucket).num_sample_rows)
            + [CompileJob("prompt_logprobs", (bucket[0],))])
    add(everything)  # nothing left by now; kept so no executable can be missed
    return order


class BackgroundCompiles:
    """The background thread compiling ``jobs`` with ``compiler`` (``warm_up.Compiler``) into ``runner``'s tables,
    ``ready`` (``ReadySet``) growing as each lands; ``num_first`` executables were compiled before it."""

    def __init__(self, runner, compiler, jobs: list[CompileJob], num_first: int, timings: dict):
        self.runner, self._compiler, self._jobs, self._timings = runner, compiler, jobs, timings
        self.num_first, self.num_landed, self.num_jobs = num_first, 0, len(jobs)
        self.seconds: float | None = None  # from start to the last executable landed
        self._landing = Landing()
        self._functions = [f for f in runner.step_functions() if isinstance(f, AheadOfTimeFunction)]
        for function in self._functions:
            function.landing = self._landing
        self._stop = threading.Event()
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paged-jax-background-compile", daemon=True)

    def start(self) -> "BackgroundCompiles":
        self._started = time.perf_counter()
        _RUNNING.add(self)
        self._thread.start()
        return self

    def _landed(self, job: CompileJob) -> None:
        self.num_landed += 1
        self.runner.ready.landed(job)
        tokens, seqs = self.runner.ready.limits
        logger.info("compiled %d/%d in the background: %s (steps up to %d tokens, %d sequences)",
                    self.num_first + self.num_landed, self.num_first + self.num_jobs, job.label, tokens, seqs)

    def _run(self) -> None:
        try:
            self._compiler.compile(self._jobs, on_landed=self._landed, stop=self._stop, raise_failures=False,
                                   name="paged-jax-background-compile")
        except BaseException:  # noqa: BLE001 - the engine serves on with what landed
            logger.exception("background compilation failed")
        finally:
            self._timings["compile_jobs"] = sorted(self._compiler.spans, key=lambda span: span[1] + span[2])
            if self._compiler.cache is not None:
                self._timings["executables_loaded"] = self._compiler.cache.hits
            if self.num_landed == self.num_jobs:
                self.seconds = self._timings["background_s"] = time.perf_counter() - self._started
                self.runner.ready.finish()
                logger.info("all %d step executables ready, %.1f s after serving started",
                            self.num_first + self.num_jobs, self.seconds)
            elif not self._stop.is_set():
                logger.warning("%d of %d step executables did not compile in the background: steps that need "
                               "them compile them when they first run", self.num_jobs - self.num_landed,
                               self.num_jobs)
            self._landing.finish()
            for function in self._functions:
                function.landing = None
            self.done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the thread has ended (everything landed, or stopped); whether it has."""
        return self.done.wait(timeout)

    def stop(self) -> None:
        """Drop the queued compiles; the ones in flight end on their own (daemon threads: nothing waits for them)."""
        self._stop.set()

    def running(self) -> bool:
        """Whether a compile (or the thread handing them out) is still running, stopped or not."""
        queue = self._compiler.queue
        return self._thread.is_alive() or (queue is not None and any(t.is_alive() for t in queue.threads))

    def stop_and_wait(self) -> None:
        """``stop``, then wait for the compiles in flight (at most one per thread)."""
        self.stop()
        self._thread.join()
        if self._compiler.queue is not None:
            self._compiler.queue.join()


def compiles_in_flight() -> bool:
    """Whether background compiles of this process are still running (a process that must end at once ends with
    ``os._exit`` rather than wait for them: ``serving.engine_process``)."""
    return any(compiles.running() for compiles in list(_RUNNING))


@atexit.register
def _wait_for_compiles_in_flight() -> None:
    """An XLA compile cannot be interrupted, and a daemon thread still compiling when the interpreter finalizes dies
    inside C++ (an abort): at exit, the queued compiles are dropped and the ones in flight waited for."""
    for compiles in list(_RUNNING):
        compiles.stop_and_wait()


def _bound_beside_steps(runner, compiler) -> None:
    """Background compiles autotune beside serving steps, which an out-of-memory would fail: at most as many at once
    as ``warm_up_lib.compiles_beside_steps`` allows (an INFO line says when that is fewer than before)."""
    device = min(jax.tree.leaves(runner.kv_pool)[0].devices(), key=lambda d: d.id)
    before = compiler.slots.limit
    compiler.slots.cap(warm_up_lib.compiles_beside_steps(runner, compiler.threads, device))
    if compiler.slots.limit < before:
        logger.info("at most %d compiles at once beside serving steps (their autotuning's device memory)",
                    compiler.slots.limit)


def warm_up_in_background(runner, use_tqdm: bool = True, threads: int | None = None) -> dict:
    """Compile and run ``first_jobs``, then start ``BackgroundCompiles`` for the rest (``runner.background``).
    Returns ``warm_up_jobs``' timings plus ``first_executables`` and ``background_executables``; the background
    thread updates ``compile_jobs`` and ``executables_loaded`` in it and adds ``background_s`` (from its start to
    the last executable landed) when done."""
    first = first_jobs(runner)
    rest = background_jobs(runner, first)
    runner.ready.start()
    start = time.perf_counter()
    timings, compiler = warm_up_lib.warm_up_jobs(runner, first, use_tqdm=use_tqdm, threads=threads)
    for job in first:
        runner.ready.landed(job)
    tokens, seqs = runner.ready.limits
    logger.info("ready to serve after %d of %d step executables in %.1f s (steps up to %d tokens, %d sequences); "
                "compiling the other %d in the background", len(first), len(first) + len(rest),
                time.perf_counter() - start, tokens, seqs, len(rest))
    timings.update(first_executables=len(first), background_executables=len(rest))
    if compiler is not None:
        _bound_beside_steps(runner, compiler)
    runner.background = BackgroundCompiles(runner, compiler, rest, len(first), timings).start()
    return timings
