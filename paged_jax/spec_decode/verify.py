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

    def as_stats(self) -> dict[str, float]:
        """As engine stats: flat numbers (summed over data-parallel replicas), vLLM's names without the prefix; the
        per-position counts as ``spec_decode_num_accepted_tokens_per_pos.<position>``."""
        stats = {f"{STATS_PREFIX}num_drafts": self.num_drafts, f"{STATS_PREFIX}num_draft_tokens": self.num_draft_tokens,
                 f"{STATS_PREFIX}num_accepted_tokens": self.num_accepted_tokens}
        for pos, count in enumerate(self.num_accepted_tokens_per_pos):
            stats[f"{PER_POS_KEY}.{pos}"] = count
        return stats


STATS_PREFIX = "spec_decode_"
PER_POS_KEY = "spec_decode_num_accepted_tokens_per_pos"


def per_position(stats: dict) -> list[int]:
    """The per-position accepted counts out of engine stats (``SpecDecodingStats.as_stats``)."""
    counts = {int(key.rsplit(".", 1)[1]): int(value) for key, value in stats.items() if key.startswith(PER_POS_KEY)}
    return [counts[pos] for pos in sorted(counts)]


def mean_acceptance_length(stats: dict) -> float | None:
    """Tokens per verifying step of a sequence, vLLM's mean acceptance length: 1 (the target's own) + accepted
    drafts per draft, from engine stats; None without speculative decoding or drafts."""
    drafts = stats.get(f"{STATS_PREFIX}num_drafts")
    if not drafts:
        return None
    return 1.0 + stats[f"{STATS_PREFIX}num_accepted_tokens"] / drafts
