"""Prompt lookup (vLLM's ``ngram`` method): the drafts are the tokens that followed the latest earlier occurrence of
the sequence's last n tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min`` (longest match first).

Each sequence keeps an index of its n-grams (``NgramIndex``), extended by the tokens it gained since its last
proposal: a step costs a few dict operations per sequence, not a scan of its whole history. A sequence's tokens only
ever grow at the end (rejected drafts never become tokens; recompute after preemption keeps them), so the index
stays valid for the sequence's life."""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """One sequence's tokens and, for every n in [min_n, max_n], the latest end of each n-gram before its last
    position.

    Attributes:
      tokens: list[int] the sequence's tokens so far (prompt + outputs).
      ends: dict mapping an n-gram (tuple of n ints; lengths never collide) to the end (exclusive) of its latest
        occurrence that ends at or before ``len(tokens) - 1``: the current suffix itself is never an entry.
    """

    __slots__ = ("tokens", "ends", "min_n", "max_n", "k")

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int):
        self.k, self.min_n, self.max_n = num_speculative_tokens, min_n, max_n
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}

    def propose(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> list[int]:
        """Take the tokens the sequence (prompt then outputs, both only grown at the end since the previous call)
        gained, index the n-grams ending before its new last position, and return its drafts (list[int], at most
        k; empty when no n-gram of the suffix occurred earlier). One call per sequence per step: kept to one
        method."""
        tokens, ends, min_n, max_n = self.tokens, self.ends, self.min_n, self.max_n
        first, num_prompt = len(tokens), len(prompt_token_ids)
        if first < num_prompt:
            tokens += prompt_token_ids[first:]
            tokens += output_token_ids
        else:
            tokens += output_token_ids[first - num_prompt:]
        length = len(tokens)
        for end in range(max(first, 1), length):  # in order: a later occurrence replaces an earlier one
            for n in range(min_n, min(max_n, end) + 1):
                ends[tuple(tokens[end - n:end])] = end
        for n in range(min(max_n, length - 1), min_n - 1, -1):
            end = ends.get(tuple(tokens[length - n:]))
            if end is not None:
                return tokens[end:end + self.k]
        return []


class NgramProposer:
    """Proposes up to ``num_speculative_tokens`` drafts from a sequence's own tokens (prompt + outputs), with one
    ``NgramIndex`` per unfinished sequence (by request id)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self._indices: dict[str, NgramIndex] = {}

    def propose(self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> list[int]:
        """The drafts (list[int], at most k) of sequence ``request_id``, whose tokens are the prompt then the outputs
        (both only grown at the end since its previous call)."""
        index = self._indices.get(request_id)
        if index is None:
            index = self._indices[request_id] = NgramIndex(self.k, self.min_n, self.max_n)
        return index.propose(prompt_token_ids, output_token_ids)

    def finish(self, request_id: str) -> None:
        """Sequence ``request_id`` ended: drop its index (unknown ids are ignored)."""
        self._indices.pop(request_id, None)

    @property
    def num_sequences(self) -> int:
        """Sequences with an index (unfinished ones that proposed)."""
        return len(self._indices)
