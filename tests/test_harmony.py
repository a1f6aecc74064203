"""gpt-oss's harmony format in the server (``--reasoning-parser openai_gptoss``, ``--tool-call-parser openai``): the
reader on token ids built with the harmony encoding (what a gpt-oss checkpoint samples), whole and streamed, then
the chat and Responses routes over scripted engine outputs, and the start-up and request refusals.

The encoding needs the real ``o200k_base`` vocabulary: the library checks its SHA-256 even when it is read from
``TIKTOKEN_ENCODINGS_BASE`` (a stand-in vocabulary is refused, as ``test_stand_in_vocabulary_is_refused`` shows), so
the file ships compressed in ``tests/data`` and is unpacked into a temporary directory.
"""

from __future__ import annotations

import asyncio
import base64
import json
import lzma
import os
import pathlib

import pytest

openai_harmony = pytest.importorskip("openai_harmony")  # the gpt-oss extra (in the test extra)

from openai_harmony import Message, Role  # noqa: E402

VOCAB_XZ = pathlib.Path(__file__).parent / "data" / "o200k_base.tiktoken.xz"
MODEL_NAME = "gpt-oss-harmony"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiktoken")
    (directory / "o200k_base.tiktoken").write_bytes(lzma.decompress(VOCAB_XZ.read_bytes()))
    return directory


@pytest.fixture(scope="module")
def encoding(vocab_dir):
    from serving.harmony import harmony_encoding

    previous = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(vocab_dir)
    try:
        yield harmony_encoding()
    finally:
        if previous is None:
            del os.environ["TIKTOKEN_ENCODINGS_BASE"]
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = previous


def reply(encoding, *messages: tuple[str, str | None, str]) -> list[int]:
    """The ids a gpt-oss reply samples after its prompt's ``<|start|>assistant``: (channel, recipient, text) per
    message, each rendered by the library; the last ends ``<|return|>`` (``<|call|>`` for a call)."""
    ids: list[int] = []
    for channel, recipient, text in messages:
        message = Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)
        if recipient is not None:
            message = message.with_recipient(recipient).with_content_type("<|constrain|>json")
        ids += encoding.render(message)
    start = encoding.encode("<|start|>assistant", allowed_special="all")
    assert ids[:len(start)] == start
    ids = ids[len(start):]
    end = encoding.encode("<|end|>", allowed_special="all")
    if ids[-1:] == end:  # the reply's last message ends with the stop token instead
        ids[-1:] = encoding.encode("<|call|>" if messages[-1][1] else "<|return|>", allowed_special="all")
    return ids


ANSWER = [("analysis", None, "The user asks about é weather."), ("final", None, "It is sunny in Paris. ☀")]
CALL = [("analysis", None, "Need the weather tool."), ("commentary", None, "Let me check."),
        ("commentary", "functions.get_weather", '{"city": "Paris"}')]


def test_special_tokens_keep_their_published_ids(encoding):
    ids = {token: encoding.encode(token, allowed_special="all") for token in
           ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")}
    assert ids == {"<|start|>": [200006], "<|channel|>": [200005], "<|message|>": [200008], "<|end|>": [200007],
                   "<|return|>": [200002], "<|call|>": [200012], "<|constrain|>": [200003]}
    assert sorted(encoding.stop_tokens_for_assistant_actions()) == [200002, 200012]


def test_stand_in_vocabulary_is_refused(tmp_path, monkeypatch):
    lines = "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256))
    (tmp_path / "o200k_base.tiktoken").write_text(lines)
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path))
    with pytest.raises(openai_harmony.HarmonyError, match="hash mismatch"):
        openai_harmony.load_harmony_encoding(openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS)


def choice(encoding, tool_choice="auto", tool_parser="openai", reasoning_parser="openai_gptoss", max_calls=None,
           include_reasoning=True):
    """A chat choice's reader with gpt-oss's parsers (``encoding``: the fixture's, which the reader's is)."""
    from serving.chat_output import ChoiceOutput
    from serving.harmony import harmony_encoding
    from serving.reasoning_parsers import REASONING_PARSERS
    from serving.tool_parsers import TOOL_PARSERS
    from serving.tool_parsers.tool_choice import ToolChoice

    assert harmony_encoding() is encoding
    parsers = (TOOL_PARSERS[tool_parser]() if tool_parser else None,
               REASONING_PARSERS[reasoning_parser]() if reasoning_parser else None)
    # As the server decides (OpenAIServer.reads_harmony_for): a harmony parser chosen by flag reads every reply.
    harmony = any(parser is not None and parser.harmony for parser in parsers)
    return ChoiceOutput(ToolChoice(tool_choice, max_calls=max_calls), parsers[0] if tool_choice == "auto" else None,
                        parsers[1], "", include_reasoning=include_reasoning, harmony=harmony)


