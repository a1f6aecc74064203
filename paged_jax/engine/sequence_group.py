"""Engine-side state of a user request and its sequences (n > 1, best_of, beam search): which scheduler
``Request`` each output sequence is, its detokenizer, logprobs and what earlier outputs already reported.

A request with ``SamplingParams.n > 1`` (or ``best_of``) runs as ``num_sequences`` scheduler requests: sequence 0
computes the prompt and the others are forked from it in the step that samples its first token
(``Request.pending_forks``): they share its blocks and sample their first token from the same logits, each with its
own seed (``child_seed``). With ``best_of > n`` nothing is reported until every sequence has finished; then the n with
the highest cumulative logprob are returned, numbered 0..n-1 best first (``reported_sequences``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import numpy as np

from paged_jax.engine.detokenizer import IncrementalDetokenizer
from paged_jax.outputs import Logprob, RequestMetrics
from paged_jax.worker.prompt_logprobs import PromptLogprobsCollector
from paged_jax.core.request import Request
from paged_jax.sampling_params import SamplingParams

if TYPE_CHECKING:
    from paged_jax.engine.beam_search import BeamSearchState


def child_seed(seed: int, index: int) -> int:
    """Seed of the ``index``-th sequence of an n > 1 request: the request seed itself for index 0, a well-mixed
    64-bit function of (seed, index) for the others."""
    if index == 0:
        return seed
    return int(np.random.SeedSequence([seed % (1 << 64), index]).generate_state(2, np.uint32).view(np.uint64)[0])


@dataclasses.dataclass
class SequenceState:
    """Engine-side state of one output sequence (one scheduler ``Request``)."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    admitted: bool = False  # handed to the scheduler (as a request or as a pending fork)
    num_reported_tokens: int = 0  # what earlier outputs carried: an output is the delta past these
    num_reported_chars: int = 0
    finish_reported: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestState:
    """Engine-side state of one user request (its sequences; the live beams of a beam search)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[SequenceState]
    metrics: RequestMetrics
    prompt_logprobs: PromptLogprobsCollector | None = None  # computed by sequence 0
    beam_search: "BeamSearchState | None" = None

    @property
    def finished(self) -> bool:
        if self.beam_search is not None:
            return self.beam_search.done
        for seq in self.seqs:  # a loop, not all(<genexpr>): read for every running request every step
            if seq.finish_reason is None:
                return False
        return True

    @functools.cached_property
    def reports_deltas(self) -> bool:
        """Whether outputs go out as the tokens come (else only the finished output: best_of > n, beam search)."""
        return self.beam_search is None and self.params.num_sequences == self.params.n

    @functools.cached_property
    def plain_stream(self) -> bool:
        """One sequence and nothing per token but its ids and text (no logprobs, prompt logprobs, beam search): its
        running deltas can go as ``paged_jax.engine.step_outputs.StreamDeltas`` rows. Fixed once the request is added."""
        if self.beam_search is not None or self.prompt_logprobs is not None or self.params.num_sequences != 1:
            return False
        seq = self.seqs[0]
        return seq.logprobs is None and seq.cumulative_logprob is None


def reported_sequences(state: RequestState) -> list[tuple[int, SequenceState]]:
    """``(output index, sequence)`` of what a request reports: every sequence under its own index; with
    ``best_of > n`` (finished) the n with the highest cumulative logprob, best first, numbered 0..n-1."""
    params = state.params
    if params.num_sequences == params.n:
        return [(seq.index, seq) for seq in state.seqs]
    ranked = sorted(state.seqs, key=lambda seq: seq.cumulative_logprob, reverse=True)
    return list(enumerate(ranked[:params.n]))
