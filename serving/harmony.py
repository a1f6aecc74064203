"""gpt-oss's harmony format in the server: a reply's token ids read as channels with the ``openai-harmony`` library
(``--reasoning-parser openai_gptoss``, ``--tool-call-parser openai``; the ``gpt-oss`` extra installs the library).

A gpt-oss reply is a sequence of assistant messages, each ``[<|start|>assistant]<|channel|>CHANNEL[ to=RECIPIENT]
[<|constrain|>TYPE]<|message|>TEXT<|end|>`` (the last one ends ``<|return|>``, a tool call ``<|call|>``).
``HarmonyReader`` feeds the sampled ids to the library's ``StreamableParser`` and routes each message's text:

* ``analysis``: reasoning (``reasoning_content``);
* ``final``, and ``commentary`` without a recipient (the preambles a model shows before calling tools): content;
* a recipient ``functions.NAME`` (whatever the channel): a call of ``NAME`` whose arguments are the text, streamed
  as it comes (when tool calls are read; otherwise the call is left out of the content);
* any other recipient (the built-in ``browser`` / ``python`` tools, which the server does not run): left out.

The parser works on ids, never on detokenized text (the header tokens are special tokens that text would lose). A
reply the library cannot parse (the model broke the format), or one that never opened a message, keeps the rest of
its text as content, decoded from its ids.

The encoding (``o200k_harmony``) loads the ``o200k_base`` vocabulary once: downloaded and cached by the library, or
read from the directory in ``TIKTOKEN_ENCODINGS_BASE`` on a machine without network access (the library checks the
file's SHA-256 either way).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Sequence

try:  # the gpt-oss extra
    import openai_harmony
except ImportError:
    openai_harmony = None

from serving.errors import APIError
from serving.protocol import DeltaFunctionCall, DeltaToolCall
from serving.tool_parsers.base import random_tool_call_id

logger = logging.getLogger(__name__)

EXTRA = "gpt-oss"
REASONING_EFFORTS = ("low", "medium", "high")
_FUNCTIONS = "functions."


def harmony_available() -> bool:
    """Whether the ``openai-harmony`` library is installed."""
    return openai_harmony is not None


def require_harmony(flag: str) -> None:
    """ValueError naming ``flag`` and the extra that installs the library, when it is missing."""
    if not harmony_available():
        raise ValueError(f"{flag} reads gpt-oss's harmony format with the openai-harmony library, which is not "
                         f"installed: pip install 'paged-jax[{EXTRA}]'")


def with_reasoning_effort(body: Any) -> Any:
    """``body`` (a chat request) whose ``reasoning_effort`` (gpt-oss's ``low`` / ``medium`` / ``high``; vLLM's field)
    reaches the chat template as its ``reasoning_effort`` variable, which gpt-oss's template writes into the system
    message (``chat_template_kwargs`` given by the request win). APIError 400 naming the field for another value."""
    effort = body.reasoning_effort
    if effort is None:
        return body
    if effort not in REASONING_EFFORTS:
        raise APIError(400, f"reasoning_effort: must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                       param="reasoning_effort")
    return body.model_copy(update={"chat_template_kwargs": {"reasoning_effort": effort,
                                                            **(body.chat_template_kwargs or {})}})


def check_parsers(reasoning_parser: Any, tool_parser: Any) -> None:
    """The server's ``--reasoning-parser`` and ``--tool-call-parser`` (parser classes or instances, or None) read the
    same format, and the library a harmony one needs is installed; else ValueError naming the flags."""
    chosen = [(flag, parser) for flag, parser in (("--reasoning-parser", reasoning_parser),
                                                  ("--tool-call-parser", tool_parser)) if parser is not None]
    harmony = [f"{flag} {parser.name}" for flag, parser in chosen if parser.harmony]
    text = [f"{flag} {parser.name}" for flag, parser in chosen if not parser.harmony]
    if harmony and text:
        raise ValueError(f"{harmony[0]} reads gpt-oss's harmony format, which {text[0]} does not: use "
                         f"--reasoning-parser openai_gptoss with --tool-call-parser openai")
    if harmony:
        require_harmony(harmony[0])


def load_harmony_for(*parsers: Any) -> None:
    """Loads ``harmony_encoding()`` when one of ``parsers`` (None allowed) reads harmony (ValueError as it)."""
    if any(parser is not None and parser.harmony for parser in parsers):
        harmony_encoding()


@functools.cache
def harmony_encoding() -> Any:
    """The ``HARMONY_GPT_OSS`` encoding (loaded once per process).

    Raises:
      ValueError: the library is missing, or its vocabulary could not be loaded (no network and no
        ``TIKTOKEN_ENCODINGS_BASE``).
    """
    require_harmony("the harmony format")
    try:
        return openai_harmony.load_harmony_encoding(openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    except openai_harmony.HarmonyError as exc:
        raise ValueError(f"the harmony encoding (o200k_base vocabulary) could not be loaded: {exc}. Without network "
                         f"access, set TIKTOKEN_ENCODINGS_BASE to a directory holding o200k_base.tiktoken") from exc


class HarmonyReader:
    """Reads one reply's token ids, fed in deltas, as (reasoning, content, tool-call pieces).

    Args:
      encoding: ``harmony_encoding()``.
      read_tools: messages to ``functions.NAME`` become tool calls (``--tool-call-parser openai``, tool choice
        ``auto``); otherwise they are left out.
      max_calls: keep at most this many calls (``parallel_tool_calls: false`` -> 1); None: all.
    """

    def __init__(self, encoding: Any, read_tools: bool, max_calls: int | None = None):
        self._encoding = encoding
        self._parser = openai_harmony.StreamableParser(encoding, role=openai_harmony.Role.ASSISTANT)
        # The token that ends a message's header: the message's text (and a call's arguments) follows. The parser's
        # own state is not read per token: the library serializes it with the message's tokens, O(length) a call.
        (self._message_token,) = encoding.encode("<|message|>", allowed_special="all")
        # Tokens only a message's header holds: a reply that stops among them was cut short in its first header.
        self._header_tokens = frozenset(encoding.encode("<|start|><|channel|><|constrain|>", allowed_special="all"))
        self._read_tools = read_tools
        self._max_calls = max_calls
        self._broken = False  # the library refused a token: the rest is plain text
        self._call_open = False  # the open message is a call that is kept
        self._unopened: list[int] | None = []  # the ids before the first message opens (None once one has)
        self.num_calls = 0

    def feed(self, token_ids: Sequence[int], final: bool = False) -> tuple[str, str, list[DeltaToolCall]]:
        """-> (reasoning delta, content delta, tool-call pieces) of the reply's next ``token_ids``. A call's first
        piece carries its id and name; its arguments follow as they are sampled. ``final`` on the last delta."""
        reasoning, content, calls = [], [], []
        for position, token_id in enumerate(token_ids):
            if self._broken:
                content.append(self._plain(token_ids[position:]))
                break
            try:
                self._parser.process(token_id)
            except openai_harmony.HarmonyError as exc:
                logger.warning("the reply left the harmony format (%s); its rest is returned as content", exc)
                self._broken = True
                content.append(self._plain(token_ids[position:]))
                break
            if token_id == self._message_token and not self._parser.current_content:  # a header's end (the
                # parser takes one inside a text as text): a message opens
                self._unopened = None
                self._open_message(calls)
            elif self._unopened is not None:
                self._unopened.append(token_id)
            else:
                self._route(self._parser.last_content_delta, reasoning, content, calls)
        if final and not self._broken:
            try:  # a reply cut short (max_tokens) or ended without its stop token: close its last message
                self._parser.process_eos()
            except openai_harmony.HarmonyError:
                pass  # a header cut short: nothing of it is text
        if final and self._unopened:
            if self._header_tokens.isdisjoint(self._unopened):  # not a harmony reply at all: its text is content
                logger.warning("the reply opened no harmony message; its text is returned as content")
                content.append(self._plain(()))
            else:  # cut short (max_tokens) inside its first header: nothing of it is text
                self._unopened = None
        return "".join(reasoning), "".join(content), calls

    def _plain(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids``, after that of the ids no message took yet."""
        ids, self._unopened = (self._unopened or []) + list(token_ids), None
        return self._encoding.decode(ids)

    def _open_message(self, calls: list[DeltaToolCall]) -> None:
        """A message to ``functions.NAME`` opens a call (its id and name, arguments to follow), unless calls are not
        read or the most are kept already."""
        recipient = self._parser.current_recipient or ""
        self._call_open = (self._read_tools and recipient.startswith(_FUNCTIONS)
                           and (self._max_calls is None or self.num_calls < self._max_calls))
        if self._call_open:
            self.num_calls += 1
            calls.append(DeltaToolCall(index=self.num_calls - 1, id=random_tool_call_id(), type="function",
                                       function=DeltaFunctionCall(name=recipient[len(_FUNCTIONS):], arguments="")))

    def _route(self, text: str | None, reasoning: list[str], content: list[str], calls: list[DeltaToolCall]) -> None:
        """Sends ``text`` (the open message's newest text; None between messages) where the message's channel and
        recipient say."""
        if not text:
            return
        if self._parser.current_recipient:
            if self._call_open:
                if calls and calls[-1].index == self.num_calls - 1:  # one piece per call per delta
                    calls[-1].function.arguments += text
                else:
                    calls.append(DeltaToolCall(index=self.num_calls - 1, function=DeltaFunctionCall(arguments=text)))
        elif self._parser.current_channel == "analysis":
            reasoning.append(text)
        else:
            content.append(text)
