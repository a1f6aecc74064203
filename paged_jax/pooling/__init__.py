"""Pooling models (vLLM's ``--runner pooling``): embeddings, classification and scores from the same paged,
bucketed step as generation.

A pooling request is a prefill-only request: the scheduler and the KV pool run it as any prompt (chunked prefill,
prefix caching for last-token pooling) and it finishes when its prompt is computed. The runner's step gives each row's
pooled hidden state through the model's head instead of logits (``pooler.PoolingForward``); the core accumulates a
prompt's chunks and post-processes (``pooler.PoolingAccumulator``); the output processor returns
``PoolingRequestOutput``. ``config``: which runner a model gets and its ``PoolerConfig``; ``params``:
``PoolingParams``; ``outputs``: the returned types.
"""

from paged_jax.pooling.outputs import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput,
                                       EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput, ScoringOutput,
                                       ScoringRequestOutput)
from paged_jax.pooling.params import PoolingParams

__all__ = ["PoolingParams", "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput",
           "ClassificationOutput", "ClassificationRequestOutput", "ScoringOutput", "ScoringRequestOutput"]