def streamed(output, ids, step=1):
    """(content, reasoning, [(id, name, arguments)]) of ``ids`` fed ``step`` at a time, accumulated as clients do."""
    content, reasoning, calls = "", "", {}
    for start in range(0, len(ids), step):
        delta = output.feed("", final=start + step >= len(ids), token_ids=ids[start:start + step])
        if delta is None:
            continue
        content += delta.content or ""
        reasoning += delta.reasoning_content or ""
        for piece in delta.tool_calls or ():
            call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
            assert (piece.id is None) == (call["id"] is not None)  # the id and name come once, first
            call["id"] = piece.id or call["id"]
            call["name"] += piece.function.name or ""
            call["arguments"] += piece.function.arguments or ""
    return content, reasoning, [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_analysis_is_reasoning_and_final_is_content(encoding, step):
    ids = reply(encoding, *ANSWER)
    whole = choice(encoding)
    assert whole.whole("ignored text", ids) == ("It is sunny in Paris. ☀", "The user asks about é weather.", [])
    assert whole.finish_reason("stop") == "stop"
    assert streamed(choice(encoding), ids, step) == ("It is sunny in Paris. ☀", "The user asks about é weather.", [])


@pytest.mark.parametrize("step", [1, 1000])
def test_commentary_to_functions_is_a_tool_call(encoding, step):
    ids = reply(encoding, *CALL)
    output = choice(encoding)
    content, reasoning, calls = output.whole("", ids)
    assert (content, reasoning) == ("Let me check.", "Need the weather tool.")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0].id.startswith("chatcmpl-tool-") and output.finish_reason("stop") == "tool_calls"
    content, reasoning, streamed_calls = streamed(choice(encoding), ids, step)
    assert (content, reasoning) == ("Let me check.", "Need the weather tool.")
    assert [(name, args) for _, name, args in streamed_calls] == [("get_weather", '{"city": "Paris"}')]


def test_several_calls_and_parallel_tool_calls_false(encoding):
    ids = reply(encoding, ("commentary", "functions.get_weather", '{"city": "Paris"}'),
                ("commentary", "functions.get_time", "{}"))
    _, _, calls = choice(encoding).whole("", ids)
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}'),
                                                                       ("get_time", "{}")]
    _, _, calls = streamed(choice(encoding, max_calls=1), ids)
    assert [(name, args) for _, name, args in calls] == [("get_weather", '{"city": "Paris"}')]


def test_each_parser_alone(encoding):
    ids = reply(encoding, *CALL)
    # The reasoning parser alone: calls are not read (and not content); tool choice "none" likewise.
    assert choice(encoding, tool_parser=None).whole("", ids) == ("Let me check.", "Need the weather tool.", [])
    assert choice(encoding, tool_choice="none").whole("", ids) == ("Let me check.", "Need the weather tool.", [])
    # The tool parser alone: the analysis channel is not returned without a reasoning parser.
    content, reasoning, calls = choice(encoding, reasoning_parser=None).whole("", ids)
    assert (content, reasoning, [c.function.name for c in calls]) == ("Let me check.", None, ["get_weather"])
    # The tool parser alone and a request without tools (tool choice "none"): still read as harmony, no calls.
    assert choice(encoding, reasoning_parser=None, tool_choice="none").whole("", ids) == ("Let me check.", None, [])
    assert choice(encoding, include_reasoning=False).whole("", reply(encoding, *ANSWER))[1] is None


def test_cut_short_and_broken_replies(encoding):
    ids = reply(encoding, *ANSWER)
    cut = ids[:-4]  # max_tokens ended the final message (and a multi-byte character) early
    content, reasoning, _ = choice(encoding).whole("", cut)
    assert reasoning == "The user asks about é weather." and "It is sunny in" in content
    # Cut short inside the first header (a tiny max_tokens): no header text leaks into the content.
    assert choice(encoding).whole("", ids[:2]) == ("", None, [])
    # Not harmony at all (the model ignored the format): the text is kept as content.
    plain = encoding.encode("Just text.")
    assert choice(encoding).whole("", plain) == ("Just text.", None, [])
    # A header token inside a message's text is text to the library, so to the reader.
    inside = encoding.encode("<|channel|>final<|message|>a<|message|>b<|return|>", allowed_special="all")
    assert choice(encoding).whole("", inside) == ("a<|message|>b", None, [])
    # The format breaks after a message: what follows is content, decoded from its ids.
    broken = reply(encoding, ANSWER[0]) + encoding.encode("<|message|>tail", allowed_special="all")
    content, reasoning, _ = choice(encoding).whole("", broken)
    assert reasoning == ANSWER[0][2] and content == "<|message|>tail"


