"""Copy-on-write forks: n > 1 and best_of (one prefill, shared prompt blocks), beam search (vLLM's semantics, against
transformers and a brute-force reference), preemption and aborts of forked groups (SmolLM2 fp32, CPU)."""

import itertools
import math

import numpy as np
import pytest
import torch

from paged_jax.engine.beam_search import BeamSearchOutput, get_beam_search_score
from paged_jax.sampling_params import BeamSearchParams
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import Request
from paged_jax.entrypoints.llm import LLM
from paged_jax.sampling_params import SamplingParams
from paged_jax.core.request import child_seed
from tests.test_engine import TEXT, TIGHT_BATCHED_TOKENS, TIGHT_BLOCKS, assert_clean, make_engine, run_to_completion

EOS = 2


@pytest.fixture(scope="module")
def engine():
    """The roomy engine of tests/test_engine.py (same compiled shapes) with prefix caching off: whatever is shared
    here is shared by forking."""
    eng = make_engine(enable_prefix_caching=False)
    yield eng
    assert_clean(eng)


@pytest.fixture(scope="module")
def long_prompt(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(TEXT)[:200]
    assert len(ids) == 200
    return ids


def _computed(kv: KVCacheManager, request_id: str, num_tokens: int) -> Request:
    request = Request(request_id, list(range(1, num_tokens + 1)))
    assert kv.allocate_slots(request, num_tokens)
    request.num_computed_tokens = num_tokens
    return request


def test_fork_and_copy_on_write_bookkeeping():
    kv = KVCacheManager(num_blocks=12, block_size=4, enable_prefix_caching=False, num_host_blocks=4)
    parent = _computed(kv, "p", 6)  # one full block + a partial one
    children = [Request(f"c{i}", list(parent.prompt_token_ids)) for i in range(2)]
    for child in children:
        kv.fork(parent, child)
        assert child.block_ids == parent.block_ids and child.num_computed_tokens == 6
    assert [kv.blocks[b].ref_cnt for b in parent.block_ids] == [3, 3]
    # The first two writers get copies of the shared partial block; the last one writes in place.
    for request in (children[0], parent):
        assert kv.needs_copy(request) and kv.allocate_slots(request, 1)
    assert not kv.needs_copy(children[1]) and kv.allocate_slots(children[1], 1)
    shared_full, partial = children[1].block_ids
    copies = kv.take_block_copies()
    assert copies == [(partial, children[0].block_ids[1]), (partial, parent.block_ids[1])]
    assert kv.blocks[shared_full].ref_cnt == 3 and kv.blocks[partial].ref_cnt == 1
    for request in (parent, *children):
        kv.free(request)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_copy_sources_and_destinations_freed_within_a_pass():
    kv = KVCacheManager(num_blocks=12, block_size=4, enable_prefix_caching=False, num_host_blocks=4)
    parent = _computed(kv, "p", 6)
    child = Request("c", list(parent.prompt_token_ids))
    kv.fork(parent, child)
    assert kv.allocate_slots(child, 1)  # copy: partial -> child's new block
    src, dst = parent.block_ids[1], child.block_ids[1]
    kv.free(parent)  # the copy's source loses its last holder in the same pass: kept out of the free queue
    assert kv.blocks[src].ref_cnt == 0 and src not in kv._free_queue  # a swap-in of this pass cannot land in it
    assert kv.take_block_copies() == [(src, dst)]
    assert src in kv._free_queue
    kv.free(child)
    # A destination freed in the same pass drops its copy; a swap-out reads the pending copy's source.
    parent = _computed(kv, "p2", 6)
    child = Request("c2", list(parent.prompt_token_ids))
    kv.fork(parent, child)
    assert kv.allocate_slots(child, 1)
    src, dst = parent.block_ids[1], child.block_ids[1]
    pairs = kv.swap_out(child)
    assert [device for device, _ in pairs] == [parent.block_ids[0], src]
    assert kv.take_block_copies() == []
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == kv.num_usable_blocks and kv.num_free_host_blocks == kv.num_host_blocks


def _trace_steps(engine: LLMEngine, record: list):
    """Wrap ``engine.engine_core.scheduler.schedule`` to record every SchedulerOutput."""
    schedule = engine.engine_core.scheduler.schedule

    def traced():
        out = schedule()
        record.append(out)
        return out

    engine.engine_core.scheduler.schedule = traced
    return schedule


def test_n8_computes_the_prompt_once_and_shares_its_blocks(engine, long_prompt):
    kv = engine.engine_core.kv_cache_manager
    bs = kv.block_size
    num_tokens, n, seed = 24, 8, 11
    params = SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=num_tokens, ignore_eos=True)
    steps = []
    schedule = _trace_steps(engine, steps)
    try:
        engine.add_request("fan", long_prompt, params)
        peak, totals = 0, None
        while engine.has_unfinished_requests():
            for output in engine.step():
                totals = output if totals is None else (totals.add(output) or totals)
            peak = max(peak, kv.num_usable_blocks - kv.num_free_blocks)
    finally:
        engine.engine_core.scheduler.schedule = schedule
    # One prefill: the prompt's tokens are scheduled once in all.
    prompt_tokens = sum(s.num_new_tokens for out in steps for s in out.scheduled_rows()
                        if s.num_computed_tokens < len(long_prompt))
    assert prompt_tokens == len(long_prompt)
    assert sum(1 for out in steps for s in out.scheduled_rows() if s.fork_parent is not None) == n - 1  # fork rows
    # KV held: the prompt's full blocks once, then per sequence its copy of the partial block and its own blocks.
    shared = len(long_prompt) // bs
    per_sequence = kv.blocks_needed(len(long_prompt) + num_tokens) - shared
    assert peak == shared + n * per_sequence < n * kv.blocks_needed(len(long_prompt) + num_tokens)
    assert sum(len(out.block_copies) for out in steps) == n - 1  # the last writer keeps the original
    assert [c.index for c in totals.outputs] == list(range(n))
    # Each sequence is what a lone request with its seed gives: the shared prompt blocks and copies are right.
    alone = run_to_completion(engine, [long_prompt] * n,
                              [SamplingParams(temperature=1.0, seed=child_seed(seed, i), max_tokens=num_tokens,
                                              ignore_eos=True) for i in range(n)], prefix="alone")
    assert [c.token_ids for c in totals.outputs] == [o.outputs[0].token_ids for o in alone]
    assert len({tuple(c.token_ids) for c in totals.outputs}) > 1
    assert_clean(engine)


