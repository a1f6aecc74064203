"""Continuous-batching scheduler (vLLM V1 style): one token budget per step shared by decodes, chunked prefills and
newly admitted requests; prefix-cache aware admission; preemption by recompute or swap.

Per step the engine calls ``schedule()``, runs the model on the returned ``SchedulerOutput``, then calls
``update_from_output(output, sampled_token_ids)``. No separate prefill/decode phase: a request has ``num_tokens -
num_computed_tokens`` tokens left to compute, 1 while decoding; while every running request decodes and nothing
else happens, both calls take the array path of ``paged_jax.core.steady_decode``.

Order of work in ``schedule()``:
  1. Running requests, in admission order: each gets ``min(tokens left, budget)`` (1 when decoding; a chunk while
     still prefilling). If the pool is short of blocks, the least important running request (highest
     ``(priority, arrival)`` with policy="priority", latest arrival with "fcfs") is preempted until the allocation fits;
     as in vLLM that may be the request being scheduled itself (then it waits and older streams keep going), or one
     already scheduled in this step (it is un-scheduled and its budget returned).
  2. Waiting requests (FCFS, or by ``(priority, arrival_time)`` with policy="priority"), unless step 1 preempted
     anything (the pool is tight; admitting would thrash). Swapped requests resume by swap-in, others start from their
     longest prefix-cache hit. A prompt longer than the remaining budget is chunked (``enable_chunked_prefill``) so it
     never stalls the running streams. With policy="priority" a waiting request that does not fit may preempt running
     requests of strictly lower priority.
  3. Long prefills (more than ``long_prefill_token_threshold`` tokens left, vLLM's "long") of running requests
     take what step 2 left (at least half the budget); with FCFS, short prompts queued behind long ones are admitted
     first, and in a step that starts one every long prefill gets at most the threshold (vLLM V1's cap), so a short
     prompt's first token never waits behind long prefills. At most ``max_long_partial_prefills`` long prompts are
     partway through their prefill; another long one waits and shorter ones jump it (vLLM's queue jump).
Speculative decoding (``paged_jax.core.drafts``): a decoding request's drafts are computed with its next token.

Forked sequences (n > 1, best_of, beam search; ``KVCacheManager.fork``) are forked from their parent in the step that
samples its first token, one extra row per child (``SchedulerOutput.fork_rows``), which ``update_from_output`` then
gives the parent's blocks; admission keeps ``reserved_seats`` free for them. Beam search holds a request after each
token (``Request.hold_after_sample``) until it has forked, re-pointed (``replace_last_token``) or dropped it and calls
``resume``. A forked sequence is preempted as any request (recompute drops its references; swap copies its blocks).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Mapping, Sequence

from paged_jax.worker.buckets import MAX_BLOCK_COPIES
from paged_jax.core.sched_output import SchedulerOutput, StepBuilder
from paged_jax.core.steady_decode import SteadyDecode, update_decode_step
from paged_jax.core.drafts import apply_drafts, lookahead_slots, with_drafts
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.step_plan import PASSED_OVER, Admission, StepPlan
from paged_jax.core.request import FINISH_STATUS_BY_REASON, Request, RequestStatus, check_stop, stops_on_token


class Scheduler:
    """Decides, each step, which requests run with how many tokens, and owns the request life cycle.

    Args:
      kv_cache_manager: the block pool the scheduled sequences live in.
      max_num_seqs: most requests running at once (and so per step).
      max_num_batched_tokens: token budget per step (sum of ``num_new_tokens``).
      max_model_len: most tokens (prompt + output) per request; reaching it finishes the request with "length".
      preemption_mode: "recompute" (drop blocks, re-prefill prompt + outputs later) or "swap" (copy blocks to the
        host pool; falls back to recompute when the host pool is full).
      policy: "fcfs" or "priority" (lower ``Request.priority`` first, then earlier arrival).
      enable_chunked_prefill: split prompts across steps to fit the budget; without it a prompt must fit whole
        (``max_num_batched_tokens >= max_model_len`` is then required).
      long_prefill_token_threshold: a prefill with more tokens than this left to compute is long (step 3 of the
        module docstring); 0: none is, every running request is planned before admissions.
      max_long_partial_prefills: most long prompts partway through their prefill at once (>= 1).
      num_lookahead_tokens: KV slots allocated past each request's new tokens for a model drafter (``drafts``).
    """

    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, preemption_mode: str = "recompute", policy: str = "fcfs",
                 enable_chunked_prefill: bool = True, max_loras: int = 0, long_prefill_token_threshold: int = 0,
                 max_long_partial_prefills: int = 1, num_lookahead_tokens: int = 0) -> None:
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len), ("max_long_partial_prefills", max_long_partial_prefills)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(long_prefill_token_threshold, int) or long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be an int >= 0, got {long_prefill_token_threshold!r}")
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {policy!r}")
        # One request of max_model_len tokens must fit alone, or it could never make progress.
        blocks_per_request = kv_cache_manager.max_blocks_per_request(max_model_len, max_num_batched_tokens)
        if blocks_per_request > kv_cache_manager.num_usable_blocks:
            raise ValueError(f"max_model_len={max_model_len} needs {blocks_per_request} blocks but the KV cache has "
                             f"only {kv_cache_manager.num_usable_blocks}; lower max_model_len or add blocks")
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_model_len "
                             f"({max_model_len}) when chunked prefill is disabled")
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.ready_limits = (max_num_batched_tokens, max_num_seqs)  # a step's (budget, seats); lower while compiling
        self.max_model_len = max_model_len
        self.preemption_mode = preemption_mode
        self.policy = policy
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_loras = max_loras  # > 0: at most this many distinct LoRA adapters in the running batch (vLLM)
        # A prefill with more tokens left than this is long; 0 (none is long) compares against a bound never reached.
        self.long_prefill_token_threshold = long_prefill_token_threshold or max_model_len + 1
        self.max_long_partial_prefills = max_long_partial_prefills
        self._num_lookahead_tokens = num_lookahead_tokens
        self._slots = lambda computed, new: lookahead_slots(computed, new, num_lookahead_tokens, max_model_len)

        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.waiting: collections.deque[Request] = collections.deque()  # WAITING / PREEMPTED / SWAPPED
        self.running: list[Request] = []  # admission order
        self._reserving: set[Request] = set()  # running requests with reserved_seats > 0
        self._num_pending_forks = 0
        self._arrival_seq: dict[str, int] = {}  # tie-breaker for equal arrival times
        self._next_seq = 0
        self._finished_rows: list[str] = []  # finished since the last schedule(), with a row in the runner
        self._steady: SteadyDecode | None = None  # every running request decoding (dropped when running changes)

        self.num_preemptions = self.num_swap_outs = self.num_swap_ins = 0

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the scheduler")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(f"prompt has {request.num_prompt_tokens} tokens, more than max_model_len="
                             f"{self.max_model_len}")
        if request.status != RequestStatus.WAITING or request.block_ids or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} must be new (WAITING, no blocks, nothing computed)")
        if request.reserved_seats + 1 > self.max_num_seqs:
            raise ValueError(f"request {request.request_id!r} needs {request.reserved_seats + 1} sequence slots, more "
                             f"than max_num_seqs={self.max_num_seqs}")
        self._register(request)
        self._num_pending_forks += len(request.pending_forks)
        self.waiting.append(request)

    def _register(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._arrival_seq[request.request_id] = self._next_seq
        self._next_seq += 1

    def finish_request(self, request_id: str, reason: str | RequestStatus) -> Request | None:
        """Finish an unfinished request in any state and free its blocks; reason "stop" | "length" | "abort" or a
        FINISHED_* status. Returns the request, or None if the id is unknown / already finished."""
        status = FINISH_STATUS_BY_REASON.get(reason) if isinstance(reason, str) else reason
        if not isinstance(status, RequestStatus) or not status.is_finished:
            raise ValueError(f"reason must be 'stop', 'length', 'abort' or a FINISHED_* status, got {reason!r}")
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status != RequestStatus.RUNNING:
            self.waiting.remove(request)
        self._finish(request, status)
        return request

    def abort_request(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def _drop_steady(self) -> None:
        """Leave the steady decode path, its rows' ``runner_num_tokens`` made current (``SteadyDecode.close``)."""
        self._steady = self._steady and self._steady.close()  # (None either way)

    def _leave_running(self, request: Request) -> None:
        self._drop_steady()
        self.running.remove(request)
        self._reserving.discard(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """End ``request`` (a running one leaves the running set; a waiting one must have left the queue)."""
        if request.status == RequestStatus.RUNNING:
            self._leave_running(request)
        request.status = status
        # Its row, and those of children a fork row of the last step made but that were never forked, leave the batch.
        for held in (request, *request.pending_forks):
            if held.runner_num_tokens >= 0:
                self._finished_rows.append(held.request_id)
                held.runner_num_tokens = -1
        # Sequences not forked yet end with their parent (the engine ends a request's sequences together).
        self._num_pending_forks -= len(request.pending_forks)
        request.pending_forks = []
        request.reserved_seats = 0
        self.kv.free(request)
        del self.requests[request.request_id]
        del self._arrival_seq[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def _order_key(self, request: Request) -> tuple:
        seq = self._arrival_seq[request.request_id]
        if self.policy == "priority":
            return (request.priority, request.arrival_time, seq)
        return (request.arrival_time, seq)

    def _peek_waiting(self, skip: set[str]) -> Request | None:
        if self.policy == "fcfs" and not skip and (not self.waiting or self.waiting[0].startable):
            return self.waiting[0] if self.waiting else None
        # Requests whose grammar still compiles (structured outputs) or that are held (beam search) wait without
        # blocking those behind them.
        candidates = (r for r in self.waiting if r.request_id not in skip and r.startable)
        if self.policy == "priority":
            return min(candidates, key=self._order_key, default=None)
        return next(candidates, None)  # FCFS queue (preempted requests were put back at the front): the first only

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first, then admissions (see the module docstring); returns the step as a
        diff of the runner's batch (``paged_jax.core.sched_output``)."""
        output = self._steady and self._steady.step(self, *self.ready_limits)
        if output:
            return output
        self._drop_steady()
        step = StepPlan(*self.ready_limits)
        self._schedule_running(step)
        if not step.preempted:  # the pool is tight after a preemption: admitting would thrash
            # Long prefills left for after admissions keep at least half of what is left.
            reserve = min(sum(r.num_tokens_to_compute for r in step.long_prefills), step.budget // 2)
            step.budget -= reserve
            self._schedule_waiting(step)
            step.budget += reserve
        self._schedule_long_prefills(step)
        return self._build_output(step)

    def _preempt(self, victim: Request, step: StepPlan) -> None:
        """Take ``victim`` out of the running set (swap its blocks out, or drop them for a recompute); a victim
        already planned in ``step`` is un-scheduled and its budget returned."""
        planned = step.planned.pop(victim.request_id, None)
        if planned is not None:
            step.budget += planned[1]
        self._leave_running(victim)
        victim.spec_token_ids = []
        # A swap-out after a swap-in in the same step could reuse the host blocks the swap-in reads: recompute.
        if self.preemption_mode == "swap" and not step.swap_in and self.kv.can_swap_out(victim):
            step.swap_out.extend(self.kv.swap_out(victim))
            victim.status = RequestStatus.SWAPPED
            self.num_swap_outs += 1
        else:
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.PREEMPTED
        victim.runner_num_tokens = -1  # its row leaves the runner's batch (preempted_req_ids)
        self.waiting.appendleft(victim)
        step.preempted.append(victim.request_id)
        self.num_preemptions += 1

    def _schedule_running(self, step: StepPlan) -> None:
        """Give each running request its tokens (1 when decoding), preempting the least important running request
        while the pool is short (as vLLM: possibly the request itself, which then waits). Runs for every running
        request every step: kept to plain attribute reads and one allocation call per request."""
        running_status = RequestStatus.RUNNING
        kv = self.kv
        allocate_slots = kv.allocate_slots
        planned = step.planned
        long_threshold = self.long_prefill_token_threshold
        budget = step.budget
        slots_of = self._slots if self._num_lookahead_tokens else None
        copy_limit = MAX_BLOCK_COPIES * kv.num_groups
        # ``allocate_slots``' no-op case, checked here for every decode: its blocks cover the step and the block it
        # writes into is its own (no copy-on-write); no sliding window releasing blocks.
        blocks, block_size, groups = kv.blocks, kv.block_size, kv.num_groups
        own_blocks_cover = not kv.has_sliding_window
        # Only an allocation (the ``elif`` below) records copies: the test is redone after one.
        copies_full = kv.num_pending_copies >= copy_limit
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not running_status or request.held:  # preempted earlier in this loop / held
                continue
            num_computed = request.num_computed_tokens
            num_new = (len(request.prompt_token_ids) + len(request.output_token_ids)
                       - num_computed)  # request.num_tokens_to_compute, inlined
            if num_new > long_threshold:
                step.long_prefills.append(request)
                continue
            if num_new > budget:
                num_new = budget
            if num_new <= 0:
                continue
            if request.spec_token_ids:
                num_new = with_drafts(request, num_new, budget, self.max_model_len)
            if copies_full and kv.needs_copy(request):
                continue  # the step's copy-on-write slots are used up: its first write into a shared block waits
            slots = num_new if slots_of is None else slots_of(num_computed, num_new)
            block_ids = request.block_ids
            if own_blocks_cover and len(block_ids) >= (num_computed + slots + block_size - 1) // block_size * groups \
                    and blocks[block_ids[num_computed // block_size * groups]].ref_cnt <= 1:
                pass
            elif not allocate_slots(request, slots):
                step.budget = budget
                fits = self._preempt_until_fits(request, slots, step)
                budget = step.budget
                copies_full = kv.num_pending_copies >= copy_limit
                if not fits:
                    continue
            else:
                copies_full = kv.num_pending_copies >= copy_limit
            planned[request.request_id] = (request, num_new)
            budget -= num_new
        step.budget = budget

    def _preempt_until_fits(self, request: Request, num_slots: int, step: StepPlan) -> bool:
        """Preempt the least important running request until ``num_slots`` slots of running ``request`` fit (as vLLM:
        possibly ``request`` itself); returns whether ``request`` still runs with its slots allocated."""
        while True:
            victim = max(self.running, key=self._order_key)
            self._preempt(victim, step)  # returns the budget of a victim planned earlier
            if victim is request:
                return False
            if self.kv.allocate_slots(request, num_slots):
                return True

    def _schedule_long_prefills(self, step: StepPlan) -> None:
        """Give the running long prefills left out of ``_schedule_running`` what budget admissions left."""
        for request in step.long_prefills:
            if step.budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted in this step
                continue
            if self.kv.num_pending_copies >= MAX_BLOCK_COPIES * self.kv.num_groups and self.kv.needs_copy(request):
                continue
            num_new = min(request.num_tokens_to_compute, step.budget)
            if step.short_prefill_started:
                num_new = min(num_new, self.long_prefill_token_threshold)
            if (self.kv.allocate_slots(request, slots := self._slots(request.num_computed_tokens, num_new))
                    or self._preempt_until_fits(request, slots, step)):
                step.planned[request.request_id] = (request, num_new)
                step.budget -= num_new

    def _schedule_waiting(self, step: StepPlan) -> None:
        """Admit waiting requests (FCFS or by priority) while seats, budget and blocks allow; with FCFS, short
        prompts queued behind long ones first (module docstring, step 3)."""
        if not self.waiting:
            return
        admission = Admission(running_loras={r.lora_int_id for r in self.running} - {0},
                               reserved=sum(r.reserved_seats for r in self._reserving),
                               num_partial_long=len(step.long_prefills))
        for request in self._short_waiting(step):
            if self._try_admit(request, step, admission) is None:
                break
        while True:
            request = self._peek_waiting(admission.passed_over.union(step.preempted))  # never re-admit the preempted
            if request is None or self._try_admit(request, step, admission) is None:
                break

    def _short_waiting(self, step: StepPlan) -> list[Request]:
        """FCFS: the short prompts among the first ``max_num_seqs`` waiting requests when the queue's head is long."""
        threshold = self.long_prefill_token_threshold
        if (self.policy != "fcfs" or step.budget <= 0 or len(self.running) >= step.seats
                or self.waiting[0].num_tokens_to_compute <= threshold):
            return []  # no seat or budget to give (the common case at a full batch), or the head is short already
        return [r for r in itertools.islice(self.waiting, step.seats)
                if r.num_tokens_to_compute <= threshold and r.startable
                and r.request_id not in step.preempted]

    def _try_admit(self, request: Request, step: StepPlan, admission: Admission) -> bool | None:
        """Admit ``request`` if seats, adapter slots, budget and blocks allow; returns True when admitted, False when
        it is passed over (those behind it may still start), None when no more can start in this step."""
        if step.budget <= 0 or len(self.running) + admission.reserved + 1 + request.reserved_seats > step.seats:
            return None  # head-of-line: no seat (or its forks need slots that running requests hold)
        if request.lora_int_id and request.lora_int_id not in admission.running_loras \
                and len(admission.running_loras) >= self.max_loras:
            admission.passed_over.add(request.request_id)
            return False
        partial_long_allowed = admission.num_partial_long < self.max_long_partial_prefills
        num_new = self._admit(request, step, partial_long_allowed)
        if num_new == PASSED_OVER:
            admission.passed_over.add(request.request_id)  # the shorter prompts behind it go first
            # Once a short prompt started, every long prompt would stay partial: none can start. Else the look-ahead
            # is bounded by the seats: no more could run at once anyway.
            done = step.short_prefill_started or len(admission.passed_over) >= step.seats
            return None if done else False
        if num_new is None:
            return None
        if num_new < request.num_tokens_to_compute > self.long_prefill_token_threshold:
            admission.num_partial_long += 1  # a long prompt that stays partway through its prefill
        elif request.num_tokens_to_compute <= self.long_prefill_token_threshold:
            step.short_prefill_started = True
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self._join_running(request)
        admission.running_loras |= {request.lora_int_id} - {0}
        if request.reserved_seats:
            self._reserving.add(request)
            admission.reserved += request.reserved_seats
        step.planned[request.request_id] = (request, num_new)
        step.budget -= num_new
        return True

    def _admit(self, request: Request, step: StepPlan, partial_long_allowed: bool = True) -> int | None:
        """Allocate a waiting request's blocks (swap-in, or its prefix-cache hit plus new blocks), preempting lower
        priorities if the policy allows; returns its new-token count, None when it cannot start now, or
        ``PASSED_OVER`` when it is a long prompt that would stay partial and ``partial_long_allowed`` is False."""
        if request.status == RequestStatus.SWAPPED:
            num_new = min(request.num_tokens_to_compute, step.budget)
            ok = self.kv.can_swap_in(request, slots := self._slots(request.num_computed_tokens, num_new))
            while not ok and self._preempt_lower_priority(request, step):
                ok = self.kv.can_swap_in(request, slots)
            if not ok:
                return None
            step.swap_in.extend(self.kv.swap_in(request))
            if not self.kv.allocate_slots(request, slots):  # guaranteed by can_swap_in
                raise RuntimeError("allocation after swap-in failed")
            self.num_swap_ins += 1
            return num_new
        limit = step.budget
        if step.short_prefill_started:
            limit = min(limit, self.long_prefill_token_threshold)
        # What is left after its prefix-cache hit (the device's or the host tier's) decides whether it is long.
        computed_blocks, num_hit = self.kv.get_computed_blocks(request)
        num_new = request.num_tokens - num_hit
        if not partial_long_allowed and self.enable_chunked_prefill and \
                num_new > max(limit, self.long_prefill_token_threshold):
            return PASSED_OVER
        if num_new > limit:
            if not self.enable_chunked_prefill:
                return None  # head-of-line: keep FCFS/priority order rather than skipping ahead
            num_new = limit
        ok = self.kv.can_allocate(request, slots := self._slots(num_hit, num_new), computed_blocks)
        while not ok and self._preempt_lower_priority(request, step):
            ok = self.kv.can_allocate(request, slots, computed_blocks)
        if not ok:
            return None
        first_admission = request.status == RequestStatus.WAITING
        if not self.kv.allocate_slots(request, slots, computed_blocks):  # guaranteed by can_allocate
            raise RuntimeError("allocation after can_allocate failed")
        if first_admission:
            request.num_cached_prompt_tokens = min(num_hit, request.num_prompt_tokens)
        return num_new

    def _build_output(self, step: StepPlan) -> SchedulerOutput:
        """The step as the runner's diff (``StepBuilder``), fork rows after the request that samples its first
        token."""
        builder = StepBuilder()
        builder.add_rows(step.planned.values())
        finished, self._finished_rows = self._finished_rows, []
        stores, loads = self.kv.take_offload_copies()  # the host tier's (paged_jax.core.kv_offload)
        return builder.build(finished_req_ids=finished, preempted_req_ids=step.preempted,
                             block_copies=self.kv.take_block_copies(), swap_out=step.swap_out + stores,
                             swap_in=step.swap_in + loads)

    def _preempt_lower_priority(self, request: Request, step: StepPlan) -> bool:
        """policy="priority": preempt the least important running request if it ranks strictly below ``request``."""
        if self.policy != "priority" or not self.running:
            return False
        victim = max(self.running, key=self._order_key)
        if victim.priority <= request.priority:
            return False
        self._preempt(victim, step)
        return True

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled_token_ids: Mapping[str, int] | Sequence[int | None],
                           accepted_token_ids: Mapping[str, list[int]] | None = None) -> list[Request]:
        """Apply a step's results; returns the requests that produced a token (finished ones included).

        ``sampled_token_ids``: request_id -> token id, or a sequence aligned with the step's rows (the runner's
        ``StepOutput.sampled_token_ids``; entries of rows that do not sample are ignored). Requests finished or
        aborted since ``schedule()`` are skipped. ``accepted_token_ids``: request_id -> the leading drafts the
        verification kept, for every row of ``scheduler_output.spec_token_ids`` (``drafts.apply_drafts``).
        """
        spec = scheduler_output.spec_token_ids
        if spec and accepted_token_ids is None:
            raise ValueError("update_from_output: the step verified drafts; pass accepted_token_ids")
        requests_of_rows = scheduler_output.requests
        if isinstance(sampled_token_ids, Mapping):
            sampled_token_ids = [sampled_token_ids.get(r.request_id) for r in requests_of_rows]
        elif len(sampled_token_ids) != len(requests_of_rows):
            raise ValueError(f"sampled_token_ids has {len(sampled_token_ids)} entries, expected "
                             f"{len(requests_of_rows)} (one per row of the step)")
        tokens = sampled_token_ids if type(sampled_token_ids) is list else list(sampled_token_ids)
        if (not spec and not scheduler_output.fork_rows and not scheduler_output.scheduled_new_reqs
                and sum(scheduler_output.num_scheduled_tokens) == len(tokens) and all(scheduler_output.samples)):
            return update_decode_step(self, scheduler_output, tokens)
        num_forks = len(scheduler_output.fork_rows)
        first_fork = len(requests_of_rows) - num_forks
        changed: list[Request] = []
        for row, (request, samples, token, num_new, start) in enumerate(zip(
                requests_of_rows, scheduler_output.samples, tokens,
                scheduler_output.num_scheduled_tokens + [0] * num_forks, scheduler_output.row_num_computed_tokens())):
            if request.status is not RequestStatus.RUNNING:  # finished or preempted since schedule() (unregistered)
                continue  # (a fork row whose parent ended meanwhile: its child was never forked)
            if row < first_fork:
                if request.num_computed_tokens != start:
                    raise RuntimeError(f"request {request.request_id!r} changed since schedule(): call "
                                       "update_from_output once per schedule(), in order")
                if spec and request.request_id in spec:
                    self._apply_drafts(request, num_new, spec[request.request_id],
                                       accepted_token_ids[request.request_id], int(token))
                    changed.append(request)
                    continue
                request.num_computed_tokens = start + num_new
                self.kv.cache_full_blocks(request)
                if not samples:
                    continue
                if request.pending_forks:  # before the parent's own token (and a stop that would free its blocks)
                    self._fork_pending(request)
            if token is None:
                raise ValueError(f"sampled_token_ids has no token for request {request.request_id!r}")
            request.output_token_ids.append(int(token))
            status = check_stop(request, self.max_model_len)
            if status is not None:
                self._finish(request, status)
            elif request.hold_after_sample:
                request.held = True
            changed.append(request)
        return changed

    def _join_running(self, request: Request) -> None:
        self._drop_steady()
        self.running.append(request)

    def _apply_drafts(self, request: Request, num_scheduled: int, drafts: list[int], accepted: list[int],
                      token: int) -> None:
        """A row that verified ``drafts`` (``drafts.apply_drafts``): finish it where a stop rule ends it."""
        status = apply_drafts(request, num_scheduled, drafts, accepted, token, self.max_model_len)
        if status is not None:
            self._finish(request, status)
        else:
            self.kv.cache_full_blocks(request)

    def _fork_pending(self, parent: Request) -> None:
        """Fork ``parent``'s pending sequences now that its prompt is computed; each takes one of its reserved
        slots and shares its blocks."""
        children, parent.pending_forks = parent.pending_forks, []
        self._num_pending_forks -= len(children)
        for child in children:
            self._register(child)
            self.kv.fork(parent, child)
            child.num_cached_prompt_tokens = parent.num_cached_prompt_tokens
            child.status = RequestStatus.RUNNING
            self._join_running(child)
            self._use_reserved_seat(parent)

    def _use_reserved_seat(self, request: Request) -> None:
        if request.reserved_seats:
            request.reserved_seats -= 1
            if not request.reserved_seats:
                self._reserving.discard(request)

    def release_reserved_seats(self, request: Request) -> None:
        """Give back the slots ``request`` reserved and will not fork into."""
        request.reserved_seats = 0
        self._reserving.discard(request)

    def fork_request(self, parent: Request, child: Request) -> None:
        """Add ``child``, a new request whose tokens equal ``parent``'s except possibly the last (not computed
        yet), sharing ``parent``'s computed blocks (beam search). A running parent's child runs at once in one of the
        parent's reserved slots or a free one; otherwise (parent waiting, or no slot free) the child waits and
        recomputes its tokens like a preempted request."""
        if self.requests.get(parent.request_id) is not parent:
            raise ValueError(f"fork_request: {parent.request_id!r} is not an unfinished request")
        if child.request_id in self.requests:
            raise ValueError(f"request_id {child.request_id!r} is already in the scheduler")
        if child.num_tokens != parent.num_tokens or child.block_ids or child.num_computed_tokens:
            raise ValueError("fork_request: the child must be new and as long as its parent")
        self._register(child)
        child.num_cached_prompt_tokens = parent.num_cached_prompt_tokens
        reserved = sum(r.reserved_seats for r in self._reserving)
        if parent.status == RequestStatus.RUNNING and (
                parent.reserved_seats or len(self.running) + reserved < self.ready_limits[1]):
            self.kv.fork(parent, child)
            child.status = RequestStatus.RUNNING
            self._join_running(child)
            self._use_reserved_seat(parent)
        else:
            child.status = RequestStatus.PREEMPTED
            self.waiting.append(child)

    def replace_last_token(self, request: Request, token: int) -> None:
        """Beam search: make ``token`` the request's last output token (its K/V is not computed yet)."""
        self._drop_steady()
        if request.runner_num_tokens >= request.num_tokens:  # the runner appends tokens; it must not have it yet
            raise RuntimeError(f"replace_last_token: the last token of {request.request_id!r} was already sent")
        request.output_token_ids[-1] = int(token)
        self.kv.invalidate_block_hashes(request, request.num_tokens - 1)

    def resume(self, request: Request) -> None:
        """Let a held request be scheduled again."""
        request.held = False

    def resolve_placeholder(self, request: Request, output_index: int, token: int) -> None:
        """Async scheduling: put the real ``token`` in place of the placeholder that ``update_from_output`` appended
        as output ``output_index`` (its K/V not computed yet), then apply the stop-token rules the placeholder could
        not trigger (the length limits were applied then). A stop token also wins over a length finish of the same
        token, as in the synchronous path."""
        request.output_token_ids[output_index] = token
        self.kv.invalidate_block_hashes(request, request.num_prompt_tokens + output_index)
        if token not in request.stop_ids or not stops_on_token(request, token, output_index + 1):
            return  # (``stop_ids``: the screen of every token that may stop it)
        if request.is_finished:  # by length, already freed
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

    def stats(self) -> dict[str, float]:
        return {"num_running": self.num_running, "num_waiting": self.num_waiting + self._num_pending_forks,
                "num_preemptions": self.num_preemptions, "num_swap_outs": self.num_swap_outs,
                "num_swap_ins": self.num_swap_ins, **self.kv.stats()}
