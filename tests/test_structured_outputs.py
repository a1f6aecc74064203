"""Structured outputs end to end: ``response_format`` / ``structured_outputs`` / ``guided_*`` through the official
``openai`` client against the real engine (SmolLM2 on CPU, the shared ``serving_engine``), and offline
``SamplingParams(structured_outputs=StructuredOutputsParams(...))`` under preemption and async scheduling."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema_rs
import openai
import pytest

from benchmarks.structured import varied_schemas
from paged_jax.sampling_params import SamplingParams, StructuredOutputsParams
from tests.test_serving import ServerThread

MODEL_NAME = "smollm2-structured"
CHAT = [{"role": "user", "content": "Describe a fictional person as JSON."}]


@pytest.fixture(scope="module")
def server(serving_engine):
    from serving.app import create_app

    # --max-seqs-per-request at the engine's 4 seats (its default is half): a test runs n=3.
    with ServerThread(create_app(serving_engine, served_model_name=MODEL_NAME, max_seqs_per_request=4)) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.mark.slow
def test_50_varied_json_schemas_all_valid(server, serving_engine):
    schemas = varied_schemas(50)
    assert len({json.dumps(s, sort_keys=True) for s in schemas}) == 50

    async def run_all():
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=600)
        async with client:
            return await asyncio.gather(*(client.chat.completions.create(
                model=MODEL_NAME, messages=CHAT, temperature=0, max_completion_tokens=120,
                response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                        "strict": True}})
                for i, schema in enumerate(schemas)))

    responses = asyncio.run(run_all())
    for schema, response in zip(schemas, responses):
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert jsonschema_rs.validator_for(schema).is_valid(json.loads(choice.message.content)), (
            schema, choice.message.content)
    assert serving_engine.stats()["num_compiles_since_warmup"] == 0


def test_regex_choice_grammar_and_json_object(client):
    def chat(**extra):
        r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, temperature=0, max_completion_tokens=40,
                                           extra_body=extra)
        return r.choices[0].message.content

    name_age = r"[A-Z][a-z]{2,6} is [1-9][0-9]"
    assert re.fullmatch(name_age, chat(structured_outputs={"regex": name_age}))
    assert re.fullmatch(r"\d{3}-\d{4}", chat(guided_regex=r"\d{3}-\d{4}", guided_decoding_backend="xgrammar"))
    assert chat(guided_choice=["cat", "dog", "fish"]) in ("cat", "dog", "fish")
    assert chat(structured_outputs={"choice": ["yes", "no"]}) in ("yes", "no")
    grammar = 'root ::= ("red" | "green") " " digit digit?\ndigit ::= [0-9]'
    assert re.fullmatch(r"(red|green) [0-9][0-9]?", chat(guided_grammar=grammar))
    assert re.fullmatch(r"(red|green) [0-9][0-9]?", chat(structured_outputs={"grammar": grammar}))
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, temperature=0, max_completion_tokens=60,
                                       response_format={"type": "json_object"})
    text = r.choices[0].message.content  # any object: it may run past the token budget, but it starts as one
    assert text.lstrip().startswith("{") and (r.choices[0].finish_reason == "length" or isinstance(json.loads(text),
                                                                                                   dict))
    completion = client.completions.create(model=MODEL_NAME, prompt="My phone number is", max_tokens=20,
                                           temperature=0, extra_body={"guided_regex": r" \d{3}-\d{4}"})
    assert re.fullmatch(r" \d{3}-\d{4}", completion.choices[0].text)
    # n > 1: one matcher per sequence.
    r = client.completions.create(model=MODEL_NAME, prompt="Pick one:", max_tokens=5, n=3, temperature=1.0,
                                  seed=5, extra_body={"guided_choice": ["alpha", "beta", "gamma"]})
    assert len(r.choices) == 3 and all(c.text in ("alpha", "beta", "gamma") for c in r.choices)


def test_streamed_json_schema_is_valid(client):
    schema = varied_schemas(3)[2]
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, temperature=0, max_completion_tokens=120, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert jsonschema_rs.validator_for(schema).is_valid(json.loads(text))


def test_specs_that_cannot_compile_are_400_naming_the_field(server, client):
    async def run():
        client_async = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0,
                                          timeout=300)
        async with client_async:
            # A request in flight meanwhile finishes normally.
            in_flight = asyncio.ensure_future(client_async.completions.create(
                model=MODEL_NAME, prompt="Count: one, two,", max_tokens=12, temperature=0, extra_body={
                    "ignore_eos": True, "guided_regex": r"( [a-z]+,){3}.*"}))
            cases = [({"guided_regex": "a(b"}, "guided_regex"),
                     ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
                     ({"guided_grammar": "root ::= ("}, "guided_grammar"),
                     ({"guided_json": {"type": "not-a-type"}}, "guided_json"),
                     ({"response_format": {"type": "json_schema",
                                           "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
                      "response_format"),
                     ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
                     ({"structured_outputs": {"regexp": "a"}}, "structured_outputs"),
                     ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
                     ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
                     ({"guided_whitespace_pattern": " ", "guided_json": {}}, "guided_whitespace_pattern")]
            for extra, field in cases:
                with pytest.raises(openai.BadRequestError) as info:
                    await client_async.chat.completions.create(model=MODEL_NAME, messages=CHAT,
                                                               max_completion_tokens=4, extra_body=extra)
                assert info.value.body["param"] == field, (extra, info.value.body)
            return await in_flight

    done = asyncio.run(run())
    assert re.fullmatch(r"( [a-z]+,){3}.*", done.choices[0].text) and done.usage.completion_tokens == 12


# ------------------------------------------------------------------------------------------------ offline
# CI time: grammars under async scheduling stay in CI (test_async_grammar_rows_overlap_the_forward), preemption
# too (test_engine); this combines them.
@pytest.mark.slow
def test_offline_constrained_batch_same_under_preemption_and_async(serving_engine, smollm2_tokenizer):
    """A constrained batch (JSON schemas, regex, choice; n = 2) on a KV pool too small for it (recompute
    preemptions) with async scheduling gives the synchronous roomy run's outputs."""
    from paged_jax.config import EngineArgs
    from paged_jax.engine.llm_engine import LLMEngine
    from tests.test_engine import TEXT, TIGHT_BATCHED_TOKENS, TIGHT_BLOCKS, run_to_completion

    text_ids = smollm2_tokenizer.encode(TEXT)
    schemas = varied_schemas(6)
    specs = ([StructuredOutputsParams(json=s) for s in schemas]
             + [StructuredOutputsParams(regex=r"[a-z]+( [a-z]+){3,6}\."), StructuredOutputsParams(choice=["x", "y"]),
                StructuredOutputsParams(grammar='root ::= "(" [0-9]+ ")"', disable_any_whitespace=True)])
    specs = (specs * 2)[:12]
    prompts = [text_ids[i * 7: i * 7 + 90 + (i * 13) % 60] for i in range(len(specs))]
    params = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=spec, n=1 + (i == 3)) for i, spec
              in enumerate(specs)]
    reference = run_to_completion(serving_engine, prompts, params, prefix="ref")
    # The shapes of tests/test_engine.py's tight engine (compiled once for the files that share them); prompts prefill
    # in chunks.
    engine = LLMEngine(EngineArgs(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=TIGHT_BATCHED_TOKENS,
                                  num_gpu_blocks_override=TIGHT_BLOCKS, seed=0, async_scheduling=True), use_tqdm=False)
    expected = [[c.token_ids for c in o.outputs] for o in reference]
    outputs = run_to_completion(engine, prompts, params, prefix="tight")
    assert [[c.token_ids for c in o.outputs] for o in outputs] == expected
    assert engine.stats()["num_preemptions"] > 0 and engine.engine_core.runner.num_compiles_since_warmup == 0
    for spec, out in zip(specs, reference):
        for completion in out.outputs:
            if spec.json is not None and completion.finish_reason == "stop":
                assert jsonschema_rs.validator_for(spec.json).is_valid(json.loads(completion.text))


