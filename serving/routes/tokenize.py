"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's), with the server's own tokenizer copy."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from serving.openai_server import OpenAIServer, get_server
from serving.protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest, TokenizeRequest,
                              TokenizeResponse)
from serving.request_limits import check_field_sizes
from serving.routes import ERROR_RESPONSES, json_response
from serving.unsupported_fields import refuse_unsupported

router = APIRouter()


@router.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, server: OpenAIServer = Depends(get_server)) -> Response:
    server.check_model(body.model)
    if isinstance(body, TokenizeChatRequest):
        refuse_unsupported(body)
        check_field_sizes(body, server.max_prompt_chars)
        text = await server.render_chat(body.messages, body)
        token_ids = await server.encode(text, body.add_special_tokens, "messages")
    else:
        token_ids = await server.encode(body.prompt, body.add_special_tokens, "prompt")
    token_strs = server.tokenizer.convert_ids_to_tokens(token_ids) if body.return_token_strs else None
    return json_response(TokenizeResponse(count=len(token_ids), max_model_len=server.info.max_model_len,
                                          tokens=token_ids, token_strs=token_strs))


@router.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, server: OpenAIServer = Depends(get_server)) -> Response:
    server.check_model(body.model)
    server.check_token_ids(body.tokens, "tokens")
    return json_response(DetokenizeResponse(prompt=await server.decode(body.tokens, "tokens")))
