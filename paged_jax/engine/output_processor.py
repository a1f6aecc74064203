"""The output processor: engine-core outputs (token ids, logprobs) -> ``RequestOutput`` (vLLM V1's name).

Holds one ``RequestState`` per unfinished request: its sequences' tokens, detokenizers (text, stop strings), logprob
dicts, what earlier outputs already reported, and the request's group policy as the user sees it: with n > 1 every
sequence reports under its own index; with best_of > n nothing is reported until every sequence has finished, then
the n with the highest cumulative logprob, best first; a beam search reports its beams once, when it ends.

A stop string ends a sequence here; ``process_outputs`` returns those sequences so the caller aborts them in the core
(which may have computed a token or two more meanwhile: they are dropped).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

import numpy as np

from paged_jax.engine.detokenizer import IncrementalDetokenizer
from paged_jax.engine.messages import (DecodeTokens, EngineCoreOutput, EngineCoreRequest, PromptLogprobsPart,
                                      TokenLogprobs)
from paged_jax.pooling.outputs import PoolingOutput, PoolingRequestOutput
from paged_jax.outputs import (CompletionOutput, Logprob, RequestMetrics, RequestOutput, make_logprob_dict,
                                running_delta)
from paged_jax.sampling_params import BeamSearchParams, SamplingParams


@dataclasses.dataclass(slots=True)  # read for every running sequence every step: no instance dict
class SequenceState:
    """One output sequence of a request as outputs report it."""

    index: int
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_reported_tokens: int = 0  # what earlier outputs carried: an output is the delta past these
    num_reported_chars: int = 0
    finish_reported: bool = False
    # --enable-return-routed-experts: the routing parts the core's outputs carried (paged_jax.engine.routed_experts)
    routed_parts: list[np.ndarray] | None = None


@dataclasses.dataclass(slots=True)  # read for every running request every step: no instance dict
class RequestState:
    """One unfinished request: its prompt, parameters, sequences, metrics, prompt logprobs (``prompt_logprobs``:
    None unless asked, then per prompt token None (the first) or ``{token_id: Logprob}`` as they come) and, for a beam
    search, its result once finished (``beams``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    seqs: list[SequenceState]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None
    prompt_logprobs_reported: bool = False
    num_cached_tokens: int = 0
    beams: list[EngineCoreOutput] | None = None
    pooling: bool = False  # a pooling request: one PoolingRequestOutput when finished (``pooled``: its vector)
    pooled: list[float] | None = None
    # One sequence reporting token ids only (no text, logprobs, cumulative logprob or prompt logprobs; not pooling,
    # best_of or beam search): its running outputs take ``_request_outputs``' first branch (most requests of a
    # token-id workload).
    plain: bool = False
    # A plain request's output of the ``process_outputs`` call numbered ``delta_call`` (``_report_decode``).
    delta: RequestOutput | None = None
    delta_call: int = -1

    @property
    def is_beam_search(self) -> bool:
        return isinstance(self.params, BeamSearchParams)

    @property
    def finished(self) -> bool:
        if self.is_beam_search:
            return self.beams is not None
        for seq in self.seqs:  # a loop, not all(<genexpr>): read for every running request every step
            if seq.finish_reason is None:
                return False
        return True

    @property
    def reports_deltas(self) -> bool:
        """Whether outputs go out as the tokens come (else only the finished output: best_of > n, beam search)."""
        return not self.is_beam_search and self.params.num_sequences == self.params.n


class OutputProcessor:
    """Turns ``EngineCoreOutput`` s into delta ``RequestOutput`` s (see the module docstring).

    Args:
      tokenizer: the HF tokenizer (None: no text, token ids only).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._states: dict[str, RequestState] = {}
        self._num_calls = 0  # process_outputs calls (``RequestState.delta_call``)
        # The last steady decode's rows (``DecodeColumns``), valid until a state is dropped or a sequence finishes
        # (``_version``).
        self._version = 0
        self._columns: DecodeColumns | None = None

    def add_request(self, request: EngineCoreRequest, prompt: str | None) -> None:
        """Start tracking ``request`` (already accepted by the input processor); ``prompt``: its text, if given."""
        params = request.sampling_params or request.beam_search_params
        state = RequestState(request.request_id, prompt, request.prompt_token_ids, params, [],
                             RequestMetrics(arrival_time=request.arrival_time),
                             pooling=request.pooling_params is not None)
        if request.sampling_params is not None:
            if params.prompt_logprobs is not None:
                state.prompt_logprobs = [None]
            state.seqs = [self._new_sequence(index, request) for index in range(params.num_sequences)]
            seq = state.seqs[0]
            state.plain = (params.num_sequences == 1 and params.n == 1 and not state.pooling
                           and state.prompt_logprobs is None and seq.detokenizer is None and seq.logprobs is None
                           and seq.cumulative_logprob is None)
        self._states[request.request_id] = state

    def _new_sequence(self, index: int, request: EngineCoreRequest) -> SequenceState:
        params = request.sampling_params
        detokenizer = None
        if params.detokenize and self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                stop=params.stop_strings, include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens)
        return SequenceState(index=index, detokenizer=detokenizer,
                             logprobs=[] if params.logprobs is not None else None,
                             cumulative_logprob=0.0 if params.sampled_logprobs is not None else None)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Forget requests (unknown ids are ignored): they produce no more outputs."""
        self._version += 1
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def get_num_unfinished_requests(self) -> int:
        return len(self._states)

    def request_ids(self) -> list[str]:
        """Ids of the unfinished requests."""
        return list(self._states)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def process_outputs(self, outputs: Iterable[EngineCoreOutput], finished_only: bool = False,
                        decode: DecodeTokens | None = None) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """Apply one or more core steps' outputs (in step order; ``decode``: a steady decode step's token-only
        outputs as columns, after ``outputs``).

        Returns ``(request outputs, sequences to abort in the core)``: the delta ``RequestOutput`` of every request
        that got something new (finished ones included, with ``finished=True``; only those with ``finished_only``,
        each then whole), and the ``(request_id, index)`` of the sequences a stop string just ended."""
        columns = self._columns
        if columns is not None and not (finished_only and type(outputs) is list and not outputs and decode is not None
                                        and columns.request_ids is decode.request_ids
                                        and columns.version == self._version):
            columns.flush()  # anything but the same rows' next finished-only tokens reads their sequences
        now = time.time()
        touched: dict[str, RequestState] = {}
        stopped: list[tuple[str, int]] = []
        states = self._states
        for output in outputs:
            state = states.get(output.request_id)
            if state is None:
                continue  # aborted meanwhile
            if (output.scheduled_time is not None or output.num_cached_tokens or output.prompt_logprobs is not None
                    or output.pooled is not None or output.routed_experts is not None):
                self._apply_extras(state, output)
            finish = output.finish_reason is not None
            seq = state.seqs[output.index] if state.seqs else None  # (a beam search has none)
            if (seq is not None and output.new_token_ids and not finish and seq.detokenizer is None
                    and seq.logprobs is None and seq.finish_reason is None and output.cumulative_logprob is None):
                seq.token_ids += output.new_token_ids  # token ids only (``_apply_tokens``' plain case)
                metrics = state.metrics
                if metrics.first_token_time is None:
                    metrics.first_token_time = now
                metrics.last_token_time = now
                if not finished_only:
                    touched[output.request_id] = state
                continue
            if output.beam_logprobs is not None:
                state.beams = (state.beams or []) + [output]
                finish = True
            elif output.new_token_ids or finish:
                if self._apply_tokens(state, output, now):
                    stopped.append((output.request_id, output.index))
                    finish = True
            else:
                continue
            # FINAL_ONLY: only a request one of whose sequences ended can have finished.
            if finish or not finished_only:
                touched[output.request_id] = state
        reported, pending = [], False
        columns = None if decode is None or touched else self._decode_columns(decode)
        if columns is not None and (finished_only or columns.plain):  # sequences taking their tokens as they come
            reported = columns.apply(decode.token_ids, finished_only)
        elif decode is not None and finished_only:
            self._apply_decode(decode, now, touched, stopped)
        elif decode is not None:
            reported, pending = self._report_decode(decode, now, touched, stopped)
        request_outputs = self._request_outputs(touched.values(), now, finished_only)
        if reported:
            request_outputs += self._resolve(reported, now) if pending else reported
        return request_outputs, stopped

    def _decode_columns(self, decode: DecodeTokens) -> DecodeColumns | None:
        """The ``DecodeColumns`` of ``decode``'s rows (those of the last call's while its row list and every state
        are unchanged), or None when a row's sequence is not one that takes its token as is."""
        columns = self._columns
        if columns is not None and columns.request_ids is decode.request_ids and columns.version == self._version:
            return columns
        self._columns = columns = DecodeColumns.of(self._states, decode, self._version)
        return columns

    def _report_decode(self, decode: DecodeTokens, now: float, touched: dict[str, RequestState],
                       stopped: list[tuple[str, int]]) -> tuple[list, bool]:
        """``process_outputs`` of ``decode``'s rows when every request reports its delta: a plain request
        (``RequestState.plain``) takes its token and gets its ``RequestOutput`` in the same pass (such a row is never
        a sequence's first output nor its last); any other row takes the general path, its request reported with
        ``touched`` when the outputs before ``decode`` touched it, else in row order. Returns the outputs in row order
        with each other request's state in place of its output (``_resolve``), and whether there is such a state."""
        states = self._states
        reported: list = []
        report = reported.append
        late: set[str] = set()
        self._num_calls = call = self._num_calls + 1
        for request_id, index, token in zip(decode.request_ids, decode.indices, decode.token_ids):
            state = states.get(request_id)
            if state is None:
                continue  # aborted meanwhile
            if state.plain and (seq := state.seqs[0]).finish_reason is None and request_id not in touched:
                token_ids = seq.token_ids
                token_ids.append(token)  # (its metrics: set by its finishing output, the only one reporting them)
                if state.delta_call == call:  # a later step's row of the same request: into the same delta
                    state.delta.outputs[0].token_ids.append(token)
                    seq.num_reported_tokens += 1
                    continue
                start = seq.num_reported_tokens
                seq.num_reported_tokens = len(token_ids)
                state.delta_call, state.delta = call, running_delta(
                    request_id, state.prompt, state.prompt_token_ids, token_ids[start:], state.num_cached_tokens)
                report(state.delta)
                continue
            if self._apply_decode_row(state, request_id, index, token, now):
                stopped.append((request_id, index))
            if request_id not in touched and request_id not in late:
                late.add(request_id)
                report(state)
        return reported, bool(late)

    def _resolve(self, reported: list, now: float) -> list[RequestOutput]:
        """``_report_decode``'s list with each request state replaced by its output (if it has one)."""
        outputs = []
        for item in reported:
            if isinstance(item, RequestState):
                outputs += self._request_outputs((item,), now, False)
            else:
                outputs.append(item)
        return outputs

    def _apply_decode(self, decode: DecodeTokens, now: float, touched: dict[str, RequestState],
                      stopped: list[tuple[str, int]]) -> None:
        """``process_outputs`` of ``decode``'s rows with ``finished_only``: only a request a stop string ended is
        touched."""
        states = self._states
        for request_id, index, token in zip(decode.request_ids, decode.indices, decode.token_ids):
            state = states.get(request_id)
            if state is not None and self._apply_decode_row(state, request_id, index, token, now):
                stopped.append((request_id, index))
                touched[request_id] = state

    def _apply_decode_row(self, state: RequestState, request_id: str, index: int, token: int, now: float) -> bool:
        """One ``DecodeTokens`` row: a sequence with no text or logprobs to make takes its token as is (such a row
        is never a sequence's first output nor its last); any other one the general path's. True when a stop string
        ended the sequence here."""
        seq = state.seqs[index]
        if seq.detokenizer is None and seq.logprobs is None and seq.finish_reason is None:
            seq.token_ids.append(token)
            state.metrics.last_token_time = now
            return False
        return self._apply_tokens(state, EngineCoreOutput(request_id, index, [token]), now)

    def _apply_extras(self, state: RequestState, output: EngineCoreOutput) -> None:
        """What an output carries besides tokens: first-output facts, prompt logprobs, pooled vector, routing."""
        if output.scheduled_time is not None:
            state.metrics.first_scheduled_time = output.scheduled_time
            state.metrics.time_in_queue = output.scheduled_time - state.metrics.arrival_time
        if output.num_cached_tokens:
            state.num_cached_tokens = output.num_cached_tokens
        if output.prompt_logprobs is not None:
            self._record_prompt_logprobs(state, output.prompt_logprobs)
        if output.pooled is not None:
            state.pooled = output.pooled
        if output.routed_experts is not None:
            _add_routing(state.seqs[output.index], output.routed_experts.to_array())

    def _apply_tokens(self, state: RequestState, output: EngineCoreOutput, now: float) -> bool:
        """Append a sequence's new tokens (logprobs, text); True when a stop string ended it here."""
        seq = state.seqs[output.index]
        if seq.finish_reason is not None:
            return False  # tokens the core made after a stop string ended the sequence
        metrics = state.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        new_token_ids = output.new_token_ids
        core_finished = output.finish_reason is not None
        if seq.detokenizer is None and seq.logprobs is None:  # token ids only: no per-token work
            seq.token_ids += new_token_ids
        else:
            for i, token in enumerate(new_token_ids):
                seq.token_ids.append(token)
                if seq.logprobs is not None:
                    seq.logprobs.append(self._token_logprobs(output.new_logprobs[i]))
                if seq.detokenizer is None:
                    continue
                last = i == len(new_token_ids) - 1
                _, stop_str = seq.detokenizer.append((token,), finished=last and core_finished)
                if stop_str is not None:  # wins over an EOS / length finish of the same token
                    seq.finish_reason, seq.stop_reason = "stop", stop_str
                    self._version += 1
                    if output.cumulative_logprob is not None:
                        seq.cumulative_logprob = output.cumulative_logprob
                    return not (last and core_finished)
        if output.cumulative_logprob is not None:
            seq.cumulative_logprob = output.cumulative_logprob
        if core_finished:
            seq.finish_reason, seq.stop_reason = output.finish_reason, output.stop_reason
            self._version += 1
        return False

    def _decode_one(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _token_logprobs(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        return make_logprob_dict(entry.token_id, entry.logprob, entry.rank, entry.top_token_ids, entry.top_logprobs,
                                 self._decode_one)

    def _record_prompt_logprobs(self, state: RequestState, part: PromptLogprobsPart) -> None:
        """Add the entries of a prefill chunk that started at ``part.start`` (those not recorded yet)."""
        entries, prompt = state.prompt_logprobs, state.prompt_token_ids
        for i, (logprob, rank) in enumerate(zip(part.logprobs, part.ranks)):
            index = part.start + 1 + i
            if index == len(entries):
                entries.append(make_logprob_dict(prompt[index], logprob, rank, part.top_token_ids[i],
                                                 part.top_logprobs[i], self._decode_one))

    def _request_outputs(self, states: Iterable[RequestState], now: float, finished_only: bool) -> list[RequestOutput]:
        outputs = []
        add_output = outputs.append
        for state in states:
            if state.plain and (seq := state.seqs[0]).finish_reason is None:  # running: every step's common request
                if not finished_only:  # its delta: the token ids new since its last output
                    token_ids, start = seq.token_ids, seq.num_reported_tokens
                    completions = []
                    if len(token_ids) > start:
                        seq.num_reported_tokens = len(token_ids)
                        completions = [CompletionOutput(0, "", token_ids[start:], None, None)]
                    add_output(RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions,
                                             False, state.num_cached_tokens))
                continue
            finished = state.finished
            if finished:
                state.metrics.finished_time = now
                del self._states[state.request_id]
                self._version += 1
            if state.pooling:
                if finished:
                    outputs.append(PoolingRequestOutput(state.request_id, PoolingOutput(np.asarray(
                        state.pooled, np.float32)), state.prompt_token_ids, True, state.num_cached_tokens))
            elif finished or (not finished_only and state.reports_deltas):
                outputs.append(self._beam_output(state) if state.is_beam_search else self._delta_output(state,
                                                                                                        finished))
        return outputs

    def _delta_output(self, state: RequestState, finished: bool) -> RequestOutput:
        """The delta of ``state`` since its previous output, per sequence with new tokens or an unreported finish.
        ``prompt_token_ids`` is shared by all outputs (never mutated); metrics only on the finished one."""
        completions = []
        for index, seq in _reported_sequences(state):
            start = seq.num_reported_tokens
            if len(seq.token_ids) == start and (seq.finish_reason is None or seq.finish_reported):
                continue
            text = seq.detokenizer.emitted_since(seq.num_reported_chars) if seq.detokenizer is not None else ""
            seq.num_reported_chars += len(text)
            seq.num_reported_tokens = len(seq.token_ids)
            completions.append(CompletionOutput(
                index=index, text=text, token_ids=seq.token_ids[start:], cumulative_logprob=seq.cumulative_logprob,
                logprobs=seq.logprobs[start:] if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                routed_experts=_routed_experts(state, seq) if seq.finish_reason is not None else None))
            seq.finish_reported = seq.finish_reason is not None
        return RequestOutput(request_id=state.request_id, prompt=state.prompt,
                             prompt_token_ids=state.prompt_token_ids, outputs=completions, finished=finished,
                             num_cached_tokens=state.num_cached_tokens, metrics=state.metrics if finished else None,
                             prompt_logprobs=self._take_prompt_logprobs(state))

    @staticmethod
    def _take_prompt_logprobs(state: RequestState) -> list | None:
        """The prompt logprobs, once, when complete (they go with the request's first output, as vLLM)."""
        entries = state.prompt_logprobs
        if entries is None or state.prompt_logprobs_reported or len(entries) < len(state.prompt_token_ids):
            return None
        state.prompt_logprobs_reported = True
        return entries

    def _beam_output(self, state: RequestState) -> RequestOutput:
        """A finished beam search's output (as vLLM's server builds it): per returned beam, the generated tokens (a
        final EOS only with ``include_stop_str_in_output``), their text (never the EOS), the cumulative logprob and
        the candidates per token; ``finish_reason`` "stop" (EOS, ``stop_reason`` = its id) or "length"."""
        params: BeamSearchParams = state.params
        outputs = []
        for beam in state.beams:
            generated = beam.new_token_ids
            text_tokens = generated[:-1] if beam.finish_reason == "stop" else generated
            token_ids = generated if beam.finish_reason != "stop" or params.include_stop_str_in_output \
                else text_tokens
            logprobs = [{token: dataclasses.replace(logprob, decoded_token=self._decode_one(token))
                         for token, logprob in entry.items()} for entry in beam.beam_logprobs]
            outputs.append(CompletionOutput(
                index=beam.index, text=self._decode(text_tokens), token_ids=token_ids,
                cumulative_logprob=beam.cumulative_logprob, logprobs=logprobs, finish_reason=beam.finish_reason,
                stop_reason=beam.stop_reason))
        return RequestOutput(request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
                             outputs=outputs, finished=True, metrics=state.metrics)

    def _decode(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids)


class DecodeColumns:
    """The rows of a steady decode (``DecodeTokens``) whose sequences all take their token as is: running, no text,
    logprobs or cumulative logprob to make (such a row is never a sequence's first output nor its last, so its
    metrics wait for the finishing output). ``states`` / ``seqs``: each row's request state and sequence; ``plain``:
    every state is ``RequestState.plain`` (its delta is one ``RequestOutput`` made here), else False (the rows are
    reported by ``OutputProcessor._report_decode``; with ``finished_only`` they take their tokens here).
    ``pending``: the token lists (row order) of the steps taken with ``finished_only`` that are not in the sequences
    yet: appended at ``flush`` (before anything else reads them), each row's at once rather than one per step."""

    __slots__ = ("request_ids", "version", "states", "seqs", "plain", "pending")

    def __init__(self, request_ids: list[str], version: int, states: list[RequestState], seqs: list[SequenceState],
                 plain: bool):
        self.request_ids, self.version, self.states, self.seqs, self.plain = (request_ids, version, states, seqs,
                                                                              plain)
        self.pending: list[list[int]] = []

    @classmethod
    def of(cls, states: dict[str, RequestState], decode: DecodeTokens, version: int) -> "DecodeColumns | None":
        rows, seqs = [], []
        for request_id, index in zip(decode.request_ids, decode.indices):
            state = states.get(request_id)
            if state is None:
                return None
            seq = state.seqs[index]
            if seq.detokenizer is not None or seq.logprobs is not None or seq.finish_reason is not None \
                    or seq.cumulative_logprob is not None:
                return None
            rows.append(state)
            seqs.append(seq)
        plain = len(set(decode.request_ids)) == len(rows) and all(state.plain for state in rows)
        return cls(decode.request_ids, version, rows, seqs, plain)

    def apply(self, token_ids: list[int], finished_only: bool) -> list[RequestOutput]:
        """Append each row's token (``token_ids``: held, not copied); unless ``finished_only`` (then nothing is
        reported and the tokens wait in ``pending``), each request's delta ``RequestOutput`` in row order (every
        state must be plain)."""
        if finished_only:
            self.pending.append(token_ids)
            return []
        outputs = []
        report = outputs.append
        for state, seq, token in zip(self.states, self.seqs, token_ids):
            tokens, start = seq.token_ids, seq.num_reported_tokens
            tokens.append(token)
            seq.num_reported_tokens = start_next = len(tokens)
            # Held by its state until the next one: the previous output, which the caller has dropped by now, is
            # freed as this one is made, so a step's outputs do not add up to garbage collections.
            state.delta = output = running_delta(
                state.request_id, state.prompt, state.prompt_token_ids,
                [token] if start_next - start == 1 else tokens[start:], state.num_cached_tokens)
            report(output)
        return outputs

    def flush(self) -> None:
        """Append the ``pending`` tokens to the rows' sequences."""
        pending, self.pending = self.pending, []
        if len(pending) == 1:
            for seq, token in zip(self.seqs, pending[0]):
                seq.token_ids.append(token)
        elif pending:
            for seq, tokens in zip(self.seqs, zip(*pending)):
                seq.token_ids += tokens


def _reported_sequences(state: RequestState) -> list[tuple[int, SequenceState]]:
    """``(output index, sequence)`` of what a request reports: every sequence under its own index; with
    ``best_of > n`` (finished) the n with the highest cumulative logprob, best first, numbered 0..n-1."""
    if state.reports_deltas:  # (not a beam search: those report ``_beam_output``)
        return [(seq.index, seq) for seq in state.seqs]
    ranked = sorted(state.seqs, key=lambda seq: seq.cumulative_logprob, reverse=True)
    return list(enumerate(ranked[:state.params.n]))


def _add_routing(seq: SequenceState, part: np.ndarray) -> None:
    if seq.finish_reason is not None:  # positions the core forwarded after a stop string ended the sequence
        return
    if seq.routed_parts is None:
        seq.routed_parts = []
    seq.routed_parts.append(part)


def _routed_experts(state: RequestState, seq: SequenceState) -> np.ndarray | None:
    """A finished sequence's ``CompletionOutput.routed_experts``: its routing parts joined, the first
    ``prompt + generated - 1`` positions (the tokens forwarded before its last; the core may have forwarded more
    before a stop string's abort reached it)."""
    if not seq.routed_parts:
        return None
    return np.concatenate(seq.routed_parts)[:len(state.prompt_token_ids) + len(seq.token_ids) - 1]
