"""The prefix cache's host-memory tier (``--kv-offloading-size``): the bookkeeping (``paged_jax.core.kv_offload``)
under the scheduler with a simulated pool that checks every K/V read, the host pool's copies
(``paged_jax.worker.host_kv_pool``), and an engine whose multi-turn conversations outgrow a tiny device pool: the same
greedy tokens with and without the tier, hits in the tier, nothing leaked or compiled."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.config import EngineArgs
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core import kv_offload
from paged_jax.core.kv_offload import HostKVTier, host_entry
from paged_jax.core.scheduler import Scheduler
from paged_jax.worker import host_kv_pool
from paged_jax.worker.host_kv_pool import (GPU_PINNED_LIMIT_ENV, HostKVPool, check_pinned_host_limit, gather_blocks,
                                           host_memory_kind, scatter_blocks)
from tests.test_scheduler import VOCAB, FakeRunner, make_request, run_to_completion


class TierFakeRunner(FakeRunner):
    """``FakeRunner`` with the real runner's order of a step's copies: the swap-outs are gathered first, the
    swap-ins read the host pool next, and the gathered blocks land in the host pool last."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int) -> None:
        super().__init__(kv, max_num_seqs)
        num_offload = kv.offload.num_blocks if kv.offload is not None else 0
        self.host = np.full((kv.num_host_blocks + num_offload + 1, kv.block_size), -1, dtype=np.int64)

    def apply_diff_and_copies(self, out) -> None:
        self.apply_diff(out)
        gathered = [(host, self.device[dev].copy()) for dev, host in out.swap_out]
        for host, dev in out.swap_in:
            self.device[dev] = self.host[host]
        for host, data in gathered:
            self.host[host] = data
        for src, dst in out.block_copies:
            self.device[dst] = self.device[src]


def conversations(num_conversations: int, num_turns: int, seed: int = 0) -> list[list[list[int]]]:
    """Each conversation's user turns: a shared system prompt opens every conversation's first turn."""
    rng = random.Random(seed)
    system = [rng.randrange(1, VOCAB) for _ in range(9)]
    return [[(system if turn == 0 else []) + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 9))]
             for turn in range(num_turns)] for _ in range(num_conversations)]


def run_chat(sched: Scheduler, runner: FakeRunner, chats: list[list[list[int]]], max_tokens: int = 4):
    """Round-robin turns: turn t of every conversation, then turn t + 1, each prompt the conversation so far."""
    histories = [[] for _ in chats]
    outputs = []
    for turn in range(len(chats[0])):
        requests = []
        for c, chat in enumerate(chats):
            histories[c] = histories[c] + chat[turn]
            requests.append(make_request(f"c{c}t{turn}", histories[c], max_tokens=max_tokens))
        run_to_completion(sched, runner, {0: requests})
        for c, request in enumerate(requests):
            histories[c] = histories[c] + request.output_token_ids
            outputs.append(request.output_token_ids)
    return outputs


@pytest.mark.parametrize("num_offload_blocks", [0, 6, 200])  # none, a tier that evicts too, one that holds all
def test_tier_under_a_tiny_pool_gives_the_same_outputs_and_leaks_nothing(num_offload_blocks):
    """Six conversations of five turns (up to ~60 tokens each) through 20 usable blocks of 4 tokens: the prefixes are
    evicted between turns. The simulated pool checks every position a step reads; with the tier, hits load evicted
    blocks back (fewer tokens recomputed) and the counters say so; everything is free at the end."""
    chats = conversations(6, 5)
    results = {}
    for blocks in (0, num_offload_blocks):
        kv = KVCacheManager(21, 4, num_host_blocks=3, num_offload_blocks=blocks)
        sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=12, max_model_len=64)
        runner = TierFakeRunner(kv, 4)
        results[blocks] = (run_chat(sched, runner, chats), kv)
        assert kv.num_free_blocks == kv.num_usable_blocks and all(b.ref_cnt == 0 for b in kv.blocks)
        assert kv.num_free_host_blocks == kv.num_host_blocks
    (plain, plain_kv), (tiered, kv) = results[0], results[num_offload_blocks]
    assert tiered == plain
    if num_offload_blocks:
        stats = kv.stats()
        assert stats["external_prefix_cache_hits"] > 0 and kv.offload.num_loaded_blocks > 0
        assert stats["external_prefix_cache_queries"] == stats["prefix_cache_queries"]
        assert kv.offload.num_cached_blocks <= num_offload_blocks
        recomputed = stats["prefix_cache_queries"] - stats["prefix_cache_hits"] - stats["external_prefix_cache_hits"]
        assert recomputed < plain_kv.prefix_cache_queries - plain_kv.prefix_cache_hits


