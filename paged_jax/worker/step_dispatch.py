"""Dispatching built steps (``StepDispatcher``, a component ``ModelRunner`` holds): where and when the runner's
device calls run (inline or on one dispatch thread, in ``execute`` order), a step whole or in two halves, and
waiting for what was handed over. The calls themselves are the runner's (``StepDevice``).

Two halves (``ModelRunner.execute(..., defer_sampling=True)`` then ``dispatch_sampling``): with async scheduling a
step's forward does not need the grammar bitmask, only its sampling does. The engine dispatches step k+1's forward
(its decode inputs come from step k's tokens on the device), then fetches step k's tokens, advances the grammars
and only then fills the bitmask and dispatches mask + sampler, so that host work overlaps the forward (vLLM computes
its bitmask while the forward runs, too). Device order is unchanged: forward k+1 follows sampling k, sampling k+1
follows forward k+1, and the next forward reads sampling k+1's tokens; a second ``execute`` before the deferred
sampling was dispatched is a RuntimeError.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Protocol

import numpy as np

from paged_jax.worker.step_io import PendingStep


class StepDevice(Protocol):
    """The device calls a dispatcher runs (``ModelRunner``'s)."""

    def run_forward(self, buf: np.ndarray, num_tokens: int, num_seqs: int) -> tuple:
        """The jitted forward on a step buffer -> its device outputs (logits, sampling words, hidden, the MoE
        outputs' dict or None, a model drafter's step inputs or None)."""
        ...

    def run_sampling(self, forward_outputs: tuple, grammar_bitmask: np.ndarray | None,
                     sampling: "SamplingArgs") -> tuple:
        """Mask (grammar), sampler, prompt logprobs (and a model drafter's proposals) on a forward's outputs -> the
        device outputs to fetch."""
        ...


@dataclasses.dataclass(frozen=True)
class SamplingArgs:
    """What a step's sampling takes besides the forward's outputs and the grammar bitmask: the penalty history
    int32[R, L] and bias table int32[R, W] (None: none), prompt-logprob targets int32[T] (None: none), the sampler
    variant (mode, top-logprob width) and whether any logprob comes back."""

    history: np.ndarray | None
    bias_table: np.ndarray | None
    prompt_targets: np.ndarray | None
    mode: str
    num_logprobs: int
    wants_logprobs: bool


@dataclasses.dataclass
class DeferredSampling:
    """A step whose forward is dispatched and whose sampling waits for ``dispatch_sampling``: its handle, the forward's
    device outputs (or their Future on the dispatch thread), its grammars (``structured_output.step_grammars``: the
    grammar of each packed row, None: free, and the drafts of the constrained rows that verify some), the sampler
    row count R and its ``SamplingArgs``."""

    handle: PendingStep
    forward: tuple | concurrent.futures.Future
    grammars: tuple[list, dict]
    num_rows: int
    sampling: SamplingArgs


class StepDispatcher:
    """Runs a ``StepDevice``'s calls for each step, inline or on one worker thread (``dispatch_thread``).

    Dispatching a step means launching a few hundred kernels, which takes the host milliseconds with the GIL
    released; on the worker it overlaps the caller's Python work for the next step (the engine's async scheduling).
    Steps still run in the order they were handed over: every use of the KV pool and of the previous step's tokens
    goes through the one worker.
    """

    def __init__(self, device: StepDevice, *, dispatch_thread: bool = False):
        self.device = device
        self._executor = (concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="paged-jax-dispatch")
                          if dispatch_thread else None)
        self._last: concurrent.futures.Future | None = None
        self.deferred: DeferredSampling | None = None  # a step whose sampling waits for dispatch_sampling

    def submit(self, fn, *args):
        """Run ``fn(*args)`` now, or queue it on the dispatch thread (-> its Future)."""
        if self._executor is None:
            return fn(*args)
        self._last = self._executor.submit(fn, *args)
        return self._last

    def dispatch(self, handle: PendingStep, buf: np.ndarray, num_tokens: int, num_seqs: int, sampling: SamplingArgs,
                 *, grammars: tuple[list, dict] | None = None, num_rows: int = 0) -> None:
        """Hand a built step over: whole, or (``grammars``: ``structured_output.step_grammars``' rows, some
        constrained; ``num_rows``: the sampler's R) the forward alone, its sampling left for ``dispatch_sampling``
        with the bitmask."""
        if self.deferred is not None:
            raise RuntimeError("execute: the previous step's sampling was never dispatched (dispatch_sampling)")
        device = self.device
        if grammars is None:
            handle.set_device_outputs(self.submit(
                lambda: device.run_sampling(device.run_forward(buf, num_tokens, num_seqs), None, sampling)))
            return
        forward = self.submit(device.run_forward, buf, num_tokens, num_seqs)
        self.deferred = DeferredSampling(handle, forward, grammars, num_rows, sampling)

    def pending_bitmask_rows(self, handle: PendingStep) -> tuple[tuple[list, dict], int] | None:
        """``(grammars, R)`` of ``handle``'s step while its sampling waits for a bitmask, else None."""
        deferred = self.deferred
        if deferred is None or deferred.handle is not handle:
            return None
        return deferred.grammars, deferred.num_rows

    def dispatch_sampling(self, handle: PendingStep, grammar_bitmask: np.ndarray) -> None:
        """Second half of a step left without its sampling: dispatch mask (``grammar_bitmask`` int32[R, ceil(V/32)])
        + sampler (+ prompt logprobs). A no-op for a step dispatched whole."""
        deferred = self.deferred
        if deferred is None or deferred.handle is not handle:
            return
        self.deferred = None
        forward, device = deferred.forward, self.device

        def dispatch():  # on the dispatch thread the forward, queued before, has been dispatched by now
            outputs = forward.result() if isinstance(forward, concurrent.futures.Future) else forward
            return device.run_sampling(outputs, grammar_bitmask, deferred.sampling)

        handle.set_device_outputs(self.submit(dispatch))

    def wait(self) -> None:
        """Block until every call handed to the dispatch thread has been dispatched (not computed); re-raises a
        dispatch error. Anything that uses the KV pool outside a step calls this first."""
        if self._last is not None:
            self._last.result()

    def close(self) -> None:
        """Stop the dispatch thread (after the calls already handed to it)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
