"""Every request field of /v1/completions and /v1/chat/completions is honoured or refused with a 400 naming it,
driven by the official ``openai`` client against the real engine (SmolLM2 on CPU, ``serving_engine``).

The engine is wrapped so each test sees what reached ``add_request`` (prompt ids, ``SamplingParams``, priority):
a sampling field is honoured when it arrives there (the engine tests cover what the engine then does with it);
fields the server itself implements are checked on the response.
"""

from __future__ import annotations

import inspect
import logging
from typing import Callable

import openai
import pytest

from serving.protocol import ChatCompletionRequest, CompletionRequest
from tests.serving_field_cases import (CHAT, CHAT_ONLY, COMMON, COMPLETION, MODEL_NAME, PARTIAL_ASSISTANT_TURN, PROMPT,
                                      REFUSED, SHOW_ALL_TEMPLATE, TOOL_TURN, Added)
from tests.test_serving import ServerThread

class RecordingEngine:
    """Delegates to the real engine and records every request the server submits (the engine thread submits)."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.added: list[Added] = []

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def submit_requests(self, requests):
        group_id = self._engine.submit_requests(requests)
        for request_id, prompt, params, priority, *_ in requests:
            salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None  # vLLM's prompt dict
            ids = list(prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt)
            text = self._engine.tokenizer.decode(ids)  # on the engine thread, which owns this tokenizer
            self.added.append(Added(request_id, ids, text, params, priority, salt))
        return group_id


@pytest.fixture(scope="module")
def engine(serving_engine):
    return RecordingEngine(serving_engine)


@pytest.fixture(scope="module")
def server(engine):
    from serving.app import create_app

    with ServerThread(create_app(engine, served_model_name=MODEL_NAME, trust_request_chat_template=True)) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture
def state(server):
    """The app's ``OpenAIServer``; settings a test changes are restored afterwards."""
    state = server.app.state.server
    saved = dict(vars(state))
    yield state
    vars(state).update(saved)


def _send(create: Callable, base: dict, body: dict):
    """``create(**base)`` with ``body``: the client's own parameters as such (``stream`` must be, for the client to
    read SSE), the rest in ``extra_body``."""
    own = set(inspect.signature(create).parameters)
    kwargs = {**base, **{key: value for key, value in body.items() if key in own and key != "extra_body"}}
    extra = {key: value for key, value in body.items() if key not in own}
    return create(**kwargs, extra_body=extra or None)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_request_field_is_honoured_or_refused(client, engine, endpoint):
    if endpoint == "completions":
        model, own, create = CompletionRequest, COMPLETION, client.completions.create
        base = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0)
    else:
        model, own, create = ChatCompletionRequest, CHAT_ONLY, client.chat.completions.create
        base = dict(model=MODEL_NAME, messages=CHAT, max_completion_tokens=4, temperature=0)
    cases = {**COMMON, **own}
    # Enumerated from the schema: a field added to the protocol without a case here fails this test.
    assert set(cases) == set(model.model_fields), set(cases) ^ set(model.model_fields)
    for field, case in cases.items():
        if case.check is REFUSED:
            with pytest.raises(openai.BadRequestError) as info:
                _send(create, base, case.body)
            assert info.value.body["param"] == field, (field, info.value.body)
        else:
            response = _send(create, base, case.body)
            assert case.check(response, engine.added) is not False, field


# ---------------------------------------------------------------------------------- fields one by one
def test_unknown_fields_are_accepted_and_logged_once(client, caplog):
    with caplog.at_level(logging.WARNING, logger="serving.protocol"):
        for _ in range(2):
            r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2,
                                          extra_body={"no_such_field_xyz": 1})
            assert r.usage.completion_tokens >= 1
    assert sum("no_such_field_xyz" in record.getMessage() for record in caplog.records) == 1


def test_suffix_and_best_of_refusals_say_why(client):
    with pytest.raises(openai.BadRequestError, match="fill-in-the-middle"):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, suffix="!", max_tokens=2)
    assert client.completions.create(model=MODEL_NAME, prompt=PROMPT, best_of=1, max_tokens=2).choices
    for extra in ({"best_of": 1, "n": 2}, {"best_of": 3, "n": 2, "stream": True}):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, **extra)
        assert info.value.body["param"] == "best_of"
    # Beam search refuses the sampling fields it does not read, and length_penalty needs it.
    for extra, param in (({"use_beam_search": True, "top_p": 0.5}, "top_p"), ({"length_penalty": 0.5},
                                                                                "length_penalty")):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, extra_body=extra)
        assert info.value.body["param"] == param


