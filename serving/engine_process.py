"""The engine in its own process, behind a proxy with ``LLMEngine``'s interface.

Why a process: the engine is host bound on a GPU (every step is Python scheduling plus the launch of a few hundred
kernels), and a server that streams a chunk per token per client keeps its event loop busy in Python too. In one
process both share one GIL, and every millisecond the event loop holds it is taken from the engine: on the H200 the
server measured well below the offline engine's tok/s at 64 streams (benchmarks/RESULTS.md). vLLM runs its EngineCore
apart from the API server for the same reason.

``EngineProcessClient(engine_args)`` spawns the child, which builds the ``LLMEngine`` and then loops on its own:
while it has unfinished requests it steps without waiting for anyone, applying every command that arrived during a
step before the next one (a burst of arrivals joins one step, not one step each); idle, it blocks on the command
pipe. It sends one message per step: the step's outputs, which are deltas already (new token ids, new text, new
logprobs, finish state), compactly (the prompt only with a request's first output; plain running streams' deltas
as ``paged_jax.engine.step_outputs.StreamDeltas`` columns, not one ``RequestOutput`` each), the engine's stats and the
number of commands applied so far. The client turns them back into delta ``RequestOutput`` objects, accumulating
nothing.

The client is used exactly like an ``LLMEngine`` by one thread (``serving.async_engine.AsyncEngine``'s engine thread).
It implements ``serving.engine_client.ProcessEngineClient``:

* ``submit_requests([(id, prompt, params, priority[, lora_request])])`` sends a group without waiting; the child
  adds it all or none and answers before its next step; ``take_admissions()`` hands the answers over after a
  ``step()``. There is no round trip per request, so the engine keeps stepping (and running streams keep getting
  their tokens) while requests arrive. ``add_request`` is the same for one request, waiting for its answer (it
  raises the child's ValueError);
* ``step()`` returns the outputs of every step the child finished since the last call, blocking for one if none
  (each step's deltas in order, so several steps' outputs of one request follow each other); it returns early when
  admissions were answered;
* ``abort_request`` is fire-and-forget; ``stats()`` is the child's latest, with requests sent but not yet answered
  counted as waiting; ``has_unfinished_requests()`` is true while requests are live (added, neither finished nor
  aborted) or commands unanswered. Commands that leave the child idle are answered at once with its stats, so after
  the last abort one more ``step()`` brings the freed blocks into the metrics without any further request;
* a dead child (crash, kill) makes ``step`` / ``add_request`` raise ``EngineProcessDied``; ``close()`` stops it.

Requests and outputs cross the pipe pickled (``SamplingParams`` and the output dataclasses are plain data).

Start-up progress: the child logs to its stderr (inherited from the server) at the parent's log level, each line
prefixed ``(EngineCore pid=N)`` as vLLM's engine process does: model resolution and loading (Hub download bars,
weight loading bar or weights-cache restore), the KV pool size, the compile count and a ``Compiling step executables``
progress bar (bucket i of N; shown when the level is INFO or lower), then "engine ready".
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import socket
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable, Sequence

from paged_jax.outputs import CompletionOutput, RequestOutput
from paged_jax.engine.step_outputs import StreamDeltas
from serving.async_engine import EngineDeadError
from serving.lifecycle import freeze_gc_heap
from serving.server_logs import quiet_library_loggers

if TYPE_CHECKING:
    from paged_jax.config import EngineArgs

logger = logging.getLogger(__name__)


# Messages ``step()`` handles without blocking before it returns (bounds the call while the child keeps sending).
_MAX_MESSAGES_PER_CALL = 64


class EngineProcessDied(EngineDeadError):
    """The engine process exited or stopped answering (an ``EngineDeadError``: the engine loop dies with it)."""


# ------------------------------------------------------------------------------------------------ child side
CHILD_LOG_FORMAT = "%(asctime)s %(levelname)s (EngineCore pid=%(process)d) %(name)s: %(message)s"


def _child_main(engine_args, conn, log_level: int = logging.WARNING,
                engine_factory: Callable | None = None) -> None:  # runs in the spawned process
    engine = start_child_engine(engine_args, conn, log_level, engine_factory)
    if engine is None:
        return
    prompt_sent: set[str] = set()  # unfinished requests whose prompt went with an earlier output
    num_commands = 0  # commands applied so far; every message reports it, so the parent knows what it reflects
    sender = _Sender(conn)
    try:
        while True:
            # Busy: every command that arrived during the last step, without waiting. Idle: sleep until one comes.
            messages = [] if engine.has_unfinished_requests() else [conn.recv()]
            while conn.poll():
                messages.append(conn.recv())
            admissions = []
            for message in messages:
                kind = message[0]
                if kind == "shutdown":
                    return
                num_commands += 1
                if kind == "add":
                    admissions.append((message[1], _add_group(engine, message[2])))
                elif kind == "abort":
                    engine.abort_request(message[1])
                    prompt_sent.difference_update(message[1])
                elif kind == "call":  # an engine method with an answer (add_lora, remove_lora, list_loras)
                    try:
                        sender.send(("called", getattr(engine, message[1])(*message[2]), None))
                    except Exception as exc:  # noqa: BLE001 - the caller's error; the engine stays up
                        sender.send(("called", None, exc if _picklable(exc) else ValueError(str(exc))))
            busy = engine.has_unfinished_requests()
            if admissions or (messages and not busy):
                # Admissions are answered before the step (a client gets its response headers without waiting for
                # one); commands that leave the engine idle are answered at once, with the stats they produced.
                sender.send(("state", num_commands, admissions, [], dict(engine.stats()), None))
            if busy:
                stream_deltas = StreamDeltas()
                outputs = engine.step(stream_deltas=stream_deltas)
                sender.send(("state", num_commands, [], pack_step(outputs, prompt_sent), dict(engine.stats()),
                             stream_deltas.to_wire() if stream_deltas else None))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return  # the parent went away
    except BaseException as exc:  # noqa: BLE001 - the parent turns it into EngineDeadError for every client
        try:
            sender.send(("died", _describe(exc)))
        except BrokenPipeError:
            pass
    finally:
        sender.close()


def start_child_engine(engine_args, conn, log_level: int, engine_factory: Callable | None):
    """In a spawned engine process: set up logging, build the engine and send ``("ready", info)`` on ``conn`` (info:
    max_model_len, vocab_size, generation_config, model_path, stats), and return it; on failure send ``("failed",
    description, is_value_error)`` instead and return None."""
    # A spawned process starts without the parent's logging set-up: log start-up progress to the inherited stderr.
    logging.basicConfig(level=log_level, format=CHILD_LOG_FORMAT, stream=sys.stderr, force=True)
    quiet_library_loggers()
    try:
        if engine_factory is None:
            from paged_jax.parallel.data_parallel import create_engine as engine_factory

        engine = engine_factory(engine_args, use_tqdm=log_level <= logging.INFO)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("failed", _describe(exc), isinstance(exc, ValueError)))
        return None
    freeze_gc_heap()
    conn.send(("ready", {"max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size,
                         "generation_config": engine.generation_config,
                         "model_path": engine.model_path,
                         "stats": dict(engine.stats())}))
    return engine


def wait_until_ready(conn, process, start_timeout: float | None) -> dict:
    """The ready info ``start_child_engine`` sends on ``conn`` (the parent's end). Raises ValueError (the engine
    arguments were rejected: the child's message) or ``EngineProcessDied`` (another failure, a child that exited,
    or none within ``start_timeout`` s; the child is then killed)."""
    try:
        if not conn.poll(start_timeout):
            process.kill()
            process.join(5)
            raise EngineProcessDied(f"the engine process did not start within {start_timeout} s")
        message = conn.recv()
    except (EOFError, OSError) as exc:
        process.join(5)
        raise EngineProcessDied(f"the engine process exited while starting (exit code {process.exitcode})") from exc
    if message[0] == "failed":
        process.join(10)
        if message[2]:
            raise ValueError(message[1].split(": ", 1)[-1])
        raise EngineProcessDied(f"the engine process failed to start: {message[1]}")
    return message[1]


class _Sender:
    """Sends the child's messages from a thread of its own, in order: the engine loop never waits on the pipe (a
    parent busy serving HTTP may read late) and pickling overlaps the next step's device time."""

    def __init__(self, conn) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BrokenPipeError | None = None
        self._thread = threading.Thread(target=self._run, name="paged-jax-engine-sender", daemon=True)
        self._thread.start()

    def send(self, message: tuple) -> None:
        """Queue ``message``; raises BrokenPipeError once the parent is gone."""
        if self._error is not None:
            raise self._error
        self._queue.put(message)

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (message := self._queue.get()) is not None:
            try:
                self._conn.send(message)
            except (OSError, ValueError) as exc:
                self._error = BrokenPipeError(f"the parent is gone ({exc})")
                return


