"""``tools`` / ``tool_choice`` / ``parallel_tool_calls`` of a chat request (vLLM's rules):

* ``tool_choice`` defaults to ``"auto"`` when ``tools`` are given, else ``"none"``; a ``tool_choice`` other than
  ``"none"`` needs ``tools``.
* ``"none"``: the tools still reach the chat template; the reply is plain content.
* ``"auto"``: needs ``--enable-auto-tool-choice`` and ``--tool-call-parser``; the parser reads calls from the reply.
  Without them, a request that gives ``tools`` and no ``tool_choice`` is read with the parser the chat template
  implies (``serving.tool_parsers.detect``), where it implies one.
* ``"required"``: the reply is constrained (a JSON schema) to a JSON list of ``{"name", "parameters"}`` objects, one
  per call, at least one (exactly one with ``parallel_tool_calls: false``).
* ``{"type": "function", "function": {"name": X}}``: the reply is constrained to X's ``parameters`` schema and is
  the call's arguments.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from serving.errors import APIError
from serving.tool_parsers.base import ParsedToolCall, ToolParser, arguments_json, decode_json_values

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass
class ToolChoice:
    """A request's resolved tool choice: ``mode`` (none / auto / required / named), the named function, the JSON
    schema the reply is constrained to (required / named), the most calls kept (``parallel_tool_calls: false``), the
    name of the parser that reads an ``auto`` reply's calls."""

    mode: str = "none"
    function_name: str | None = None
    schema: dict | None = None
    max_calls: int | None = None
    parser_name: str | None = None


def _function_of(tool: Any, index: int) -> dict:
    if (not isinstance(tool, dict) or tool.get("type", "function") != "function"
            or not isinstance(tool.get("function"), dict) or not isinstance(tool["function"].get("name"), str)):
        raise APIError(400, f"tools: tools[{index}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                            f"\"parameters\": {{...}}}}}}", param="tools")
    parameters = tool["function"].get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise APIError(400, f"tools: tools[{index}].function.parameters must be a JSON schema object",
                       param="tools")
    return tool["function"]


def resolve_tool_choice(tools: list | None, tool_choice: Any, parallel_tool_calls: bool | None, *,
                        enable_auto_tool_choice: bool, tool_parser: str | None,
                        implied_tool_parser: str | None = None) -> ToolChoice:
    """The request's ``ToolChoice``; APIError 400 naming ``tools`` / ``tool_choice`` when they do not fit.
    ``implied_tool_parser``: the parser the chat template implies, used when ``tool_choice`` is not given and the
    server has no ``--enable-auto-tool-choice`` / ``--tool-call-parser``."""
    functions = [_function_of(tool, i) for i, tool in enumerate(tools or [])]
    if tool_choice is None and not (enable_auto_tool_choice and tool_parser):
        enable_auto_tool_choice, tool_parser = implied_tool_parser is not None, implied_tool_parser
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    max_calls = 1 if parallel_tool_calls is False else None
    if tool_choice == "none":
        return ToolChoice("none")
    if not functions:
        raise APIError(400, "tool_choice: when using `tool_choice`, `tools` must be set.", param="tool_choice")
    if tool_choice == "auto":
        if not (enable_auto_tool_choice and tool_parser):
            raise APIError(400, 'tool_choice: "auto" tool choice requires --enable-auto-tool-choice and '
                                '--tool-call-parser to be set', param="tool_choice")
        return ToolChoice("auto", max_calls=max_calls, parser_name=tool_parser)
    if tool_choice == "required":
        items = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                 "parameters": f.get("parameters") or _EMPTY_PARAMETERS},
                  "required": ["name", "parameters"]} for f in functions]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if max_calls is not None:
            schema["maxItems"] = max_calls
        return ToolChoice("required", schema=schema, max_calls=max_calls)
    if (isinstance(tool_choice, dict) and tool_choice.get("type", "function") == "function"
            and isinstance(tool_choice.get("function"), dict)):
        name = tool_choice["function"].get("name")
        for function in functions:
            if function["name"] == name:
                return ToolChoice("named", function_name=name,
                                  schema=function.get("parameters") or _EMPTY_PARAMETERS, max_calls=1)
        raise APIError(400, f"tool_choice: the function {name!r} is not among the tools", param="tool_choice")
    raise APIError(400, f"tool_choice: must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                        f"\"function\": {{\"name\": ...}}}}, got {tool_choice!r}", param="tool_choice")


class RequiredToolCallParser(ToolParser):
    """Reads the JSON list a ``"required"`` reply is constrained to: each complete element is one call."""

    name = "required"

    def find_start(self, text: str) -> int:
        return 0

    def held_back(self, text: str) -> int:
        return 0

    def parse_calls(self, region: str, final: bool) -> list[ParsedToolCall]:
        region = region.lstrip()
        if not region.startswith("["):
            return []
        values, _ = decode_json_values(region[1:], " \t\r\n,")
        return [ParsedToolCall(value["name"], arguments_json(value.get("parameters", {})))
                for value in values if isinstance(value, dict) and isinstance(value.get("name"), str)]
