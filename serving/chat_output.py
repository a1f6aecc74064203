"""The assistant message of one chat choice, from its text: reasoning (``--reasoning-parser``), tool calls (the
request's tool choice and ``--tool-call-parser``) and content, as stream deltas or as one message.

``ChoiceOutput.feed(text delta, final, token ids)`` returns the choice's next ``DeltaMessage`` (or None); a
non-streamed reply is the same stream fed in one delta (``whole``), so both agree. A harmony parser (gpt-oss:
``openai_gptoss``, ``openai``) reads the token ids instead of the text (``serving.harmony.HarmonyReader``).
"""

from __future__ import annotations

from typing import Sequence

from serving.harmony import HarmonyReader, harmony_encoding
from serving.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall, ToolCall
from serving.reasoning_parsers import ReasoningParser, ReasoningStream
from serving.tool_parsers import ToolCallStream, ToolParser
from serving.tool_parsers.base import random_tool_call_id
from serving.tool_parsers.tool_choice import RequiredToolCallParser, ToolChoice


class ChoiceOutput:
    """One choice's reader. The reply is read as harmony (gpt-oss: ``serving.harmony.HarmonyReader``, on token ids)
    when ``harmony`` (``OpenAIServer.reads_harmony_for``: a harmony parser chosen by flag, whatever the request's
    tool choice, or the harmony ``tool_parser`` the template implies for this request); its tool calls are read in
    ``auto`` mode with a harmony ``tool_parser``, its ``analysis`` channel is reasoning only with a reasoning
    parser."""

    def __init__(self, tool_choice: ToolChoice, tool_parser: ToolParser | None,
                 reasoning_parser: ReasoningParser | None, prompt: str, include_reasoning: bool = True,
                 harmony: bool = False):
        self.tool_choice = tool_choice
        self.include_reasoning = include_reasoning
        self.tools_called = False
        self._harmony = self._reasoning = self._tools = self._named_id = None
        self._named_started = False
        read_tools = tool_choice.mode == "auto" and tool_parser is not None and tool_parser.harmony
        if harmony or read_tools:
            self._harmony = HarmonyReader(harmony_encoding(), read_tools, tool_choice.max_calls)
            self._harmony_reasoning = reasoning_parser is not None
            return
        if reasoning_parser is not None:
            self._reasoning = ReasoningStream(reasoning_parser, prompt)
        if tool_choice.mode == "auto":
            self._tools = ToolCallStream(tool_parser, tool_choice.max_calls)
        elif tool_choice.mode == "required":
            self._tools = ToolCallStream(RequiredToolCallParser(), tool_choice.max_calls)
        elif tool_choice.mode == "named":
            self._named_id = random_tool_call_id()

    def feed(self, delta: str, final: bool = False, token_ids: Sequence[int] = ()) -> DeltaMessage | None:
        """The next ``DeltaMessage`` of the reply (None: nothing to send yet). ``delta`` / ``token_ids``: the reply's
        new text and its ids (a harmony reply is read from the ids); ``final`` on the last delta."""
        if self._harmony is not None:
            reasoning, content, tool_calls = self._harmony.feed(token_ids, final)
            return self._message(reasoning if self._harmony_reasoning else "", content, tool_calls)
        reasoning, content = self._reasoning.feed(delta, final) if self._reasoning is not None else ("", delta)
        tool_calls: list[DeltaToolCall] = []
        if self._named_id is not None and (content or (final and not self._named_started)):
            # The constrained reply is the named function's arguments: stream them as they come.
            piece = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=content))
            if not self._named_started:
                piece.id, piece.type, piece.function.name = self._named_id, "function", self.tool_choice.function_name
                self._named_started = True
            tool_calls.append(piece)
            content = ""
        elif self._tools is not None:
            content, calls = self._tools.feed(content, final)
            tool_calls = [DeltaToolCall(index=index, id=call.id, type="function",
                                        function=DeltaFunctionCall(name=call.name, arguments=call.arguments))
                          for index, call in calls]
        return self._message(reasoning, content, tool_calls)

    def _message(self, reasoning: str, content: str, tool_calls: list[DeltaToolCall]) -> DeltaMessage | None:
        self.tools_called = self.tools_called or bool(tool_calls)
        reasoning = reasoning if self.include_reasoning else ""
        if not (reasoning or content or tool_calls):
            return None
        return DeltaMessage(content=content or None, reasoning_content=reasoning or None,
                            tool_calls=tool_calls or None)

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """vLLM's: "tool_calls" when the parser found calls (auto) or a required choice ended normally."""
        if finish_reason is not None and ((self.tool_choice.mode == "auto" and self.tools_called)
                                          or (self.tool_choice.mode == "required" and finish_reason == "stop")):
            return "tool_calls"
        return finish_reason

    def whole(self, text: str, token_ids: Sequence[int] = ()) -> tuple[str | None, str | None, list[ToolCall]]:
        """(content, reasoning_content, tool_calls) of a finished reply (its text and token ids)."""
        delta = self.feed(text, final=True, token_ids=token_ids)
        if delta is None:
            return ("" if not self.tools_called else None), None, []
        calls: list[ToolCall] = []
        for piece in delta.tool_calls or ():
            if piece.id is not None:
                calls.append(ToolCall(id=piece.id, function=FunctionCall(name=piece.function.name, arguments="")))
            calls[piece.index].function.arguments += piece.function.arguments or ""
        content = delta.content if delta.content is not None else (None if calls else "")
        return content, delta.reasoning_content, calls
