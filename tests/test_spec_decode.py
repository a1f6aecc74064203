"""Speculative decoding (ngram, suffix): the config's start-up errors, the proposers, the scheduler's draft slots and
rollback, and on the engine: greedy and seeded outputs identical to decoding without drafts (stop strings, n > 1,
penalties, logprobs; constrained sequences verifying the drafts their grammar allows), rollback under preemption, the
target distribution kept (chi-square), vLLM's metrics, and nothing compiled after warm-up."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import scipy.stats
import torch

from models.testing import save_random_hf_checkpoint, tiny_config
from paged_jax.config import EngineArgs
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import Request, RequestStatus
from paged_jax.core.scheduler import Scheduler
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.entrypoints.llm import LLM
from paged_jax.metrics import Counter, Vector
from paged_jax.sampling_params import SamplingParams
from paged_jax.spec_decode import SpeculativeConfig, parse_speculative_config
from paged_jax.spec_decode.ngram import NgramProposer
from paged_jax.spec_decode.suffix import SuffixProposer
from paged_jax.spec_decode.verify import mean_acceptance_length, num_accepted, per_position
from tests.test_engine import assert_clean, make_engine, run_to_completion

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}


# ---------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("value, field", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "mtp", "num_speculative_tokens": 2, "model": "x"}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "draft_tensor_parallel"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 33}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "suffix", "num_speculative_tokens": 2, "prompt_lookup_max": 2}, "prompt_lookup"),
    ({"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 2.0},
     "suffix_decoding_min_token_prob"),
    ('{"method": "ngram",', "not valid JSON"),
])
def test_bad_speculative_config_is_refused_naming_the_key(value, field):
    with pytest.raises(ValueError, match="speculative_config") as info:
        parse_speculative_config(value)
    assert field in str(info.value)


def test_speculative_config_defaults_and_json():
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)  # vLLM: the one given fills the other
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3}).prompt_lookup_min == 5
    assert EngineArgs(speculative_config=dict(SUFFIX)).speculative_config == SpeculativeConfig("suffix", 4)


def test_combinations_without_drafts_are_refused_at_start_up():
    with pytest.raises(ValueError, match="pipeline_parallel_size is not supported with speculative_config"):
        EngineArgs(speculative_config=dict(NGRAM), pipeline_parallel_size=2)
    assert EngineArgs(speculative_config=dict(NGRAM), async_scheduling=True).async_scheduling


# ---------------------------------------------------------------------------------------------------- proposers
def test_ngram_proposes_what_followed_the_latest_longest_match():
    proposer = NgramProposer(3, prompt_lookup_min=1, prompt_lookup_max=3)
    assert proposer.propose("a", [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3], []) == [4, 5, 6]  # latest "1 2 3"
    assert proposer.propose("b", [5, 2, 3, 7, 1, 2, 3], []) == [7, 1, 2]  # "2 3" (no earlier "1 2 3")
    assert proposer.propose("c", [1, 2, 3, 4], []) == []
    assert NgramProposer(3, prompt_lookup_min=2, prompt_lookup_max=2).propose("d", [4, 1, 7, 1], []) == []  # 1-gram
    assert proposer.num_sequences == 3
    proposer.finish("a")
    proposer.finish("unknown")
    assert proposer.num_sequences == 2


def brute_force_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The proposal by definition: for n from max_n down to min_n (n < len), the latest earlier window equal to the
    last n tokens (the suffix itself excluded); the tokens after it, at most k."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@pytest.mark.parametrize("k, min_n, max_n", [(4, 5, 5), (3, 1, 3), (1, 1, 1), (6, 2, 4), (2, 3, 8)])
def test_ngram_index_equals_the_brute_force_proposal_as_tokens_arrive(k, min_n, max_n):
    """Sequences over a small vocabulary (many repeats, overlapping matches, a suffix whose only occurrence is
    itself): the incremental index proposes exactly what a scan of the whole sequence finds, after each prompt and
    after every 1..3 tokens appended (a verified row gains several), with or without ``prepare`` calls before them,
    including at lengths below min_n and max_n."""
    rng = np.random.default_rng(k * 100 + min_n * 10 + max_n)
    proposer = NgramProposer(k, prompt_lookup_min=min_n, prompt_lookup_max=max_n)
    for seq in range(12):
        vocab = int(rng.choice([2, 3, 5, 50]))
        prompt = rng.integers(0, vocab, int(rng.integers(1, 12))).tolist()
        outputs: list[int] = []
        request_id = f"s{seq}"
        while len(outputs) < 60:
            tokens = prompt + outputs
            assert proposer.propose(request_id, prompt, outputs) == brute_force_ngram(tokens, k, min_n, max_n), tokens
            # The engine prepares while a step runs (sometimes twice: a step that gave the row no token), then the
            # step adds one token (the prepared lookup) or several (verified drafts: the full search).
            for _ in range(int(rng.integers(0, 3))):
                proposer.prepare(request_id, prompt, outputs)
            outputs += rng.integers(0, vocab, int(rng.choice([1, 1, 2, 3]))).tolist()
        proposer.finish(request_id)
    assert proposer.num_sequences == 0


def test_ngram_edges():
    """k truncation at the end of the sequence, the longest n winning over a later shorter match, a suffix found
    only as itself, and a sequence no longer than min_n."""
    proposer = NgramProposer(4, prompt_lookup_min=1, prompt_lookup_max=2)
    assert proposer.propose("a", [7, 8, 9, 8], []) == [9, 8]  # "8" at 1: what followed, up to the end
    assert proposer.propose("a", [7, 8, 9, 8], [9]) == [8, 9]  # "8 9" at 1..2 (k=4, only 2 tokens follow)
    assert proposer.propose("b", [1, 2, 3, 2, 9, 3], [1, 2]) == [3, 2, 9, 3]  # "1 2" (0..1) beats the later "2"
    assert proposer.propose("c", [5, 6, 7], []) == []  # "7" and "6 7" occur only as the suffix
    assert proposer.propose("d", [5], []) == []  # one token: nothing before the suffix
    long = NgramProposer(2, prompt_lookup_min=3, prompt_lookup_max=3)
    assert long.propose("e", [1, 2, 3], []) == []  # shorter than min_n + 1
    assert long.propose("e", [1, 2, 3], [1, 2, 3]) == [1, 2]  # the window at 0 (overlapping the suffix's follow-up)


def test_suffix_proposes_from_its_own_tokens_and_from_finished_requests():
    proposer = SuffixProposer(4, max_tree_depth=8, max_cached_requests=1, max_spec_factor=2.0, min_token_prob=0.1)
    assert proposer.propose("a", [1, 2, 3, 4, 5, 1, 2], num_prompt_tokens=7) == [3, 4, 5, 1]
    assert proposer.propose("b", [7, 8], num_prompt_tokens=1) == []
    proposer.finish("b", [7, 8, 9, 10, 11, 12])  # its outputs 8..12 join the global tree
    assert proposer.propose("c", [40, 9, 10], num_prompt_tokens=2) == [11, 12]
    proposer.finish("c", [40, 9, 10, 50])  # its outputs 10, 50 join; the cap is one request: b's leave
    assert proposer.propose("d", [60, 9, 10], num_prompt_tokens=3) == [50]


def test_suffix_stops_below_min_token_prob():
    proposer = SuffixProposer(4, max_tree_depth=8, max_cached_requests=0, max_spec_factor=4.0, min_token_prob=0.5)
    # After "1": 2 twice, 3 once, and the open end: 2/4 = 0.5 passes; after "1 2": 5 once of 3 -> 0.5 * 1/3 < 0.5.
    assert proposer.propose("a", [1, 2, 5, 1, 2, 6, 1, 3, 1], num_prompt_tokens=9) == [2]


def test_num_accepted_is_the_agreeing_prefix():
    assert num_accepted([4, 5, 6], [4, 5, 6]) == 3
    assert num_accepted([4, 5, 6], [4, 7, 6]) == 1
    assert num_accepted([4, 5, 6], [0, 5, 6]) == 0


# ---------------------------------------------------------------------------------------------------- scheduler
@dataclasses.dataclass
class Params:
    max_tokens: int | None = 20
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None


def decoding_request(params: Params, max_num_batched_tokens: int = 32, max_model_len: int = 64):
    kv = KVCacheManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=max_model_len)
    request = Request("a", [1, 2, 3, 4, 5], params=params)
    scheduler.add_request(request)
    while not request.output_token_ids:  # prefill (chunked under a small budget); the first output
        scheduler.update_from_output(scheduler.schedule(), [7])
    return scheduler, request


def test_drafts_are_scheduled_with_the_next_token_and_rejected_ones_rolled_back():
    scheduler, request = decoding_request(Params())
    request.spec_token_ids = [8, 9, 10]
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == [4] and out.spec_token_ids == {"a": [8, 9, 10]}
    assert len(request.block_ids) * 4 >= 6 + 3  # slots for the drafts
    assert out.scheduled_cached_reqs.new_token_ids == [[7]]  # drafts travel beside the row's tokens, not in them
    with pytest.raises(ValueError, match="accepted_token_ids"):
        scheduler.update_from_output(out, [11])
    scheduler.update_from_output(out, [11], {"a": [8]})  # 8 accepted, 9 rejected (the target sampled 11 there)
    assert request.output_token_ids == [7, 8, 11] and request.spec_token_ids == []
    assert request.num_computed_tokens == 7  # prompt, 7 and 8: the K/V of 9 and 10 is rolled back
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == [1] and out.row_num_computed_tokens() == [7]


@pytest.mark.parametrize("params, budget, max_model_len, expected", [
    (Params(max_tokens=3), 32, 64, 1),  # 1 output, 1 next token, 1 draft: max_tokens
    (Params(), 3, 64, 2),  # the step's token budget
    (Params(max_tokens=None), 32, 8, 2),  # positions up to max_model_len
])
def test_drafts_are_trimmed_to_what_can_be_kept(params, budget, max_model_len, expected):
    scheduler, request = decoding_request(params, budget, max_model_len)
    request.spec_token_ids = [8, 9, 10, 11]
    out = scheduler.schedule()
    assert out.spec_token_ids == {"a": [8, 9, 10, 11][:expected]} and out.num_scheduled_tokens == [1 + expected]


def test_a_stop_token_inside_the_accepted_run_ends_the_request_there():
    scheduler, request = decoding_request(Params(stop_token_ids=[9]))
    request.spec_token_ids = [8, 9, 10]
    out = scheduler.schedule()
    scheduler.update_from_output(out, [12], {"a": [8, 9, 10]})
    assert request.output_token_ids == [7, 8, 9] and request.status == RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == 9 and scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks


# ---------------------------------------------------------------------------------------------------- engine
TEXT = ("one two three four five six seven eight nine ten. one two three four five six seven eight nine ten. "
        "The cat sat on the mat. The cat sat on the mat. The dog sat on the log. The dog sat on the")


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(TEXT)
    return [ids[:40], ids[10:50], smollm2_tokenizer.encode("Hello, my name is")]


ENGINE_SETTINGS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_gpu_blocks_override=200,
                       seed=0)
PARAMS = [
    SamplingParams(max_tokens=16, temperature=0, logprobs=2),
    SamplingParams(max_tokens=16, temperature=0, stop=["seven", "mat."], n=2),
    SamplingParams(max_tokens=8, temperature=0.9, seed=3, repetition_penalty=1.2, logprobs=1),
]


def assert_same_outputs(got, expected) -> None:
    """Same tokens, text and finishes; logprobs of the same tokens, equal up to float32 noise (a row of several
    tokens runs other matmul shapes than a one-token row)."""
    for out, ref in zip(got, expected, strict=True):
        for seq, ref_seq in zip(out.outputs, ref.outputs, strict=True):
            assert (seq.token_ids, seq.text, seq.finish_reason, seq.stop_reason) == (
                ref_seq.token_ids, ref_seq.text, ref_seq.finish_reason, ref_seq.stop_reason)
            assert (seq.logprobs is None) == (ref_seq.logprobs is None)
            for entry, ref_entry in zip(seq.logprobs or (), ref_seq.logprobs or (), strict=True):
                assert entry.keys() == ref_entry.keys()
                np.testing.assert_allclose([v.logprob for v in entry.values()],
                                           [v.logprob for v in ref_entry.values()], atol=2e-3)


@pytest.fixture(scope="module")
def plain_engine():
    """The engine without drafts: tests/test_engine.py's roomy one (its compiled shapes are in the persistent
    compilation cache when that file ran first: CI time)."""
    return make_engine()


@pytest.fixture(scope="module")
def plain_outputs(plain_engine, prompts):
    return [run_to_completion(plain_engine, prompts, params) for params in PARAMS]


# The drafting engines' pool is too small for ``test_rollback_under_preemption``'s six requests, so that test preempts
# on the ngram engine the other tests use (one compile of the drafting engine's steps: CI time).
SPEC_ENGINE_SETTINGS = {**ENGINE_SETTINGS, "max_model_len": 96, "num_gpu_blocks_override": 12}


@pytest.fixture(scope="module")
def spec_llms(smollm2_dir):
    """method -> an ``LLM`` with that speculative config (built on first use; ``SPEC_ENGINE_SETTINGS``)."""
    cache = {}

    def get(config: dict) -> LLM:
        if config["method"] not in cache:
            cache[config["method"]] = LLM(str(smollm2_dir), speculative_config=dict(config), use_tqdm=False,
                                          **SPEC_ENGINE_SETTINGS)
        return cache[config["method"]]

    return get


# Slow for suffix: the verify path is the method's; suffix proposals stay covered by their own tests.
@pytest.mark.parametrize("speculative_config", [NGRAM, pytest.param(SUFFIX, marks=pytest.mark.slow)],
                         ids=["ngram", "suffix"])
def test_outputs_equal_decoding_without_drafts(speculative_config, spec_llms, prompts, plain_outputs):
    """Greedy (with logprobs, stop strings inside accepted runs, n = 2) and seeded sampling with penalties: the
    same outputs as without drafts; drafts were accepted and rejected."""
    engine = spec_llms(speculative_config).llm_engine
    for params, expected in zip(PARAMS, plain_outputs):
        assert_same_outputs(run_to_completion(engine, prompts, params), expected)
    stats = engine.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert mean_acceptance_length(stats) > 1.2
    assert_clean(engine)


def test_llm_get_metrics_has_vllm_spec_decode_counters(spec_llms, prompts):
    llm = spec_llms(NGRAM)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts, accepted = metrics["vllm:spec_decode_num_drafts"], metrics["vllm:spec_decode_num_accepted_tokens"]
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(drafts, Counter) and isinstance(per_pos, Vector) and len(per_pos.values) == 4
    assert drafts.value > 0 and sum(per_pos.values) == accepted.value > 0
    assert metrics["vllm:spec_decode_num_draft_tokens"].value >= accepted.value
    assert metrics["vllm:generation_tokens"].value > 0


@pytest.mark.parametrize("preemption_mode", ["recompute", pytest.param("swap", marks=pytest.mark.slow)])
def test_rollback_under_preemption(preemption_mode, plain_engine, spec_llms, prompts):
    """A pool too small for the batch: drafts' slots are allocated and rolled back while sequences are preempted
    (recomputed on the shared ngram engine, or swapped out with their draft slots and back in); outputs equal those
    without drafts."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    many = prompts * 2
    expected = [out.outputs[0].token_ids for out in run_to_completion(plain_engine, many, params)]
    if preemption_mode == "recompute":
        engine = spec_llms(NGRAM).llm_engine
    else:
        engine = LLMEngine(EngineArgs(**{**SPEC_ENGINE_SETTINGS, "num_gpu_blocks_override": 14},
                                      speculative_config=dict(NGRAM), preemption_mode=preemption_mode,
                                      swap_space=0.05), use_tqdm=False)
    before = engine.stats()
    got = [out.outputs[0].token_ids for out in run_to_completion(engine, many, params, prefix="rollback")]
    assert got == expected
    stats = engine.stats()
    assert stats["num_preemptions"] > before["num_preemptions"]
    assert stats["spec_decode_num_accepted_tokens"] > before["spec_decode_num_accepted_tokens"]
    assert (stats["num_swap_outs"] > before["num_swap_outs"]) == (preemption_mode == "swap")
    assert_clean(engine)


