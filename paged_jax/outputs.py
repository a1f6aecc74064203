"""Output types returned by ``LLMEngine.step`` / ``LLM.generate``, with vLLM's names and fields.

``LLMEngine.step()`` emits *delta* outputs (vLLM's ``RequestOutputKind.DELTA``): each ``RequestOutput`` carries, per
sequence that progressed, only what is new since the previous output of that request (new token ids, new text, new
logprobs). The output with ``finished=True`` is the request's last one; it carries the finish reasons and the
metrics. Callers that need the whole generation accumulate once with ``RequestOutput.add`` (``LLM.generate`` gets
it whole from ``step(finished_only=True)``, vLLM's ``FINAL_ONLY``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class Logprob:
    """Log probability of one token (vLLM's ``Logprob``).

    logprob: log_softmax of the raw logits at this token.
    rank: 1-based rank of the token in the vocabulary by logprob (None if unknown).
    decoded_token: the token's text (None when not detokenized).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per generated token: {token_id: Logprob} for the sampled token and the requested top alternatives.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first, then {token_id: Logprob} for the prompt token and the requested top
# alternatives (vLLM's ``PromptLogprobs``).
PromptLogprobs = list[dict[int, Logprob] | None]


def make_logprob_dict(token_id: int, logprob: float, rank: int, top_ids: Sequence[int], top_logprobs: Sequence[float],
                      decode: Callable[[int], str | None]) -> dict[int, Logprob]:
    """One position's ``{token_id: Logprob}``: the token itself (its logprob and rank), then the top alternatives
    ranked 1, 2, .. in order (one that is the token itself keeps the token's entry)."""
    entry = {token_id: Logprob(logprob=float(logprob), rank=int(rank), decoded_token=decode(token_id))}
    for top_rank, (top_id, top_logprob) in enumerate(zip(top_ids, top_logprobs), start=1):
        top_id = int(top_id)
        if top_id not in entry:
            entry[top_id] = Logprob(logprob=float(top_logprob), rank=top_rank, decoded_token=decode(top_id))
    return entry


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.time()`` seconds) of one request's life; None until the event happens."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    time_in_queue: float | None = None


@dataclass(slots=True)  # one per running request per step: no instance dict
class CompletionOutput:
    """One output sequence of a request (vLLM's ``CompletionOutput``).

    index: position among the request's n sequences.
    text: generated text new in this output (the whole text once accumulated).
    token_ids: generated token ids new in this output (all of them once accumulated).
    cumulative_logprob: sum of the logprobs of all tokens sampled so far, not only the new ones (None when logprobs
      were not requested).
    logprobs: per token of ``token_ids``, {token_id: Logprob}, when ``SamplingParams.logprobs`` is set.
    finish_reason: "stop" (EOS, stop token or stop string), "length" (max_tokens / max_model_len), "abort", or
      None while running.
    stop_reason: the stop string (str) or stop token id (int) that ended the sequence; None for EOS / length.
    routed_experts: with ``enable_return_routed_experts``, on the finished output: the expert ids each forwarded
      token (the prompt and every generated token but the last) was routed to at each sparse layer,
      ``np.ndarray uint8 | uint16[num_prompt_tokens + num_generated - 1, num_sparse_layers, top_k]``; else None.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    routed_experts: np.ndarray | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)  # one per running request per step: no instance dict
class RequestOutput:
    """Everything the engine reports about one request (vLLM's ``RequestOutput``).

    prompt: the prompt text (None when the request was given token ids only).
    prompt_token_ids: the prompt; every output of a request shares one list (read it, do not mutate it).
    outputs: one ``CompletionOutput`` per sequence with something new (new tokens, or its finish), by index; all
      ``SamplingParams.n`` of them once accumulated.
    finished: all sequences are finished (this is the request's last output).
    num_cached_tokens: prompt tokens served from the prefix cache.
    metrics: set on the finished output only.
    prompt_logprobs: with ``SamplingParams.prompt_logprobs``: per prompt token None (the first) or {token_id:
      Logprob} (the prompt token and the top alternatives), on the request's first output only (as vLLM); else None.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: PromptLogprobs | None = None

    def add(self, next_output: RequestOutput) -> None:
        """Append ``next_output``, the next delta of the same request, to this output in place (vLLM's
        ``RequestOutput.add`` with ``aggregate=True``): texts, token ids and logprobs are extended per sequence index,
        the finish state and counters are taken from ``next_output``.

        This output takes ownership: its lists are extended in place and ``next_output``'s completions may become
        part of it, so neither may still be read as the delta it was.
        """
        by_index = {completion.index: completion for completion in self.outputs}
        for new in next_output.outputs:
            completion = by_index.get(new.index)
            if completion is None:
                self.outputs.append(new)
                by_index[new.index] = new
                continue
            completion.text += new.text
            completion.token_ids.extend(new.token_ids)
            if new.logprobs is not None:
                if completion.logprobs is None:
                    completion.logprobs = new.logprobs
                else:
                    completion.logprobs.extend(new.logprobs)
            completion.cumulative_logprob = new.cumulative_logprob
            completion.finish_reason = new.finish_reason
            completion.stop_reason = new.stop_reason
            if new.routed_experts is not None:
                completion.routed_experts = new.routed_experts
        if len(self.outputs) > 1 and any(a.index > b.index for a, b in zip(self.outputs, self.outputs[1:])):
            self.outputs.sort(key=lambda completion: completion.index)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = next_output.prompt_logprobs
        self.finished = next_output.finished
        self.num_cached_tokens = next_output.num_cached_tokens
        if next_output.metrics is not None:
            self.metrics = next_output.metrics


_new_object = object.__new__


def running_delta(request_id: str, prompt: str | None, prompt_token_ids: list[int], token_ids: list[int],
                  num_cached_tokens: int) -> RequestOutput:
    """The delta of a running request with one sequence and token ids only (the output of every running request,
    every step): ``RequestOutput(request_id, prompt, prompt_token_ids, [CompletionOutput(0, "", token_ids, None,
    None)], False, num_cached_tokens)``, every field of both set here rather than by the dataclasses' ``__init__``
    (a class call into a Python ``__init__`` costs about twice these slot stores)."""
    completion = _new_object(CompletionOutput)
    completion.index, completion.text, completion.token_ids = 0, "", token_ids
    completion.cumulative_logprob = completion.logprobs = completion.finish_reason = completion.stop_reason = None
    completion.routed_experts = None
    output = _new_object(RequestOutput)
    output.request_id, output.prompt, output.prompt_token_ids = request_id, prompt, prompt_token_ids
    output.outputs, output.finished, output.num_cached_tokens = [completion], False, num_cached_tokens
    output.metrics = output.prompt_logprobs = None
    return output
