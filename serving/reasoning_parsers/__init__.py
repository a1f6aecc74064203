"""Reasoning parsers (``--reasoning-parser``): the thinking a model writes between ``<think>`` and ``</think>``
goes to ``reasoning_content``, the rest to ``content``, streamed and not (a whole reply is the stream fed at once).

* ``deepseek_r1``: the reply starts in thinking (the template opens ``<think>`` or the model does) until
  ``</think>``; a reply without it is all thinking (it ran out of tokens while thinking).
* ``qwen3``: the reply is thinking only when it opens with ``<think>`` or the prompt ends with it (templates that
  open the thinking block, e.g. Qwen3-2507's); otherwise it is all content (``enable_thinking: false``).
* ``openai_gptoss``: gpt-oss's harmony format, read from the reply's token ids (``serving.harmony``): the
  ``analysis`` channel is the reasoning, the ``final`` channel the content. Needs the ``gpt-oss`` extra.
"""

from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"


class ReasoningParser:
    """A reasoning format. ``harmony``: read from token ids by ``serving.harmony.HarmonyReader`` (no text
    markers)."""

    name = ""
    harmony = False

    def starts_in_reasoning(self, prompt: str) -> bool:
        raise NotImplementedError


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def starts_in_reasoning(self, prompt: str) -> bool:
        return True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def starts_in_reasoning(self, prompt: str) -> bool:
        return prompt.rstrip().endswith(THINK_START)


class GptOssReasoningParser(ReasoningParser):
    name = "openai_gptoss"
    harmony = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, GptOssReasoningParser)}


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest proper suffix of ``text`` that begins ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ReasoningStream:
    """Splits one reply, fed in deltas, into (reasoning delta, content delta) pairs."""

    def __init__(self, parser: ReasoningParser, prompt: str):
        self.in_reasoning = parser.starts_in_reasoning(prompt)
        self._at_start = True  # a leading <think> is dropped (and opens the thinking)
        self._pending = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self._pending += delta
        if self._at_start:
            stripped = self._pending.lstrip()
            if stripped.startswith(THINK_START):
                self._pending, self.in_reasoning, self._at_start = stripped[len(THINK_START):], True, False
            elif THINK_START.startswith(stripped) and not final:
                return "", ""  # may still become <think>
            else:
                self._at_start = False
        reasoning = ""
        if self.in_reasoning:
            end = self._pending.find(THINK_END)
            if end >= 0:
                reasoning, self._pending = self._pending[:end], self._pending[end + len(THINK_END):]
                self.in_reasoning = False
            else:
                keep = 0 if final else _partial_suffix(self._pending, THINK_END)
                reasoning, self._pending = self._pending[:len(self._pending) - keep], self._pending[
                    len(self._pending) - keep:]
                return reasoning, ""
        content, self._pending = self._pending, ""
        return reasoning, content
