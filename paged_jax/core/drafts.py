"""Speculative decoding's part of scheduling (``paged_jax.spec_decode`` proposes the drafts): how many of a request's
drafts a step computes with its next token, and how a verified row's kept drafts become outputs. The ``Scheduler``
calls both; the drafts ride in ``Request.spec_token_ids``."""

from __future__ import annotations

from paged_jax.core.request import Request, RequestStatus, check_stop


def with_drafts(request: Request, num_new: int, budget: int, max_model_len: int) -> int:
    """A decoding request whose row the runner holds computes its drafts with its next token, as many as fit the
    step's ``budget``, ``max_model_len`` (every draft position must be one) and ``max_tokens`` (tokens past it would
    never be kept); any other request drops them. Trims ``request.spec_token_ids``; returns its new-token count,
    drafts included."""
    drafts = request.spec_token_ids
    num_drafts = 0
    if num_new == 1 and request.runner_num_tokens >= 0:
        num_drafts = min(len(drafts), budget - 1, max_model_len - request.num_tokens)
        if request.max_tokens is not None:
            num_drafts = min(num_drafts, request.max_tokens - request.num_output_tokens - 1)
    request.spec_token_ids = drafts[:max(num_drafts, 0)]
    return num_new + len(request.spec_token_ids)


def lookahead_slots(num_computed: int, num_new: int, num_lookahead_tokens: int, max_model_len: int) -> int:
    """KV slots a request allocates for ``num_new`` tokens after ``num_computed``: those and up to
    ``num_lookahead_tokens`` more within ``max_model_len``, where a model drafter writes its draft positions
    (vLLM's look-ahead slots; ``paged_jax.spec_decode.draft_runner``)."""
    return num_new + max(0, min(num_lookahead_tokens, max_model_len - num_computed - num_new))


def apply_drafts(request: Request, num_scheduled: int, drafts: list[int], accepted: list[int], token: int,
                 max_model_len: int) -> RequestStatus | None:
    """A row that verified ``drafts``: its ``accepted`` ones and then ``token`` (the target's sample after the last
    accepted one) become outputs one by one, so a stop token or a length limit inside the run ends it there (returns
    that finished status: the caller finishes the request); otherwise the computed tokens advance past the accepted
    ones only, which rolls back the rejected drafts' K/V (the next step overwrites their slots). Returns None then."""
    if accepted != drafts[:len(accepted)]:
        raise ValueError(f"accepted tokens of {request.request_id!r} are not a prefix of its drafts")
    request.spec_token_ids = []
    for new_token in (*accepted, token):
        request.output_token_ids.append(new_token)
        status = check_stop(request, max_model_len)
        if status is not None:
            return status
    request.num_computed_tokens += num_scheduled - (len(drafts) - len(accepted))
    return None
