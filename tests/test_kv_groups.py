"""KV-cache groups (paged_jax.core.kv_groups, paged_jax.worker.kv_group_pool): the group layout; the KV-cache
manager's group rules (a sliding group's blocks released past its window, at most ceil(W / block_size) + 1 held while
decoding, hits valid for every group, forks copied per group, swap); the scheduler's random workload against a fake
runner that reads every group back; the pool's capacity and its benchmark; groups off without windows; and the
engine against transformers on Mistral (every layer slides: one group) and Gemma 3 (a full group and two sliding
groups sharing the pool): one continuous batch of prompts two to three windows long, chunked prefill across the
window edge, preemption by recompute and swap."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import kv_capacity

from models.config import AttentionChunk, ModelConfig
from models.presets import preset_config
from models.testing import save_random_hf_checkpoint, tiny_config
from paged_jax.config import EngineArgs
from paged_jax.core.kv_cache_manager import NULL_BLOCK_ID, KVCacheManager
from paged_jax.core.kv_groups import (KVCacheGroupSpec, engine_kv_groups, kv_cache_groups, kv_pool_capacity,
                                      longest_window_hit, max_blocks_per_request, num_skipped_blocks)
from paged_jax.core.request import Request
from paged_jax.core.scheduler import Scheduler
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.sampling_params import SamplingParams
from paged_jax.worker.kv_group_pool import KVPoolLayout
from paged_jax.worker.kv_pool_sizing import kv_bytes_per_block
from paged_jax.worker.step_io import StepLayout
from tests.test_scheduler import VOCAB, FakeRunner, prefix_states, run_random_workload

GEMMA3_12B_WINDOWS = tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(48))


def test_group_layout():
    groups = kv_cache_groups(GEMMA3_12B_WINDOWS)
    assert [g.sliding_window for g in groups] == [None] + [1024] * 5
    assert groups[0].layers == tuple(range(5, 48, 6)) and all(len(g.layers) == 8 for g in groups)
    assert sorted(sum((g.layers for g in groups), ())) == list(range(48))
    assert kv_cache_groups((None,) * 4) == (KVCacheGroupSpec(None, (0, 1, 2, 3)),)
    assert kv_cache_groups((8,) * 3) == (KVCacheGroupSpec(8, (0, 1, 2)),)
    assert kv_cache_groups((8, None, 8, 8, 8)) == (KVCacheGroupSpec(None, (1,)), KVCacheGroupSpec(8, (0,)),
                                                   KVCacheGroupSpec(8, (2,)), KVCacheGroupSpec(8, (3,)),
                                                   KVCacheGroupSpec(8, (4,)))
    assert engine_kv_groups((None,) * 4) == (KVCacheGroupSpec(None, (0, 1, 2, 3)),)  # groups off
    assert engine_kv_groups(GEMMA3_12B_WINDOWS) == groups
    assert engine_kv_groups((8, 16)) == (KVCacheGroupSpec(16, (0, 1)),)  # every layer slides: one group
    # A sharding plan's attention takes one table: a mixed layout keeps every token in every layer.
    assert engine_kv_groups(GEMMA3_12B_WINDOWS, mixed_groups=False) == (KVCacheGroupSpec(None, tuple(range(48))),)


def test_block_rules():
    assert num_skipped_blocks(7, 8, 4) == 0 and num_skipped_blocks(11, 8, 4) == 1 and num_skipped_blocks(12, 8, 4) == 1
    assert max_blocks_per_request(100, None, 4, 16) == 25
    assert max_blocks_per_request(100, 8, 4, 1) == 3  # ceil(8 / 4) + 1 while decoding
    assert max_blocks_per_request(100, 8, 4, 16) == 7 and max_blocks_per_request(10, 8, 4, 16) == 3
    # Blocks 0 and 2 missed: a hit of n blocks needs blocks skipped(n * 4) .. n - 1 (window 8, block 4).
    assert longest_window_hit([1, None, 3, 4, 5, None], 8, 4) == 5
    assert longest_window_hit([1, None, 3, None], 8, 4) == 1
    assert longest_window_hit([None, None], 8, 4) == 0


def _decode(kv: KVCacheManager, request: Request, num_steps: int) -> list[int]:
    """Run ``num_steps`` one-token steps; the number of blocks the request holds after each allocation."""
    held = []
    for step in range(num_steps):
        assert kv.allocate_slots(request, 1)
        held.append(sum(b != NULL_BLOCK_ID for b in request.block_ids))
        request.output_token_ids.append(7 + step)
        request.num_computed_tokens += 1
        kv.cache_full_blocks(request)
    return held


@pytest.mark.parametrize("window,block_size", [(8, 4), (10, 4), (5, 8)])
def test_sliding_window_holds_at_most_window_blocks_plus_one(window, block_size):
    kv = KVCacheManager(num_blocks=64, block_size=block_size, group_windows=(window,))
    request = Request(request_id="a", prompt_token_ids=list(range(3, 3 + 3 * window)))
    assert kv.allocate_slots(request, request.num_tokens)  # one chunk of three windows
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    held = _decode(kv, request, 5 * block_size)
    assert max(held) <= -(-window // block_size) + 1
    assert len(request.block_ids) == kv.blocks_needed(request.num_computed_tokens)  # the table keeps its length
    assert kv.num_free_blocks == kv.num_usable_blocks - held[-1]
    kv.free(request)
    assert kv.num_free_blocks == kv.num_usable_blocks and all(b.ref_cnt == 0 for b in kv.blocks)


def test_chunk_block_rules():
    chunk = AttentionChunk(8)
    # Position 11's chunk starts at 8: blocks 0, 1 (block 4) are skipped; position 16's starts at 16.
    assert [num_skipped_blocks(n, chunk, 4) for n in (7, 8, 11, 15, 16)] == [0, 2, 2, 2, 4]
    assert num_skipped_blocks(20, AttentionChunk(10), 4) == 5 and num_skipped_blocks(19, AttentionChunk(10), 4) == 2
    assert max_blocks_per_request(100, chunk, 4, 1) == 3 and max_blocks_per_request(100, chunk, 4, 16) == 7
    # A hit of n blocks needs the blocks from the chunk of position n * 4 on: 5 blocks need block 4 only, a hit
    # ending on a chunk's edge none.
    assert longest_window_hit([None, None, None, None, 5, None, None], chunk, 4) == 6
    assert longest_window_hit([1, None, 3, None, None], chunk, 4) == 4
    assert longest_window_hit([1, None, None, 4, None], AttentionChunk(12), 4) == 4
    llama4 = (AttentionChunk(8), AttentionChunk(8), AttentionChunk(8), None) * 2
    groups = engine_kv_groups(llama4)
    assert groups == (KVCacheGroupSpec(None, (3, 7)), KVCacheGroupSpec(AttentionChunk(8), (0, 1)),
                      KVCacheGroupSpec(AttentionChunk(8), (2, 4)), KVCacheGroupSpec(AttentionChunk(8), (5, 6)))
    assert engine_kv_groups((AttentionChunk(8),) * 3) == (KVCacheGroupSpec(AttentionChunk(8), (0, 1, 2)),)
    assert engine_kv_groups(llama4, mixed_groups=False) == (KVCacheGroupSpec(None, tuple(range(8))),)


@pytest.mark.parametrize("chunk,block_size", [(8, 4), (10, 4), (7, 4), (5, 8), (16, 4)])
def test_chunked_group_holds_at_most_chunk_blocks_plus_one(chunk, block_size):
    """A chunked group keeps only the blocks of the current chunk: at most ceil(chunk / block_size) + 1 while
    decoding; a full group beside it keeps every block."""
    kv = KVCacheManager(num_blocks=128, block_size=block_size, group_windows=(None, AttentionChunk(chunk)))
    request = Request(request_id="a", prompt_token_ids=list(range(3, 3 + 3 * chunk - 1)))
    assert kv.allocate_slots(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    held = [sum(b != NULL_BLOCK_ID for b in request.block_ids[1::2])]
    for step in range(3 * chunk):
        assert kv.allocate_slots(request, 1)
        held.append(sum(b != NULL_BLOCK_ID for b in request.block_ids[1::2]))
        full = request.block_ids[0::2]
        assert NULL_BLOCK_ID not in full and len(full) == -(-(request.num_computed_tokens + 1) // block_size)
        # The chunked group holds exactly the blocks from its chunk's start to the new token's.
        start = request.num_computed_tokens // chunk * chunk // block_size
        assert [b != NULL_BLOCK_ID for b in request.block_ids[1::2]] == [i >= start for i in range(len(full))]
        request.output_token_ids.append(7 + step)
        request.num_computed_tokens += 1
        kv.cache_full_blocks(request)
    assert max(held[1:]) <= -(-chunk // block_size) + 1
    assert max(held[1:]) >= -(-chunk // block_size)  # a whole chunk's blocks while its last token decodes
    kv.free(request)
    assert kv.num_free_blocks == kv.num_usable_blocks and all(b.ref_cnt == 0 for b in kv.blocks)


def test_released_blocks_stay_hits_and_window_hit_needs_only_the_window():
    kv = KVCacheManager(num_blocks=32, block_size=4, group_windows=(8,))
    first = Request(request_id="a", prompt_token_ids=list(range(3, 27)))  # 24 tokens, 6 blocks
    assert kv.allocate_slots(first, 24)
    first.num_computed_tokens = 24
    kv.cache_full_blocks(first)
    _decode(kv, first, 1)
    assert first.block_ids[:3] == [NULL_BLOCK_ID] * 3  # tokens 0..11 slid out of position 24's window
    kv.free(first)
    second = Request(request_id="b", prompt_token_ids=list(range(3, 27)) + [99, 98])
    blocks, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 24 and blocks[:4] == [NULL_BLOCK_ID] * 4 and NULL_BLOCK_ID not in blocks[4:]
    assert kv.allocate_slots(second, 2, blocks)
    assert second.num_computed_tokens == 24 and kv.prefix_cache_hits == 24
    kv.free(second)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_window_hit_after_the_early_blocks_were_evicted():
    kv = KVCacheManager(num_blocks=9, block_size=4, group_windows=(8,))  # 8 usable
    first = Request(request_id="a", prompt_token_ids=list(range(3, 27)))
    assert kv.allocate_slots(first, 24)
    first.num_computed_tokens = 24
    kv.cache_full_blocks(first)
    head = first.block_ids[:2]
    kv.free(first)
    # Evict the prefix's first two blocks: a hit of 24 tokens needs only blocks 4 and 5 (position 24's window).
    kv._free_queue.move_to_end(head[1], last=False)
    kv._free_queue.move_to_end(head[0], last=False)
    filler = Request(request_id="f", prompt_token_ids=[200] * 9)
    assert kv.allocate_slots(filler, 8)
    assert kv.blocks[head[0]].block_hash is None  # evicted
    second = Request(request_id="b", prompt_token_ids=list(range(3, 27)) + [99])
    blocks, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 24 and blocks[:4] == [NULL_BLOCK_ID] * 4


def test_fork_copy_on_write_and_swap_with_null_entries():
    kv = KVCacheManager(num_blocks=32, block_size=4, group_windows=(8,), num_host_blocks=8)
    parent = Request(request_id="p", prompt_token_ids=list(range(3, 21)))  # 18 tokens
    assert kv.allocate_slots(parent, 18)
    parent.num_computed_tokens = 18
    kv.cache_full_blocks(parent)
    assert kv.allocate_slots(parent, 1)  # releases blocks 0 .. 1 (position 18's window starts at 11)
    assert parent.block_ids[:2] == [NULL_BLOCK_ID] * 2
    child = Request(request_id="c", prompt_token_ids=list(range(3, 21)))
    kv.fork(parent, child)
    assert child.block_ids == parent.block_ids
    shared_last = parent.block_ids[4]
    assert kv.allocate_slots(child, 1)  # writes position 18 into the shared partial block: copy-on-write
    assert child.block_ids[4] != shared_last and kv.take_block_copies() == [(shared_last, child.block_ids[4])]
    # Swap: only the blocks still held travel; the null entries stay null.
    held = [b for b in child.block_ids if b != NULL_BLOCK_ID]
    assert kv.can_swap_out(child)
    copies = kv.swap_out(child)
    assert [d for d, _ in copies] == held and child.host_block_ids[:2] == [-1, -1]
    assert kv.num_free_host_blocks == 8 - len(held)
    assert kv.can_swap_in(child, 1)
    back = kv.swap_in(child)
    assert child.block_ids[:2] == [NULL_BLOCK_ID] * 2 and len(back) == len(held)
    assert kv.num_free_host_blocks == 8
    for request in (parent, child):
        kv.free(request)
    assert kv.num_free_blocks == kv.num_usable_blocks and all(b.ref_cnt == 0 for b in kv.blocks)


def test_groups_share_one_pool_with_interleaved_tables():
    """A full group and a sliding group (window 8, block 4): two entries per block from one pool, the sliding
    group's released past its window, hits valid for both groups, forks copied per group on write, swap."""
    kv = KVCacheManager(num_blocks=40, block_size=4, group_windows=(None, 8), num_host_blocks=16)
    first = Request(request_id="a", prompt_token_ids=list(range(3, 27)))  # 24 tokens: 6 blocks per group
    assert kv.can_allocate(first, 24) and kv.allocate_slots(first, 24)
    assert len(first.block_ids) == 12 == kv.blocks_needed(24) and kv.num_free_blocks == 39 - 12
    first.num_computed_tokens = 24
    kv.cache_full_blocks(first)
    held = _decode(kv, first, 7)  # 31 tokens computed, the last block partial
    full, sliding = first.block_ids[0::2], first.block_ids[1::2]
    assert NULL_BLOCK_ID not in full and len(full) == 8
    assert sliding[:5] == [NULL_BLOCK_ID] * 5 and NULL_BLOCK_ID not in sliding[5:] and max(held) <= 8 + 3
    assert kv.max_blocks_per_request(32, 1) == 8 + 3
    # The full group's blocks are cached and so are the sliding group's (released ones stay hashed when free).
    second = Request(request_id="b", prompt_token_ids=list(range(3, 27)) + [99])
    blocks, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 24 and blocks[0::2] == full[:6] and blocks[1::2][:4] == [NULL_BLOCK_ID] * 4
    assert blocks[1::2][4:] == [kv._cached_block_by_hash[first.block_hashes[i] + (1).to_bytes(2, "little")]
                                for i in (4, 5)]
    assert kv.allocate_slots(second, 1, blocks) and second.num_computed_tokens == 24
    # A fork writing into its shared partial block copies it in both groups.
    child = Request(request_id="c", prompt_token_ids=list(first.prompt_token_ids))
    child.output_token_ids = list(first.output_token_ids)
    kv.fork(first, child)
    assert kv.needs_copy(child)
    assert kv.allocate_slots(child, 1)
    copies = kv.take_block_copies()
    assert len(copies) == 2 and {src for src, _ in copies} == {first.block_ids[-2], first.block_ids[-1]}
    assert child.block_ids[1::2][:6] == [NULL_BLOCK_ID] * 6  # position 31's window starts in block 6
    num_held = sum(b != NULL_BLOCK_ID for b in child.block_ids)
    copies = kv.swap_out(child)
    assert len(copies) == num_held == 8 + 2 and child.host_block_ids[1::2][:6] == [-1] * 6
    assert kv.can_swap_in(child) and len(kv.swap_in(child)) == num_held
    for request in (first, second, child):
        kv.free(request)
    assert kv.num_free_blocks == kv.num_usable_blocks and all(b.ref_cnt == 0 for b in kv.blocks)
    assert kv.num_free_host_blocks == 16


