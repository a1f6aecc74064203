"""Chat rendering: an OpenAI-style conversation -> the prompt the tokenizer's chat template writes for it.

The one home of chat rendering, used by ``LLM.chat`` and by the server (``/v1/chat/completions``, ``/tokenize``).
Messages are OpenAI's: ``{"role", "content", "name"?, "tool_calls"?, "tool_call_id"?}`` where ``content`` is a
string, None, or a list of text parts ``{"type": "text", "text": ...}``. Before the template sees them, text parts
are joined with newlines, None content becomes "", the ``developer`` role (OpenAI's newer name for ``system``)
becomes ``system``, since HF chat templates know only the older roles, and the JSON-string ``arguments`` of an
assistant's ``tool_calls`` are parsed into dicts (as vLLM does: tool-use templates expect dicts). Other message
keys, ``tool_calls`` and ``tool_call_id`` included, pass through to the template unchanged; keys whose value is
None are dropped (templates test ``message.tool_calls is defined``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from transformers.utils.chat_template_utils import _compile_jinja_template

# apply_chat_template's own arguments: chat_template_kwargs may not set them (they would change what is returned).
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "tokenize", "return_tensors", "return_dict",
                                       "return_assistant_tokens_mask", "tokenizer_kwargs", "padding", "truncation",
                                       "max_length"})


class ChatTemplateError(ValueError):
    """The chat template rejected the conversation (e.g. an unsupported role order); the message is the
    template's own."""


def load_chat_template(chat_template: str | None) -> str | None:
    """vLLM's ``--chat-template``: the contents of the file at ``chat_template``, or the string itself when it is
    an inline Jinja template (it has ``{``, ``}`` or a newline).

    Raises:
      ValueError: ``chat_template`` looks like a path but cannot be read, or the template is not valid Jinja (compiled
      as transformers compiles it).
    """
    if chat_template is None:
        return None
    try:
        template = Path(chat_template).read_text()
    except OSError as exc:
        if not any(char in chat_template for char in "{}\n"):
            raise ValueError(f"chat_template {chat_template!r} looks like a file path, but it cannot be read "
                             f"({exc})") from exc
        template = chat_template
    try:
        _compile_jinja_template(template)
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat_template is not a valid Jinja template: {exc}") from exc
    return template


def normalize_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """One OpenAI-style message as HF chat templates expect it (see the module docstring).

    Raises:
      ChatTemplateError: a tool call's ``arguments`` is not valid JSON.
    """
    entry = {key: value for key, value in message.items() if value is not None}
    content = entry.get("content")
    if isinstance(content, list):
        content = "\n".join(part["text"] for part in content)
    entry["content"] = content or ""
    if entry.get("role") == "developer":
        entry["role"] = "system"
    if entry.get("tool_calls"):
        calls = []
        for call in entry["tool_calls"]:
            call = dict(call)
            function = dict(call.get("function") or {})
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError as exc:
                    raise ChatTemplateError(f"tool call {call.get('id')!r}: arguments is not valid JSON ({exc})"
                                            ) from exc
            call["function"] = function
            calls.append(call)
        entry["tool_calls"] = calls
    return entry


def render_chat(tokenizer: Any, conversation: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                chat_template_kwargs: Mapping[str, Any] | None = None, *, continue_final_message: bool = False,
                chat_template: str | None = None, documents: Sequence[Mapping[str, str]] | None = None,
                tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The prompt text of ``conversation`` as the chat template renders it (vLLM's ``apply_hf_chat_template``).

    Args:
      tokenizer: a transformers tokenizer (``apply_chat_template``).
      conversation: OpenAI-style messages (see the module docstring).
      add_generation_prompt: end with the assistant turn's opening.
      chat_template_kwargs: extra variables for the template; they override the arguments below (as vLLM), e.g.
        ``{"enable_thinking": False}`` for Qwen3.
      continue_final_message: leave the final message open, so the reply continues it (e.g. a prefilled
        assistant answer); exclusive with ``add_generation_prompt``.
      chat_template: a Jinja template replacing the tokenizer's.
      documents: ``[{"title", "text"}, ...]`` for templates that support retrieval-augmented generation.
      tools: OpenAI tool definitions (``[{"type": "function", "function": {...}}]``) for templates that describe
        tools to the model (Qwen, Llama 3.x, Mistral).
    Raises:
      ChatTemplateError: the template failed on this conversation (or there is none), or the arguments conflict.
      RuntimeError: the template rendered something other than a string.
    """
    kwargs: dict[str, Any] = dict(add_generation_prompt=add_generation_prompt,
                                  continue_final_message=continue_final_message)
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    if documents is not None:
        kwargs["documents"] = [dict(document) for document in documents]
    if tools:
        kwargs["tools"] = [dict(tool) for tool in tools]
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(chat_template_kwargs or {}))
    if reserved:
        raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    kwargs.update(chat_template_kwargs or {})
    if kwargs["add_generation_prompt"] and kwargs["continue_final_message"]:
        raise ChatTemplateError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    messages = [normalize_message(message) for message in conversation]
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as exc:  # noqa: BLE001 - template errors are the conversation's fault, not the engine's
        raise ChatTemplateError(str(exc)) from exc
    if not isinstance(rendered, str):
        raise RuntimeError("the tokenizer's chat template did not render a string")
    return rendered


def chat_prompt_token_ids(tokenizer: Any, conversation: Sequence[Mapping[str, Any]],
                          add_generation_prompt: bool = True,
                          chat_template_kwargs: Mapping[str, Any] | None = None, **render_kwargs: Any) -> list[int]:
    """Token ids of ``conversation`` rendered by ``render_chat`` (``render_kwargs``: its keyword-only arguments);
    no special tokens are added (the template already writes them)."""
    text = render_chat(tokenizer, conversation, add_generation_prompt, chat_template_kwargs, **render_kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))
