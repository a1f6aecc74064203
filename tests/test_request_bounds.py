"""Every field that multiplies a request's work is bounded (issue 53): the sequences it runs (n, best_of, beam
width, each prompt of a batch) against ``--max-seqs-per-request`` (by default half the engine's ``max_num_seqs``) and
``--max-waiting-requests``, the top logprobs per token (``logprobs``, ``top_logprobs``, ``prompt_logprobs``) against
``--max-logprobs``, stop strings, banned ids and ``logit_bias`` against the engine's widths, and the fields rendered
into the prompt or compiled into a grammar (tools, schemas) against the longest prompt text the context can hold.
For each: one value past the bound is a 400 naming the field, the bound itself is served.

One app over the session's SmolLM2 engine (``serving_engine``: max_model_len 256, max_num_seqs 4), with
``--max-seqs-per-request 4`` (above its default, so that both bounds can be crossed alone) and
``--max-waiting-requests 3``.
"""

from __future__ import annotations

import json

import httpx
import pytest
from test_serving import ServerThread

from paged_jax.sampling_params import MAX_LOGPROBS, SamplingParams, num_sequences
from paged_jax.worker.sampler import BANNED_WIDTH, LOGIT_BIAS_WIDTH
from serving.request_limits import default_max_seqs_per_request

MODEL_NAME = "smollm2-bounds"
MAX_WAITING = 3
MAX_NUM_SEQS = 4  # serving_engine's, and the app's --max-seqs-per-request
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(serving_engine):
    from serving.app import create_app

    app = create_app(serving_engine, served_model_name=MODEL_NAME, max_waiting_requests=MAX_WAITING,
                     max_seqs_per_request=MAX_NUM_SEQS)
    with ServerThread(app) as handle:
        yield handle


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def _completion(**fields):
    return {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, **fields}


def _chat(**fields):
    return {"model": MODEL_NAME, "messages": CHAT, "max_completion_tokens": 2, **fields}


