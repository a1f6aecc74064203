"""KVCacheManager: block pool ref counts, free-queue order, prefix caching (hash chain, LRU), swap bookkeeping."""

from __future__ import annotations

import pytest

from paged_jax.core.block_hash import hash_block_tokens
from paged_jax.core.kv_cache_manager import NULL_BLOCK_ID, KVCacheManager
from paged_jax.core.request import Request


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(tokens))  # the KV-cache manager never reads params


def admit_and_compute(kv: KVCacheManager, request: Request) -> int:
    """Admit with the best prefix hit, compute the whole prompt in one step, register its full blocks.

    Returns the number of hit tokens."""
    hit_blocks, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hit_blocks)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return num_hit


def test_null_block_reserved_and_refcounts() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4, enable_prefix_caching=False)
    assert kv.num_free_blocks == 4 and kv.usage == 0.0
    a = make_request("a", range(1, 10))  # 9 tokens -> 3 blocks
    assert kv.allocate_slots(a, 9)
    assert NULL_BLOCK_ID not in a.block_ids and len(a.block_ids) == 3
    assert all(kv.blocks[b].ref_cnt == 1 for b in a.block_ids)
    assert kv.num_free_blocks == 1 and kv.usage == pytest.approx(0.75)
    # Growing within the last block needs nothing; crossing a boundary needs one more block.
    a.num_computed_tokens = 9
    assert kv.allocate_slots(a, 3) and len(a.block_ids) == 3
    assert kv.allocate_slots(a, 4) and len(a.block_ids) == 4 and kv.num_free_blocks == 0
    # Out of blocks: fails and changes nothing.
    b = make_request("b", [7])
    assert not kv.allocate_slots(b, 1)
    assert b.block_ids == [] and kv.num_free_blocks == 0
    kv.free(a)
    assert a.block_ids == [] and kv.num_free_blocks == 4
    assert all(kv.blocks[i].ref_cnt == 0 for i in range(5))
    with pytest.raises(RuntimeError, match="double free"):
        kv._release([1])


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(num_blocks=1, block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="num_host_blocks"):
        KVCacheManager(num_blocks=4, block_size=4, num_host_blocks=-1)
    kv = KVCacheManager(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="num_new_tokens"):
        kv.allocate_slots(make_request("a", [1]), -1)


def test_free_queue_order_uncached_first_then_tail_first() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7])  # 3 full blocks + 1 partial
    admit_and_compute(kv, a)
    a_blocks = list(a.block_ids)
    kv.free(a)
    queue = list(kv._free_queue)
    # The partial (un-hashed) last block is reused first; never-used blocks come next; the hashed blocks sit at the
    # tail, deepest block first.
    assert queue[0] == a_blocks[3]
    assert queue[-3:] == [a_blocks[2], a_blocks[1], a_blocks[0]]
    assert kv.blocks[a_blocks[3]].block_hash is None and kv.blocks[a_blocks[0]].block_hash is not None


def test_prefix_hit_on_identical_prompt_shares_blocks() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(10, 20))  # 10 tokens: 2 full blocks + 2 tokens
    a = make_request("a", prompt)
    assert admit_and_compute(kv, a) == 0
    b = make_request("b", prompt)
    hit_blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and hit_blocks == a.block_ids[:2]
    assert kv.allocate_slots(b, 2, hit_blocks)
    assert b.num_computed_tokens == 8 and b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert [kv.blocks[i].ref_cnt for i in b.block_ids] == [2, 2, 1]
    assert kv.prefix_cache_queries == 20 and kv.prefix_cache_hits == 8
    # Freeing one owner keeps the shared blocks alive for the other.
    kv.free(a)
    assert [kv.blocks[i].ref_cnt for i in b.block_ids] == [1, 1, 1]
    kv.free(b)
    assert kv.num_free_blocks == 15


def test_hit_never_covers_the_whole_prompt() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request("a", list(range(8)))  # exactly 2 full blocks
    admit_and_compute(kv, a)
    b = make_request("b", list(range(8)))
    _, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4  # (8 - 1) // 4 blocks: the last prompt token must be computed for logits
    c = make_request("c", list(range(9)))
    _, num_hit = kv.get_computed_blocks(c)
    assert num_hit == 8


