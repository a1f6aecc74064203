"""Building the engine core's per-step ``EngineCoreOutput`` s from a step's results (``EngineCore``'s output half).

``token_output`` makes one sequence's output (its new tokens, their logprobs, its first-output facts and finish).
``TokenOnlyRows`` is the column-wise path of a steady decode: while a step's rows are the same running requests as
a step whose outputs all carried their token only (no logprobs, grammar, drafts, routing, pooling, first-output facts
or finish), their outputs are one ``DecodeTokens`` made from the sampled token ids alone, without a per-row check or
object.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from paged_jax.core.request import Request, RequestStatus
from paged_jax.core.sched_output import SchedulerOutput
from paged_jax.engine.messages import DecodeTokens, EngineCoreOutput, PromptLogprobsPart, TokenLogprobs
from paged_jax.worker.step_io import StepOutput

_STATUS = operator.attrgetter("status")
_REQUEST_ID = operator.attrgetter("request_id")
_INDEX = operator.attrgetter("index")


class TokenOnlyRows:
    """The rows of the last step whose outputs were all token-only (see the module docstring): their requests
    (row order) and each one's output request id and sequence index."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.request_ids: list[str] = []
        self.indices: list[int] = []

    def remember(self, requests: list[Request], outputs: list[EngineCoreOutput]) -> None:
        """``requests`` (the step's rows, every one progressed) got the token-only ``outputs`` (row order)."""
        self.requests = list(requests)
        self.request_ids = list(map(_REQUEST_ID, outputs))
        self.indices = list(map(_INDEX, outputs))

    def forget(self) -> None:
        self.requests, self.request_ids, self.indices = [], [], []

    def outputs(self, progressed: list[Request], tokens: Sequence[int], running: Sequence[Request] = ()
                ) -> DecodeTokens | None:
        """The outputs of a step whose rows all progressed (``progressed``, row order; ``tokens`` their sampled ids)
        when those are the remembered requests, all still running (``running``: the scheduler's running list, which
        holds running requests only: equal to ``progressed``, no status is read); else None. What made a row
        token-only stays so while it runs (its parameters, no grammar, its first output reported)."""
        if progressed != self.requests or len(tokens) != len(progressed):
            return None
        if progressed != running and any(status is not RequestStatus.RUNNING
                                         for status in set(map(_STATUS, progressed))):
            return None
        return DecodeTokens(self.request_ids, self.indices, tokens if type(tokens) is list else list(tokens))


def token_output(group, index: int, request: Request, tokens: list[int], result: StepOutput, row: int,
                 routed_experts, pooling) -> EngineCoreOutput:
    """The output of ``tokens``, sequence ``index`` of ``group``'s (``EngineCore``'s ``_Group``) new tokens: one, or
    a verifying row's, whose logprobs are the target's at the draft positions and after the last draft
    (``logprob_sources``). ``routed_experts`` / ``pooling``: the core's recorder and accumulator, or None."""
    params = request.params
    output = EngineCoreOutput(group.request_id, index, tokens)
    sources = logprob_sources(result, row, len(tokens))
    if params.logprobs is not None:
        k = params.logprobs
        output.new_logprobs = [TokenLogprobs(token, float(out.logprobs[i]), int(out.ranks[i]),
                                             out.top_token_ids[i][:k].tolist(), out.top_logprobs[i][:k].tolist())
                               for token, (out, i) in zip(tokens, sources)]
    if group.cumulative_logprobs is not None:
        group.cumulative_logprobs[index] += sum(float(out.logprobs[i]) for out, i in sources)
        output.cumulative_logprob = group.cumulative_logprobs[index]
    if routed_experts is not None:  # the positions recorded since the sequence's previous output
        output.routed_experts = routed_experts.take_new(request.request_id)
    if not group.reported_start:
        group.reported_start = True
        output.scheduled_time = group.scheduled_time
        output.num_cached_tokens = request.num_cached_prompt_tokens
    if request.is_finished:
        output.finish_reason = request.finish_reason
        output.stop_reason = request.stop_reason
        if pooling is not None:
            output.pooled = pooling.take(request.request_id)
    return output


def logprob_sources(result: StepOutput, row: int, num_tokens: int) -> list[tuple[StepOutput, int]]:
    """Where the logprobs of a row's ``num_tokens`` new tokens are: ``(outputs, index)`` each. A verifying row's
    token i was sampled at its draft position i (``result.draft_outputs``), its k + 1-th after its last draft (the
    row's own); any other row's one token at the row."""
    positions = (result.draft_rows or {}).get(row)
    if positions is None:
        return [(result, row)]
    return [(result.draft_outputs, positions[i]) if i < len(positions) else (result, row) for i in range(num_tokens)]


def rows_of(requests_of_rows: list[Request], progressed: list[Request]) -> Sequence[int]:
    """The step row of each of ``progressed``, requests of ``requests_of_rows`` in the same order (the scheduler's
    update keeps the row order)."""
    if len(progressed) == len(requests_of_rows):
        return range(len(progressed))
    rows, row = [], 0
    for request in progressed:
        while requests_of_rows[row] is not request:
            row += 1
        rows.append(row)
        row += 1
    return rows


def no_text(token_id: int) -> None:
    """Token text inside the core: none (the output processor decodes)."""
    return None


def prompt_logprob_outputs(seq_of: dict, scheduler_output: SchedulerOutput, result: StepOutput
                           ) -> list[EngineCoreOutput]:
    """The prompt logprobs a finished step computed (``result.prompt_logprobs``, one chunk per row), for the rows
    whose sequence is still in ``seq_of`` (the core's request id -> (group, sequence index))."""
    if result.prompt_logprobs is None:
        return []
    outputs = []
    starts = scheduler_output.row_num_computed_tokens()
    for request, start, chunk in zip(scheduler_output.requests, starts, result.prompt_logprobs):
        entry = seq_of.get(request.request_id)
        if chunk is None or entry is None or entry[0].seqs.get(entry[1]) is not request:
            continue  # no prompt logprobs in this row, or aborted meanwhile
        k = request.params.prompt_logprobs
        part = PromptLogprobsPart(start, chunk.logprobs.tolist(), chunk.ranks.tolist(),
                                  chunk.top_token_ids[:, :k].tolist(), chunk.top_logprobs[:, :k].tolist())
        outputs.append(EngineCoreOutput(entry[0].request_id, entry[1], prompt_logprobs=part))
        if start + len(part.logprobs) + 1 >= request.num_prompt_tokens:
            request.skip_prefix_cache = False  # every position computed: a later recompute may take hits
    return outputs