def test_invalid_offline_specs_raise_value_errors_naming_the_field(serving_engine):
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="^whitespace_pattern"):
        StructuredOutputsParams(json={}, whitespace_pattern=" ")
    with pytest.raises(ValueError, match="^regex: cannot be compiled"):
        serving_engine.add_request("bad", [1, 2, 3], SamplingParams(structured_outputs=StructuredOutputsParams(
            regex="a(b")))
    assert not serving_engine.has_unfinished_requests()


def test_async_grammar_rows_overlap_the_forward(serving_engine, smollm2_tokenizer, monkeypatch):
    """Async scheduling with constrained requests in flight: each step's forward is dispatched before the previous
    step's tokens are fetched; the grammars advance with them, then the bitmask goes with the sampling. Outputs
    equal the synchronous run's."""
    from paged_jax.worker.step_io import PendingStep
    from paged_jax.structured_output.manager import SequenceGrammar
    from tests.test_engine import run_to_completion

    engine, runner = serving_engine, serving_engine.engine_core.runner
    events: list[str] = []

    def record(name, fn):
        def wrapped(*args, **kwargs):
            events.append(name)
            return fn(*args, **kwargs)
        return wrapped

    for name, attr in (("forward", "run_forward"), ("sample", "run_sampling")):
        monkeypatch.setattr(runner, attr, record(name, getattr(runner, attr)))
    monkeypatch.setattr(PendingStep, "result", record("fetch", PendingStep.result))
    monkeypatch.setattr(SequenceGrammar, "accept", record("accept", SequenceGrammar.accept))
    prompts = [smollm2_tokenizer.encode(text) for text in ("A person as JSON:", "Three words:", "Once upon a time")]
    params = [SamplingParams(temperature=0.8, seed=1, max_tokens=10, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(json=varied_schemas(1)[0])),
              SamplingParams(temperature=0.8, seed=2, max_tokens=10, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(regex=r"[a-z]+( [a-z]+){2}\.")),
              SamplingParams(temperature=0.8, seed=3, max_tokens=10)]
    outputs = {}
    try:
        for async_scheduling in (False, True):
            engine.engine_core.async_scheduling = async_scheduling
            events.clear()
            done = run_to_completion(engine, prompts, params, prefix=f"ov{async_scheduling}")
            outputs[async_scheduling] = [[c.token_ids for c in o.outputs] for o in done]
    finally:
        engine.engine_core.async_scheduling = False
    assert outputs[True] == outputs[False]
    # Collapse each run of accepts. A step with grammar rows is dispatched in two halves; with a step in flight
    # (async) the previous step's tokens are fetched and accepted between them.
    steps = [e for i, e in enumerate(events) if e != "accept" or events[i - 1] != "accept"]
    halves = [steps[i:i + 4] for i, e in enumerate(steps) if e == "forward"]
    assert all(h[1] == "sample" or h == ["forward", "fetch", "accept", "sample"] for h in halves), steps
    assert sum(h[1] == "fetch" for h in halves) >= 8, steps
    assert engine.stats()["num_compiles_since_warmup"] == 0 and not engine.has_unfinished_requests()