def test_partial_prefix_hit_and_hash_chaining() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit_and_compute(kv, a)
    # Same first block, different second block: one block hit.
    b = make_request("b", [1, 2, 3, 4, 50, 60, 70, 80, 9])
    assert kv.get_computed_blocks(b) == (a.block_ids[:1], 4)
    # Same second block under a different first block: no hit (the hash covers the whole prefix).
    c = make_request("c", [9, 9, 9, 9, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(c) == ([], 0)
    assert hash_block_tokens(b"x", [5, 6, 7, 8]) != hash_block_tokens(b"y", [5, 6, 7, 8])
    kv.get_computed_blocks(c)  # fills c.block_hashes
    assert c.block_hashes[1] != a.block_hashes[1]


def test_invalidate_block_hashes_after_a_replaced_token() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7])
    a.output_token_ids.append(-1)  # an async-scheduling placeholder completes the second block...
    a.output_token_ids.append(-1)  # ...and starts a third
    kv.get_computed_blocks(a)  # fills a.block_hashes from the placeholders
    assert len(a.block_hashes) == 2
    a.output_token_ids[0] = 8
    kv.invalidate_block_hashes(a, a.num_prompt_tokens)
    assert len(a.block_hashes) == 1  # the first block's hash does not depend on the replaced token
    kv.get_computed_blocks(a)
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    kv.get_computed_blocks(b)
    assert a.block_hashes == b.block_hashes[:2]


def test_only_computed_full_blocks_are_cached() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request("a", list(range(12)))
    assert kv.allocate_slots(a, 12)  # allocated, nothing computed yet
    kv.cache_full_blocks(a)
    assert kv.num_cached_blocks == 0
    a.num_computed_tokens = 6  # first chunk done: one full block
    kv.cache_full_blocks(a)
    assert kv.num_cached_blocks == 1 and kv.blocks[a.block_ids[0]].block_hash == a.block_hashes[0]
    b = make_request("b", list(range(12)))
    assert kv.get_computed_blocks(b) == (a.block_ids[:1], 4)
    # Output tokens become cacheable once computed (a decoded token is fed back and written next step).
    a.num_computed_tokens = 12
    a.output_token_ids += [100, 101, 102, 103]
    assert kv.allocate_slots(a, 4)
    a.num_computed_tokens = 16
    kv.cache_full_blocks(a)
    assert kv.num_cached_blocks == 4


def test_duplicate_prefix_computed_twice_keeps_first() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a, b = make_request("a", list(range(9))), make_request("b", list(range(9)))
    for r in (a, b):  # both admitted before either computed: no hit, separate blocks
        assert kv.get_computed_blocks(r) == ([], 0)
        assert kv.allocate_slots(r, 9)
    for r in (a, b):
        r.num_computed_tokens = 9
        kv.cache_full_blocks(r)
    assert kv.num_cached_blocks == 2
    assert kv.blocks[a.block_ids[0]].block_hash is not None and kv.blocks[b.block_ids[0]].block_hash is None
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 15


def test_lru_eviction_order_and_eviction_drops_hash() -> None:
    kv = KVCacheManager(num_blocks=7, block_size=2)  # 6 usable blocks
    a = make_request("a", [1, 2, 3, 4, 5])  # 2 full blocks + partial
    b = make_request("b", [6, 7, 8, 9, 10])
    admit_and_compute(kv, a)
    admit_and_compute(kv, b)
    a_full, b_full = a.block_ids[:2], b.block_ids[:2]
    kv.free(a)  # a is least recently used
    kv.free(b)
    # Two fresh blocks: the two worthless partial blocks go first, no eviction.
    c = make_request("c", [20, 21, 22])
    assert kv.allocate_slots(c, 3)
    assert kv.num_evicted_blocks == 0 and kv.num_cached_blocks == 4
    # Next: a's blocks (LRU), deepest first.
    d = make_request("d", [30])
    assert kv.allocate_slots(d, 1) and d.block_ids == [a_full[1]]
    assert kv.num_evicted_blocks == 1 and kv.blocks[a_full[1]].block_hash is None
    # a's first block survived, its second did not: a repeat of a hits one block only; b still hits fully.
    assert kv.get_computed_blocks(make_request("a2", [1, 2, 3, 4, 5])) == ([a_full[0]], 2)
    assert kv.get_computed_blocks(make_request("b2", [6, 7, 8, 9, 10])) == (b_full, 4)
    # A hit revives a free block (removes it from the free queue) before any new block is popped.
    b2 = make_request("b2", [6, 7, 8, 9, 10, 11])
    hit, n = kv.get_computed_blocks(b2)
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(b2, b2.num_tokens - n, hit)
    assert b2.block_ids[:2] == b_full and kv.num_free_blocks == free_before - 3
    assert kv.blocks[b_full[0]].block_hash is not None  # revived, not evicted


