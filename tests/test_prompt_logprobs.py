"""Prompt logprobs (``SamplingParams.prompt_logprobs``) on the real SmolLM2 (fp32, CPU) against transformers:
chunked prompts, a prefix already in the cache, ranks and top-k, n > 1, both engine loops, no compile after warm-up;
and the host-side bookkeeping of ``PromptLogprobsCollector``."""

import numpy as np
import pytest
import torch

from paged_jax.config import EngineArgs
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.worker.prompt_logprobs import PromptLogprobsCollector
from paged_jax.sampling_params import SamplingParams
from paged_jax.worker.step_io import PromptLogprobsChunk
from tests.test_engine import TEXT, assert_clean, run_to_completion

MAX_BATCHED_TOKENS = 32  # prompts below are longer: they are computed in several chunks
ATOL = 1e-4


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def engine(request):
    eng = LLMEngine(EngineArgs(dtype="float32", max_model_len=256, max_num_seqs=4,
                               max_num_batched_tokens=MAX_BATCHED_TOKENS, num_gpu_blocks_override=80, seed=0,
                               async_scheduling=request.param), use_tqdm=False)
    yield eng
    assert_clean(eng)


@pytest.fixture(scope="module")
def prompt(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(TEXT)[:90]
    assert len(ids) > 2 * MAX_BATCHED_TOKENS
    return ids


def check_against_transformers(prompt_logprobs, prompt, num_top, hf_logits):
    """Every entry: the prompt token's logprob and rank, and the top ``num_top``, as log_softmax of transformers'
    logits (fp32, ATOL); ranks within what a tie at ATOL allows."""
    ref = torch.log_softmax(torch.from_numpy(hf_logits(prompt)), dim=-1).numpy()
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        entry, row, token = prompt_logprobs[position], ref[position - 1], prompt[position]
        np.testing.assert_allclose(entry[token].logprob, row[token], atol=ATOL)
        target = row[token]
        assert 1 + np.sum(row > target + ATOL) <= entry[token].rank <= 1 + np.sum(row > target - ATOL)
        top = sorted((e.rank, token_id, e.logprob) for token_id, e in entry.items() if e.rank <= num_top)
        assert [rank for rank, _, _ in top] == list(range(1, num_top + 1))
        kth_largest = np.sort(row)[-num_top] if num_top else np.inf
        for _, token_id, logprob in top:
            np.testing.assert_allclose(logprob, row[token_id], atol=ATOL)
            assert row[token_id] >= kth_largest - ATOL  # one of the num_top most likely
        assert len(entry) in (num_top, num_top + 1)  # the top ones, plus the prompt token unless among them
        if entry[token].rank <= num_top:
            assert len(entry) == num_top
        assert all(e.decoded_token is not None for e in entry.values())


def test_chunked_prompt_logprobs_match_transformers(engine, prompt, hf_logits):
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=5)
    out = run_to_completion(engine, [prompt], params, prefix="chunked")[0]
    check_against_transformers(out.prompt_logprobs, prompt, 5, hf_logits)
    assert out.num_cached_tokens == 0
    # prompt_logprobs=0: only the prompt token's own entry.
    out = run_to_completion(engine, [prompt[:40]], SamplingParams(max_tokens=1, prompt_logprobs=0), prefix="zero")[0]
    check_against_transformers(out.prompt_logprobs, prompt[:40], 0, hf_logits)
    assert engine.engine_core.runner.num_compiles_since_warmup == 0


def test_cached_prefix_is_recomputed_for_prompt_logprobs(engine, prompt, hf_logits):
    """A prompt whose prefix is in the prefix cache takes no hit when it asks for prompt logprobs (every position
    is computed), while a plain request still does; the first output alone carries them."""
    run_to_completion(engine, [prompt[:70]], SamplingParams(max_tokens=1), prefix="warm")
    plain = run_to_completion(engine, [prompt[:80]], SamplingParams(max_tokens=1), prefix="plain")[0]
    assert plain.num_cached_tokens >= 64 and plain.prompt_logprobs is None
    engine.add_request("cached", prompt, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2,
                                                        ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(outputs) >= 2 and outputs[0].num_cached_tokens == 0
    assert [o.prompt_logprobs is not None for o in outputs] == [True] + [False] * (len(outputs) - 1)
    check_against_transformers(outputs[0].prompt_logprobs, prompt, 2, hf_logits)


def test_parallel_samples_and_final_only_output(engine, prompt, hf_logits):
    """n = 2: one prompt_logprobs for the request; step(finished_only=True) (LLM.generate's mode) carries them."""
    params = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=3, prompt_logprobs=1)
    engine.add_request("fan", prompt[5:60], params)
    finals = []
    while engine.has_unfinished_requests():
        finals += engine.step(finished_only=True)
    (final,) = finals
    assert len(final.outputs) == 2
    check_against_transformers(final.prompt_logprobs, prompt[5:60], 1, hf_logits)
    one_token = run_to_completion(engine, [prompt[:1]], SamplingParams(max_tokens=1, prompt_logprobs=3),
                                  prefix="one")[0]
    assert one_token.prompt_logprobs == [None]


