"""A chat request from its body to the engine: the one path that ``POST /v1/chat/completions`` and
``POST /v1/responses`` (whose requests are translated into chat requests, ``serving.responses_input``) share.

``submit_chat`` checks the body, resolves the tool choice, renders the conversation with the chat template, tokenizes
it, builds the sampling parameters and admits the request; ``choice_output`` reads one choice's text back as
reasoning, tool calls and content (``serving.chat_output``). Input problems raise ``APIError`` naming the chat field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from serving.async_engine import EngineRequest, RequestStream
from serving.chat_output import ChoiceOutput
from serving.errors import APIError
from serving.harmony import with_reasoning_effort
from serving.openai_server import OpenAIServer
from serving.protocol import ChatCompletionRequest
from serving.structured_outputs import structured_outputs_from_request
from serving.tool_parsers.tool_choice import ToolChoice, resolve_tool_choice


@dataclasses.dataclass
class ChatSubmission:
    """An admitted chat request: its engine streams (one per prompt: one), the rendered prompt, its token count,
    the resolved tool choice, the number of top logprobs asked for (None: no logprobs) and the sampling parameters."""

    streams: list[RequestStream]
    prompt: str
    num_prompt_tokens: int
    tool_choice: ToolChoice
    num_top: int | None
    params: Any


def check_chat_logprobs(server: OpenAIServer, body: ChatCompletionRequest) -> int | None:
    """The number of top logprobs ``body`` asks for (None: no logprobs), checked against ``--max-logprobs``."""
    if body.top_logprobs is not None and body.top_logprobs > 0 and not body.logprobs:
        raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
    num_top = (body.top_logprobs or 0) if body.logprobs else None
    server.check_num_logprobs(num_top, "top_logprobs")
    return num_top


async def submit_chat(server: OpenAIServer, body: ChatCompletionRequest, response_id: str) -> ChatSubmission:
    """Check ``body``, render and tokenize its conversation, and admit it to the engine as ``response_id``.

    Raises:
      APIError: 400 naming the field, 404 for an unknown model, 503 when the waiting queue is full.
    """
    server.check_request(body)
    server.check_num_seqs(body, 1)
    num_top = check_chat_logprobs(server, body)
    server.check_prompt_logprobs(body)
    tool_choice = resolve_tool_choice(body.tools, body.tool_choice, body.parallel_tool_calls,
                                      enable_auto_tool_choice=server.enable_auto_tool_choice,
                                      tool_parser=server.tool_parser.name if server.tool_parser else None,
                                      implied_tool_parser=server.implied_tool_parser)
    tool_parser = server.tool_call_parser(tool_choice)
    if server.reads_harmony_for(tool_parser):
        refuse_constraint(body, tool_choice)
    text = await server.render_chat(body.messages, with_reasoning_effort(body))
    ids = server.truncate(await server.encode(text, body.add_special_tokens, "messages",
                                              truncating=body.truncate_prompt_tokens is not None),
                          body.truncate_prompt_tokens)
    server.check_prompt_length(len(ids), "messages")
    max_tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = server.resolve_max_tokens(requested, len(ids), max_tokens_param)
    aliases = {"logprobs": "top_logprobs", "max_tokens": max_tokens_param}
    keep_special = tool_parser is not None and not tool_parser.skip_special_tokens
    params = server.generation_params(body, max_tokens=max_tokens, logprobs=num_top, aliases=aliases,
                                      prompt_logprobs=body.prompt_logprobs, tool_schema=tool_choice.schema,
                                      skip_special_tokens=False if keep_special else None)
    streams = await server.submit([EngineRequest(response_id, server.engine_prompt(ids, body), params,
                                                 priority=body.priority, lora_request=server.lora_request(body.model))],
                                  body, aliases)
    return ChatSubmission(streams, text, len(ids), tool_choice, num_top, params)


def refuse_constraint(body: ChatCompletionRequest, tool_choice: ToolChoice) -> None:
    """A structured-output constraint (``response_format``, ``structured_outputs``, a ``"required"`` or named tool
    choice, ...) binds a reply from its first token, where a harmony reply writes its channel header: with gpt-oss's
    parsers it is refused (400 naming the field)."""
    constraint, fields = structured_outputs_from_request(body, tool_choice.schema)
    if constraint is not None:
        field = fields[constraint.kind]
        raise APIError(400, f"{field}: structured outputs and tool_choice \"required\" or a named function bind the "
                            f"reply from its first token, which breaks gpt-oss's harmony format (this server reads "
                            f"it with --reasoning-parser openai_gptoss / --tool-call-parser openai); use "
                            f"tool_choice \"auto\"", param=field)


def choice_output(server: OpenAIServer, body: ChatCompletionRequest, submission: ChatSubmission) -> ChoiceOutput:
    """A fresh reader of one choice's reply (reasoning, tool calls, content) for ``submission``."""
    tool_parser = server.tool_call_parser(submission.tool_choice)
    return ChoiceOutput(submission.tool_choice, tool_parser, server.reasoning_parser, submission.prompt,
                        body.include_reasoning, harmony=server.reads_harmony_for(tool_parser))
