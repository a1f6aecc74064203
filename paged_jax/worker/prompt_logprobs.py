"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``): for each prompt token after the first, the logprob
and rank of that token given the ones before it, plus the ``prompt_logprobs`` most likely alternatives.

The device half runs in the model runner as its own jitted function, compiled per token bucket at warm-up and
dispatched only on steps where some prompt chunk computes them (``NewRequestData.prompt_logprobs``): it
takes the forward's final hidden states of every token of the step, computes the logits at every position in row
chunks (``LOGITS_CHUNK_ROWS``, so the f32 ``[rows, vocab]`` logits stay bounded) and gathers each position's
target logprob, rank and top-K (K fixed at the runner's ``max_logprobs``; requests slice it on the host).

The runner targets each prompt chunk's position p at prompt token p + 1 (its batch row holds the whole prompt, so
chunked prefill needs nothing special). The host half, ``PromptLogprobsCollector``, is the engine's per-request
record; positions already recorded (a prompt recomputed after a preemption) are not recorded again. Requests that
want prompt logprobs never take prefix-cache hits (``Request.skip_prefix_cache``, as vLLM): every prompt position
has to be computed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from paged_jax.outputs import PromptLogprobs, make_logprob_dict
from paged_jax.worker.sampler import raw_logprob_outputs
from paged_jax.worker.step_io import PromptLogprobsChunk

# Rows of float32 logits materialized at once (the KV pool's sizing leaves room for a few such chunks).
LOGITS_CHUNK_ROWS = 256


def prompt_logprobs_on_device(compute_logits: Callable[[jax.Array], jax.Array], hidden: jax.Array,
                              targets: jax.Array, *, num_logprobs: int, chunk_rows: int = LOGITS_CHUNK_ROWS,
                              batch_invariant: bool = False) -> tuple[jax.Array, ...]:
    """Target logprobs at every token of a step (traced inside the runner's jitted function).

    Args:
      compute_logits: ``model.compute_logits``, ``[N, hidden] -> f32[N, V]``.
      hidden: [T, hidden] the forward's final hidden states (after the final norm).
      targets: int32[T] the token whose logprob each position gives; < 0 = not wanted (computed, ignored).
      num_logprobs: K, the top alternatives per position.
      chunk_rows: positions per logits chunk (chunks run one after another, so at most this many rows of logits
        are live).
      batch_invariant: the engine's batch-invariant mode (``raw_logprob_outputs``'s).
    Returns:
      (logprob f32[T], rank i32[T] (1-based), top ids i32[T, K], top logprobs f32[T, K]), all under log_softmax of
      the raw logits.
    """
    num_tokens = hidden.shape[0]
    rows = min(chunk_rows, num_tokens)
    num_chunks = -(-num_tokens // rows)
    pad = num_chunks * rows - num_tokens
    hidden = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(num_chunks, rows, hidden.shape[-1])
    targets = jnp.pad(jnp.maximum(targets, 0), (0, pad)).reshape(num_chunks, rows)

    def one_chunk(chunk):
        chunk_hidden, chunk_targets = chunk
        logprob, top_ids, top_logprobs, rank = raw_logprob_outputs(compute_logits(chunk_hidden), chunk_targets,
                                                                   num_logprobs, batch_invariant=batch_invariant)
        return logprob, rank, top_ids, top_logprobs

    # A loop over chunks (lax.map), not a Python loop: XLA merges unrolled chunks' LM-head matmuls back into one
    # [T, V] logits matrix, which is exactly the memory this bound exists to avoid. This executable runs only on
    # steps that ask for prompt logprobs, so the loop's per-iteration cost stays off the decode hot path.
    outputs = jax.lax.map(one_chunk, (hidden, targets))
    return tuple(out.reshape(num_chunks * rows, *out.shape[2:])[:num_tokens] for out in outputs)


class PromptLogprobsCollector:
    """One request's prompt logprobs, gathered over its prefill chunks.

    Args:
      prompt_token_ids: the prompt (length P).
      num_logprobs: alternatives per position (``SamplingParams.prompt_logprobs``), at most the runner's K.
      decode: ``token id -> text`` for ``Logprob.decoded_token`` (returns None without a tokenizer).

    ``entries`` is vLLM's ``RequestOutput.prompt_logprobs`` as it grows: None for the first token, then per prompt
    token ``{token_id: Logprob}`` (the token itself, with its rank, and the top ``num_logprobs`` ranked 1..).
    """

    def __init__(self, prompt_token_ids: Sequence[int], num_logprobs: int, decode: Callable[[int], str | None]):
        self.prompt_token_ids = prompt_token_ids
        self.num_logprobs = num_logprobs
        self._decode = decode
        self.entries: PromptLogprobs = [None]
        self.reported = False

    @property
    def complete(self) -> bool:
        return len(self.entries) == len(self.prompt_token_ids)

    def record(self, num_computed_tokens: int, chunk: PromptLogprobsChunk) -> None:
        """Add the entries of a chunk that started at ``num_computed_tokens`` (those not recorded yet)."""
        logprobs, ranks = chunk.logprobs.tolist(), chunk.ranks.tolist()
        top_ids = chunk.top_token_ids[:, :self.num_logprobs].tolist()
        top_logprobs = chunk.top_logprobs[:, :self.num_logprobs].tolist()
        for i in range(len(logprobs)):
            index = num_computed_tokens + 1 + i
            if index == len(self.entries):
                self.entries.append(make_logprob_dict(self.prompt_token_ids[index], logprobs[i], ranks[i],
                                                      top_ids[i], top_logprobs[i], self._decode))

    def take(self) -> PromptLogprobs | None:
        """The entries, once, when complete (they go with the request's first output, as vLLM); else None."""
        if self.reported or not self.complete:
            return None
        self.reported = True
        return self.entries
