"""One engine process serving several API server processes (``--api-server-count`` > 1; ``serving.api_servers``
starts them all).

The engine side (``multi_client_main``) is ``serving.engine_process``'s child loop with one pipe per API server
(client) plus a control pipe to the launcher:

* it waits on every client pipe at once (``multiprocessing.connection.wait``); busy, it applies every command that
  arrived from any client during a step before the next one; idle, it sleeps until one comes;
* request ids are the clients' own (the user-visible id stays; a client refuses its own duplicates); in the engine
  each is tagged with its client's index (``"<index>:<id>"``), so two servers may use the same id;
* after each step every client that is engaged (has requests in the engine, got outputs, or has commands not yet
  answered) gets one message with only its own requests' outputs: the step's ``RequestOutput`` s and its rows of the
  ``StreamDeltas`` columns (split by owner), the engine's stats (``num_unfinished_requests`` = that client's own)
  and the number of its commands applied. An idle client hears nothing (its engine thread is not reading); commands
  that leave the engine idle are answered at once, as with one client;
* ``--max-waiting-requests`` is enforced here, where the waiting count is exact (a server's own stats snapshot is
  only as fresh as its last message): a group that would push it past the bound is refused with
  ``EngineOverloadedError`` (503); the servers' engine threads skip their own check (``shared_engine_process``);
* the engine-level metrics are recorded here after each step (``serving.multiprocess_metrics.EngineProcessMetrics``)
  and so is the periodic stats log line (``StatsLogger``): the servers' own copies would be stale;
* a client that sends ``shutdown`` or whose pipe closes (its API server exited) is detached: its requests are aborted,
  their KV blocks freed. The control pipe's ``shutdown`` or its closing (the launcher is gone) ends the process.

The API server side is ``AttachedEngineClient``: an ``EngineProcessClient`` over one of those pipes (the same
protocol and wire format) that neither starts nor owns the engine process; it watches it through a pidfd.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.connection
import os
import select
from typing import TYPE_CHECKING, Any, Callable

from paged_jax.engine.step_outputs import StreamDeltas
from serving.async_engine import waiting_bound_error
from serving.engine_process import (EngineProcessClient, _add_group, _describe, _pack, _picklable, _Sender,
                                    start_child_engine)

if TYPE_CHECKING:
    from paged_jax.config import EngineArgs

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """What the engine process does for all its clients: ``max_waiting_requests`` (``--max-waiting-requests``, in
    sequences; None = unbounded), ``metrics_prefix`` (``--metrics-prefix``; the engine-level metrics' names),
    ``log_stats`` (the periodic stats line)."""

    max_waiting_requests: int | None = None
    metrics_prefix: str = "paged_jax"
    log_stats: bool = False


@dataclasses.dataclass(eq=False)
class _Client:
    index: int
    conn: Any  # multiprocessing.connection.Connection
    sender: _Sender
    owned: dict[str, str] = dataclasses.field(default_factory=dict)  # the client's request id -> engine request id
    num_commands: int = 0  # commands applied so far
    num_reported: int = 0  # ... as of the latest message sent
    attached: bool = True


class _MultiClientLoop:
    def __init__(self, engine, control_conn, client_conns, options: EngineOptions) -> None:
        self.engine = engine
        self.control = control_conn
        self.options = options
        self.clients = [_Client(index, conn, _Sender(conn)) for index, conn in enumerate(client_conns)]
        self.owner: dict[str, tuple[_Client, str]] = {}  # engine request id -> (client, the client's id)
        self.prompt_sent: set[str] = set()  # engine ids whose prompt went with an earlier output
        self.metrics = None
        self.latest_stats: dict = dict(engine.stats())

    # --------------------------------------------------------------------------------------- commands
    def _add(self, client: _Client, requests: list[tuple]) -> BaseException | None:
        bound = self.options.max_waiting_requests
        if bound is not None:
            error = waiting_bound_error(int(self.engine.stats().get("num_waiting", 0)),
                                        sum(getattr(request[2], "n", 1) for request in requests), bound)
            if error is not None:
                return error
        tagged = [(f"{client.index}:{request[0]}", *request[1:]) for request in requests]
        error = _add_group(self.engine, tagged)
        if error is None:
            for request, engine_request in zip(requests, tagged):
                client.owned[request[0]] = engine_request[0]
                self.owner[engine_request[0]] = (client, request[0])
        return error

    def _abort(self, client: _Client, request_ids) -> None:
        engine_ids = [client.owned.pop(r) for r in request_ids if r in client.owned]
        for engine_id in engine_ids:
            del self.owner[engine_id]
        self.engine.abort_request(engine_ids)
        self.prompt_sent.difference_update(engine_ids)

    def _detach(self, client: _Client) -> None:
        """The client left (``shutdown``) or its API server is gone: its requests end, their blocks are freed."""
        if not client.attached:
            return
        client.attached = False
        self._abort(client, list(client.owned))
        client.sender.close(timeout=1.0)
        client.conn.close()

    def _apply(self, client: _Client, message: tuple, admissions: list) -> None:
        kind = message[0]
        if kind == "shutdown":
            self._detach(client)
            return
        client.num_commands += 1
        if kind == "add":
            admissions.append((message[1], self._add(client, message[2])))
        elif kind == "abort":
            self._abort(client, message[1])
        elif kind == "call":  # an engine method with an answer (add_lora, list_loras)
            try:
                answer = ("called", getattr(self.engine, message[1])(*message[2]), None)
            except Exception as exc:  # noqa: BLE001 - the caller's error; the engine stays up
                answer = ("called", None, exc if _picklable(exc) else ValueError(str(exc)))
            self._send(client, answer)

    def _send(self, client: _Client, message: tuple) -> None:
        try:
            client.sender.send(message)
        except BrokenPipeError:  # that API server is gone; the others go on
            self._detach(client)

    # --------------------------------------------------------------------------------------- messages
    def _send_state(self, client: _Client, admissions: list, deltas: list, stream_deltas: StreamDeltas | None,
                    stats: dict) -> None:
        client.num_reported = client.num_commands
        stats = dict(stats, num_unfinished_requests=len(client.owned))  # what this client still has in the engine
        self._send(client, ("state", client.num_commands, admissions, deltas, stats,
                            stream_deltas.to_wire() if stream_deltas else None))

    def _split(self, outputs: list, stream_deltas: StreamDeltas) -> tuple[dict, dict]:
        """One step's outputs by client, packed, under the clients' own ids."""
        packed: dict[_Client, list] = {}
        for output in outputs:
            entry = self.owner.get(output.request_id)
            if entry is None:
                continue
            client, request_id = entry
            packed.setdefault(client, []).append((request_id, *_pack(output, self.prompt_sent)[1:]))
            if output.finished:
                del self.owner[output.request_id]
                client.owned.pop(request_id, None)
        rows: dict[_Client, StreamDeltas] = {}
        for engine_id, token_ids, text, num_cached in zip(stream_deltas.request_ids, stream_deltas.token_ids,
                                                           stream_deltas.texts, stream_deltas.num_cached_tokens):
            entry = self.owner.get(engine_id)
            if entry is None:
                continue
            columns = rows.get(entry[0])
            if columns is None:
                columns = rows[entry[0]] = StreamDeltas()
            columns.request_ids.append(entry[1])
            columns.token_ids.append(token_ids)
            columns.texts.append(text)
            columns.num_cached_tokens.append(num_cached)
        return packed, rows

    def _publish(self, stats: dict) -> None:
        self.latest_stats = stats
        if self.metrics is not None:
            self.metrics.update(stats)

    # --------------------------------------------------------------------------------------- the loop
    def run(self) -> None:
        engine = self.engine
        while True:
            attached = [client for client in self.clients if client.attached]
            busy = engine.has_unfinished_requests()
            ready = multiprocessing.connection.wait([self.control, *(c.conn for c in attached)],
                                                    timeout=0 if busy else None)
            if self.control in ready:
                try:
                    if self.control.recv()[0] == "shutdown":
                        return
                except (EOFError, OSError):
                    return  # the launcher is gone
            touched: dict[_Client, list] = {}
            for client in attached:
                if client.conn not in ready:
                    continue
                admissions = touched.setdefault(client, [])
                try:
                    while client.attached and client.conn.poll():
                        self._apply(client, client.conn.recv(), admissions)
                except (EOFError, OSError):  # its API server exited
                    self._detach(client)
            busy = engine.has_unfinished_requests()
            if touched and not busy:
                self._publish(dict(engine.stats()))
            for client, admissions in touched.items():
                # Admissions are answered before the step; commands that leave the engine idle at once.
                if client.attached and (admissions or not busy):
                    self._send_state(client, admissions, [], None, self.latest_stats)
            if not busy:
                continue
            stream_deltas = StreamDeltas()
            outputs = engine.step(stream_deltas=stream_deltas)
            engaged = [c for c in self.clients if c.attached and (c.owned or c.num_commands != c.num_reported)]
            packed, rows = self._split(outputs, stream_deltas)
            stats = dict(engine.stats())
            for client in self.clients:
                if client.attached and (client in packed or client in rows or client in engaged):
                    self._send_state(client, [], packed.get(client, []), rows.get(client), stats)
            self._publish(stats)  # after the sends: the streams' tokens do not wait for the metrics files


def multi_client_main(engine_args: EngineArgs, control_conn, client_conns: list, log_level: int,
                      engine_factory: Callable | None, options: EngineOptions) -> None:  # the spawned process
    """The engine process of ``serving.api_servers``: build the engine (``ready`` / ``failed`` on the control pipe,
    as ``serving.engine_process``'s child), then serve the clients until the launcher says ``shutdown``."""
    os.setpgrp()  # a Ctrl-C in the terminal reaches the launcher only; it stops the engine after the servers drain
    engine = start_child_engine(engine_args, control_conn, log_level, engine_factory)
    if engine is None:
        return
    loop = _MultiClientLoop(engine, control_conn, client_conns, options)
    from serving.multiprocess_metrics import EngineProcessMetrics
    from serving.metrics import cache_config_labels
    from serving.openai_server import model_info_from_engine
    from serving.server_logs import StatsLogger

    model_name = model_info_from_engine(engine, engine_args.served_model_names or None).served_model_name
    loop.metrics = EngineProcessMetrics(model_name, prefix=options.metrics_prefix,
                                        cache_config=cache_config_labels(engine_args))
    loop.metrics.update(loop.latest_stats)
    stats_logger = StatsLogger(lambda: loop.latest_stats).start() if options.log_stats else None
    try:
        loop.run()
    except KeyboardInterrupt:
        return
    except BaseException as exc:  # noqa: BLE001 - every client turns it into EngineDeadError
        logger.exception("the engine failed")
        for client in loop.clients:
            if client.attached:
                try:
                    client.sender.send(("died", _describe(exc)))
                except BrokenPipeError:
                    pass
    finally:
        if stats_logger is not None:
            stats_logger.stop()
        for client in loop.clients:
            if client.attached:
                client.sender.close()


class AttachedEngineClient(EngineProcessClient):
    """An ``EngineProcessClient`` over one client pipe of a running ``multi_client_main`` engine process, in an API
    server process: same interface and protocol; it neither starts nor stops the engine process (``close()``
    detaches), and sees it die through a pidfd (``is_alive``, safe from any thread).

    Args:
      engine_args: the engine's ``EngineArgs``.
      conn: this server's end of its pipe to the engine process.
      ready_info: the engine's ready message (``start_child_engine``), relayed by the launcher.
      engine_pid: the engine process's pid.
    """

    # One of several clients: the engine process enforces --max-waiting-requests and records the engine metrics.
    shared_engine_process = True

    def __init__(self, engine_args: EngineArgs, conn, ready_info: dict, engine_pid: int) -> None:
        self._conn = conn
        self._engine_pid = engine_pid
        try:
            self._pidfd: int | None = os.pidfd_open(engine_pid)  # readable once the process has exited
        except (AttributeError, OSError):  # no pidfd (old kernel): signal 0, as good while the launcher reaps it
            self._pidfd = None
        self._setup(engine_args, ready_info)

    def is_alive(self) -> bool:
        if self._closed:
            return False
        if self._pidfd is not None:
            return not select.select([self._pidfd], [], [], 0)[0]
        try:
            os.kill(self._engine_pid, 0)
            return True
        except OSError:
            return False

    def close(self, timeout: float = 30.0) -> None:
        """Detach from the engine process (it aborts this server's requests); the engine keeps serving others."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._conn.send(("shutdown",))
        except (OSError, ValueError):
            pass
        self._conn.close()
        self._wake_reader.close()
        self._wake_writer.close()
        if self._pidfd is not None:
            os.close(self._pidfd)

    @property
    def pid(self) -> int | None:
        return self._engine_pid

    def _exit_code(self) -> int | None:
        return None  # not this process's child