def test_tier_with_swap_preemption_and_priorities_never_reads_foreign_kv():
    """Random arrivals over a small vocabulary (many shared prefixes) with swap preemption, priorities and aborts,
    a tier smaller than what is evicted: the simulated pool checks every read; nothing leaks."""
    kv = KVCacheManager(13, 2, num_host_blocks=5, num_offload_blocks=7)
    sched = Scheduler(kv, 4, 9, 24, preemption_mode="swap", policy="priority")
    runner = TierFakeRunner(kv, 4)
    from tests.test_scheduler import run_random_workload

    all_reqs = run_random_workload(sched, runner, seed=3)
    assert all(r.is_finished for r in all_reqs)
    assert kv.num_free_blocks == kv.num_usable_blocks and kv.num_free_host_blocks == kv.num_host_blocks
    assert sched.num_preemptions > 0 and kv.offload.hits > 0 and kv.offload.num_stored_blocks > kv.offload.num_blocks


def test_tier_lru_and_the_blocks_of_a_pass():
    tier = HostKVTier(2, first_host_id=5)
    tier.store(b"a", 1)
    assert tier.entry(b"a") is None  # stored in this pass: its data lands after the step's loads are read
    assert tier.take_copies() == ([(1, 5)], [])
    assert tier.entry(b"a") == host_entry(5)
    tier.store(b"b", 2)
    tier.store(b"a", 3)  # held already: no copy, most recently used now
    tier.store(b"c", 4)  # evicts b, the least recently used
    stores, _ = tier.take_copies()
    assert stores == [(2, 6), (4, 6)] and tier.entry(b"b") is None and tier.entry(b"c") == host_entry(6)
    entries = [9, host_entry(5)]
    assert tier.load_hits(entries, [b"x", b"a"], lambda block_hash: 11) == 1
    assert entries == [9, 11] and tier.take_copies() == ([], [(5, 11)])
    tier.clear()
    assert tier.entry(b"a") is None and tier.num_cached_blocks == 0


def test_tier_saves_computed_blocks_ahead_of_their_eviction(monkeypatch):
    """Write-through: the blocks the device cache registers are stored in the tier in the next passes (at most
    ``SAVE_AHEAD_BLOCKS`` a pass), so that their eviction copies nothing; one evicted before its turn is stored then,
    once. Loads read the host blocks the saves wrote."""
    monkeypatch.setattr(kv_offload, "SAVE_AHEAD_BLOCKS", 1)
    kv = KVCacheManager(5, 4, num_offload_blocks=8)  # 4 usable device blocks
    first = make_request("first", range(1, 10), max_tokens=1)  # 9 tokens: two full blocks
    assert kv.allocate_slots(first, 9)
    first.num_computed_tokens = 9
    kv.cache_full_blocks(first)
    block_1, block_2 = first.block_ids[:2]
    assert kv.take_offload_copies() == ([(block_1, 0)], [])  # saved ahead, one a pass
    kv.free(first)
    other = make_request("other", range(20, 36), max_tokens=1)
    assert kv.allocate_slots(other, 16)  # every device block: evicts both of first's
    assert kv.take_offload_copies() == ([(block_2, 1)], [])  # only the one not saved ahead yet, at its eviction
    assert kv.take_offload_copies() == ([], [])  # its queued save ahead is moot: the block holds other's KV now
    kv.free(other)
    again = make_request("again", range(1, 10), max_tokens=1)
    computed, num_hit = kv.get_computed_blocks(again)
    assert computed == [host_entry(0), host_entry(1)] and num_hit == 8
    assert kv.allocate_slots(again, 1, computed)
    assert kv.take_offload_copies() == ([], [(0, again.block_ids[0]), (1, again.block_ids[1])])
    assert kv.offload.num_stored_blocks == 2 and kv.offload.hits == 8 and kv.prefix_cache_hits == 0