def test_padded_vocabulary_bitmask_equals_xgrammars_own(smollm2_tokenizer, monkeypatch):
    """A model vocabulary padded past the tokenizer's ids: the grammars use the tokenizer's ids only (xgrammar would
    count every padding id as a special token), and the step bitmask equals the one xgrammar fills over the whole
    padded vocabulary: the padding ids banned, the same tokens allowed; the threaded fill (many grammar rows on a
    multi-core host) writes the same rows as one thread."""
    import numpy as np
    import xgrammar as xgr

    from paged_jax.structured_output import StructuredOutputManager, backend, fill_step_bitmask

    vocab_size, eos = len(smollm2_tokenizer) + 1000, smollm2_tokenizer.eos_token_id
    manager = StructuredOutputManager(smollm2_tokenizer, vocab_size, [eos])
    specs = [StructuredOutputsParams(json=varied_schemas(2)[1]), StructuredOutputsParams(regex=r"[a-z]{2,4} [0-9]+")]
    info = xgr.TokenizerInfo.from_huggingface(smollm2_tokenizer, vocab_size=vocab_size, stop_token_ids=[eos])
    reference_compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    grammars = [manager.new_sequence(manager.grammar_for(spec)) for spec in specs]
    references = [xgr.GrammarMatcher(reference_compiler.compile_json_schema(json.dumps(specs[0].json))),
                  xgr.GrammarMatcher(reference_compiler.compile_regex(specs[1].regex))]
    assert grammars[0].backend.grammar_vocab_size == len(smollm2_tokenizer)
    for _ in range(6):
        bitmask = fill_step_bitmask([None, *grammars], 4, vocab_size)
        expected = np.full_like(bitmask, -1)
        for row, matcher in enumerate(references, start=1):
            matcher.fill_next_token_bitmask(expected, row)
        np.testing.assert_array_equal(bitmask, expected)
        with monkeypatch.context() as threaded:
            threaded.setattr(backend, "fill_threads", lambda num_rows: 2)
            np.testing.assert_array_equal(fill_step_bitmask([None, *grammars], 4, vocab_size), expected)
        for grammar, matcher, row in zip(grammars, references, (1, 2)):
            allowed = np.flatnonzero(np.unpackbits(bitmask[row].view(np.uint8), bitorder="little"))
            assert allowed.max() < len(smollm2_tokenizer)
            grammar.accept(int(allowed[len(allowed) // 2]))
            assert matcher.accept_token(int(allowed[len(allowed) // 2]))
    manager.close()


def test_drafts_are_validated_and_every_draft_position_masked(smollm2_tokenizer):
    """Speculative decoding on a tiny grammar: drafts are cut at the first token the grammar forbids (and after the
    stop token that ends it), leaving the matcher where it was; the step bitmask gives each draft position the mask
    of the grammar advanced through the drafts before it (xgrammar's own masks), rows after the grammar ended only
    the stop tokens, rows after a forbidden draft (never validated) repeat its mask; the matcher is rolled back."""
    import numpy as np

    from paged_jax.structured_output import StructuredOutputManager, fill_step_bitmask
    from paged_jax.structured_output.backend import XgrammarBackend

    tokenizer, eos = smollm2_tokenizer, smollm2_tokenizer.eos_token_id
    vocab_size = len(tokenizer)
    manager = StructuredOutputManager(tokenizer, vocab_size, [eos])
    compiled = manager.grammar_for(StructuredOutputsParams(choice=["one two three", "one four"]))
    grammar = manager.new_sequence(compiled)
    one, two, three = (tokenizer.encode(text) for text in ("one", " two", " three"))
    five = tokenizer.encode(" five")
    assert grammar.validate_tokens(one + two + five + three) == one + two
    assert grammar.validate_tokens(one + two + three + [eos] + one) == one + two + three + [eos]
    assert grammar.validate_tokens(five + one) == [] and grammar.validate_tokens([]) == []

    def reference(prefix: list[int]) -> np.ndarray:  # xgrammar's mask after ``prefix``, on a matcher of its own
        matcher = XgrammarBackend.new_matcher(compiled.result())
        assert all(matcher.accept_token(t) for t in prefix)
        row = np.full((1, bitmask.shape[1]), -1, np.int32)
        matcher.fill_next_token_bitmask(row, 0)
        return row[0]

    drafts = {1: (one + two + three + [eos], 3), 2: (one + five + two, 7)}  # row -> (drafts, first draft row)
    other = manager.new_sequence(compiled)
    for _ in range(2):  # the second time from the same (rolled back) matchers
        bitmask = fill_step_bitmask([None, grammar, other], 12, vocab_size, drafts)
        assert (bitmask[[0, 10, 11]] == -1).all()  # free row and padding
        for j, row in enumerate([3, 4, 5, 6]):  # row 1's drafts: the grammar after drafts[:j]
            np.testing.assert_array_equal(bitmask[row], reference((one + two + three)[:j]))
        np.testing.assert_array_equal(bitmask[1], manager.stop_only_row)  # after the stop token
        np.testing.assert_array_equal(bitmask[7], reference([]))
        np.testing.assert_array_equal(bitmask[8], reference(one))
        np.testing.assert_array_equal(bitmask[9], reference(one))  # " five" refused: its mask repeats
        np.testing.assert_array_equal(bitmask[2], reference(one))
        assert not np.unpackbits(bitmask[8].view(np.uint8), bitorder="little")[five[0]]
    np.testing.assert_array_equal(fill_step_bitmask([grammar], 1, vocab_size)[0], reference([]))  # rolled back
    for token in one + two:  # the kept tokens
        grammar.accept(token)
    np.testing.assert_array_equal(fill_step_bitmask([grammar], 1, vocab_size)[0], reference(one + two))
    assert grammar.error is None
    manager.close()


def test_draft_host_benchmark_leaves_the_grammars_where_they_were(smollm2_tokenizer):
    """benchmarks/structured.py's speculative-decoding figure on three schemas: drafts walked, validated and filled,
    timings positive, every grammar's mask the same afterwards."""
    import numpy as np

    from benchmarks.structured import _draft_host_us
    from paged_jax.structured_output import StructuredOutputManager, fill_step_bitmask

    vocab_size = len(smollm2_tokenizer)
    manager = StructuredOutputManager(smollm2_tokenizer, vocab_size, [smollm2_tokenizer.eos_token_id])
    grammars = [manager.new_sequence(manager.grammar_for(StructuredOutputsParams(json=schema)))
                for schema in varied_schemas(3)]
    before = fill_step_bitmask(grammars, 3, vocab_size)
    figure = _draft_host_us(grammars, vocab_size, k=3, repeats=2)
    assert figure["k"] == 3 and figure["draft_tokens"] == 9
    assert min(figure["validate_per_step"], figure["fill_per_step"], figure["fill_per_step_without_drafts"]) > 0
    np.testing.assert_array_equal(fill_step_bitmask(grammars, 3, vocab_size), before)
    manager.close()
