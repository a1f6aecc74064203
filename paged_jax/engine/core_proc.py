"""The engine core in its own process: one loop serving one or more clients over pipes, msgspec on the wire.

Why a process: the engine is host bound on a GPU (every step is Python scheduling plus the launch of a few hundred
kernels), and a server streaming a chunk per token per client keeps its event loop busy in Python too; in one
process both share one GIL. vLLM runs its EngineCore apart from the API server for the same reason.

``EngineCoreProc.run`` is the loop, for one client (``paged-jax serve``) or several (``--api-server-count``):

* idle, it sleeps until a message comes from any client; busy, it applies every message that arrived from any
  client during a step before the next one (a burst of arrivals joins one step);
* with several clients, request ids are tagged with the client's index inside the core (``"<index>:<id>"``), so
  two clients may use the same id;
* after each step every engaged client (has requests in the core, or messages not yet reported) gets one
  ``EngineCoreOutputs`` with only its own requests' outputs, the core's stats and the answers to its messages;
  messages that leave the core idle, or add requests, are answered at once (before the step);
* ``admission_check`` (the server's ``--max-waiting-requests``, where the waiting count is exact) may refuse a group;
* a client that sends ``Shutdown`` or whose pipe closes is detached: its requests are aborted, their blocks freed.
  ``control``: a pipe whose ``Shutdown`` (or closing) ends the loop (the launcher of several API servers).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.connection
import queue
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import msgspec

from paged_jax.engine.exceptions import EngineOverloadedError
from paged_jax.engine.messages import (CLIENT_MESSAGE_DECODER, AbortRequests, AddRequests, Admission, CoreDied,
                                       CoreFailed, CoreReady, EngineCoreOutput, EngineCoreOutputs, Shutdown,
                                       UtilityCall, UtilityResult, encode)

logger = logging.getLogger(__name__)

CORE_LOG_FORMAT = "%(asctime)s %(levelname)s (EngineCore pid=%(process)d) %(name)s: %(message)s"


class Sender:
    """Sends one end's encoded messages from a thread of its own, in order: the loop never waits on the pipe (a
    reader busy serving HTTP may read late) and the write overlaps the next step's device time."""

    def __init__(self, conn) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BrokenPipeError | None = None
        self._thread = threading.Thread(target=self._run, name="paged-jax-core-sender", daemon=True)
        self._thread.start()

    def send(self, message) -> None:
        """Encode and queue ``message``; raises BrokenPipeError once the other end is gone."""
        if self._error is not None:
            raise self._error
        self._queue.put(encode(message))

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            try:
                self._conn.send_bytes(data)
            except (OSError, ValueError) as exc:
                self._error = BrokenPipeError(f"the other end is gone ({exc})")
                return


def describe(exc: BaseException) -> str:
    """``"Type: message"`` of an exception (what crosses the wire of a failure)."""
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


@dataclasses.dataclass(eq=False)
class _Client:
    index: int
    conn: Any  # multiprocessing.connection.Connection
    sender: Sender
    owned: dict[str, str] = dataclasses.field(default_factory=dict)  # the client's request id -> the core's
    num_messages: int = 0  # messages applied so far
    num_reported: int = 0  # ... as of the latest message sent
    attached: bool = True
    admissions: list[Admission] = dataclasses.field(default_factory=list)
    utility_results: list[UtilityResult] = dataclasses.field(default_factory=list)


