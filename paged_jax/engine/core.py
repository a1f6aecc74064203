"""``EngineCore``: the scheduler, the KV-cache manager and the model runner of one model, stepped as one loop.

Takes ``EngineCoreRequest`` s (validated and tokenized by the input processor) and returns, per step, a list of
``EngineCoreOutput`` (token ids, logprobs, finishes; no text). The same object runs in the caller's process (the
offline ``LLM``, an ``LLMEngine`` on a server thread) and in an engine process (``paged_jax.engine.core_proc``).

One step: ``Scheduler.schedule()`` -> ``ModelRunner.execute`` (the step as a diff of the runner's persistent batch)
-> ``Scheduler.update_from_output`` -> one output per sequence that got a token. The request state inside the core is
the scheduler's ``Request``, one per sequence; a request's sequences form a group:

* n > 1 / best_of: sequence 0 computes the prompt; the others are forked from it (copy-on-write blocks) in the step
  that samples its first token, each sampling with its own seed (``child_seed``). Which of them the user sees (best_of)
  is the output processor's.
* beam search: ``paged_jax.engine.beam_search.BeamSearchState`` forks and prunes beams between steps; the group
  reports once, when the search ends.

Async scheduling (``EngineArgs.async_scheduling``) is a batch queue of depth 2: step k+1 is scheduled with a
placeholder for each token still on the device and dispatched before step k's tokens reach the host; each call returns
the outputs of the step that completed. A step with grammar rows dispatches its forward first and its sampling once
the grammars have seen step k's tokens (``ModelRunner.execute(defer_sampling=True)`` / ``dispatch_sampling``). Step
k+1 is scheduled only once step k completed (``_needs_tokens_first``) when step k has a row whose sampler reads the
previous tokens (penalties, bad words), or with speculative decoding when step k verifies drafts (each row's kept
count is its result's; the scheduler advances then, with no placeholder) or some sampling row of step k will be
proposed drafts from its token (``SpecDecoder.drafts_follow``: drafting on, not a held beam); the call that dispatches
step k+1 still returns before it completes. So with drafts every step waits for the previous one; steps overlap
while drafting is off (``disable_by_batch_size``) or step k's rows sample nothing to draft from (prompt chunks).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterable, Sequence

import numpy as np

from paged_jax.config import EngineArgs
from paged_jax.core.request import Request, RequestStatus, child_seed
from paged_jax.core.sched_output import PLACEHOLDER_TOKEN, SchedulerOutput
from paged_jax.engine.beam_search import BeamSearchState
from paged_jax.engine.core_setup import build_core_parts
from paged_jax.engine.core_outputs import TokenOnlyRows, no_text, prompt_logprob_outputs, rows_of, token_output
from paged_jax.engine.messages import DecodeTokens, EngineCoreOutput, EngineCoreRequest
from paged_jax.engine.rollout_control import RolloutControl
from paged_jax.engine.routed_experts import ExpertLoad, RoutedExpertsRecorder
from paged_jax.outputs import make_logprob_dict
from paged_jax.pooling.pooler import PoolingAccumulator
from paged_jax.spec_decode.decoder import SpecDecoder
from paged_jax.structured_output import StructuredOutputManager
from paged_jax.worker.step_io import PendingStep, StepOutput


@dataclasses.dataclass(eq=False)
class _Group:
    """The sequences of one request inside the core.

    ``seqs``: index -> its live ``Request`` (finished and aborted ones leave); ``cumulative_logprobs``: per index
    (when the request needs them); ``reported_start``: its first output (scheduling time, cached tokens) went;
    ``token_only``: its outputs carry only token ids (no logprobs, cumulative logprob or beam search)."""

    request_id: str
    seqs: dict[int, Request]
    num_prompt_tokens: int
    cumulative_logprobs: list[float] | None = None
    beam_search: BeamSearchState | None = None
    scheduled_time: float | None = None
    reported_start: bool = False
    token_only: bool = False


@dataclasses.dataclass
class _InFlightStep:
    """A dispatched step of the batch queue: ``rows`` = (row, request, output index) of its placeholders;
    ``scheduler_output`` kept when some row computes prompt logprobs or the step reports its routing, or when it
    ``verifies`` drafts (no placeholders then: the scheduler is advanced when it completes)."""

    handle: PendingStep
    rows: list[tuple[int, Request, int]]
    scheduler_output: SchedulerOutput | None = None
    verifies: bool = False


class EngineCore:
    """The engine core of one model (see the module docstring).

    Args:
      engine_args: ``EngineArgs`` (vLLM names).
      use_tqdm: progress bars while loading and compiling.
      devices: this core's devices (a data-parallel replica's; default the first local ones).

    Attributes: ``info`` (``EngineCoreInfo``: limits and model facts for clients), ``tokenizer``, ``model_config``,
    ``scheduler``, ``kv_cache_manager``, ``runner``, ``lora_manager`` (None without ``enable_lora``),
    ``startup_timings``.
    """

    def __init__(self, engine_args: EngineArgs, *, use_tqdm: bool = True, devices: Sequence | None = None):
        if engine_args.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size={engine_args.data_parallel_size}: one EngineCore is one replica; "
                             "build replicas with paged_jax.parallel.data_parallel.DataParallelCore")
        self.engine_args = engine_args
        parts = build_core_parts(engine_args, use_tqdm=use_tqdm, devices=devices)
        self.info = parts.info
        self.startup_timings = parts.info.startup_timings
        self.tokenizer = parts.loaded.tokenizer
        self.model_config = parts.loaded.config
        self.runner, self.scheduler = parts.runner, parts.scheduler
        self.kv_cache_manager, self.lora_manager = parts.kv_cache_manager, parts.lora_manager
        self.max_num_seqs = parts.info.max_num_seqs
        # The pooling runner's requests: their pooled state until their prompt is computed (paged_jax.pooling).
        self.pooling = PoolingAccumulator(parts.info.pooler) if parts.info.pooler is not None else None
        self.structured_outputs = StructuredOutputManager(self.tokenizer, self.info.vocab_size,
                                                          self.info.eos_token_ids)
        self._eos_token_ids = frozenset(self.info.eos_token_ids)
        self._seed_rng = np.random.default_rng(engine_args.seed)
        self._groups: dict[str, _Group] = {}  # unfinished requests
        self._seq_of: dict[str, tuple[_Group, int]] = {}  # scheduler request id -> (group, sequence index)
        self.async_scheduling = bool(engine_args.async_scheduling)
        # Speculative decoding (EngineArgs refuses it with async scheduling): drafts proposed after each step.
        spec_config = engine_args.speculative_config
        self.spec_decoder = SpecDecoder(spec_config) if spec_config is not None else None
        self._batch_queue: collections.deque[_InFlightStep] = collections.deque()
        self._token_rows = TokenOnlyRows()  # a steady decode's rows, whose outputs carry their token only
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_steps = 0
        # Mixture-of-experts routing outputs (paged_jax.engine.routed_experts), when asked.
        self.routed_experts = RoutedExpertsRecorder() if engine_args.enable_return_routed_experts else None
        self.expert_load = (ExpertLoad(self.model_config) if engine_args.enable_expert_load_metrics
                            else None)
        # Weight updates, sleep mode, pause / resume (an RL trainer's controls).
        self.rollout = RolloutControl(self, parts.loaded.quantization, engine_args.enable_sleep_mode,
                                      engine_args.weight_transfer_config)

    # ------------------------------------------------------------------ requests
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request (its fields were validated by the input processor). ValueError naming the field for what
        only the core can check: an id in use, the adapter (``lora_request``), the grammar (``structured_outputs``)."""
        request_id = request.request_id
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        self.rollout.check_can_generate()
        lora = self._resolve_lora(request)
        # The scheduler orders FCFS by arrival; it expects time.monotonic()-based values.
        monotonic_arrival = time.monotonic() - (time.time() - request.arrival_time)
        if request.beam_search_params is not None:
            if self.routed_experts is not None:  # its beams' outputs are assembled apart (engine.beam_search)
                raise ValueError("beam_search: not supported with enable_return_routed_experts")
            self._add_beam_search(request, monotonic_arrival)
            return
        params = request.sampling_params
        if (request.pooling_params is not None) != (self.pooling is not None):
            raise ValueError("pooling_params: a pooling request needs the pooling runner and the pooling runner "
                             "takes only pooling requests")
        # Parsed here (a bad spec is a ValueError naming its field), compiled on the manager's threads meanwhile.
        grammar = self.structured_outputs.grammar_for(params.structured_outputs) if params.structured_outputs else None
        base_seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 1 << 63))
        num_seqs = params.num_sequences
        group = _Group(request_id, {}, len(request.prompt_token_ids),
                       cumulative_logprobs=[0.0] * num_seqs if params.sampled_logprobs is not None else None,
                       token_only=params.sampled_logprobs is None and params.logprobs is None)
        for index in range(num_seqs):
            seq_id = request_id if num_seqs == 1 else f"{request_id}::{index}"
            if seq_id in self._seq_of:
                raise ValueError(f"request_id {request_id!r} collides with the sequence ids of another request")
            group.seqs[index] = Request(
                request_id=seq_id, prompt_token_ids=list(request.prompt_token_ids), params=params,
                eos_token_ids=self._eos_token_ids, priority=request.priority, arrival_time=monotonic_arrival,
                skip_prefix_cache=index == 0 and params.prompt_logprobs is not None, cache_salt=request.cache_salt,
                lora=lora, seed=child_seed(base_seed, index),
                grammar=self.structured_outputs.new_sequence(grammar) if grammar else None)
        # Sequences 1.. fork from sequence 0 when it samples its first token (as many as max_num_seqs lets run
        # together; any more start on their own, sharing the prompt only through the prefix cache).
        first = group.seqs[0]
        first.pending_forks = [group.seqs[i] for i in range(1, min(num_seqs, self.max_num_seqs))]
        first.reserved_seats = len(first.pending_forks)
        self._groups[request_id] = group
        for index, seq in group.seqs.items():
            self._seq_of[seq.request_id] = (group, index)
        if request.pooling_params is not None:
            self.pooling.add(request_id, request.pooling_params)
        for index in [0, *range(self.max_num_seqs, num_seqs)]:
            self.rollout.admit(group.seqs[index])

    def add_requests(self, requests: Iterable[EngineCoreRequest]) -> None:
        """Add a group of requests all or none: the first ValueError aborts the ones added before it."""
        add_all_or_none(self, requests)

    def _resolve_lora(self, request: EngineCoreRequest):
        if request.lora_request is None:
            return None
        if self.lora_manager is None:
            raise ValueError("lora_request: LoRA is not enabled; start the engine with enable_lora=True "
                             "(--enable-lora)")
        return self.lora_manager.get(request.lora_request)

    def _add_beam_search(self, request: EngineCoreRequest, monotonic_arrival: float) -> None:
        params = request.beam_search_params
        group = _Group(request.request_id, {}, len(request.prompt_token_ids))
        num_steps = min(params.max_tokens, self.info.max_model_len - len(request.prompt_token_ids))

        def on_new_beam(beam: Request) -> None:
            if beam.request_id in self._seq_of:
                raise ValueError(f"request_id {request.request_id!r} collides with the sequence ids of another "
                                 "request")
            self._seq_of[beam.request_id] = (group, 0)

        group.beam_search = BeamSearchState(
            request.request_id, list(request.prompt_token_ids), params, num_steps, self._eos_token_ids,
            self.scheduler, on_new_beam, lambda beam: self._seq_of.pop(beam.request_id, None),
            int(self._seed_rng.integers(0, 1 << 63)), request.priority, monotonic_arrival)
        self._groups[request.request_id] = group
        self.rollout.admit(group.beam_search.root)

    def abort_requests(self, request_ids: Iterable[str] = (), sequences: Iterable[tuple[str, int]] = ()) -> None:
        """Abort whole requests and single sequences (``(request_id, index)``, e.g. one that hit a stop string);
        unknown or finished ones are ignored. Their blocks are freed at once; they produce no more outputs."""
        for request_id in request_ids:
            group = self._groups.pop(request_id, None)
            if group is None:
                continue
            if group.beam_search is not None:
                group.beam_search.abort()
            if self.pooling is not None:
                self.pooling.discard(request_id)
            for seq in group.seqs.values():
                self.scheduler.abort_request(seq.request_id)  # a pending fork is dropped with its parent
                self._seq_of.pop(seq.request_id, None)
                if self.routed_experts is not None:
                    self.routed_experts.drop(seq.request_id)
                if self.spec_decoder is not None:
                    self.spec_decoder.forget(seq.request_id)
        for request_id, index in sequences:
            group = self._groups.get(request_id)
            seq = group.seqs.get(index) if group is not None else None
            if seq is not None:
                self.scheduler.finish_request(seq.request_id, "stop")
                self._sequence_done(group, seq, index)
                if self.spec_decoder is not None:
                    self.spec_decoder.forget(seq.request_id)

    def _sequence_done(self, group: _Group, seq: Request, index: int) -> None:
        if self.routed_experts is not None:
            self.routed_experts.drop(seq.request_id)
        del group.seqs[index]
        self._seq_of.pop(seq.request_id, None)
        if not group.seqs and group.beam_search is None:
            del self._groups[group.request_id]

    def has_unfinished_requests(self) -> bool:
        """Whether stepping has work: unfinished requests (while paused, only those still scheduled, a step in flight,
        or outputs to report)."""
        if self.rollout.pause_mode is not None:
            return (self.rollout.has_outputs() or bool(self._batch_queue) or
                    (not self.rollout.frozen and self.scheduler.has_unfinished_requests()))
        return bool(self._groups)

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is unfinished here."""
        return request_id in self._groups

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[EngineCoreOutput]:
        """Run one step; returns the outputs of the sequences that progressed (with async scheduling, of the step
        that completed during this call; a call that schedules nothing just completes the step in flight)."""
        outputs, decode = self.step_columns()
        return outputs + decode.expand() if decode is not None else outputs

    def step_columns(self) -> tuple[list[EngineCoreOutput], DecodeTokens | None]:
        """``step``'s outputs, those of a steady decode's rows as one ``DecodeTokens`` (after the others) rather
        than an object per row."""
        if self.rollout.pause_mode is not None:
            paused_outputs = self.rollout.take_outputs()  # the aborts of pause_generation("abort")
            if self.rollout.frozen or paused_outputs:
                return self._with_oldest(paused_outputs) if self._batch_queue else (paused_outputs, None)
        if self.async_scheduling:
            return self._step_async()
        # A step left in flight by async scheduling just turned off completes first.
        outputs, decode = self._with_oldest([]) if self._batch_queue else ([], None)
        if decode is not None:
            outputs, decode = outputs + decode.expand(), None
        scheduler_output = self.scheduler.schedule()
        handle = self._launch(scheduler_output)
        if handle is None:
            return outputs, None
        if self.spec_decoder is not None:  # host work that needs no token of this step, while the device runs it
            self.spec_decoder.prepare(scheduler_output.requests, self.scheduler.num_running)
        return self._finish_step(scheduler_output, handle.result(), outputs)

    def _finish_step(self, scheduler_output: SchedulerOutput, result: StepOutput, outputs: list[EngineCoreOutput]
                     ) -> tuple[list[EngineCoreOutput], DecodeTokens | None]:
        """A step whose scheduler update waited for its result (every step without async scheduling; a step that
        verifies drafts with it): verify its drafts, advance the scheduler, append the outputs to ``outputs``,
        propose the next drafts. Returns ``outputs`` and a steady decode's ``DecodeTokens`` (or None)."""
        self._record_routing(scheduler_output, result)
        outputs += prompt_logprob_outputs(self._seq_of, scheduler_output, result)
        if result.pooled is not None:
            self.pooling.record(scheduler_output.requests, scheduler_output.row_num_computed_tokens(),
                                scheduler_output.num_scheduled_tokens, result.pooled)
        tokens = result.sampled_token_ids.tolist()
        accepted, first_output = None, {}
        if scheduler_output.spec_token_ids:  # the rows' new outputs start at their current count
            accepted = self.spec_decoder.verify(scheduler_output, result, tokens)
            first_output = {r.request_id: r.num_output_tokens for r in scheduler_output.requests
                            if r.request_id in accepted}
        progressed = self.scheduler.update_from_output(scheduler_output, tokens, accepted)
        # A step without drafts (every step of a batch whose sequences find none) is a plain decode's step.
        decode = None if scheduler_output.spec_token_ids else self._token_rows.outputs(progressed, tokens,
                                                                                       self.scheduler.running)
        if decode is not None:  # a steady decode's step: every row's output is its token
            self.generation_tokens_total += len(tokens)
        elif progressed:
            output_indices = ([first_output.get(r.request_id, len(r.output_token_ids) - 1) for r in progressed]
                              if first_output else [len(r.output_token_ids) - 1 for r in progressed])
            rows = zip(rows_of(scheduler_output.requests, progressed), progressed, output_indices)
            if self._token_outputs(rows, result, outputs) == len(tokens):
                self._token_rows.remember(progressed, outputs[-len(tokens):])
            else:
                self._token_rows.forget()
        if self.spec_decoder is not None:
            self._propose(progressed, rows_of(scheduler_output.requests, progressed)
                          if result.proposed_draft_ids is not None else (), result)
        return outputs, decode

    def _propose(self, requests: list[Request], rows: Sequence[int], result: StepOutput,
                 overlapped: bool = False) -> None:
        """The next drafts of ``requests`` (step rows ``rows`` of ``result``), which just got their tokens; none
        when ``overlapped`` (their next step is already scheduled): finished ones just leave the proposer."""
        proposed = None  # a model drafter's drafts, computed in the step (host proposers draft in ``propose``)
        if result.proposed_draft_ids is not None and not overlapped:
            proposed = self.spec_decoder.model_drafts(requests, rows, result)
        self.spec_decoder.propose(requests, self.scheduler.num_running, proposed, overlapped)

    def _step_async(self) -> tuple[list[EngineCoreOutput], DecodeTokens | None]:
        outputs, decode = [], None
        if self._batch_queue and self._needs_tokens_first(self._batch_queue[0]):
            outputs, decode = self._with_oldest(outputs)
        scheduler_output = self.scheduler.schedule()
        handle = self._launch(scheduler_output, defer_sampling=bool(self._batch_queue))
        if handle is not None and self.spec_decoder is not None and not self._batch_queue:  # (no placeholders)
            self.spec_decoder.prepare(scheduler_output.requests, self.scheduler.num_running)
        if self._batch_queue:  # waits for step k while step k+1 runs
            outputs, decode = self._with_oldest(outputs, decode, overlapped=True)
        if handle is not None:
            self.runner.dispatch_sampling(handle)  # a no-op unless only the forward went (grammar rows)
            self._enqueue(scheduler_output, handle)
        return outputs, decode

    def _with_oldest(self, outputs: list[EngineCoreOutput], decode: DecodeTokens | None = None,
                     overlapped: bool = False) -> tuple[list[EngineCoreOutput], DecodeTokens | None]:
        """``outputs`` (then ``decode``'s) followed by the oldest in-flight step's (``_complete_oldest``)."""
        if decode is not None:
            outputs = outputs + decode.expand()
        completed = self._complete_oldest(overlapped)
        if isinstance(completed, DecodeTokens):
            return outputs, completed
        return outputs + completed, None

    def _launch(self, scheduler_output: SchedulerOutput, defer_sampling: bool = False) -> PendingStep | None:
        """Hand the step to the runner; None when it has no rows."""
        if scheduler_output.is_empty:
            return None
        if scheduler_output.scheduled_new_reqs:
            now = time.time()
            for new in scheduler_output.scheduled_new_reqs:
                entry = self._seq_of.get(new.req_id)
                if entry is not None and entry[0].scheduled_time is None:
                    entry[0].scheduled_time = now
        lora_slots = ({} if self.lora_manager is None else
                      self.lora_manager.slots_for_step(r.lora for r in scheduler_output.requests if r.lora is not None))
        handle = self.runner.execute(scheduler_output, lora_slots, defer_sampling=defer_sampling)
        if handle is not None:
            self.num_steps += 1
        return handle

    def _enqueue(self, scheduler_output: SchedulerOutput, handle: PendingStep) -> None:
        """Right after dispatch: advance the scheduler as if the step were done, with a placeholder for each sampled
        token, so the next step can be scheduled before the tokens are known; a step that verifies drafts (its rows'
        token counts are its result's) advances it when it completes, before the next step is scheduled."""
        if scheduler_output.spec_token_ids:
            self._batch_queue.append(_InFlightStep(handle, [], scheduler_output, verifies=True))
            return
        placeholders = [PLACEHOLDER_TOKEN if samples else None for samples in scheduler_output.samples]
        progressed = self.scheduler.update_from_output(scheduler_output, placeholders)
        rows = list(zip(rows_of(scheduler_output.requests, progressed), progressed,
                        [len(r.output_token_ids) - 1 for r in progressed]))
        prompt_rows = handle.wants_prompt_logprobs
        # No rows: every sampling row belonged to a request that ended meanwhile; nothing to resolve (unless the step
        # computes prompt logprobs, which must still be reported, or reports its routing).
        routing = self.expert_load is not None or self.routed_experts is not None
        if rows or prompt_rows or routing:
            self._batch_queue.append(_InFlightStep(handle, rows, scheduler_output if prompt_rows or routing else None))

    def _needs_tokens_first(self, flight: _InFlightStep) -> bool:
        """Whether the next step waits for ``flight``'s tokens (no overlap): it verifies drafts (the scheduler needs
        how many were kept), some row's sampler reads every previous token when the next step is built (penalties,
        bad words), or some row will be proposed drafts from its new token (grammars only need the tokens at
        sampling: ``_step_async``)."""
        if flight.verifies or any(request.reads_output_tokens for _, request, _ in flight.rows):
            return True
        return self.spec_decoder is not None and self.spec_decoder.drafts_follow(
            (request for _, request, _ in flight.rows), self.scheduler.num_running)

    def _complete_oldest(self, overlapped: bool = False) -> list[EngineCoreOutput] | DecodeTokens:
        """Fetch the oldest in-flight step's tokens, put them in place of its placeholders (applying the stop tokens
        the scheduler could not see then) and report them (a steady decode's as columns, when no other output
        came); a step that verifies drafts is finished as without async scheduling (``_finish_step``).
        ``overlapped``: the next step is already scheduled (no drafts are proposed)."""
        flight = self._batch_queue.popleft()
        result = flight.handle.result()
        if flight.verifies:  # (no steady decode's columns: the step has drafts)
            return self._finish_step(flight.scheduler_output, result, [])[0]
        self._record_routing(flight.scheduler_output, result)
        outputs = (prompt_logprob_outputs(self._seq_of, flight.scheduler_output, result)
                   if flight.scheduler_output is not None else [])
        tokens = result.sampled_token_ids.tolist()  # Python ints once, not a numpy scalar per row
        seq_of, resolve_placeholder = self._seq_of, self.scheduler.resolve_placeholder
        rows, requests, row_tokens = [], [], []
        for flight_row in flight.rows:  # every running sequence, every step: kept lean
            row, request, output_index = flight_row
            entry = seq_of.get(request.request_id)
            if entry is None or entry[0].seqs.get(entry[1], request) is not request:
                continue  # aborted or finished meanwhile
            token = tokens[row]
            resolve_placeholder(request, output_index, token)
            rows.append(flight_row)
            requests.append(request)
            row_tokens.append(token)
        decode = self._token_rows.outputs(requests, row_tokens, self.scheduler.running)
        if decode is not None:  # a steady decode's step: every row's output is its token
            self.generation_tokens_total += len(row_tokens)
            outputs = outputs + decode.expand() if outputs else decode
        elif rows and self._token_outputs(rows, result, outputs) == len(rows):  # (no rows: nothing to report)
            self._token_rows.remember(requests, outputs[-len(rows):])
        else:
            self._token_rows.forget()
        if self.spec_decoder is not None:  # after the grammars accepted the tokens (drafts are cut to them)
            self._propose(requests, [row for row, _, _ in rows], result, overlapped)
        return outputs

    # ------------------------------------------------------------------ outputs
    def _token_outputs(self, rows: Iterable[tuple[int, Request, int]], result: StepOutput,
                       outputs: list[EngineCoreOutput]) -> int:
        """Append the output of each ``(row, request, output index)`` whose token is known (a row that verified
        drafts: its tokens from that index on); advance the beam searches that got every beam's token. Returns how
        many of them were token-only (``core_outputs.TokenOnlyRows``)."""
        seq_of = self._seq_of
        beam_groups = []
        draft_rows = result.draft_rows or {}
        # The common row (every running sequence, every step) needs its token only: no drafts, grammar, logprobs,
        # beam search, routing, pooling, first-output facts or finish.
        token_only_step = not draft_rows and self.routed_experts is None and self.pooling is None
        running, num_token_only, add_output = RequestStatus.RUNNING, 0, outputs.append
        for row, request, output_index in rows:
            group, index = seq_of[request.request_id]
            if (token_only_step and group.token_only and output_index and group.reported_start
                    and request.status is running and request.grammar is None):
                add_output(EngineCoreOutput(group.request_id, index, [request.output_token_ids[output_index]]))
                num_token_only += 1
                continue
            if row in draft_rows:
                tokens = request.output_token_ids[output_index:]
                if request.grammar is not None:  # the kept drafts and the token after them
                    for token in tokens:
                        request.grammar.accept(token)
                outputs.append(token_output(group, index, request, tokens, result, row, self.routed_experts,
                                            self.pooling))
                self.generation_tokens_total += len(tokens)
                if request.is_finished:
                    self._sequence_done(group, request, index)
                continue
            token = request.output_token_ids[output_index]
            if request.grammar is not None:
                request.grammar.accept(token)
            if self.pooling is None:  # a pooling request's one token ends it: nothing generated
                self.generation_tokens_total += 1
            if output_index == 0:  # per sequence, as vLLM counts each of n sequences' prompt
                self.prompt_tokens_total += group.num_prompt_tokens
            if group.beam_search is not None:
                group.beam_search.record(request, make_logprob_dict(
                    token, result.logprobs[row], result.ranks[row],
                    result.top_token_ids[row][:2 * group.beam_search.params.beam_width],
                    result.top_logprobs[row][:2 * group.beam_search.params.beam_width], no_text))
                beam_groups.append(group)
                continue
            outputs.append(token_output(group, index, request, [token], result, row, self.routed_experts,
                                        self.pooling))
            if request.is_finished:
                self._sequence_done(group, request, index)
        self.generation_tokens_total += num_token_only
        for group in beam_groups:
            search = group.beam_search
            if not search.done:
                search.advance()  # a no-op until every beam has its token
                if search.done:
                    outputs += search.outputs()
                    del self._groups[group.request_id]
        return num_token_only

    def _record_routing(self, scheduler_output: SchedulerOutput | None, result: StepOutput) -> None:
        if self.expert_load is not None:
            self.expert_load.record(result)
        if self.routed_experts is not None:  # of the sequences still running (async: some ended meanwhile)
            self.routed_experts.record(scheduler_output, result, self._seq_of)

    # ------------------------------------------------------------------ utilities (also callable remotely)
    def stats(self) -> dict[str, float]:
        """Scheduler gauges and counters plus token totals. Keys: num_running, num_waiting, num_unfinished_requests,
        kv_cache_usage (0..1), num_preemptions, num_swap_outs, num_swap_ins, num_gpu_blocks / num_cpu_blocks,
        prefix_cache_queries / prefix_cache_hits (tokens), prompt_tokens_total, generation_tokens_total, num_steps,
        num_compiles_since_warmup; with speculative decoding vLLM's counters (``SpecDecodingStats.as_stats``)."""
        stats = dict(self.scheduler.stats())
        stats["num_unfinished_requests"] = len(self._groups)
        stats["prompt_tokens_total"] = self.prompt_tokens_total
        stats["generation_tokens_total"] = self.generation_tokens_total
        stats["num_steps"] = self.num_steps
        stats["num_compiles_since_warmup"] = self.runner.num_compiles_since_warmup
        if self.spec_decoder is not None:
            stats.update(self.spec_decoder.stats.as_stats())
        if self.expert_load is not None:
            stats.update(self.expert_load.as_stats())
        return stats

    def add_lora(self, lora_request) -> bool:
        """Load an adapter into host memory ahead of its requests (ValueError if it cannot be served). True if it
        was not loaded yet."""
        return self._require_lora("lora_request").add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Forget adapter ``lora_id`` (requests already using it finish with it). True if it was loaded."""
        return self._require_lora("lora_id").remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        """Ids of the adapters in host memory."""
        return set() if self.lora_manager is None else self.lora_manager.list_loras()

    def _require_lora(self, field: str):
        if self.lora_manager is None:
            raise ValueError(f"{field}: LoRA is not enabled; start the engine with enable_lora=True (--enable-lora)")
        return self.lora_manager

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block no request holds (vLLM's ``reset_prefix_cache``); True when done."""
        self.kv_cache_manager.reset_prefix_cache()
        return True

    # RL rollouts (paged_jax.engine.rollout_control): the weights, sleep mode, pause / resume.
    def update_weights(self, params) -> None:
        """Replace the weights with ``params`` (model layout or HF names, the engine's dtype); a ValueError naming
        the first mismatched parameter leaves the old ones serving."""
        self.rollout.update_weights(params)

    def update_weights_from_disk(self, path: str) -> None:
        """Replace the weights with an HF safetensors or orbax checkpoint directory's."""
        self.rollout.update_weights_from_disk(path)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.rollout.init_weight_transfer_engine(init_info)

    def update_weights_from_distributed(self, names: list[str], dtype_names: list[str], shapes: list) -> None:
        self.rollout.update_weights_from_distributed(names, dtype_names, shapes)

    def sleep(self, level: int = 1) -> dict:
        return self.rollout.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.rollout.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.rollout.is_sleeping()

    def pause_generation(self, mode: str = "abort") -> None:
        self.rollout.pause_generation(mode)

    def resume_generation(self) -> None:
        self.rollout.resume_generation()

    def is_paused(self) -> bool:
        """Paused and idle: nothing runs (with mode "wait", once the requests it lets finish have)."""
        return self.rollout.is_paused() and (self.rollout.frozen or not self.scheduler.has_unfinished_requests())

    def close(self) -> None:
        """Stop the runner's threads and the grammar compiler's."""
        self.structured_outputs.close()
        self.runner.close()


def add_all_or_none(core, requests: Iterable[EngineCoreRequest]) -> None:
    """``core.add_request`` each request; on the first error abort the ones added before it and raise it."""
    added = []
    try:
        for request in requests:
            core.add_request(request)
            added.append(request.request_id)
    except Exception:
        core.abort_requests(added)
        raise
