"""The engine core's boundary types: what goes into the core and what comes out of it, in-process or on the wire.

One schema, msgspec Structs: the in-process ``EngineCore`` takes and returns these same objects, and a core in its own
process (``paged_jax.engine.core_proc``) receives the client messages (``AddRequests``, ``AbortRequests``,
``UtilityCall``, ``Shutdown``) and sends ``EngineCoreOutputs``, MessagePack-encoded with ``encode`` / the decoders
below.

* ``EngineCoreRequest``: a request after the input processor: validated, tokenized, its parameters final. The core
  turns it into its one request state (``paged_jax.core.request.Request``, one per sequence).
* ``EngineCoreOutput``: what one sequence of one request got in one step: its new token ids, their logprobs when asked,
  its finish. No text: detokenization, stop strings and ``RequestOutput`` are the output processor's
  (``paged_jax.engine.output_processor``).
* ``EngineCoreOutputs``: one core step's outputs, the core's stats, and (process core) the answers to client messages.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from paged_jax.lora.request import LoRARequest
from paged_jax.outputs import Logprob
from paged_jax.pooling.config import PoolerConfig
from paged_jax.pooling.params import PoolingParams
from paged_jax.sampling_params import BeamSearchParams, SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request as the engine core takes it.

    Attributes:
      request_id: unique among the core's unfinished requests.
      prompt_token_ids: list[int] (1..max_model_len ids, each in the vocabulary).
      sampling_params: its ``SamplingParams`` (``bad_words`` already tokenized), or None for a beam search.
      beam_search_params: a ``BeamSearchParams`` (then ``sampling_params`` is None).
      arrival_time: ``time.time()`` of arrival (metrics and FCFS order).
      priority: lower runs earlier with ``scheduling_policy="priority"``.
      lora_request: the adapter to run with (``enable_lora``), or None.
      cache_salt: vLLM's prompt ``cache_salt``: prefix-cache entries are shared only among equal salts.
      pooling_params: a pooling request's ``PoolingParams`` (pooling runner; ``sampling_params`` then ends it after
        its prompt, ``paged_jax.pooling``).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None
    beam_search_params: BeamSearchParams | None = None
    arrival_time: float = 0.0
    priority: int = 0
    lora_request: LoRARequest | None = None
    cache_salt: str | None = None
    pooling_params: PoolingParams | None = None


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """The logprobs of one sampled token: its own (``logprob``, 1-based ``rank``) and the ``top_token_ids`` /
    ``top_logprobs`` (k = the request's ``logprobs``) most likely tokens, most likely first."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


class PromptLogprobsPart(msgspec.Struct, array_like=True, gc=False):
    """Prompt logprobs of the prompt positions ``start + 1 ..`` (one per entry; the chunk of one prefill step).

    Attributes: ``logprobs`` / ``ranks``: list[float] / list[int] of each position's own token; ``top_token_ids`` /
    ``top_logprobs``: list[list] (k = the request's ``prompt_logprobs``) per position."""

    start: int
    logprobs: list[float]
    ranks: list[int]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]