class EngineCoreProc:
    """The loop of a core in its own process (see the module docstring).

    Args:
      core: an ``EngineCore`` (or ``DataParallelCore``).
      client_conns: one pipe end per client.
      control: the launcher's pipe end, or None (then the loop ends when its only client leaves).
      admission_check: ``(core stats, number of sequences of a group) -> EngineOverloadedError | None``.
      on_stats: called with the core's stats after each step and after messages that leave it idle.
    """

    def __init__(self, core, client_conns: list, control=None, *,
                 admission_check: Callable[[dict, int], EngineOverloadedError | None] | None = None,
                 on_stats: Callable[[dict], None] | None = None) -> None:
        self.core = core
        self.control = control
        self.clients = [_Client(index, conn, Sender(conn)) for index, conn in enumerate(client_conns)]
        self._tagged = len(client_conns) > 1
        self.owner: dict[str, tuple[_Client, str]] = {}  # the core's request id -> (client, the client's id)
        self._admission_check = admission_check
        self._on_stats = on_stats

    # --------------------------------------------------------------------------------------- messages
    def _apply(self, client: _Client, message) -> None:
        if isinstance(message, Shutdown):
            self._detach(client)
            return
        client.num_messages += 1
        if isinstance(message, AddRequests):
            error = self._add(client, message.requests)
            client.admissions.append(Admission(message.group_id, None if error is None else str(error),
                                               isinstance(error, EngineOverloadedError)))
        elif isinstance(message, AbortRequests):
            self._abort(client, message.request_ids, message.sequences)
        elif isinstance(message, UtilityCall):
            try:
                result = getattr(self.core, message.method)(*message.args)
                client.utility_results.append(UtilityResult(message.call_id, result))
            except ValueError as exc:  # the caller's error; the core stays up
                client.utility_results.append(UtilityResult(message.call_id, error=str(exc)))

    def _add(self, client: _Client, requests: list) -> BaseException | None:
        if self._admission_check is not None:
            error = self._admission_check(self.core.stats(), sum(_num_sequences(r) for r in requests))
            if error is not None:
                return error
        core_ids = [self._core_id(client, r.request_id) for r in requests]
        if self._tagged:
            requests = [msgspec.structs.replace(r, request_id=core_id) for r, core_id in zip(requests, core_ids)]
        try:
            self.core.add_requests(requests)
        except ValueError as exc:  # the client's error (a bad adapter, grammar, a duplicate id)
            return exc
        for request, core_id in zip(requests, core_ids):
            client_id = request.request_id if not self._tagged else core_id.split(":", 1)[1]
            client.owned[client_id] = core_id
            self.owner[core_id] = (client, client_id)
        return None

    def _core_id(self, client: _Client, request_id: str) -> str:
        return f"{client.index}:{request_id}" if self._tagged else request_id

    def _abort(self, client: _Client, request_ids, sequences=()) -> None:
        core_ids = [client.owned.pop(r) for r in request_ids if r in client.owned]
        for core_id in core_ids:
            del self.owner[core_id]
        sequences = [(r, self._core_id(client, r), i) for r, i in sequences if r in client.owned]
        self.core.abort_requests(core_ids, [(core_id, i) for _, core_id, i in sequences])
        for client_id, core_id, _ in sequences:
            if not self.core.has_request(core_id):  # its last live sequence: no output will say it ended
                del client.owned[client_id]
                self.owner.pop(core_id, None)

    def _detach(self, client: _Client) -> None:
        """The client left (``Shutdown``) or is gone: its requests end, their blocks are freed."""
        if not client.attached:
            return
        client.attached = False
        self._abort(client, list(client.owned))
        client.sender.close(timeout=1.0)
        client.conn.close()

    def _send(self, client: _Client, outputs: list[EngineCoreOutput], stats: dict) -> None:
        message = EngineCoreOutputs(outputs, {**stats, "num_unfinished_requests": len(client.owned)},
                                    client.num_messages, client.admissions, client.utility_results)
        client.admissions, client.utility_results = [], []
        client.num_reported = client.num_messages
        try:
            client.sender.send(message)
        except BrokenPipeError:  # that client is gone; the others go on
            self._detach(client)

    # --------------------------------------------------------------------------------------- the loop
    def _read(self, busy: bool) -> tuple[bool, list[_Client]]:
        """Apply what arrived (waiting for something while idle); ``(stop the loop, clients that sent)``."""
        attached = [client for client in self.clients if client.attached]
        if not attached and self.control is None:
            return True, []
        waitables = [c.conn for c in attached] + ([self.control] if self.control is not None else [])
        ready = multiprocessing.connection.wait(waitables, timeout=0 if busy else None)
        if self.control is not None and self.control in ready:
            try:
                if isinstance(CLIENT_MESSAGE_DECODER.decode(self.control.recv_bytes()), Shutdown):
                    return True, []
            except (EOFError, OSError):
                return True, []  # the launcher is gone
        sent = []
        for client in attached:
            if client.conn not in ready:
                continue
            sent.append(client)
            try:
                while client.attached and client.conn.poll():
                    self._apply(client, CLIENT_MESSAGE_DECODER.decode(client.conn.recv_bytes()))
            except (EOFError, OSError):  # its process exited
                self._detach(client)
        return False, sent

    def run(self) -> None:
        """Serve until the control pipe (or, without one, every client) says stop."""
        core = self.core
        while True:
            stop, sent = self._read(core.has_unfinished_requests())
            if stop:
                return
            busy = core.has_unfinished_requests()
            if sent and not busy:
                stats = dict(core.stats())
                self._publish(stats)
            for client in sent:
                # Admissions are answered before the step; messages that leave the core idle at once.
                if client.attached and (client.admissions or client.utility_results or not busy):
                    self._send(client, [], stats if not busy else dict(core.stats()))
            if busy:
                self._step()

    def _step(self) -> None:
        outputs = self.core.step()
        by_client: dict[_Client, list[EngineCoreOutput]] = {}
        owner, has_request = self.owner, self.core.has_request
        ended = []
        for output in outputs:
            entry = owner.get(output.request_id)
            if entry is None:
                continue  # its client detached meanwhile
            client, client_id = entry
            if output.finish_reason is not None and not has_request(output.request_id):
                ended.append(output.request_id)  # the core holds it no more (several sequences may end together)
            output.request_id = client_id
            by_client.setdefault(client, []).append(output)
        for core_id in ended:
            entry = owner.pop(core_id, None)
            if entry is not None:
                del entry[0].owned[entry[1]]
        stats = dict(self.core.stats())
        for client in self.clients:
            if client.attached and (client in by_client or client.owned or client.num_messages != client.num_reported):
                self._send(client, by_client.get(client, []), stats)
        self._publish(stats)  # after the sends: the streams' tokens do not wait for the metrics

    def _publish(self, stats: dict) -> None:
        if self._on_stats is not None:
            self._on_stats(stats)

    def report_death(self, exc: BaseException) -> None:
        """Tell every attached client the loop failed (they end their requests with ``EngineDeadError``)."""
        for client in self.clients:
            if client.attached:
                try:
                    client.sender.send(CoreDied(describe(exc)))
                except BrokenPipeError:
                    pass

    def close(self) -> None:
        for client in self.clients:
            if client.attached:
                client.sender.close()


def _num_sequences(request) -> int:
    """Sequences a core request runs at once (n / best_of, or the beam width)."""
    params = request.sampling_params or request.beam_search_params
    return params.num_sequences


def start_core(engine_args, conn, log_level: int, build_core: Callable):
    """In a spawned core process: set up logging (to the inherited stderr, each line tagged with the process), build
    the core (``build_core(engine_args, use_tqdm=)``) and send ``CoreReady`` on ``conn``; on failure send
    ``CoreFailed`` and return None."""
    logging.basicConfig(level=log_level, format=CORE_LOG_FORMAT, stream=sys.stderr, force=True)
    try:
        core = build_core(engine_args, use_tqdm=log_level <= logging.INFO)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send_bytes(encode(CoreFailed(describe(exc), isinstance(exc, ValueError))))
        return None
    info = core.info
    info.stats = dict(core.stats())
    conn.send_bytes(encode(CoreReady(info)))
    return core