def _add_group(engine, requests: list[tuple]) -> BaseException | None:
    """Add ``[(request_id, prompt, params, priority[, lora_request])]`` all or none: the error of the first bad
    request (the ones added before it are aborted), or None."""
    added = []
    try:
        for request_id, prompt, params, priority, *lora_request in requests:
            lora = {"lora_request": lora_request[0]} if lora_request and lora_request[0] is not None else {}
            engine.add_request(request_id, prompt, params, priority=priority, **lora)
            added.append(request_id)
    except Exception as exc:  # noqa: BLE001 - the caller's error (bad request), not the engine's
        engine.abort_request(added)
        return exc if _picklable(exc) else ValueError(str(exc))
    return None


def pack_step(outputs: list[RequestOutput], prompt_sent: set[str]) -> list[tuple]:
    """One step's delta outputs as the wire message carries them (``_pack`` each)."""
    return [_pack(output, prompt_sent) for output in outputs]


def _pack(output: RequestOutput, prompt_sent: set[str]) -> tuple:
    """A delta ``RequestOutput`` as plain tuples for the pipe; the prompt goes with the request's first output only."""
    completions = [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason)
                   for c in output.outputs]
    head = None
    if output.request_id not in prompt_sent:
        head = (output.prompt, output.prompt_token_ids)
        prompt_sent.add(output.request_id)
    if output.finished:
        prompt_sent.discard(output.request_id)
    return (output.request_id, head, completions, output.finished, output.num_cached_tokens, output.metrics,
            output.prompt_logprobs)