class StepRecorder:
    """On ``engine``: the steps dispatched while an earlier step's tokens were still to be fetched (``overlapped``:
    async scheduling; a step whose tokens nobody fetches, a prompt chunk's, does not count), those of them that
    verify drafts (``overlapped_verifies``), and each sequence's drafts as proposed (``proposals``: request id
    without its first ``strip`` characters -> list of drafts)."""

    def __init__(self, engine: LLMEngine, monkeypatch, strip: int = 1):
        from paged_jax.worker.step_io import PendingStep

        core = engine.engine_core
        self.events: list[tuple[object, bool]] = []  # (handle, verifies) per dispatch, (handle, None) per fetch
        self.proposals: dict[str, list[list[int]]] = {}
        execute, result, propose = core.runner.execute, PendingStep.result, core.spec_decoder.propose

        def recorded_execute(scheduler_output, *args, **kwargs):
            handle = execute(scheduler_output, *args, **kwargs)
            self.events.append((handle, bool(scheduler_output.spec_token_ids)))
            return handle

        def recorded_result(handle):
            self.events.append((handle, None))
            return result(handle)

        def recorded_propose(requests, *args):
            propose(requests, *args)
            for request in requests:
                if request.spec_token_ids:
                    self.proposals.setdefault(request.request_id[strip:], []).append(list(request.spec_token_ids))

        monkeypatch.setattr(core.runner, "execute", recorded_execute)
        monkeypatch.setattr(PendingStep, "result", recorded_result)
        monkeypatch.setattr(core.spec_decoder, "propose", recorded_propose)

    def _overlapping(self) -> list[bool]:
        """Per dispatch that came while a fetched step was dispatched and not yet fetched: whether it verifies."""
        fetched = {id(handle) for handle, verifies in self.events if verifies is None}
        pending, overlapping = set(), []
        for handle, verifies in self.events:
            if verifies is None:
                pending.discard(id(handle))
                continue
            if pending:
                overlapping.append(verifies)
            if id(handle) in fetched:
                pending.add(id(handle))
        return overlapping

    @property
    def overlapped(self) -> int:
        return len(self._overlapping())

    @property
    def overlapped_verifies(self) -> int:
        return sum(self._overlapping())


