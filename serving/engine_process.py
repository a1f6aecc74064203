"""The engine in its own process, behind a proxy with ``LLMEngine``'s interface.

Why a process: the engine is host bound on a GPU (every step is Python scheduling plus the launch of a few hundred
kernels), and a server that streams a chunk per token per client keeps its event loop busy in Python too. In one
process both share one GIL, and every millisecond the event loop holds it is taken from the engine: on the H200 the
server measured well below the offline engine's tok/s at 64 streams (benchmarks/RESULTS.md). vLLM runs its EngineCore
apart from the API server for the same reason.

``EngineProcessClient(engine_args)`` spawns the child, which builds the ``LLMEngine`` and then loops on its own:
while it has unfinished requests it steps without waiting for anyone, reading commands between steps; idle, it
blocks on the command pipe. After each step it sends the step's outputs, which are deltas already (new token ids,
new text, new logprobs, finish state), compactly (the prompt only with a request's first output), and the engine's
stats; the client turns them back into delta ``RequestOutput`` objects, accumulating nothing.

The client is used exactly like an ``LLMEngine`` by one thread (``serving.async_engine.AsyncEngine``'s engine thread):

It implements ``serving.engine_client.ProcessEngineClient``:

* ``add_request`` sends the request and waits for the child's answer (it raises the child's ValueError);
* ``step()`` returns the outputs of every step the child finished since the last call, blocking for one if none
  (each step's deltas in order, so several steps' outputs of one request follow each other);
* ``abort_request`` is fire-and-forget; ``stats()`` is the child's latest, with requests added since counted as
  waiting; ``has_unfinished_requests()`` is the client's own view (added, neither finished nor aborted);
* a dead child (crash, kill) makes ``step`` / ``add_request`` raise ``EngineProcessDied``; ``close()`` stops it.

Requests and outputs cross the pipe pickled (``SamplingParams`` and the output dataclasses are plain data).

Start-up progress: the child logs to its stderr (inherited from the server) at the parent's log level, each line
prefixed ``(EngineCore pid=N)`` as vLLM's engine process does: model resolution and loading (Hub download bars,
weight loading bar or weights-cache restore), the KV pool size, the compile count and a ``Compiling step buckets``
progress bar (bucket i of N; shown when the level is INFO or lower), then "engine ready".
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

from serving.async_engine import EngineDeadError
from serving.server_logs import quiet_library_loggers

if TYPE_CHECKING:
    from paged_jax.config import EngineArgs
    from paged_jax.outputs import RequestOutput

logger = logging.getLogger(__name__)


class EngineProcessDied(EngineDeadError):
    """The engine process exited or stopped answering (an ``EngineDeadError``: the engine loop dies with it)."""


# ------------------------------------------------------------------------------------------------ child side
CHILD_LOG_FORMAT = "%(asctime)s %(levelname)s (EngineCore pid=%(process)d) %(name)s: %(message)s"


def _child_main(engine_args, conn, log_level: int = logging.WARNING) -> None:  # runs in the spawned process
    # A spawned process starts without the parent's logging set-up: log start-up progress to the inherited stderr.
    logging.basicConfig(level=log_level, format=CHILD_LOG_FORMAT, stream=sys.stderr, force=True)
    quiet_library_loggers()
    try:
        from paged_jax.engine import LLMEngine

        engine = LLMEngine(engine_args, use_tqdm=log_level <= logging.INFO)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("failed", _describe(exc), isinstance(exc, ValueError)))
        return
    conn.send(("ready", {"max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size,
                         "generation_config": engine.generation_config,
                         "model_path": engine.model_path,
                         "stats": dict(engine.stats())}))
    prompt_sent: set[str] = set()  # unfinished requests whose prompt went with an earlier output
    try:
        while True:
            if engine.has_unfinished_requests():
                messages = []
                while conn.poll():
                    messages.append(conn.recv())
            else:
                messages = [conn.recv()]  # idle: sleep until there is something to do
            for message in messages:
                kind = message[0]
                if kind == "shutdown":
                    return
                if kind == "add":
                    _, request_id, prompt, params, priority, lora_request = message
                    try:
                        engine.add_request(request_id, prompt, params, priority=priority, lora_request=lora_request)
                    except Exception as exc:  # noqa: BLE001 - the caller's error (bad request), not the engine's
                        conn.send(("added", request_id, exc if _picklable(exc) else ValueError(str(exc))))
                    else:
                        conn.send(("added", request_id, None))
                elif kind == "abort":
                    engine.abort_request(message[1])
                    prompt_sent.difference_update(message[1])
                elif kind == "call":  # an engine method with an answer (add_lora, remove_lora, list_loras)
                    try:
                        conn.send(("called", getattr(engine, message[1])(*message[2]), None))
                    except Exception as exc:  # noqa: BLE001 - the caller's error; the engine stays up
                        conn.send(("called", None, exc if _picklable(exc) else ValueError(str(exc))))
            if engine.has_unfinished_requests():
                outputs = engine.step()
                conn.send(("step", [_pack(output, prompt_sent) for output in outputs], dict(engine.stats())))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return  # the parent went away
    except BaseException as exc:  # noqa: BLE001 - the parent turns it into EngineDeadError for every client
        try:
            conn.send(("died", _describe(exc)))
        except (OSError, ValueError):
            pass


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
    Raises:
      ValueError: the child rejected ``engine_args`` (its message).
      EngineProcessDied: the child failed otherwise or did not start in time.
    """

    def __init__(self, engine_args: EngineArgs, *, start_timeout: float | None = None):
        context = multiprocessing.get_context("spawn")  # JAX is not fork-safe
        self._conn, child_conn = context.Pipe(duplex=True)
        log_level = logging.getLogger().getEffectiveLevel()  # the child logs start-up progress at the same level
        self._process = context.Process(target=_child_main, args=(engine_args, child_conn, log_level), daemon=True,
                                        name="paged-jax-engine")
        started = time.perf_counter()
        self._process.start()
        logger.info("engine process started (pid %d): loading the model and compiling; its progress follows",
                    self._process.pid)
        child_conn.close()
        self.engine_args = engine_args
        if not self._conn.poll(start_timeout):
            self.close()
            raise EngineProcessDied(f"the engine process did not start within {start_timeout} s")
        message = self._recv()
        if message[0] == "failed":
            self._process.join(10)
            if message[2]:
                raise ValueError(message[1].split(": ", 1)[-1])
            raise EngineProcessDied(f"the engine process failed to start: {message[1]}")
        info = message[1]
        self.max_model_len = int(info["max_model_len"])
        self.vocab_size = int(info["vocab_size"])
        self.model_path = info["model_path"]
        self.generation_config: dict = dict(info["generation_config"])
        self._stats: dict = dict(info["stats"])
        from paged_jax.model_loader import load_tokenizer

        # The same tokenizer as the child's (already downloaded by it when it comes from the Hub).
        self.tokenizer = load_tokenizer(engine_args, self.model_path)
        logger.info("engine process ready in %.1f s", time.perf_counter() - started)
        # Added, neither finished nor aborted: request id -> (prompt, prompt_token_ids) once its first output came.
        self._live: dict[str, tuple[str | None, list[int]] | None] = {}
        self._added_since_stats = 0
        self._pending_outputs: list = []
        self._closed = False
        self._lock = threading.Lock()  # close() may come from another thread than the engine thread

    # ------------------------------------------------------------------ LLMEngine interface (one thread)
    def add_request(self, request_id: str, prompt: Any, params: Any = None, priority: int = 0,
                    lora_request: Any = None) -> None:
        """Queue a request in the child; raises the child's ValueError for a bad one."""
        if request_id in self._live:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._send(("add", request_id, prompt, params, priority, lora_request))
        while True:  # step results may arrive first: keep them for step()
            message = self._recv()
            if message[0] == "added" and message[1] == request_id:
                if message[2] is not None:
                    raise message[2]
                self._live[request_id] = None
                self._added_since_stats += 1
                return
            self._handle(message)

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
        """The delta outputs of every step the child finished since the last call (blocks for one if none yet)."""
        while not self._pending_outputs and self._live:
            self._handle(self._recv())
            if not self._pending_outputs and self._stats.get("num_unfinished_requests") == 0:
                # The child holds nothing any more (its stats come after every acknowledged add), so whatever is
                # still live here ended without an output; never block on a child that will not step again.
                logger.warning("engine process holds none of %d live requests; dropping them", len(self._live))
                self._live.clear()
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    def get_num_unfinished_requests(self) -> int:
        return len(self._live)

    def get_tokenizer(self):
        return self.tokenizer

    def stats(self) -> dict:
        stats = dict(self._stats)
        # Requests added since the child's last report are waiting as far as admission control is concerned.
        stats["num_waiting"] = int(stats.get("num_waiting", 0)) + self._added_since_stats
        return stats

    def close(self, timeout: float = 30.0) -> None:
        """Stop the child (after its current step) and reap it."""
        with self._lock:
            if getattr(self, "_closed", False):
                return
            self._closed = True
        try:
            self._conn.send(("shutdown",))
        except (OSError, ValueError):
            pass
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._conn.close()

    def is_alive(self) -> bool:
        """Whether the child process is running (safe from any thread; ``/health`` asks it)."""
        return not self._closed and self._process.is_alive()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    # ------------------------------------------------------------------ internals
    def _send(self, message) -> None:
        try:
            self._conn.send(message)
        except (OSError, ValueError) as exc:
            raise EngineProcessDied(f"the engine process is gone ({exc})") from exc

    def _recv(self):
        try:
            message = self._conn.recv()
        except (EOFError, OSError) as exc:
            code = self._process.exitcode
            raise EngineProcessDied(f"the engine process exited (exit code {code})") from exc
        if message[0] == "died":
            raise EngineProcessDied(f"the engine process failed: {message[1]}")
        return message

    def _handle(self, message) -> None:
        if message[0] != "step":
            raise EngineProcessDied(f"unexpected message from the engine process: {message[0]!r}")
        _, deltas, stats = message
        self._stats = stats
        self._added_since_stats = 0
        for delta in deltas:
            output = self._rebuild(delta)
            if output is not None:
                self._pending_outputs.append(output)

    def _rebuild(self, packed: tuple) -> RequestOutput | None:
        """The delta ``RequestOutput`` that ``_pack`` packed; None for a request aborted here meanwhile."""
        from paged_jax.outputs import CompletionOutput, RequestOutput

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