def test_request_id_names_the_response(server, engine):
    import httpx

    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        body = {"prompt": PROMPT, "max_tokens": 1, "request_id": "from-body"}
        assert c.post("/v1/completions", json=body).json()["id"] == "cmpl-from-body"
        assert engine.added[-1].request_id == "cmpl-from-body-0"
        r = c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "request_id": "from-body"},
                   headers={"X-Request-Id": "from-header"})  # the header wins, as in vLLM
        assert r.json()["id"] == "chatcmpl-from-header"


def test_no_op_values_of_refused_fields_are_accepted(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=2,
                                       tool_choice="none", response_format={"type": "text"},
                                       extra_body={"use_beam_search": False, "length_penalty": 1.0, "bad_words": []})
    assert r.usage.completion_tokens >= 1


def test_logit_bias_allowed_token_ids_and_bad_words(client, smollm2_tokenizer):
    """What the three fields do to the generated tokens (seen as ``token_id:N`` logprob entries), and their 400s."""
    def generate(**extra):
        r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0,
                                      extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True, **extra})
        return [int(token.split(":")[1]) for token in r.choices[0].logprobs.tokens]

    greedy = generate()
    banana = smollm2_tokenizer.encode(" banana", add_special_tokens=False)[0]
    assert generate(logit_bias={str(banana): 100}) == [banana] * 4
    assert generate(logit_bias={str(greedy[0]): -100})[0] != greedy[0]
    allowed = [banana, greedy[1], 13]
    assert set(generate(allowed_token_ids=allowed, temperature=1.0, seed=3)) <= set(allowed)
    word = smollm2_tokenizer.decode(greedy[:1]).strip()  # " Paris"
    without = generate(bad_words=[word])
    assert without[0] != greedy[0] and greedy[0] not in without
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=3, temperature=0,
                                          logit_bias={str(banana): 100})
    assert chat.choices[0].message.content == " banana" * 3
    vocab = smollm2_tokenizer.vocab_size
    for extra, param in (({"logit_bias": {str(vocab): 1}}, "logit_bias"),
                         ({"logit_bias": {"x": 1}}, "logit_bias"),
                         ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
                         ({"allowed_token_ids": []}, "allowed_token_ids"),
                         ({"allowed_token_ids": [vocab + 1]}, "allowed_token_ids"),
                         ({"bad_words": [""]}, "bad_words")):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, extra_body=extra)
        assert info.value.body["param"] == param, (extra, info.value.body)


def test_chat_template_kwargs_reach_the_template(client, engine):
    """Qwen3's enable_thinking switch, as its template spells it."""
    template = ("{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>"
                "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>{% endif %}"
                "{% endif %}")
    for thinking in (True, False):
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=1,
                                       extra_body={"chat_template": template,
                                                   "chat_template_kwargs": {"enable_thinking": thinking}})
        assert ("<think>" in engine.added[-1].prompt_text) is not thinking
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=1,
                                       extra_body={"chat_template_kwargs": {"tokenize": True}})
    assert info.value.body["param"] == "chat_template_kwargs"


def test_continue_final_message_and_chat_echo(client, engine):
    with pytest.raises(openai.BadRequestError) as info:  # add_generation_prompt defaults to true: exclusive
        client.chat.completions.create(model=MODEL_NAME, messages=PARTIAL_ASSISTANT_TURN, max_completion_tokens=4,
                                       extra_body={"continue_final_message": True})
    assert info.value.body["param"] == "continue_final_message"
    body = {"continue_final_message": True, "add_generation_prompt": False}
    r = client.chat.completions.create(model=MODEL_NAME, messages=PARTIAL_ASSISTANT_TURN, max_completion_tokens=4, temperature=0,
                                       extra_body=body)
    prompt = engine.added[-1].prompt_text
    assert prompt.endswith("<|im_start|>assistant\nThe capital of France")  # left open: no <|im_end|>
    assert r.choices[0].message.role == "assistant"
    echoed = client.chat.completions.create(model=MODEL_NAME, messages=PARTIAL_ASSISTANT_TURN, max_completion_tokens=4,
                                            temperature=0, extra_body={**body, "echo": True})
    assert echoed.choices[0].message.content == "The capital of France" + r.choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=PARTIAL_ASSISTANT_TURN, max_completion_tokens=4,
                                                 temperature=0, stream=True, extra_body={**body, "echo": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == echoed.choices[0].message.content


def test_tool_messages_reach_the_template_intact(server, smollm2_tokenizer):
    import httpx

    from paged_jax.entrypoints.chat import render_chat

    body = {"messages": TOOL_TURN, "chat_template": SHOW_ALL_TEMPLATE}
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        tokens = c.post("/tokenize", json=body).json()["tokens"]
        bad = c.post("/tokenize", json={**body, "messages": [{**TOOL_TURN[1], "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]})
    text = smollm2_tokenizer.decode(tokens)
    assert "(call call_1 lookup city=Paris)" in text and "(result of call_1)" in text
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    # The model's own template sees them as well (SmolLM2's ignores tool_calls, but the tool turn is rendered).
    assert "Paris is the capital." in render_chat(smollm2_tokenizer, TOOL_TURN)


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, engine, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("One two three four five six")
    r = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=3, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 3})
    assert engine.added[-1].prompt == ids[-3:] and r.usage.prompt_tokens == 3
    tail = client.completions.create(model=MODEL_NAME, prompt=ids[-3:], max_tokens=3, temperature=0)
    assert r.choices[0].text == tail.choices[0].text
    client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=1,
                                   extra_body={"truncate_prompt_tokens": 4})
    assert len(engine.added[-1].prompt) == 4
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=3,
                                  extra_body={"truncate_prompt_tokens": 10**6})
    assert info.value.body["param"] == "truncate_prompt_tokens"


def test_priority_reaches_the_engine_with_priority_scheduling(client, engine, state):
    with pytest.raises(openai.BadRequestError, match="--scheduling-policy priority") as info:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, extra_body={"priority": -3})
    assert info.value.body["param"] == "priority"
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, extra_body={"priority": 0})
    assert engine.added[-1].priority == 0
    state.scheduling_policy = "priority"
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, extra_body={"priority": -3})
    assert engine.added[-1].priority == -3
    client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=1,
                                   extra_body={"priority": 4})
    assert engine.added[-1].priority == 4


