"""The tool-call parser a chat template implies, for a request with ``tools`` and no ``tool_choice`` on a server
started without ``--tool-call-parser`` (beyond vLLM, which answers such a request 400).

A template that teaches the model a tool-call format names that format's markers: Qwen2 / 2.5 / 3 and Hermes
templates wrap calls in ``<tool_call>`` (``hermes``), Mistral's start them with ``[TOOL_CALLS]`` (``mistral``), and
Llama 3.x templates describe tools in an ``ipython`` environment between ``<|start_header_id|>`` headers
(``llama3_json``); gpt-oss's harmony template writes ``<|channel|>`` headers and ends calls with ``<|call|>``
(``openai``, where the ``gpt-oss`` extra is installed). Any other template implies none.
"""

from __future__ import annotations

from typing import Any

from serving.harmony import harmony_available

# (parser name, markers that must all be in the template), first match wins.
_TEMPLATE_MARKERS = (
    ("openai", ("<|channel|>", "<|call|>")),
    ("hermes", ("<tool_call>",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("llama3_json", ("<|start_header_id|>", "ipython")),
)


def template_text(chat_template: Any) -> str | None:
    """The template's text: a string as is; a tokenizer's named templates (a dict): its ``tool_use`` one, else its
    ``default`` one."""
    if isinstance(chat_template, dict):
        chat_template = chat_template.get("tool_use") or chat_template.get("default")
    return chat_template if isinstance(chat_template, str) else None


def implied_tool_parser(chat_template: Any) -> str | None:
    """The name (a key of ``serving.tool_parsers.TOOL_PARSERS``) of the parser ``chat_template`` implies, or None."""
    text = template_text(chat_template)
    if not text:
        return None
    for name, markers in _TEMPLATE_MARKERS:
        if name == "openai" and not harmony_available():
            continue
        if all(marker in text for marker in markers):
            return name
    return None
