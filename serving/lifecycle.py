"""How ``paged-jax serve`` ends: a bounded drain on SIGTERM / SIGINT (``--shutdown-timeout``, vLLM's flag and
default) and a non-zero exit when the engine dies, so that an orchestrator restarts the server.

``ServingServer`` is a ``uvicorn.Server`` that

* on shutdown stops accepting connections (uvicorn), lets the running requests finish for up to
  ``shutdown_timeout`` seconds (0, the default: none), then shuts the engine down: every request still running
  ends at once, a stream with an error event and ``data: [DONE]``, a whole response with a 500;
* freezes its start-up heap once it serves (``freeze_gc_heap``: no full garbage collection walks it while serving;
  unfrozen when ``serve`` returns);
* exits with status 0 after a shutdown on SIGTERM / SIGINT (uvicorn would re-raise the signal once it has shut
  down, so that SIGTERM killed the process after a complete drain);
* watches the engine on uvicorn's 0.1 s tick: when it has died (a step failed, the engine process is gone), the
  server shuts down by itself and ``engine_died`` is set (``serve_main`` then exits with status 1; ``/health`` has
  answered 503 since the death).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from typing import Any

import uvicorn

logger = logging.getLogger(__name__)

# Beyond the drain, how long uvicorn waits for connections that still do not close (a client that reads nothing)
# before it cancels their tasks.
_CONNECTION_GRACE_S = 5.0


def freeze_gc_heap() -> None:
    """Collect, then move every object alive now to the GC's permanent generation. Called once a process is up
    (the server when it starts serving; the engine process once its engine is built): the start-up heap (imports,
    tokenizer, model, compiled executables: hundreds of thousands of objects) is never freed, and a full collection
    that walks it pauses every stream at once (vLLM freezes its heaps too). Later full collections walk only what
    serving allocates."""
    gc.collect()
    gc.freeze()


class ServingServer(uvicorn.Server):
    """uvicorn's server with a bounded drain and an engine watchdog.

    Args:
      config: the uvicorn config (its ``timeout_graceful_shutdown`` is set from ``shutdown_timeout``).
      async_engine: the app's ``serving.async_engine.AsyncEngine``.
      shutdown_timeout: seconds running requests may take to finish once shutdown starts (>= 0).
    """

    def __init__(self, config: uvicorn.Config, async_engine: Any, shutdown_timeout: float = 0.0) -> None:
        if shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {shutdown_timeout}")
        config.timeout_graceful_shutdown = int(shutdown_timeout + _CONNECTION_GRACE_S)
        super().__init__(config)
        self.async_engine = async_engine
        self.shutdown_timeout = shutdown_timeout
        self.engine_died = False

    def serve_on_socket(self, sock) -> int:
        """Serve on the bound ``sock`` until shutdown (a signal, or the engine's death); then shut the engine client
        down and close ``sock``. Returns the exit status: 0 after a shutdown on SIGTERM / SIGINT, 1 when the engine
        died or the server did not start."""
        try:
            self.run(sockets=[sock])
        except KeyboardInterrupt:
            pass  # an interrupt before uvicorn captures signals: the server has not started (status 1)
        finally:
            self.async_engine.shutdown()
            sock.close()
        return 1 if self.engine_died or not self.started else 0

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's signal capture, without its re-raise of the captured signal once it has shut down: that
        re-raise makes SIGTERM kill the process (status -15, a crash to a supervisor) after a complete drain. The
        drain is the signal's whole effect here; ``serve_on_socket`` returns the exit status."""
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()

    async def serve(self, sockets=None) -> None:
        try:
            await super().serve(sockets)
        finally:
            gc.unfreeze()  # a process that goes on after serving (tests) collects its whole heap again

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        freeze_gc_heap()  # the app, tokenizer and imports are up: nothing later frees them while serving

    async def on_tick(self, counter: int) -> bool:
        if not self.engine_died and self.async_engine.dead_error is None and self.async_engine.is_healthy:
            return await super().on_tick(counter)
        if not self.engine_died and not self.should_exit:
            self.engine_died = True
            logger.error("the engine is not running (%s): shutting the server down (exit status 1) so that it "
                         "can be restarted", self.async_engine.dead_error or "its process has exited")
        return True

    async def shutdown(self, sockets=None) -> None:
        end_requests = asyncio.ensure_future(self._end_requests_after(self.shutdown_timeout))
        try:
            await super().shutdown(sockets)
        finally:
            end_requests.cancel()
            await asyncio.to_thread(self.async_engine.shutdown)

    async def _end_requests_after(self, timeout: float) -> None:
        if timeout > 0:
            logger.info("draining: running requests have %.1f s to finish (--shutdown-timeout)", timeout)
            await asyncio.sleep(timeout)
        if self.async_engine.num_in_flight:
            logger.warning("shutdown: ending %d unfinished request(s) with an error (--shutdown-timeout %.1f s)",
                           self.async_engine.num_in_flight, timeout)
        await asyncio.to_thread(self.async_engine.shutdown)
