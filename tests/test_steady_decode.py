"""The scheduler's steady decode path (``paged_jax.core.steady_decode``) against its general path: the same workload
(arrivals, EOS / stop tokens / min_tokens / max_tokens, aborts, a pool small enough to preempt) through a scheduler
with the steady path and one without must give the same steps (every diff field) and the same updates."""

from __future__ import annotations

import random
import types

import pytest

from paged_jax.core import steady_decode
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import Request
from paged_jax.core.scheduler import Scheduler

EOS = 2


def _params(rng: random.Random):
    return types.SimpleNamespace(max_tokens=rng.choice([None, 5, 30, 60]), min_tokens=rng.choice([0, 0, 3]),
                                 ignore_eos=rng.random() < 0.5,
                                 stop_token_ids=rng.choice([None, None, [7], [8, 9], list(range(40, 50))]))


def _run(seed: int, steady: bool, monkeypatch, num_steps: int = 160) -> list:
    """A trace of every step's diff and update under a seeded workload."""
    with monkeypatch.context() as patch:
        if not steady:
            patch.setattr(steady_decode.SteadyDecode, "after_update", staticmethod(lambda *args: None))
        rng = random.Random(seed)
        kv = KVCacheManager(num_blocks=rng.choice([40, 400]), block_size=4, enable_prefix_caching=rng.random() < 0.7)
        scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=120)
        trace, next_id, steady_steps = [], 0, 0
        for step in range(num_steps):
            if rng.random() < 0.08 or step == 0:
                for _ in range(rng.randint(1, 6)):
                    prompt = [rng.randrange(3, 50) for _ in range(rng.randint(1, 20))]
                    scheduler.add_request(Request(f"r{next_id}", prompt, params=_params(rng), eos_token_ids=[EOS]))
                    next_id += 1
            if scheduler.running and rng.random() < 0.03:
                scheduler.abort_request(rng.choice(scheduler.running).request_id)
            steady_steps += scheduler._steady is not None
            out = scheduler.schedule()
            cached = out.scheduled_cached_reqs
            trace.append((cached.req_ids, cached.tokens_of_rows(), cached.new_block_ids, cached.block_starts,
                          cached.num_computed_tokens, [n.req_id for n in out.scheduled_new_reqs],
                          [n.block_ids for n in out.scheduled_new_reqs], out.num_scheduled_tokens,
                          out.finished_req_ids, out.preempted_req_ids, out.block_copies, out.samples))
            if scheduler.running and rng.random() < 0.03:  # finished between the step and its update
                scheduler.abort_request(rng.choice(scheduler.running).request_id)
            tokens = [rng.choice([EOS, 7, 8, rng.randrange(3, 50), rng.randrange(3, 50)]) for _ in out.samples]
            changed = scheduler.update_from_output(out, tokens)
            trace.append([(r.request_id, r.status, r.num_computed_tokens, list(r.output_token_ids), r.stop_reason,
                           list(r.block_ids), list(r.block_hashes)) for r in changed])
            trace.append(sorted(kv._cached_block_by_hash.items()))
        trace.append(steady_steps if steady else None)
        return trace


@pytest.mark.parametrize("seed", range(6))
def test_steady_steps_equal_the_general_path(seed, monkeypatch):
    steady = _run(seed, True, monkeypatch)
    general = _run(seed, False, monkeypatch)
    assert steady[-1] > 10  # the steady path ran
    assert steady[:-1] == general[:-1]


def test_steady_path_takes_the_common_decode_and_leaves_on_change():
    kv = KVCacheManager(num_blocks=200, block_size=4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=100)
    params = types.SimpleNamespace(max_tokens=50, min_tokens=0, ignore_eos=True, stop_token_ids=None)
    for i in range(3):
        scheduler.add_request(Request(f"r{i}", [5 + i] * (3 + i), params=params, eos_token_ids=[EOS]))
    for _ in range(3):
        out = scheduler.schedule()
        scheduler.update_from_output(out, [9] * out.num_rows)
    assert scheduler._steady is not None
    out = scheduler.schedule()
    assert out.scheduled_cached_reqs.decode_token_ids == [9, 9, 9]
    scheduler.abort_request("r1")
    assert scheduler._steady is None  # the running set changed: the general path runs
    scheduler.update_from_output(out, [9, 9, 9])
    assert [r.request_id for r in scheduler.running] == ["r0", "r2"]
    assert [r.num_output_tokens for r in scheduler.running] == [4, 4]
