"""gpt-oss's tool calls (``--tool-call-parser openai``, vLLM's name): harmony messages addressed ``to=functions.NAME``
on the ``commentary`` channel, ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``.
Their header tokens are special tokens, so the calls are read from the reply's token ids by
``serving.harmony.HarmonyReader`` rather than from its text; this class names the format in the registry."""

from __future__ import annotations

from serving.tool_parsers.base import ToolParser


class OpenAIToolParser(ToolParser):
    name = "openai"
    harmony = True
