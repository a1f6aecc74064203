"""``paged-jax serve --api-server-count N`` (vLLM's flag and meaning): N API server processes in front of one engine
process.

Why: one API server is one Python event loop doing HTTP, SSE JSON and per-stream bookkeeping for every stream; at
hundreds of streams that loop is the ceiling (benchmarks/serving_host.py measures it without a model). Several
processes spread that work over several cores while the engine stays one.

The layout (``serve_api_servers``, in the process that ran ``serve``, the launcher):

* the launcher binds the listening socket once (before the engine loads, as with one server) and hands it to every
  API server (pickled to the spawned process: the same socket); each runs uvicorn on it, so the kernel spreads
  accepted connections over the servers;
* it starts the engine process (``serving.engine_process.multi_client_main``) with one pipe per API server and
  a control pipe of its own, waits for the engine to be ready (a bad engine argument: exit status 2 naming it, as
  with one server), then starts the servers (``api_server_main``), each with the same app (``create_app``) over an
  an ``LLMEngine`` attached to its pipe (``serving.engine_process.attach_engine``). Each server has its own tokenizer copy; adapters from ``--lora-modules``
  are loaded by every server under the same ids (the engine loads each once);
* metrics: ``PROMETHEUS_MULTIPROC_DIR`` (``serving.multiprocess_metrics``): ``/metrics`` on any server reports the
  whole system;
* it supervises: SIGTERM / SIGINT (the servers and the engine are in process groups of their own, so a terminal's
  Ctrl-C reaches the launcher only) -> every server gets one SIGTERM and drains for ``--shutdown-timeout`` (as one
  server does), then the engine process is stopped; exit status 0. An API server that exits by itself -> the others
  are stopped the same way and the launcher exits with status 1. The engine process dying -> every server sees it
  (``LLMEngine.is_alive``) and exits with status 1, and so does the launcher.

Not supported with N > 1 (refused naming the flags, ``api_server_count_error``): ``--no-engine-process`` (there is
no engine process to share), run-time LoRA updates (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: an adapter loaded through
one server would be unknown to the others; vLLM refuses the combination too) and ``--nnodes`` > 1.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import time
from typing import Any, Callable

from paged_jax.engine.messages import Shutdown, encode
from serving.settings import app_kwargs, server_settings, uvicorn_config

logger = logging.getLogger(__name__)

SERVER_LOG_FORMAT = "%(asctime)s %(levelname)s (APIServer pid=%(process)d) %(name)s: %(message)s"
# Beyond --shutdown-timeout, how long the launcher waits for draining servers (uvicorn's own connection grace, then
# the engine shutdown) before it kills them.
_STOP_GRACE_S = 15.0


def api_server_count_error(args: argparse.Namespace) -> str | None:
    """Why ``--api-server-count`` cannot be used with the other flags (None: it can)."""
    from serving.engine_process import engine_process_enabled
    from serving.lora import RUNTIME_UPDATING_ENV, runtime_lora_updating_allowed

    count = args.api_server_count
    if count < 1:
        return f"--api-server-count must be >= 1, got {count}"
    if count == 1:
        return None
    if not engine_process_enabled(args.engine_process):
        return ("--api-server-count > 1 needs the engine in its own process: it cannot be combined with "
                "--no-engine-process (or PAGED_JAX_ENGINE_PROCESS=0)")
    if runtime_lora_updating_allowed():
        return (f"--api-server-count > 1 cannot be used with {RUNTIME_UPDATING_ENV} (run-time LoRA loading): an "
                "adapter loaded through one API server would be unknown to the others; serve adapters with "
                "--lora-modules instead")
    if args.nnodes > 1:
        return "--api-server-count > 1 is not supported with --nnodes > 1 (multi-host engines)"
    return None


class _StopRequested(Exception):
    """SIGTERM / SIGINT reached the launcher."""


def _raise_stop(signum, frame) -> None:
    raise _StopRequested(signal.Signals(signum).name)


def serve_api_servers(parser: argparse.ArgumentParser, args: argparse.Namespace, sock: socket.socket) -> int:
    """``serve_main`` with ``--api-server-count`` > 1: returns the exit status (0 after SIGTERM / SIGINT, 1 when an
    API server or the engine died); a bad engine argument exits through ``parser.error`` (status 2)."""
    from serving.engine_process import EngineProcessDied

    try:
        engine_args, chat_template = server_settings(args)
    except ValueError as exc:
        sock.close()
        parser.error(str(exc))
    try:
        return run_api_servers(args, engine_args, sock, chat_template=chat_template)
    except ValueError as exc:
        parser.error(str(exc))
    except EngineProcessDied as exc:
        logger.error("the engine did not start: %s", exc)
        return 1
    finally:
        sock.close()


def run_api_servers(args: argparse.Namespace, engine_args: Any, sock: socket.socket, *,
                    chat_template: str | None = None, core_factory: Callable | None = None,
                    start_timeout: float | None = None,
                    on_started: Callable[[int, list[int]], None] | None = None) -> int:
    """Start the engine process and ``args.api_server_count`` API servers on ``sock``, and supervise them until a
    signal or a death (see the module docstring). ``core_factory``: builds the core in the engine process (the
    model-free core of benchmarks/serving_host.py); ``on_started(engine_pid, server_pids)`` is called once all are started
    (benchmarks/serving_host.py accounts CPU time by process). Raises ValueError / ``EngineProcessDied`` when the
    engine does not start."""
    from serving.engine_process import EngineOptions, multi_client_main, wait_until_ready
    from serving.multiprocess_metrics import multiprocess_dir

    count = args.api_server_count
    context = multiprocessing.get_context("spawn")  # JAX is not fork-safe
    log_level = logging.getLogger().getEffectiveLevel()
    options = EngineOptions(max_waiting_requests=args.max_waiting_requests, metrics_prefix=args.metrics_prefix,
                            log_stats=not engine_args.disable_log_stats)
    previous_handlers = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    engine = ready_info = None
    servers: list = []
    with multiprocess_dir():  # before any process starts: they inherit PROMETHEUS_MULTIPROC_DIR
        control, engine_control = context.Pipe()
        pipes = [context.Pipe() for _ in range(count)]
        try:
            engine = context.Process(target=multi_client_main, name="paged-jax-engine", daemon=True,
                                     args=(engine_args, engine_control, [child for _, child in pipes], log_level,
                                           core_factory, options))
            engine.start()
            logger.info("engine process started (pid %d) for %d API servers: loading the model and compiling",
                        engine.pid, count)
            engine_control.close()
            for _, child in pipes:
                child.close()
            ready_info = wait_until_ready(control, engine, start_timeout)
            for index, (conn, _) in enumerate(pipes):
                server = context.Process(target=api_server_main, name=f"paged-jax-api-server-{index}", daemon=True,
                                         args=(index, args, engine_args, chat_template, conn, sock, ready_info,
                                               engine.pid, log_level))
                server.start()
                conn.close()
                servers.append(server)
            scheme = "https" if args.ssl_certfile else "http"
            logger.info("Started %d API servers (pids %s) on %s://%s:%d%s", count,
                        ", ".join(str(s.pid) for s in servers), scheme, args.host or "0.0.0.0",
                        sock.getsockname()[1], args.root_path or "")
            if on_started is not None:
                on_started(engine.pid, [server.pid for server in servers])
            return _supervise(engine, servers, args.shutdown_timeout)
        except _StopRequested as stop:  # during start-up
            logger.info("%s: stopping", stop)
            return 0
        finally:
            _stop_all(servers, args.shutdown_timeout)
            _stop_engine(engine, control, started=ready_info is not None)
            for sig, handler in previous_handlers.items():
                signal.signal(sig, handler)


def _supervise(engine, servers: list, shutdown_timeout: float) -> int:
    """Block until a signal (-> 0 once the servers have drained; 1 if one of them failed) or until a process exits
    by itself (-> 1; 2 when a server exited 2: an argument it refused, as one server's serve would)."""
    try:
        ready = multiprocessing.connection.wait([engine.sentinel, *(s.sentinel for s in servers)])
    except _StopRequested as stop:
        logger.info("%s: shutting down %d API servers (--shutdown-timeout %.1f s)", stop, len(servers),
                    shutdown_timeout)
        _stop_all(servers, shutdown_timeout)
        # uvicorn re-raises the SIGTERM it handled once it has shut down: -SIGTERM is a clean exit too.
        failed = [s for s in servers if s.exitcode not in (0, -signal.SIGTERM)]
        if failed:
            logger.error("API servers exited with status %s", [server.exitcode for server in servers])
        return 1 if failed else 0
    if engine.sentinel in ready:
        engine.join(1)
        logger.error("the engine process exited (exit code %s): the API servers exit with status 1",
                     engine.exitcode)
        # They see it themselves within a tick; give them that before stopping them.
        _wait_for_exit(servers, _STOP_GRACE_S)
        logger.error("API servers exited with status %s", [server.exitcode for server in servers])
        return 1
    status = 1
    for server in servers:
        if server.sentinel in ready:
            server.join()
            if server.exitcode == 2:  # a bad argument (e.g. --lora-modules): exit as one server would
                status = 2
            logger.error("API server %s (pid %d) exited with status %s: shutting every process down (exit status "
                         "%d)", server.name, server.pid, server.exitcode, status)
    return status


def _wait_for_exit(processes: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))