def test_allocation_accounts_for_revived_hits() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)  # 3 usable
    a = make_request("a", [1, 2, 3, 4, 5])
    admit_and_compute(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 3
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # hit 2 blocks (both free), needs 3 more: 5 > 3
    hit, n = kv.get_computed_blocks(b)
    assert n == 4
    assert not kv.can_allocate(b, 5, hit) and not kv.allocate_slots(b, 5, hit)
    assert b.block_ids == [] and kv.num_free_blocks == 3 and kv.num_cached_blocks == 2
    assert kv.allocate_slots(b, 1, hit)  # 2 revived + 1 new = 3
    assert kv.num_free_blocks == 0


def test_reset_prefix_cache() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit_and_compute(kv, a)
    kv.free(a)
    kv.reset_prefix_cache()
    assert kv.num_cached_blocks == 0
    assert kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5])) == ([], 0)


def test_prefix_caching_disabled() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit_and_compute(kv, a)
    assert kv.num_cached_blocks == 0
    assert kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5])) == ([], 0)


def test_swap_out_and_in_bookkeeping() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=2, num_host_blocks=3)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5)
    a.num_computed_tokens = 3  # blocks: [computed, half computed, allocated but empty]
    dev = list(a.block_ids)
    assert kv.can_swap_out(a)
    pairs = kv.swap_out(a)
    assert pairs == [(dev[0], 0), (dev[1], 1)]  # the empty third block is not copied
    assert a.block_ids == [] and a.host_block_ids == [0, 1]
    assert kv.num_free_blocks == 5 and kv.num_free_host_blocks == 1
    big = make_request("big", list(range(10)))
    assert kv.allocate_slots(big, 10)  # takes every device block
    assert not kv.can_swap_in(a)
    kv.free(big)
    assert kv.can_swap_in(a, num_new_tokens=2) and not kv.can_swap_in(a, num_new_tokens=100)
    back = kv.swap_in(a)
    assert [h for h, _ in back] == [0, 1] and [d for _, d in back] == a.block_ids
    assert kv.num_free_host_blocks == 3 and a.host_block_ids == []
    assert kv.allocate_slots(a, 2) and len(a.block_ids) == 3
    kv.free(a)
    assert kv.num_free_blocks == 5


def test_swap_out_needs_host_room_and_free_releases_host_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2, num_host_blocks=1)
    a = make_request("a", [1, 2, 3])
    assert kv.allocate_slots(a, 3)
    a.num_computed_tokens = 3
    assert not kv.can_swap_out(a)
    with pytest.raises(RuntimeError, match="host pool"):
        kv.swap_out(a)
    b = make_request("b", [1])
    assert kv.allocate_slots(b, 1)
    b.num_computed_tokens = 1
    kv.swap_out(b)
    assert kv.num_free_host_blocks == 0
    kv.free(b)  # aborting a swapped request returns its host blocks
    assert kv.num_free_host_blocks == 1 and b.host_block_ids == []


def test_request_token_slices_and_validation() -> None:
    r = make_request("r", [1, 2, 3])
    r.output_token_ids += [4, 5]
    for start in range(6):
        for stop in range(start, 6):
            assert r.token_ids_slice(start, stop) == r.all_token_ids[start:stop]
    assert r.num_tokens == 5 and r.num_output_tokens == 2 and r.finish_reason is None
    with pytest.raises(ValueError, match="request_id"):
        Request(request_id="", prompt_token_ids=[1])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request(request_id="x", prompt_token_ids=[-1])
    assert Request(request_id="x", prompt_token_ids=[1], eos_token_ids=2).eos_token_ids == frozenset({2})


@pytest.mark.parametrize("salt", [None, "tenant"])
def test_cache_filled_blocks_registers_as_cache_full_blocks(salt) -> None:
    """A steady decode's registration of the blocks its rows just filled (``cache_filled_blocks``) leaves the same
    hashes, registrations and counts as ``cache_full_blocks``: rows that computed their prompt (one sharing another's
    prefix, one whose first filled block is its prompt's), a row that also filled a prompt block meanwhile."""
    def run(filled: bool) -> tuple:
        kv = KVCacheManager(num_blocks=64, block_size=4)
        requests = [Request(request_id=f"r{i}", prompt_token_ids=prompt, cache_salt=salt)
                    for i, prompt in enumerate([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 9], [5] * 8])]
        for request in requests:
            admit_and_compute(kv, request)
        for step in range(11):
            crossing = []
            for i, request in enumerate(requests):
                request.output_token_ids.append(10 * i + step)
                assert kv.allocate_slots(request, 1)
                request.num_computed_tokens += 1
                if request.num_computed_tokens % kv.block_size == 0:
                    crossing.append(request)
            if filled:
                kv.cache_filled_blocks(crossing)
            else:
                for request in crossing:
                    kv.cache_full_blocks(request)
        return ([r.block_hashes for r in requests], dict(kv._cached_block_by_hash), dict(kv.cached_block_counts),
                [b.block_hash for b in kv.blocks])

    assert run(True) == run(False)
    hashes = run(True)[0]
    assert hashes[0][:1] == hashes[1][:1] and len(hashes[3]) == 4
