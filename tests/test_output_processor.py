"""The output processor on hand-made core outputs (no model): deltas, FINAL_ONLY, n > 1 sequences ending apart."""

import dataclasses
import random

import pytest

from paged_jax.engine.messages import DecodeTokens, EngineCoreOutput, EngineCoreRequest
from paged_jax.engine.output_processor import DecodeColumns, OutputProcessor
from paged_jax.outputs import CompletionOutput, RequestOutput, running_delta
from paged_jax.sampling_params import SamplingParams

# Per step, the core's outputs: request "a" (n=2; sequence 0 ends first, by length) and "b" (n=1, ends by a stop
# token); the first output of each sequence carries its scheduling facts.
STEPS = [
    [EngineCoreOutput("a", 0, [5], num_cached_tokens=16, scheduled_time=1.0), EngineCoreOutput("a", 1, [6]),
     EngineCoreOutput("b", 0, [7], scheduled_time=1.0)],
    [EngineCoreOutput("a", 0, [8], finish_reason="length"), EngineCoreOutput("a", 1, [9]),
     EngineCoreOutput("b", 0, [10])],
    [EngineCoreOutput("a", 1, []), EngineCoreOutput("b", 0, [2], finish_reason="stop", stop_reason=2)],
    [EngineCoreOutput("a", 1, [11], finish_reason="length")],
]


def _processor() -> OutputProcessor:
    processor = OutputProcessor(None)
    processor.add_request(EngineCoreRequest("a", [1, 2, 3], SamplingParams(n=2, max_tokens=3, seed=0)), None)
    processor.add_request(EngineCoreRequest("b", [4], SamplingParams(max_tokens=8, stop_token_ids=[2])), None)
    return processor


def test_final_only_reports_each_request_once_with_every_sequence_whole():
    streaming, final_only = _processor(), _processor()
    deltas: dict[str, dict[int, list[int]]] = {"a": {0: [], 1: []}, "b": {0: []}}
    finals, finished_steps = {}, {}
    for step, outputs in enumerate(STEPS):
        stream_outputs, stopped = streaming.process_outputs(outputs)
        assert not stopped
        # A sequence's output without tokens or a finish reports nothing new.
        assert [o.request_id for o in stream_outputs] == list(dict.fromkeys(
            o.request_id for o in outputs if o.new_token_ids or o.finish_reason))
        for output in stream_outputs:
            for completion in output.outputs:
                deltas[output.request_id][completion.index] += completion.token_ids
        for output in final_only.process_outputs(outputs, finished_only=True)[0]:
            assert output.finished and output.request_id not in finals
            finals[output.request_id], finished_steps[output.request_id] = output, step
    assert finished_steps == {"b": 2, "a": 3}  # each when its last sequence ended
    assert {i: c.token_ids for i, c in enumerate(finals["a"].outputs)} == deltas["a"] == {0: [5, 8], 1: [6, 9, 11]}
    assert [c.finish_reason for c in finals["a"].outputs] == ["length", "length"]
    assert finals["b"].outputs[0].token_ids == deltas["b"][0] == [7, 10, 2]
    assert (finals["b"].outputs[0].finish_reason, finals["b"].outputs[0].stop_reason) == ("stop", 2)
    assert finals["a"].num_cached_tokens == 16 and finals["a"].metrics.first_scheduled_time == 1.0
    assert finals["a"].metrics.first_token_time is not None
    assert finals["a"].metrics.last_token_time >= finals["a"].metrics.first_token_time
    assert not streaming.has_unfinished_requests() and not final_only.has_unfinished_requests()


def test_tokens_after_a_sequence_finished_are_dropped():
    """The core may compute a token or two after a sequence ended (a stop string's abort on its way): dropped."""
    processor = _processor()
    processor.process_outputs(STEPS[0])
    processor.process_outputs(STEPS[1])  # sequence 0 of "a" ends
    outputs, _ = processor.process_outputs([EngineCoreOutput("a", 0, [12]), EngineCoreOutput("a", 1, [13])])
    assert [(c.index, c.token_ids) for o in outputs for c in o.outputs] == [(1, [13])]
    outputs, _ = processor.process_outputs([EngineCoreOutput("a", 0, [14])])
    assert [o.outputs for o in outputs] in ([], [[]])  # nothing of it reported


