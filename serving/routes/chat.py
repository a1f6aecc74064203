"""``POST /v1/chat/completions``: ``messages`` (and ``tools``) rendered by the chat template (``paged_jax.entrypoints.chat``),
JSON or SSE; each choice's text becomes reasoning, tool calls and content (``serving.chat_output``)."""

from __future__ import annotations

from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from serving.chat_request import ChatSubmission, choice_output, submit_chat
from serving.openai_server import OpenAIServer, get_server
from serving.protocol import (ChatCompletionRequest, ChatCompletionResponse, ChatCompletionResponseChoice,
                              ChatCompletionStreamChoice, ChatCompletionStreamResponse, ChatMessage, DeltaMessage,
                              unix_time)
from serving.routes import GENERATION_RESPONSES, encode_routed_experts, json_response
from serving.streaming import EngineStreamingResponse, SSEChunks, collect_final, usage_options

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=GENERATION_RESPONSES)
async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request,
                                 server: OpenAIServer = Depends(get_server)) -> Response:
    response_id = server.response_id("chatcmpl", body, raw_request)
    submission = await submit_chat(server, body, response_id)
    streams, num_top = submission.streams, submission.num_top
    created = unix_time()
    # vLLM's get_chat_request_role: the reply continues the last message's role unless a new turn is opened.
    role = server.response_role if body.add_generation_prompt else body.messages[-1].role
    echo = _echoed_content(body, role)
    if body.stream:
        return EngineStreamingResponse(_chat_chunks(server, body, submission, response_id, created, role, echo),
                                       server.engine, streams)
    finals = await collect_final(server.engine, streams, raw_request)
    if finals is None:
        return Response(status_code=499)  # the client left
    (final,) = finals
    choices = []
    for completion in final.outputs:
        logprobs = None
        if num_top is not None and completion.logprobs is not None:
            logprobs = server.chat_logprobs(completion.token_ids, completion.logprobs, num_top,
                                            bool(body.return_tokens_as_token_ids))
        output = choice_output(server, body, submission)
        content, reasoning, tool_calls = output.whole(completion.text, completion.token_ids)
        content = echo + content if echo else content
        choices.append(ChatCompletionResponseChoice(
            index=completion.index, message=ChatMessage(role=role, content=content, tool_calls=tool_calls,
                                                        reasoning_content=reasoning),
            logprobs=logprobs, finish_reason=output.finish_reason(completion.finish_reason),
            stop_reason=completion.stop_reason, routed_experts=encode_routed_experts(completion.routed_experts)))
    choices.sort(key=lambda choice: choice.index)
    num_completion_tokens = sum(len(completion.token_ids) for completion in final.outputs)
    usage = SSEChunks.usage_info(submission.num_prompt_tokens, num_completion_tokens,
                                 server.cached_tokens([final.num_cached_tokens]))
    return json_response(ChatCompletionResponse(id=response_id, created=created,
                                                model=server.response_model_name(body.model), choices=choices,
                                                usage=usage,
                                                prompt_logprobs=server.prompt_logprobs(final.prompt_logprobs)))


def _echoed_content(body: ChatCompletionRequest, role: str) -> str:
    """``echo``: the last message's content when it has the reply's role (the reply then continues it), else ""."""
    last = body.messages[-1]
    if not body.echo or last.role != role or not last.content:
        return ""
    return last.content if isinstance(last.content, str) else "\n".join(part.text for part in last.content)


async def _chat_chunks(server: OpenAIServer, body: ChatCompletionRequest, submission: ChatSubmission,
                       response_id: str, created: int, role: str, echo: str) -> AsyncIterator[str]:
    """The SSE chunks of a streamed chat completion: the role per choice, the echoed content per choice, then one
    chunk per choice and delta output."""
    stream, num_prompt_tokens, num_top = submission.streams[0], submission.num_prompt_tokens, submission.num_top
    include_usage, continuous_usage = usage_options(body.stream_options)
    chunks = SSEChunks(ChatCompletionStreamResponse, response_id, created, server.response_model_name(body.model),
                       include_usage)
    start_usage = chunks.usage_info(num_prompt_tokens, 0) if continuous_usage else None
    for index in range(body.n):
        yield chunks.choice(ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role=role, content="")),
                            start_usage)
    if echo:
        for index in range(body.n):
            yield chunks.choice(ChatCompletionStreamChoice(index=index, delta=DeltaMessage(content=echo)),
                                start_usage)
    num_tokens = [0] * body.n  # per choice: completion tokens so far
    outputs = [choice_output(server, body, submission) for _ in range(body.n)]
    num_cached_tokens = 0
    async for output in stream:
        num_cached_tokens = output.num_cached_tokens
        for completion in output.outputs:
            num_tokens[completion.index] += len(completion.token_ids)
            logprobs = None
            if num_top is not None and completion.logprobs is not None:
                logprobs = server.chat_logprobs(completion.token_ids, completion.logprobs, num_top,
                                                bool(body.return_tokens_as_token_ids))
            output = outputs[completion.index]
            finished = completion.finish_reason is not None
            delta = output.feed(completion.text, final=finished, token_ids=completion.token_ids)
            if delta is None and not finished and logprobs is None:
                continue  # held back (a possible marker, a tool call not complete yet): nothing to send
            usage = chunks.usage_info(num_prompt_tokens, num_tokens[completion.index]) if continuous_usage else None
            yield chunks.choice(ChatCompletionStreamChoice(index=completion.index, delta=delta or DeltaMessage(),
                                                           logprobs=logprobs,
                                                           finish_reason=output.finish_reason(completion.finish_reason),
                                                           stop_reason=completion.stop_reason), usage)
    if include_usage:
        yield chunks.usage(num_prompt_tokens, sum(num_tokens), server.cached_tokens([num_cached_tokens]))
