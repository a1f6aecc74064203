"""Dispatching a built step (``ModelRunner``'s other half): the host-to-device copy of the step buffer and the
jitted calls, inline or on the runner's one dispatch thread, whole or in two halves, and the multi-host step
channel's messages for each.

Two halves (``ModelRunner.execute(..., defer_sampling=True)`` then ``dispatch_sampling``): with async scheduling a
step's forward does not need the grammar bitmask, only its sampling does. The engine dispatches step k+1's forward
(its decode inputs come from step k's tokens on the device), then fetches step k's tokens, advances the grammars
and only then fills the bitmask and dispatches mask + sampler, so that host work overlaps the forward (vLLM computes
its bitmask while the forward runs, too). Device order is unchanged: forward k+1 follows sampling k, sampling k+1
follows forward k+1, and the next forward reads sampling k+1's tokens; a second ``execute`` before the deferred
sampling was dispatched is a RuntimeError.

Multi-host messages (``paged_jax.parallel.follower.follow`` replays them): ``"dispatch"`` (a whole step),
``"forward"`` and ``"sample"`` (the two halves, in that order).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import jax
import numpy as np

from paged_jax.parallel.multihost import local_copies
from paged_jax.worker.sampler import SamplingMode
from paged_jax.worker.step_io import PendingStep
from paged_jax.structured_output import fill_step_bitmask


@dataclasses.dataclass
class DeferredSampling:
    """A step whose forward is dispatched and whose sampling waits for ``dispatch_sampling``: its handle, the forward's
    device outputs (or their Future on the dispatch thread), the grammar of each packed row (None: free), the
    sampler row count R, and ``_run_sampling``'s arguments after the bitmask."""

    handle: PendingStep
    forward: tuple | concurrent.futures.Future
    grammars: list
    num_rows: int
    sampling_args: tuple