def _describe(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def _picklable(exc: BaseException) -> bool:
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return True
    except Exception:  # noqa: BLE001
        return False


# ----------------------------------------------------------------------------------------------- parent side
class EngineProcessClient:
    """``LLMEngine``'s interface (``ProcessEngineClient``) over an engine running in a spawned child process (see
    the module docstring).

    Args:
      engine_args: ``EngineArgs`` for the child's ``LLMEngine``.
      start_timeout: seconds to wait for the child to load the model and compile (None: no limit).
      engine_factory: builds the child's engine as ``engine_factory(engine_args, use_tqdm=bool)``; a picklable
        module-level callable (default ``paged_jax.parallel.data_parallel.create_engine``; benchmarks/serving_host.py passes
        a model-free engine to measure the serving path alone).
    Raises:
      ValueError: the child rejected ``engine_args`` (its message).
      EngineProcessDied: the child failed otherwise or did not start in time.
    """

    def __init__(self, engine_args: EngineArgs, *, start_timeout: float | None = None,
                 engine_factory: Callable | None = None):
        context = multiprocessing.get_context("spawn")  # JAX is not fork-safe
        self._conn, child_conn = context.Pipe(duplex=True)
        log_level = logging.getLogger().getEffectiveLevel()  # the child logs start-up progress at the same level
        self._process = context.Process(target=_child_main, args=(engine_args, child_conn, log_level, engine_factory),
                                        daemon=True, name="paged-jax-engine")
        started = time.perf_counter()
        self._process.start()
        logger.info("engine process started (pid %d): loading the model and compiling; its progress follows",
                    self._process.pid)
        child_conn.close()
        try:
            info = wait_until_ready(self._conn, self._process, start_timeout)
        except BaseException:
            self._conn.close()
            raise
        self._setup(engine_args, info)
        logger.info("engine process ready in %.1f s", time.perf_counter() - started)

    def _setup(self, engine_args: EngineArgs, info: dict) -> None:
        """The client's state once the engine is ready (``info``: ``start_child_engine``'s ready info)."""
        self.engine_args = engine_args
        self.max_model_len = int(info["max_model_len"])
        self.vocab_size = int(info["vocab_size"])
        self.model_path = info["model_path"]
        self.generation_config: dict = dict(info["generation_config"])
        self._stats: dict = dict(info["stats"])
        from paged_jax.worker.model_loader import load_tokenizer

        # The same tokenizer as the child's (already downloaded by it when it comes from the Hub).
        self.tokenizer = load_tokenizer(engine_args, self.model_path)
        # Added, neither finished nor aborted: request id -> (prompt, prompt_token_ids) once its first output came.
        self._live: dict[str, tuple[str | None, list[int]] | None] = {}
        self._admitting: dict[int, list[str]] = {}  # group id -> its request ids, until the child answers
        self._admissions: list[tuple[int, BaseException | None]] = []  # answers not yet taken
        self._next_group_id = 0
        self._num_commands_sent = 0
        self._num_commands_applied = 0  # by the child, as of its latest message
        self._pending_outputs: list = []
        # Called on the engine thread with each child step's stats, in order (per-step metrics such as tokens per
        # step: ``step()`` may return several steps' outputs at once).
        self.on_step_stats: Callable[[dict], None] | None = None
        # ``wakeup()`` (any thread) makes a blocked ``step()`` return, so new commands need not wait for a step.
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._wake_writer.setblocking(False)
        self._closed = False
        self._lock = threading.Lock()  # close() may come from another thread than the engine thread

    # ------------------------------------------------------------------ LLMEngine interface (one thread)
    def submit_requests(self, requests: Sequence[tuple]) -> int:
        """Send ``[(request_id, prompt, params, priority[, lora_request])]`` to the child without waiting: the child
        adds them all or none before its next step and answers through ``take_admissions()``; returns the group's
        id.

        Raises:
          ValueError: a request id is already in use (nothing was sent).
          EngineProcessDied: the child is gone.
        """
        request_ids = [request[0] for request in requests]
        for request_id in request_ids:
            if request_id in self._live:
                raise ValueError(f"request_id {request_id!r} is already in use")
        group_id = self._next_group_id
        self._next_group_id += 1
        self._send(("add", group_id, [tuple(request) for request in requests]))
        self._admitting[group_id] = request_ids
        for request_id in request_ids:
            self._live[request_id] = None
        return group_id

    def take_admissions(self) -> list[tuple[int, BaseException | None]]:
        """The child's answers to ``submit_requests`` received so far: ``(group id, None or the error that refused
        the whole group)``. A refused group's requests are no longer live; an admitted one's outputs come from
        ``step()``."""
        admissions, self._admissions = self._admissions, []
        return admissions

    def add_request(self, request_id: str, prompt: Any, params: Any = None, priority: int = 0,
                    lora_request: Any = None) -> None:
        """Queue a request in the child and wait for its answer (raises the child's ValueError)."""
        group_id = self.submit_requests([(request_id, prompt, params, priority, lora_request)])
        while True:  # step results may arrive first: keep them for step()
            for i, (answered, error) in enumerate(self._admissions):
                if answered == group_id:
                    del self._admissions[i]
                    if error is not None:
                        raise error
                    return
            self._handle(self._recv())

    def add_lora(self, lora_request: Any) -> bool:
        """``LLMEngine.add_lora`` in the child (raises its ValueError)."""
        return self._call("add_lora", lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._call("remove_lora", lora_id)

    def list_loras(self) -> set[int]:
        return self._call("list_loras")

    def _call(self, method: str, *args: Any) -> Any:
        self._send(("call", method, args))
        while True:  # step results may arrive first: keep them for step()
            message = self._recv()
            if message[0] == "called":
                if message[2] is not None:
                    raise message[2]
                return message[1]
            self._handle(message)

    def abort_request(self, request_id) -> None:
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        request_ids = [r for r in request_ids if r in self._live]
        if not request_ids:
            return
        for r in request_ids:
            del self._live[r]
        self._send(("abort", request_ids))

    def step(self) -> list[RequestOutput]:
        """The delta outputs of every step the child finished since the last call. Blocks for the child's next
        message while there are none and requests are live or commands unanswered; returns early (maybe with no
        outputs) when admissions were answered, the child has applied every command, or ``wakeup()`` was called."""
        while True:
            for _ in range(_MAX_MESSAGES_PER_CALL):  # whatever is already there, without blocking
                if not self._conn.poll():
                    break
                self._handle(self._recv())
            if self._pending_outputs or self._admissions or not self.has_unfinished_requests():
                break
            if (self._num_commands_applied == self._num_commands_sent
                    and self._stats.get("num_unfinished_requests") == 0):
                # The child has applied every command and holds nothing, so whatever is still live here ended
                # without an output; never block on a child that will not step again.
                logger.warning("engine process holds none of %d live requests; dropping them", len(self._live))
                self._live.clear()
                break
            ready = multiprocessing.connection.wait([self._conn, self._wake_reader])
            if self._wake_reader in ready:
                self._take_wakeups()
                if self._conn not in ready:
                    break  # the caller has commands to send
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def wakeup(self) -> None:
        """Make a ``step()`` blocked on the child return now (safe from any thread): the caller has queued commands
        that should reach the child before its next step."""
        try:
            self._wake_writer.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already signalled (buffer full) or closed

    def _take_wakeups(self) -> None:
        try:
            while self._wake_reader.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def has_unfinished_requests(self) -> bool:
        """Live requests, or commands the child has not answered yet (after the last abort, ``step()`` returns
        once the child has applied it, with its stats)."""
        return bool(self._live) or self._num_commands_applied != self._num_commands_sent

    def get_num_unfinished_requests(self) -> int:
        return len(self._live)

    def get_tokenizer(self):
        return self.tokenizer

    def stats(self) -> dict:
        stats = dict(self._stats)
        # Requests sent but not yet answered are waiting as far as admission control is concerned.
        stats["num_waiting"] = int(stats.get("num_waiting", 0)) + sum(map(len, self._admitting.values()))
        return stats

    def close(self, timeout: float = 30.0) -> None:
        """Stop the child (after its current step) and reap it."""
        with self._lock:
            closed_elsewhere = getattr(self, "_closed", False)
            self._closed = True
        if closed_elsewhere:
            # Return once the child has exited, so that the server does not exit before its engine (a multi-host
            # node 0 still shuts the other nodes down at its exit).
            self._process.join(timeout)
            return
        try:
            self._conn.send(("shutdown",))
        except (OSError, ValueError):
            pass
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._conn.close()
        self._wake_reader.close()
        self._wake_writer.close()

    def is_alive(self) -> bool:
        """Whether the child process is running (safe from any thread; ``/health`` asks it)."""
        return not self._closed and self._process.is_alive()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _exit_code(self) -> int | None:
        return self._process.exitcode

    # ------------------------------------------------------------------ internals
    def _send(self, message) -> None:
        try:
            self._conn.send(message)
        except (OSError, ValueError) as exc:
            raise EngineProcessDied(f"the engine process is gone ({exc})") from exc
        self._num_commands_sent += 1

    def _recv(self):
        try:
            message = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise EngineProcessDied(f"the engine process exited (exit code {self._exit_code()})") from exc
        if message[0] == "died":
            raise EngineProcessDied(f"the engine process failed: {message[1]}")
        return message

    def _handle(self, message) -> None:
        if message[0] != "state":
            raise EngineProcessDied(f"unexpected message from the engine process: {message[0]!r}")
        _, self._num_commands_applied, admissions, deltas, self._stats, stream_deltas = message
        if self.on_step_stats is not None:
            self.on_step_stats(self._stats)
        for group_id, error in admissions:
            request_ids = self._admitting.pop(group_id)
            if error is not None:
                for request_id in request_ids:
                    self._live.pop(request_id, None)
            self._admissions.append((group_id, error))
        for delta in deltas:
            output = self._rebuild(delta)
            if output is not None:
                self._pending_outputs.append(output)
        if stream_deltas is not None:  # rows of requests whose first output came earlier: their prompt is known
            self._pending_outputs += StreamDeltas.from_wire(stream_deltas).request_outputs(self._live)

    def _rebuild(self, packed: tuple) -> RequestOutput | None:
        """The delta ``RequestOutput`` that ``_pack`` packed; None for a request aborted here meanwhile."""
        request_id, head, completions, finished, num_cached_tokens, metrics, prompt_logprobs = packed
        if request_id not in self._live:
            return None
        if head is not None:
            self._live[request_id] = head
        prompt, prompt_token_ids = self._live[request_id]
        if finished:
            del self._live[request_id]
        outputs = [CompletionOutput(index=index, text=text, token_ids=token_ids, cumulative_logprob=cumulative_logprob,
                                    logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason)
                   for index, text, token_ids, cumulative_logprob, logprobs, finish_reason, stop_reason in completions]
        return RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
                             outputs=outputs, finished=finished, num_cached_tokens=num_cached_tokens, metrics=metrics,
                             prompt_logprobs=prompt_logprobs)


def engine_process_enabled(flag: bool | None) -> bool:
    """The CLI flag, else ``PAGED_JAX_ENGINE_PROCESS`` (``0`` = a thread); on by default: the server streams more
    tokens per second with the engine in its own process than on a thread of the server process
    (benchmarks/RESULTS.md, "Server")."""
    if flag is not None:
        return bool(flag)
    return os.environ.get("PAGED_JAX_ENGINE_PROCESS", "1") != "0"
