"""Dead-node detection for a multi-host engine: every node notices a dead peer within seconds, logs one error naming
it and the reason, and exits with status 1 (``--distributed-timeout-seconds``, vLLM's flag).

Why not JAX's own heartbeat alone (measured on CPU, jax 0.10): the coordination service notices a dead process only
after ``heartbeat_timeout_seconds`` and then aborts every other process from a C++ thread (SIGABRT, "Terminating
process because the JAX distributed service detected fatal errors", a stack trace); ``missed_heartbeat_callback``,
the client's only hook, cannot be used from Python (jaxlib has no Python conversion of its ``absl::Status``
argument: ``std::bad_cast``, abort). So:

* ``RankWatch``: one TCP connection between node 0 and each other node, opened right after ``jax.distributed``
  joins (node 0 listens on an ephemeral port it publishes in the coordinator's key-value store). A process that
  exits or is killed closes its sockets, so its peer sees end-of-file at once; a host that vanishes (power, network)
  stops the pings every ``timeout / 4`` s and is declared dead after ``timeout`` s. Node 0 relays a death to the
  other nodes before it exits, so every node names the same dead node. A clean exit says ``bye`` first (node 0:
  before its ``"shutdown"`` step message), so nobody reports it. JAX's heartbeat stays the backstop, at
  ``JAX_HEARTBEAT_FACTOR * timeout``.
* ``run_supervised``: a follower (node > 0) runs its engine in a child process. When node 0 is killed, the
  coordinator (which lives in node 0) vanishes with it, and JAX aborts the follower within milliseconds, before any
  Python code of its own can run; the parent sees the abort, checks whether the coordinator still answers, and
  logs the error and exits 1 itself (vLLM's headless nodes also watch their workers from a parent process).

Node 0 is the engine process of ``paged-jax serve`` (``serving.engine_process``): its exit makes the API server
stop and exit 1 (``serving.lifecycle``), as any engine death does.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10
# JAX's heartbeat (the backstop for what the watch cannot see, e.g. a hung coordination service) is this many
# watch timeouts, so a vanished host is reported by the watch first.
JAX_HEARTBEAT_FACTOR = 3
_ADDRESS_KEY = "paged_jax/rank_watch/port"
# Node 0, reporting a death: how long it waits for the other nodes to take the news and exit before it exits (its
# exit takes the coordinator down, which makes JAX abort them).
_RELAY_WAIT_S = 2.0
_EXIT_STATUS = 1
# How often a spawned engine process checks that its parent is still there.
_PARENT_POLL_S = 0.25


def _exit_process(message: str) -> None:
    """The default reaction to a dead node: the error is logged already; flush it and leave without running atexit
    hooks (they would talk to the dead node, or wait in jax.distributed's shutdown barrier)."""
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - exiting regardless
            pass
    sys.stderr.flush()
    os._exit(_EXIT_STATUS)


class RankWatch:
    """This node's end of the watch. ``start()`` connects it (node 0: accepts the other ``num_nodes - 1``);
    ``close()`` announces a clean exit; a dead peer calls ``on_dead(message)`` once (default: exit with status 1).

    Args:
      client: ``jax.distributed``'s client (its key-value store carries node 0's port).
      node_rank: this node (0 = the coordinator's node).
      num_nodes: nodes in the job (>= 2).
      coordinator_host: the host followers reach node 0 at (that of the coordinator address).
      timeout_s: silence after which a peer is declared dead (> 0); also the time the followers have to connect.
      on_dead: called with the error message when a peer is dead.
    """

    def __init__(self, client: Any, node_rank: int, num_nodes: int, coordinator_host: str, timeout_s: float,
                 on_dead: Callable[[str], None] = _exit_process):
        if timeout_s <= 0:
            raise ValueError(f"distributed_timeout_seconds must be > 0, got {timeout_s}")
        self.client = client
        self.node_rank = node_rank
        self.num_nodes = num_nodes
        self.coordinator_host = coordinator_host
        self.timeout_s = float(timeout_s)
        self._on_dead = on_dead
        self._lock = threading.Lock()
        self._peers: dict[int, socket.socket] = {}  # node 0: every follower; a follower: {0: node 0}
        self._finished: set[int] = set()  # peers that said bye or whose connection ended
        self._closing = False
        self._dead_reported = False
        self._listener: socket.socket | None = None

    # ------------------------------------------------------------------ set-up and clean exit
    def start(self) -> None:
        """Connect to the other nodes (blocks until connected; on node 0 until every follower is, at most
        ``timeout_s``), then watch them from daemon threads."""
        if self.node_rank == 0:
            self._accept_followers()
        else:
            self._connect_to_node0()
        for rank, sock in self._peers.items():
            threading.Thread(target=self._read, args=(rank, sock), name=f"paged-jax-watch-{rank}",
                             daemon=True).start()
        threading.Thread(target=self._ping, name="paged-jax-watch-ping", daemon=True).start()
        logger.info("node %d watches node(s) %s (--distributed-timeout-seconds %g)", self.node_rank,
                    sorted(self._peers), self.timeout_s)

    @property
    def closing(self) -> bool:
        """Whether ``close()`` was called (this node is exiting cleanly)."""
        return self._closing

    def close(self) -> None:
        """This node exits cleanly: tell the peers (``bye``) so they do not report it, and stop reporting theirs."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            peers = list(self._peers.values())
        for sock in peers:
            _send_line(sock, "bye")

    def _accept_followers(self) -> None:
        if socket.has_dualstack_ipv6():
            self._listener = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            self._listener = socket.create_server(("", 0))
        self._listener.settimeout(self.timeout_s)
        self.client.key_value_set(_ADDRESS_KEY, str(self._listener.getsockname()[1]))
        deadline = time.monotonic() + self.timeout_s
        try:
            while len(self._peers) < self.num_nodes - 1:
                self._listener.settimeout(max(deadline - time.monotonic(), 0.001))
                try:
                    sock, _ = self._listener.accept()
                except socket.timeout:
                    missing = sorted(set(range(1, self.num_nodes)) - set(self._peers))
                    self._report(missing[0], f"it did not connect to node 0's watch within {self.timeout_s:g} s "
                                             f"of joining the job (nodes {missing} missing)")
                    return
                sock.settimeout(self.timeout_s)
                hello = _recv_line(sock)
                if hello is None or not hello.startswith("hello "):
                    sock.close()  # not one of ours (a port scan, say): ignore it
                    continue
                self._peers[int(hello.split()[1])] = sock
        finally:
            self._listener.close()

    def _connect_to_node0(self) -> None:
        port = self.client.blocking_key_value_get(_ADDRESS_KEY, int(self.timeout_s * 1000))
        sock = socket.create_connection((self.coordinator_host, int(port)), timeout=self.timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _send_line(sock, f"hello {self.node_rank}")
        self._peers[0] = sock

    # ------------------------------------------------------------------ watching
    def _ping(self) -> None:
        while True:
            time.sleep(self.timeout_s / 4)
            with self._lock:
                peers = [(rank, sock) for rank, sock in self._peers.items() if rank not in self._finished]
                if self._dead_reported or self._closing or not peers:
                    return
            for _, sock in peers:
                _send_line(sock, "ping")  # a failed send shows up as the reader's error

    def _read(self, rank: int, sock: socket.socket) -> None:
        buffered = b""
        while True:
            try:
                data = sock.recv(4096)
            except socket.timeout:
                reason = f"no message from it for {self.timeout_s:g} s (its host is down, hung or unreachable)"
                break
            except OSError as exc:
                reason = f"its connection failed ({exc})"
                break
            if not data:
                reason = "its connection closed (the process exited or was killed)"
                break
            buffered += data
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                words = line.decode(errors="replace").split(" ", 2)
                if words[0] == "bye":
                    with self._lock:
                        self._finished.add(rank)
                    if rank == 0:
                        return  # node 0 shuts down: its "shutdown" step message ends this follower
                elif words[0] == "dead" and rank == 0 and len(words) == 3:
                    self._report(int(words[1]), f"{words[2]} (reported by node 0)")
                    return
        with self._lock:
            clean = self._closing or rank in self._finished
            self._finished.add(rank)
        if not clean:
            self._report(rank, reason)

    def _report(self, dead_rank: int, reason: str) -> None:
        with self._lock:
            if self._dead_reported or self._closing:
                return
            self._dead_reported = True
            survivors = [(rank, sock) for rank, sock in self._peers.items()
                         if rank != dead_rank and rank not in self._finished]
        message = f"node {dead_rank} is gone: {reason}"
        logger.error("%s; node %d exits (status %d) so that the job can be restarted", message, self.node_rank,
                     _EXIT_STATUS)
        if self.node_rank == 0 and survivors:
            for _, sock in survivors:
                _send_line(sock, f"dead {dead_rank} {reason}")
            deadline = time.monotonic() + _RELAY_WAIT_S
            for _, sock in survivors:  # until each has exited (its connection ends) or the wait is over
                _wait_closed(sock, deadline)
        self._on_dead(message)


def _send_line(sock: socket.socket, line: str) -> None:
    try:
        sock.sendall(line.encode() + b"\n")
    except OSError:
        pass  # the peer is gone: its reader reports it


def _recv_line(sock: socket.socket) -> str | None:
    data = b""
    while not data.endswith(b"\n"):
        try:
            chunk = sock.recv(256)
        except OSError:
            return None
        if not chunk:
            return None
        data += chunk
    return data.decode(errors="replace").strip()


def _wait_closed(sock: socket.socket, deadline: float) -> None:
    # The reader thread of this connection also reads it; either one seeing end-of-file is enough, so poll with
    # MSG_PEEK and stop at the deadline.
    while time.monotonic() < deadline:
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            if not sock.recv(1, socket.MSG_PEEK):
                return
            time.sleep(0.05)
        except socket.timeout:
            return
        except OSError:
            return


# ------------------------------------------------------------------------------------------------ process level
_watch: RankWatch | None = None


def start_watch(client: Any, node_rank: int, num_nodes: int, coordinator_address: str,
                timeout_s: float) -> RankWatch:
    """Start this process's ``RankWatch`` (once; later calls return it). A process spawned by another (the engine
    process of ``paged-jax serve``, a follower's engine under ``run_supervised``) also exits when its parent dies,
    so that killing a node's main process takes its part of the job with it."""
    global _watch
    if _watch is None:
        watch = RankWatch(client, node_rank, num_nodes, coordinator_address.rsplit(":", 1)[0].strip("[]"),
                          timeout_s)
        watch.start()
        _watch = watch
        import multiprocessing

        if multiprocessing.parent_process() is not None:
            threading.Thread(target=_exit_with_parent, args=(node_rank,), name="paged-jax-watch-parent",
                             daemon=True).start()
    return _watch


def _exit_with_parent(node_rank: int) -> None:
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL_S)
    if _watch is not None and _watch.closing:
        return  # this process is already exiting cleanly (its parent may go first): let it finish
    logger.error("node %d's parent process (pid %d) is gone; node %d exits (status %d)", node_rank, parent,
                 node_rank, _EXIT_STATUS)
    _exit_process("parent gone")