def test_a_prefix_on_the_device_is_a_device_hit_with_the_tier_on():
    """The tier continues the device cache's lookup where it misses: a prefix whose first blocks are still on the
    device and whose deepest one was evicted (the device evicts a prefix's deepest blocks first) is a device hit for
    the former (``prefix_cache_hits``) and a tier hit for the latter (``external_prefix_cache_hits``), and the
    turn reads the right KV."""
    kv = KVCacheManager(7, 4, num_offload_blocks=16)  # 6 usable device blocks
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=24)
    runner = TierFakeRunner(kv, 4)
    prompt = list(range(1, 18))  # 17 tokens: 4 full blocks, then one more
    first = make_request("first", prompt, max_tokens=1)
    run_to_completion(sched, runner, {0: [first]})
    run_to_completion(sched, runner, {0: [make_request("other", range(30, 39), max_tokens=1)]})  # evicts 1 block
    again = make_request("again", prompt, max_tokens=1)
    run_to_completion(sched, runner, {0: [again]})
    stats = kv.stats()
    assert stats["prefix_cache_hits"] == 12 and stats["external_prefix_cache_hits"] == 4
    assert again.output_token_ids == first.output_token_ids


def _host_pool(num_host_blocks: int = 4, **kwargs):
    """A two-layer device pool of 6 blocks (distinct values everywhere), its contents on the host, and a host pool."""
    shape = (6, 4, 2, 3)  # blocks, block_size, Hkv, D
    pool = [(jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) + 100 * layer,
             -jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) - 100 * layer) for layer in range(2)]
    host = HostKVPool(num_host_blocks, (2, 2) + shape[1:], np.float32, gather=jax.jit(gather_blocks),
                      scatter=jax.jit(scatter_blocks, donate_argnums=(0,)), device=jax.devices()[0], **kwargs)
    return pool, jax.device_get(pool), host


def _assert_blocks_equal(pool, original, moved: dict[int, int]) -> None:
    """Device blocks ``moved`` keys hold what ``original``'s blocks ``moved`` values held, in every layer."""
    after = jax.device_get(pool)
    for layer in range(len(original)):
        for kv in range(2):
            for dst, src in moved.items():
                np.testing.assert_array_equal(after[layer][kv][dst], original[layer][kv][src])


def test_host_pool_stores_land_after_the_step_and_load_back_exactly():
    """Blocks saved to host memory in one step load back bit-exactly into other blocks in a later step; a step's own
    saves never feed its loads; padded sizes only (no compile). Host blocks are JAX arrays in pinned host memory
    (the CPU backend offers it, as the GPU's does)."""
    pool, original, host = _host_pool()
    assert host.memory_kind == "pinned_host" and host.block_array(0) is None
    assert host.reserve_host_memory() >= 0 and host.block_array(0) is None  # (done at construction on a GPU)
    pool = host.swap(pool, [(1, 0), (2, 1), (3, 2)], [])
    assert host.block_array(0).sharding.memory_kind == "pinned_host" and host.block_array(0).shape == (2, 2, 4, 2, 3)
    pool = host.swap(pool, [(4, 0)], [(0, 4), (1, 5), (2, 1)])  # reads 0 before block 4 lands there
    host.flush()
    assert host.num_in_flight == (0, 0) and host.bytes_saved == 4 * host.block_bytes == host.bytes_loaded + host.block_bytes
    _assert_blocks_equal(pool, original, {4: 1, 5: 2, 1: 3})
    for layer in range(2):
        for kv in range(2):
            np.testing.assert_array_equal(host.read_block(0)[layer, kv], original[layer][kv][4])
    host.close()


