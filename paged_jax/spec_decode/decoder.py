"""What the engine core drives each step: propose drafts for the sequences that got tokens, then verify the drafts a
step computed (``verify``) and count them (vLLM's metrics)."""

from __future__ import annotations

from collections.abc import Iterable

from paged_jax.core.request import Request
from paged_jax.core.sched_output import SchedulerOutput
from paged_jax.spec_decode.config import MODEL_METHODS, SpeculativeConfig
from paged_jax.spec_decode.ngram import NgramProposer
from paged_jax.spec_decode.suffix import SuffixProposer
from paged_jax.spec_decode.verify import SpecDecodingStats, num_accepted
from paged_jax.worker.step_io import StepOutput


class SpecDecoder:
    """The proposer of ``config.method`` and the counters of one engine core.

    A sequence with a grammar (structured outputs) takes the drafts its grammar allows, as vLLM's: ``propose``
    truncates them at the first token the grammar forbids (``SequenceGrammar.validate_tokens``, on the host, also
    for a model drafter's drafts, which come back with the step's result before the next step is scheduled), the
    verify step masks every sampled position of the sequence, draft position j with the grammar advanced through the
    first j drafts (``structured_output.fill_step_bitmask``), and the grammar then accepts the tokens kept. The
    target's distribution at each position is the masked one, so verification stays exact: greedy outputs equal
    those without drafts, and a forbidden token is never kept. Beam-search beams (held after every token) never take
    drafts: they decode one token per step, with the same outputs."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.stats = SpecDecodingStats(config.num_speculative_tokens)
        k = config.num_speculative_tokens
        self._ngram = (NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
                       if config.method == "ngram" else None)
        self._suffix = (SuffixProposer(k, config.suffix_decoding_max_tree_depth,
                                       config.suffix_decoding_max_cached_requests,
                                       config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
                        if config.method == "suffix" else None)

    def propose(self, requests: Iterable[Request], num_running: int,
                proposed: dict[str, list[int]] | None = None, overlapped: bool = False) -> None:
        """Set the drafts (``Request.spec_token_ids``) of each request that just got tokens; finished ones leave
        the proposer. None while ``num_running`` reaches ``disable_by_batch_size``, or when ``overlapped`` (async
        scheduling already scheduled their next step, ``drafts_follow`` having said none would come).
        ``proposed``: a model drafter's drafts by request id (``StepOutput.proposed_draft_ids``; ``model_drafts``),
        computed on the device."""
        limit = self.config.disable_by_batch_size
        disabled = overlapped or (limit is not None and num_running >= limit)
        ngram, model_method = self._ngram, self.config.method in MODEL_METHODS
        for request in requests:  # every running sequence, every step: kept lean
            if request.is_finished:
                self._finish(request)
                continue
            if disabled or request.hold_after_sample:
                request.spec_token_ids = []
                continue
            if ngram is not None:
                drafts = ngram.propose(request.request_id, request.prompt_token_ids, request.output_token_ids)
            elif model_method:
                drafts = (proposed or {}).get(request.request_id, [])
            else:
                drafts = self._suffix.propose(request.request_id, request.all_token_ids, request.num_prompt_tokens)
            grammar = request.grammar  # constrained: the drafts before the first one its grammar forbids
            request.spec_token_ids = grammar.validate_tokens(drafts) if grammar is not None and drafts else drafts

    def drafts_follow(self, requests: Iterable[Request], num_running: int) -> bool:
        """Whether ``propose`` may give drafts to some of ``requests`` once their step's tokens are known, with
        ``num_running`` sequences (async scheduling: counted before that step's stop tokens are known; a sequence
        stopping there can bring the count under ``disable_by_batch_size`` one step later than without it)."""
        limit = self.config.disable_by_batch_size
        if limit is not None and num_running >= limit:
            return False
        return any(not request.hold_after_sample and not request.is_finished for request in requests)

    def prepare(self, requests: Iterable[Request], num_running: int) -> None:
        """While the device computes a step of ``requests``: the n-gram proposer's work that needs only the tokens
        known before it (``NgramIndex.prepare``), so ``propose`` after the step is a lookup of the new token."""
        ngram, limit = self._ngram, self.config.disable_by_batch_size
        if ngram is None or (limit is not None and num_running >= limit):
            return
        for request in requests:
            if not request.hold_after_sample and not request.is_finished:
                ngram.prepare(request.request_id, request.prompt_token_ids, request.output_token_ids)

    def _finish(self, request: Request) -> None:
        """A sequence finished: its tokens feed the suffix trees of recent requests; its n-gram index goes."""
        if self._suffix is not None:
            self._suffix.finish(request.request_id, request.all_token_ids)
        elif self._ngram is not None:
            self._ngram.finish(request.request_id)

    @staticmethod
    def model_drafts(requests: Iterable[Request], rows: Iterable[int], result: StepOutput) -> dict[str, list[int]]:
        """A model drafter's drafts of ``requests`` (their step rows ``rows``, in the same order) out of the step's
        result, which holds some (``proposed_draft_ids`` set): request id -> drafts."""
        drafts = result.proposed_draft_ids
        return {r.request_id: drafts[row].tolist() for r, row in zip(requests, rows) if drafts[row, 0] >= 0}

    def forget(self, request_id: str) -> None:
        """A sequence aborted: drop its proposer state."""
        if self._suffix is not None:
            self._suffix.finish(request_id, ())
        elif self._ngram is not None:
            self._ngram.finish(request_id)

    def verify(self, scheduler_output: SchedulerOutput, result: StepOutput, tokens: list[int]) -> dict[str, list[int]]:
        """The drafts each verifying row keeps (``verify``'s module docstring): request id -> accepted drafts, for
        ``Scheduler.update_from_output``; ``tokens`` (the step's sampled token per row) gets, for a row that rejected
        a draft, the target's sample at that draft's position in place of the one after its last draft."""
        accepted: dict[str, list[int]] = {}
        targets_all = result.draft_outputs.sampled_token_ids.tolist()
        for row, positions in result.draft_rows.items():
            request_id = scheduler_output.requests[row].request_id
            drafts = scheduler_output.spec_token_ids[request_id]
            targets = targets_all[positions.start:positions.stop]
            count = num_accepted(drafts, targets)
            accepted[request_id] = drafts[:count]
            if count < len(drafts):
                tokens[row] = targets[count]
            self.stats.observe(len(drafts), count)
        return accepted
