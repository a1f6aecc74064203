"""Verification of drafts against the target model, and vLLM's speculative-decoding counters.

The proposers here (ngram, suffix) put all their probability on the one token they propose: q is one-hot. Standard
speculative rejection sampling then accepts draft d with probability min(1, p(d) / q(d)) = p(d) and, on rejection,
samples from max(0, p - q) normalized = p without d, renormalized. Drawing x ~ p at the draft position and
accepting iff x == d does exactly that: P(accept) = p(d), and a rejected x is p conditioned on x != d. So the step
samples the target at every draft position with the sampler's own rules (temperature, top-k/p, penalties,
logit_bias, seeds: the token of output index i is drawn from the noise of (seed, i), as without drafts) and keeps the
longest prefix of drafts the samples agree with, then the sample after it. Greedy rows sample the argmax: identical to
decoding without drafts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


def num_accepted(draft_token_ids: Sequence[int], target_token_ids: Sequence[int]) -> int:
    """Length of the longest prefix of ``draft_token_ids`` (k) equal to the target's samples at the same positions
    (``target_token_ids``, k)."""
    for i, (draft, target) in enumerate(zip(draft_token_ids, target_token_ids)):
        if draft != target:
            return i
    return len(draft_token_ids)


@dataclasses.dataclass
class SpecDecodingStats:
    """vLLM's counters (``vllm:spec_decode_num_drafts``, ``_num_draft_tokens``, ``_num_accepted_tokens``,
    ``_num_accepted_tokens_per_pos``): sequences that verified drafts, drafts verified, drafts accepted, and per
    draft position how many were accepted."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += accepted
        for pos in range(accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verifying step of a sequence: 1 (the target's own) + accepted drafts per draft (vLLM's)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
                "mean_acceptance_length": self.mean_acceptance_length}
