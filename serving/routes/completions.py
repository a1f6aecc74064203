"""``POST /v1/completions``: one or several prompts (texts or token ids), ``n`` choices each, JSON or SSE."""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from serving.async_engine import EngineRequest, RequestStream
from serving.errors import APIError
from serving.openai_server import OpenAIServer, get_server
from serving.protocol import (CompletionRequest, CompletionResponse, CompletionResponseChoice,
                              CompletionStreamChoice, CompletionStreamResponse, unix_time)
from serving.routes import GENERATION_RESPONSES, encode_routed_experts, json_response
from serving.streaming import (CompletionTextChunk, EngineStreamingResponse, SSEChunks, collect_final, merge_streams,
                               usage_options)

router = APIRouter()


def _normalize_prompts(prompt: Any) -> list[str | list[int]]:
    """The request's ``prompt`` as a list of prompts (each a text or a token-id list)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


@router.post("/v1/completions", response_model=CompletionResponse, responses=GENERATION_RESPONSES)
async def create_completion(body: CompletionRequest, raw_request: Request,
                            server: OpenAIServer = Depends(get_server)) -> Response:
    server.check_request(body)
    server.check_suffix(body.suffix)
    server.check_num_logprobs(body.logprobs, "logprobs")
    server.check_prompt_logprobs(body)
    # vLLM: echo with logprobs returns the prompt's logprobs too, with as many alternatives.
    prompt_logprobs = body.prompt_logprobs if body.prompt_logprobs is not None else (
        body.logprobs if body.echo else None)
    prompts = _normalize_prompts(body.prompt)
    server.check_num_seqs(body, len(prompts))
    prompt_token_ids = await server.prompt_token_ids(prompts, body.add_special_tokens, body.truncate_prompt_tokens,
                                                     "prompt")
    aliases: dict[str, str] = {}
    requests = []
    response_id = server.response_id("cmpl", body, raw_request)
    for index, ids in enumerate(prompt_token_ids):
        max_tokens = server.resolve_max_tokens(body.max_tokens, len(ids), "max_tokens")
        params = server.generation_params(body, max_tokens=max_tokens, logprobs=body.logprobs, aliases=aliases,
                                        prompt_logprobs=prompt_logprobs)
        requests.append(EngineRequest(f"{response_id}-{index}", server.engine_prompt(ids, body), params,
                                      priority=body.priority, lora_request=server.lora_request(body.model)))
    # The echoed prompt is the text as sent, or the decoded ids of a token prompt (or of a truncated one).
    prompt_texts = [p if isinstance(p, str) and body.truncate_prompt_tokens is None
                    else await server.decode(ids, "echo")
                    for p, ids in zip(prompts, prompt_token_ids)] if body.echo else None
    streams = await server.submit(requests, body, aliases)
    num_prompt_tokens = [len(ids) for ids in prompt_token_ids]
    created = unix_time()
    if body.stream:
        return EngineStreamingResponse(
            _completion_chunks(server, body, streams, response_id, created, prompt_texts, prompt_token_ids),
            server.engine, streams)
    finals = await collect_final(server.engine, streams, raw_request)
    if finals is None:
        return Response(status_code=499)  # the client left
    choices = []
    num_completion_tokens = 0
    for prompt_index, output in enumerate(finals):
        prompt_logprobs = server.prompt_logprobs(output.prompt_logprobs)
        for completion in output.outputs:
            prefix = prompt_texts[prompt_index] if prompt_texts else ""
            logprobs = None
            if body.logprobs is not None and completion.logprobs is not None:
                token_ids, entries = completion.token_ids, completion.logprobs
                if prompt_texts:  # the echoed prompt's tokens come first, their offsets from 0 (vLLM)
                    token_ids = [*prompt_token_ids[prompt_index], *token_ids]
                    entries = [*output.prompt_logprobs, *entries]
                logprobs = server.completion_logprobs(token_ids, entries, body.logprobs,
                                                      0 if prompt_texts else len(prefix),
                                                      bool(body.return_tokens_as_token_ids))
            choices.append(CompletionResponseChoice(
                index=prompt_index * body.n + completion.index, text=prefix + completion.text, logprobs=logprobs,
                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                prompt_logprobs=prompt_logprobs, routed_experts=encode_routed_experts(completion.routed_experts)))
            num_completion_tokens += len(completion.token_ids)
    choices.sort(key=lambda choice: choice.index)
    usage = SSEChunks.usage_info(sum(num_prompt_tokens), num_completion_tokens,
                                 server.cached_tokens(output.num_cached_tokens for output in finals))
    return json_response(CompletionResponse(id=response_id, created=created,
                                            model=server.response_model_name(body.model), choices=choices,
                                            usage=usage))


async def _completion_chunks(server: OpenAIServer, body: CompletionRequest, streams: list[RequestStream],
                             response_id: str, created: int, prompt_texts: list[str] | None,
                             prompt_token_ids: list[list[int]]) -> AsyncIterator[str]:
    """The SSE chunks of a streamed completion: one chunk per choice and delta output; with ``echo`` a choice's first
    chunk starts with its prompt (and its logprobs with the prompt's, when asked), as vLLM."""
    include_usage, continuous_usage = usage_options(body.stream_options)
    model = server.response_model_name(body.model)
    chunks = SSEChunks(CompletionStreamResponse, response_id, created, model, include_usage)
    text_chunk = CompletionTextChunk(response_id, created, model, include_usage)
    as_token_ids = bool(body.return_tokens_as_token_ids)
    num_prompt_tokens = [len(ids) for ids in prompt_token_ids]
    num_tokens: dict[int, int] = {}  # per choice: completion tokens so far (continuous_usage_stats)
    num_chars_sent: dict[int, int] = {}  # per choice: characters streamed so far (logprobs' text_offset)
    prompt_logprobs: dict[int, list] = {}  # per prompt: its request's prompt logprobs (on its first output)
    num_cached_tokens: dict[int, int] = {}  # per prompt: its tokens served from the prefix cache
    async for prompt_index, output in merge_streams(streams):
        num_cached_tokens[prompt_index] = output.num_cached_tokens
        if output.prompt_logprobs is not None:
            prompt_logprobs[prompt_index] = output.prompt_logprobs
        for completion in output.outputs:
            index = prompt_index * body.n + completion.index
            text, token_ids, entries = completion.text, completion.token_ids, completion.logprobs
            if prompt_texts is not None and index not in num_chars_sent:  # the choice's first chunk: echo
                text = prompt_texts[prompt_index] + text
                if body.logprobs is not None and entries is not None:
                    token_ids = [*prompt_token_ids[prompt_index], *token_ids]
                    entries = [*prompt_logprobs[prompt_index], *entries]
            num_tokens[index] = num_tokens.get(index, 0) + len(completion.token_ids)
            char_offset = num_chars_sent.get(index, 0)
            num_chars_sent[index] = char_offset + len(text)
            if (body.logprobs is None or entries is None) and not continuous_usage:
                yield text_chunk(index, text, completion.finish_reason, completion.stop_reason)
                continue
            logprobs = None
            if body.logprobs is not None and entries is not None:
                logprobs = server.completion_logprobs(token_ids, entries, body.logprobs, char_offset, as_token_ids)
            usage = chunks.usage_info(num_prompt_tokens[prompt_index], num_tokens[index]) if continuous_usage \
                else None
            yield chunks.choice(CompletionStreamChoice(index=index, text=text, logprobs=logprobs,
                                                       finish_reason=completion.finish_reason,
                                                       stop_reason=completion.stop_reason), usage)
    if include_usage:
        yield chunks.usage(sum(num_prompt_tokens), sum(num_tokens.values()),
                           server.cached_tokens(num_cached_tokens.values()))
