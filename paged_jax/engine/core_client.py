"""``EngineCoreProcClient``: ``EngineCore``'s interface over a core in another process (``paged_jax.engine.core_proc``).

``LLMEngine`` drives it as it drives an in-process core: ``add_requests``, ``abort_requests``, ``step`` (the outputs
of every core step finished since the last call), ``stats`` and the core's utilities. What differs:

* ``add_requests(requests, group_id)`` sends the group and returns at once; the core adds it all or none before its
  next step and answers through ``take_admissions()`` after a later ``step()`` (no round trip per request, so running
  streams keep getting tokens while requests arrive); ``wait_for_admission`` waits for one answer;
* ``step()`` blocks for the core's next message while none came and the client's requests are live or messages
  unanswered; it returns early on admissions or ``wakeup()`` (any thread), so new messages need not wait a step;
* a dead core (crash, kill) makes ``step`` and the utilities raise ``EngineProcessDied``; ``close()`` stops it.

``spawn`` starts a core process for this client alone; ``attach`` connects to one pipe of a core process that serves
several clients (``--api-server-count``), which it neither starts nor stops (``close`` detaches; liveness through a
pidfd).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from paged_jax.config import EngineArgs
from paged_jax.engine.exceptions import EngineOverloadedError, EngineProcessDied
from paged_jax.engine.messages import (CORE_MESSAGE_DECODER, AbortRequests, AddRequests, CoreDied, CoreFailed,
                                       EngineCoreInfo, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest,
                                       Shutdown, UtilityCall, encode)
from paged_jax.worker.model_loader import import_tokenizer_library, load_tokenizer, local_tokenizer_path

logger = logging.getLogger(__name__)

# Messages ``step()`` handles without blocking before it returns (bounds the call while the core keeps sending).
_MAX_MESSAGES_PER_CALL = 64


def wait_until_ready(conn, process, start_timeout: float | None) -> EngineCoreInfo:
    """The ``EngineCoreInfo`` of the core's ``CoreReady`` on ``conn``. Raises ValueError (the engine arguments were
    refused: the core's message) or ``EngineProcessDied`` (another failure, a process that exited, or none within
    ``start_timeout`` s; ``process``, if given, is then killed)."""
    try:
        if not conn.poll(start_timeout):
            if process is not None:
                process.kill()
                process.join(5)
            raise EngineProcessDied(f"the engine process did not start within {start_timeout} s")
        message = CORE_MESSAGE_DECODER.decode(conn.recv_bytes())
    except (EOFError, OSError) as exc:
        if process is not None:
            process.join(5)
        raise EngineProcessDied("the engine process exited while starting"
                                + (f" (exit code {process.exitcode})" if process is not None else "")) from exc
    if isinstance(message, CoreFailed):
        if process is not None:
            process.join(10)
        if message.value_error:
            raise ValueError(message.description.split(": ", 1)[-1])
        raise EngineProcessDied(f"the engine process failed to start: {message.description}")
    return message.info


class _EarlyTokenizer:
    """The client's tokenizer loaded on a thread while the core starts, when its directory is known beforehand
    (``local_tokenizer_path``); else the tokenizer's library imported meanwhile (``result`` loads it)."""

    def __init__(self, engine_args: EngineArgs):
        self._args, self._path, self._tokenizer = engine_args, local_tokenizer_path(engine_args), None
        self._thread = threading.Thread(target=self._load, name="paged-jax-tokenizer", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        try:
            if self._path is None:
                import_tokenizer_library()
            else:
                self._tokenizer = load_tokenizer(self._args, self._path)
        except Exception:  # noqa: BLE001 - loaded again by ``result``, which raises it then
            self._path = None

    def result(self, model_path: str | None):
        """The tokenizer ``load_tokenizer`` gives for the core's ``model_path``."""
        self._thread.join()
        same = self._path is not None and (self._args.tokenizer is not None or (
            model_path is not None and os.path.realpath(self._path) == os.path.realpath(model_path)))
        return self._tokenizer if same else load_tokenizer(self._args, model_path)


_LOAD = object()  # EngineCoreProcClient's tokenizer argument: load it


class EngineCoreProcClient:
    """A client of a core in another process (see the module docstring). Build with ``spawn`` or ``attach``.

    Attributes: ``info`` (the core's ``EngineCoreInfo``), ``tokenizer`` (loaded here, as the core's),
    ``engine_args``; ``on_step_stats``: called with each core message's stats, in order (per-step metrics: ``step()``
    may return several steps' outputs at once)."""

    def __init__(self, engine_args: EngineArgs, conn, info: EngineCoreInfo, *, process=None,
                 engine_pid: int | None = None, tokenizer: Any = _LOAD):
        self.engine_args = engine_args
        self.info = info
        self._conn = conn
        self._process = process  # ours to stop (spawn), or None (attach)
        self.shared = process is None  # one of several clients of the core process
        self._engine_pid = process.pid if process is not None else engine_pid
        self._pidfd = None
        if process is None:
            try:
                self._pidfd = os.pidfd_open(engine_pid)  # readable once the process has exited
            except (AttributeError, OSError):  # no pidfd (old kernel): signal 0, as good while the launcher reaps it
                self._pidfd = None
        # The same tokenizer as the core's (already downloaded by it when it comes from the Hub).
        self.tokenizer = load_tokenizer(engine_args, info.model_path) if tokenizer is _LOAD else tokenizer
        self._stats: dict = dict(info.stats)
        self._admitting: dict[int, int] = {}  # group id -> its number of sequences, until the core answers
        self._admissions: list[tuple[int, BaseException | None]] = []
        self._call_ids = itertools.count()
        self._utility_results: dict[int, Any] = {}
        self._num_sent = self._num_applied = 0
        self._pending: list[EngineCoreOutput] = []
        self.on_step_stats: Callable[[dict], None] | None = None
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._wake_writer.setblocking(False)
        self._closed = False
        self._lock = threading.Lock()  # close() may come from another thread than the engine thread

    @classmethod
    def spawn(cls, engine_args: EngineArgs, *, target: Callable, start_timeout: float | None = None,
              args: tuple = ()) -> "EngineCoreProcClient":
        """Start ``target(engine_args, conn, log_level, *args)`` (a module-level function that builds the core and
        runs its loop) in a spawned process and wait until it is ready."""
        context = multiprocessing.get_context("spawn")  # JAX is not fork-safe
        conn, child_conn = context.Pipe(duplex=True)
        log_level = logging.getLogger().getEffectiveLevel()  # the core logs start-up progress at the same level
        process = context.Process(target=target, args=(engine_args, child_conn, log_level, *args), daemon=True,
                                  name="paged-jax-engine")
        started = time.perf_counter()
        process.start()
        logger.info("engine process started (pid %d): loading the model and compiling; its progress follows",
                    process.pid)
        child_conn.close()
        tokenizer = _EarlyTokenizer(engine_args)  # loads while the core starts
        try:
            info = wait_until_ready(conn, process, start_timeout)
        except BaseException:
            conn.close()
            raise
        logger.info("engine process ready in %.1f s", time.perf_counter() - started)
        return cls(engine_args, conn, info, process=process, tokenizer=tokenizer.result(info.model_path))

    @classmethod
    def attach(cls, engine_args: EngineArgs, conn, info: EngineCoreInfo, engine_pid: int) -> "EngineCoreProcClient":
        """A client over one pipe of a running core process serving several clients."""
        return cls(engine_args, conn, info, engine_pid=engine_pid)

    # ------------------------------------------------------------------ EngineCore's interface
    def add_requests(self, requests: Sequence[EngineCoreRequest], group_id: int) -> None:
        """Send a group to be added all or none; its answer comes from ``take_admissions()``."""
        self._send(AddRequests(group_id, list(requests)))
        self._admitting[group_id] = sum((r.sampling_params or r.beam_search_params).num_sequences for r in requests)

    def take_admissions(self) -> list[tuple[int, BaseException | None]]:
        """``(group id, None or the error that refused the whole group)`` for every answer received so far."""
        admissions, self._admissions = self._admissions, []
        return admissions

    def wait_for_admission(self, group_id: int) -> BaseException | None:
        """Wait for the answer to group ``group_id`` (other messages are kept for ``step()``)."""
        while True:
            for i, (answered, error) in enumerate(self._admissions):
                if answered == group_id:
                    del self._admissions[i]
                    return error
            self._handle(self._recv())

    def abort_requests(self, request_ids: Iterable[str] = (), sequences: Iterable[tuple[str, int]] = ()) -> None:
        request_ids, sequences = list(request_ids), [tuple(s) for s in sequences]
        if request_ids or sequences:
            self._send(AbortRequests(request_ids, sequences))

    def step(self) -> list[EngineCoreOutput]:
        """The outputs of every core step finished since the last call (see the module docstring)."""
        while True:
            for _ in range(_MAX_MESSAGES_PER_CALL):  # whatever is already there, without blocking
                if not self._conn.poll():
                    break
                self._handle(self._recv())
            if self._pending or self._admissions or self.core_is_idle():
                break
            ready = multiprocessing.connection.wait([self._conn, self._wake_reader])
            if self._wake_reader in ready:
                self._take_wakeups()
                if self._conn not in ready:
                    break  # the caller has messages to send
        outputs, self._pending = self._pending, []
        return outputs

    def core_is_idle(self) -> bool:
        """The core has applied every message sent and holds none of this client's requests: it sends nothing more
        until a new message."""
        return self._num_applied == self._num_sent and self._stats.get("num_unfinished_requests", 0) == 0

    def has_unanswered_messages(self) -> bool:
        return self._num_applied != self._num_sent

    def stats(self) -> dict:
        """The core's latest stats; sequences sent but not yet answered count as waiting."""
        stats = dict(self._stats)
        stats["num_waiting"] = int(stats.get("num_waiting", 0)) + sum(self._admitting.values())
        return stats

    def add_lora(self, lora_request) -> bool:
        return self._call("add_lora", lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._call("remove_lora", lora_id)

    def list_loras(self) -> set[int]:
        return set(self._call("list_loras"))

    def reset_prefix_cache(self) -> bool:
        return self._call("reset_prefix_cache")

    # RL rollouts (paged_jax.engine.rollout_control), run by the core process between steps.
    def update_weights(self, params) -> None:
        raise ValueError("update_weights: the engine core runs in another process, where in-memory parameters "
                         "cannot go; use update_weights_from_disk")

    def update_weights_from_disk(self, path: str) -> None:
        self._call("update_weights_from_disk", str(path))

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("init_weight_transfer_engine", dict(init_info))

    def update_weights_from_distributed(self, names: list[str], dtype_names: list[str], shapes: list) -> None:
        self._call("update_weights_from_distributed", list(names), list(dtype_names), [list(s) for s in shapes])

    def sleep(self, level: int = 1) -> dict:
        return self._call("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._call("wake_up", tags)

    def is_sleeping(self) -> bool:
        return self._call("is_sleeping")

    def pause_generation(self, mode: str = "abort") -> None:
        self._call("pause_generation", mode)

    def resume_generation(self) -> None:
        self._call("resume_generation")

    def is_paused(self) -> bool:
        return self._call("is_paused")

    def _call(self, method: str, *args: Any) -> Any:
        call_id = next(self._call_ids)
        self._send(UtilityCall(call_id, method, list(args)))
        while call_id not in self._utility_results:  # step results may arrive first: kept for step()
            self._handle(self._recv())
        result = self._utility_results.pop(call_id)
        if result.error is not None:
            raise ValueError(result.error)
        return result.result

    # ------------------------------------------------------------------ the process
    def wakeup(self) -> None:
        """Make a ``step()`` blocked on the core return now (safe from any thread)."""
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

    def is_alive(self) -> bool:
        """Whether the core's process is running (safe from any thread; ``/health`` asks it)."""
        if self._closed:
            return False
        if self._process is not None:
            return self._process.is_alive()
        if self._pidfd is not None:
            return not select.select([self._pidfd], [], [], 0)[0]
        try:
            os.kill(self._engine_pid, 0)
            return True
        except OSError:
            return False

    @property
    def pid(self) -> int | None:
        return self._engine_pid

    def close(self, timeout: float = 30.0) -> None:
        """Stop a spawned core (after its current step) and reap it; detach from an attached one."""
        with self._lock:
            closed_elsewhere, self._closed = self._closed, True
        if closed_elsewhere:
            if self._process is not None:
                # Return once the core has exited, so that the server does not exit before its engine (a multi-host
                # node 0 still shuts the other nodes down at its exit).
                self._process.join(timeout)
            return
        try:
            self._conn.send_bytes(encode(Shutdown()))
        except (OSError, ValueError):
            pass
        if self._process is not None:
            self._process.join(timeout)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(5)
        self._conn.close()
        self._wake_reader.close()
        self._wake_writer.close()
        if self._pidfd is not None:
            os.close(self._pidfd)

    # ------------------------------------------------------------------ internals
    def _send(self, message) -> None:
        try:
            self._conn.send_bytes(encode(message))
        except (OSError, ValueError) as exc:
            raise EngineProcessDied(f"the engine process is gone ({exc})") from exc
        self._num_sent += 1

    def _recv(self):
        try:
            message = CORE_MESSAGE_DECODER.decode(self._conn.recv_bytes())
        except (EOFError, OSError) as exc:
            code = self._process.exitcode if self._process is not None else None
            raise EngineProcessDied(f"the engine process exited (exit code {code})") from exc
        if isinstance(message, CoreDied):
            raise EngineProcessDied(f"the engine process failed: {message.description}")
        if not isinstance(message, EngineCoreOutputs):
            raise EngineProcessDied(f"unexpected message from the engine process: {type(message).__name__}")
        return message

    def _handle(self, message: EngineCoreOutputs) -> None:
        self._num_applied = message.num_messages
        self._stats = message.stats
        if self.on_step_stats is not None:
            self.on_step_stats(self._stats)
        for admission in message.admissions:
            self._admitting.pop(admission.group_id, None)
            error = None
            if admission.error is not None:
                error = (EngineOverloadedError(admission.error) if admission.overloaded
                         else ValueError(admission.error))
            self._admissions.append((admission.group_id, error))
        for result in message.utility_results:
            self._utility_results[result.call_id] = result
        self._pending += message.outputs
