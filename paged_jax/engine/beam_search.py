"""Beam search (vLLM's ``BeamSearchParams`` / ``BeamSearchSequence`` / ``BeamSearchOutput`` and its algorithm), run
inside the engine on copy-on-write blocks.

vLLM's algorithm (``LLM.beam_search``; the server's ``use_beam_search`` runs the same): start from the prompt as the
only beam; each step, every live beam yields as candidates the tokens of its next-token logprobs entry (the
``2 * beam_width`` most likely plus the sampled one, logprobs of the raw logits); a candidate ending in EOS (unless
``ignore_eos``) is completed, the others are ranked by ``get_beam_search_score`` and the best ``beam_width`` become
the next beams. After ``max_tokens`` steps (or when no beam is left) the completed and the live beams together are
ranked and the best ``beam_width`` returned.

How it differs from transformers' ``generate(num_beams=k, do_sample=False, early_stopping=True)``:
- every EOS candidate of every beam is kept as completed, whatever its rank (transformers keeps one only when it ranks
  among the step's top ``num_beams`` candidates), and the search never stops early: it runs ``max_tokens`` steps
  while beams are left (transformers stops once ``num_beams`` hypotheses are done);
- the length penalty divides by the length of prompt + output (EOS excluded) instead of the output's;
- candidates are each beam's own top ``2 * beam_width`` (the same set as transformers' global top
  ``2 * num_beams`` as far as the kept beams go).
Without EOS (``ignore_eos``) the two agree; tests/test_parallel_sampling.py checks that against transformers and the
EOS case against a brute-force reference of the algorithm above.

On the engine (``LLMEngine.add_request(request_id, prompt, BeamSearchParams)``): each live beam is a scheduler
request held after each sampled token (``Request.hold_after_sample``). When every beam of a step has its token,
``BeamSearchState.advance`` prunes the beams without successor (their blocks freed), gives each kept beam's request
its first successor (``Scheduler.replace_last_token``: the token's K/V is not computed yet) and forks the others
(``Scheduler.fork_request``: the new beam shares the parent's blocks; the partial last block is copied on its first
write), then resumes them. The request reports one output, when it is finished: the best ``beam_width`` beams.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection

from paged_jax.outputs import CompletionOutput, Logprob, RequestOutput
from paged_jax.core.request import Request
from paged_jax.sampling_params import MAX_LOGPROBS, SamplingParams
from paged_jax.engine.sequence_group import RequestState, SequenceState, child_seed


@dataclasses.dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``.

    beam_width: beams kept per step (>= 1; 2 * beam_width logprobs per step, so at most ``MAX_LOGPROBS / 2``).
    max_tokens: most generated tokens (>= 1).
    ignore_eos: EOS is a token like any other (beams never complete early).
    temperature: the sampled token joins the candidates (0: the most likely, already among them).
    length_penalty: scores are ``cumulative logprob / length ** length_penalty``.
    include_stop_str_in_output: the server's output keeps a completed beam's EOS token in ``token_ids``.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    @property
    def n(self) -> int:
        """Sequences the request returns (the beam width), under ``SamplingParams``' name for it."""
        return self.beam_width

    @property
    def num_sequences(self) -> int:
        """Sequences the request runs at once (the beam width)."""
        return self.beam_width

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if 2 * self.beam_width > MAX_LOGPROBS:
            raise ValueError(f"beam_width must be at most {MAX_LOGPROBS // 2} (each step reads the 2 * beam_width "
                             f"most likely tokens, at most max_logprobs={MAX_LOGPROBS}), got {self.beam_width}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 1e30:
            raise ValueError(f"temperature must be non-negative, got {self.temperature!r}")
        if not isinstance(self.length_penalty, (int, float)) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")


@dataclasses.dataclass
class BeamSearchSequence:
    """vLLM's ``BeamSearchSequence``: ``tokens`` includes the prompt; ``logprobs`` one entry per generated token (the
    step's candidates); ``text`` is set on the returned sequences (``LLM.beam_search``: the decoded ``tokens``)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    """vLLM's ``BeamSearchOutput``: the best ``beam_width`` sequences, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int | Collection[int],
                          length_penalty: float = 1.0) -> float:
    """vLLM's score: ``cumulative_logprob / len ** length_penalty``, len = prompt + output tokens, a final EOS not
    counted. ``eos_token_id``: one id or a collection of them."""
    eos = (eos_token_id,) if isinstance(eos_token_id, int) else eos_token_id
    seq_len = len(tokens) - (1 if tokens[-1] in eos else 0)
    return cumulative_logprob / (seq_len ** length_penalty)