def test_capacity_of_gemma3_12b_with_groups():
    """The issue's target: >= 4x the requests at 32k context with groups (dummy shape, analytic)."""
    config = preset_config("gemma-3-12b")
    assert config.layer_windows == GEMMA3_12B_WINDOWS
    page = 2 * 16 * config.num_key_value_heads * config.head_dim * 2
    kwargs = dict(kv_budget_bytes=40 << 30, page_bytes=page, block_size=16, context_len=32768, max_chunk_tokens=1)
    flat = kv_pool_capacity(config.layer_windows, grouped=False, **kwargs)
    grouped = kv_pool_capacity(config.layer_windows, grouped=True, **kwargs)
    assert (flat.num_groups, grouped.num_groups, grouped.layers_per_block) == (1, 6, 8)
    assert grouped.blocks_per_request == 2048 + 5 * 65 and flat.blocks_per_request == 2048
    assert grouped.max_requests >= 4 * flat.max_requests > 0
    # Without windows the layouts agree.
    llama = kv_pool_capacity((None,) * 32, grouped=True, **kwargs)
    assert llama == kv_pool_capacity((None,) * 32, grouped=False, **kwargs)


def test_capacity_benchmark_reports_gemma3_12b_on_an_h100(capsys):
    report = kv_capacity.main(["--device-memory-gib", "79.6"])
    assert json.loads(capsys.readouterr().out) == report
    flat, grouped = report["flat"], report["grouped"]
    assert (flat["blocks_per_request"], grouped["blocks_per_request"]) == (2048, 2048 + 5 * 65)
    assert flat["block_bytes"] == 6 * grouped["block_bytes"] == 48 * 2 * 16 * 8 * 256 * 2
    assert grouped["num_blocks"] == report["kv_budget_bytes"] // grouped["block_bytes"]
    assert report["requests_ratio"] >= 4 and flat["max_requests"] > 0


