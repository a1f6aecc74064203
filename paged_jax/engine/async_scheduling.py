"""Async scheduling on the engine side (``EngineArgs.async_scheduling``): step k+1 is scheduled and dispatched
before step k's tokens reach the host. The scheduler is advanced with a placeholder for each token still on the
device (the runner feeds a ``PLACEHOLDER_TOKEN`` from the previous step's on-device samples); the next ``step()`` call resolves
the placeholders, applies the stop rules and detokenizes while the device runs the step after.

Structured outputs overlap too: a grammar row's bitmask needs step k's token, but only at sampling. So with a
constrained row in flight the engine dispatches step k+1's forward alone (``ModelRunner.execute(...,
defer_sampling=True)``), then fetches step k's tokens and advances the grammars while it runs, then fills the bitmask
and dispatches mask + sampler (``ModelRunner.dispatch_sampling``), as vLLM computes its bitmask during the forward.
Rows that read their previous output tokens in the sampler (penalties, bad words: ``reads_output_tokens``) still
need every token on the host when the step is built: a step after one with such a row waits for it first.
"""

from __future__ import annotations

import dataclasses
import time

from paged_jax.core.sched_output import PLACEHOLDER_TOKEN, SchedulerOutput
from paged_jax.outputs import RequestOutput
from paged_jax.core.request import Request
from paged_jax.worker.step_io import PendingStep


@dataclasses.dataclass
class InFlightStep:
    """A dispatched step whose sampled tokens are still placeholders: ``rows`` = (row, request, output index);
    ``scheduler_output``: the step, when some of its rows asked for prompt logprobs, else None."""

    handle: PendingStep
    rows: list[tuple[int, Request, int]]
    scheduler_output: SchedulerOutput | None = None


class AsyncSchedulingMixin:
    """The async half of ``LLMEngine.step`` (which owns ``scheduler``, ``runner``, ``_seq_by_id``, ``_launch``,
    ``_on_token``, ``_collect_outputs``, ``_record_prompt_logprobs`` and ``_in_flight: InFlightStep | None``)."""

    _in_flight: InFlightStep | None

    def _step_async(self, finished_only: bool, stream_deltas=None) -> list[RequestOutput]:
        """Schedule and dispatch step k+1, then (while the device runs it) bring step k's tokens to the host, check
        stop conditions and detokenize; a step with grammar rows gets its sampling dispatched once their matchers
        have seen step k's tokens. A call that schedules nothing just reports the step in flight."""
        outputs: list[RequestOutput] = []
        if self._in_flight is not None and self._in_flight_needs_tokens():
            outputs += self._finish_in_flight(finished_only, stream_deltas)
        scheduler_output = self.scheduler.schedule()
        handle = self._launch(scheduler_output, defer_sampling=self._in_flight is not None)
        if self._in_flight is not None:
            outputs += self._finish_in_flight(finished_only, stream_deltas)  # waits for step k while step k+1 runs
        if handle is not None:
            self.runner.dispatch_sampling(handle)  # a no-op unless only the forward went (grammar rows)
            self._start_in_flight(scheduler_output, handle)
        return outputs

    def _start_in_flight(self, scheduler_output, handle: PendingStep) -> None:
        """Right after dispatch: advance the scheduler as if the step were done, with a placeholder for each sampled
        token, so the next step can be scheduled before the tokens are known."""
        row_of = {r.request_id: i for i, r in enumerate(scheduler_output.requests)}
        placeholders = [PLACEHOLDER_TOKEN if samples else None for samples in scheduler_output.samples]
        progressed = self.scheduler.update_from_output(scheduler_output, placeholders)
        rows = [(row_of[r.request_id], r, r.num_output_tokens - 1) for r in progressed]
        prompt_rows = handle.wants_prompt_logprobs
        # No rows: every sampling row belonged to a request that ended meanwhile; nothing to resolve (unless the step
        # computes prompt logprobs, which must still be recorded).
        self._in_flight = (InFlightStep(handle=handle, rows=rows,
                                        scheduler_output=scheduler_output if prompt_rows else None)
                           if rows or prompt_rows else None)

    def _in_flight_needs_tokens(self) -> bool:
        """Penalties and bad words read every previous token in the sampler when the next step is built: no overlap
        then (grammars only need them at sampling: ``_step_async``)."""
        return any(request.params is not None and request.params.reads_output_tokens
                   for _, request, _ in self._in_flight.rows)

    def _finish_in_flight(self, finished_only: bool = False, stream_deltas=None) -> list[RequestOutput]:
        """Fetch the in-flight step's tokens, let the scheduler replace the placeholders (and apply the stop tokens it
        could not see), advance the grammars, detokenize."""
        flight, self._in_flight = self._in_flight, None
        result = flight.handle.result()
        if flight.scheduler_output is not None:
            self._record_prompt_logprobs(flight.scheduler_output, result)
        tokens = result.sampled_token_ids.tolist()  # Python ints once, not a numpy scalar per row
        now = time.time()
        touched = {}
        seq_by_id, resolve_placeholder, on_token = self._seq_by_id, self.scheduler.resolve_placeholder, self._on_token
        for row, request, output_index in flight.rows:  # every running sequence, every step: kept lean
            entry = seq_by_id.get(request.request_id)
            if entry is None or entry[1].request is not request or entry[1].finish_reason is not None:
                continue  # aborted meanwhile
            state, seq = entry
            resolve_placeholder(request, output_index, tokens[row])
            on_token(state, seq, request, output_index, result, row, now)
            touched[state.request_id] = state
        return self._collect_outputs(touched.values(), now, finished_only, stream_deltas)