@pytest.mark.parametrize("n", [2, 3])
def test_fork_step_whose_tokens_equal_its_rows_feeds_every_prompt_token(engine, long_prompt, n):
    """A prompt of n tokens forks n - 1 children in the step that computes it: that step has as many tokens as rows
    (the fork rows carry none), yet it is no all-decode step. Greedy, every sequence equals the n = 1 output."""
    prompt = long_prompt[:n]
    alone = run_to_completion(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                              prefix=f"alone{n}-")[0]
    forked = run_to_completion(engine, [prompt], SamplingParams(n=n, temperature=0.0, max_tokens=6, ignore_eos=True),
                               prefix=f"forked{n}-")[0]
    assert [list(c.token_ids) for c in forked.outputs] == [list(alone.outputs[0].token_ids)] * n


def test_best_of_returns_the_top_cumulative_logprobs(engine, long_prompt):
    prompt = long_prompt[:40]
    all_four = run_to_completion(engine, [prompt], SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=6,
                                                                  logprobs=0), prefix="four")[0].outputs
    best = run_to_completion(engine, [prompt], SamplingParams(n=2, best_of=4, temperature=1.0, seed=5,
                                                              max_tokens=6), prefix="best")[0].outputs
    ranked = sorted(all_four, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.index for c in best] == [0, 1]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked]
    np.testing.assert_allclose([c.cumulative_logprob for c in best], [c.cumulative_logprob for c in ranked],
                               rtol=1e-5)
    assert best[0].logprobs is None  # ranked by logprob, but none were asked for
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=2, best_of=3, temperature=0.0)
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)
    assert_clean(engine)


def test_aborting_forked_groups_leaks_nothing(engine, long_prompt):
    engine.add_request("pending", long_prompt, SamplingParams(n=4, temperature=1.0, max_tokens=30))
    engine.step()  # the first prefill chunk: the other sequences are still pending forks
    engine.abort_request("pending")
    engine.add_request("forked", long_prompt[:50], SamplingParams(n=4, best_of=5, temperature=1.0, max_tokens=30))
    engine.add_request("beams", long_prompt[:50], BeamSearchParams(beam_width=3, max_tokens=30))
    for _ in range(6):
        engine.step()
    running = {r.request_id for r in engine.engine_core.scheduler.running}
    assert {"forked::0", "forked::4"} <= running and sum("beams::" in r for r in running) == 3
    assert any(block.ref_cnt > 1 for block in engine.engine_core.kv_cache_manager.blocks)  # sharing in progress
    engine.abort_request(["forked", "beams"])
    assert engine.step() == []
    assert_clean(engine)


