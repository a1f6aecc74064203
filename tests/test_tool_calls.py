"""Tool calling and reasoning output through the official ``openai`` client (SmolLM2 on CPU, the shared
``serving_engine``; the server runs with ``--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser
qwen3``), plus the parsers of the other formats on their own."""

from __future__ import annotations

import json

import openai
import pytest

from tests.test_serving import ServerThread

MODEL_NAME = "smollm2-tools"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# A Hermes-format reply, forced with a regex so the auto parser's path runs with a model that does not write it.
HERMES_REPLY = (r'Let me check\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n'
                r'</tool_call>')


@pytest.fixture(scope="module")
def server(serving_engine):
    from serving.app import create_app

    app = create_app(serving_engine, served_model_name=MODEL_NAME, enable_auto_tool_choice=True,
                     tool_parser="hermes", reasoning_parser="qwen3")
    with ServerThread(app) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=300)


def accumulate_stream(stream):
    """(content, reasoning, [(id, name, arguments)], finish_reason) from streamed chunks, as OpenAI clients do."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for piece in delta.tool_calls or ():
                call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = piece.id or call["id"]
                call["name"] += (piece.function.name or "") if piece.function else ""
                call["arguments"] += (piece.function.arguments or "") if piece.function else ""
            finish = choice.finish_reason or finish
    return content, reasoning, [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_tool_call_round_trip(client, stream):
    kwargs = dict(model=MODEL_NAME, temperature=0, max_completion_tokens=60, tools=[WEATHER, TIME])
    first = client.chat.completions.create(messages=ASK, tool_choice="required", stream=stream, **kwargs)
    if stream:
        _, _, calls, finish = accumulate_stream(first)
    else:
        message = first.choices[0].message
        calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls]
        finish = first.choices[0].finish_reason
    assert finish == "tool_calls" and calls
    call_id, name, arguments = calls[0]
    assert call_id and name in ("get_weather", "get_time")
    args = json.loads(arguments)
    assert args in ({"city": "Paris"}, {"city": "Rome"}) if name == "get_weather" else args["zone"] in ("UTC", "CET")
    # The call and its result go back through the chat template; the model answers in text.
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "Sunny, 21 degrees."}]
    answer = client.chat.completions.create(messages=history, tool_choice="none", stream=stream, **kwargs)
    if stream:
        content, _, calls, finish = accumulate_stream(answer)
    else:
        content, calls, finish = (answer.choices[0].message.content, answer.choices[0].message.tool_calls,
                                  answer.choices[0].finish_reason)
    assert content and not calls and finish in ("stop", "length")


def test_named_tool_choice_and_parallel_tool_calls(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    whole = client.chat.completions.create(model=MODEL_NAME, messages=ASK, temperature=0, max_completion_tokens=30,
                                           tools=[WEATHER, TIME], tool_choice=named)
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    assert whole.choices[0].finish_reason == "stop"  # vLLM: a named choice keeps the engine's finish reason
    streamed = accumulate_stream(client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, temperature=0, max_completion_tokens=30, tools=[WEATHER, TIME],
        tool_choice=named, stream=True))
    assert [(n, a) for _, n, a in streamed[2]] == [(call.function.name, call.function.arguments)]
    single = client.chat.completions.create(model=MODEL_NAME, messages=ASK, temperature=0, max_completion_tokens=60,
                                            tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert len(single.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_tool_choice_parses_hermes_calls(client, stream):
    response = client.chat.completions.create(model=MODEL_NAME, messages=ASK, temperature=0,
                                              max_completion_tokens=150, tools=[WEATHER], stream=stream,
                                              extra_body={"structured_outputs": {"regex": HERMES_REPLY}})
    if stream:
        content, _, calls, finish = accumulate_stream(response)
    else:
        message = response.choices[0].message
        content, finish = message.content, response.choices[0].finish_reason
        calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls]
    assert content.strip() == "Let me check." and finish == "tool_calls"
    assert [(name, json.loads(args)["city"] in ("Paris", "Rome")) for _, name, args in calls] == [
        ("get_weather", True)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_goes_to_reasoning_content(client, stream):
    kwargs = dict(model=MODEL_NAME, messages=ASK, temperature=0, max_completion_tokens=100, stream=stream,
                  extra_body={"structured_outputs": {"regex": r"<think>\nThe user asks\.\n</think>\n\n"
                                                              r"It is (sunny|rainy)\."}})
    if stream:
        content, reasoning, _, _ = accumulate_stream(client.chat.completions.create(**kwargs))
    else:
        message = client.chat.completions.create(**kwargs).choices[0].message
        content, reasoning = message.content, message.reasoning_content
    assert reasoning.startswith("\nThe user asks") and "<think>" not in reasoning and "</think>" not in reasoning
    assert content.strip() in ("It is sunny.", "It is rainy.")
    hidden = client.chat.completions.create(**{**kwargs, "stream": False,
                                               "extra_body": {**kwargs["extra_body"], "include_reasoning": False}})
    assert hidden.choices[0].message.reasoning_content is None


def test_tool_request_errors_name_the_field(client):
    def bad(**extra):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_completion_tokens=4, **extra)
        return info.value.body["param"]

    assert bad(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}) == "tool_choice"
    assert bad(tool_choice="required") == "tool_choice"  # no tools
    assert bad(tools=[{"type": "function", "function": {"description": "no name"}}]) == "tools"
    assert bad(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}) == "tool_choice"


def test_auto_tool_choice_needs_the_server_flags(serving_engine):
    from fastapi.testclient import TestClient

    from serving.app import create_app

    app = create_app(serving_engine, served_model_name=MODEL_NAME)
    try:
        with TestClient(app) as http:
            r = http.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
            assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
    finally:
        app.state.server.engine.shutdown()


@pytest.mark.parametrize("parser,text,expected_content,expected", [
    ("hermes", 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n'
               '{"name": "g", "arguments": {}}\n</tool_call>', "Sure. ", [("f", {"a": 1}), ("g", {})]),
    ("llama3_json", '{"name": "f", "parameters": {"x": 2}}; {"name": "g", "parameters": {}}', None,
     [("f", {"x": 2}), ("g", {})]),
    ("llama3_json", "<|python_tag|>{\"name\": \"f\", \"parameters\": {}}", None, [("f", {})]),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"q": "s"}}]', None, [("f", {"q": "s"})]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"q": 1}', None, [("f", {"q": 1})]),
    ("hermes", "No call here, only <tool", "No call here, only <tool", []),
])
def test_parsers_whole_and_streamed_agree(parser, text, expected_content, expected):
    from serving.chat_output import ChoiceOutput
    from serving.tool_parsers import TOOL_PARSERS
    from serving.tool_parsers.tool_choice import ToolChoice

    content, _, calls = ChoiceOutput(ToolChoice("auto"), TOOL_PARSERS[parser](), None, "").whole(text)
    assert content == expected_content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == expected
    if parser == "mistral":
        assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    streamed = ChoiceOutput(ToolChoice("auto"), TOOL_PARSERS[parser](), None, "")
    pieces = [streamed.feed(text[i:i + 3], final=i + 3 >= len(text)) for i in range(0, len(text), 3)]
    streamed_calls = [(p.function.name, json.loads(p.function.arguments))
                      for d in pieces if d is not None for p in d.tool_calls or ()]
    assert streamed_calls == expected
    assert "".join(d.content or "" for d in pieces if d is not None) == (expected_content or "")


# Chat templates of each family, cut to what matters: ChatML turns (so SmolLM2 runs them) plus the family's tool-call
# instructions, whose markers imply the parser.
_CHATML_TURNS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "<|im_start|>assistant\n")
FAMILY_TEMPLATES = {
    "hermes": "{% if tools %}For each call return <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call>"
              "{% endif %}" + _CHATML_TURNS,
    "llama3_json": "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{%- if tools %}{{- 'Environment: "
                   "ipython\\n' }}{%- endif %}" + _CHATML_TURNS,
    "mistral": "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}" + _CHATML_TURNS
               + "{#- a reply's calls start with [TOOL_CALLS] #}",
}
FAMILY_REPLIES = {  # regexes forcing a reply in each family's format
    "hermes": r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>',
    "llama3_json": r'\{"name": "get_weather", "parameters": \{"city": "Paris"\}\}',
    "mistral": r'\[TOOL_CALLS\] \[\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\]',
}


def test_each_family_template_implies_its_parser():
    from serving.tool_parsers.detect import implied_tool_parser

    for name, template in FAMILY_TEMPLATES.items():
        assert implied_tool_parser(template) == name
        assert implied_tool_parser({"default": _CHATML_TURNS, "tool_use": template}) == name
    assert implied_tool_parser(_CHATML_TURNS) is None and implied_tool_parser(None) is None


@pytest.mark.parametrize("family", sorted(FAMILY_TEMPLATES))
def test_tools_without_tool_choice_use_the_parser_the_template_implies(serving_engine, family, caplog):
    """No --enable-auto-tool-choice / --tool-call-parser: a request with tools and no tool_choice is read with the
    template's parser (logged once); an explicit tool_choice "auto" is still refused, as vLLM refuses it."""
    import logging

    from fastapi.testclient import TestClient

    from serving.app import create_app

    app = create_app(serving_engine, served_model_name=MODEL_NAME, chat_template=FAMILY_TEMPLATES[family])
    body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 60, "temperature": 0,
            "structured_outputs": {"regex": FAMILY_REPLIES[family]}}
    try:
        with TestClient(app) as http, caplog.at_level(logging.INFO, logger="serving.openai_server"):
            for _ in range(2):
                r = http.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                assert choice["finish_reason"] == "tool_calls"
                assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                        for c in choice["message"]["tool_calls"]] == [("get_weather", {"city": "Paris"})]
            refused = http.post("/v1/chat/completions", json={**body, "tool_choice": "auto"})
            assert refused.status_code == 400 and "--enable-auto-tool-choice" in refused.json()["error"]["message"]
    finally:
        app.state.server.engine.shutdown()
    chosen = [r.getMessage() for r in caplog.records if "chat template implies" in r.getMessage()]
    assert len(chosen) == 1 and f"the {family} parser" in chosen[0]
