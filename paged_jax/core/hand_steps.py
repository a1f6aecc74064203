"""Steps built by hand for a ``ModelRunner`` driven without the scheduler (tests, kernels-in-the-engine benchmarks):
requests keep the block tables they are given, each step names how many new tokens each request computes, and the
``SchedulerOutput`` diffs come from the scheduler's own builder (``StepBuilder``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from paged_jax.core.sched_output import PLACEHOLDER_TOKEN, SchedulerOutput, StepBuilder
from paged_jax.core.request import Request


class HandScheduler:
    """Requests with fixed block tables, stepped by hand.

    ``add`` a request, ``step({req_id: num_new_tokens})`` for each step's ``SchedulerOutput`` (a request's first
    step sends its whole row), run it, then ``update(output, sampled)`` with the runner's ``StepOutput`` token ids
    (or None: placeholders, as async scheduling feeds them), ``finish`` to drop a row.
    """

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}
        self._finished: list[str] = []

    def add(self, req_id: str, prompt_token_ids: Sequence[int], block_ids: Sequence[int], params: Any = None, *,
            seed: int = 0, num_computed_tokens: int = 0, output_token_ids: Sequence[int] = (), lora: Any = None,
            prompt_logprobs: bool = False) -> Request:
        """A request holding ``block_ids`` (covering every token it will compute), ``num_computed_tokens`` of them
        already in the pool."""
        request = Request(request_id=req_id, prompt_token_ids=list(prompt_token_ids), params=params, seed=seed,
                          output_token_ids=list(output_token_ids), block_ids=list(block_ids),
                          num_computed_tokens=num_computed_tokens, lora=lora, skip_prefix_cache=prompt_logprobs)
        self.requests[req_id] = request
        return request

    def step(self, num_new_tokens: Mapping[str, int], *, forks: Mapping[str, Sequence[str]] | None = None,
             block_copies: Sequence[tuple[int, int]] = (), grammars: Mapping[str, Any] | None = None,
             swap_out: Sequence[tuple[int, int]] = (), swap_in: Sequence[tuple[int, int]] = ()) -> SchedulerOutput:
        """The step computing ``num_new_tokens[req_id]`` tokens of each named request (in this order; held rows
        first, as the scheduler orders them); ``forks``: parent -> ids of children (added before) whose first token
        is sampled from the parent's last token of this step."""
        builder = StepBuilder()
        for req_id, num_new in num_new_tokens.items():
            request = self.requests[req_id]
            known = request.num_tokens + len(request.spec_token_ids)  # drafts (``Request.spec_token_ids``) follow
            if request.num_computed_tokens + num_new > known:
                raise ValueError(f"{req_id!r}: {num_new} new tokens, but only {known} are known")
            builder.add(request, num_new)
        for parent, children in (forks or {}).items():
            for child in children:
                builder.add_fork(self.requests[child], parent)
        builder.grammars.update(grammars or {})
        finished, self._finished = self._finished, []
        return builder.build(finished_req_ids=finished, preempted_req_ids=[], block_copies=list(block_copies),
                             swap_out=list(swap_out), swap_in=list(swap_in))

    def update(self, scheduler_output: SchedulerOutput, sampled_token_ids: Sequence[int] | None) -> None:
        """Advance each row's computed tokens and append its sampled token (``PLACEHOLDER_TOKEN`` for each when
        ``sampled_token_ids`` is None)."""
        num_forks = len(scheduler_output.fork_rows)
        first_fork = scheduler_output.num_rows - num_forks
        for row, (request, samples) in enumerate(zip(scheduler_output.requests, scheduler_output.samples)):
            if row < first_fork:
                request.num_computed_tokens += scheduler_output.num_scheduled_tokens[row]
            else:  # a fork child now shares its parent's computed blocks
                parent = self.requests[scheduler_output.fork_rows[row - first_fork][1]]
                request.num_computed_tokens = parent.num_computed_tokens
            if samples:
                token = PLACEHOLDER_TOKEN if sampled_token_ids is None else int(sampled_token_ids[row])
                request.output_token_ids.append(token)

    def finish(self, req_id: str) -> None:
        """Drop the request; its row leaves the runner's batch with the next step."""
        request = self.requests.pop(req_id)
        if request.runner_num_tokens >= 0:
            self._finished.append(req_id)
