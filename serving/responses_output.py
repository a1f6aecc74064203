"""One reply of the Responses API as output items, and the stream events that build them.

``OutputBuilder.feed`` takes the reply's ``DeltaMessage``s (``serving.chat_output.ChoiceOutput.feed``: reasoning,
content, tool-call pieces) and returns the events OpenAI's SDK parses: an item opens when its kind of text starts
(``response.output_item.added``, then for text ``response.content_part.added``), grows by deltas
(``response.reasoning_text.delta``, ``response.output_text.delta``, ``response.function_call_arguments.delta``) and
is done when another kind starts or the reply ends (``*.done``, ``response.content_part.done``,
``response.output_item.done``). A non-streamed reply is the same builder fed in one delta, so both agree; the
finished items are ``OutputBuilder.items``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from serving.protocol import DeltaMessage, DeltaToolCall, random_uuid
from serving.responses_protocol import (ContentPartEvent, FunctionCallArgumentsDeltaEvent,
                                        FunctionCallArgumentsDoneEvent, OutputFunctionCall, OutputItem,
                                        OutputItemEvent, OutputMessage, OutputReasoning, OutputText,
                                        OutputTextDeltaEvent, OutputTextDoneEvent, ReasoningContent,
                                        ReasoningTextDeltaEvent, ReasoningTextDoneEvent, ResponseEvent)


@dataclasses.dataclass
class _OpenItem:
    kind: str  # "reasoning", "message" or "function_call"
    item_id: str
    output_index: int
    text: str = ""  # reasoning or message text, or the call's arguments
    call_id: str = ""
    name: str = ""
    logprobs: list = dataclasses.field(default_factory=list)  # a message's


_ID_PREFIX = {"reasoning": "rs", "message": "msg", "function_call": "fc"}


class OutputBuilder:
    """The output items of one reply and their stream events, numbered from ``sequence_number`` (the events before
    the first item, ``response.created`` and ``response.in_progress``, take their numbers through ``event``)."""

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self.sequence_number = 0
        self._open: _OpenItem | None = None
        self._logprobs: list = []  # logprob entries of tokens whose text no output_text delta has carried yet

    def event(self, cls: type, **fields: Any) -> ResponseEvent:
        """A ``cls`` event with the next sequence number."""
        event = cls(sequence_number=self.sequence_number, **fields)
        self.sequence_number += 1
        return event

    @property
    def text(self) -> tuple[str, str]:
        """(the reply's reasoning, its message text) among the finished items."""
        reasoning = "".join(part.text for item in self.items if isinstance(item, OutputReasoning)
                            for part in item.content)
        content = "".join(part.text for item in self.items if isinstance(item, OutputMessage) for part in item.content)
        return reasoning, content

    def feed(self, delta: DeltaMessage | None, logprobs: list | None = None) -> list[ResponseEvent]:
        """The events of the reply's next delta (none for None: text held back by the parsers). ``logprobs``: the
        entries of the delta's tokens (``include: ["message.output_text.logprobs"]``); the next output_text delta
        carries them (all the reply's tokens' go to its message text, reasoning and tool-call tokens included, as
        vLLM's)."""
        self._logprobs.extend(logprobs or ())
        events: list[ResponseEvent] = []
        if delta is None:
            return events
        if delta.reasoning_content:
            events += self._text("reasoning", delta.reasoning_content)
        if delta.content:
            events += self._text("message", delta.content)
        for piece in delta.tool_calls or ():
            events += self._call_piece(piece)
        return events

    def close(self, status: str = "completed") -> list[ResponseEvent]:
        """The events that finish the open item (if any), which gets ``status`` (``incomplete``: the reply was cut
        at ``max_output_tokens``)."""
        item, self._open = self._open, None
        if item is None:
            return []
        common = dict(item_id=item.item_id, output_index=item.output_index)
        if item.kind == "function_call":
            done = OutputFunctionCall(id=item.item_id, call_id=item.call_id, name=item.name, arguments=item.text,
                                      status=status)
            events = [self.event(FunctionCallArgumentsDoneEvent, name=item.name, arguments=item.text, **common)]
        elif item.kind == "reasoning":
            part = ReasoningContent(text=item.text)
            done = OutputReasoning(id=item.item_id, content=[part], status=status)
            events = [self.event(ReasoningTextDoneEvent, content_index=0, text=item.text, **common),
                      self.event(ContentPartEvent, type="response.content_part.done", content_index=0, part=part,
                                 **common)]
        else:
            item.logprobs += self._logprobs
            self._logprobs = []
            part = OutputText(text=item.text, logprobs=item.logprobs)
            done = OutputMessage(id=item.item_id, status=status, content=[part])
            events = [self.event(OutputTextDoneEvent, content_index=0, text=item.text, logprobs=item.logprobs,
                                 **common),
                      self.event(ContentPartEvent, type="response.content_part.done", content_index=0, part=part,
                                 **common)]
        self.items.append(done)
        events.append(self.event(OutputItemEvent, type="response.output_item.done", output_index=item.output_index,
                                 item=done))
        return events

    def _start(self, kind: str, **fields: Any) -> list[ResponseEvent]:
        events = self.close()
        item = self._open = _OpenItem(kind, f"{_ID_PREFIX[kind]}_{random_uuid()}", len(self.items), **fields)
        common = dict(item_id=item.item_id, output_index=item.output_index)
        if kind == "function_call":
            added = OutputFunctionCall(id=item.item_id, call_id=item.call_id, name=item.name, arguments="",
                                       status="in_progress")
        elif kind == "reasoning":
            added = OutputReasoning(id=item.item_id, status="in_progress")
        else:
            added = OutputMessage(id=item.item_id, status="in_progress", content=[])
        events.append(self.event(OutputItemEvent, type="response.output_item.added", output_index=item.output_index,
                                 item=added))
        if kind != "function_call":
            part = ReasoningContent(text="") if kind == "reasoning" else OutputText(text="")
            events.append(self.event(ContentPartEvent, type="response.content_part.added", content_index=0,
                                     part=part, **common))
        return events

    def _text(self, kind: str, text: str) -> list[ResponseEvent]:
        events = [] if self._open is not None and self._open.kind == kind else self._start(kind)
        item = self._open
        item.text += text
        common = dict(item_id=item.item_id, output_index=item.output_index, content_index=0, delta=text)
        if kind == "reasoning":
            events.append(self.event(ReasoningTextDeltaEvent, **common))
        else:
            logprobs, self._logprobs = self._logprobs, []
            item.logprobs += logprobs
            events.append(self.event(OutputTextDeltaEvent, logprobs=logprobs, **common))
        return events

    def _call_piece(self, piece: DeltaToolCall) -> list[ResponseEvent]:
        arguments = (piece.function.arguments if piece.function is not None else None) or ""
        events: list[ResponseEvent] = []
        if piece.id is not None:  # a call's first piece: its id and name
            events = self._start("function_call", call_id=piece.id, name=piece.function.name or "")
        item = self._open
        if arguments:
            item.text += arguments
            events.append(self.event(FunctionCallArgumentsDeltaEvent, item_id=item.item_id,
                                     output_index=item.output_index, delta=arguments))
        return events