def _random_steps(seed: int) -> tuple[list[EngineCoreRequest], list[list[EngineCoreOutput]]]:
    """A seeded workload: requests with one or two sequences, logprob-free; per call one or two core steps of token
    outputs (some empty), first outputs with scheduling facts, finishes by length or stop token, a token after a
    finish."""
    rng = random.Random(seed)
    requests = [EngineCoreRequest(f"r{i}", [1, 2, 3], SamplingParams(n=rng.choice([1, 1, 1, 2]), max_tokens=50))
                for i in range(12)]
    live = {r.request_id: list(range(r.sampling_params.n)) for r in requests}
    first = {(r, i) for r, seqs in live.items() for i in seqs}
    calls = []
    while any(live.values()):
        call = []
        for _ in range(rng.choice([1, 1, 2])):
            for request_id, seqs in live.items():
                for index in list(seqs):
                    output = EngineCoreOutput(request_id, index, [rng.randrange(100)] if rng.random() < 0.9 else [])
                    if (request_id, index) in first:
                        first.discard((request_id, index))
                        output.scheduled_time, output.num_cached_tokens = 1.0, rng.choice([0, 16])
                    if rng.random() < 0.1:
                        output.finish_reason = rng.choice(["length", "stop"])
                        output.stop_reason = 7 if output.finish_reason == "stop" else None
                        seqs.remove(index)
                    call.append(output)
        if rng.random() < 0.2 and call:
            call.append(EngineCoreOutput(call[0].request_id, call[0].index, [5]))  # may follow a finish
        calls.append(call)
    return requests, calls


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("finished_only", [False, True])
def test_plain_requests_fast_path_gives_the_general_outputs(seed, finished_only, monkeypatch):
    """Running one-sequence token-id requests take the ``plain`` branch: the same ``RequestOutput`` s (metrics aside:
    wall-clock times) as the general path, with n = 2 requests and finishes among them."""
    def run(plain: bool) -> list:
        requests, calls = _random_steps(seed)
        processor = OutputProcessor(None)
        for request in requests:
            processor.add_request(request, None)
            if not plain:
                processor._states[request.request_id].plain = False
        trace = []
        for call in calls:
            outputs, stopped = processor.process_outputs(call, finished_only)
            trace.append(([dataclasses.replace(o, metrics=None) for o in outputs], stopped))
        return trace, processor.has_unfinished_requests()

    plain_trace = run(True)
    assert plain_trace == run(False)
    assert sum(len(outputs) for outputs, _ in plain_trace[0]) > 0


def test_running_delta_is_the_dataclasses_output():
    """``running_delta`` sets every field of both dataclasses (a field added to either and not set there fails
    here) to what their constructors give."""
    delta = running_delta("r", "hi", [1, 2], [5], 16)
    assert delta == RequestOutput("r", "hi", [1, 2], [CompletionOutput(0, "", [5], None, None)], False, 16)
    for output in (delta, delta.outputs[0]):
        assert all(hasattr(output, field.name) for field in dataclasses.fields(output))


def _as_columns(call: list[EngineCoreOutput]) -> tuple[list[EngineCoreOutput], DecodeTokens]:
    """Split a call's outputs as a steady decode's core sends them: the token-only ones (one token, no finish, not
    a first output) as ``DecodeTokens`` after the others."""
    rest, columns = [], DecodeTokens([], [], [])
    for output in call:
        if (len(output.new_token_ids) == 1 and output.finish_reason is None and output.scheduled_time is None
                and not output.num_cached_tokens):
            columns.request_ids.append(output.request_id)
            columns.indices.append(output.index)
            columns.token_ids.append(output.new_token_ids[0])
        else:
            rest.append(output)
    return rest, columns


