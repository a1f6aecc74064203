"""The core's side of a mixture-of-experts model's routing outputs: each sequence's routed experts by position
(``--enable-return-routed-experts``, vLLM's RL router replay) and the running per-expert token counts
(``--enable-expert-load-metrics``).

A sequence's routing is kept by token position, so a request preempted and recomputed overwrites what it had, a
prefill split into chunks fills it chunk by chunk, and a fork row (n > 1, best_of, beams) starts from its parent's.
When the sequence finishes, ``take`` gives its ``[num_tokens - 1, num_sparse_layers, top_k]`` array: every token
that went through a forward (the prompt and all sampled tokens but the last), as vLLM's
``CompletionOutput.routed_experts``.
"""

from __future__ import annotations

from collections.abc import Container

import numpy as np

from paged_jax.core.sched_output import SchedulerOutput
from paged_jax.engine.messages import RoutedExperts
from paged_jax.metrics import MOE_EXPERT_TOKENS
from paged_jax.worker.step_io import StepOutput


class RoutedExpertsRecorder:
    """Per sequence (request id), the routing of its forwarded tokens, grown as steps report them."""

    def __init__(self):
        self._by_request: dict[str, np.ndarray] = {}

    def record(self, scheduler_output: SchedulerOutput, result: StepOutput, live: Container[str]) -> None:
        """Store the step's rows' routing (``result.routed_experts``, per row ``[n, L, k]``) at their positions, for
        the sequences in ``live`` (request ids; with async scheduling a sequence may have ended since the step)."""
        if result.routed_experts is None:
            return
        for row, routing in zip(scheduler_output.scheduled_rows(), result.routed_experts):
            request_id = row.request_id
            if request_id not in live:
                continue
            if row.fork_parent is not None:  # a fork shares its parent's tokens so far (its row comes after)
                parent = self._by_request.get(row.fork_parent)
                if parent is not None:
                    self._by_request[request_id] = parent.copy()
                continue
            end = row.num_computed_tokens + len(routing)
            held = self._by_request.get(request_id)
            if held is None or len(held) < end:
                grown = np.zeros((max(end, 2 * (0 if held is None else len(held))),) + routing.shape[1:],
                                 routing.dtype)
                if held is not None:
                    grown[:len(held)] = held
                held = self._by_request[request_id] = grown
            held[row.num_computed_tokens:end] = routing

    def take(self, request_id: str, num_tokens: int) -> RoutedExperts | None:
        """The finished sequence's routing of its first ``num_tokens - 1`` tokens (dropped from the recorder), or None
        when none was recorded."""
        held = self._by_request.pop(request_id, None)
        if held is None:
            return None
        return RoutedExperts.from_array(held[:max(num_tokens - 1, 0)])

    def drop(self, request_id: str) -> None:
        """Forget an aborted sequence."""
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

