"""Llama 3.x JSON tool calls: the reply is ``{"name": ..., "parameters": {...}}`` (optionally after
``<|python_tag|>``; several calls separated by ``;``), as Llama 3.1/3.2/3.3's chat templates ask for."""

from __future__ import annotations

from serving.tool_parsers.base import ParsedToolCall, ToolParser, arguments_json, decode_json_values

_PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_markers = (_PYTHON_TAG,)

    def find_start(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped.startswith("{"):  # a reply that opens with a JSON object is a call
            return len(text) - len(stripped)
        return super().find_start(text)

    def held_back(self, text: str) -> int:
        if not text.strip():
            return len(text)  # only whitespace so far: a call may still begin
        return super().held_back(text)

    def parse_calls(self, region: str, final: bool) -> list[ParsedToolCall]:
        values, _ = decode_json_values(region.replace(_PYTHON_TAG, ""))
        calls = []
        for value in values:
            if not isinstance(value, dict) or not isinstance(value.get("name"), str):
                break
            calls.append(ParsedToolCall(value["name"],
                                        arguments_json(value.get("parameters", value.get("arguments", {})))))
        return calls
