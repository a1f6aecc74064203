"""What every tool-call parser shares: the parsed calls, the streaming split of a reply into content and tool calls.

A parser (``ToolParser``) knows where the tool-call region of a reply starts (``find_start``) and how to read the
calls in it (``parse_calls``). ``ToolCallStream`` runs any parser over a reply streamed in deltas: text before the
region streams as ``content`` (a possible partial start marker is held back), each tool call is sent once it is
complete (its id, name and whole ``arguments`` in one ``DeltaToolCall``; OpenAI clients accumulate arguments
over deltas, so one piece is valid), and what remains is parsed at the end. A whole reply is the same stream fed in
one delta, so a non-streamed reply equals the streamed one, accumulated.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import string
from typing import Any


@dataclasses.dataclass
class ParsedToolCall:
    """One tool call read from the reply: the function name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""


def arguments_json(arguments: Any) -> str:
    """The ``arguments`` of a call as OpenAI sends them: JSON text (a string the model wrote is kept as is)."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def random_tool_call_id() -> str:
    return f"chatcmpl-tool-{secrets.token_hex(16)}"


def decode_json_values(text: str, separators: str = " \t\r\n;,") -> tuple[list[Any], str]:
    """The JSON values written one after another in ``text`` (separated by whitespace, ``;`` or ``,``) and the text
    left after the last complete one."""
    decoder = json.JSONDecoder()
    values, pos = [], 0
    while True:
        while pos < len(text) and text[pos] in separators:
            pos += 1
        if pos >= len(text):
            return values, ""
        try:
            value, end = decoder.raw_decode(text, pos)
        except ValueError:
            return values, text[pos:]
        values.append(value)
        pos = end


class ToolParser:
    """A tool-call format. Subclasses set ``start_markers`` (or override ``find_start``) and ``parse_calls``.

    ``skip_special_tokens``: False when the format's markers are special tokens that detokenization must keep
    (Mistral's ``[TOOL_CALLS]``); the route then asks the engine for them.
    ``harmony``: the calls are read from the reply's token ids by ``serving.harmony.HarmonyReader`` (gpt-oss), not
    from its text.
    """

    name = ""
    start_markers: tuple[str, ...] = ()
    skip_special_tokens = True
    harmony = False

    def find_start(self, text: str) -> int:
        """Index in ``text`` (the reply so far) where the tool-call region starts, or -1."""
        found = [i for i in (text.find(marker) for marker in self.start_markers) if i >= 0]
        return min(found) if found else -1

    def held_back(self, text: str) -> int:
        """How many trailing characters of ``text`` could begin a start marker (not streamed as content yet)."""
        for size in range(min(len(text), max((len(m) for m in self.start_markers), default=0)), 0, -1):
            if any(marker.startswith(text[-size:]) for marker in self.start_markers):
                return size
        return 0

    def parse_calls(self, region: str, final: bool) -> list[ParsedToolCall]:
        """The complete calls in ``region`` (from the start marker on); ``final``: the reply has ended."""
        raise NotImplementedError

    def make_id(self) -> str:
        return random_tool_call_id()


class MistralIds:
    """Mistral's templates accept only 9-character alphanumeric tool call ids."""

    @staticmethod
    def make_id() -> str:
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))


class ToolCallStream:
    """Splits one reply, fed in deltas, into content and tool calls with ``parser`` (see the module docstring).
    ``max_calls``: keep at most this many calls (``parallel_tool_calls: false`` -> 1)."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None):
        self.parser = parser
        self.max_calls = max_calls
        self._text = ""  # the whole reply so far
        self._content_sent = 0  # characters of _text streamed as content
        self._region_start = -1
        self.calls: list[ParsedToolCall] = []

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[tuple[int, ParsedToolCall]]]:
        """-> (content delta, [(index, call)] newly complete). ``final`` on the last delta (may be "")."""
        self._text += delta
        content = ""
        if self._region_start < 0:
            start = self.parser.find_start(self._text)
            if start >= 0:
                self._region_start = start
                content = self._text[self._content_sent:start]
                self._content_sent = start
            else:
                end = len(self._text) if final else len(self._text) - self.parser.held_back(self._text)
                content = self._text[self._content_sent:end]
                self._content_sent = max(self._content_sent, end)
        new_calls = []
        if self._region_start >= 0:
            parsed = self.parser.parse_calls(self._text[self._region_start:], final)
            if final and not parsed and not self.calls:  # nothing readable: the region was text after all
                content += self._text[self._content_sent:]
                self._content_sent = len(self._text)
            for call in parsed[len(self.calls):]:
                if self.max_calls is not None and len(self.calls) >= self.max_calls:
                    break
                call.id = call.id or self.parser.make_id()
                new_calls.append((len(self.calls), call))
                self.calls.append(call)
        return content, new_calls
