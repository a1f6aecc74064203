"""Output types returned by ``LLMEngine.step`` / ``LLM.generate``, with vLLM's names and fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

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


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.time()`` seconds) of one request's life; None until the event happens."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    time_in_queue: float | None = None


@dataclass
class CompletionOutput:
    """One output sequence of a request (vLLM's ``CompletionOutput``).

    index: position among the request's n sequences.
    text: generated text (cumulative).
    token_ids: generated token ids (cumulative).
    cumulative_logprob: sum of the sampled tokens' logprobs (None when logprobs were not requested).
    logprobs: per generated token, {token_id: Logprob}, when ``SamplingParams.logprobs`` is set.
    finish_reason: "stop" (EOS, stop token or stop string), "length" (max_tokens / max_model_len), "abort", or
      None while running.
    stop_reason: the stop string (str) or stop token id (int) that ended the sequence; None for EOS / length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything the engine reports about one request (vLLM's ``RequestOutput``).

    prompt: the prompt text (None when the request was given token ids only).
    outputs: one ``CompletionOutput`` per sequence (``SamplingParams.n``).
    finished: all sequences are finished.
    num_cached_tokens: prompt tokens served from the prefix cache.
    prompt_logprobs: always None (prompt logprobs are not supported); kept for vLLM compatibility.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: None = field(default=None)