class StepDispatchMixin:
    """The dispatch methods of ``ModelRunner`` (which owns the state they use: ``_dispatcher``, ``_last_dispatch``,
    ``_deferred``, ``step_channel``, the jitted functions, the KV pool, ``_prev_tokens``)."""

    def dispatch_sampling(self, handle: PendingStep) -> None:
        """Second half of a step ``execute(..., defer_sampling=True)`` left without its sampling: fill the grammar
        bitmask from the rows' grammars now (they must have seen every token before this step's) and dispatch mask +
        sampler (+ prompt logprobs). A no-op for a step dispatched whole."""
        deferred = self._deferred
        if deferred is None or deferred.handle is not handle:
            return
        self._deferred = None
        grammar_bitmask = fill_step_bitmask(deferred.grammars, deferred.num_rows, self.vocab_size)
        forward = deferred.forward

        def dispatch():  # on the dispatch thread the forward, queued before, has been dispatched by now
            outputs = forward.result() if isinstance(forward, concurrent.futures.Future) else forward
            history, bias_table, prompt_targets, mode, num_logprobs, wants_logprobs = deferred.sampling_args
            return self._dispatch_sampling(outputs, history, bias_table, grammar_bitmask, prompt_targets, mode,
                                           num_logprobs, wants_logprobs)

        handle.set_device_outputs(self._submit(dispatch))

    def _submit(self, fn, *args):
        """Run ``fn(*args)`` now, or queue it on the dispatch thread (-> its Future)."""
        if self._dispatcher is None:
            return fn(*args)
        self._last_dispatch = self._dispatcher.submit(fn, *args)
        return self._last_dispatch

    def _dispatch(self, buf: np.ndarray, history: np.ndarray | None, bias_table: np.ndarray | None,
                  grammar_bitmask: np.ndarray | None, prompt_targets: np.ndarray | None, num_tokens: int,
                  num_seqs: int, mode: str, num_logprobs: int, wants_logprobs: bool) -> tuple:
        """Send one step's buffer and launch its forward + sampling, and the prompt logprobs when some row wants them
        (on the dispatch thread if there is one). Returns the device outputs to fetch (sampler's, prompt logprobs'),
        their host copies already started."""
        if self.step_channel is not None:
            self.step_channel.publish("dispatch", (buf, history, bias_table, grammar_bitmask, prompt_targets,
                                                   num_tokens, num_seqs, mode, num_logprobs, wants_logprobs))
        return self._run_sampling(self._run_forward(buf, num_tokens, num_seqs), history, bias_table,
                                  grammar_bitmask, prompt_targets, mode, num_logprobs, wants_logprobs)

    def _dispatch_forward(self, buf: np.ndarray, num_tokens: int, num_seqs: int) -> tuple:
        """A deferred step's first half (``execute(defer_sampling=True)``): the forward alone."""
        if self.step_channel is not None:
            self.step_channel.publish("forward", (buf, num_tokens, num_seqs))
        return self._run_forward(buf, num_tokens, num_seqs)

    def _dispatch_sampling(self, forward_outputs: tuple, *sampling_args) -> tuple:
        """A deferred step's second half (``dispatch_sampling``) on ``forward_outputs`` of ``_dispatch_forward``;
        ``sampling_args`` as ``_run_sampling``'s."""
        if self.step_channel is not None:
            self.step_channel.publish("sample", sampling_args)
        return self._run_sampling(forward_outputs, *sampling_args)

    def _run_forward(self, buf: np.ndarray, num_tokens: int, num_seqs: int) -> tuple:
        """-> (logits f32[R, V], sampling words, hidden [T, hidden]) on device; the KV pool updated in place."""
        # One process: the executable takes the numpy buffer itself (its C++ call path transfers it, far cheaper
        # than ``jax.device_put``'s); several: each process puts its own replica first.
        self.kv_pool, logits, sampling_words, hidden = self._forward(
            self._param_leaves, self.kv_pool, buf if self._single_process else jax.device_put(buf, self.device),
            self._prev_tokens,
            self.lora_slots and self.lora_slots.arrays, num_tokens=num_tokens, num_seqs=num_seqs)
        return logits, sampling_words, hidden

    def _run_sampling(self, forward_outputs: tuple, history: np.ndarray | None, bias_table: np.ndarray | None,
                      grammar_bitmask: np.ndarray | None, prompt_targets: np.ndarray | None, mode: str,
                      num_logprobs: int, wants_logprobs: bool) -> tuple:
        """Mask (grammar), sample, prompt logprobs -> the device outputs to fetch, host copies started."""
        logits, sampling_words, hidden = forward_outputs
        num_rows = logits.shape[0]
        if grammar_bitmask is not None:
            logits = self._apply_grammar_bitmask(logits, jax.device_put(grammar_bitmask, self.device))
        # Full mode's variants all take the bias table (ModelRunner.sampler_variants): without a row that uses it,
        # a neutral one (no logit_bias entries, every token allowed).
        bias_table = (jax.device_put(bias_table, self.device) if bias_table is not None
                      else self._neutral_bias_tables[num_rows] if mode == SamplingMode.FULL.value
                      else self._no_history[num_rows])
        history = jax.device_put(history, self.device) if history is not None else self._no_history[num_rows]
        outs = self._sample(logits, sampling_words, history, bias_table, mode=mode, num_logprobs=num_logprobs)
        self._prev_tokens = outs[0]
        fetch = local_copies(outs if wants_logprobs else outs[:1])
        prompt_fetch = () if prompt_targets is None else local_copies(self._prompt_logprobs(
            self._param_leaves, hidden, jax.device_put(prompt_targets, self.device)))
        for array in (*fetch, *prompt_fetch):
            array.copy_to_host_async()  # start the device->host copy now; result() then only waits for it
        return fetch, prompt_fetch

    def write_lora_slot(self, slot: int, loaded) -> None:
        """Put a LoRA adapter (``LoadedLoRA``) into device slot ``slot`` after the steps already dispatched."""
        if self._dispatcher is None:
            return self.lora_slots.write(slot, loaded)
        self._last_dispatch = self._dispatcher.submit(self.lora_slots.write, slot, loaded)

    def wait_for_dispatch(self) -> None:
        """Block until every step handed to the dispatch thread has been dispatched (not computed); re-raises a
        dispatch error. Anything that uses the KV pool outside ``execute`` calls this first."""
        if self._last_dispatch is not None:
            self._last_dispatch.result()

    def close(self) -> None:
        """Stop the dispatch thread (after the steps already handed to it)."""
        if self._dispatcher is not None:
            self._dispatcher.shutdown(wait=True)