def spec_counters(engine: LLMEngine, before: dict) -> dict:
    return {key: value - before.get(key, 0) for key, value in engine.stats().items() if key.startswith("spec_")}


def test_async_scheduling_with_drafts(spec_llms, prompts, plain_outputs, monkeypatch):
    """Async scheduling with ngram drafts: a step that verifies drafts, or whose rows will be proposed drafts, waits
    for the step before it, so outputs (greedy with logprobs, stop strings, n = 2; seeded sampling with penalties)
    equal the engine's without drafts; for the greedy set each sequence's proposals and the counters equal the
    synchronous run's (a stop string ends a sequence one step later under async scheduling, drafts or not).
    Overlapped steps: tests/test_spec_decode_models.py."""
    engine = spec_llms(NGRAM).llm_engine
    core = engine.engine_core
    runs = {}
    for async_scheduling, params_list in ((False, PARAMS[:1]), (True, PARAMS)):
        monkeypatch.setattr(core, "async_scheduling", async_scheduling)
        core.reset_prefix_cache()  # the same prefills in both runs (their budget trims drafts alike)
        steps, before, outputs = StepRecorder(engine, monkeypatch), engine.stats(), []
        for i, params in enumerate(params_list):
            outputs.append(run_to_completion(engine, prompts, params, prefix=f"{async_scheduling:d}{i}"))
            runs[async_scheduling, i] = spec_counters(engine, before), dict(steps.proposals)
        monkeypatch.undo()
    for got, expected in zip(outputs, plain_outputs):
        assert_same_outputs(got, expected)
    assert runs[True, 0] == runs[False, 0] and runs[True, 0][0]["spec_decode_num_accepted_tokens"] > 0
    assert steps.overlapped_verifies == 0
    assert_clean(engine)


