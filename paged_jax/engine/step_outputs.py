"""What a step reports per request: its delta since the request's previous output, either as a ``RequestOutput`` or,
for a plain running stream, as a row of ``StreamDeltas`` columns.

A server streams every running request's delta every step, so at hundreds of streams the per-stream cost of a delta
is on the engine's critical path (the engine is host bound). Most rows are plain: one sequence, still running, no
logprobs, prompt already reported; all such a row carries is (request id, new token ids, new text, cached prompt
tokens). ``LLMEngine.step(stream_deltas=)`` appends those to columns instead of building a ``RequestOutput`` per
stream; the engine process (serving/engine_process.py) sends the columns as they are (a few lists per step pickle
far faster than hundreds of tuples) and its client rebuilds the same delta ``RequestOutput`` objects
(``StreamDeltas.request_outputs``). Every other output (a request's first, its last, n > 1, logprobs, beam search)
stays a ``RequestOutput``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import msgspec

from paged_jax.outputs import CompletionOutput, RequestOutput
from paged_jax.engine.sequence_group import RequestState, SequenceState, reported_sequences

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(tuple[list[str], list[list[int]], list[str], list[int]])


def _take_delta(seq: SequenceState) -> tuple[list[int], str]:
    """``seq``'s token ids and text not reported yet (fresh list; the engine keeps appending to its own), marked as
    reported now."""
    token_ids = seq.request.output_token_ids
    start = seq.num_reported_tokens
    text = seq.detokenizer.emitted_since(seq.num_reported_chars) if seq.detokenizer is not None else ""
    seq.num_reported_chars += len(text)
    seq.num_reported_tokens = len(token_ids)
    return token_ids[start:], text


def make_delta_output(state: RequestState, finished: bool,
                      decode: Callable[[list[int]], str] | None = None) -> RequestOutput:
    """The delta of ``state`` since its previous output, per sequence with new tokens or an unreported finish.
    ``prompt_token_ids`` is shared by all outputs (never mutated); metrics only on the finished one. ``decode``
    (token ids -> text) is for beam search, whose texts are decoded when it ends."""
    if state.beam_search is not None:
        return state.beam_search.output(decode)
    completions = []
    for index, seq in reported_sequences(state):
        start = seq.num_reported_tokens
        if len(seq.request.output_token_ids) == start and (seq.finish_reason is None or seq.finish_reported):
            continue
        token_ids, text = _take_delta(seq)
        completions.append(CompletionOutput(
            index=index, text=text, token_ids=token_ids, cumulative_logprob=seq.cumulative_logprob,
            logprobs=seq.logprobs[start:] if seq.logprobs is not None else None,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        seq.finish_reported = seq.finish_reason is not None
    return RequestOutput(request_id=state.request_id, prompt=state.prompt,
                         prompt_token_ids=state.prompt_token_ids, outputs=completions, finished=finished,
                         num_cached_tokens=state.seqs[0].request.num_cached_prompt_tokens,
                         metrics=state.metrics if finished else None,
                         prompt_logprobs=state.prompt_logprobs.take() if state.prompt_logprobs else None)


@dataclasses.dataclass
class StreamDeltas:
    """Plain running streams' deltas of one or more steps, as columns (row i is one request's delta of one step;
    several steps' rows of one request follow each other in step order).

    Attributes:
      request_ids: list[str].
      token_ids: list[list[int]] the row's new output token ids (usually one).
      texts: list[str] their new text ("" without a tokenizer, or while a character is incomplete).
      num_cached_tokens: list[int] the request's prompt tokens served from the prefix cache.
    """

    request_ids: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[list[int]] = dataclasses.field(default_factory=list)
    texts: list[str] = dataclasses.field(default_factory=list)
    num_cached_tokens: list[int] = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.request_ids)

    def take(self, state: RequestState) -> bool:
        """Append ``state``'s delta as a row when it is a plain stream's (``RequestState.plain_stream``) that is
        running and whose first output was already made, and return True; else False (the caller makes a
        ``RequestOutput``)."""
        if not state.plain_stream:
            return False
        seq = state.seqs[0]
        if seq.finish_reason is not None or seq.num_reported_tokens == 0:
            return False
        token_ids, text = _take_delta(seq)
        self.request_ids.append(state.request_id)
        self.token_ids.append(token_ids)
        self.texts.append(text)
        self.num_cached_tokens.append(seq.request.num_cached_prompt_tokens)
        return True

    def extend(self, other: StreamDeltas) -> None:
        self.request_ids += other.request_ids
        self.token_ids += other.token_ids
        self.texts += other.texts
        self.num_cached_tokens += other.num_cached_tokens

    def to_wire(self) -> bytes:
        """The columns as one MessagePack array of four arrays (msgspec: several times faster than pickling the
        lists); ``from_wire`` inverts it."""
        return _ENCODER.encode((self.request_ids, self.token_ids, self.texts, self.num_cached_tokens))

    @classmethod
    def from_wire(cls, wire: bytes) -> StreamDeltas:
        return cls(*_DECODER.decode(wire))

    def request_outputs(self, prompts: Mapping[str, tuple[str | None, list[int]] | None]) -> list[RequestOutput]:
        """The rows as the delta ``RequestOutput`` objects ``make_delta_output`` makes for them; ``prompts``: request
        id -> (prompt, prompt_token_ids) of the requests still wanted (a row of any other is dropped)."""
        outputs = []
        for request_id, token_ids, text, num_cached in zip(self.request_ids, self.token_ids, self.texts,
                                                             self.num_cached_tokens):
            head = prompts.get(request_id)
            if head is None:
                continue  # aborted meanwhile
            outputs.append(RequestOutput(
                request_id=request_id, prompt=head[0], prompt_token_ids=head[1], finished=False,
                outputs=[CompletionOutput(index=0, text=text, token_ids=token_ids, cumulative_logprob=None,
                                          logprobs=None)], num_cached_tokens=num_cached))
        return outputs