def test_host_pool_deferred_saves_go_in_one_transfer_after_the_forward(monkeypatch):
    """``defer_saves`` (the runner's steps): a step's saves are gathered before its loads' scatters (which donate the
    pool) but sent to host memory only by ``finish_saves``, every chunk of the step in one ``device_put``; the
    gathers hold the blocks as they were before the step's forward; a later step's loads read them bit-exactly (a
    save left pending is sent first); the same step shapes compile nothing more."""
    pool, original, host = _host_pool(num_host_blocks=6, max_in_flight=64)
    pool = jax.device_put(pool, jax.devices()[0])  # committed, as the runner's pool (and the scatters' outputs)
    monkeypatch.setattr(host_kv_pool, "chunks", lambda items: [items[i:i + 2] for i in range(0, len(items), 2)])
    puts = []
    real_put = jax.device_put

    def counted_put(x, *args, **kwargs):
        puts.append((len(x) if isinstance(x, list) else 1, getattr(args[0] if args else None, "memory_kind", None)))
        return real_put(x, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", counted_put)
    gather, scatter = host._gather, host._scatter

    def rounds(pool):
        puts.clear()
        pool = host.swap(pool, [(1, 0), (2, 1), (3, 2)], [], defer_saves=True)
        assert not [p for p in puts if p[1] == "pinned_host"] and host.num_in_flight[0] == 3
        forward = [(k.at[1:4].set(0.0), v.at[1:4].set(0.0)) for k, v in pool]  # the step overwrites the blocks
        host.finish_saves()
        assert [p for p in puts if p[1] == "pinned_host"] == [(3, "pinned_host")]  # one transfer, both chunks
        pool = host.swap(forward, [(4, 3)], [(0, 4), (1, 5), (2, 1)], defer_saves=True)  # block 4's save pending
        return host.swap(pool, [], [(3, 2)], defer_saves=True)  # reads host block 3: its save is sent first

    pool = rounds(pool)
    _assert_blocks_equal(pool, original, {4: 1, 5: 2, 1: 3, 2: 4})
    compiled = gather._cache_size(), scatter._cache_size()
    pool = rounds(jax.device_put(original, jax.devices()[0]))  # the same copies again, from the same contents
    host.flush()
    assert (gather._cache_size(), scatter._cache_size()) == compiled and host.num_in_flight == (0, 0)
    assert host.counts["blocks_saved"] == 8 and host.counts["blocks_loaded"] == 8
    _assert_blocks_equal(pool, original, {4: 1, 5: 2, 1: 3, 2: 4})
    host.close()


def test_host_pool_copies_are_dispatched_without_waiting_for_the_device(monkeypatch):
    """Under its in-flight cap a step's saves and loads only dispatch transfers: nothing in ``swap`` waits for the
    device or reads an array back to numpy. A load of blocks whose saves are still counted in flight (nobody waited
    for them) reads their data: the runtime orders the load after the save, not the host."""
    pool, original, host = _host_pool(max_in_flight=8)
    array_type = type(pool[0][0])
    waits = []

    def refuse(*args, **kwargs):
        waits.append(args)
        raise AssertionError("the host KV pool waited for the device inside a step")

    monkeypatch.setattr(host_kv_pool, "_ready", lambda arrays: False)  # every save still on its way
    with monkeypatch.context() as m:
        for target, name in ((jax, "block_until_ready"), (jax, "device_get"), (array_type, "block_until_ready"),
                             (array_type, "__array__")):
            m.setattr(target, name, refuse)
        pool = host.swap(pool, [(1, 0), (2, 1)], [])
        pool = host.swap(pool, [(3, 2)], [(0, 4), (1, 5)])
        assert host.num_in_flight == (3, 2)
    assert not waits
    _assert_blocks_equal(pool, original, {4: 1, 5: 2})
    host.close()
    assert host.num_in_flight == (0, 0)


def test_host_pool_waits_for_the_oldest_copy_only_past_the_in_flight_cap(monkeypatch):
    """Copies under way hold device memory (a save its gathered blocks, a load its transferred blocks until its
    scatter has run): past ``max_in_flight`` blocks of saves, or of loads, the oldest is waited for (and only then);
    data stays exact."""
    pool, original, host = _host_pool(max_in_flight=2)
    monkeypatch.setattr(host_kv_pool, "_ready", lambda arrays: False)  # nothing finishes unless waited for
    waited = []
    real_wait = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda arrays: waited.append(len(arrays)) or real_wait(arrays))
    pool = host.swap(pool, [(1, 0)], [])
    assert waited == [] and host.num_in_flight == (1, 0)
    pool = host.swap(pool, [(2, 1), (3, 2)], [])
    assert waited == [1] and host.num_in_flight == (2, 0)  # the first save (one block) was waited for
    pool = host.swap(pool, [], [(0, 4), (2, 5)])
    assert waited == [1] and host.num_in_flight == (2, 2)
    pool = host.swap(pool, [], [(1, 3)])
    assert waited == [1, 1] and host.num_in_flight == (2, 1)  # the first load's scatter was waited for
    _assert_blocks_equal(pool, original, {4: 1, 5: 3, 3: 2})


