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
    from serving.chat_output import ChoiceOutput
    from serving.reasoning_parsers import REASONING_PARSERS
    from serving.tool_parsers import TOOL_PARSERS
    from serving.tool_parsers.tool_choice import ToolChoice

    return ChoiceOutput(ToolChoice(tool_choice, max_calls=max_calls),
                        TOOL_PARSERS[tool_parser]() if tool_parser else None,
                        REASONING_PARSERS[reasoning_parser]() if reasoning_parser else None, "",
                        include_reasoning=include_reasoning, harmony_encoding=encoding)


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
    assert choice(encoding, include_reasoning=False).whole("", reply(encoding, *ANSWER))[1] is None


def test_cut_short_and_broken_replies(encoding):
    ids = reply(encoding, *ANSWER)
    cut = ids[:-4]  # max_tokens ended the final message (and a multi-byte character) early
    content, reasoning, _ = choice(encoding).whole("", cut)
    assert reasoning == "The user asks about é weather." and "It is sunny in" in content
    # Not harmony at all (the model ignored the format): the text is kept as content.
    plain = encoding.encode("Just text.")
    assert choice(encoding).whole("", plain) == ("Just text.", None, [])
    # The format breaks after a message: what follows is content, decoded from its ids.
    broken = reply(encoding, ANSWER[0]) + encoding.encode("<|message|>tail", allowed_special="all")
    content, reasoning, _ = choice(encoding).whole("", broken)
    assert reasoning == ANSWER[0][2] and content == "<|message|>tail"
