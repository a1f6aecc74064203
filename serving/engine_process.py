"""The engine in its own process, behind a proxy with ``LLMEngine``'s interface.

Why a process: the engine is host bound on a GPU (every step is Python scheduling plus the launch of a few hundred
kernels), and a server that streams a chunk per token per client keeps its event loop busy in Python too. In one
process both share one GIL, and every millisecond the event loop holds it is taken from the engine: on the H200 the
server reached 65% of the offline engine's tok/s at 64 streams (benchmarks/RESULTS.md). vLLM runs its EngineCore
apart from the API server for the same reason.

``EngineProcessClient(engine_args)`` spawns the child, which builds the ``LLMEngine`` and then loops on its own:
while it has unfinished requests it steps without waiting for anyone, reading commands between steps; idle, it
blocks on the command pipe. After each step it sends the *deltas* of the step's outputs (new token ids, new text,
new logprobs, finish state) and the engine's stats; the client rebuilds cumulative ``RequestOutput`` objects (new
objects each time: the event loop may still read the previous ones).

The client is used exactly like an ``LLMEngine`` by one thread (``serving.async_engine.AsyncEngine``'s engine thread):

* ``add_request`` sends the request and waits for the child's answer (it raises the child's ValueError);
* ``step()`` returns the outputs of every step the child finished since the last call, blocking for one if none;
* ``abort_request`` is fire-and-forget; ``stats()`` is the child's latest, with requests added since counted as
  waiting; ``has_unfinished_requests()`` is the client's own view (added, neither finished nor aborted);
* a dead child (crash, kill) makes ``step`` / ``add_request`` raise ``EngineProcessDied``; ``close()`` stops it.

Requests and outputs cross the pipe pickled (``SamplingParams`` and the output dataclasses are plain data).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import threading
import traceback
from typing import Any

from serving.async_engine import EngineDeadError

logger = logging.getLogger(__name__)


class EngineProcessDied(EngineDeadError):
    """The engine process exited or stopped answering (an ``EngineDeadError``: the engine loop dies with it)."""


# ------------------------------------------------------------------------------------------------ child side
def _child_main(engine_args, conn) -> None:  # runs in the spawned process
    try:
        from paged_jax.engine import LLMEngine

        engine = LLMEngine(engine_args, use_tqdm=False)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("failed", _describe(exc), isinstance(exc, ValueError)))
        return
    tokenizer_path = engine_args.tokenizer or engine.model_path
    conn.send(("ready", {"max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size,
                         "model_path": engine.model_path, "tokenizer_path": tokenizer_path,
                         "stats": dict(engine.stats())}))
    sent: dict[str, list[list[int]]] = {}  # request id -> per completion [tokens sent, chars sent, logprobs sent]
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
                    _, request_id, prompt, params = message
                    try:
                        engine.add_request(request_id, prompt, params)
                    except Exception as exc:  # noqa: BLE001 - the caller's error (bad request), not the engine's
                        conn.send(("added", request_id, exc if _picklable(exc) else ValueError(str(exc))))
                    else:
                        conn.send(("added", request_id, None))
                elif kind == "abort":
                    engine.abort_request(message[1])
                    for request_id in message[1]:
                        sent.pop(request_id, None)
            if engine.has_unfinished_requests():
                outputs = engine.step()
                conn.send(("step", [_delta(output, sent) for output in outputs], dict(engine.stats())))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return  # the parent went away
    except BaseException as exc:  # noqa: BLE001 - the parent turns it into EngineDeadError for every client
        try:
            conn.send(("died", _describe(exc)))
        except (OSError, ValueError):
            pass


def _delta(output, sent: dict) -> tuple:
    """What is new in ``output`` since the last delta of its request (the whole prompt on the first one)."""
    state = sent.get(output.request_id)
    first = state is None
    if first:
        state = sent[output.request_id] = [[0, 0, 0] for _ in output.outputs]
    completions = []
    for completion, seen in zip(output.outputs, state):
        new_tokens = completion.token_ids[seen[0]:]
        new_text = completion.text[seen[1]:]
        new_logprobs = None if completion.logprobs is None else completion.logprobs[seen[2]:]
        seen[0], seen[1] = len(completion.token_ids), len(completion.text)
        seen[2] = 0 if completion.logprobs is None else len(completion.logprobs)
        completions.append((completion.index, new_text, new_tokens, completion.cumulative_logprob, new_logprobs,
                            completion.finish_reason, completion.stop_reason))
    if output.finished:
        sent.pop(output.request_id, None)
    head = (output.prompt, output.prompt_token_ids) if first else None
    return (output.request_id, head, completions, output.finished, output.num_cached_tokens, output.metrics)


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
@dataclasses.dataclass
class _Accumulated:
    prompt: str | None
    prompt_token_ids: list[int]
    texts: list[str]
    token_ids: list[list[int]]
    logprobs: list[list | None]


class EngineProcessClient:
    """``LLMEngine``'s interface over an engine running in a spawned child process (see the module docstring).

    Args:
      engine_args: ``EngineArgs`` for the child's ``LLMEngine``.
      start_timeout: seconds to wait for the child to load the model and compile (None: no limit).
    Raises:
      ValueError: the child rejected ``engine_args`` (its message).
      EngineProcessDied: the child failed otherwise or did not start in time.
    """

    def __init__(self, engine_args, *, start_timeout: float | None = None):
        context = multiprocessing.get_context("spawn")  # JAX is not fork-safe
        self._conn, child_conn = context.Pipe(duplex=True)
        self._process = context.Process(target=_child_main, args=(engine_args, child_conn), daemon=True,
                                        name="paged-jax-engine")
        self._process.start()
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
        self._stats: dict = dict(info["stats"])
        from paged_jax.engine import LLMEngine

        self.tokenizer = LLMEngine._load_tokenizer(info["tokenizer_path"])
        self._live: dict[str, _Accumulated | None] = {}  # added, neither finished nor aborted
        self._added_since_stats = 0
        self._pending_outputs: list = []
        self._closed = False
        self._lock = threading.Lock()  # close() may come from another thread than the engine thread

    # ------------------------------------------------------------------ LLMEngine interface (one thread)
    def add_request(self, request_id: str, prompt: Any, params: Any = None) -> None:
        if request_id in self._live:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._send(("add", request_id, prompt, params))
        while True:  # step results may arrive first: keep them for step()
            message = self._recv()
            if message[0] == "added" and message[1] == request_id:
                if message[2] is not None:
                    raise message[2]
                self._live[request_id] = None
                self._added_since_stats += 1
                return
            self._handle(message)

    def abort_request(self, request_id) -> None:
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        request_ids = [r for r in request_ids if r in self._live]
        if not request_ids:
            return
        for r in request_ids:
            del self._live[r]
        self._send(("abort", request_ids))

    def step(self, *, finished_only: bool = False) -> list:
        while not self._pending_outputs and self._live:
            self._handle(self._recv())
            if not self._pending_outputs and self._stats.get("num_unfinished_requests") == 0:
                # The child holds nothing any more (its stats come after every acknowledged add), so whatever is
                # still live here ended without an output; never block on a child that will not step again.
                logger.warning("engine process holds none of %d live requests; dropping them", len(self._live))
                self._live.clear()
        outputs, self._pending_outputs = self._pending_outputs, []
        return [o for o in outputs if o.finished] if finished_only else outputs

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

    def _rebuild(self, delta):
        """A fresh cumulative ``RequestOutput`` from the request's accumulated state plus ``delta``; None for a
        request aborted here meanwhile."""
        from paged_jax.outputs import CompletionOutput, RequestOutput

        request_id, head, completions, finished, num_cached_tokens, metrics = delta
        if request_id not in self._live:
            return None
        acc = self._live[request_id]
        if acc is None:
            prompt, prompt_token_ids = head if head is not None else (None, [])
            n = len(completions)
            acc = self._live[request_id] = _Accumulated(prompt, prompt_token_ids, [""] * n, [[] for _ in range(n)],
                                                        [None] * n)
        outs = []
        for i, (index, new_text, new_tokens, cumulative_logprob, new_logprobs, finish_reason,
                stop_reason) in enumerate(completions):
            acc.texts[i] += new_text
            acc.token_ids[i] = acc.token_ids[i] + list(new_tokens)  # a new list: the last one may still be read
            if new_logprobs is not None:
                acc.logprobs[i] = (acc.logprobs[i] or []) + list(new_logprobs)
            outs.append(CompletionOutput(index=index, text=acc.texts[i], token_ids=acc.token_ids[i],
                                         cumulative_logprob=cumulative_logprob, logprobs=acc.logprobs[i],
                                         finish_reason=finish_reason, stop_reason=stop_reason))
        if finished:
            del self._live[request_id]
        return RequestOutput(request_id=request_id, prompt=acc.prompt, prompt_token_ids=acc.prompt_token_ids,
                             outputs=outs, finished=finished, num_cached_tokens=num_cached_tokens, metrics=metrics)


def engine_process_enabled(flag: bool | None) -> bool:
    """The CLI flag, else ``PAGED_JAX_ENGINE_PROCESS`` (``0`` = a thread); on by default: on the H200 at 64 streams
    the server reached 11,834 output tok/s with the engine in its own process vs 8,484 on a thread of the server
    process (offline engine 13,337; benchmarks/RESULTS.md)."""
    if flag is not None:
        return bool(flag)
    return os.environ.get("PAGED_JAX_ENGINE_PROCESS", "1") != "0"