@dataclasses.dataclass
class _Beam:
    sequence: BeamSearchSequence
    state: SequenceState  # its scheduler request and the engine's record of its last token's logprobs


class BeamSearchState:
    """The engine-side beam search of one request (see the module docstring).

    Args:
      state: the request's engine state; its ``seqs`` are kept equal to the live beams' sequences.
      params: the request's ``BeamSearchParams``.
      num_steps: steps to run (``max_tokens`` capped by the room left in ``max_model_len``).
      eos_token_ids: what completes a beam.
      scheduler: the engine's scheduler (beams are its requests).
      registry: the engine's scheduler request id -> (request state, sequence) map, kept current.
      base_seed: the beams' seeds derive from it (temperature > 0).
    """

    def __init__(self, state: RequestState, params: BeamSearchParams, num_steps: int, eos_token_ids: Collection[int],
                 scheduler, registry: dict, base_seed: int, priority: int, arrival_time: float):
        self.params = params
        self.num_steps = num_steps
        self.eos_token_ids = frozenset(eos_token_ids)
        self.scheduler = scheduler
        self.registry = registry
        self.base_seed = base_seed
        self.priority = priority
        self.arrival_time = arrival_time
        self.request_state = state
        # What each beam's request samples with: its logprobs entry holds the candidates.
        self.sampling = SamplingParams(temperature=params.temperature, logprobs=2 * params.beam_width,
                                       max_tokens=num_steps, ignore_eos=True, detokenize=False)
        self.num_done_steps = 0
        self.completed: list[BeamSearchSequence] = []
        self.final: list[BeamSearchSequence] | None = None
        self._num_beams_made = 0
        root = self._new_sequence(list(state.prompt_token_ids), [])
        root.request.reserved_seats = params.beam_width - 1  # its first step forks that many beams
        self.beams = [_Beam(BeamSearchSequence(list(state.prompt_token_ids), []), root)]
        state.seqs = [root]

    @property
    def done(self) -> bool:
        return self.final is not None

    def _score(self, sequence: BeamSearchSequence) -> float:
        return get_beam_search_score(sequence.tokens, sequence.cum_logprob, self.eos_token_ids,
                                     self.params.length_penalty)

    def _new_sequence(self, prompt_token_ids: list[int], output_token_ids: list[int]) -> SequenceState:
        index = self._num_beams_made
        self._num_beams_made += 1
        request = Request(request_id=f"{self.request_state.request_id}::beam{index}",
                          prompt_token_ids=prompt_token_ids, params=self.sampling,
                          eos_token_ids=self.eos_token_ids, priority=self.priority, arrival_time=self.arrival_time,
                          output_token_ids=output_token_ids, hold_after_sample=True,
                          seed=child_seed(self.base_seed, index))
        return SequenceState(index=index, request=request, detokenizer=None,
                             logprobs=[], cumulative_logprob=0.0, admitted=True)

    def advance(self) -> None:
        """Run the beam-search step once every live beam has its next token's logprobs (else do nothing)."""
        if self.done or any(not beam.state.logprobs for beam in self.beams):
            return
        candidates: list[tuple[BeamSearchSequence, _Beam]] = []
        for beam in self.beams:
            entry = beam.state.logprobs.pop()
            for token, logprob in entry.items():
                current = beam.sequence
                new = BeamSearchSequence(current.tokens + [token], current.logprobs + [entry],
                                         current.cum_logprob + logprob.logprob)
                if token in self.eos_token_ids and not self.params.ignore_eos:
                    new.finish_reason, new.stop_reason = "stop", token
                    self.completed.append(new)
                else:
                    candidates.append((new, beam))
        candidates.sort(key=lambda item: self._score(item[0]), reverse=True)  # stable: ties keep beam order
        kept = candidates[:self.params.beam_width]
        self.num_done_steps += 1
        if self.num_done_steps >= self.num_steps or not kept:
            self._finish([new for new, _ in kept])
            return
        successors: dict[int, list[BeamSearchSequence]] = {id(beam): [] for beam in self.beams}
        for new, parent in kept:
            successors[id(parent)].append(new)
        for beam in self.beams:  # beams without a successor go first: their blocks are nobody's
            if not successors[id(beam)]:
                self._drop(beam.state)
        next_beams = []
        for beam in self.beams:
            news = successors[id(beam)]
            if not news:
                continue
            parent = beam.state.request
            for new in news[1:]:
                state = self._new_sequence(parent.prompt_token_ids,
                                           parent.output_token_ids[:-1] + [new.tokens[-1]])
                self.scheduler.fork_request(parent, state.request)
                self.registry[state.request.request_id] = (self.request_state, state)
                next_beams.append(_Beam(new, state))
            self.scheduler.replace_last_token(parent, news[0].tokens[-1])
            self.scheduler.release_reserved_seats(parent)
            next_beams.append(_Beam(news[0], beam.state))
        self.beams = next_beams
        self.request_state.seqs = [beam.state for beam in next_beams]
        for beam in next_beams:
            self.scheduler.resume(beam.state.request)

    def _drop(self, state: SequenceState) -> None:
        self.scheduler.abort_request(state.request.request_id)  # no-op once the scheduler finished it
        self.registry.pop(state.request.request_id, None)

    def _finish(self, live: list[BeamSearchSequence]) -> None:
        for beam in self.beams:
            self._drop(beam.state)
        self.beams = []
        self.final = sorted(self.completed + live, key=self._score, reverse=True)[:self.params.beam_width]
        self.request_state.seqs = []

    def output(self, decode: Callable[[list[int]], str] | None) -> RequestOutput:
        """The finished request's output (as vLLM's server builds it): per returned beam, the generated tokens (a
        final EOS only with ``include_stop_str_in_output``), their text (never the EOS), the cumulative logprob and
        the logprobs entries; ``finish_reason`` "stop" (EOS, ``stop_reason`` = its id) or "length"."""
        state = self.request_state
        num_prompt = len(state.prompt_token_ids)
        outputs = []
        for index, beam in enumerate(self.final):
            generated = beam.tokens[num_prompt:]
            text_tokens = generated[:-1] if beam.finish_reason == "stop" else generated
            token_ids = generated if beam.finish_reason != "stop" or self.params.include_stop_str_in_output \
                else text_tokens
            outputs.append(CompletionOutput(
                index=index, text=decode(text_tokens) if decode is not None else "", token_ids=token_ids,
                cumulative_logprob=beam.cum_logprob, logprobs=beam.logprobs,
                finish_reason=beam.finish_reason or "length", stop_reason=beam.stop_reason))
        return RequestOutput(request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
                             outputs=outputs, finished=True, metrics=state.metrics)


def to_beam_search_output(output: RequestOutput, params: BeamSearchParams,
                          decode: Callable[[list[int]], str] | None) -> BeamSearchOutput:
    """``LLM.beam_search``'s form of a finished beam-search ``RequestOutput``: tokens are prompt + output (a final
    EOS included), ``text`` their decoding (as vLLM's ``LLM.beam_search``)."""
    sequences = []
    for completion in output.outputs:
        tokens = list(output.prompt_token_ids) + list(completion.token_ids)
        if completion.finish_reason == "stop" and not params.include_stop_str_in_output:
            tokens.append(completion.stop_reason)
        sequences.append(BeamSearchSequence(tokens=tokens, logprobs=completion.logprobs,
                                            cum_logprob=completion.cumulative_logprob,
                                            text=decode(tokens) if decode is not None else None,
                                            finish_reason=completion.finish_reason,
                                            stop_reason=completion.stop_reason))
    return BeamSearchOutput(sequences)
