"""The pooler: the device half runs inside the runner's jitted step, the host half in the engine core.

Device (``pooled_row_outputs``): the step's forward gives, per row of the step, its pooled hidden state through the
model's head (identity for an embedder, the ``score`` linear of a classifier) in place of the logits: float32[R, W].
"LAST" takes the row's last token of the step, "CLS" its first, "MEAN" the sum over the row's tokens of the step (the
head is linear without bias, so head(sum) / n = head(mean)). Fixed shapes: the step buffer's ``cu_q_lens`` and
``logits_indices`` say where each row's tokens are; nothing else travels.

Host (``PoolingAccumulator``): a prompt's chunks arrive over several steps; the accumulator keeps what each request's
pooling needs (the chunk ending at the prompt's end for LAST, the one starting at 0 for CLS, the running sum for MEAN)
and, when the prompt is complete, applies the request's post-processing (``finalize``): Matryoshka truncation and
normalization of an embedding, the classifier's activation.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.pooling.config import PoolerConfig
from paged_jax.pooling.params import PoolingParams
from paged_jax.worker.step_forward import SingleProgramForward

_NORMALIZE_EPS = 1e-12  # torch.nn.functional.normalize's, as vLLM and sentence-transformers use


def pooled_row_outputs(pooler: PoolerConfig):
    """The ``row_outputs`` of the pooling forward (``paged_jax.worker.step_forward.SingleProgramForward``):
    ``(model, hidden [T, hidden], fields) -> float32[R, W]`` (W = hidden size, or the classifier's labels)."""
    pooling_type, token_ids = pooler.pooling_type, pooler.logit_token_ids

    def row_outputs(model, hidden, fields):
        indices = fields["logits_indices"]  # int32[R]: each row's last token of the step (padding rows: 0)
        cu_q_lens = fields["cu_q_lens"]  # int32[S + 1]
        num_rows, num_tokens = indices.shape[0], hidden.shape[0]
        if pooling_type == "LAST":
            pooled = hidden[indices]
        elif pooling_type == "CLS":
            firsts = jnp.zeros((num_rows,), jnp.int32).at[:cu_q_lens.shape[0] - 1].set(cu_q_lens[:-1])
            pooled = hidden[jnp.minimum(firsts, num_tokens - 1)]
        else:  # MEAN: each token's row from cu_q_lens; padding tokens fall past the last row and are dropped
            token_rows = jnp.searchsorted(cu_q_lens[1:], jnp.arange(num_tokens, dtype=jnp.int32), side="right")
            pooled = jax.ops.segment_sum(hidden.astype(jnp.float32), token_rows, num_segments=num_rows)
        if model.config.head == "none":
            return pooled.astype(jnp.float32)
        logits = model.compute_logits(pooled)
        if token_ids is None:  # the score head's classes
            return logits
        logits = logits[:, jnp.asarray(token_ids, jnp.int32)]  # classifier_from_token: those tokens' logits
        return logits[:, 1:] - logits[:, :1] if pooler.two_way else logits

    return row_outputs


class PoolingForward(SingleProgramForward):
    """The pooling runner's step: one program per bucket whose per-row outputs are ``pooled_row_outputs`` and which
    samples nothing (``pools``)."""

    pools = True

    def __init__(self, pooler: PoolerConfig):
        super().__init__(pooled_row_outputs(pooler))
        self.pooler = pooler  # configuration of the compiled programs (executable_cache.runner_fingerprint)


def finalize(pooled: np.ndarray, params: PoolingParams, pooler: PoolerConfig) -> np.ndarray:
    """A request's output float32[W or dimensions] from its pooled vector float32[W]."""
    vector = pooled.astype(np.float32)
    if pooler.task == "embed":
        if params.dimensions is not None:
            vector = vector[:params.dimensions]
        normalize = pooler.normalize if params.normalize is None else params.normalize
        if normalize:
            vector = vector / max(float(np.linalg.norm(vector)), _NORMALIZE_EPS)
        return vector
    if params.activation is False:
        return vector
    if vector.shape[0] == 1:
        return 1.0 / (1.0 + np.exp(-vector))
    shifted = np.exp(vector - vector.max())
    return shifted / shifted.sum()


class PoolingAccumulator:
    """The pooled state of the engine core's pooling requests (see the module docstring)."""

    def __init__(self, pooler: PoolerConfig):
        self.pooler = pooler
        self._params: dict[str, PoolingParams] = {}
        self._pooled: dict[str, np.ndarray] = {}
        self._counts: dict[str, int] = {}

    def add(self, request_id: str, params: PoolingParams) -> None:
        self._params[request_id] = params

    def discard(self, request_id: str) -> None:
        self._params.pop(request_id, None)
        self._pooled.pop(request_id, None)
        self._counts.pop(request_id, None)

    def record(self, requests: Sequence, starts: Sequence[int], num_new: Sequence[int], pooled: np.ndarray) -> None:
        """One step's rows: ``requests`` (scheduler ``Request``s, row order), tokens in the pool before the step,
        tokens computed in it, and the step's ``pooled`` float32[rows, W]."""
        kind = self.pooler.pooling_type
        for row, (request, start, count) in enumerate(zip(requests, starts, num_new)):
            request_id = request.request_id
            if request_id not in self._params or count == 0:
                continue
            if kind == "LAST":
                if start + count >= request.num_prompt_tokens:
                    self._pooled[request_id] = pooled[row]
            elif kind == "CLS":
                if start == 0:
                    self._pooled[request_id] = pooled[row]
            else:  # MEAN; a recompute after preemption starts again from 0 (no prefix cache with MEAN)
                total = 0 if start == 0 else self._counts.get(request_id, 0)
                previous = self._pooled.get(request_id) if start else None
                self._pooled[request_id] = pooled[row] if previous is None else previous + pooled[row]
                self._counts[request_id] = total + count

    def take(self, request_id: str) -> list[float]:
        """The finished request's output (``finalize``); forgets the request."""
        pooled = self._pooled[request_id]
        if self.pooler.pooling_type == "MEAN":
            pooled = pooled / self._counts[request_id]
        out = finalize(pooled, self._params[request_id], self.pooler)
        self.discard(request_id)
        return out.tolist()
