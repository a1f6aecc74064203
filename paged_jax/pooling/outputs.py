"""What the pooling entry points return, with vLLM's names: ``PoolingRequestOutput`` (the engine's, ``.outputs.data``)
and the task views ``EmbeddingRequestOutput`` (``.outputs.embedding``), ``ClassificationRequestOutput``
(``.outputs.probs``) and ``ScoringRequestOutput`` (``.outputs.score``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

T = TypeVar("T")


@dataclass
class PoolingOutput:
    """``data``: float32[W] the request's pooled, post-processed vector."""

    data: np.ndarray


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput(Generic[T]):
    """One finished pooling request: its id, output, prompt token ids, ``finished`` (always True: pooling requests
    report once) and ``num_cached_tokens`` (prompt tokens served from the prefix cache)."""

    request_id: str
    outputs: T
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(output.request_id, EmbeddingOutput(output.outputs.data.tolist()), output.prompt_token_ids,
                   output.finished, output.num_cached_tokens)


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return cls(output.request_id, ClassificationOutput(output.outputs.data.tolist()), output.prompt_token_ids,
                   output.finished, output.num_cached_tokens)


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    pass