# ------------------------------------------------------------------------------------------ the server's routes
@pytest.fixture(scope="module")
def harmony_app(serving_engine, encoding):
    from serving.app import create_app

    app = create_app(serving_engine, served_model_name=MODEL_NAME, enable_auto_tool_choice=True,
                     tool_parser="openai", reasoning_parser="openai_gptoss")
    try:
        yield app
    finally:
        app.state.server.engine.shutdown()


def script_engine(monkeypatch, app, ids):
    """The app's engine answers every request with ``ids``, one token per output (as a gpt-oss checkpoint's steps
    would); the SmolLM2 engine behind it runs nothing."""
    from paged_jax.outputs import CompletionOutput, RequestOutput
    from serving.async_engine import RequestStream

    class ScriptedStream(RequestStream):
        def __init__(self, request_id, loop):
            super().__init__(request_id, loop)
            self._script = [RequestOutput(request_id, None, [], [CompletionOutput(
                0, "", [token_id], None, None, "stop" if i == len(ids) - 1 else None)], finished=i == len(ids) - 1)
                for i, token_id in enumerate(ids)]

        async def next_output(self):
            if self.finished:
                raise StopAsyncIteration
            output = self._script.pop(0)
            self.finished = output.finished
            return output

    async def add_requests(requests):
        app.state.scripted_prompts = [request.prompt for request in requests]
        return [ScriptedStream(request.request_id, asyncio.get_running_loop()) for request in requests]

    monkeypatch.setattr(app.state.server.engine, "add_requests", add_requests)


def sse_chunks(response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_completions_read_harmony(harmony_app, encoding, monkeypatch, stream):
    from fastapi.testclient import TestClient

    script_engine(monkeypatch, harmony_app, reply(encoding, *CALL))
    body = {"model": MODEL_NAME, "messages": ASK, "tools": [WEATHER], "max_tokens": 100, "stream": stream}
    with TestClient(harmony_app) as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    if not stream:
        choice = response.json()["choices"][0]
        message = choice["message"]
        assert (message["content"], message["reasoning_content"]) == ("Let me check.", "Need the weather tool.")
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
            ("get_weather", '{"city": "Paris"}')]
        assert choice["finish_reason"] == "tool_calls"
        return
    deltas = [c["choices"][0] for c in sse_chunks(response)]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Let me check."
    assert "".join(d["delta"].get("reasoning_content") or "" for d in deltas) == "Need the weather tool."
    pieces = [p for d in deltas for p in d["delta"].get("tool_calls") or ()]
    assert len(pieces) > 1  # the arguments stream as they are sampled
    assert pieces[0]["id"] and pieces[0]["function"]["name"] == "get_weather"
    assert "".join(p["function"]["arguments"] or "" for p in pieces) == '{"city": "Paris"}'
    assert deltas[-1]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_api_maps_the_channels_to_items(harmony_app, encoding, monkeypatch, stream):
    from fastapi.testclient import TestClient

    script_engine(monkeypatch, harmony_app, reply(encoding, *CALL))
    body = {"model": MODEL_NAME, "input": "What is the weather in Paris?", "max_output_tokens": 100,
            "stream": stream,
            "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]}
    with TestClient(harmony_app) as http:
        response = http.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    if stream:
        events = sse_chunks(response)
        kinds = {event["type"] for event in events}
        assert {"response.reasoning_text.delta", "response.output_text.delta",
                "response.function_call_arguments.delta"} <= kinds
        (completed,) = [event for event in events if event["type"] == "response.completed"]
        items = completed["response"]["output"]
    else:
        items = response.json()["output"]
    assert [item["type"] for item in items] == ["reasoning", "message", "function_call"]
    assert items[0]["content"][0]["text"] == "Need the weather tool."
    assert items[1]["content"][0]["text"] == "Let me check."
    assert (items[2]["name"], items[2]["arguments"]) == ("get_weather", '{"city": "Paris"}')


def test_constraints_are_refused_naming_the_field(harmony_app):
    from fastapi.testclient import TestClient

    cases = [({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
             ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
              "tool_choice"),
             ({"response_format": {"type": "json_object"}}, "response_format"),
             ({"structured_outputs": {"regex": "a+"}}, "structured_outputs")]
    with TestClient(harmony_app) as http:
        for extra, field in cases:
            r = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": ASK, "max_tokens": 4,
                                                        **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
            assert "harmony" in r.json()["error"]["message"]


def test_start_up_refusals(monkeypatch, capsys):
    from serving import harmony
    from serving.cli import parse_serve_args
    from serving.reasoning_parsers import REASONING_PARSERS
    from serving.tool_parsers import TOOL_PARSERS

    with pytest.raises(ValueError, match="--reasoning-parser openai_gptoss .*--tool-call-parser hermes"):
        harmony.check_parsers(REASONING_PARSERS["openai_gptoss"], TOOL_PARSERS["hermes"])
    with pytest.raises(SystemExit):
        parse_serve_args(["--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser",
                          "openai"])
    assert "--tool-call-parser openai reads gpt-oss's harmony format" in capsys.readouterr().err
    monkeypatch.setattr(harmony, "openai_harmony", None)  # the gpt-oss extra not installed
    with pytest.raises(ValueError, match=r"--tool-call-parser openai .*paged-jax\[gpt-oss\]"):
        harmony.check_parsers(None, TOOL_PARSERS["openai"])
    with pytest.raises(SystemExit):
        parse_serve_args(["--reasoning-parser", "openai_gptoss"])
    assert "pip install 'paged-jax[gpt-oss]'" in capsys.readouterr().err
    harmony.check_parsers(REASONING_PARSERS["qwen3"], TOOL_PARSERS["hermes"])  # text parsers need nothing


HARMONY_TEMPLATE = ("<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
                    "{%- for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endfor %}"
                    "{#- a call: <|start|>assistant to=functions.NAME<|channel|>commentary json"
                    "<|message|>...<|call|> #}"
                    "<|start|>assistant")


def test_a_harmony_template_implies_the_openai_parser(monkeypatch):
    from serving import harmony
    from serving.tool_parsers.detect import implied_tool_parser

    assert implied_tool_parser(HARMONY_TEMPLATE) == "openai"
    monkeypatch.setattr(harmony, "openai_harmony", None)
    assert implied_tool_parser(HARMONY_TEMPLATE) is None


def test_tools_without_flags_are_read_as_harmony_under_a_harmony_template(serving_engine, encoding, monkeypatch):
    from fastapi.testclient import TestClient

    from serving.app import create_app

    app = create_app(serving_engine, served_model_name=MODEL_NAME, chat_template=HARMONY_TEMPLATE)
    script_engine(monkeypatch, app, reply(encoding, *CALL))
    body = {"model": MODEL_NAME, "messages": ASK, "tools": [WEATHER], "max_tokens": 100}
    try:
        with TestClient(app) as http:
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            message = r.json()["choices"][0]["message"]
            # No reasoning parser: the analysis channel is not returned.
            assert (message["content"], message["reasoning_content"]) == ("Let me check.", None)
            assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
            refused = http.post("/v1/chat/completions", json={**body, "response_format": {"type": "json_object"}})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format"
            plain = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": ASK, "max_tokens": 4,
                                                            "response_format": {"type": "json_object"}})
            assert plain.status_code == 200  # no tools: the reply is not read as harmony, the constraint stands
    finally:
        app.state.server.engine.shutdown()


