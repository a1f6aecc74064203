"""LLMEngine on the real SmolLM2-135M-Instruct (fp32, CPU): token-for-token equality with transformers greedy decoding
under batching, chunked prefill, preemption (recompute and swap) and prefix caching; sampling semantics; input
validation; no block leaks and no compilation after warm-up."""

import copy
import time

import jax
import numpy as np
import pytest
import torch

from paged_jax.config import EngineArgs
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.sampling_params import SamplingParams
from paged_jax.engine.messages import (CLIENT_MESSAGE_DECODER, CORE_MESSAGE_DECODER, AddRequests, EngineCoreOutputs,
                                       encode)
from paged_jax.engine.output_processor import OutputProcessor

MAX_NEW_TOKENS = 20
MAX_MODEL_LEN = 256
# Same pool size (and so the same compiled shapes, via the persistent compilation cache) for every roomy engine.
ROOMY_BLOCKS = 400
TIGHT_BLOCKS = 40  # 39 usable blocks of 16 tokens: far less than 16 running sequences of ~100 tokens need
# The tight recompute engines' step budget: prompts prefill in several chunks. Tests in other files that build a tight
# engine use it too (tests/test_parallel_sampling.py, test_structured_outputs.py): one compile of those shapes.
TIGHT_BATCHED_TOKENS = 32

TEXT = (
    "The history of astronomy spans thousands of years. Early civilizations watched the sky to keep track of the "
    "seasons, to plan harvests and to navigate across deserts and oceans. The Babylonians recorded the motions of "
    "the planets on clay tablets, and Greek thinkers such as Aristarchus suggested that the Earth moves around the "
    "Sun. During the Renaissance, Copernicus, Kepler and Galileo transformed our understanding of the solar system. "
    "Galileo pointed a small telescope at Jupiter and discovered four moons circling the planet. Newton later "
    "explained the motion of the planets with a single law of gravitation. In the twentieth century, astronomers "
    "learned that the Milky Way is only one of billions of galaxies, and that the universe is expanding. Today, "
    "space telescopes observe light from stars that formed shortly after the Big Bang, while robotic rovers drive "
    "across the dusty plains of Mars looking for signs of ancient water. Cooking, too, has a long history: bread "
    "was baked in Egypt, noodles were made in China, and spices travelled along trade routes that connected "
    "distant cultures. Music, mathematics and medicine all grew through the same kind of exchange of ideas."
)
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
    "List three prime numbers.", "Who wrote Hamlet?", "Give me a tip for learning to cook.",
    "Why is the sky blue?", "Translate 'good morning' into Spanish.",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def workload(tokenizer):
    """32 prompts (token ids), lengths ~5..200: raw windows of TEXT and chat-templated questions with context."""
    text_ids = tokenizer.encode(TEXT)
    assert len(text_ids) >= 200
    prompts = []
    for i in range(32):
        length = 5 + (i * 53) % 190
        if i % 2 == 0:
            start = (i * 7) % max(1, len(text_ids) - length)
            prompts.append(text_ids[start:start + length])
        else:
            context = tokenizer.decode(text_ids[:max(0, length - 30)])
            content = (context + "\n\n" if context else "") + QUESTIONS[i % len(QUESTIONS)]
            prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                         tokenize=True, add_generation_prompt=True))
            if hasattr(prompts[-1], "input_ids"):  # transformers 5 may return a BatchEncoding
                prompts[-1] = prompts[-1]["input_ids"]
    lengths = [len(p) for p in prompts]
    assert min(lengths) <= 10 and max(lengths) >= 150
    return prompts


@pytest.fixture(scope="module")
def reference(workload, hf_greedy):
    return hf_greedy.many(workload, MAX_NEW_TOKENS)


def make_engine(**overrides) -> LLMEngine:
    settings = dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=16, max_num_batched_tokens=128,
                    num_gpu_blocks_override=ROOMY_BLOCKS, seed=0)
    settings.update(overrides)
    return LLMEngine(EngineArgs(**settings), use_tqdm=False)


def assert_clean(engine: LLMEngine) -> None:
    """No unfinished request, every device and host block free, nothing compiled since warm-up."""
    assert not engine.has_unfinished_requests()
    kv = engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert all(block.ref_cnt == 0 for block in kv.blocks)
    assert kv.num_free_host_blocks == kv.num_host_blocks
    assert engine.engine_core.scheduler.num_running == 0 and engine.engine_core.scheduler.num_waiting == 0
    assert engine.engine_core.runner.num_compiles_since_warmup == 0
    assert not engine.engine_core._batch_queue


