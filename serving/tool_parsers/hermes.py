"""Hermes-style tool calls (Qwen2, Qwen2.5, Qwen3, Hermes): ``<tool_call>\n{"name": ..., "arguments": {...}}\n
</tool_call>``, one block per call."""

from __future__ import annotations

import json
import re

from serving.tool_parsers.base import ParsedToolCall, ToolParser, arguments_json

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"
    start_markers = ("<tool_call>",)

    def parse_calls(self, region: str, final: bool) -> list[ParsedToolCall]:
        bodies = _BLOCK.findall(region)
        if final:  # a last block the reply left unclosed (it ran out of tokens, or the stop string cut it)
            tail = region[region.rfind("</tool_call>") + len("</tool_call>"):] if "</tool_call>" in region else region
            if "<tool_call>" in tail:
                bodies.append(tail.split("<tool_call>", 1)[1])
        calls = []
        for body in bodies:
            try:
                value = json.loads(body)
            except ValueError:
                break
            if not isinstance(value, dict) or not isinstance(value.get("name"), str):
                break
            calls.append(ParsedToolCall(value["name"], arguments_json(value.get("arguments", {}))))
        return calls
