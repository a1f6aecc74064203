"""Runs an ``LLMEngine`` on its own thread and exposes it to asyncio code.

Why a thread: ``LLMEngine.step()`` blocks for a whole model step (device compute plus host scheduling). Calling it
on the event loop would freeze every HTTP connection for that long, and the engine is not thread-safe, so it cannot
be called from a thread pool either. Here one dedicated thread owns the engine: *every* engine call happens on it.

Protocol between the two sides:

* event loop -> engine thread: commands (add a group of requests, abort requests, shut down) go through a
  thread-safe ``queue.SimpleQueue``. The thread blocks on that queue while the engine is idle (no busy spin) and,
  while it has work, drains *all* pending commands before each ``step()`` so a burst of arrivals joins one batch.
* an add costs no round trip to a core in another process: the group is validated and tokenized here (the engine's
  input processor), sent with ``submit_requests``, and its submitter resolved when the core's answer comes back
  with a later ``step()`` (at once for a core in this process); a command also wakes the engine thread out of its
  wait for the core's next step (``wakeup``).
* engine thread -> event loop: after each step, the (delta) outputs are grouped by the event loop that owns each
  request and handed over with one ``loop.call_soon_threadsafe`` per loop, into per-request ``asyncio.Queue`` s.

Failure handling: an exception in ``step()`` (or ``stats()``) kills the engine: every in-flight request receives an
``EngineDeadError``, commands already queued are answered with it, and later submissions raise it at once, so no
client hangs. Admission control: with ``max_waiting_requests`` set, a group of requests that would push the
engine's waiting queue past that bound is refused with ``EngineOverloadedError`` (the HTTP layer answers 503).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from paged_jax.engine.exceptions import EngineDeadError, EngineOverloadedError, waiting_bound_error
from paged_jax.engine.llm_engine import LLMEngine

if TYPE_CHECKING:
    from paged_jax.outputs import RequestOutput
    from paged_jax.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class EngineRequest:
    """What ``LLMEngine.add_request`` needs: an id, the prompt (token ids or text), the SamplingParams, the
    priority (lower runs earlier with ``scheduling_policy="priority"``) and the LoRA adapter (a ``LoRARequest``)."""

    request_id: str
    prompt: list[int] | str
    params: SamplingParams
    priority: int = 0
    lora_request: Any = None


class RequestStream:
    """The outputs of one engine request, consumed on the event loop that submitted it.

    Outputs are deltas (each ``RequestOutput`` holds what is new since the previous one), so a consumer that falls
    behind must see all of them: ``next_output`` merges every output that arrived since its previous call into one
    delta (vLLM's output processor does the same for a lagging consumer): a stream whose HTTP response could not
    keep up with the engine sends fewer, multi-token chunks, nothing lost. The outputs wait in a plain list with at
    most one waiting consumer (a future), which is all an ``asyncio.Queue`` would do here at a fraction of its cost
    per token.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, params: SamplingParams | None = None) -> None:
        self.request_id = request_id
        self.loop = loop
        self.params = params  # the request's SamplingParams (metrics: n, max_tokens)
        self._pending: list = []  # RequestOutputs (or one exception, last) not yet returned by next_output
        self._waiter: asyncio.Future | None = None  # the consumer waiting in next_output
        self.finished = False
        # For metrics, written on the event loop only: timestamps (time.monotonic), the finish reasons of the
        # choices finished so far, the tokens received per choice index.
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_reasons: list[str] = []
        self.num_generation_tokens: dict[int, int] = {}

    def _put(self, item: Any) -> None:  # event loop only
        self._pending.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_output(self) -> RequestOutput:
        """Wait for the next output; returns every output that arrived by now merged into one delta.

        Raises:
          EngineDeadError (or the exception the engine raised for this request) when the engine failed.
          StopAsyncIteration after the finished output was returned.
        """
        if self.finished:
            raise StopAsyncIteration
        while not self._pending:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        pending, self._pending = self._pending, []
        item = pending[0]
        for following in pending[1:]:
            if isinstance(item, BaseException):
                break
            if isinstance(following, BaseException):
                item = following
            else:
                item.add(following)  # the outputs belong to this stream alone
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.next_output()


@dataclasses.dataclass
class _AddCommand:
    requests: list[EngineRequest]
    streams: list[RequestStream]
    loop: asyncio.AbstractEventLoop
    admitted: asyncio.Future  # resolved on `loop` with None or an exception


@dataclasses.dataclass
class _AbortCommand:
    request_ids: list[str]


@dataclasses.dataclass
class _ShutdownCommand:
    pass


@dataclasses.dataclass
class _CallCommand:
    """Run ``engine.<method>(*args)`` on the engine thread (e.g. ``add_lora``); the result resolves ``done``."""

    method: str
    args: tuple
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the submitter was cancelled meanwhile; its requests get aborted by it
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