def test_collector_records_each_position_once():
    """Entries per chunk (position p -> prompt token p + 1, none for the last prompt token), and a chunk computed
    again after a recompute preemption adds nothing."""
    prompt = [10, 11, 12, 13, 14]
    collector = PromptLogprobsCollector(prompt, 1, decode=lambda token: None)

    def chunk(targets):
        n = len(targets)
        return PromptLogprobsChunk(np.full(n, -1.0, np.float32), np.arange(1, n + 1, dtype=np.int32),
                                   np.array([[t, 0] for t in targets], np.int32), np.full((n, 2), -1.0, np.float32))

    collector.record(0, chunk([11, 12]))
    assert len(collector.entries) == 3
    collector.record(0, chunk([11, 12]))  # recomputed: nothing new
    assert len(collector.entries) == 3
    assert collector.take() is None  # not complete yet
    collector.record(2, chunk([13, 14]))
    assert collector.complete
    entries = collector.take()
    assert entries[0] is None and [sorted(e) for e in entries[1:]] == [[11], [12], [13], [14]]
    assert [e[t].rank for e, t in zip(entries[1:], prompt[1:])] == [1, 2, 1, 2]
    assert collector.take() is None  # once


def test_runner_targets_each_prompt_chunk_position_at_the_next_prompt_token():
    """The runner's host side (``step_packing``): a prompt chunk of a row computing prompt logprobs targets position
    p at prompt token p + 1 (from its batch row, so a chunk needs nothing from the next one), none for the prompt's
    last token, none for decodes or rows without prompt logprobs; spans come back in step-row order."""
    from paged_jax.core.sched_output import NewRequestData
    from paged_jax.worker.input_batch import InputBatch
    from paged_jax.worker.step_packing import _prompt_logprob_targets

    batch = InputBatch(4, 32, 4, eos_token_ids=[2], vocab_size=64)
    prompt = [10, 11, 12, 13, 14]
    for req_id, wants in (("p", True), ("plain", False)):
        batch.add(NewRequestData(req_id=req_id, prompt_token_ids=prompt, output_token_ids=[20], params=None, seed=0,
                                 block_ids=[1], num_computed_tokens=0, prompt_logprobs=wants))
    p, plain = batch.row_of["p"], batch.row_of["plain"]

    def targets(rows, num_tokens=8, rows_to_packed=None):
        """rows: [(batch row, start, new tokens)] in packed order."""
        batch_rows, starts, q_lens = (np.array(column, np.int64) for column in zip(*rows))
        cu = np.cumsum(q_lens)
        order = np.arange(len(rows)) if rows_to_packed is None else np.array(rows_to_packed)
        return _prompt_logprob_targets(batch, batch_rows, starts, q_lens, cu, num_tokens, order)

    got, spans = targets([(p, 0, 2)])
    assert got.tolist() == [11, 12] + [-1] * 6 and spans == [(0, 2)]
    got, spans = targets([(p, 2, 3)])  # the chunk's last position is the prompt's last: no target
    assert got.tolist() == [13, 14] + [-1] * 6 and spans == [(0, 2)]
    got, spans = targets([(p, 0, 2)])  # computed again (a recompute): the same targets; the collector skips them
    assert got.tolist()[:2] == [11, 12]
    assert targets([(p, 4, 1)]) == (None, None)  # only the prompt's last token
    assert targets([(p, 5, 1)]) == (None, None)  # a decode
    assert targets([(plain, 0, 5)]) == (None, None)  # no prompt logprobs asked
    # Two rows, packed in another order than the step's (step row 0 is packed second).
    got, spans = targets([(plain, 5, 1), (p, 1, 3)], rows_to_packed=[1, 0])
    assert got.tolist() == [-1, 12, 13, 14] + [-1] * 4
    assert spans == [(1, 3), None]