def _refused(response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == 400, error
    return error["message"]


def test_num_sequences_is_the_one_rule():
    assert num_sequences(3) == 3 and num_sequences(2, best_of=5) == 5
    assert SamplingParams(n=2, best_of=5, temperature=1.0).num_sequences == 5
    assert SamplingParams(n=3).num_sequences == 3


def test_the_default_per_request_bound_is_half_of_max_num_seqs(server, serving_engine):
    assert serving_engine.max_num_seqs == MAX_NUM_SEQS
    assert default_max_seqs_per_request(serving_engine) == MAX_NUM_SEQS // 2
    assert server.app.state.server.max_seqs_per_request == MAX_NUM_SEQS


# (field, body over the per-request bound, body over the waiting-queue bound, body within both, choices served).
SEQUENCE_CASES = {
    "n": (dict(n=MAX_NUM_SEQS + 1), dict(n=MAX_WAITING + 1), dict(n=MAX_WAITING, temperature=1.0), MAX_WAITING),
    "best_of": (dict(best_of=MAX_NUM_SEQS + 1, temperature=1.0), dict(best_of=MAX_WAITING + 1, temperature=1.0),
                dict(best_of=MAX_WAITING, temperature=1.0), 1),
    "beam width": (dict(use_beam_search=True, n=MAX_NUM_SEQS + 1), dict(use_beam_search=True, n=MAX_WAITING + 1),
                   dict(use_beam_search=True, n=2), 2),
    "prompt batch": (dict(prompt=["a"] * (MAX_NUM_SEQS + 1)), dict(prompt=[[1, 2]] * (MAX_WAITING + 1)),
                     dict(prompt=["a", "b", "c"]), 3),
}
PARAM = {"n": "n", "best_of": "best_of", "beam width": "n", "prompt batch": "prompt"}


@pytest.mark.parametrize("field", SEQUENCE_CASES)
def test_every_sequence_counts_against_both_bounds(http, field):
    over_request, over_queue, within, num_choices = SEQUENCE_CASES[field]
    message = _refused(http.post("/v1/completions", json=_completion(**over_request)), PARAM[field])
    assert f"{MAX_NUM_SEQS + 1} sequences" in message and "--max-seqs-per-request" in message
    message = _refused(http.post("/v1/completions", json=_completion(**over_queue)), PARAM[field])
    assert f"{MAX_WAITING + 1} sequences" in message and "--max-waiting-requests" in message
    response = http.post("/v1/completions", json=_completion(**within))
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == num_choices


def test_huge_best_of_is_refused_before_any_work(http, server):
    for body in (_completion(best_of=100000), _chat(best_of=100000, temperature=1.0)):
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        _refused(http.post(path, json=body), "best_of")
    for body, path in ((_completion(best_of=MAX_NUM_SEQS + 1, temperature=1.0), "/v1/completions"),
                       (_chat(best_of=MAX_NUM_SEQS + 1, temperature=1.0), "/v1/chat/completions")):
        assert "--max-seqs-per-request" in _refused(http.post(path, json=body), "best_of")
    assert server.async_engine.num_in_flight == 0
    # An ordinary request right after is served.
    assert http.post("/v1/completions", json=_completion()).status_code == 200


def test_batch_times_n_counts_every_sequence(http):
    message = _refused(http.post("/v1/completions", json=_completion(prompt=["a", "b"], n=2)), "n")
    assert "4 sequences (2 prompt(s) x n=2)" in message


@pytest.mark.parametrize("path, field, over, within", [
    ("/v1/completions", "logprobs", dict(logprobs=MAX_LOGPROBS + 1), dict(logprobs=MAX_LOGPROBS)),
    ("/v1/chat/completions", "top_logprobs", dict(logprobs=True, top_logprobs=MAX_LOGPROBS + 1),
     dict(logprobs=True, top_logprobs=MAX_LOGPROBS)),
    ("/v1/completions", "prompt_logprobs", dict(prompt_logprobs=MAX_LOGPROBS + 1), dict(prompt_logprobs=2)),
    ("/v1/completions", "prompt_logprobs", dict(prompt_logprobs=-1), dict(prompt_logprobs=0)),
])
def test_logprob_widths_are_bounded(http, path, field, over, within):
    body = _completion if path == "/v1/completions" else _chat
    _refused(http.post(path, json=body(**over)), field)
    response = http.post(path, json=body(**within, **({"prompt": "Hello world, how are you"}
                                                      if field == "prompt_logprobs" else {})))
    assert response.status_code == 200, response.text
    if field == "prompt_logprobs":  # each prompt token: itself plus at most the asked alternatives
        entries = [e for e in response.json()["choices"][0]["prompt_logprobs"] if e is not None]
        assert entries and all(len(e) <= within["prompt_logprobs"] + 1 for e in entries)


@pytest.mark.parametrize("field, over, within", [
    ("stop", dict(stop=[f"s{i}" for i in range(65)]), dict(stop=[f"s{i}" for i in range(64)])),
    ("stop", dict(stop=["s" * 513]), dict(stop=["s" * 512])),
    ("stop_token_ids", dict(stop_token_ids=list(range(100, 101 + BANNED_WIDTH)), min_tokens=1),
     dict(stop_token_ids=list(range(100, 100 + BANNED_WIDTH - 1)), min_tokens=1)),
    ("bad_words", dict(bad_words=[f"{a}{b}" for a in "bcdfg" for b in "klmnpqrstvz"]), dict(bad_words=["bk"])),
    ("logit_bias", dict(logit_bias={str(i): 1.0 for i in range(LOGIT_BIAS_WIDTH + 1)}),
     dict(logit_bias={str(i): 1.0 for i in range(LOGIT_BIAS_WIDTH)})),
])
def test_per_token_work_lists_are_bounded(http, field, over, within):
    _refused(http.post("/v1/completions", json=_completion(**over)), field)
    response = http.post("/v1/completions", json=_completion(**within))
    assert response.status_code == 200, response.text


def _tool(num_properties: int) -> dict:
    properties = {f"p{i}": {"type": "string", "description": "x" * 20} for i in range(num_properties)}
    return {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": properties}}}


def _schema_fields(schema: dict) -> dict:
    """Each structured-output field, asking for ``schema``."""
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
            "guided_json": schema, "structured_outputs": {"json": schema}}


def test_tools_and_schemas_are_bounded_by_the_context(http, server):
    max_chars = server.app.state.server.max_prompt_chars
    big_tool = _tool(max_chars // 40)
    assert len(json.dumps(big_tool)) > max_chars
    message = _refused(http.post("/v1/chat/completions", json=_chat(tools=[big_tool])), "tools")
    assert str(max_chars) in message
    _refused(http.post("/tokenize", json={"messages": CHAT, "tools": [big_tool]}), "tools")
    big_schema = big_tool["function"]["parameters"]
    for field, value in _schema_fields(big_schema).items():
        _refused(http.post("/v1/chat/completions", json=_chat(**{field: value})), field)
        _refused(http.post("/v1/completions", json=_completion(**{field: value})), field)
    _refused(http.post("/v1/completions", json=_completion(guided_choice=["x" * 100] * (max_chars // 100))),
             "guided_choice")
    _refused(http.post("/v1/completions", json=_completion(guided_regex="a" * (max_chars + 1))), "guided_regex")
    # Within the bound: a small schema is served (and followed).
    response = http.post("/v1/completions", json=_completion(guided_json={"type": "boolean"}, max_tokens=4,
                                                             temperature=0))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] in ("true", "false")


def test_request_chat_templates_need_trust(http, server):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    _refused(http.post("/v1/chat/completions", json=_chat(chat_template=template)), "chat_template")
    _refused(http.post("/v1/chat/completions", json=_chat(chat_template_kwargs={"chat_template": template})),
             "chat_template_kwargs")
    _refused(http.post("/tokenize", json={"messages": CHAT, "chat_template": template}), "chat_template")
    openai_server = server.app.state.server
    openai_server.trust_request_chat_template = True  # --trust-request-chat-template
    try:
        response = http.post("/tokenize", json={"messages": CHAT, "chat_template": template})
        assert response.status_code == 200, response.text
        assert response.json()["count"] == len(openai_server.tokenizer.encode("Hi", add_special_tokens=False))
    finally:
        openai_server.trust_request_chat_template = False


# ------------------------------------------------------------------------------------- token-id prompt messages
@pytest.mark.parametrize("prompt, where, shown", [
    ([1, True, 3], "prompt[1]", "got true"),
    ([5, 6, -1], "prompt[2]", "got -1"),
    ([1, 2.5], "prompt[1]", "got 2.5"),
    ([[1, 2], [3, "x"]], "prompt[1][1]", 'got "x"'),
    ([[1, 2], 3], "prompt[1]", "lists of token ids, got 3"),
    (["a", 7], "prompt[1]", "only strings, got 7"),
    ({"ids": [1]}, "prompt", 'got {"ids": [1]}'),
])
def test_token_id_prompt_errors_name_the_index(http, prompt, where, shown):
    message = _refused(http.post("/v1/completions", json=_completion(prompt=prompt)), "prompt")
    assert message.startswith(f"{where}: ") and shown in message, message
    assert "more error" not in message and ".str" not in message


def test_out_of_vocabulary_ids_name_the_prompt_and_index(http, serving_engine):
    vocab = serving_engine.vocab_size
    message = _refused(http.post("/v1/completions", json=_completion(prompt=[1, vocab])), "prompt")
    assert message.startswith(f"prompt[1]: token id {vocab} is out of range [0, {vocab})"), message
    message = _refused(http.post("/v1/completions", json=_completion(prompt=[[1], [2, 3, vocab + 5]])), "prompt")
    assert message.startswith(f"prompt[1][2]: token id {vocab + 5} is out of range"), message


# ------------------------------------------------------------------------------ usage.prompt_tokens_details
def test_cached_tokens_behind_enable_prompt_tokens_details(http, server):
    prompt = "An unrepeated opening for the prefix cache, 53. " * 6  # several full KV blocks
    body = _completion(prompt=prompt, max_tokens=1)
    assert http.post("/v1/completions", json=body).json()["usage"]["prompt_tokens_details"] is None  # flag off
    openai_server = server.app.state.server
    openai_server.enable_prompt_tokens_details = True  # --enable-prompt-tokens-details
    try:
        usage = http.post("/v1/completions", json=body).json()["usage"]  # the blocks cached by the first request
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert 0 < cached < usage["prompt_tokens"]
        fresh = _completion(prompt="A different opening, never sent before: 71. " * 6, max_tokens=1)
        assert http.post("/v1/completions", json=fresh).json()["usage"]["prompt_tokens_details"] == {
            "cached_tokens": 0}
        # Streamed: the final usage chunk; chat the same.
        with http.stream("POST", "/v1/completions", json={**body, "stream": True, "stream_options": {}}) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}
        messages = [{"role": "user", "content": prompt}]
        first, second = (http.post("/v1/chat/completions", json=_chat(messages=messages)).json()["usage"]
                         for _ in range(2))
        assert first["prompt_tokens_details"]["cached_tokens"] < second["prompt_tokens_details"]["cached_tokens"]
    finally:
        openai_server.enable_prompt_tokens_details = False
