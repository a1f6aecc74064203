"""Continuous-batching scheduler (vLLM V1 style): one token budget per step shared by decodes, chunked prefills and
newly admitted requests; prefix-cache aware admission; preemption by recompute or swap.

Per step the engine calls ``schedule()``, runs the model on the returned ``SchedulerOutput``, then calls
``update_from_output(output, sampled_token_ids)``. There is no separate prefill/decode phase: a request simply has
``num_tokens - num_computed_tokens`` tokens left to compute, which is 1 while decoding.

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

Forked sequences (n > 1, best_of, beam search; ``KVCacheManager.fork``): a request's ``pending_forks`` are forked
from it in the step that samples its first token: that step carries one extra row per child with no new tokens
(``SchedulerOutput.fork_rows``), which samples the child's first token from the parent's last prompt position, and
``update_from_output`` then gives the child the parent's blocks. Admission keeps ``reserved_seats`` running slots
free for them. Beam search holds a request after each sampled token (``Request.hold_after_sample``) until the beam
search has forked, re-pointed (``replace_last_token``) or dropped it and calls ``resume``.
Preemption of a forked sequence is that of any request: recompute drops its references (the siblings keep the
shared blocks) and re-prefills its own prompt + outputs later; swap copies its blocks, shared ones included, to the
host pool, and it comes back in blocks of its own.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence

from paged_jax.worker.buckets import MAX_BLOCK_COPIES
from paged_jax.core.sched_output import SchedulerOutput, StepBuilder
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import FINISH_STATUS_BY_REASON, Request, RequestStatus


@dataclasses.dataclass
class _StepPlan:
    """One ``schedule()`` call's working state: the budget left, the planned ``request_id -> (request, new
    tokens)``, what it preempted and the swap copies it queued."""

    budget: int
    planned: dict[str, tuple[Request, int]] = dataclasses.field(default_factory=dict)
    preempted: list[str] = dataclasses.field(default_factory=list)
    swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)


def _grammar_ready(request: Request) -> bool:
    return request.grammar is None or request.grammar.is_ready


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
    """

    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, preemption_mode: str = "recompute", policy: str = "fcfs",
                 enable_chunked_prefill: bool = True, max_loras: int = 0) -> None:
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {policy!r}")
        # One request of max_model_len tokens must fit alone, or it could never make progress.
        if kv_cache_manager.blocks_needed(max_model_len) > kv_cache_manager.num_usable_blocks:
            raise ValueError(
                f"max_model_len={max_model_len} needs {kv_cache_manager.blocks_needed(max_model_len)} blocks but the "
                f"KV cache has only {kv_cache_manager.num_usable_blocks}; lower max_model_len or add blocks")
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_model_len "
                             f"({max_model_len}) when chunked prefill is disabled")
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.preemption_mode = preemption_mode
        self.policy = policy
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_loras = max_loras  # > 0: at most this many distinct LoRA adapters in the running batch (vLLM)

        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.waiting: collections.deque[Request] = collections.deque()  # WAITING / PREEMPTED / SWAPPED
        self.running: list[Request] = []  # admission order
        self._reserving: set[Request] = set()  # running requests with reserved_seats > 0
        self._num_pending_forks = 0
        self._arrival_seq: dict[str, int] = {}  # tie-breaker for equal arrival times
        self._next_seq = 0
        self._finished_rows: list[str] = []  # finished since the last schedule(), with a row in the runner

        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_swap_ins = 0

    # ------------------------------------------------------------------ request life cycle
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
        if request.status == RequestStatus.RUNNING:
            self._leave_running(request)
        else:
            self.waiting.remove(request)
        self._finish(request, status)
        return request

    def abort_request(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def _leave_running(self, request: Request) -> None:
        self.running.remove(request)
        self._reserving.discard(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
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

    # ------------------------------------------------------------------ ordering helpers
    def _order_key(self, request: Request) -> tuple:
        seq = self._arrival_seq[request.request_id]
        if self.policy == "priority":
            return (request.priority, request.arrival_time, seq)
        return (request.arrival_time, seq)

    def _peek_waiting(self, skip: set[str]) -> Request | None:
        if (self.policy == "fcfs" and not skip
                and (not self.waiting or (_grammar_ready(self.waiting[0]) and not self.waiting[0].held))):
            return self.waiting[0] if self.waiting else None
        # Requests whose grammar still compiles (structured outputs) or that are held (beam search) wait without
        # blocking those behind them.
        candidates = [r for r in self.waiting if r.request_id not in skip and not r.held and _grammar_ready(r)]
        if not candidates:
            return None
        if self.policy == "priority":
            return min(candidates, key=self._order_key)
        return candidates[0]  # FCFS queue; preempted requests were put back at the front

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first, then admissions (see the module docstring); returns the step as a
        diff of the runner's batch (``paged_jax.core.sched_output``)."""
        step = _StepPlan(budget=self.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted:  # the pool is tight after a preemption: admitting would thrash
            self._schedule_waiting(step)
        return self._build_output(step)

    def _preempt(self, victim: Request, step: "_StepPlan") -> None:
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

    def _schedule_running(self, step: "_StepPlan") -> None:
        """Give each running request its tokens (1 when decoding), preempting the least important running request
        while the pool is short (as vLLM: possibly the request itself, which then waits). Runs for every running
        request every step: kept to plain attribute reads and one allocation call per request."""
        running_status = RequestStatus.RUNNING
        kv = self.kv
        allocate_slots = kv.allocate_slots
        planned = step.planned
        budget = step.budget
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not running_status or request.held:  # preempted earlier in this loop / held
                continue
            num_new = (len(request.prompt_token_ids) + len(request.output_token_ids)
                       - request.num_computed_tokens)  # request.num_tokens_to_compute, inlined
            if num_new > budget:
                num_new = budget
            if num_new <= 0:
                continue
            if request.spec_token_ids:
                num_new = self._with_drafts(request, num_new, budget)
            if kv.num_pending_copies >= MAX_BLOCK_COPIES and kv.needs_copy(request):
                continue  # the step's copy-on-write slots are used up: its first write into a shared block waits
            if not allocate_slots(request, num_new):
                step.budget = budget
                while True:
                    victim = max(self.running, key=self._order_key)
                    self._preempt(victim, step)  # returns the budget of a victim planned earlier
                    if victim is request or allocate_slots(request, num_new):
                        break
                budget = step.budget
                if request.status is not running_status:
                    continue
            planned[request.request_id] = (request, num_new)
            budget -= num_new
        step.budget = budget

    def _with_drafts(self, request: Request, num_new: int, budget: int) -> int:
        """Speculative decoding: a decoding request whose row the runner holds computes its drafts with its next
        token, as many as fit the step's budget, ``max_model_len`` (every draft position must be one) and
        ``max_tokens`` (tokens past it would never be kept); any other request drops them. Returns its new-token
        count, drafts included."""
        drafts = request.spec_token_ids
        num_drafts = 0
        if num_new == 1 and request.runner_num_tokens >= 0:
            num_drafts = min(len(drafts), budget - 1, self.max_model_len - request.num_tokens)
            if request.max_tokens is not None:
                num_drafts = min(num_drafts, request.max_tokens - request.num_output_tokens - 1)
        request.spec_token_ids = drafts[:max(num_drafts, 0)]
        return num_new + len(request.spec_token_ids)

    def _schedule_waiting(self, step: "_StepPlan") -> None:
        """Admit waiting requests (FCFS or by priority) while seats, budget and blocks allow."""
        if not self.waiting:
            return
        lora_skipped: set[str] = set()  # waiting requests whose adapter would need a slot the running ones hold
        running_loras = {r.lora_int_id for r in self.running} - {0}
        # Slots kept free for sequences that running requests will fork.
        reserved = sum(r.reserved_seats for r in self._reserving)
        while step.budget > 0 and len(self.running) + reserved < self.max_num_seqs:
            request = self._peek_waiting(lora_skipped.union(step.preempted))  # never re-admit what this step preempted
            if request is None:
                break
            if len(self.running) + reserved + 1 + request.reserved_seats > self.max_num_seqs:
                break  # head-of-line: its forks need slots that running requests hold
            if request.lora_int_id and request.lora_int_id not in running_loras \
                    and len(running_loras) >= self.max_loras:
                lora_skipped.add(request.request_id)
                continue
            num_new = self._admit(request, step)
            if num_new is None:
                break
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            running_loras |= {request.lora_int_id} - {0}
            if request.reserved_seats:
                self._reserving.add(request)
                reserved += request.reserved_seats
            step.planned[request.request_id] = (request, num_new)
            step.budget -= num_new

    def _admit(self, request: Request, step: "_StepPlan") -> int | None:
        """Allocate a waiting request's blocks (swap-in, or its prefix-cache hit plus new blocks), preempting lower
        priorities if the policy allows; returns its new-token count, or None when it cannot start now."""
        if request.status == RequestStatus.SWAPPED:
            num_new = min(request.num_tokens_to_compute, step.budget)
            ok = self.kv.can_swap_in(request, num_new)
            while not ok and self._preempt_lower_priority(request, step):
                ok = self.kv.can_swap_in(request, num_new)
            if not ok:
                return None
            step.swap_in.extend(self.kv.swap_in(request))
            if not self.kv.allocate_slots(request, num_new):  # guaranteed by can_swap_in
                raise RuntimeError("allocation after swap-in failed")
            self.num_swap_ins += 1
            return num_new
        computed_blocks, num_hit = self.kv.get_computed_blocks(request)
        num_new = request.num_tokens - num_hit
        if num_new > step.budget:
            if not self.enable_chunked_prefill:
                return None  # head-of-line: keep FCFS/priority order rather than skipping ahead
            num_new = step.budget
        ok = self.kv.can_allocate(request, num_new, computed_blocks)
        while not ok and self._preempt_lower_priority(request, step):
            ok = self.kv.can_allocate(request, num_new, computed_blocks)
        if not ok:
            return None
        first_admission = request.status == RequestStatus.WAITING
        if not self.kv.allocate_slots(request, num_new, computed_blocks):  # guaranteed by can_allocate
            raise RuntimeError("allocation after can_allocate failed")
        if first_admission:
            request.num_cached_prompt_tokens = min(num_hit, request.num_prompt_tokens)
        return num_new

    def _build_output(self, step: "_StepPlan") -> SchedulerOutput:
        """The step as the runner's diff (``StepBuilder``), fork rows after the request that samples its first
        token."""
        builder = StepBuilder()
        builder.add_rows(step.planned.values())
        finished, self._finished_rows = self._finished_rows, []
        return builder.build(finished_req_ids=finished, preempted_req_ids=step.preempted,
                             block_copies=self.kv.take_block_copies(), swap_out=step.swap_out, swap_in=step.swap_in)

    def _preempt_lower_priority(self, request: Request, step: "_StepPlan") -> bool:
        """policy="priority": preempt the least important running request if it ranks strictly below ``request``."""
        if self.policy != "priority" or not self.running:
            return False
        victim = max(self.running, key=self._order_key)
        if victim.priority <= request.priority:
            return False
        self._preempt(victim, step)
        return True

    # ------------------------------------------------------------------ results
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled_token_ids: Mapping[str, int] | Sequence[int | None],
                           accepted_token_ids: Mapping[str, list[int]] | None = None) -> list[Request]:
        """Apply a step's results; returns the requests that produced a token (finished ones included).

        ``sampled_token_ids``: request_id -> token id, or a sequence aligned with the step's rows (the runner's
        ``StepOutput.sampled_token_ids``; entries of rows that do not sample are ignored). Requests finished or
        aborted since ``schedule()`` are skipped. ``accepted_token_ids``: request_id -> the leading drafts the
        verification kept, for every row of ``scheduler_output.spec_token_ids`` (``_apply_drafts``).
        """
        spec = scheduler_output.spec_token_ids
        if spec and accepted_token_ids is None:
            raise ValueError("update_from_output: the step verified drafts; pass accepted_token_ids")
        requests_of_rows = scheduler_output.requests
        if isinstance(sampled_token_ids, Mapping):
            tokens = [sampled_token_ids.get(r.request_id) for r in requests_of_rows]
        else:
            if len(sampled_token_ids) != len(requests_of_rows):
                raise ValueError(f"sampled_token_ids has {len(sampled_token_ids)} entries, expected "
                                 f"{len(requests_of_rows)} (one per row of the step)")
            tokens = sampled_token_ids
        first_fork = len(requests_of_rows) - len(scheduler_output.fork_rows)
        changed: list[Request] = []
        running_status = RequestStatus.RUNNING
        cache_full_blocks = self.kv.cache_full_blocks
        max_model_len = self.max_model_len
        starts = scheduler_output.row_num_computed_tokens()
        num_scheduled = scheduler_output.num_scheduled_tokens
        # Every running request, every step: the stop rule (``_check_stop``) is inlined for a plain token.
        for row, (request, samples, token) in enumerate(zip(requests_of_rows, scheduler_output.samples, tokens)):
            if request.status is not running_status:  # finished or preempted since schedule() (unregistered then)
                continue  # (a fork row whose parent ended meanwhile: its child was never forked)
            if row < first_fork:
                if request.num_computed_tokens != starts[row]:
                    raise RuntimeError(f"request {request.request_id!r} changed since schedule(): call "
                                       "update_from_output once per schedule(), in order")
                if spec and request.request_id in spec:
                    self._apply_drafts(request, num_scheduled[row], spec[request.request_id],
                                       accepted_token_ids[request.request_id], int(tokens[row]))
                    changed.append(request)
                    continue
                request.num_computed_tokens += num_scheduled[row]
                cache_full_blocks(request)
                if not samples:
                    continue
                if request.pending_forks:  # before the parent's own token (and a stop that would free its blocks)
                    self._fork_pending(request)
            if token is None:
                raise ValueError(f"sampled_token_ids has no token for request {request.request_id!r}")
            token = int(token)
            output_token_ids = request.output_token_ids
            output_token_ids.append(token)
            num_output = len(output_token_ids)
            max_tokens = request.max_tokens
            if ((num_output > request.min_tokens and token >= 0
                 and (token in request.eos_stop_ids or token in request.stop_token_id_set))
                    or (max_tokens is not None and num_output >= max_tokens)
                    or len(request.prompt_token_ids) + num_output >= max_model_len):
                status = self._check_stop(request)
                self._leave_running(request)
                self._finish(request, status)
            elif request.hold_after_sample:
                request.held = True
            changed.append(request)
        return changed

    def _apply_drafts(self, request: Request, num_scheduled: int, drafts: list[int], accepted: list[int],
                      token: int) -> None:
        """A row that verified ``drafts``: its accepted ones and then ``token`` (the target's sample after the last
        accepted one) become outputs one by one, so a stop token or a length limit inside the run ends it there; the
        rejected drafts' K/V is rolled back (not counted as computed: the next step overwrites their slots)."""
        if accepted != drafts[:len(accepted)]:
            raise ValueError(f"accepted tokens of {request.request_id!r} are not a prefix of its drafts")
        request.spec_token_ids = []
        for new_token in (*accepted, token):
            request.output_token_ids.append(new_token)
            status = self._check_stop(request)
            if status is not None:
                self._leave_running(request)
                self._finish(request, status)
                return
        request.num_computed_tokens += num_scheduled - (len(drafts) - len(accepted))
        self.kv.cache_full_blocks(request)

    # ------------------------------------------------------------------ forking (n > 1, best_of, beam search)
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
            self.running.append(child)
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
                parent.reserved_seats or len(self.running) + reserved < self.max_num_seqs):
            self.kv.fork(parent, child)
            child.status = RequestStatus.RUNNING
            self.running.append(child)
            self._use_reserved_seat(parent)
        else:
            child.status = RequestStatus.PREEMPTED
            self.waiting.append(child)

    def replace_last_token(self, request: Request, token: int) -> None:
        """Beam search: make ``token`` the request's last output token (its K/V is not computed yet)."""
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
        if not _stops_on_token(request, token, output_index + 1):
            return
        if request.is_finished:  # by length, already freed
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

    def _check_stop(self, request: Request) -> RequestStatus | None:
        """Stop conditions for the token just appended: a stop token (``_stops_on_token``; never a placeholder,
        whose stop rule ``resolve_placeholder`` applies), else the length limits (max_tokens, max_model_len), which
        always apply."""
        output_token_ids = request.output_token_ids
        num_output = len(output_token_ids)
        token = output_token_ids[-1]
        if token >= 0 and _stops_on_token(request, token, num_output):
            return RequestStatus.FINISHED_STOPPED
        max_tokens = request.max_tokens
        if max_tokens is not None and num_output >= max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if len(request.prompt_token_ids) + num_output >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def stats(self) -> dict[str, float]:
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting + self._num_pending_forks,
            "num_preemptions": self.num_preemptions,
            "num_swap_outs": self.num_swap_outs,
            "num_swap_ins": self.num_swap_ins,
            "kv_cache_usage": self.kv.usage,
            "prefix_cache_queries": self.kv.prefix_cache_queries,
            "prefix_cache_hits": self.kv.prefix_cache_hits,
            "num_gpu_blocks": self.kv.num_blocks,
            "num_cpu_blocks": self.kv.num_host_blocks,
        }


def _stops_on_token(request: Request, token: int, num_output: int) -> bool:
    """Whether ``token``, the ``num_output``-th output token of ``request``, ends it: EOS (unless ignore_eos) or one of
    its stop_token_ids, counted only once more than min_tokens outputs exist. Sets ``request.stop_reason`` when it
    does (the stop token id; None for EOS)."""
    if num_output <= request.min_tokens:
        return False
    if token in request.eos_stop_ids:
        request.stop_reason = None
        return True
    if token in request.stop_token_id_set:
        request.stop_reason = token
        return True
    return False
