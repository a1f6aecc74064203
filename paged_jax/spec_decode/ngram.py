"""Prompt lookup (vLLM's ``ngram`` method): the drafts are the tokens that followed the latest earlier occurrence of
the sequence's last n tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min`` (longest match first)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Proposes up to ``num_speculative_tokens`` drafts from a sequence's own tokens (prompt + outputs)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        """token_ids: the sequence so far -> its drafts (list[int], at most k; empty when no n-gram recurs)."""
        tokens = np.asarray(token_ids, np.int64)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n:]
            # Windows starting at 0 .. length - n - 1: every earlier occurrence (the suffix itself excluded).
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start:start + self.k].tolist()
        return []