def test_host_pool_makes_room_before_a_copy_allocates(monkeypatch):
    """The in-flight cap bounds the device memory the copies hold: a chunk's gather (saves) or transfer (loads)
    starts only once the copies under way leave it room, so the oldest is waited for first."""
    pool, original, host = _host_pool(max_in_flight=2)
    monkeypatch.setattr(host_kv_pool, "_ready", lambda arrays: False)  # nothing finishes unless waited for
    events = []
    real_wait = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda arrays: events.append("wait") or real_wait(arrays))
    gather, transfer = host._gather, host._transfer
    host._gather = lambda *args: events.append("gather") or gather(*args)
    host._transfer = lambda *args: events.append("transfer") or transfer(*args)
    pool = host.swap(pool, [(1, 0), (2, 1)], [])
    pool = host.swap(pool, [(3, 2)], [])
    assert events == ["gather", "wait", "gather"]
    events.clear()
    pool = host.swap(pool, [], [(0, 4), (1, 5)])
    pool = host.swap(pool, [], [(2, 3)])
    assert events == ["transfer", "wait", "transfer"]
    _assert_blocks_equal(pool, original, {4: 1, 5: 2, 3: 3})
    host.close()


def test_host_memory_kind_and_the_gpu_pinned_cap():
    """Host blocks go to pinned host memory where the platform has it, else unpinned host memory; a platform with
    neither is refused naming the flags. XLA's pinned host allocator on a GPU is capped: a pool above the cap is
    refused, naming the variable that raises it."""
    class Device:
        platform = "other"

        def __init__(self, kinds):
            self.kinds = kinds

        def addressable_memories(self):
            return [type("Memory", (), {"kind": kind})() for kind in self.kinds]

    assert host_memory_kind(jax.devices()[0]) == "pinned_host"
    assert host_memory_kind(Device(["device", "pinned_host", "unpinned_host"])) == "pinned_host"
    assert host_memory_kind(Device(["device", "unpinned_host"])) == "unpinned_host"
    with pytest.raises(ValueError, match="kv_offloading_size.*no host memory kind"):
        host_memory_kind(Device(["device"]))
    check_pinned_host_limit(200 * 2**30, "cpu", environ={})
    check_pinned_host_limit(60 * 2**30, "gpu", environ={})
    with pytest.raises(ValueError, match=f"kv_offloading_size.*{GPU_PINNED_LIMIT_ENV}"):
        check_pinned_host_limit(70 * 2**30, "gpu", environ={})
    check_pinned_host_limit(70 * 2**30, "gpu", environ={GPU_PINNED_LIMIT_ENV: "96"})
    with pytest.raises(ValueError, match=GPU_PINNED_LIMIT_ENV):  # preallocating, XLA's default cap is smaller
        check_pinned_host_limit(20 * 2**30, "gpu", environ={"XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE": "true"})


def test_flags_refused_where_the_tier_does_not_work():
    with pytest.raises(ValueError, match="kv_offloading_backend"):
        EngineArgs(kv_offloading_size=1.0, kv_offloading_backend="lmcache")
    for bad in (0, -1.0, True):
        with pytest.raises(ValueError, match="kv_offloading_size"):
            EngineArgs(kv_offloading_size=bad)
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        with pytest.raises(ValueError, match=f"kv_offloading_size is not supported with {name}"):
            EngineArgs(kv_offloading_size=1.0, **{name: 2})
    with pytest.raises(ValueError, match="kv_offloading_size is not supported with nnodes"):
        EngineArgs(kv_offloading_size=1.0, nnodes=2)
    with pytest.raises(ValueError, match="kv_offloading_size.*enable_prefix_caching"):
        EngineArgs(kv_offloading_size=1.0, enable_prefix_caching=False)
    for windows in ((None, 8), (8,)):  # a mix of full and sliding layers; layers that all slide
        with pytest.raises(ValueError, match="kv_offloading_size is not supported with KV-cache groups"):
            KVCacheManager(32, 4, group_windows=windows, num_offload_blocks=4)
    with pytest.raises(ValueError, match="kv_offloading_size needs prefix caching"):
        KVCacheManager(32, 4, enable_prefix_caching=False, num_offload_blocks=4)