class _NoText:
    """A detokenizer that makes no text (the general path's per-token work, without a tokenizer)."""

    def append(self, token_ids, finished: bool) -> tuple[str, None]:
        return "", None

    def emitted_since(self, num_chars: int) -> str:
        return ""


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("finished_only", [False, True])
def test_decode_columns_give_the_outputs_of_their_rows(seed, finished_only):
    """``DecodeTokens`` columns (plain and n = 2 requests, tokens after a finish) give the same ``RequestOutput`` s
    (metrics aside) as the same outputs one object per row in the same order, with a detokenizing request taking
    the general path."""
    def run(columns: bool) -> list:
        requests, calls = _random_steps(seed)
        processor = OutputProcessor(None)
        for request in requests:
            processor.add_request(request, None)
        processor._states["r0"].seqs[0].detokenizer = _NoText()  # a row the columns cannot take as is
        trace = []
        for call in calls:
            rest, decode = _as_columns(call)
            outputs, stopped = (processor.process_outputs(rest, finished_only, decode) if columns else
                                processor.process_outputs(rest + decode.expand(), finished_only))
            trace.append(([dataclasses.replace(o, metrics=None) for o in outputs], stopped))
        return trace

    trace = run(True)
    assert trace == run(False)
    assert sum(len(outputs) for outputs, _ in trace) > 0


@pytest.mark.parametrize("with_pair", [False, True])
@pytest.mark.parametrize("finished_only", [False, True])
def test_steady_decode_columns_across_calls(with_pair, finished_only, monkeypatch):
    """A steady decode's ``DecodeTokens`` (one row list object call after call, as the core sends it) give the same
    outputs as one object per row, across an abort, a finish and a sequence's own stop between calls (the rows kept
    from an earlier call are dropped then)."""
    def run(columns: bool) -> list:
        requests = [EngineCoreRequest(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=50)) for i in range(5)]
        if with_pair:
            requests.append(EngineCoreRequest("pair", [1, 2], SamplingParams(n=2, max_tokens=50)))
        processor = OutputProcessor(None)
        for request in requests:
            processor.add_request(request, None)
        rows = [(r.request_id, i) for r in requests for i in range(r.sampling_params.n)]
        first = [EngineCoreOutput(r, i, [9], scheduled_time=1.0) for r, i in rows]
        trace = [processor.process_outputs(first, finished_only)]
        ids, indices = [r for r, _ in rows], [i for _, i in rows]
        rng = random.Random(0)
        for call in range(8):
            rest = []
            if call == 2:
                processor.abort_requests(["r1"])  # its rows still come with this call's columns
            if call == 4:  # r2 ends (a length finish) beside the columns of the others
                rest = [EngineCoreOutput("r2", 0, [4], finish_reason="length")]
                keep = [k for k, r in enumerate(ids) if r not in ("r1", "r2")]
                ids, indices = [ids[k] for k in keep], [indices[k] for k in keep]
            if call == 6 and with_pair:  # one sequence of the pair ends alone
                rest = [EngineCoreOutput("pair", 1, [4], finish_reason="stop", stop_reason=4)]
                ids, indices = ids[:-1], indices[:-1]
            decode = DecodeTokens(ids, indices, [rng.randrange(100) for _ in ids])
            outputs, stopped = (processor.process_outputs(rest, finished_only, decode) if columns else
                                processor.process_outputs(rest + decode.expand(), finished_only))
            trace.append(([dataclasses.replace(o, metrics=None) for o in outputs], stopped))
        last = [EngineCoreOutput(r, i, [1], finish_reason="length") for r, i in zip(ids, indices)]
        trace.append(([dataclasses.replace(o, metrics=None) for o in processor.process_outputs(last, finished_only)[0]],
                      None))
        return trace[1:]

    applied = []
    apply = DecodeColumns.apply
    monkeypatch.setattr(DecodeColumns, "apply", lambda self, *args: applied.append(1) or apply(self, *args))
    trace = run(True)
    assert trace == run(False)
    assert sum(len(outputs) for outputs, _ in trace) > 0
    assert len(applied) >= (3 if finished_only or not with_pair else 0)  # the columns' own path ran
