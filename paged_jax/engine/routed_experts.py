"""The core's side of a mixture-of-experts model's routing outputs: each sequence's routed experts by position
(``--enable-return-routed-experts``, vLLM's RL router replay) and the running per-expert token counts
(``--enable-expert-load-metrics``).

A sequence's routing is kept by token position, so a request preempted and recomputed overwrites what it had, a
prefill split into chunks fills it chunk by chunk, and a fork row (n > 1, best_of) starts from its parent's. Each
output of the sequence carries the positions recorded since its previous one (``take_new``); the output processor
joins them and, when the sequence finishes (by a stop string too), keeps its first ``num_tokens - 1``: every token
that went through a forward (the prompt and all sampled tokens but the last), vLLM's
``CompletionOutput.routed_experts`` ``[num_tokens - 1, num_sparse_layers, top_k]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container

import numpy as np

from paged_jax.core.sched_output import SchedulerOutput
from paged_jax.engine.messages import RoutedExperts
from paged_jax.metrics import MOE_EXPERT_TOKENS
from paged_jax.worker.step_io import StepOutput


@dataclasses.dataclass
class _SequenceRouting:
    """One sequence's routing: ``ids [capacity, L, k]`` with positions ``[0, length)`` recorded, ``[0, shipped)``
    already sent in its outputs."""

    ids: np.ndarray
    length: int = 0
    shipped: int = 0


class RoutedExpertsRecorder:
    """Per sequence (request id), the routing of its forwarded tokens, grown as steps report them."""

    def __init__(self):
        self._by_request: dict[str, _SequenceRouting] = {}

    def record(self, scheduler_output: SchedulerOutput, result: StepOutput, live: Container[str]) -> None:
        """Store the step's rows' routing (``result.routed_experts``, per row ``[n, L, k]``) at their positions, for
        the sequences in ``live`` (request ids; with async scheduling a sequence may have ended since the step)."""
        if result.routed_experts is None:
            return
        by_request = self._by_request
        for row, routing in zip(scheduler_output.scheduled_rows(), result.routed_experts):
            request_id = row.request_id
            if request_id not in live:
                continue
            if row.fork_parent is not None:  # a fork shares its parent's tokens so far (its row comes after)
                parent = by_request.get(row.fork_parent)
                if parent is not None:
                    by_request[request_id] = _SequenceRouting(parent.ids.copy(), parent.length)
                continue
            end = row.num_computed_tokens + len(routing)
            held = by_request.get(request_id)
            if held is None:
                held = by_request[request_id] = _SequenceRouting(np.zeros((end,) + routing.shape[1:], routing.dtype))
            elif len(held.ids) < end:
                grown = np.zeros((max(end, 2 * len(held.ids)),) + routing.shape[1:], routing.dtype)
                grown[:held.length] = held.ids[:held.length]
                held.ids = grown
            held.ids[row.num_computed_tokens:end] = routing
            held.length = max(held.length, end)

    def take_new(self, request_id: str) -> RoutedExperts | None:
        """The sequence's routing recorded since its previous output (``[n, L, k]``), or None when there is none."""
        held = self._by_request.get(request_id)
        if held is None or held.shipped >= held.length:
            return None
        new = held.ids[held.shipped:held.length]
        held.shipped = held.length
        return RoutedExperts.from_array(new)

    def drop(self, request_id: str) -> None:
        """Forget a finished or aborted sequence."""
        self._by_request.pop(request_id, None)


class ExpertLoad:
    """Tokens routed to each expert of each sparse layer of ``config`` (a ``models.config.ModelConfig``) since start
    (``counts``: ``int64[num_sparse_layers, E]``)."""

    def __init__(self, config):
        self.layer_ids = [i for i in range(config.num_hidden_layers) if config.moe.is_sparse(i)]
        self.counts = np.zeros((len(self.layer_ids), config.moe.num_experts), np.int64)

    def record(self, result: StepOutput) -> None:
        if result.expert_load is None:
            return
        self.counts += result.expert_load

    def as_stats(self) -> dict[str, int]:
        """As engine stats (flat numbers, summed over data-parallel replicas):
        ``moe_expert_tokens.<decoder layer index>.<expert>``."""
        return {f"{MOE_EXPERT_TOKENS[0]}.{layer}.{expert}": int(count)
                for layer, row in zip(self.layer_ids, self.counts.tolist()) for expert, count in enumerate(row)}

