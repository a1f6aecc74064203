"""Multi-host step replay in one process: node 0's runner publishes each ``SchedulerOutput`` (msgspec,
``encode_step``) and a grammar step's bitmask; a follower's runner runs the same ``execute`` on them
(``paged_jax.parallel.follower.follow``) and ends with node 0's KV pool and batch, its decode tokens fed from its own
on-device samples."""

from __future__ import annotations

import collections
import pickle

import numpy as np

from paged_jax.core.hand_steps import HandScheduler
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import Request
from paged_jax.core.sched_output import REMOTE_GRAMMAR, decode_step, encode_step
from paged_jax.core.scheduler import Scheduler
from paged_jax.parallel.follower import follow
from paged_jax.sampling_params import SamplingParams, StructuredOutputsParams
from paged_jax.worker.sampler import allowed_mask_words
from tests.test_model_runner import make_runner, tiny_model  # noqa: F401 (fixture)


class _MemoryChannel:
    """``StepChannel``'s two ends in one process (messages pickled as on the key-value store)."""

    def __init__(self):
        self.messages = collections.deque()
        self.kinds = []

    def publish(self, kind, payload=None):
        self.kinds.append(kind)
        self.messages.append(pickle.dumps((kind, payload)))

    def receive(self):
        return pickle.loads(self.messages.popleft())


class _StopOnlyGrammar:
    """A grammar whose matcher has ended: its rows allow only ``allowed`` (``fill_step_bitmask``'s stop-only row)."""

    def __init__(self, allowed: int, vocab_size: int):
        row = np.zeros((allowed_mask_words(vocab_size),), np.int32)
        row[allowed // 32] = np.int32(np.uint32(1 << (allowed % 32)).view(np.int32))
        self.stop_only_row = row

    def live_matcher(self):
        return None


def test_step_message_round_trips_the_runner_view():
    """A scheduler step (new rows with their parameters, a fork row, cached diffs, finished ids) decodes to the
    same diff; grammars come back as ``REMOTE_GRAMMAR`` by request id, without the scheduler's requests."""
    kv = KVCacheManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    params = SamplingParams(temperature=0.7, top_k=5, stop=["x"], logit_bias={3: 1.5}, max_tokens=9, seed=4,
                            structured_outputs=StructuredOutputsParams(regex="a+"))
    parent = Request("p", [1, 2, 3, 4, 5], params=params, seed=7, reserved_seats=1)
    parent.pending_forks = [Request("p-1", [1, 2, 3, 4, 5], params=params, seed=8)]
    for request in (parent, Request("q", [6, 7], params=SamplingParams(max_tokens=4))):
        scheduler.add_request(request)
    first = scheduler.schedule()
    scheduler.update_from_output(first, [9] * first.num_rows)
    scheduler.abort_request("q")
    second = scheduler.schedule()
    second.grammars["p"] = object()
    for out in (first, second):
        decoded, lora_slots = decode_step(encode_step(out, {3: 1}))
        assert lora_slots == {3: 1} and decoded.requests == []
        assert decoded.scheduled_new_reqs == out.scheduled_new_reqs
        assert decoded.scheduled_cached_reqs == out.scheduled_cached_reqs
        assert [(c, p) for c, p in decoded.fork_rows] == [(c, p) for c, p in out.fork_rows]
        for name in ("num_scheduled_tokens", "finished_req_ids", "preempted_req_ids", "block_copies", "samples"):
            assert list(map(tuple, getattr(decoded, name))) == list(map(tuple, getattr(out, name))) \
                if name == "block_copies" else getattr(decoded, name) == getattr(out, name), name
        assert decoded.num_rows == out.num_rows and decoded.grammars == dict.fromkeys(out.grammars, REMOTE_GRAMMAR)
    assert first.fork_rows and first.scheduled_new_reqs[0].params == params
    assert second.finished_req_ids == ["q"] and second.scheduled_cached_reqs.req_ids
    # A steady decode's diff carries its tokens as one column.
    steady = Scheduler(KVCacheManager(num_blocks=64, block_size=4), max_num_seqs=4, max_num_batched_tokens=64,
                       max_model_len=64)
    steady.add_request(Request("s", [1, 2, 3], params=SamplingParams(max_tokens=20)))
    for _ in range(3):
        out = steady.schedule()
        steady.update_from_output(out, [5] * out.num_rows)
    out = steady.schedule()
    assert out.scheduled_cached_reqs.decode_token_ids == [5]
    assert decode_step(encode_step(out))[0].scheduled_cached_reqs == out.scheduled_cached_reqs


def test_follower_runs_node0s_steps_to_the_same_kv_pool(tiny_model):
    """Node 0 runs prefill and decode steps as async scheduling does (decodes fed from the device), one row
    constrained by a grammar; a follower replaying its channel ends with the same KV pool and rows, so it sampled
    the same tokens (the constrained row's bitmask being node 0's)."""
    model, config = tiny_model
    leader, follower = make_runner(model, config), make_runner(model, config)
    channel = _MemoryChannel()
    leader.step_channel = channel
    hs = HandScheduler()
    rng = np.random.default_rng(5)
    hs.add("a", rng.integers(3, config.vocab_size, size=11).tolist(), list(range(1, 9)),
           params=SamplingParams(temperature=0.0), seed=1)
    hs.add("b", rng.integers(3, config.vocab_size, size=6).tolist(), list(range(9, 17)),
           params=SamplingParams(temperature=0.9), seed=2)
    grammar = _StopOnlyGrammar(allowed=5, vocab_size=config.vocab_size)
    handles = []
    for step in range(5):
        plan = {"a": 11, "b": 6} if step == 0 else {"a": 1, "b": 1}
        out = hs.step(plan, grammars={"b": grammar})
        handles.append((out, leader.execute(out)))
        hs.update(out, None)  # placeholders: the next step feeds them from the device
    hs.finish("a")
    leader.execute(hs.step({"b": 1}, grammars={"b": grammar}))
    channel.publish("shutdown")
    assert channel.kinds.count("step") == 6 and channel.kinds.count("bitmask") == 6
    constrained = [result.sampled_token_ids[out.row_req_ids().index("b")]
                   for out, handle in handles for result in [handle.result()]]
    assert constrained == [5] * 5
    follow(follower, channel)
    assert not channel.messages
    for ours, theirs in zip(follower.kv_pool, leader.kv_pool):
        for a, b in zip(ours, theirs):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert follower.input_batch.req_ids == leader.input_batch.req_ids == ["b"]
    np.testing.assert_array_equal(follower.input_batch.token_ids[:1], leader.input_batch.token_ids[:1])
