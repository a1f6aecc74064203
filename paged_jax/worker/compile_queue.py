"""The threads that compile step executables (``paged_jax.worker.warm_up``): jobs run by priority on daemon worker
threads, each timed, tracing and lowering one job at a time in priority order (``LoweringTurns``).

Daemon threads: an XLA compile cannot be interrupted, and a process that exits (a server stopped while executables
still compile in the background) must not wait for the compiles in flight.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import logging
import queue
import threading
import time

import jax

logger = logging.getLogger(__name__)

class LoweringTurns:
    """Tracing and lowering run one job at a time, the job with the lowest ``priority`` first.

    Both are Python under the GIL: N jobs lowering at once each take about N times as long and end together, so the
    first XLA compile (which releases the GIL) starts only when nearly all lowering is done. In turns, the first jobs
    (the largest forwards, at a full warm-up) reach XLA after their own lowering and their compiles overlap the
    lowering of the rest. A cold start stays bound by the CPU work of XLA's compiles (benchmarks/RESULTS.md,
    "Start-up to first token")."""

    def __init__(self):
        self._changed = threading.Condition()
        self._waiting: list[int] = []  # a heap of the waiting jobs' priorities
        self._busy = False

    def turn(self, priority: int) -> "LoweringTurn":
        """A reusable context manager holding the turn for job ``priority`` (unique per job)."""
        return LoweringTurn(self, priority)

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


class LoweringTurn:
    def __init__(self, turns: LoweringTurns, priority: int):
        self._turns, self._priority = turns, priority

    def __enter__(self):
        self._turns._acquire(self._priority)

    def __exit__(self, *exc):
        self._turns._release()


class CompileSlots:
    """How many XLA compiles run at once: at first every thread's; a compile that runs out of device memory (XLA's
    autotuning allocates fresh copies of a matmul's operands and outputs, e.g. a large vocabulary's embedding, beside
    the weights and the KV pool) halves the limit and runs again once fewer than that many compile. The first limit
    fits small models at full speed; large ones settle where their autotuning fits. An out-of-memory error of a
    compile that ran alone is raised."""

    def __init__(self, limit: int):
        self.limit = max(1, int(limit))
        self._beside: dict[object, int] = {}  # each running compile -> the most others that ran beside it
        self._changed = threading.Condition()

    def cap(self, limit: int) -> None:
        """At most ``limit`` (at least 1) compiles at once from now on."""
        with self._changed:
            self.limit = max(1, min(self.limit, int(limit)))

    def run(self, compile_fn):
        """``compile_fn()`` (an XLA compile) in a slot, again in a smaller one after an out-of-memory error."""
        while True:
            token = object()
            with self._changed:
                self._changed.wait_for(lambda: len(self._beside) < self.limit)
                self._beside[token] = len(self._beside)
                for other in self._beside:
                    self._beside[other] = max(self._beside[other], len(self._beside) - 1)
            try:
                return compile_fn()
            except jax.errors.JaxRuntimeError as exc:
                if not self._lowered_after(exc, token):
                    raise
            finally:
                with self._changed:
                    self._beside.pop(token, None)
                    self._changed.notify_all()

    def _lowered_after(self, error: Exception, token: object) -> bool:
        """Whether ``error`` is an out-of-memory of a compile that had others beside it: then it runs again, and the
        limit is halved unless it already ran with more beside it than the limit now allows (compiles that failed
        together lower it once)."""
        if "RESOURCE_EXHAUSTED" not in str(error):
            return False
        with self._changed:
            beside = self._beside.get(token, 0)
            if beside < 1:
                return False
            if beside < self.limit:
                self.limit = max(1, (beside + 1) // 2)
        logger.warning("a compile ran out of device memory beside %d others (XLA's autotuning buffers): at most %d "
                       "compile at once from now on, and it runs again", beside, self.limit)
        return True


class _Workers:
    """``threads`` daemon threads running queued ``(priority, fn, future)`` jobs, the lowest priority first."""

    def __init__(self, threads: int, name: str):
        self._changed = threading.Condition()
        self._queued: list = []  # a heap of (priority, fn, future)
        self._stopping = False
        self.threads = [threading.Thread(target=self._serve, name=f"{name}-{index}", daemon=True)
                        for index in range(threads)]
        for thread in self.threads:
            thread.start()

    def put(self, priority: int, fn, future: concurrent.futures.Future) -> None:
        with self._changed:
            if self._stopping:
                future.cancel()
                return
            heapq.heappush(self._queued, (priority, id(future), fn, future))
            self._changed.notify()

    def stop(self) -> None:
        """Cancel the queued jobs (their futures' callbacks run) and end the threads once their job in flight ends."""
        with self._changed:
            self._stopping = True
            queued, self._queued = self._queued, []
            self._changed.notify_all()
        for *_, future in queued:
            future.cancel()

    def _serve(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._queued or self._stopping)
                if self._stopping:
                    return
                _, _, fn, future = heapq.heappop(self._queued)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the future's owner
                future.set_exception(exc)


class JobQueue:
    """Compile jobs on ``threads`` worker threads, by priority (the order they are submitted in, unless given): each
    timed (``spans``: ``[label, start s since started, seconds, lowering s]``), lowering in turns by priority; a job
    that takes another job's outputs is queued only once that one has ended, so no thread sits blocked on another
    job while compiles wait for a thread."""

    def __init__(self, threads: int, started: float, name: str = "paged-jax-compile"):
        self._workers = _Workers(threads, name)
        self._started = started
        self.spans: list[list] = []
        self._turns = LoweringTurns()
        self._submitted = itertools.count()  # each job's default priority: its submission order
        self._finished: queue.SimpleQueue = queue.SimpleQueue()  # (tag, future) of every job, as it ends
        self._stopping = threading.Event()
        self._num_jobs = 0

    def _timed(self, label: str, priority: int, fn, *args):
        """``fn(*args, seconds=, turn=)`` as a job that records its span."""
        turn = self._turns.turn(priority)

        def job():
            begin = time.perf_counter()
            seconds: dict = {}  # load_or_compile's lowering time
            try:
                return fn(*args, seconds=seconds, turn=turn)
            finally:
                self.spans.append([label, round(begin - self._started, 4), round(time.perf_counter() - begin, 4),
                                   round(seconds.get("lower", 0.0), 4)])
        return job

    def _put(self, tag, label: str, priority: int, fn, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.add_done_callback(lambda done: self._finished.put((tag, done)))
        self._workers.put(priority, self._timed(label, priority, fn, *args), future)
        return future

    def submit(self, tag, label: str, fn, *args) -> concurrent.futures.Future:
        """Queue ``fn(*args, seconds, turn)`` now; its future (``tag`` comes back from ``wait``)."""
        self._num_jobs += 1
        return self._put(tag, label, next(self._submitted), fn, *args)

    def submit_after(self, dependency: concurrent.futures.Future, tag, label: str, fn, *args) -> None:
        """Queue ``fn(dependency, *args, seconds, turn)`` once ``dependency`` (a job whose outputs it takes) has
        ended; its priority is its submission order all the same."""
        self._num_jobs += 1
        priority = next(self._submitted)

        def ready(done):
            if self._stopping.is_set() or done.cancelled():
                self._finished.put((tag, None))
                return
            self._put(tag, label, priority, fn, done, *args)
        dependency.add_done_callback(ready)

    def wait(self, on_done, stop: threading.Event | None = None) -> None:
        """Wait for every job submitted, calling ``on_done(tag, future)`` (None: the job was dropped) as each ends,
        until ``stop`` is set (then the queued jobs are dropped and the ones in flight left to end). A failure that
        ``on_done`` re-raises drops the queued jobs and propagates. The worker threads end with it."""
        try:
            for _ in range(self._num_jobs):
                while True:
                    try:
                        tag, done = self._finished.get(timeout=None if stop is None else 0.05)
                        break
                    except queue.Empty:
                        if stop.is_set():
                            return
                on_done(tag, None if done is None or done.cancelled() else done)
        finally:
            self.stop()

    def stop(self) -> None:
        self._stopping.set()
        self._workers.stop()

    @property
    def threads(self) -> list[threading.Thread]:
        return self._workers.threads

    def join(self) -> None:
        """Wait until the worker threads have ended (after ``stop``: once their jobs in flight have)."""
        for thread in self.threads:
            thread.join()