def _stop_all(servers: list, shutdown_timeout: float) -> None:
    """One SIGTERM to each running server (a graceful drain of ``shutdown_timeout`` s), then SIGKILL whatever has
    not exited after the drain and a grace. A second signal to the launcher meanwhile kills them at once."""
    for server in servers:
        if server.is_alive():
            server.terminate()
    try:
        _wait_for_exit(servers, shutdown_timeout + _STOP_GRACE_S)
    except _StopRequested:
        logger.warning("second signal: killing the API servers")
    for server in servers:
        if server.is_alive():
            server.kill()
            server.join(5)


def _stop_engine(engine, control, started: bool) -> None:
    """Ask the engine process to exit (it does after its current step); one still loading is killed."""
    if engine is None:
        return
    try:
        if started:
            control.send_bytes(encode(Shutdown()))
            engine.join(30)
    except (OSError, ValueError):
        pass
    except _StopRequested:
        logger.warning("second signal: killing the engine process")
    if engine.is_alive():
        engine.kill()
        engine.join(5)
    control.close()


def api_server_main(index: int, args: argparse.Namespace, engine_args: Any, chat_template: str | None, conn,
                    sock: socket.socket, ready_info, engine_pid: int, log_level: int) -> None:
    """One API server process: the app over an ``LLMEngine`` attached to the core process, uvicorn on the shared socket. Exits with
    status 1 when the engine died, 2 when the app could not be built (e.g. a bad ``--lora-modules`` adapter)."""
    os.setpgrp()  # signals come from the launcher (one SIGTERM), not from the terminal too
    logging.basicConfig(level=log_level, format=SERVER_LOG_FORMAT, stream=sys.stderr, force=True)
    from serving.server_logs import quiet_library_loggers

    quiet_library_loggers()
    from serving.app import create_app
    from serving.lifecycle import ServingServer
    from serving.engine_process import attach_engine
    from serving.multiprocess_metrics import check_multiprocess_mode

    check_multiprocess_mode()
    engine = attach_engine(engine_args, conn, ready_info, engine_pid)
    # The engine process logs the periodic stats line (each server's view of the engine is partial).
    kwargs = dict(app_kwargs(args, engine_args, chat_template), log_stats=False)
    try:
        app = create_app(engine, **kwargs)
    except ValueError as exc:
        logger.error("API server %d: %s", index, exc)
        engine.close()
        sys.exit(2)
    server = ServingServer(uvicorn_config(app, args), app.state.server.engine, args.shutdown_timeout)
    sys.exit(server.serve_on_socket(sock))