def test_engine_multi_turn_chat_with_the_tier_gives_the_same_greedy_tokens(tmp_path):
    """A tiny Llama (random fp32 weights) with 24 usable blocks of 8 tokens; five conversations of four turns whose
    prompts (the conversation so far) share a system prompt and outgrow the pool between turns. With the tier the
    evicted prefixes load back from host memory: the same greedy tokens as without it, hits in the tier, the device and
    host blocks free again, nothing compiled after warm-up. The engine with the tier also schedules asynchronously
    (its copies run on the dispatch thread's pool)."""
    from models.testing import save_random_hf_checkpoint, tiny_config
    from paged_jax.engine.llm_engine import LLMEngine
    from paged_jax.sampling_params import SamplingParams

    save_random_hf_checkpoint(tiny_config("llama"), tmp_path, seed=2)
    rng = random.Random(5)
    system = [rng.randrange(3, 256) for _ in range(20)]
    chats = [[(system if turn == 0 else []) + [rng.randrange(3, 256) for _ in range(rng.randrange(6, 14))]
              for turn in range(4)] for _ in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    results = {}
    for size in (None, 0.001):  # 0.001 GiB: 262 host blocks of this model's 4 KiB
        engine = LLMEngine(EngineArgs(model=str(tmp_path), dtype="float32", max_model_len=96, block_size=8,
                                      max_num_batched_tokens=32, max_num_seqs=4, num_gpu_blocks_override=25,
                                      kv_offloading_size=size, async_scheduling=size is not None, seed=0),
                           use_tqdm=False)
        histories, tokens = [[] for _ in chats], []
        for turn in range(4):
            for c, chat in enumerate(chats):
                histories[c] = histories[c] + chat[turn]
                engine.add_request(f"c{c}t{turn}", {"prompt_token_ids": histories[c]}, params)
            out: dict[str, list[int]] = {}
            while engine.has_unfinished_requests():
                for o in engine.step():
                    out.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
            for c in range(len(chats)):
                histories[c] = histories[c] + out[f"c{c}t{turn}"]
                tokens.append(out[f"c{c}t{turn}"])
        core = engine.engine_core
        kv = core.kv_cache_manager
        assert kv.num_free_blocks == kv.num_usable_blocks and all(b.ref_cnt == 0 for b in kv.blocks)
        assert kv.num_free_host_blocks == kv.num_host_blocks
        assert core.runner.num_compiles_since_warmup == 0
        results[size] = (tokens, core.stats())
        engine.close()
    (plain, plain_stats), (tiered, stats) = results[None], results[0.001]
    assert tiered == plain
    assert "external_prefix_cache_hits" not in plain_stats
    assert stats["external_prefix_cache_hits"] > 0 and stats["num_onloaded_blocks"] > 0
    assert (stats["prefix_cache_hits"] + stats["external_prefix_cache_hits"]
            > plain_stats["prefix_cache_hits"])  # fewer tokens recomputed


def test_tier_counters_reach_the_metrics_and_the_stats_line():
    """vLLM's names: ``vllm:external_prefix_cache_queries`` / ``_hits`` beside the device's counters (``LLM.get_metrics``
    and ``/metrics`` share the table), the stats line's external hit rate, and ``cache_config_info``'s labels."""
    from paged_jax.metrics import metrics_from_stats
    from serving.server_logs import format_stats_line

    stats = {"prefix_cache_queries": 400, "prefix_cache_hits": 100, "external_prefix_cache_queries": 400,
             "external_prefix_cache_hits": 200}
    values = {m.name: m.value for m in metrics_from_stats(stats)}
    assert values["vllm:external_prefix_cache_queries"] == 400 and values["vllm:external_prefix_cache_hits"] == 200
    assert values["vllm:prefix_cache_hits"] == 100
    line = format_stats_line(stats, 0.0, 0.0)
    assert line.endswith("Prefix cache hit rate: 25.0%, External prefix cache hit rate: 50.0%")
    assert "External" not in format_stats_line({"prefix_cache_queries": 4}, 0.0, 0.0)
    from serving.metrics import cache_config_labels  # vLLM's cache_config_info carries the CacheConfig fields

    labels = cache_config_labels(EngineArgs(kv_offloading_size=2.5))
    assert labels["kv_offloading_size"] == 2.5 and labels["kv_offloading_backend"] == "native"
