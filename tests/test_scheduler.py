"""Scheduler: budgets, chunked prefill, prefix-cache admission, preemption (recompute / swap), priority, stop rules,
abort; driven by a fake model runner that keeps a simulated KV pool and checks that no sequence ever reads K/V that
is not its own."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from paged_jax.core.kv_cache_manager import NULL_BLOCK_ID, KVCacheManager
from paged_jax.core.request import Request, RequestStatus
from paged_jax.core.scheduler import Scheduler, SchedulerOutput

VOCAB = 50
_MOD = (1 << 61) - 1


@dataclasses.dataclass
class Params:
    max_tokens: int | None = 8
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None


def prefix_states(tokens: list[int]) -> list[int]:
    """What a correct K/V entry at position p holds in the simulation: a rolling hash of tokens[0..p]."""
    states, h = [], 17
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % _MOD
        states.append(h)
    return states


class FakeRunner:
    """Plays the model runner: a device pool ``[num_blocks, block_size]`` and a host pool of int64 "K/V" entries.

    Like the real runner it sees only the step's diff (``SchedulerOutput``): it keeps a mirror of each request's row
    (the tokens and block table the diffs built), and checks that mirror against the scheduler's ``Request`` (so the
    diff contract itself is checked). Each step it drops finished and preempted rows, applies the diff, applies swap
    and block copies in the documented order, writes the entries of the new tokens (derived from the mirrored token
    ids, at the positions the step says), reads back every position < kv_len through the mirrored block table and
    checks it against the true prefix state, and samples a token that depends only on what it read. So a request's
    outputs are a pure function of its prompt iff the bookkeeping is right.
    """

    def __init__(self, kv: KVCacheManager, max_num_seqs: int) -> None:
        self.block_size = kv.block_size
        self.max_num_seqs = max_num_seqs
        self.device = np.full((kv.num_blocks, kv.block_size), -1, dtype=np.int64)
        self.host = np.full((max(kv.num_host_blocks, 1), kv.block_size), -1, dtype=np.int64)
        self.max_seqs_seen = 0
        self.tokens: dict[str, list[int]] = {}  # the runner's rows: tokens and block table per request id
        self.tables: dict[str, list[int]] = {}

    def _add_row(self, new) -> None:
        assert new.req_id not in self.tokens, f"{new.req_id} sent as new but the runner holds its row"
        self.tokens[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
        self.tables[new.req_id] = list(new.block_ids)

    def apply_diff(self, out: SchedulerOutput) -> None:
        """What ``InputBatch`` does with a step's diff."""
        for req_id in out.finished_req_ids:
            assert req_id in self.tokens, f"{req_id} finished but the runner holds no row for it"
            del self.tokens[req_id], self.tables[req_id]
        for req_id in out.preempted_req_ids:  # (a request admitted and preempted in one step holds none)
            self.tokens.pop(req_id, None)
            self.tables.pop(req_id, None)
        cached = out.scheduled_cached_reqs
        for req_id, new_tokens, new_blocks, block_start in zip(cached.req_ids, cached.tokens_of_rows(),
                                                               cached.new_block_ids, cached.block_starts):
            assert req_id in self.tokens, f"{req_id} sent as running but the runner holds no row for it"
            self.tokens[req_id] += new_tokens
            if new_blocks:
                table = self.tables[req_id]
                assert block_start <= len(table)
                self.tables[req_id] = table[:block_start] + list(new_blocks)
        for new in out.scheduled_new_reqs:
            self._add_row(new)
        for child, _ in out.fork_rows:
            self._add_row(child)
        assert len(self.tokens) <= self.max_num_seqs, "more rows than the runner's batch holds"

    def apply_diff_and_copies(self, out: SchedulerOutput) -> None:
        """The diff, then the swaps and the copy-on-write copies, in the runner's order."""
        self.apply_diff(out)
        for dev, host in out.swap_out:
            self.host[host] = self.device[dev]
        for host, dev in out.swap_in:
            self.device[dev] = self.host[host]
        for src, dst in out.block_copies:
            self.device[dst] = self.device[src]

    def step(self, out: SchedulerOutput) -> dict[str, int]:
        self.apply_diff_and_copies(out)
        cached = out.scheduled_cached_reqs
        rows = out.scheduled_rows()
        num_forks = len(out.fork_rows)
        # Row order: the cached requests, then the new ones, then the fork rows.
        assert [r.request_id for r in rows] == out.row_req_ids()
        num_request_rows = len(cached.req_ids) + len(out.scheduled_new_reqs)
        assert len(out.num_scheduled_tokens) == num_request_rows == len(rows) - num_forks
        assert all(n >= 1 for n in out.num_scheduled_tokens)
        assert out.total_num_scheduled_tokens == sum(r.num_new_tokens for r in rows)
        assert [r.request_id for r in rows[len(rows) - num_forks:]] == [child.req_id for child, _ in out.fork_rows]
        assert all(r.num_new_tokens == 0 and r.num_computed_tokens == 0 and r.samples
                   for r in rows[len(rows) - num_forks:])
        self.max_seqs_seen = max(self.max_seqs_seen, len(rows))
        bs = self.block_size
        # The rows as the runner sees them match the scheduler's requests.
        for r in rows:
            known = r.request.all_token_ids
            tokens, table = self.tokens[r.request_id], self.tables[r.request_id]
            assert tokens == known, f"{r.request_id}: the runner's tokens {tokens} are not the request's {known}"
            if not r.request.is_finished:  # (aborted between schedule() and the step: its blocks are freed)
                assert table == r.request.block_ids, f"{r.request_id}: the runner's block table is not the request's"
            kv_len = r.num_computed_tokens + r.num_new_tokens
            if r.fork_parent is None:  # the runner samples a row whose step reaches the end of its tokens
                assert r.samples == (kv_len == len(tokens)), r.request_id
            assert NULL_BLOCK_ID not in table
            assert len(table) >= -(-kv_len // bs)
        # Write every sequence's new K/V first (as a forward pass does, layer by layer), then read.
        for r in rows:
            kv_len = r.num_computed_tokens + r.num_new_tokens
            table = self.tables[r.request_id]
            # The entry at p depends on tokens[0..p]; tokens before num_computed_tokens come from the request's own
            # history, which the pool must already hold (checked below).
            states = prefix_states(self.tokens[r.request_id][:kv_len])
            for p in range(r.num_computed_tokens, kv_len):
                self.device[table[p // bs], p % bs] = states[p]
        sampled, last_read = {}, {}
        for r in rows:
            if r.fork_parent is not None:  # samples from its parent's last position of this step
                sampled[r.request_id] = last_read[r.fork_parent] % VOCAB
                continue
            kv_len = r.num_computed_tokens + r.num_new_tokens
            table = self.tables[r.request_id]
            states = prefix_states(r.request.all_token_ids[:kv_len])
            read = [int(self.device[table[p // bs], p % bs]) for p in range(kv_len)]
            assert read == states, f"{r.request_id} read K/V that is not its own"
            last_read[r.request_id] = read[-1]
            if r.samples:
                sampled[r.request_id] = read[-1] % VOCAB
        return sampled


def run_to_completion(sched: Scheduler, runner: FakeRunner, arrivals: dict[int, list[Request]] | None = None,
                      max_steps: int = 2000) -> list[SchedulerOutput]:
    outputs = []
    arrivals = dict(arrivals or {})
    step = 0
    while sched.has_unfinished_requests() or arrivals:
        for r in arrivals.pop(step, []):
            sched.add_request(r)
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        assert out.num_rows <= sched.max_num_seqs
        sampled = runner.step(out)
        # Every row the runner holds is an unfinished request's (or a child forked this step).
        assert set(runner.tokens) <= set(sched.requests) | {child.req_id for child, _ in out.fork_rows}
        sched.update_from_output(out, sampled)
        outputs.append(out)
        step += 1
        assert step < max_steps, "no progress"
    # The next step drops the rows of the requests that finished last: the runner's batch ends empty.
    out = sched.schedule()
    assert not out.has_rows
    runner.step(out)
    assert not runner.tokens
    return outputs


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64,
                   num_host_blocks=0, prefix=True, **kw) -> tuple[Scheduler, FakeRunner]:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix, num_host_blocks=num_host_blocks)
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, max_model_len, **kw), FakeRunner(kv, max_num_seqs)


def make_request(rid, prompt, max_tokens=8, priority=0, arrival=None, eos=(), **params) -> Request:
    kw = {} if arrival is None else {"arrival_time": arrival}
    return Request(rid, list(prompt), Params(max_tokens=max_tokens, **params), eos_token_ids=frozenset(eos),
                   priority=priority, **kw)


def outputs_alone(prompts: dict[str, list[int]], max_tokens: dict[str, int]) -> dict[str, list[int]]:
    """Reference: each request run by itself with a big pool."""
    ref = {}
    for rid, prompt in prompts.items():
        sched, runner = make_scheduler(num_blocks=256, max_num_batched_tokens=64)
        r = make_request(rid, prompt, max_tokens=max_tokens[rid])
        sched.add_request(r)
        run_to_completion(sched, runner)
        ref[rid] = r.output_token_ids
    return ref


def test_constructor_and_add_request_validation() -> None:
    kv = KVCacheManager(8, 4)
    with pytest.raises(ValueError, match="max_model_len"):
        Scheduler(kv, 4, 16, max_model_len=64)  # 16 blocks needed, 7 usable
    with pytest.raises(ValueError, match="preemption_mode"):
        Scheduler(kv, 4, 16, 16, preemption_mode="drop")
    with pytest.raises(ValueError, match="policy"):
        Scheduler(kv, 4, 16, 16, policy="lifo")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(kv, 4, 8, 16, enable_chunked_prefill=False)
    sched = Scheduler(kv, 4, 16, 16)
    with pytest.raises(ValueError, match="prompt"):
        sched.add_request(make_request("long", range(17)))
    sched.add_request(make_request("a", [1]))
    with pytest.raises(ValueError, match="request_id"):
        sched.add_request(make_request("a", [1]))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        make_request("empty", [])


def test_chunked_prefill_respects_budget_and_decodes_go_first() -> None:
    sched, runner = make_scheduler(max_num_batched_tokens=10, max_model_len=64)
    a = make_request("a", range(1, 4), max_tokens=20)
    b = make_request("b", range(1, 4), max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert [(s.request_id, s.num_new_tokens, s.samples) for s in out.scheduled_rows()] == [("a", 3, True),
                                                                                           ("b", 3, True)]
    sched.update_from_output(out, runner.step(out))
    long_prompt = make_request("long", range(100, 130), max_tokens=2)  # 30 tokens, budget 10
    sched.add_request(long_prompt)
    chunks = []
    while long_prompt.num_output_tokens == 0:
        out = sched.schedule()
        # The two running streams decode every step and come first; the long prompt gets the rest of the budget.
        rows = out.scheduled_rows()
        assert [s.request_id for s in rows] == ["a", "b", "long"]
        chunk = rows[2]
        assert sum(s.num_new_tokens == 1 for s in rows) == 2
        assert out.total_num_scheduled_tokens == 2 + chunk.num_new_tokens <= 10
        chunks.append((chunk.num_computed_tokens, chunk.num_new_tokens, chunk.samples))
        sched.update_from_output(out, runner.step(out))
    assert chunks == [(0, 8, False), (8, 8, False), (16, 8, False), (24, 6, True)]
    run_to_completion(sched, runner)
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks


def test_no_chunked_prefill_is_head_of_line() -> None:
    sched, runner = make_scheduler(max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
    sched.add_request(make_request("a", range(40), max_tokens=3))
    sched.add_request(make_request("b", range(100, 130), max_tokens=3))  # 40 + 30 > 64: waits whole
    out = sched.schedule()
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled_rows()] == [("a", 40)]
    sched.update_from_output(out, runner.step(out))
    out = sched.schedule()
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled_rows()] == [("a", 1), ("b", 30)]


def test_max_num_seqs() -> None:
    sched, runner = make_scheduler(max_num_seqs=2)
    reqs = [make_request(f"r{i}", [i + 1, 2, 3], max_tokens=3) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched, runner)
    assert runner.max_seqs_seen == 2
    assert all(r.num_output_tokens == 3 and r.finish_reason == "length" for r in reqs)


def test_prefix_cache_admission_and_sharing() -> None:
    sched, runner = make_scheduler(num_blocks=64, block_size=4)
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks
    a = make_request("a", prompt, max_tokens=5)
    sched.add_request(a)
    sched.update_from_output(out := sched.schedule(), runner.step(out))
    b = make_request("b", prompt, max_tokens=5)  # e.g. the second of n=2 samples
    sched.add_request(b)
    out = sched.schedule()
    seq_b = next(s for s in out.scheduled_rows() if s.request_id == "b")
    assert (seq_b.num_computed_tokens, seq_b.num_new_tokens) == (8, 2)
    assert b.num_cached_prompt_tokens == 8
    assert b.block_ids[:2] == a.block_ids[:2]
    assert [sched.kv.blocks[i].ref_cnt for i in a.block_ids[:2]] == [2, 2]
    sched.update_from_output(out, runner.step(out))
    run_to_completion(sched, runner)
    assert a.output_token_ids == b.output_token_ids  # same prompt, deterministic fake sampler
    assert sched.kv.prefix_cache_hits == 8 and sched.kv.prefix_cache_queries == 20
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("long_threshold", [0, 5])  # 5: long prefills go after admissions (tests/test_fairness.py)
def test_preemption_under_tiny_pool_gives_same_outputs(mode: str, prefix: bool, long_threshold: int) -> None:
    rng = random.Random(0)
    shared = [rng.randrange(1, VOCAB) for _ in range(8)]
    prompts, max_tokens = {}, {}
    for i in range(6):
        # Some prompts share a prefix, so prefix hits and preemption interact.
        own = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 14))]
        prompts[f"r{i}"] = (shared if i % 2 else []) + own
        max_tokens[f"r{i}"] = rng.randrange(6, 16)
    ref = outputs_alone(prompts, max_tokens)
    # 10 usable blocks of 4 tokens: far less than the ~6 x 7 blocks the requests need together.
    sched, runner = make_scheduler(num_blocks=11, block_size=4, max_num_batched_tokens=12, max_model_len=40,
                                   num_host_blocks=6, prefix=prefix, preemption_mode=mode,
                                   long_prefill_token_threshold=long_threshold)
    reqs = {rid: make_request(rid, p, max_tokens=max_tokens[rid]) for rid, p in prompts.items()}
    arrivals = {0: [reqs["r0"], reqs["r1"], reqs["r2"]], 3: [reqs["r3"]], 5: [reqs["r4"], reqs["r5"]]}
    outs = run_to_completion(sched, runner, arrivals)
    assert sched.num_preemptions > 0
    if mode == "swap":
        assert any(o.swap_out for o in outs) and any(o.swap_in for o in outs)
        assert sched.num_swap_outs > 0
    else:
        assert not any(o.swap_out for o in outs)
    for rid, r in reqs.items():
        assert r.output_token_ids == ref[rid], rid
        assert r.finish_reason == "length"
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks
    assert sched.kv.num_free_host_blocks == sched.kv.num_host_blocks


def run_random_workload(sched: Scheduler, runner: FakeRunner, seed: int) -> list[Request]:
    """300 steps of random arrivals (prompts of at most 11 tokens) and aborts, then the rest to completion; returns
    every request."""
    rng = random.Random(seed)
    all_reqs = []
    for step in range(300):
        if rng.random() < 0.3:
            prompt = [rng.randrange(1, 6) for _ in range(rng.randrange(1, 12))]  # small vocab: many prefix hits
            r = make_request(f"q{step}", prompt, max_tokens=rng.randrange(1, 10), priority=rng.randrange(3),
                             eos={0}, min_tokens=rng.randrange(2))
            sched.add_request(r)
            all_reqs.append(r)
        if rng.random() < 0.05 and sched.requests:
            sched.abort_request(rng.choice(sorted(sched.requests)))
        out = sched.schedule()
        sched.update_from_output(out, runner.step(out))
    run_to_completion(sched, runner)
    return all_reqs


@pytest.mark.parametrize("long_threshold", [0, 4])
def test_random_workload_with_aborts_never_leaks(long_threshold: int) -> None:
    sched, runner = make_scheduler(num_blocks=13, block_size=2, max_num_batched_tokens=9, max_model_len=24,
                                   max_num_seqs=4, num_host_blocks=5, preemption_mode="swap", policy="priority",
                                   long_prefill_token_threshold=long_threshold)
    all_reqs = run_random_workload(sched, runner, seed=1)
    assert all(r.is_finished for r in all_reqs)
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks
    assert sched.kv.num_free_host_blocks == sched.kv.num_host_blocks
    assert all(b.ref_cnt == 0 for b in sched.kv.blocks)
    assert sched.num_preemptions > 0 and sched.kv.prefix_cache_hits > 0


def test_priority_policy_order() -> None:
    sched, runner = make_scheduler(max_num_seqs=1, policy="priority")
    reqs = [make_request("low", [1, 2], priority=5, arrival=0.0, max_tokens=1),
            make_request("high_late", [1, 3], priority=0, arrival=2.0, max_tokens=1),
            make_request("high_early", [1, 4], priority=0, arrival=1.0, max_tokens=1),
            make_request("mid", [1, 5], priority=1, arrival=0.5, max_tokens=1)]
    for r in reqs:
        sched.add_request(r)
    order = [o.scheduled_rows()[0].request_id for o in run_to_completion(sched, runner)]
    assert order == ["high_early", "high_late", "mid", "low"]


def test_fcfs_policy_ignores_priority() -> None:
    sched, runner = make_scheduler(max_num_seqs=1, policy="fcfs")
    for rid, prio in (("first", 9), ("second", 0)):
        sched.add_request(make_request(rid, [1, 2], priority=prio, max_tokens=1))
    assert [o.scheduled_rows()[0].request_id for o in run_to_completion(sched, runner)] == ["first", "second"]


def test_preemption_victim_is_least_important() -> None:
    # 6 usable blocks of 2 tokens; three requests of 4 prompt tokens (2 blocks each) fill the pool.
    for policy, expected_victim in (("fcfs", "c"), ("priority", "a")):
        sched, runner = make_scheduler(num_blocks=7, block_size=2, max_model_len=12, policy=policy)
        for rid, prio in (("a", 2), ("b", 0), ("c", 1)):
            sched.add_request(make_request(rid, [ord(rid), 1, 2, 3], priority=prio, max_tokens=6))
        sched.update_from_output(out := sched.schedule(), runner.step(out))
        assert sched.kv.num_free_blocks == 0
        out = sched.schedule()  # each decode (position 4) needs a new block
        assert out.preempted_req_ids[0] == expected_victim
        assert sched.requests[expected_victim].status == RequestStatus.PREEMPTED
        assert sched.requests[expected_victim].num_computed_tokens == 0
        assert expected_victim not in [s.request_id for s in out.scheduled_rows()]
        sched.update_from_output(out, runner.step(out))
        run_to_completion(sched, runner)


def test_priority_preempts_lower_priority_running_for_waiting() -> None:
    sched, runner = make_scheduler(num_blocks=5, block_size=2, max_model_len=8, policy="priority")
    low = make_request("low", [1, 2, 3, 4, 5], priority=3, max_tokens=3)
    sched.add_request(low)
    sched.update_from_output(out := sched.schedule(), runner.step(out))
    high = make_request("high", [6, 7, 8, 9, 10], priority=0, max_tokens=3)  # 3 blocks; only 1 free
    sched.add_request(high)
    out = sched.schedule()
    assert out.preempted_req_ids == ["low"] and [s.request_id for s in out.scheduled_rows()] == ["high"]
    sched.update_from_output(out, runner.step(out))
    run_to_completion(sched, runner)
    assert high.num_output_tokens == 3 and low.num_output_tokens == 3


def test_abort_in_every_state_frees_blocks() -> None:
    sched, runner = make_scheduler(num_blocks=9, block_size=2, max_num_batched_tokens=6, max_model_len=16,
                                   num_host_blocks=8, preemption_mode="swap")
    kv = sched.kv
    waiting = make_request("waiting", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], max_tokens=4)
    sched.add_request(waiting)
    assert sched.abort_request("waiting") is waiting and waiting.finish_reason == "abort"
    assert sched.abort_request("waiting") is None  # already gone

    prefilling = make_request("prefilling", range(1, 11), max_tokens=4)
    sched.add_request(prefilling)
    sched.update_from_output(out := sched.schedule(), runner.step(out))
    assert prefilling.status == RequestStatus.RUNNING and 0 < prefilling.num_computed_tokens < 10
    sched.abort_request("prefilling")
    assert kv.num_free_blocks == kv.num_usable_blocks and not sched.has_unfinished_requests()

    # Fill the pool so that decoding preempts (swap) the later request.
    a = make_request("a", range(20, 27), max_tokens=6)  # 7 tokens: 4 blocks
    b = make_request("b", range(30, 37), max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    while b.status != RequestStatus.SWAPPED:
        out = sched.schedule()
        sched.update_from_output(out, runner.step(out))
    assert b.host_block_ids and kv.num_free_host_blocks < kv.num_host_blocks
    sched.abort_request("b")
    assert kv.num_free_host_blocks == kv.num_host_blocks and b.block_ids == [] and b.host_block_ids == []
    assert a.status == RequestStatus.RUNNING and a.num_output_tokens > 0  # decoding
    # Abort between schedule() and update_from_output(): the stale result is ignored.
    out = sched.schedule()
    sched.abort_request("a")
    assert sched.update_from_output(out, runner.step(out)) == []
    assert kv.num_free_blocks == kv.num_usable_blocks and not sched.has_unfinished_requests()

    # Recompute-preempted request.
    sched2, runner2 = make_scheduler(num_blocks=7, block_size=2, max_model_len=12)
    reqs = [make_request(rid, [ord(rid), 1, 2, 3], max_tokens=6) for rid in "abc"]
    for r in reqs:
        sched2.add_request(r)
    while not sched2.num_preemptions:
        out = sched2.schedule()
        sched2.update_from_output(out, runner2.step(out))
    victim = next(r for r in reqs if r.status == RequestStatus.PREEMPTED)
    sched2.abort_request(victim.request_id)
    assert victim.finish_reason == "abort" and victim.block_ids == []
    for r in reqs:
        sched2.abort_request(r.request_id)
    assert sched2.kv.num_free_blocks == sched2.kv.num_usable_blocks


def _generate(sched, runner, request, tokens: list[int]) -> list[int]:
    """Feed the given sampled tokens one step at a time until the request finishes."""
    sched.add_request(request)
    feed = iter(tokens)
    while not request.is_finished:
        out = sched.schedule()
        runner.step(out)
        sched.update_from_output(out, {s.request_id: next(feed) for s in out.scheduled_rows() if s.samples})
    return request.output_token_ids


def test_stop_conditions() -> None:
    def fresh():
        return make_scheduler(max_model_len=16)

    sched, runner = fresh()
    r = make_request("eos", [1, 2], max_tokens=10, eos={7})
    assert _generate(sched, runner, r, [3, 7, 4]) == [3, 7] and r.finish_reason == "stop" and r.stop_reason is None

    r = make_request("min", [1, 2], max_tokens=10, eos={7}, min_tokens=2)
    assert _generate(sched, runner, r, [7, 7, 7, 5]) == [7, 7, 7] and r.finish_reason == "stop"

    r = make_request("ignore", [1, 2], max_tokens=3, eos={7}, ignore_eos=True)
    assert _generate(sched, runner, r, [7, 7, 7, 7]) == [7, 7, 7] and r.finish_reason == "length"

    r = make_request("stop_id", [1, 2], max_tokens=10, stop_token_ids=[9], min_tokens=1)
    assert _generate(sched, runner, r, [9, 4, 9, 4]) == [9, 4, 9] and r.finish_reason == "stop"
    assert r.stop_reason == 9

    r = make_request("len", [1, 2], max_tokens=2)
    assert _generate(sched, runner, r, [4, 4, 4]) == [4, 4] and r.finish_reason == "length"

    r = make_request("model_len", range(1, 14), max_tokens=None)  # 13 prompt tokens, max_model_len 16
    assert _generate(sched, runner, r, [4] * 10) == [4, 4, 4] and r.finish_reason == "length"
    assert r.num_tokens == 16
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks


def _generate_with_placeholders(sched, runner, request, tokens: list[int]) -> list[int]:
    """``_generate`` as async scheduling drives it: each step appends a placeholder (-1) that is resolved to the real
    token afterwards (before the next step is built, so the fake runner reads real tokens)."""
    sched.add_request(request)
    feed = iter(tokens)
    while not request.is_finished:
        out = sched.schedule()
        runner.step(out)
        for changed in sched.update_from_output(out, {s.request_id: -1 for s in out.scheduled_rows() if s.samples}):
            sched.resolve_placeholder(changed, changed.num_output_tokens - 1, next(feed))
    return request.output_token_ids


@pytest.mark.parametrize("case", ["eos", "min", "ignore", "stop_id", "len", "len_and_stop", "model_len"])
def test_resolve_placeholder_applies_the_same_stop_rules(case: str) -> None:
    cases = {
        "eos": (dict(max_tokens=10, eos={7}), [3, 7, 4]),
        "min": (dict(max_tokens=10, eos={7}, min_tokens=2), [7, 7, 7, 5]),
        "ignore": (dict(max_tokens=3, eos={7}, ignore_eos=True), [7, 7, 7, 7]),
        "stop_id": (dict(max_tokens=10, stop_token_ids=[9], min_tokens=1), [9, 4, 9, 4]),
        "len": (dict(max_tokens=2), [4, 4, 4]),
        "len_and_stop": (dict(max_tokens=2, stop_token_ids=[9]), [4, 9, 4]),  # the stop token wins over length
        "model_len": (dict(max_tokens=None), [4] * 10),
    }
    params, tokens = cases[case]
    prompt = list(range(1, 14)) if case == "model_len" else [1, 2]
    results = []
    for generate in (_generate, _generate_with_placeholders):
        sched, runner = make_scheduler(max_model_len=16)
        r = make_request(case, prompt, **params)
        outputs = generate(sched, runner, r, tokens)
        results.append((outputs, r.finish_reason, r.stop_reason, sched.kv.num_free_blocks))
        assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks
    assert results[0] == results[1]
    if case == "len_and_stop":
        assert results[1][1:3] == ("stop", 9)


def test_finish_request_for_stop_strings() -> None:
    sched, runner = make_scheduler()
    r = make_request("s", [1, 2, 3], max_tokens=10)
    sched.add_request(r)
    sched.update_from_output(out := sched.schedule(), runner.step(out))
    assert sched.finish_request("s", "stop") is r
    assert r.finish_reason == "stop" and r.block_ids == [] and not sched.has_unfinished_requests()
    with pytest.raises(ValueError, match="reason"):
        sched.finish_request("s", "bogus")


def test_update_from_output_accepts_aligned_list_and_checks_order() -> None:
    sched, runner = make_scheduler()
    r1, r2 = make_request("x", [1, 2], max_tokens=4), make_request("y", [3, 4], max_tokens=4)
    sched.add_request(r1)
    sched.add_request(r2)
    out = sched.schedule()
    changed = sched.update_from_output(out, [11, 12])
    assert changed == [r1, r2] and r1.output_token_ids == [11] and r2.output_token_ids == [12]
    with pytest.raises(RuntimeError, match="once per schedule"):
        sched.update_from_output(out, [11, 12])
    out = sched.schedule()
    with pytest.raises(ValueError, match="sampled_token_ids"):
        sched.update_from_output(out, [1])