def accumulate(totals: dict, output) -> None:
    """Fold the delta ``output`` into ``totals[request_id]`` (a copy of the request's first delta, so the deltas a
    caller holds stay as they came)."""
    if output.request_id in totals:
        totals[output.request_id].add(output)
    else:
        totals[output.request_id] = copy.deepcopy(output)


def run_to_completion(engine: LLMEngine, prompts, params, prefix="r"):
    """Submit all prompts at once, step until done; returns the accumulated final RequestOutputs in submission
    order."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    ids = [f"{prefix}{i}" for i in range(len(prompts))]
    for request_id, prompt, p in zip(ids, prompts, params_list):
        engine.add_request(request_id, prompt, p)
    totals, finished = {}, set()
    # A time bound, not a step count: steps are empty (and fast) while grammars compile in the background.
    deadline = time.monotonic() + 600
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        for output in engine.step():
            assert output.request_id not in finished, "an output came after the finished one"
            accumulate(totals, output)
            if output.finished:
                finished.add(output.request_id)
    assert finished == set(ids)
    return [totals[i] for i in ids]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def engine(request):
    """The roomy engine, once with async scheduling (the default) and once synchronous: every test that uses it
    checks both loops against the same expectations."""
    eng = make_engine(async_scheduling=request.param)
    yield eng
    assert_clean(eng)


# Slow for the synchronous loop (CI time): SmolLM2's batched greedy tokens stay covered by the async case, the
# synchronous loop's batched greedy with prefix-cache hits by
# tests/test_moe.py::test_engine_greedy_equals_transformers_with_prefix_caching_and_preemption (and its other tests
# here run on the synchronous engine too).
@pytest.mark.parametrize("engine", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["async", "sync"],
                         indirect=True)
def test_batched_greedy_matches_transformers_then_hits_prefix_cache(engine, workload, reference):
    # The engine runs the fused-projection layout (one q/k/v matmul, one gate/up matmul per layer).
    param_paths = {"/".join(map(str, path)) for path, _ in
                   jax.tree_util.tree_flatten_with_path(engine.engine_core.runner._state_treedef.unflatten(
                       engine.engine_core.runner._param_leaves))[0]}
    assert any("qkv_proj" in p for p in param_paths) and any("gate_up_proj" in p for p in param_paths)
    assert not any("['q_proj']" in p or "['gate_proj']" in p for p in param_paths)
    outputs = run_to_completion(engine, workload, GREEDY)
    got = [o.outputs[0].token_ids for o in outputs]
    mismatches = [i for i, (g, r) in enumerate(zip(got, reference)) if g != r]
    assert not mismatches, f"prompts {mismatches} differ from transformers"
    for out, ref in zip(outputs, reference):
        completion = out.outputs[0]
        assert completion.finish_reason == ("stop" if ref[-1] == 2 and len(ref) < MAX_NEW_TOKENS else "length")
        assert completion.text == engine.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        metrics = out.metrics
        assert metrics.arrival_time <= metrics.first_token_time <= metrics.finished_time
    assert_clean(engine)
    stats = engine.stats()
    assert stats["generation_tokens_total"] == sum(len(r) for r in reference)
    assert stats["prompt_tokens_total"] == sum(len(p) for p in workload)

    # Second pass over the same prompts: prefix-cache hits, identical outputs.
    hits_before = engine.stats()["prefix_cache_hits"]
    again = run_to_completion(engine, workload, GREEDY, prefix="again")
    assert [o.outputs[0].token_ids for o in again] == reference
    assert engine.stats()["prefix_cache_hits"] > hits_before
    assert sum(o.num_cached_tokens for o in again) > 0
    assert_clean(engine)


# The recompute case also prefills in chunks of a small token budget without prefix caching (one engine for both:
# CI time); the swap case keeps the default budget.
@pytest.mark.parametrize("mode,async_scheduling", [("recompute", True), pytest.param("swap", False, marks=pytest.mark.slow)])
def test_preemption_matches_transformers(workload, reference, mode, async_scheduling):
    chunked = dict(max_num_batched_tokens=TIGHT_BATCHED_TOKENS, enable_prefix_caching=False) if mode == "recompute" \
        else {}
    engine = make_engine(num_gpu_blocks_override=TIGHT_BLOCKS, preemption_mode=mode, swap_space=0.05,
                         async_scheduling=async_scheduling, **chunked)
    # Half the workload (lengths 5..186, raw and chat) fills the 16 sequences' steps and preempts several times (CI
    # time: the whole workload takes twice as long and checks nothing more here).
    outputs = run_to_completion(engine, workload[:16], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == reference[:16]
    stats = engine.stats()
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["num_swap_outs"] > 0 and stats["num_swap_ins"] > 0
    assert_clean(engine)


def test_seeded_sampling_reproducible_across_batches(engine, workload):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=12)
    alone = run_to_completion(engine, [workload[3]], params, prefix="alone")[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=8)  # unseeded neighbours in the batch
    mixed = run_to_completion(engine, [workload[0], workload[3], workload[5]], [others, params, others],
                              prefix="mixed")
    assert mixed[1].outputs[0].token_ids == alone
    different_seed = run_to_completion(engine, [workload[3]], SamplingParams(temperature=0.8, top_p=0.9, seed=99,
                                                                             max_tokens=12), prefix="seed99")
    assert different_seed[0].outputs[0].token_ids != alone
    assert_clean(engine)


def test_top_k_one_equals_greedy(engine, workload, reference):
    params = SamplingParams(temperature=1.0, top_k=1, max_tokens=MAX_NEW_TOKENS)
    outputs = run_to_completion(engine, workload[:4], params, prefix="topk")
    assert [o.outputs[0].token_ids for o in outputs] == reference[:4]
    assert_clean(engine)


def test_stop_strings_cut_exactly(engine, workload):
    full = run_to_completion(engine, [workload[1]], GREEDY, prefix="full")[0].outputs[0]
    text = full.text
    assert len(text) > 12
    stop = text[6:10]
    index = text.find(stop)
    cut = run_to_completion(engine, [workload[1]], SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS,
                                                                  stop=[stop]), prefix="cut")[0].outputs[0]
    assert cut.text == text[:index]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)]
    kept = run_to_completion(engine, [workload[1]], SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW_TOKENS, stop=stop, include_stop_str_in_output=True),
        prefix="kept")[0].outputs[0]
    assert kept.text == text[:index + len(stop)]
    # A stop token id ends the sequence with that token kept.
    stop_id = full.token_ids[3]
    by_id = run_to_completion(engine, [workload[1]], SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS,
                                                                    stop_token_ids=[stop_id]),
                              prefix="byid")[0].outputs[0]
    assert by_id.token_ids == full.token_ids[:full.token_ids.index(stop_id) + 1]
    assert by_id.stop_reason == stop_id
    assert_clean(engine)


def test_n2_children_share_prompt_blocks(engine, workload):
    prompt = workload[10]  # > 3 full blocks
    assert len(prompt) >= 64
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=6)
    kv = engine.engine_core.kv_cache_manager
    engine.add_request("fan", prompt, params)  # sequence 1 forks from 0 (tests/test_parallel_sampling.py)
    shared_seen = False
    totals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            accumulate(totals, output)
        running = {r.request_id: r for r in engine.engine_core.scheduler.running}
        if "fan::0" in running and "fan::1" in running:
            first, second = running["fan::0"].block_ids, running["fan::1"].block_ids
            num_full = len(prompt) // kv.block_size
            assert first[:num_full] == second[:num_full]
            assert all(kv.blocks[b].ref_cnt == 2 for b in first[:num_full])
            shared_seen = True
    assert shared_seen
    final = totals["fan"]
    assert final.finished
    assert [c.index for c in final.outputs] == [0, 1]
    assert all(len(c.token_ids) == 6 for c in final.outputs)
    assert final.outputs[0].token_ids != final.outputs[1].token_ids  # own seeds per child
    # Reproducible: the same seeded request gives the same two sequences.
    again = run_to_completion(engine, [prompt], params, prefix="fan-again")[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in final.outputs]
    assert_clean(engine)


def test_logprobs_match_transformers(engine, workload, hf_logits):
    prompt = workload[2]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5)
    out = run_to_completion(engine, [prompt], params, prefix="lp")[0].outputs[0]
    logits = torch.from_numpy(hf_logits(prompt + out.token_ids))
    ref = torch.log_softmax(logits, dim=-1).numpy()[len(prompt) - 1:-1]  # predicts each output token
    assert len(out.logprobs) == len(out.token_ids)
    total = 0.0
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert entry[token].rank == 1
        np.testing.assert_allclose(entry[token].logprob, ref[step, token], atol=2e-4, rtol=1e-4)
        top = np.argsort(-ref[step])[:5]
        assert set(top) <= set(entry)
        for token_id in top:
            np.testing.assert_allclose(entry[int(token_id)].logprob, ref[step, token_id], atol=2e-4, rtol=1e-4)
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert_clean(engine)


def test_invalid_requests_rejected_and_engine_keeps_serving(engine, workload, reference):
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    bad = [
        ("prompt", [1] * (MAX_MODEL_LEN + 1), GREEDY),
        ("prompt", [1, 2, engine.vocab_size], GREEDY),
        ("prompt", [1, -3], GREEDY),
        ("prompt", [], GREEDY),
        ("prompt", "", GREEDY),
        ("stop_token_ids", [1, 2, 3], SamplingParams(stop_token_ids=[engine.vocab_size + 5])),
        ("logit_bias", [1, 2, 3], SamplingParams(logit_bias={engine.vocab_size: 1.0})),
        ("logit_bias", [1, 2, 3], SamplingParams(logit_bias={i: 1.0 for i in range(301)})),
        ("allowed_token_ids", [1, 2, 3], SamplingParams(allowed_token_ids=[5, engine.vocab_size])),
        ("bad_words", [1, 2, 3], SamplingParams(bad_words=("one two three four five six seven eight nine ten "
                                                           "eleven twelve thirteen fourteen fifteen sixteen "
                                                           "seventeen eighteen nineteen twenty").split())),
        ("params", [1, 2, 3], {"temperature": 0.0}),
    ]
    engine.add_request("ok-before", workload[0], GREEDY)
    for field, prompt, params in bad:
        with pytest.raises(ValueError, match=field):
            engine.add_request(f"bad-{field}", prompt, params)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("ok-before", workload[1], GREEDY)
    assert engine.get_num_unfinished_requests() == 1
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            accumulate(final, output)
    assert final["ok-before"].finished and final["ok-before"].outputs[0].token_ids == reference[0]
    assert_clean(engine)


def test_abort_frees_blocks(engine, workload):
    for i in range(4):
        engine.add_request(f"abort{i}", workload[i + 8], SamplingParams(temperature=0.0, max_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine.engine_core.kv_cache_manager.num_free_blocks < engine.engine_core.kv_cache_manager.num_usable_blocks
    engine.abort_request(["abort0", "abort1"])
    engine.abort_request("abort2")
    assert engine.get_num_unfinished_requests() == 1
    engine.abort_request("abort3")
    engine.abort_request("never-existed")
    assert engine.step() == []
    assert_clean(engine)


def test_stats_keys(engine):
    stats = engine.stats()
    for key in ("num_running", "num_waiting", "kv_cache_usage", "prefix_cache_queries", "prefix_cache_hits",
                "num_preemptions", "prompt_tokens_total", "generation_tokens_total"):
        assert key in stats
    assert 0.0 <= stats["kv_cache_usage"] <= 1.0
    assert jax.devices()[0].platform == "cpu"


def test_repetition_penalty_matches_transformers(engine, workload, hf_greedy):
    prompt = workload[4]
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=10)
    out = run_to_completion(engine, [prompt], params, prefix="rep")[0].outputs[0]
    assert out.token_ids == hf_greedy(prompt, 10, repetition_penalty=1.3)
    assert_clean(engine)


def test_min_tokens_defers_eos(engine, tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say just the word yes."}], tokenize=True,
                                           add_generation_prompt=True)
    if hasattr(prompt, "input_ids"):
        prompt = prompt["input_ids"]
    free = run_to_completion(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=40),
                             prefix="free")[0].outputs[0]
    assert free.finish_reason == "stop" and free.token_ids[-1] == 2, "the prompt should end with EOS quickly"
    min_tokens = len(free.token_ids) + 2
    held = run_to_completion(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=40, min_tokens=min_tokens),
                             prefix="held")[0].outputs[0]
    assert len(held.token_ids) >= min_tokens
    assert 2 not in held.token_ids[:min_tokens]
    assert held.token_ids[:len(free.token_ids) - 1] == free.token_ids[:-1]
    assert_clean(engine)


def _contains(tokens, sequence) -> bool:
    return any(tokens[i:i + len(sequence)] == sequence for i in range(len(tokens) - len(sequence) + 1))


def test_logit_bias_allowed_token_ids_and_bad_words(engine, workload, reference, tokenizer):
    """In one batch: a -100 bias on the greedy first token moves it, a +100 bias forces a token every step,
    allowed_token_ids bounds every sampled token, and a bad two-token phrase of the greedy output never appears
    (nor does its other tokenization), which changes the output."""
    prompt, greedy = workload[1], reference[1][:8]
    phrase = next(tokenizer.decode(greedy[i:i + 2]) for i in range(1, 6)
                  if tokenizer.encode(tokenizer.decode(greedy[i:i + 2]), add_special_tokens=False) == greedy[i:i + 2])
    forced = tokenizer.encode(" banana", add_special_tokens=False)[0]
    allowed = sorted({*greedy[3:6], forced, 11})
    bad = SamplingParams(temperature=0.0, max_tokens=8, bad_words=[phrase])
    params = [SamplingParams(temperature=0.0, max_tokens=8, logit_bias={greedy[0]: -100.0}),
              SamplingParams(temperature=0.0, max_tokens=4, logit_bias={str(forced): 100.0}),
              SamplingParams(temperature=1.0, seed=5, max_tokens=8, allowed_token_ids=allowed, ignore_eos=True),
              bad]
    outs = [o.outputs[0].token_ids for o in run_to_completion(engine, [prompt] * 4, params, prefix="bias")]
    assert outs[0][0] != greedy[0]
    assert outs[1] == [forced] * 4
    assert len(outs[2]) == 8 and set(outs[2]) <= set(allowed)
    assert bad.bad_words_token_ids == []  # the engine tokenized a copy; the caller's params are untouched
    tokenized = bad.clone()
    tokenized.update_from_tokenizer(tokenizer)
    assert len(tokenized.bad_words_token_ids) == 2 and tokenized.reads_output_tokens
    assert outs[3] != greedy and not any(_contains(outs[3], word) for word in tokenized.bad_words_token_ids)
    assert_clean(engine)


def test_streamed_outputs_are_deltas_and_finished_only_agrees(engine, workload, reference):
    prompts = workload[:4]
    ids = [f"snap{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, GREEDY)
    received = {request_id: [] for request_id in ids}  # (output, its token ids / text when it arrived)
    while engine.has_unfinished_requests():
        for output in engine.step():
            received[output.request_id].append((output, list(output.outputs[0].token_ids), output.outputs[0].text))
    for i, request_id in enumerate(ids):
        history = received[request_id]
        assert [o.finished for o, _, _ in history] == [False] * (len(history) - 1) + [True]
        for output, tokens_then, text_then in history:  # later steps did not change what a caller already got
            assert output.outputs[0].token_ids == tokens_then and output.outputs[0].text == text_then
            assert output.prompt_token_ids == list(prompts[i])
            assert tokens_then  # an output only for a request with new tokens
            assert (output.metrics is not None) == output.finished  # metrics go with the final output only
        # The deltas, concatenated, are the whole generation.
        assert [token for _, tokens, _ in history for token in tokens] == reference[i]
        whole_text = "".join(text for _, _, text in history)
        assert whole_text == engine.tokenizer.decode(reference[i], skip_special_tokens=True)
        assert history[-1][0].outputs[0].finish_reason is not None
        assert all(o.outputs[0].finish_reason is None for o, _, _ in history[:-1])

    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, GREEDY)
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step(finished_only=True):
            assert output.finished and output.request_id not in final
            final[output.request_id] = output
    # Only finished outputs asked for: each is its request's only output, the whole generation.
    assert [final[request_id].outputs[0].token_ids for request_id in ids] == reference[:4]
    assert [final[request_id].outputs[0].text for request_id in ids] == \
        ["".join(text for _, _, text in received[request_id]) for request_id in ids]
    assert_clean(engine)

    # A process core's path: the core's outputs cross the wire (msgspec) each step and a second output processor
    # rebuilds the same deltas the first pass got (one request with logprobs too).
    params = [GREEDY] * 3 + [SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=1)]
    remote = OutputProcessor(engine.tokenizer)
    for request_id, prompt, p in zip(ids, prompts, params):
        request, text = engine.input_processor.process(request_id, prompt, p)
        engine.engine_core.add_request(request)
        wired = CLIENT_MESSAGE_DECODER.decode(encode(AddRequests(0, [request]))).requests[0]
        assert wired == request
        remote.add_request(wired, text)
    via_wire = {request_id: [] for request_id in ids}
    while engine.engine_core.has_unfinished_requests():
        message = EngineCoreOutputs(engine.engine_core.step())
        wire = CORE_MESSAGE_DECODER.decode(encode(message))
        assert wire == message
        outputs, stopped = remote.process_outputs(wire.outputs)
        assert not stopped
        for output in outputs:
            completion = output.outputs[0]
            assert output.prompt_token_ids == list(prompts[ids.index(output.request_id)])
            assert completion.index == 0 and (completion.logprobs is not None) == (output.request_id == "snap3")
            via_wire[output.request_id].append((completion.token_ids, completion.text, output.finished,
                                                output.num_cached_tokens))
    for request_id in ids:
        assert [entry[:3] for entry in via_wire[request_id]] == \
            [(tokens, text, o.finished) for o, tokens, text in received[request_id]]
        assert len({entry[3] for entry in via_wire[request_id]}) == 1  # the same cached-prompt count throughout
    assert_clean(engine)
