"""The scheduler's steady decode path: every running request decodes one token per step, in the same order, while
nothing is admitted, finished, preempted, forked or held (most steps of a full batch).

``update_decodes`` is ``Scheduler.update_from_output`` for a step whose rows all decode one token of a request the
runner holds. ``SteadyDecode`` keeps the running requests' numbers in arrays indexed by their running position (tokens
in the pool, block-table lengths) once such an update left every running request running, unheld: the next
``schedule()`` is then array ops, one block allocated for each row entering a new block (a mask finds them), and the
diff built column-wise (``CachedRequestData``: each row's last sampled token, the crossing rows' new block). Anything
else drops it (``Scheduler._steady``) and the general path runs."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import numpy as np

from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import Request, RequestStatus, check_stop
from paged_jax.core.sched_output import PLACEHOLDER_TOKEN, CachedRequestData, SchedulerOutput

_SPEC_TOKEN_IDS = operator.attrgetter("spec_token_ids")
_HELD = operator.attrgetter("held")
_STOP_IDS = operator.attrgetter("stop_ids")
_LAST = operator.itemgetter(-1)
_NO_BLOCKS: list[int] = []
# Up to this many shared stop ids are screened one compare each: cheaper than ``np.isin``'s set-up.
_COMPARED_STOP_IDS = 8


def update_decodes(requests: Sequence[Request], tokens: Sequence, starts: Sequence[int], kv: KVCacheManager,
                   max_model_len: int, finish: Callable[[Request, RequestStatus], None]) -> list[Request]:
    """Apply a step whose rows all decode one token of a request the runner holds: ``requests`` its rows' requests,
    ``tokens`` their sampled tokens (int or numpy integer; None: missing, a ValueError), ``starts`` their tokens in
    the pool before the step; ``finish(request, status)`` ends a running request. The general update's work for
    such rows: the computed count, newly full blocks into the prefix cache, the token appended, the stop rule
    (``check_stop``) where the token (``Request.stop_ids``) or a length limit may end it. Rows whose request finished
    or was preempted since ``schedule()`` are skipped. Returns the requests that got their token, in row order."""
    changed: list[Request] = []
    add_changed = changed.append
    running = RequestStatus.RUNNING
    cache_full_blocks = kv.cache_full_blocks if kv.enable_prefix_caching else None
    cached_block_counts, block_size = kv.cached_block_counts, kv.block_size
    for request, token, start in zip(requests, tokens, starts):
        if request.status is not running:
            continue
        if request.num_computed_tokens != start:
            raise RuntimeError(f"request {request.request_id!r} changed since schedule(): call update_from_output "
                               "once per schedule(), in order")
        request.num_computed_tokens = start + 1
        if cache_full_blocks is not None and (start + 1) // block_size > cached_block_counts.get(
                request.request_id, 0):  # a block filled up: one step in block_size
            cache_full_blocks(request)
        if type(token) is not int:
            if token is None:
                raise ValueError(f"sampled_token_ids has no token for request {request.request_id!r}")
            token = int(token)
        output_token_ids = request.output_token_ids
        output_token_ids.append(token)
        num_output = len(output_token_ids)
        if (token in request.stop_ids or num_output >= request.max_output_tokens
                or len(request.prompt_token_ids) + num_output >= max_model_len):
            status = check_stop(request, max_model_len)
            if status is not None:
                finish(request, status)
                add_changed(request)
                continue
        if request.hold_after_sample:
            request.held = True
        add_changed(request)
    return changed


def update_decode_step(scheduler, scheduler_output: SchedulerOutput, tokens: Sequence) -> list[Request]:
    """``scheduler.update_from_output`` of a step whose rows all decode one token of a request the runner holds:
    ``SteadyDecode.update`` after a steady step, else ``update_decodes``, after which the steady state may start."""
    steady, kv = scheduler._steady, scheduler.kv
    changed = steady and steady.update(scheduler_output, tokens, kv, scheduler.max_model_len,
                                       scheduler._finish)
    if changed is None:
        scheduler._drop_steady()
        starts = scheduler_output.scheduled_cached_reqs.num_computed_tokens
        changed = update_decodes(scheduler_output.requests, tokens, starts, kv, scheduler.max_model_len,
                                 scheduler._finish)
        scheduler._steady = SteadyDecode.after_update(scheduler_output.requests, scheduler.running, starts, kv,
                                                      bool(scheduler._num_lookahead_tokens), scheduler.max_model_len)
    return changed


class SteadyDecode:
    """The running requests of a steady decode, in running order, each one token ahead of the runner's row.

    Attributes:
      requests: list[Request] the running requests; req_ids / outputs: their ids and ``output_token_ids`` lists.
      num_computed: int64[n] their tokens in the pool; num_blocks: int64[n] their block-table lengths.
      scheduled: the ``SchedulerOutput`` of the last steady step (its update advances the arrays), or None.
    """

    def __init__(self, requests: list[Request], num_computed: np.ndarray, max_model_len: int,
                 block_size: int | None = None):
        self.requests = requests
        self.req_ids = [r.request_id for r in requests]
        self.outputs = [r.output_token_ids for r in requests]
        self.num_computed = num_computed
        self.num_blocks = np.fromiter((len(r.block_ids) for r in requests), np.int64, len(requests))
        self.scheduled: SchedulerOutput | None = None
        # The tokens the last update appended (row order), when none is a placeholder: the next step's decode tokens,
        # read without touching every row's output list.
        self.last_tokens: list[int] | None = None
        # With prefix caching (``block_size``): the rows' tokens of the last ``block_size`` updates (update k's in
        # rows k % block_size and that + block_size: the last block_size updates are consecutive rows) and the
        # updates so far; a filled block is hashed from them rather than from the row's output list. None once a
        # placeholder came (async scheduling puts the real token in the row's list later).
        self.recent = None if block_size is None else np.zeros((2 * block_size, len(requests)), np.int64)
        self.num_updates = 0
        # The rows (int64[k] and their requests) whose block fills at update k for each phase k % block_size: every
        # row advances one token an update, so each row fills its block every block_size updates, in turn.
        self.fill_rows: list[tuple[np.ndarray, list[Request]]] = []
        if block_size is not None:
            phase = (-1 - num_computed) % block_size  # (the update after which the row's count is a multiple)
            splits = np.cumsum(np.bincount(phase, minlength=block_size))[:-1]
            for rows in np.split(np.argsort(phase, kind="stable"), splits):
                self.fill_rows.append((rows, [requests[i] for i in rows.tolist()]))
        # Steps scheduled here whose token the rows' ``Request.runner_num_tokens`` do not count yet (``close``).
        self.runner_lag = 0
        # The stop rule's screen: outputs so far, the count at which a length limit ends each, the stop ids most
        # rows share (sorted list) and the rows with others.
        self.num_output = np.fromiter(map(len, self.outputs), np.int64, len(requests))
        self.output_limit = np.fromiter((min(r.max_output_tokens, max_model_len - len(r.prompt_token_ids))
                                         for r in requests), np.int64, len(requests))
        shared = max(set(map(_STOP_IDS, requests)), key=list(map(_STOP_IDS, requests)).count)
        self.stop_ids = sorted(shared)
        self.own_stop_rows = [i for i, r in enumerate(requests) if r.stop_ids != shared]

    def close(self) -> None:
        """Add the steps scheduled here to every row's ``runner_num_tokens`` (a row the runner still holds): the
        scheduler's general path reads them. Called when the scheduler leaves this state."""
        lag, self.runner_lag = self.runner_lag, 0
        if lag:
            for request in self.requests:
                if request.runner_num_tokens >= 0:
                    request.runner_num_tokens += lag

    @staticmethod
    def after_update(requests: list[Request], running: list[Request], starts: Sequence[int],
                     kv: KVCacheManager, lookahead: bool, max_model_len: int) -> "SteadyDecode | None":
        """The steady state after a decode-only update of ``requests`` (rows with tokens in the pool ``starts``
        before it), if it is one: the rows were every running request in running order, all still running and
        unheld, none constrained by a grammar; one KV-cache group without a sliding window, no lookahead slots."""
        if (not requests or lookahead or kv.num_groups != 1 or kv.has_sliding_window or requests != running
                or any(map(_HELD, requests)) or any(r.grammar is not None for r in requests)):
            return None
        return SteadyDecode(list(requests), np.asarray(starts, np.int64) + 1, max_model_len,
                            kv.block_size if kv.enable_prefix_caching else None)

    def update(self, scheduler_output: SchedulerOutput, tokens: Sequence, kv: KVCacheManager, max_model_len: int,
               finish: Callable[[Request, RequestStatus], None]) -> list[Request] | None:
        """``update_decodes`` of the last steady step (``scheduled``), with the arrays: every request gets its token
        (nothing changed since ``schedule``: any change dropped this state), the stop rule runs only for rows whose
        token may stop them (``stop_ids``, one set shared by most rows) or that reached a length limit; blocks are
        cached for the rows that filled one. None (nothing done) for another step or tokens that are not all ints."""
        if scheduler_output is not self.scheduled:
            return None
        if len(tokens) != len(self.requests):
            return None
        try:  # (a typed read of the list: several times faster than ``np.asarray``'s)
            sampled = np.fromiter(tokens, np.int64, len(tokens))
        except (TypeError, ValueError):  # a token that is no integer (None: missing)
            return None
        self.scheduled = None
        requests = self.requests
        tokens = sampled.tolist()
        # (a placeholder, async scheduling, may be replaced in the row's list before the next step: read it there)
        self.last_tokens = None if PLACEHOLDER_TOKEN in tokens else tokens  # (no numpy reduction: cheaper)
        if self.last_tokens is None:
            self.recent = None
        self.num_computed += 1
        for request, output_token_ids, token, num_computed in zip(requests, self.outputs, tokens,
                                                                  self.num_computed.tolist()):
            request.num_computed_tokens = num_computed
            output_token_ids.append(token)
        if kv.enable_prefix_caching:
            self._cache_filled_blocks(kv, sampled)
        self.num_output += 1
        may_stop = self.num_output >= self.output_limit
        if len(self.stop_ids) > _COMPARED_STOP_IDS:
            may_stop |= np.isin(sampled, self.stop_ids)
        else:
            for stop_id in self.stop_ids:
                may_stop |= sampled == stop_id
        for i in self.own_stop_rows:
            may_stop[i] |= tokens[i] in requests[i].stop_ids
        changed = list(requests)
        for i in np.flatnonzero(may_stop).tolist():
            status = check_stop(requests[i], max_model_len)
            if status is not None:
                finish(requests[i], status)  # drops this state (Scheduler._leave_running)
        return changed

    def _cache_filled_blocks(self, kv: KVCacheManager, sampled: np.ndarray) -> None:
        """Register the blocks the rows just filled (``KVCacheManager.cache_filled_blocks``), with their tokens from
        ``recent`` where it holds the whole block; then put the rows' new tokens ``sampled`` int64[n] in it."""
        recent, block_size, num_updates = self.recent, kv.block_size, self.num_updates
        phase = num_updates % block_size
        filled, requests = self.fill_rows[phase]
        if requests:
            if recent is not None and num_updates >= block_size:  # each filled block's tokens came in the updates
                # (the last block_size updates' tokens: rows phase .. phase + block_size, oldest first)
                kv.cache_filled_blocks(requests, recent[phase:phase + block_size, filled].T)
            else:
                kv.cache_filled_blocks(requests)
        if recent is not None:
            recent[phase] = recent[phase + block_size] = sampled
        self.num_updates = num_updates + 1

    def step(self, scheduler, budget: int, seats: int) -> SchedulerOutput | None:
        """``schedule()`` while steady: None when a waiting request could take a seat (admission is the general
        path's) or ``schedule`` declines; else the step with what the scheduling pass collected besides its rows
        (rows finished since the last step, the KV-cache manager's copies: ``Scheduler._build_output``'s)."""
        reserved = sum(r.reserved_seats for r in scheduler._reserving)
        if scheduler.waiting and len(scheduler.running) + reserved < seats:
            return None
        kv = scheduler.kv
        output = self.schedule(kv, budget, seats)
        if output is not None:
            output.finished_req_ids, scheduler._finished_rows = scheduler._finished_rows, []
            output.block_copies = kv.take_block_copies()
            output.swap_out, output.swap_in = kv.take_offload_copies()
        return output

    def schedule(self, kv: KVCacheManager, budget: int, seats: int) -> SchedulerOutput | None:
        """The next step (one token per request), or None (changing nothing) when it is not a steady one: drafts to
        verify, budget or seats short, or too few free blocks for the rows entering a new block."""
        requests = self.requests
        n = len(requests)
        if n > budget or n > seats or any(map(_SPEC_TOKEN_IDS, requests)):
            return None
        crossing = np.flatnonzero((self.num_computed + kv.block_size) // kv.block_size > self.num_blocks)
        if len(crossing) > kv.num_free_blocks:
            return None
        # One empty list for every row without new blocks (read-only, as the whole diff): no allocation per row.
        new_block_ids: list[list[int]] = [_NO_BLOCKS] * n
        block_starts = self.num_blocks.tolist()
        if len(crossing):  # each row writes its next token into a block of its own: one new block each
            self.num_blocks[crossing] += 1
            rows = crossing.tolist()
            crossing_requests = [requests[i] for i in rows]
            for i, request, block_id, num_blocks in zip(rows, crossing_requests,
                                                         kv.append_new_blocks(crossing_requests),
                                                         self.num_blocks[crossing].tolist()):
                new_block_ids[i] = [block_id]
                request.runner_num_blocks = num_blocks
        self.runner_lag += 1  # each row gets its last sampled token (below)
        last_tokens, self.last_tokens = self.last_tokens, None
        cached = CachedRequestData(list(self.req_ids), [], new_block_ids, block_starts, self.num_computed.tolist(),
                                   decode_token_ids=last_tokens or list(map(_LAST, self.outputs)))
        self.scheduled = SchedulerOutput(
            scheduled_cached_reqs=cached, scheduled_new_reqs=[], num_scheduled_tokens=[1] * n, fork_rows=[],
            finished_req_ids=[], preempted_req_ids=[], block_copies=[], swap_out=[], swap_in=[], grammars={},
            requests=list(requests), samples=[True] * n)
        return self.scheduled