def test_an_implied_harmony_parser_that_cannot_load_leaves_the_server_starting(serving_engine, monkeypatch, caplog):
    from serving import harmony
    from serving.app import create_app

    def offline():
        raise ValueError("the harmony encoding (o200k_base vocabulary) could not be loaded")

    monkeypatch.setattr(harmony, "harmony_encoding", offline)
    with pytest.raises(ValueError, match="could not be loaded"):  # chosen by flag: the start fails
        create_app(serving_engine, served_model_name=MODEL_NAME, tool_parser="openai", enable_auto_tool_choice=True)
    app = create_app(serving_engine, served_model_name=MODEL_NAME, chat_template=HARMONY_TEMPLATE)
    try:
        assert app.state.server.implied_tool_parser is None
        assert "implies the openai tool-call parser, which cannot be used here" in caplog.text
    finally:
        app.state.server.engine.shutdown()


def test_reasoning_effort_reaches_a_template_that_takes_it(serving_engine, harmony_app, encoding, monkeypatch):
    from fastapi.testclient import TestClient

    from serving.app import create_app

    body = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 100}
    with TestClient(harmony_app) as http:  # SmolLM2's template has no reasoning_effort: refused, not dropped
        r = http.post("/v1/chat/completions", json={**body, "reasoning_effort": "low"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    app = create_app(serving_engine, served_model_name=MODEL_NAME, reasoning_parser="openai_gptoss",
                     chat_template=HARMONY_TEMPLATE)
    script_engine(monkeypatch, app, reply(encoding, *ANSWER))
    try:
        with TestClient(app) as http:
            prompts = {}
            for effort in ("low", None):
                r = http.post("/v1/chat/completions", json={**body, "reasoning_effort": effort})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["reasoning_content"] == ANSWER[0][2]
                (prompt,) = app.state.scripted_prompts
                prompts[effort] = app.state.server.tokenizer.decode(prompt)
            assert "Reasoning: low" in prompts["low"] and "Reasoning: medium" in prompts[None]
            r = http.post("/v1/chat/completions", json={**body, "reasoning_effort": "extreme"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    finally:
        app.state.server.engine.shutdown()