class RoutedExperts(msgspec.Struct, array_like=True, gc=False):
    """Routed experts on the wire: the bytes of a C-ordered ``dtype[shape]`` array (``[positions, num_sparse_layers,
    top_k]``, ``paged_jax.engine.routed_experts``)."""

    shape: list[int]
    dtype: str
    data: bytes

    @classmethod
    def from_array(cls, array) -> "RoutedExperts":
        return cls(list(array.shape), array.dtype.str, array.tobytes())

    def to_array(self) -> np.ndarray:
        return np.frombuffer(self.data, np.dtype(self.dtype)).reshape(self.shape)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What sequence ``index`` of request ``request_id`` got in one step.

    Attributes:
      new_token_ids: list[int] sampled this step (usually one; none in a prefill step without a sample).
      finish_reason: "stop" | "length" | "abort" once the sequence ended (after its last token), else None.
      stop_reason: the stop token id that ended it (None for EOS / length).
      new_logprobs: per new token its ``TokenLogprobs`` when the request asked for ``logprobs``.
      cumulative_logprob: the sum of the sequence's sampled tokens' logprobs so far, when the request needs it
        (``SamplingParams.sampled_logprobs`` is not None).
      prompt_logprobs: the prompt logprobs this step computed (sequence 0, ``prompt_logprobs`` requests).
      num_cached_tokens: prompt tokens served from the prefix cache.
      scheduled_time: ``time.time()`` the request was first scheduled, on its first output.
      beam_logprobs: a finished beam search's beam ``index`` (best first): per token the step's candidates.
      pooled: a finished pooling request's output vector (``paged_jax.pooling.pooler.finalize``).
      routed_experts: the routing of the sequence's positions recorded since its previous output
        (``--enable-return-routed-experts``, ``paged_jax.engine.routed_experts``).
    """

    request_id: str
    index: int = 0
    new_token_ids: list[int] = []
    finish_reason: str | None = None
    stop_reason: int | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: PromptLogprobsPart | None = None
    num_cached_tokens: int = 0
    scheduled_time: float | None = None
    beam_logprobs: list[dict[int, Logprob]] | None = None
    pooled: list[float] | None = None
    routed_experts: RoutedExperts | None = None


class DecodeTokens(msgspec.Struct, array_like=True, gc=False):
    """The token-only outputs of one steady decode step, as columns: sequence ``indices[i]`` of request
    ``request_ids[i]`` got the one token ``token_ids[i]`` (each list one entry per row). Such an output carries
    nothing else: no logprobs or cumulative logprob, not the sequence's first output, no finish (the engine core's
    ``core_outputs.TokenOnlyRows`` makes them; ``expand`` gives the same outputs one object per row)."""

    request_ids: list[str]
    indices: list[int]
    token_ids: list[int]

    def expand(self) -> list[EngineCoreOutput]:
        return list(map(EngineCoreOutput, self.request_ids, self.indices, [[token] for token in self.token_ids]))


class Admission(msgspec.Struct, array_like=True, gc=False):
    """The core's answer to ``AddRequests`` ``group_id``: ``error`` None (all added) or the message of the error
    that refused the whole group: a ValueError, or with ``overloaded`` an ``EngineOverloadedError`` (the waiting
    queue is full)."""

    group_id: int
    error: str | None = None
    overloaded: bool = False


class UtilityResult(msgspec.Struct, array_like=True, gc=False):
    """The answer to ``UtilityCall`` ``call_id``: its result, or the message of its ValueError (``error``)."""

    call_id: int
    result: Any = None
    error: str | None = None


class EngineCoreOutputs(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """A process core's message to one client: the outputs of one step for that client's requests (in step order),
    the core's ``stats()`` (``num_unfinished_requests``: the client's own), how many of the client's messages the core
    has applied, and the answers to those that ask for one."""

    outputs: list[EngineCoreOutput] = []
    stats: dict[str, Any] = {}
    num_messages: int = 0
    admissions: list[Admission] = []
    utility_results: list[UtilityResult] = []


class EngineCoreInfo(msgspec.Struct, gc=False):
    """What clients of a core need of its model and limits.

    Attributes: ``max_model_len`` (tokens per sequence, prompt included), ``vocab_size`` (token ids in
    ``[0, vocab_size)``), ``eos_token_ids``, ``max_num_seqs``, ``max_num_batched_tokens``, ``max_logprobs`` (the
    widest ``logprobs`` / ``prompt_logprobs`` / ``2 * beam_width``), ``model_path`` (None for a named dummy shape),
    ``generation_config`` (the checkpoint's, as a dict), ``startup_timings`` (seconds per start-up stage),
    ``stats`` (the core's stats when it got ready), ``pooler`` (the pooling runner's ``PoolerConfig``; None: the
    generate runner)."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    max_num_seqs: int
    max_num_batched_tokens: int
    max_logprobs: int
    model_path: str | None
    generation_config: dict
    startup_timings: dict[str, float] = {}
    stats: dict[str, Any] = {}
    pooler: PoolerConfig | None = None


class CoreReady(msgspec.Struct, tag=True, array_like=True, gc=False):
    """A process core is ready to serve (its first message)."""

    info: EngineCoreInfo


class CoreFailed(msgspec.Struct, tag=True, array_like=True, gc=False):
    """A process core could not start: ``description`` of the error; ``value_error``: the engine arguments were
    refused (the client raises ValueError)."""

    description: str
    value_error: bool = False


class CoreDied(msgspec.Struct, tag=True, array_like=True, gc=False):
    """A process core's loop failed (every client's requests end with ``EngineDeadError``)."""

    description: str


# ---------------------------------------------------------------------------------------- client -> core messages
class AddRequests(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Add ``requests`` all or none; the core answers with an ``Admission`` for ``group_id``."""

    group_id: int
    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Abort whole requests (``request_ids``) and single sequences (``sequences``: ``(request_id, index)``, e.g.
    one that hit a stop string); unknown ids are ignored. An aborted sequence produces no more outputs."""

    request_ids: list[str] = []
    sequences: list[tuple[str, int]] = []


class UtilityCall(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Call ``EngineCore.<method>(*args)`` between steps (``add_lora``, ``remove_lora``, ``list_loras``,
    ``reset_prefix_cache``, ...); answered with a ``UtilityResult``."""

    call_id: int
    method: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Stop the core loop (after the current step)."""


ClientMessage = AddRequests | AbortRequests | UtilityCall | Shutdown
CoreMessage = EngineCoreOutputs | CoreReady | CoreFailed | CoreDied

_ENCODER = msgspec.msgpack.Encoder()
CLIENT_MESSAGE_DECODER = msgspec.msgpack.Decoder(ClientMessage)
CORE_MESSAGE_DECODER = msgspec.msgpack.Decoder(CoreMessage)


def encode(message: ClientMessage | CoreMessage) -> bytes:
    """MessagePack bytes of a message (decode with ``CLIENT_MESSAGE_DECODER`` / ``CORE_MESSAGE_DECODER``)."""
    return _ENCODER.encode(message)