# ---------------------------------------------------------------------------------------------------- distribution
VOCAB = 20  # the smallest the engine serves: its logprob executables take the top 20


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return save_random_hf_checkpoint(tiny_config("llama", vocab_size=VOCAB, bos_token_id=0, eos_token_id=0),
                                     tmp_path_factory.mktemp("tiny") / "ckpt", seed=1)


def exact_marginals(checkpoint, prompt: list[int], temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """The target's laws float64[V] of the second and third sampled tokens (softmax(logits / temperature), summed
    over the tokens before them), from transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float64).eval()

    def next_probs(contexts: list[list[int]]) -> torch.Tensor:
        return torch.softmax(model(torch.tensor(contexts)).logits[:, -1] / temperature, -1)

    with torch.no_grad():
        first = next_probs([prompt])[0]
        second = next_probs([prompt + [a] for a in range(VOCAB)])  # [t1, t2]
        third = next_probs([prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)]).reshape(VOCAB, VOCAB, -1)
    pair = first[:, None] * second
    return pair.sum(0).numpy(), (pair[:, :, None] * third).sum((0, 1)).numpy()


def chi_square_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    observed = np.bincount(samples, minlength=VOCAB).astype(float)
    expected = probs / probs.sum() * len(samples)
    small = expected < 5  # pooled: chi-square's validity rule
    if small.any():
        observed, expected = (np.append(x[~small], x[small].sum()) for x in (observed, expected))
    return scipy.stats.chisquare(observed, expected).pvalue


def test_sampled_tokens_keep_the_target_distribution(tiny_checkpoint):
    """Temperature 1 on a 20-token vocabulary, 1500 seeds: the second and third sampled tokens (sampled at the first
    and second draft positions of a step verifying two drafts, or after them) follow the target's exact laws
    (chi-square)."""
    prompt, temperature, num_seeds = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], 1.0, 1500
    engine = LLMEngine(EngineArgs(model=str(tiny_checkpoint), max_model_len=32, max_num_seqs=16,
                                  max_num_batched_tokens=64, num_gpu_blocks_override=300, seed=0,
                                  speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                      "prompt_lookup_min": 1, "prompt_lookup_max": 2}),
                       use_tqdm=False)
    params = [SamplingParams(max_tokens=4, temperature=temperature, seed=seed, ignore_eos=True)
              for seed in range(num_seeds)]
    tokens = np.array([out.outputs[0].token_ids for out in
                       run_to_completion(engine, [{"prompt_token_ids": prompt}] * num_seeds, params)])
    stats = engine.stats()
    assert stats["spec_decode_num_drafts"] >= num_seeds // 4
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert stats["spec_decode_num_accepted_tokens_per_pos.1"] > 0  # some third tokens followed two kept drafts
    second, third = exact_marginals(tiny_checkpoint, prompt, temperature)
    assert chi_square_pvalue(tokens[:, 1], second) > 1e-3
    assert chi_square_pvalue(tokens[:, 2], third) > 1e-3
    assert engine.engine_core.runner.num_compiles_since_warmup == 0


def test_prometheus_exports_spec_decode_counters_only_with_drafts():
    from serving.metrics import _EngineStatsCollector

    collector = _EngineStatsCollector("vllm", {"model_name": "m", "engine": "0"}, {})
    collector.update({"num_running": 1})
    assert not [f for f in collector.collect() if f.name.startswith("vllm:spec_decode")]
    collector.update({"num_running": 1, "spec_decode_num_drafts": 3, "spec_decode_num_draft_tokens": 9,
                      "spec_decode_num_accepted_tokens": 4, "spec_decode_num_accepted_tokens_per_pos.0": 3,
                      "spec_decode_num_accepted_tokens_per_pos.1": 1})
    samples = {(s.name, s.labels.get("position")): s.value for f in collector.collect() for s in f.samples}
    assert samples[("vllm:spec_decode_num_drafts_total", None)] == 3
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", None)] == 4
    assert samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", "0")] == 3
    assert samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", "1")] == 1


def test_speculative_config_flag():
    import argparse

    from paged_jax.entrypoints.cli import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "suffix", "num_speculative_tokens": 6}'])
    assert EngineArgs(**engine_kwargs(args)).speculative_config == SpeculativeConfig("suffix", 6)
    args = parser.parse_args(["--speculative-config", '{"method": "deepseek_mtp", "num_speculative_tokens": 1}'])
    assert EngineArgs(**engine_kwargs(args)).speculative_config == SpeculativeConfig("mtp", 1)  # vLLM's alias


@pytest.mark.slow
def test_tensor_parallel_engine_verifies_drafts(tiny_checkpoint):
    """tp = 2 (two of the 8 virtual CPU devices) with ngram drafts: greedy outputs equal one device's without
    drafts."""
    prompts = [{"prompt_token_ids": [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2][:n]} for n in (12, 9, 6)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    settings = dict(model=str(tiny_checkpoint), max_model_len=32, max_num_seqs=4, max_num_batched_tokens=32,
                    num_gpu_blocks_override=40, seed=0)
    expected = [out.outputs[0].token_ids for out in
                run_to_completion(LLMEngine(EngineArgs(**settings), use_tqdm=False), prompts, params)]
    engine = LLMEngine(EngineArgs(**settings, tensor_parallel_size=2, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}),
        use_tqdm=False)
    assert [out.outputs[0].token_ids for out in run_to_completion(engine, prompts, params)] == expected
    assert engine.stats()["spec_decode_num_drafts"] > 0
    assert_clean(engine)


GRAMMAR_SCHEMA = {"type": "object", "properties": {"animal": {"enum": ["cat", "dog"]}, "place": {"enum": ["mat", "log"]}},
                  "required": ["animal", "place"], "additionalProperties": False}
GRAMMAR_CHOICES = ["The cat sat on the mat. The dog sat on the log.", "The dog sat on the mat."]


@pytest.mark.parametrize("speculative_config", [NGRAM, pytest.param(SUFFIX, marks=pytest.mark.slow)],
                         ids=["ngram", "suffix"])
def test_structured_output_rows_verify_drafts_their_grammar_allows(speculative_config, spec_llms, plain_engine,
                                                                   prompts, monkeypatch, smollm2_tokenizer):
    """Constrained sequences (regex, choice, JSON schema) take drafts: those their grammar forbids are cut before
    they are scheduled, every verified position is masked; outputs (and a free row's beside them) equal the engine's
    without drafts, match their grammars, and the counters add up; nothing compiled after warm-up."""
    import json
    import re

    import jsonschema_rs

    from paged_jax.sampling_params import StructuredOutputsParams
    from paged_jax.structured_output.backend import XgrammarBackend
    from paged_jax.structured_output.manager import SequenceGrammar

    specs = [StructuredOutputsParams(regex="(one two )+three"), StructuredOutputsParams(choice=GRAMMAR_CHOICES),
             StructuredOutputsParams(json=GRAMMAR_SCHEMA, disable_any_whitespace=True)]
    # The target's favourite token at every position is one no grammar allows: only the masks keep it out.
    banned = {smollm2_tokenizer.encode(" banana")[0]: 100.0}
    params = [SamplingParams(max_tokens=24, temperature=0, structured_outputs=spec, logit_bias=banned)
              for spec in specs]
    many = prompts + [prompts[2], prompts[0]]
    params += [params[0], SamplingParams(max_tokens=12, temperature=0)]
    expected = run_to_completion(plain_engine, many, params)
    engine = spec_llms(speculative_config).llm_engine
    validated = []  # (drafts proposed, drafts kept) of the constrained rows
    validate = SequenceGrammar.validate_tokens
    monkeypatch.setattr(SequenceGrammar, "validate_tokens",
                        lambda self, drafts: validated.append((drafts, validate(self, drafts))) or validated[-1][1])
    before = engine.stats()
    got = run_to_completion(engine, many, params)
    assert_same_outputs(got, expected)
    for out, p in zip(got, params[:4]):  # every kept token continues the grammar (the last row ran to max_tokens)
        matcher = XgrammarBackend.new_matcher(engine.engine_core.structured_outputs.grammar_for(
            p.structured_outputs).result())
        assert all(matcher.accept_token(t) for t in out.outputs[0].token_ids)
    texts = [out.outputs[0].text for out in got]
    assert re.fullmatch("(one two )+three", texts[0]) and texts[1] in GRAMMAR_CHOICES
    assert jsonschema_rs.validator_for(GRAMMAR_SCHEMA).is_valid(json.loads(texts[2]))
    assert any(kept == drafts for drafts, kept in validated)  # whole drafts kept ...
    assert any(len(kept) < len(drafts) for drafts, kept in validated)  # ... and drafts cut at a forbidden token
    stats = {key: value - before.get(key, 0) for key, value in engine.stats().items() if key.startswith("spec_")}
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert sum(per_position(stats)) == stats["spec_decode_num_accepted_tokens"]
    assert_clean(engine)


@pytest.mark.slow
def test_lora_rows_verify_drafts_with_their_adapter(smollm2_dir, tmp_path_factory, prompts):
    """Rows with and without an adapter in the same steps, each verifying drafts: outputs equal a LoRA engine's
    without drafts (every draft token runs with its row's adapter)."""
    from lora_adapters import make_peft_model
    from paged_jax.lora.request import LoRARequest

    _, paths = make_peft_model(smollm2_dir, tmp_path_factory.mktemp("adapters"))
    settings = dict(model=str(smollm2_dir), enable_lora=True, max_loras=1, max_lora_rank=16, **ENGINE_SETTINGS)
    lora = LoRARequest("attn-r8", 1, paths["attn-r8"])
    params = SamplingParams(max_tokens=12, temperature=0)

    def run(llm: LLM) -> list[list[int]]:
        return [out.outputs[0].token_ids for out in llm.generate(
            [{"prompt_token_ids": p} for p in prompts] * 2, params, use_tqdm=False,
            lora_request=[lora] * len(prompts) + [None] * len(prompts))]

    expected = run(LLM(use_tqdm=False, **settings))
    llm = LLM(use_tqdm=False, speculative_config=dict(NGRAM), **settings)
    assert run(llm) == expected
    assert llm.llm_engine.stats()["spec_decode_num_accepted_tokens"] > 0


def test_verify_benchmark_times_each_k_on_its_own_runner(tmp_path):
    """benchmarks/spec_decode.py verify on a tiny shape: each k on a runner built with that k (a single sequence's
    verify step in its own (1 + k, 1) bucket, the plain step in (1, 1), both sampling 8 rows), only the timed shapes
    compiled and none after warm-up."""
    import json

    from benchmarks.spec_decode import main

    result = main(["verify", "--tiny", "--batches", "1,2", "--ks", "0,2", "--context", "16", "--repeats", "1",
                   "--dtype", "float32", "--out", str(tmp_path / "v.json")])
    cases = {(c["batch"], c["k"]): c for c in result["cases"]}
    assert list(cases) == [(1, 0), (2, 0), (1, 2), (2, 2)]
    assert (cases[1, 0]["bucket"], cases[1, 2]["bucket"]) == ([1, 1], [3, 1])
    assert cases[1, 0]["sample_rows"] == cases[1, 2]["sample_rows"] == 8
    assert cases[2, 2]["bucket"] == [16, 8] and cases[2, 2]["ratio"] > 0
    assert all(c["num_compiles_since_warmup"] == 0 and c["step_ms"] > 0 for c in result["cases"])
    assert len(json.loads((tmp_path / "v.json").read_text())["cases"]) == 4
