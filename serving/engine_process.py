"""The server's engine core in its own process (the default), for one API server or several.

The server process keeps the input and output processors (tokenization, validation, detokenization, stop strings:
``paged_jax.engine.llm_engine.LLMEngine``) and drives a core in a spawned process through
``paged_jax.engine.core_client.EngineCoreProcClient``; the core process runs the one core loop,
``paged_jax.engine.core_proc.EngineCoreProc``, with the server's hooks: ``--max-waiting-requests`` checked where the
waiting count is exact, and (several API servers) the engine-level metrics and the periodic stats line recorded there.

* ``start_engine_process(engine_args)``: an ``LLMEngine`` over a core process of its own (``paged-jax serve``);
* ``multi_client_main``: the core process of ``--api-server-count`` > 1 (``serving.api_servers`` starts it with one
  pipe per API server and a control pipe); each API server gets an ``LLMEngine`` over its pipe from
  ``attach_engine``.

Start-up progress: the core logs to its stderr (inherited from the server) at the parent's log level, each line
prefixed ``(EngineCore pid=N)`` as vLLM's engine process does: model resolution and loading, the KV pool size, the
compile count and a ``Compiling step executables`` progress bar, then "engine ready".
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import types
from typing import TYPE_CHECKING, Callable

from paged_jax.engine.core_client import EngineCoreProcClient, wait_until_ready
from paged_jax.engine.core_proc import EngineCoreProc, start_core
from paged_jax.engine.exceptions import EngineProcessDied, waiting_bound_error
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.messages import EngineCoreInfo
from paged_jax.parallel.data_parallel import create_engine_core
from paged_jax.worker.background_compile import compiles_in_flight
from serving.lifecycle import freeze_gc_heap
from serving.metrics import cache_config_labels
from serving.multiprocess_metrics import EngineProcessMetrics
from serving.openai_server import model_info_from_engine
from serving.server_logs import StatsLogger, quiet_library_loggers

if TYPE_CHECKING:
    from paged_jax.config import EngineArgs

logger = logging.getLogger(__name__)

__all__ = ["EngineOptions", "EngineProcessDied", "attach_engine", "engine_process_enabled", "multi_client_main",
           "start_engine_process", "wait_until_ready"]


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """What the core process does for all its clients: ``max_waiting_requests`` (``--max-waiting-requests``, in
    sequences; None = unbounded: the API server checks it itself when it is the only client), ``metrics_prefix``
    (``--metrics-prefix``; the engine-level metrics' names), ``log_stats`` (the periodic stats line)."""

    max_waiting_requests: int | None = None
    metrics_prefix: str = "paged_jax"
    log_stats: bool = False


def _admission_check(options: EngineOptions):
    bound = options.max_waiting_requests
    if bound is None:
        return None
    return lambda stats, num_seqs: waiting_bound_error(int(stats.get("num_waiting", 0)), num_seqs, bound)


def _start(engine_args, conn, log_level: int, core_factory: Callable | None):
    quiet_library_loggers()
    core = start_core(engine_args, conn, log_level, core_factory or create_engine_core)
    if core is not None:
        freeze_gc_heap()
    return core


def engine_core_main(engine_args: EngineArgs, conn, log_level: int = logging.WARNING,
                     core_factory: Callable | None = None) -> None:  # runs in the spawned process
    """The core process of one API server: build the core, then run the core loop on ``conn``."""
    core = _start(engine_args, conn, log_level, core_factory)
    if core is None:
        return
    _run_loop(EngineCoreProc(core, [conn]))
    _exit_without_waiting_for_compiles()


def multi_client_main(engine_args: EngineArgs, control_conn, client_conns: list, log_level: int,
                      core_factory: Callable | None, options: EngineOptions) -> None:  # the spawned process
    """The core process of ``serving.api_servers``: build the core (``CoreReady`` / ``CoreFailed`` on the control
    pipe), then serve the clients until the launcher says ``Shutdown`` or goes away."""
    os.setpgrp()  # a Ctrl-C in the terminal reaches the launcher only; it stops the engine after the servers drain
    core = _start(engine_args, control_conn, log_level, core_factory)
    if core is None:
        return
    on_stats, stats_logger = _engine_metrics(core, engine_args, options)
    try:
        _run_loop(EngineCoreProc(core, client_conns, control_conn, admission_check=_admission_check(options),
                                 on_stats=on_stats))
    finally:
        if stats_logger is not None:
            stats_logger.stop()
    _exit_without_waiting_for_compiles()


def _exit_without_waiting_for_compiles() -> None:
    """A stopped core process whose step executables still compile in the background ends now (``os._exit``):
    an XLA compile cannot be interrupted, and the interpreter's exit would wait for the ones in flight (seconds),
    keeping a stopped server's engine process alive."""
    if compiles_in_flight():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _engine_metrics(core, engine_args: EngineArgs, options: EngineOptions):
    """``(on_stats, stats logger or None)``: the engine-level metrics of several API servers, recorded here."""
    info = core.info
    facts = types.SimpleNamespace(engine_args=engine_args, model_path=info.model_path,
                                  max_model_len=info.max_model_len, vocab_size=info.vocab_size)
    model_name = model_info_from_engine(facts, engine_args.served_model_names or None).served_model_name
    metrics = EngineProcessMetrics(model_name, prefix=options.metrics_prefix,
                                   cache_config=cache_config_labels(engine_args))
    latest = {"stats": dict(core.stats())}
    metrics.update(latest["stats"])

    def on_stats(stats: dict) -> None:
        latest["stats"] = stats
        metrics.update(stats)

    stats_logger = StatsLogger(lambda: latest["stats"]).start() if options.log_stats else None
    return on_stats, stats_logger


def _run_loop(loop: EngineCoreProc) -> None:
    try:
        loop.run()
    except KeyboardInterrupt:
        return
    except BaseException as exc:  # noqa: BLE001 - every client turns it into EngineDeadError
        logger.exception("the engine failed")
        loop.report_death(exc)
    finally:
        loop.close()


def start_engine_process(engine_args: EngineArgs, *, start_timeout: float | None = None,
                         core_factory: Callable | None = None) -> LLMEngine:
    """An ``LLMEngine`` whose core runs in a spawned process (``core_factory(engine_args, use_tqdm=)`` builds it
    there; default ``create_engine_core``). Raises ValueError (the core refused ``engine_args``) or
    ``EngineProcessDied`` (another failure, or not ready within ``start_timeout`` s)."""
    client = EngineCoreProcClient.spawn(engine_args, target=engine_core_main, start_timeout=start_timeout,
                                        args=(core_factory,))
    return LLMEngine(engine_args, engine_core=client)


def attach_engine(engine_args: EngineArgs, conn, info: EngineCoreInfo, engine_pid: int) -> LLMEngine:
    """An ``LLMEngine`` over one client pipe of a running ``multi_client_main`` core process (an API server of
    several): it neither starts nor stops the process; ``close()`` detaches."""
    return LLMEngine(engine_args, engine_core=EngineCoreProcClient.attach(engine_args, conn, info, engine_pid))


def engine_process_enabled(flag: bool | None) -> bool:
    """The CLI flag, else ``PAGED_JAX_ENGINE_PROCESS`` (``0`` = a thread); on by default: the server streams more
    tokens per second with the engine core in its own process than on a thread of the server process
    (benchmarks/RESULTS.md, "Server")."""
    if flag is not None:
        return bool(flag)
    return os.environ.get("PAGED_JAX_ENGINE_PROCESS", "1") != "0"