def close_watch() -> None:
    """This process exits cleanly (node 0: before its ``"shutdown"`` message; a follower: after it)."""
    if _watch is not None:
        _watch.close()


def run_supervised(target: Callable[..., int], args: tuple, coordinator_address: str | None, node_rank: int) -> int:
    """Run ``target(*args)`` (a follower's engine) in a spawned child and return the exit status: the child's, 0
    when this process was told to stop (SIGTERM / SIGINT, passed on to the child), 1 (after logging why) when the
    child was killed by a signal (JAX's abort: node 0 or another node is gone)."""
    import multiprocessing

    process = multiprocessing.get_context("spawn").Process(target=_child_main, args=(target, args), daemon=False,
                                                           name=f"paged-jax-node{node_rank}")
    stop_signals: list[int] = []

    def pass_on(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
        stop_signals.append(signum)
        if process.pid is not None:
            process.terminate()

    previous = {s: signal.signal(s, pass_on) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        process.start()
        process.join()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    code = process.exitcode
    if stop_signals or code is not None and code >= 0:
        return 0 if stop_signals else code
    name = signal.Signals(-code).name if code is not None else "an unknown cause"
    if code != -signal.SIGABRT:
        logger.error("node %d's engine process was killed by %s; node %d exits (status %d)", node_rank, name,
                     node_rank, _EXIT_STATUS)
        return _EXIT_STATUS
    # JAX aborts a process when its coordination service reports a dead node or the coordinator itself is gone.
    unreachable = None
    if coordinator_address is not None:
        host, _, port = coordinator_address.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
        except OSError as exc:
            unreachable = exc
    if unreachable is not None:
        logger.error("node 0 is gone: the coordinator at %s does not answer (%s), and JAX aborted node %d's engine "
                     "process; node %d exits (status %d) so that the job can be restarted", coordinator_address,
                     unreachable, node_rank, node_rank, _EXIT_STATUS)
    else:
        logger.error("JAX aborted node %d's engine process: its distributed service reported a dead node (its "
                     "error above names it); node %d exits (status %d)", node_rank, node_rank, _EXIT_STATUS)
    return _EXIT_STATUS


def _child_main(target: Callable[..., int], args: tuple) -> None:  # runs in the spawned child
    # Ctrl-C reaches the whole process group: the parent stops the child (SIGTERM), the child does not also raise.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(target(*args))
