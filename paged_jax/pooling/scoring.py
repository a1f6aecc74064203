"""Scores of text pairs (vLLM's ``score`` task): a cross-encoder (a one-label classifier) reads each pair as one
prompt, the tokenizer's pair encoding; an embedder scores a pair by the cosine similarity of the two embeddings."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pair_inputs(data_1: str | Sequence[str], data_2: str | Sequence[str],
                names: tuple[str, str] = ("text_1", "text_2")) -> list[tuple[str, str]]:
    """vLLM's pairing: one first text against each second text (1:N), or texts paired in order (N:N); ValueError
    naming the field (``names``: the two fields' names) otherwise."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    for name, texts in zip(names, (first, second)):
        if not texts:
            raise ValueError(f"{name} must not be empty")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"{names[1]}: {len(second)} texts for {len(first)} {names[0]} entries (1:N or N:N)")
    return list(zip(first, second))


def distinct_texts(pairs: Sequence[tuple[str, str]]) -> tuple[list[str], list[tuple[int, int]]]:
    """An embedder's work for ``pairs``: each distinct text once (a 1:N query is embedded once), and per pair the
    indices of its two texts in that list."""
    index: dict[str, int] = {}
    for pair in pairs:
        for text in pair:
            index.setdefault(text, len(index))
    return list(index), [(index[a], index[b]) for a, b in pairs]


def pair_prompt_token_ids(tokenizer, first: str, second: str) -> list[int]:
    """A cross-encoder's prompt for one pair: the tokenizer's pair encoding (``tokenizer(text, text_pair)``)."""
    if tokenizer is None:
        raise ValueError("text_1: scoring text pairs needs a tokenizer and this model has none")
    return list(tokenizer(first, second)["input_ids"])


def check_cross_encoder(pooler) -> None:
    """A classifier scores pairs only with one label (its sigmoid is the score), as vLLM."""
    if pooler.task == "classify" and pooler.width != 1:
        raise ValueError(f"model: scoring needs a cross-encoder with one label; this classifier has {pooler.width}")


def cosine_similarity(a: Sequence[float], b: Sequence[float]) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(a @ b / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-12))
