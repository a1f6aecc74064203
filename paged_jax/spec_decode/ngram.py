"""Prompt lookup (vLLM's ``ngram`` method): the drafts are the tokens that followed the latest earlier occurrence of
the sequence's last n tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min`` (longest match first).

Each sequence keeps an index of its n-grams (``NgramIndex``), extended by the tokens it gained since its last call:
a step costs a few dict operations per sequence, not a scan of its whole history. A sequence's tokens only ever grow
at the end (rejected drafts never become tokens; recompute after preemption keeps them), so the index stays valid
for the sequence's life.

``prepare`` runs while the device computes a step: it indexes the tokens known so far and looks up every n-gram that
the step's one new token could complete, so that after the step ``propose`` only checks that token against those
few candidates (none, on text without repeats) instead of indexing and searching on the step's critical path."""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """One sequence's tokens and its n-grams for every n in [min_n, max_n], keyed by their first n - 1 tokens.

    Attributes:
      tokens: list[int] the sequence's tokens so far (prompt + outputs).
      follows: dict mapping an n-gram's first n - 1 tokens (a tuple; lengths never collide) to a dict from its last
        token to the end (exclusive) of its latest occurrence among those indexed.
      indexed: n-grams ending at or before this position are in ``follows``.
      candidates: after ``prepare`` (``prepared`` = the length then): the ``follows`` entries of the suffixes that
        one more token would complete, longest n first.
    """

    __slots__ = ("tokens", "follows", "indexed", "candidates", "prepared", "min_n", "max_n", "k")

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int):
        self.k, self.min_n, self.max_n = num_speculative_tokens, min_n, max_n
        self.tokens: list[int] = []
        self.follows: dict[tuple[int, ...], dict[int, int]] = {}
        self.indexed = 0
        self.candidates: list[dict[int, int]] = []
        self.prepared = -1

    def _extend(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> int:
        """Append the tokens gained since the last call; returns the new length."""
        tokens = self.tokens
        first, num_prompt = len(tokens), len(prompt_token_ids)
        if first < num_prompt:
            tokens += prompt_token_ids[first:]
            tokens += output_token_ids
        else:
            tokens += output_token_ids[first - num_prompt:]
        return len(tokens)

    def _index(self, upto: int) -> None:
        """Index the n-grams ending after ``indexed`` and at or before ``upto``, in order (a later occurrence
        replaces an earlier one)."""
        tokens, follows, min_n, max_n = self.tokens, self.follows, self.min_n, self.max_n
        for end in range(max(self.indexed + 1, 1), upto + 1):
            last = tokens[end - 1]
            for n in range(min_n, min(max_n, end) + 1):
                key = tuple(tokens[end - n:end - 1])
                ends = follows.get(key)
                if ends is None:
                    follows[key] = {last: end}
                else:
                    ends[last] = end
        self.indexed = max(self.indexed, upto)

    def prepare(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        """Before a step that may add one token: index every n-gram of the known tokens (the current suffix too: once
        a token follows it, it is an earlier occurrence) and keep the candidates that token would be looked up in."""
        length = self._extend(prompt_token_ids, output_token_ids)
        self._index(length)
        tokens, follows = self.tokens, self.follows
        candidates = []
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            ends = follows.get(tuple(tokens[length + 1 - n:length]))
            if ends is not None:
                candidates.append(ends)
        self.candidates, self.prepared = candidates, length

    def propose(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> list[int]:
        """Take the tokens the sequence (prompt then outputs, both only grown at the end since the previous call)
        gained and return its drafts (list[int], at most k; empty when no n-gram of the suffix occurred earlier)."""
        tokens, prepared = self.tokens, self.prepared
        self.prepared = -1
        if prepared == len(tokens) and len(prompt_token_ids) + len(output_token_ids) == prepared + 1:
            token = output_token_ids[-1]  # prepare took the whole prompt: the one new token is an output
            tokens.append(token)
            for ends in self.candidates:  # the step's one token against the prepared candidates
                end = ends.get(token)
                if end is not None:
                    return tokens[end:end + self.k]
            return []
        length = self._extend(prompt_token_ids, output_token_ids)
        self._index(length - 1)
        last = tokens[-1]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self.follows.get(tuple(tokens[length - n:length - 1]), {}).get(last)
            if end is not None and end < length:
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
        return self._index_of(request_id).propose(prompt_token_ids, output_token_ids)

    def prepare(self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        """While the device computes a step: ``NgramIndex.prepare`` of sequence ``request_id``."""
        self._index_of(request_id).prepare(prompt_token_ids, output_token_ids)

    def _index_of(self, request_id: str) -> NgramIndex:
        index = self._indices.get(request_id)
        if index is None:
            index = self._indices[request_id] = NgramIndex(self.k, self.min_n, self.max_n)
        return index

    def finish(self, request_id: str) -> None:
        """Sequence ``request_id`` ended: drop its index (unknown ids are ignored)."""
        self._indices.pop(request_id, None)

    @property
    def num_sequences(self) -> int:
        """Sequences with an index (unfinished ones that proposed)."""
        return len(self._indices)