def test_return_tokens_as_token_ids(client):
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1)
    as_ids = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1,
                                       extra_body={"return_tokens_as_token_ids": True})
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=4, temperature=0,
                                          logprobs=True, extra_body={"return_tokens_as_token_ids": True})
    ids = [int(token.split(":")[1]) for token in as_ids.choices[0].logprobs.tokens]
    assert len(ids) == 4 and all(token.startswith("token_id:") for token in as_ids.choices[0].logprobs.tokens)
    assert as_ids.choices[0].logprobs.token_logprobs == plain.choices[0].logprobs.token_logprobs
    assert as_ids.choices[0].text == plain.choices[0].text  # the text itself stays text
    assert all(entry.token.startswith("token_id:") for entry in chat.choices[0].logprobs.content)


def test_special_token_fields_reach_the_text(client):
    """skip_special_tokens=False keeps <|im_end|> in the text (generated past EOS with ignore_eos); min_tokens
    holds EOS back; stop_token_ids ends on the given id."""
    def reply(**extra):
        return client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=24,
                                              temperature=0, extra_body=extra).choices[0]

    short = reply()
    assert short.finish_reason == "stop"  # ends with EOS well before 24 tokens
    assert "<|im_end|>" in reply(ignore_eos=True, skip_special_tokens=False).message.content
    assert "<|im_end|>" not in reply(ignore_eos=True).message.content
    held = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=24, temperature=0,
                                          extra_body={"min_tokens": 20})
    assert held.usage.completion_tokens >= 20
    greedy = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
                                       extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    ids = [int(token.split(":")[1]) for token in greedy.choices[0].logprobs.tokens]
    k = next(k for k in range(1, len(ids)) if ids[k] not in ids[:k])  # a token not generated before it
    stopped = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0,
                                        extra_body={"stop_token_ids": [ids[k]], "ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].stop_reason == ids[k]
    assert stopped.usage.completion_tokens == k + 1


def test_stream_options(client):
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0,
                                            stream=True, stream_options={}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 4  # vLLM: stream_options {} already asks for usage
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_completion_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    counts = [c.usage.completion_tokens for c in chunks[:-1]]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 4 and chunks[-1].usage.total_tokens > 4
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, stream_options={})
    assert info.value.body["param"] == "stream_options"


def test_max_logprobs_limit(client, state):
    state.max_logprobs = 2
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, logprobs=2)
    for create, kwargs, param in ((client.completions.create, dict(prompt=PROMPT, logprobs=3), "logprobs"),
                                  (client.chat.completions.create,
                                   dict(messages=CHAT, logprobs=True, top_logprobs=3), "top_logprobs")):
        with pytest.raises(openai.BadRequestError, match="max allowed: 2") as info:
            create(model=MODEL_NAME, max_tokens=1, **kwargs)
        assert info.value.body["param"] == param


def test_response_role(client, state):
    state.response_role = "narrator"
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=2)
    assert r.choices[0].message.role == "narrator"
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=2,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "narrator"


