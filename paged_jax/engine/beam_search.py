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
from collections.abc import Callable, Collection

from paged_jax.core.request import Request, child_seed
from paged_jax.engine.messages import EngineCoreOutput
from paged_jax.outputs import Logprob, RequestOutput
from paged_jax.sampling_params import BeamSearchParams, SamplingParams


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
    request: Request  # its scheduler request
    entry: dict[int, Logprob] | None = None  # its last sampled token's candidates, until the next advance


class BeamSearchState:
    """The engine core's beam search of one request (see the module docstring).

    Args:
      request_id: the user request's id (the beams' scheduler ids derive from it).
      prompt_token_ids: list[int] the prompt.
      params: the request's ``BeamSearchParams``.
      num_steps: steps to run (``max_tokens`` capped by the room left in ``max_model_len``).
      eos_token_ids: what completes a beam.
      scheduler: the core's scheduler (beams are its requests).
      on_new_beam / on_dropped_beam: called with a beam's ``Request`` when it is made / dropped (the core keeps its
        request registry with them).
      base_seed: the beams' seeds derive from it (temperature > 0).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: BeamSearchParams, num_steps: int,
                 eos_token_ids: Collection[int], scheduler, on_new_beam: Callable[[Request], None],
                 on_dropped_beam: Callable[[Request], None], base_seed: int, priority: int, arrival_time: float):
        self.request_id = request_id
        self.params = params
        self.num_steps = num_steps
        self.eos_token_ids = frozenset(eos_token_ids)
        self.scheduler = scheduler
        self._on_new_beam, self._on_dropped_beam = on_new_beam, on_dropped_beam
        self.base_seed = base_seed
        self.priority = priority
        self.arrival_time = arrival_time
        # What each beam's request samples with: its logprobs entry holds the candidates.
        self.sampling = SamplingParams(temperature=params.temperature, logprobs=2 * params.beam_width,
                                       max_tokens=num_steps, ignore_eos=True, detokenize=False)
        self.num_done_steps = 0
        self.completed: list[BeamSearchSequence] = []
        self.final: list[BeamSearchSequence] | None = None
        self._num_beams_made = 0
        root = self._new_request(list(prompt_token_ids), [])
        root.reserved_seats = params.beam_width - 1  # its first step forks that many beams
        self.beams = [_Beam(BeamSearchSequence(list(prompt_token_ids), []), root)]

    @property
    def root(self) -> Request:
        """The first beam's request (the one the core hands to the scheduler)."""
        return self.beams[0].request

    @property
    def done(self) -> bool:
        return self.final is not None

    def live_requests(self) -> list[Request]:
        return [beam.request for beam in self.beams]

    def _score(self, sequence: BeamSearchSequence) -> float:
        return get_beam_search_score(sequence.tokens, sequence.cum_logprob, self.eos_token_ids,
                                     self.params.length_penalty)

    def _new_request(self, prompt_token_ids: list[int], output_token_ids: list[int]) -> Request:
        index = self._num_beams_made
        self._num_beams_made += 1
        request = Request(request_id=f"{self.request_id}::beam{index}", prompt_token_ids=prompt_token_ids,
                          params=self.sampling, eos_token_ids=self.eos_token_ids, priority=self.priority,
                          arrival_time=self.arrival_time, output_token_ids=output_token_ids,
                          hold_after_sample=True, seed=child_seed(self.base_seed, index))
        self._on_new_beam(request)
        return request

    def record(self, request: Request, entry: dict[int, Logprob]) -> None:
        """The candidates (``{token_id: Logprob}``) of the token ``request`` (a live beam) just sampled."""
        for beam in self.beams:
            if beam.request is request:
                beam.entry = entry
                return

    def advance(self) -> None:
        """Run the beam-search step once every live beam has its next token's candidates (else do nothing)."""
        if self.done or any(beam.entry is None for beam in self.beams):
            return
        candidates: list[tuple[BeamSearchSequence, _Beam]] = []
        for beam in self.beams:
            entry, beam.entry = beam.entry, None
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
        self._next_beams(kept)

    def _next_beams(self, kept: list[tuple[BeamSearchSequence, _Beam]]) -> None:
        """Make the kept candidates the live beams: a parent's first successor reuses its request, the others fork
        it; parents without a successor are dropped first (their blocks are nobody's)."""
        successors: dict[int, list[BeamSearchSequence]] = {id(beam): [] for beam in self.beams}
        for new, parent in kept:
            successors[id(parent)].append(new)
        for beam in self.beams:
            if not successors[id(beam)]:
                self._drop(beam.request)
        next_beams = []
        for beam in self.beams:
            news = successors[id(beam)]
            if not news:
                continue
            parent = beam.request
            for new in news[1:]:
                child = self._new_request(parent.prompt_token_ids, parent.output_token_ids[:-1] + [new.tokens[-1]])
                self.scheduler.fork_request(parent, child)
                next_beams.append(_Beam(new, child))
            self.scheduler.replace_last_token(parent, news[0].tokens[-1])
            self.scheduler.release_reserved_seats(parent)
            next_beams.append(_Beam(news[0], parent))
        self.beams = next_beams
        for beam in next_beams:
            self.scheduler.resume(beam.request)

    def _drop(self, request: Request) -> None:
        self.scheduler.abort_request(request.request_id)  # no-op once the scheduler finished it
        self._on_dropped_beam(request)

    def abort(self) -> None:
        """Drop every live beam (the request was aborted)."""
        for beam in self.beams:
            self._drop(beam.request)
        self.beams = []

    def _finish(self, live: list[BeamSearchSequence]) -> None:
        self.abort()
        self.final = sorted(self.completed + live, key=self._score, reverse=True)[:self.params.beam_width]

    def outputs(self) -> list[EngineCoreOutput]:
        """The finished search's result: per returned beam (best first) its generated tokens (a final EOS
        included), candidates per token, cumulative logprob and finish ("stop" with the EOS id, or "length")."""
        outputs = []
        for index, beam in enumerate(self.final):
            generated = beam.tokens[len(beam.tokens) - len(beam.logprobs):]  # one candidates entry per token
            outputs.append(EngineCoreOutput(
                request_id=self.request_id, index=index, new_token_ids=generated, cumulative_logprob=beam.cum_logprob,
                beam_logprobs=beam.logprobs, finish_reason=beam.finish_reason or "length",
                stop_reason=beam.stop_reason))
        return outputs


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
