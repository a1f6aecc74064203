"""Mistral tool calls: ``[TOOL_CALLS]`` then a JSON list ``[{"name": ..., "arguments": {...}}, ...]`` (v3
tokenizers) or ``name[ARGS]{...}`` per call (v11+). ``[TOOL_CALLS]`` is a special token, so the reply is
detokenized with special tokens kept; tool call ids are 9 alphanumeric characters, as Mistral's templates require."""

from __future__ import annotations

import json

from serving.tool_parsers.base import MistralIds, ParsedToolCall, ToolParser, arguments_json, decode_json_values

_TOOL_CALLS = "[TOOL_CALLS]"
_ARGS = "[ARGS]"


class MistralToolParser(MistralIds, ToolParser):
    name = "mistral"
    start_markers = (_TOOL_CALLS,)
    skip_special_tokens = False

    def parse_calls(self, region: str, final: bool) -> list[ParsedToolCall]:
        calls = []
        for part in region.split(_TOOL_CALLS)[1:]:
            part = part.strip()
            if _ARGS in part:  # name[ARGS]{...}
                name, _, rest = part.partition(_ARGS)
                try:
                    arguments, _ = json.JSONDecoder().raw_decode(rest.strip())
                except ValueError:
                    break
                calls.append(ParsedToolCall(name.strip(), arguments_json(arguments)))
                continue
            values, _ = decode_json_values(part)
            for value in values:
                for item in value if isinstance(value, list) else [value]:
                    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                        return calls
                    calls.append(ParsedToolCall(item["name"], arguments_json(item.get("arguments", {}))))
        return calls