class AsyncEngine:
    """Thread-owning wrapper around an ``LLMEngine`` (its core in this process or in its own).

    Args:
      engine: the engine; after ``start()`` only the engine thread may touch it.
      max_waiting_requests: bound on the engine's waiting queue (None = unbounded).
      on_stats: called on the engine thread with ``engine.stats()`` after every loop iteration (metrics).
      on_output: called on the event loop as ``on_output(stream, request_output, now)`` before the output is queued
        (latency metrics).
      request_logger: called on the event loop as ``request_logger(request_id, prompt, params)`` for every request
        handed to ``add_requests`` (``serving.server_logs.RequestLogger.log``).
    """

    def __init__(self, engine: LLMEngine, *, max_waiting_requests: int | None = None,
                 on_stats: Callable[[dict], None] | None = None,
                 on_output: Callable[[RequestStream, RequestOutput, float], None] | None = None,
                 request_logger: Callable[[str, Any, SamplingParams], None] | None = None) -> None:
        # Every request passes through the waiting queue before its first step, so the bound must admit one.
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1 or None, got {max_waiting_requests}")
        self.engine = engine
        # A core in another process also has to be alive, and is closed after the engine thread stops.
        self._process_engine = None if engine.core_in_process else engine
        self.max_waiting_requests = max_waiting_requests
        self._on_stats = on_stats
        self._on_output = on_output
        self._request_logger = request_logger
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # Guards `_dead` together with enqueueing, so no command can slip into the queue after the dying thread
        # drained it.
        self._lock = threading.Lock()
        self._dead: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        # Groups are admitted without a round trip per request: group id -> the add command, until the engine
        # answers (engine thread only).
        self._admitting: dict[int, _AddCommand] = {}
        self._thread = threading.Thread(target=self._run, name="paged-jax-engine", daemon=True)
        self._started = False
        self.latest_stats: dict = {}
        self.num_steps = 0
        self.num_loop_iterations = 0  # wake-ups of the engine thread; stays flat while idle (no busy spin)

    # ------------------------------------------------------------------------------------ event-loop side API
    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    @property
    def is_healthy(self) -> bool:
        return (self._started and self._dead is None and self._thread.is_alive()
                and (self._process_engine is None or self._process_engine.is_alive()))

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    @property
    def engine_thread_id(self) -> int | None:
        """``threading.get_ident()`` of the engine thread (None before ``start()``)."""
        return self._thread.ident

    @property
    def num_in_flight(self) -> int:
        """Requests the engine thread is currently streaming outputs for (diagnostics)."""
        return len(self._streams)

    def _submit(self, command: Any) -> None:
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"engine is not running: {self._dead}") from self._dead
            self._commands.put(command)
        if self._process_engine is not None:
            self._process_engine.wakeup()  # the engine thread may be waiting for the engine process's next step

    async def add_requests(self, requests: Sequence[EngineRequest]) -> list[RequestStream]:
        """Admit a group of requests atomically (all or none) and return their output streams.

        Raises:
          ValueError: the engine rejected a request (bad sampling parameters, prompt too long, ...).
          EngineOverloadedError: the waiting queue is full.
          EngineDeadError: the engine is not running.
        """
        if not self._started:
            raise EngineDeadError("engine loop was not started")
        loop = asyncio.get_running_loop()
        requests = list(requests)
        if self._request_logger is not None:
            for request in requests:
                self._request_logger(request.request_id, request.prompt, request.params)
        streams = [RequestStream(r.request_id, loop, r.params) for r in requests]
        admitted = loop.create_future()
        self._submit(_AddCommand(requests, streams, loop, admitted))
        try:
            await admitted
        except asyncio.CancelledError:
            # The client went away while we waited for admission: the add may still happen, so abort after it
            # (commands run in order).
            self.abort([r.request_id for r in requests])
            raise
        return streams

    async def call(self, method: str, *args: Any) -> Any:
        """``engine.<method>(*args)`` run on the engine thread between steps (e.g. ``add_lora``, ``remove_lora``);
        returns its result or raises its exception (EngineDeadError when the engine is not running)."""
        if not self._started:
            raise EngineDeadError("engine loop was not started")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._submit(_CallCommand(method, args, loop, done))
        return await done

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); never raises, even if the engine died."""
        try:
            self._submit(_AbortCommand(list(request_ids)))
        except EngineDeadError:
            pass

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread: in-flight requests get EngineDeadError."""
        if not self._started:
            return
        try:
            self._submit(_ShutdownCommand())
        except EngineDeadError:
            pass
        self._thread.join(timeout)
        if self._process_engine is not None:
            self._process_engine.close()

    # ------------------------------------------------------------------------------------ engine-thread side
    def _run(self) -> None:
        try:
            self._publish_stats()
            while True:
                if self.engine.has_unfinished_requests():
                    commands = self._drain()
                else:
                    commands = [self._commands.get()]  # idle: sleep until there is something to do
                    commands += self._drain()
                self.num_loop_iterations += 1
                for command in commands:
                    if isinstance(command, _ShutdownCommand):
                        self._die(EngineDeadError("engine was shut down"), abort_in_engine=True)
                        return
                    if isinstance(command, _AddCommand):
                        self._handle_add(command)
                    elif isinstance(command, _AbortCommand):
                        self._handle_abort(command.request_ids)
                    elif isinstance(command, _CallCommand):
                        self._handle_call(command)
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self.num_steps += 1
                    self._handle_admissions(self.engine.take_admissions())
                    self._dispatch(outputs)
                self._publish_stats()
        except Exception as exc:  # noqa: BLE001 - any engine failure must reach the clients, not kill silently
            logger.exception("engine loop failed")
            self._die(exc, abort_in_engine=True)

    def _drain(self) -> list:
        commands = []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _publish_stats(self) -> None:
        stats = dict(self.engine.stats())
        self.latest_stats = stats
        if self._on_stats is not None:
            self._on_stats(stats)

    def _num_waiting(self) -> int:
        return int(self.engine.stats().get("num_waiting", 0))

    def _handle_add(self, command: _AddCommand) -> None:
        # A core process shared by several API servers checks the bound itself, on its exact waiting count.
        if self.max_waiting_requests is not None and not self.engine.shared_engine_process:
            # Sequences, as a request's n sequences each wait to be scheduled.
            error = waiting_bound_error(self._num_waiting(),
                                        sum(getattr(r.params, "num_sequences", 1) for r in command.requests),
                                        self.max_waiting_requests)
            if error is not None:
                self._call_on_loop(command.loop, _resolve, command.admitted, error)
                return
        self._submit_group(command)
        self._handle_admissions(self.engine.take_admissions())  # a core in this process answers at once

    def _handle_call(self, command: _CallCommand) -> None:
        try:
            result, error = getattr(self.engine, command.method)(*command.args), None
        except EngineDeadError as exc:  # the engine loop dies (every client hears of it), this caller first
            self._call_on_loop(command.loop, _resolve, command.done, EngineDeadError(f"engine is not running: {exc}"))
            raise
        except Exception as exc:  # noqa: BLE001 - the caller's error (e.g. a bad adapter); the engine stays up
            result, error = None, exc

        def resolve(future: asyncio.Future) -> None:
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(result)

        self._call_on_loop(command.loop, resolve, command.done)
    def _submit_group(self, command: _AddCommand) -> None:
        """Hand the group to the engine without waiting; ``_handle_admissions`` resolves it."""
        try:
            for request in command.requests:
                if request.request_id in self._streams:
                    raise ValueError(f"request_id {request.request_id!r} is already in use")
            group_id = self.engine.submit_requests(
                [(r.request_id, r.prompt, r.params, r.priority, r.lora_request) for r in command.requests])
        except EngineDeadError as exc:
            dead = EngineDeadError(f"engine is not running: {exc}")
            self._call_on_loop(command.loop, _resolve, command.admitted, dead)
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the submitter; the engine stays usable
            self._call_on_loop(command.loop, _resolve, command.admitted, exc)
            return
        self._admitting[group_id] = command
        for request, stream in zip(command.requests, command.streams):
            self._streams[request.request_id] = stream

    def _handle_admissions(self, admissions: Sequence[tuple[int, BaseException | None]]) -> None:
        for group_id, error in admissions:
            command = self._admitting.pop(group_id)
            if error is not None:  # the engine refused the whole group: nothing of it runs
                for request in command.requests:
                    self._streams.pop(request.request_id, None)
            self._call_on_loop(command.loop, _resolve, command.admitted, error)

    def _handle_abort(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            if self._streams.pop(request_id, None) is not None:
                self.engine.abort_request(request_id)

    def _call_on_loop(self, loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> bool:
        try:
            loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:  # that event loop is closed: nobody is listening any more
            return False

    def _dispatch(self, outputs: Sequence[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # aborted meanwhile
                continue
            if output.finished:
                del self._streams[output.request_id]
            by_loop.setdefault(stream.loop, []).append((stream, output))
        for loop, items in by_loop.items():
            if not self._call_on_loop(loop, self._deliver, items):
                self._handle_abort([stream.request_id for stream, output in items if not output.finished])

    def _deliver(self, items: list[tuple[RequestStream, RequestOutput]]) -> None:  # event loop
        now = time.monotonic()
        for stream, output in items:
            if self._on_output is not None:
                try:
                    self._on_output(stream, output, now)
                except Exception:  # noqa: BLE001 - metrics must never break delivery
                    logger.exception("on_output callback failed")
            stream._put(output)

    def _die(self, error: BaseException, *, abort_in_engine: bool) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = error
        dead = EngineDeadError(f"engine is not running: {error}")
        dead.__cause__ = error
        pending = self._drain()
        admitting, self._admitting = list(self._admitting.values()), {}
        for command in [*admitting, *pending]:
            if isinstance(command, _AddCommand):
                self._call_on_loop(command.loop, _resolve, command.admitted, dead)
            elif isinstance(command, _CallCommand):
                self._call_on_loop(command.loop, _resolve, command.done, dead)
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            self._call_on_loop(stream.loop, stream._put, dead)
        if abort_in_engine:
            # Best effort: free the engine's blocks of requests nobody will read any more.
            for request_id in streams:
                try:
                    self.engine.abort_request(request_id)
                except Exception:  # noqa: BLE001
                    pass