# (checkpoint config, pool blocks, the manager's group windows): Mistral's every layer slides (one group); six Gemma 3
# layers, every third full: a full group and two sliding groups of two layers (two pool slots).
SLIDING_FAMILIES = {
    "mistral": (tiny_config("mistral", sliding_window=8), 7, (8,)),
    "gemma3": (tiny_config("gemma3", num_hidden_layers=6, sliding_window_pattern=3), 17, (None, 8, 8)),
}


@pytest.mark.parametrize("family,mode,async_scheduling,parallel", [
    ("mistral", "recompute", False, {}), ("mistral", "swap", False, {}), ("gemma3", "recompute", True, {}),
    ("gemma3", "swap", False, {}), ("gemma3", "swap", False, {"tensor_parallel_size": 2})])
def test_engine_with_sliding_groups_matches_transformers_under_preemption(tmp_path, family, mode, async_scheduling,
                                                                          parallel):
    """Windows of 8, prompts of two to three windows in one continuous batch, chunked prefill in 16-token steps
    across the window edge, a pool too small for the batch (Mistral's: 6 blocks, less than one 64-token sequence
    without groups; Gemma's: 16, one 64-token sequence's 8 full and 2 x 4 sliding blocks): preemption. A sliding group
    holds at most ceil((W - 1 + 16) / 8) + 1 = 4 blocks of a request at any step; greedy fp32 tokens equal
    transformers', on one device and with the groups' pages split over two devices (tensor parallel)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf_config, num_blocks, windows = SLIDING_FAMILIES[family]
    save_random_hf_checkpoint(hf_config, tmp_path, seed=3)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (17, 22, 19, 24, 20)]
    max_tokens = 16
    engine = LLMEngine(EngineArgs(model=str(tmp_path), dtype="float32", max_model_len=64, block_size=8,
                                  max_num_batched_tokens=16, max_num_seqs=8, num_gpu_blocks_override=num_blocks,
                                  preemption_mode=mode, **({"swap_space": 0.01} if mode == "swap" else {}),
                                  async_scheduling=async_scheduling, seed=0, **parallel), use_tqdm=False)
    core = engine.engine_core
    kv = core.kv_cache_manager
    assert kv.group_windows == windows
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    sliding_groups = [g for g, window in enumerate(windows) if window is not None]
    tokens: dict[str, list[int]] = {}
    most_held = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.outputs[0].token_ids)
        for request in core.scheduler.running:
            for g in sliding_groups:
                entries = request.block_ids[g::len(windows)]
                most_held = max(most_held, sum(b != NULL_BLOCK_ID for b in entries))
    assert 2 <= most_held <= 4
    assert core.stats()["num_preemptions"] > 0
    if mode == "swap":
        assert core.stats()["num_swap_outs"] > 0
    with torch.no_grad():
        expected = [hf_model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == expected
    assert kv.num_free_blocks == kv.num_usable_blocks and kv.num_free_host_blocks == kv.num_host_blocks
    assert core.runner.num_compiles_since_warmup == 0


class GroupedFakeRunner(FakeRunner):
    """``tests.test_scheduler.FakeRunner`` for a manager with KV-cache groups: every group's entry of a position
    holds the position's prefix state and its group; each row reads back, per group, the positions its step's queries
    see (a sliding group's from the window of the first new token) through the runner's mirrored table, which keeps
    stale entries where the manager nulled them (the kernel masks those positions)."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int) -> None:
        super().__init__(kv, max_num_seqs)
        self.windows = kv.group_windows

    def step(self, out):
        self.apply_diff_and_copies(out)
        bs, groups, rows = self.block_size, len(self.windows), out.scheduled_rows()
        for r in rows:  # the runner's table agrees with the request's wherever the request holds a block
            table = self.tables[r.request_id]
            if not r.request.is_finished:
                assert all(b in (NULL_BLOCK_ID, t) for b, t in zip(r.request.block_ids, table)), r.request_id
            kv_len = r.num_computed_tokens + r.num_new_tokens
            states = prefix_states(self.tokens[r.request_id][:kv_len])
            for p in range(r.num_computed_tokens, kv_len):
                for g in range(groups):
                    block = table[p // bs * groups + g]
                    assert block != NULL_BLOCK_ID, f"{r.request_id} writes position {p} of group {g} to the null block"
                    self.device[block, p % bs] = states[p] * groups + g
        sampled, last_read = {}, {}
        for r in rows:
            if r.fork_parent is not None:
                sampled[r.request_id] = last_read[r.fork_parent] % VOCAB
                continue
            kv_len = r.num_computed_tokens + r.num_new_tokens
            table = self.tables[r.request_id]
            states = prefix_states(r.request.all_token_ids[:kv_len])
            for g, window in enumerate(self.windows):
                if isinstance(window, AttentionChunk):  # the chunk of the step's first query
                    first = r.num_computed_tokens // window.size * window.size
                else:
                    first = 0 if window is None else max(0, r.num_computed_tokens - window + 1)
                read = [int(self.device[table[p // bs * groups + g], p % bs]) for p in range(first, kv_len)]
                assert read == [s * groups + g for s in states[first:]], f"{r.request_id} read another's K/V"
            last_read[r.request_id] = states[-1]
            if r.samples:
                sampled[r.request_id] = states[-1] % VOCAB
        return sampled


@pytest.mark.parametrize("windows,num_blocks", [((3,), 9), ((None, 3, 3), 31), ((None, AttentionChunk(4)), 21),
                                               ((AttentionChunk(3),), 8)])
def test_random_workload_with_groups_never_leaks(windows, num_blocks):
    """The scheduler's random workload (prefix hits on a small vocabulary, aborts, priority preemption with swap) on a
    manager with groups: no row ever reads K/V that is not its own, and everything is freed at the end."""
    kv = KVCacheManager(num_blocks, 2, num_host_blocks=12, group_windows=windows)
    sched = Scheduler(kv, 4, 9, 24, preemption_mode="swap", policy="priority")
    all_reqs = run_random_workload(sched, GroupedFakeRunner(kv, 4), seed=2)
    assert all(r.is_finished for r in all_reqs)
    assert kv.num_free_blocks == kv.num_usable_blocks and kv.num_free_host_blocks == kv.num_host_blocks
    assert all(b.ref_cnt == 0 for b in kv.blocks)
    assert sched.num_preemptions > 0 and sched.num_swap_outs > 0 and kv.prefix_cache_hits > 0


def test_groups_off_without_windows_keep_todays_layout():
    """No window: one group, a (k, v) pair per layer, the step buffer's fields and the block bytes as before."""
    llama = ModelConfig.from_hf_config(tiny_config("llama", num_hidden_layers=3))
    assert KVPoolLayout.for_config(llama) == KVPoolLayout(1, 3, (0, 0, 0), (0, 1, 2))
    assert kv_bytes_per_block(llama, 16, "float32") == 3 * 2 * 16 * 2 * 16 * 4
    plain = StepLayout(32, 8, 4, 8)
    assert plain.fields == StepLayout(32, 8, 4, 8, num_kv_groups=1).fields
    assert plain.fields["slot_mapping"][1] - plain.fields["slot_mapping"][0] == 32
    assert plain.fields["block_tables"][1] - plain.fields["block_tables"][0] == 8 * 4
    gemma = ModelConfig.from_hf_config(tiny_config("gemma3", num_hidden_layers=6, sliding_window_pattern=3))
    layout = KVPoolLayout.for_config(gemma)
    assert (layout.num_groups, layout.num_slots) == (3, 2)
    assert [(layout.group_of_layer[i], layout.slot_of_layer[i]) for i in range(6)] == [
        (1, 0), (1, 1), (0, 0), (2, 0), (2, 1), (0, 1)]
    assert KVPoolLayout.for_config(gemma, mixed_groups=False) == KVPoolLayout(1, 6, (0,) * 6, tuple(range(6)))
    assert kv_bytes_per_block(gemma, 16, "float32") * 3 == kv_bytes_per_block(gemma, 16, "float32", mixed_groups=False)


# Each family's KV-cache groups (a plain Llama for comparison): Gemma 3's full and sliding groups sharing two pool
# slots, Llama 4's chunked RoPE layers beside its NoPE full layer, gpt-oss's alternating sliding and full layers,
# Mistral's every layer sliding (one group).
IN_PLACE_FAMILIES = {
    "gemma3": tiny_config("gemma3", num_hidden_layers=6, sliding_window_pattern=3),
    "llama4": tiny_config("llama4"),
    "gpt_oss": tiny_config("gpt_oss"),
    "mistral": tiny_config("mistral", sliding_window=8),
    "llama": tiny_config("llama", num_hidden_layers=3),
}


@pytest.mark.parametrize("family", sorted(IN_PLACE_FAMILIES))
def test_step_updates_the_donated_pool_in_place(family):
    """The compiled step of a decode bucket (one token) and of the widest bucket writes every pool output into its
    donated argument (aliased bytes = the pool's) and allocates scratch far below the pool's bytes: with groups,
    several layers write one slot in a step, with attention reads between, and none of it may copy the pool (on
    the H100 a Gemma-3-12B step needed a second pool). 4000 blocks of 16 tokens: a pool of 16 to 64 MB beside a
    step's activations of under 1 MB."""
    from models.loader import init_dummy_model
    from paged_jax.worker.model_runner import ModelRunner
    from paged_jax.worker.warm_up import compile_forward_apart

    config = ModelConfig.from_hf_config(IN_PLACE_FAMILIES[family])
    model = init_dummy_model(config, dtype=np.float32, seed=0)
    runner = ModelRunner(model, config, num_blocks=4000, block_size=16, max_model_len=64, max_num_seqs=2,
                         max_num_batched_tokens=16, eos_token_ids=[2])
    pool_bytes = sum(x.size * x.dtype.itemsize for pages in runner.abstract_kv_pool() for x in pages)
    for num_tokens, num_seqs in (min(runner.buckets), max(runner.buckets)):
        memory = compile_forward_apart(runner, num_tokens, num_seqs).memory_analysis()
        assert memory.alias_size_in_bytes == pool_bytes, (num_tokens, num_seqs)
        assert memory.temp_size_in_bytes < pool_bytes / 8, (num_tokens, num_seqs, memory.temp_size_in_bytes,
                                                            pool_bytes)