def test_generation_config_defaults_fill_unset_fields(client, engine, state, serving_engine):
    from serving.app import create_app

    state.default_sampling_params = {"temperature": 0.0, "top_k": 5, "max_tokens": 3}
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, extra_body={"ignore_eos": True})
    params = engine.added[-1].params
    assert (params.temperature, params.top_k, params.max_tokens) == (0.0, 5, 3)  # max_tokens: the smaller (vLLM)
    assert r.usage.completion_tokens == 3
    client.chat.completions.create(model=MODEL_NAME, messages=CHAT, temperature=0.7, top_p=0.9,
                                   extra_body={"top_k": 2})
    params = engine.added[-1].params
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.7, 0.9, 2, 3)
    # create_app reads them from the engine's generation config (LLMEngine and EngineProcessClient attribute).
    wrapped = RecordingEngine(serving_engine)
    wrapped.generation_config = {"temperature": 0.25, "max_new_tokens": 7, "do_sample": True}
    app = create_app(wrapped, served_model_name="x")
    try:
        assert app.state.server.default_sampling_params == {"temperature": 0.25, "max_tokens": 7}
    finally:
        app.state.server.engine.shutdown()


def test_serve_flags_are_checked_before_loading(capsys, tmp_path):
    from paged_jax.entrypoints.chat import load_chat_template
    from serving.cli import build_parser, serve_main

    for argv, flag in ((["--max-logprobs", "50"], "--max-logprobs"),
                       (["--chat-template", "no/such/template.jinja"], "--chat-template")):
        with pytest.raises(SystemExit):
            serve_main(argv)
        assert flag in capsys.readouterr().err
    path = tmp_path / "template.jinja"
    path.write_text("{{ messages[0].content }}")
    assert load_chat_template(str(path)) == "{{ messages[0].content }}"
    assert load_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"  # inline
    args = build_parser().parse_args(["--response-role", "bot", "--max-logprobs", "5", "--chat-template", str(path)])
    assert (args.response_role, args.max_logprobs, args.chat_template) == ("bot", 5, str(path))


def test_echo_with_logprobs_returns_the_prompt_logprobs(client, engine):
    """vLLM: echo + logprobs asks the engine for prompt logprobs (as many alternatives) and lists the prompt tokens
    first in the choice's logprobs, the first one without a logprob; streamed, the first chunk carries them."""
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2,
                                  echo=True, extra_body={"ignore_eos": True})
    prompt = engine.added[-1].prompt
    assert engine.added[-1].params.prompt_logprobs == 2
    choice = r.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT) and len(lp.tokens) == len(prompt) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(value <= 0 for value in lp.token_logprobs[1:])
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])  # the 2 most likely, plus the token unless in them
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert "".join(lp.tokens[:len(prompt)]) == PROMPT
    entries = choice.prompt_logprobs  # the raw prompt logprobs come along (vLLM)
    assert [entries[i][str(t)]["logprob"] for i, t in enumerate(prompt) if i] == pytest.approx(
        lp.token_logprobs[1:len(prompt)], abs=1e-6)
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True})
    assert lp.token_logprobs[len(prompt):] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0,
                                            logprobs=2, echo=True, stream=True, extra_body={"ignore_eos": True}))
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in streamed) == choice.text
    assert sum((c.logprobs.tokens for c in streamed), []) == lp.tokens
    assert sum((c.logprobs.token_logprobs for c in streamed), []) == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert sum((c.logprobs.text_offset for c in streamed), []) == lp.text_offset


def test_prompt_logprobs_rules_and_chat_agrees_with_completions(client, engine):
    """vLLM's rules (not with stream; >= 0 or -1 = the whole vocabulary, at most --max-logprobs), and the chat
    prompt's logprobs equal those of the same token ids sent as a completion."""
    for extra, kwargs in (({"prompt_logprobs": 1}, {"stream": True}), ({"prompt_logprobs": -1}, {}),
                          ({"prompt_logprobs": -2}, {}), ({"prompt_logprobs": 21}, {})):
        for create, base in ((client.completions.create, dict(prompt=PROMPT, max_tokens=1)),
                             (client.chat.completions.create, dict(messages=CHAT, max_completion_tokens=1))):
            with pytest.raises(openai.BadRequestError) as info:
                create(model=MODEL_NAME, **base, **kwargs, extra_body=extra)
            assert info.value.body["param"] == "prompt_logprobs", (extra, kwargs)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=1,
                                          extra_body={"prompt_logprobs": 3})
    ids = engine.added[-1].prompt
    completion = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=1,
                                           extra_body={"prompt_logprobs": 3})
    assert chat.prompt_logprobs[0] is None and completion.choices[0].prompt_logprobs[0] is None
    for got, want in zip(chat.prompt_logprobs[1:], completion.choices[0].prompt_logprobs[1:]):
        assert sorted(got) == sorted(want)
        assert [got[k]["logprob"] for k in sorted(got)] == pytest.approx([want[k]["logprob"] for k in sorted(want)],
                                                                         abs=1e-5)
        assert [got[k]["rank"] for k in sorted(got)] == [want[k]["rank"] for k in sorted(want)]
