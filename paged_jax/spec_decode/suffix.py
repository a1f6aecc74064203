"""Suffix decoding (vLLM's ``suffix`` method, after Arctic Inference's SuffixDecoding): suffix trees, bounded in
depth, over each live sequence's own tokens and over the outputs of recently finished requests. The drafts continue
the longest suffix of the sequence found in a tree, following the most frequent continuation while its estimated
probability stays at or above ``min_token_prob``."""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence


class _Node:
    """A trie node: how many times the path to it occurred, and its continuations."""

    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTree:
    """Every substring of at most ``max_depth`` tokens of the sequences added, with occurrence counts.

    ``extend`` adds one sequence's tokens incrementally (``cursor``: the sequence's open paths, the nodes of its last
    ``max_depth - 1`` suffixes); ``remove`` takes a whole sequence's counts back out."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = _Node()

    def extend(self, cursor: list[_Node], tokens: Sequence[int], sign: int = 1) -> list[_Node]:
        """Add (``sign`` 1) or take back (-1) ``tokens`` appended to the sequence at ``cursor``; returns the new
        cursor."""
        for token in tokens:
            advanced = []
            for node in [self.root, *cursor]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += sign
                if child.count <= 0:
                    del node.children[token]
                advanced.append(child)
            cursor = advanced[:self.max_depth - 1]
        return cursor

    def remove(self, tokens: Sequence[int]) -> None:
        self.extend([], tokens, sign=-1)

    def propose(self, context: Sequence[int], max_tokens: int, max_spec_factor: float,
                min_token_prob: float) -> tuple[list[int], float]:
        """Drafts after ``context`` (its last ``max_depth`` tokens matched, longest continued match first) and their
        score (the sum of their estimated probabilities)."""
        tail = list(context[-self.max_depth:])
        for start in range(len(tail)):
            node = self.root
            for token in tail[start:]:
                node = node.children.get(token)
                if node is None:
                    break
            if node is None or not node.children:
                continue
            limit = min(max_tokens, math.ceil(max_spec_factor * (len(tail) - start)))
            return _follow(node, limit, min_token_prob)
        return [], 0.0


def _follow(node: _Node, limit: int, min_token_prob: float) -> tuple[list[int], float]:
    drafts, score, prob = [], 0.0, 1.0
    while len(drafts) < limit and node.children:
        token, child = max(node.children.items(), key=lambda item: item[1].count)
        prob *= child.count / node.count
        if prob < min_token_prob:
            break
        drafts.append(token)
        score += prob
        node = child
    return drafts, score


class SuffixProposer:
    """Per live sequence its own tree; one global tree over the outputs of the last ``max_cached_requests``
    finished sequences. ``propose`` takes the drafts of the tree that scores higher."""

    def __init__(self, num_speculative_tokens: int, max_tree_depth: int, max_cached_requests: int,
                 max_spec_factor: float, min_token_prob: float):
        self.k = num_speculative_tokens
        self.max_depth = max_tree_depth
        self.max_cached = max_cached_requests
        self.max_spec_factor, self.min_token_prob = max_spec_factor, min_token_prob
        self.global_tree = SuffixTree(max_tree_depth)
        self._cached: collections.deque[list[int]] = collections.deque()  # oldest first
        # request id -> (its tree, the tree's cursor, tokens added, outputs start)
        self._live: dict[str, tuple[SuffixTree, list[_Node], int, int]] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> list[int]:
        """token_ids: the sequence so far (prompt + outputs) -> its drafts (at most k)."""
        tree, cursor, num_added, _ = self._live.get(request_id) or (SuffixTree(self.max_depth), [], 0, 0)
        cursor = tree.extend(cursor, token_ids[num_added:])
        self._live[request_id] = (tree, cursor, len(token_ids), num_prompt_tokens)
        args = (self.k, self.max_spec_factor, self.min_token_prob)
        own = tree.propose(token_ids, *args)
        cached = self.global_tree.propose(token_ids, *args) if self._cached else ([], 0.0)
        return (own if own[1] >= cached[1] else cached)[0]

    def finish(self, request_id: str, token_ids: Sequence[int]) -> None:
        """A sequence ended: drop its tree; its outputs join the global tree (the oldest leave past the cap)."""
        live = self._live.pop(request_id, None)
        if live is None or not self.max_cached:
            return
        outputs = list(token_ids[live[3]:])
        if not outputs:
            return
        self.global_tree.extend([], outputs)
        self._cached.append(outputs)
        while len(self._cached) > self.max_cached:
            self.global_tree.remove(self._cached.popleft())
