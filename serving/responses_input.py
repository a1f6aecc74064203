"""A Responses request as the chat request it is (vLLM's ``construct_input_messages``): the stored conversation of
``previous_response_id`` and the ``input`` items become chat messages after the request's ``instructions`` (which do
not carry over to later turns, as OpenAI's), function tools become chat tools, ``tool_choice`` and
``text.format`` their chat forms, ``max_output_tokens`` the ``max_completion_tokens``. The chat path
(``serving.chat_request``) then serves it; its errors name chat fields, which ``responses_error`` renames back.

Items become messages as vLLM builds them: a ``function_call`` joins the assistant message before it (as one of its
``tool_calls``), a ``reasoning`` item opens an assistant message (its ``reasoning``) that the next assistant text or
call joins, a ``function_call_output`` is a ``tool`` message.
"""

from __future__ import annotations

from typing import Any, Sequence

from pydantic import TypeAdapter, ValidationError

from serving.errors import APIError
from serving.protocol import ChatCompletionRequest
from serving.unsupported_fields import OUTPUT_LOGPROBS
from serving.responses_protocol import (FunctionCallItem, FunctionCallOutputItem, InputItem, MessageItem, OutputItem,
                                        ReasoningItem, ResponsesRequest)

# Responses fields that mean the same in a chat request.
SHARED_FIELDS = ("model", "temperature", "top_p", "top_k", "repetition_penalty", "seed", "stop", "ignore_eos",
                 "skip_special_tokens", "include_stop_str_in_output", "logit_bias", "structured_outputs", "priority",
                 "cache_salt", "parallel_tool_calls", "user", "prompt_cache_key", "safety_identifier", "service_tier",
                 "mm_processor_kwargs", "vllm_xargs", "stream")
# A chat field -> the Responses field it comes from (errors of the chat path name the latter).
CHAT_TO_RESPONSES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                     "response_format": "text", "logprobs": "include"}
_ITEMS = TypeAdapter(list[InputItem])


def _append_item(messages: list[dict], item: Any) -> None:
    previous = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
    if isinstance(item, MessageItem):
        if item.role == "assistant" and previous is not None and previous.get("content") is None:
            previous["content"] = item.text()
        else:
            messages.append({"role": item.role, "content": item.text()})
    elif isinstance(item, FunctionCallItem):
        call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        if previous is not None:
            previous.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif isinstance(item, FunctionCallOutputItem):
        messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    elif isinstance(item, ReasoningItem):
        if previous is not None and previous.get("reasoning") is None and previous.get("content") is None:
            previous["reasoning"] = item.text()
        else:
            messages.append({"role": "assistant", "content": None, "reasoning": item.text()})


def conversation(history: Sequence[dict], items: str | Sequence[Any]) -> list[dict]:
    """The chat messages of a conversation: ``history`` (a stored turn's), then ``items`` (a request's ``input``)."""
    messages = [dict(message) for message in history]
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        return messages
    for item in items:
        _append_item(messages, item)
    return messages


def output_history(output: Sequence[OutputItem]) -> list[Any]:
    """A response's output items as the input items that pass them back."""
    return _ITEMS.validate_python([item.model_dump() for item in output])


def _continues_final_message(items: str | Sequence[Any]) -> bool:
    """vLLM's partial-message completion: the input ends with an unfinished assistant message."""
    last = items[-1] if not isinstance(items, str) and items else None
    return (isinstance(last, MessageItem) and last.role == "assistant"
            and last.status in ("in_progress", "incomplete"))


def _chat_tool_choice(tool_choice: Any) -> Any:
    if tool_choice is None or isinstance(tool_choice, str):
        return tool_choice  # "none", "auto", "required" (others are refused by the chat path, naming tool_choice)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(
            tool_choice.get("name"), str):
        return {"type": "function", "function": {"name": tool_choice["name"]}}
    raise APIError(400, f"tool_choice: must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                        f"\"name\": ...}}, got {tool_choice!r}", param="tool_choice")


def _response_format(text: dict | None) -> dict | None:
    """``text.format`` as a chat ``response_format`` (None: no constraint)."""
    if text is None:
        return None
    for key, value in text.items():
        if key != "format" and value is not None:
            raise APIError(400, f"text: text.{key} is not supported (only text.format)", param="text")
    spec = text.get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, f"text: text.format must be {{\"type\": \"text\" | \"json_object\" | \"json_schema\", "
                            f"...}}, got {spec!r}", param="text")
    if spec["type"] != "json_schema":
        return {"type": spec["type"]}
    return {"type": "json_schema", "json_schema": {key: spec[key] for key in ("name", "schema", "strict", "description")
                                                   if key in spec}}


def chat_request(body: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    """The chat request that serves ``body``, whose conversation is ``messages`` (``conversation``, without the
    instructions: they are prepended here)."""
    fields: dict[str, Any] = {name: getattr(body, name) for name in SHARED_FIELDS if name in body.model_fields_set}
    fields["messages"] = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + messages
    if body.max_output_tokens is not None:
        fields["max_completion_tokens"] = body.max_output_tokens
    if OUTPUT_LOGPROBS in (body.include or ()):
        fields.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    if body.tools:
        fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                           for tool in body.tools]
    if body.tool_choice is not None:
        fields["tool_choice"] = _chat_tool_choice(body.tool_choice)
    response_format = _response_format(body.text)
    if response_format is not None:
        fields["response_format"] = response_format
    if _continues_final_message(body.input):
        fields.update(add_generation_prompt=False, continue_final_message=True)
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise APIError(400, f"input: the conversation is not a valid chat ({where}: {first.get('msg')})",
                       param="input") from exc


def responses_error(exc: APIError) -> APIError:
    """An error of the chat path naming the Responses field instead of the chat field it was translated into."""
    param = CHAT_TO_RESPONSES.get(exc.param or "", exc.param)
    message = exc.message
    if exc.param in CHAT_TO_RESPONSES and message.startswith(exc.param):
        message = param + message[len(exc.param):]
    return APIError(exc.status_code, message, param=param, headers=exc.headers)
