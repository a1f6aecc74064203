"""Chat rendering: an OpenAI-style conversation -> the prompt the tokenizer's chat template writes for it.

The one home of chat rendering, used by ``LLM.chat`` and by the server (``/v1/chat/completions``, ``/tokenize``).
Messages are OpenAI's: ``{"role", "content", "name"?}`` where ``content`` is a string, None, or a list of text parts
``{"type": "text", "text": ...}``. Before the template sees them, text parts are joined with newlines, None content
becomes "", and the ``developer`` role (OpenAI's newer name for ``system``) becomes ``system``, since HF chat
templates know only the older roles. Other message keys pass through to the template unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class ChatTemplateError(ValueError):
    """The chat template rejected the conversation (e.g. an unsupported role order); the message is the
    template's own."""


def normalize_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """One OpenAI-style message as HF chat templates expect it (plain-string content, no ``developer`` role)."""
    entry = dict(message)
    content = entry.get("content")
    if isinstance(content, list):
        content = "\n".join(part["text"] for part in content)
    entry["content"] = content or ""
    if entry.get("role") == "developer":
        entry["role"] = "system"
    if entry.get("name") is None:
        entry.pop("name", None)
    return entry


def render_chat(tokenizer: Any, conversation: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The prompt text of ``conversation`` as the tokenizer's chat template renders it.

    Args:
      tokenizer: a transformers tokenizer (``apply_chat_template``).
      conversation: OpenAI-style messages (see the module docstring).
      add_generation_prompt: end with the assistant turn's opening (False to continue a final assistant message).
      chat_template_kwargs: extra variables for the template.
    Raises:
      ChatTemplateError: the template failed on this conversation (or the tokenizer has no template).
      RuntimeError: the template rendered something other than a string.
    """
    messages = [normalize_message(message) for message in conversation]
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 **(chat_template_kwargs or {}))
    except Exception as exc:  # noqa: BLE001 - template errors are the conversation's fault, not the engine's
        raise ChatTemplateError(str(exc)) from exc
    if not isinstance(rendered, str):
        raise RuntimeError("the tokenizer's chat template did not render a string")
    return rendered


def chat_prompt_token_ids(tokenizer: Any, conversation: Sequence[Mapping[str, Any]],
                          add_generation_prompt: bool = True,
                          chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids of ``conversation`` rendered by ``render_chat``; no special tokens are added (the template
    already writes them)."""
    text = render_chat(tokenizer, conversation, add_generation_prompt, chat_template_kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))