# Swap of a forked group: slow (make test-all) to keep CI's suite in its time budget; recompute stays in CI, and
# swap preemption itself is covered by tests/test_kv_groups.py's and tests/test_llama4.py's swap cases.
@pytest.mark.parametrize("mode", ["recompute", pytest.param("swap", marks=pytest.mark.slow)])
def test_forked_groups_survive_preemption(engine, long_prompt, mode):
    """Forced preemption (a 39-block pool) of n = 3 groups gives the roomy engine's outputs: greedy under recompute
    (async scheduling), seeded sampling under swap."""
    prompts = [long_prompt[i * 20:i * 20 + 90] for i in range(4)]
    if mode == "recompute":
        params = SamplingParams(n=3, temperature=0.0, max_tokens=24, ignore_eos=True)
    else:
        params = [SamplingParams(n=3, temperature=1.0, seed=s, max_tokens=24, ignore_eos=True) for s in range(4)]
    roomy = run_to_completion(engine, prompts, params, prefix=f"roomy-{mode}")
    chunked = dict(max_num_batched_tokens=TIGHT_BATCHED_TOKENS) if mode == "recompute" else {}  # chunked prefill too
    tight = make_engine(num_gpu_blocks_override=TIGHT_BLOCKS, preemption_mode=mode, swap_space=0.05,
                        async_scheduling=mode == "recompute", **chunked)
    outputs = run_to_completion(tight, prompts, params)
    assert tight.stats()["num_preemptions"] > 0
    if mode == "swap":
        assert tight.stats()["num_swap_outs"] > 0
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[c.token_ids for c in o.outputs] for o in roomy]
    assert_clean(tight)


def _hf_logprobs(model, token_ids) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([list(token_ids)])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1).numpy()


def _vllm_beam_search_reference(model, prompt, beam_width, max_tokens, length_penalty, ignore_eos):
    """vLLM's beam search, brute force: every step recomputes each beam's next-token logprobs with transformers
    (no cache), candidates = its 2 * beam_width most likely tokens."""
    beams, completed = [(list(prompt), 0.0)], []

    def score(item):
        return get_beam_search_score(item[0], item[1], EOS, length_penalty)

    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in beams:
            logprobs = _hf_logprobs(model, tokens)
            for token in np.argsort(-logprobs, kind="stable")[:2 * beam_width].tolist():
                new = (tokens + [token], cum + float(logprobs[token]))
                (completed if token == EOS and not ignore_eos else candidates).append(new)
        beams = sorted(candidates, key=score, reverse=True)[:beam_width]
        if not beams:
            break
    return sorted(completed + beams, key=score, reverse=True)[:beam_width]


def _as_llm(engine: LLMEngine) -> LLM:
    llm = LLM.__new__(LLM)  # LLM.beam_search over the module's engine (no second engine build)
    llm.llm_engine, llm._request_counter = engine, itertools.count()
    return llm


def test_beam_search_without_eos_equals_transformers(engine, hf_smollm2_model, smollm2_tokenizer):
    """With EOS out of the picture (ignore_eos here; an EOS id that never ranks there) vLLM's beam search and
    transformers' agree: same beams, same order."""
    prompts = [smollm2_tokenizer.encode(text) for text in ("The capital of France is", "def fibonacci(n):")]
    llm = _as_llm(engine)
    params = BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True, length_penalty=0.7)
    results = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert all(isinstance(r, BeamSearchOutput) and len(r.sequences) == 4 for r in results)
    unused_eos = hf_smollm2_model.config.vocab_size - 1
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            hf = hf_smollm2_model.generate(torch.tensor([prompt]), num_beams=4, num_return_sequences=4,
                                           do_sample=False, max_new_tokens=6, length_penalty=0.7,
                                           early_stopping=True, eos_token_id=unused_eos, pad_token_id=unused_eos,
                                           output_scores=True, return_dict_in_generate=True)
        assert [s.tokens for s in result.sequences] == hf.sequences.tolist()
        for sequence in result.sequences:
            assert sequence.text == smollm2_tokenizer.decode(sequence.tokens)
            assert len(sequence.logprobs) == 6 and sequence.finish_reason == "length"
            total = sum(entry[token].logprob for entry, token in zip(sequence.logprobs, sequence.tokens[-6:]))
            assert math.isclose(sequence.cum_logprob, total, rel_tol=1e-6)
    assert_clean(engine)


def test_beam_search_with_eos_equals_vllm_semantics(engine, hf_smollm2_model, smollm2_tokenizer):
    prompt = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2? Answer in one word."}],
                                                   tokenize=True, add_generation_prompt=True)
    if hasattr(prompt, "input_ids"):
        prompt = prompt["input_ids"]
    params = BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=1.0)
    engine.add_request("eos-beams", list(prompt), params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(outputs) == 1 and outputs[0].finished  # one output, when finished
    got = outputs[0].outputs
    ref = _vllm_beam_search_reference(hf_smollm2_model, prompt, 3, 10, 1.0, ignore_eos=False)
    assert any(tokens[-1] == EOS for tokens, _ in ref)  # the case under test: completed beams compete
    for completion, (tokens, cum) in zip(got, ref):
        generated = tokens[len(prompt):]
        stopped = generated[-1] == EOS
        assert completion.token_ids == (generated[:-1] if stopped else generated)  # EOS only in stop_reason
        assert completion.finish_reason == ("stop" if stopped else "length")
        assert completion.stop_reason == (EOS if stopped else None)
        assert completion.text == smollm2_tokenizer.decode(completion.token_ids)
        assert math.isclose(completion.cumulative_logprob, cum, rel_tol=1e-4, abs_tol=1e-4)
    assert_clean(engine)
