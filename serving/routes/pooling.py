"""The pooling endpoints of a model served by the pooling runner (``paged_jax.pooling``): ``POST /v1/embeddings``
(OpenAI's), ``POST /classify``, ``POST /v1/score`` / ``/score`` and ``POST /v1/rerank`` / ``/rerank`` /
``/v2/rerank`` (vLLM's; the rerank body and answer are Jina's and Cohere's).

Each prompt is one pooling request; a request's prompts are admitted as a group and answered together. A generative
model answers these with a 400 naming ``model``, as a pooling model answers the generation endpoints
(``OpenAIServer.check_request``).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from paged_jax.pooling.params import PoolingParams
from paged_jax.pooling.scoring import check_cross_encoder, cosine_similarity, distinct_texts, pair_inputs
from serving.async_engine import EngineRequest
from serving.errors import APIError
from serving.openai_server import OpenAIServer, get_server
from serving.pooling_protocol import (ClassificationData, ClassificationRequest, ClassificationResponse, EmbeddingData,
                                      EmbeddingRequest, EmbeddingResponse, PoolingFields, RerankDocument,
                                      RerankRequest, RerankResponse, RerankResult, RerankUsage, ScoreData,
                                      ScoreRequest, ScoreResponse)
from serving.protocol import UsageInfo, random_uuid, unix_time
from serving.routes import GENERATION_RESPONSES, json_response
from serving.streaming import collect_final

router = APIRouter()
_RESPONSES = {key: value for key, value in GENERATION_RESPONSES.items() if key != 200}


def _pooler(server: OpenAIServer, body: PoolingFields, endpoint: str):
    server.check_model(body.model)
    pooler = server.info.pooler
    if pooler is None:
        raise APIError(400, f"model: {server.info.served_model_name} is a generative model; {endpoint} needs a "
                            "pooling model (serve it with --runner pooling)", param="model")
    if body.priority != 0 and server.scheduling_policy != "priority":
        raise APIError(400, f"priority: got priority {body.priority} but priority scheduling is not enabled "
                            "(serve with --scheduling-policy priority)", param="priority")
    return pooler


def _input_prompts(value: Any, param: str) -> list[str | list[int]]:
    """A request's ``input`` as a list of prompts (texts or token-id lists)."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise APIError(400, f"{param} must not be empty", param=param)
    return [list(value)] if isinstance(value[0], int) else list(value)


def _check_num_inputs(server: OpenAIServer, num_inputs: int, param: str) -> None:
    """Each input is one engine request: at most as many as one request may run (``--max-seqs-per-request``) and the
    waiting queue holds."""
    for limit, flag in ((server.max_seqs_per_request, "--max-seqs-per-request"),
                        (server.engine.max_waiting_requests, "--max-waiting-requests")):
        if limit is not None and num_inputs > limit:
            raise APIError(400, f"{param}: this request has {num_inputs} inputs, more than the {limit} one request "
                                f"may run ({flag}); send fewer", param=param)


async def _pool(server: OpenAIServer, body: PoolingFields, raw_request: Request, prefix: str,
                prompt_token_ids: list[list[int]], params: PoolingParams) -> list | None:
    """Run each prompt as one pooling request -> their ``PoolingRequestOutput``s in order (None: the client left)."""
    base = raw_request.headers.get("X-Request-Id") or body.request_id or random_uuid()
    requests = [EngineRequest(f"{prefix}-{base}-{index}", ids, params, priority=body.priority)
                for index, ids in enumerate(prompt_token_ids)]
    streams = await server.submit(requests, body, {})
    return await collect_final(server.engine, streams, raw_request)


def _usage(prompt_token_ids: list[list[int]]) -> UsageInfo:
    num_tokens = sum(len(ids) for ids in prompt_token_ids)
    return UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens)


@router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_RESPONSES)
async def create_embedding(body: EmbeddingRequest, raw_request: Request,
                           server: OpenAIServer = Depends(get_server)) -> Response:
    pooler = _pooler(server, body, "/v1/embeddings")
    if pooler.task != "embed":
        raise APIError(400, f"model: {server.info.served_model_name} is a {pooler.task} model, not an embedding "
                            "model", param="model")
    prompts = _input_prompts(body.input, "input")
    _check_num_inputs(server, len(prompts), "input")
    # The prompts are truncated here (truncate_prompt_tokens), before their length is checked.
    params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize, task="embed")
    ids = await server.prompt_token_ids(prompts, body.add_special_tokens, body.truncate_prompt_tokens,
                                        "input")
    outputs = await _pool(server, body, raw_request, "embd", ids, params)
    if outputs is None:
        return Response(status_code=499)  # the client left
    data = [EmbeddingData(index=i, embedding=_encode_embedding(out.outputs.data, body.encoding_format))
            for i, out in enumerate(outputs)]
    return json_response(EmbeddingResponse(id=f"embd-{random_uuid()}", created=unix_time(),
                                           model=server.response_model_name(body.model), data=data,
                                           usage=_usage(ids)))


def _encode_embedding(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """``float``: the values; ``base64``: their little-endian float32 bytes (OpenAI's, which its SDKs decode)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return np.asarray(vector, np.float32).tolist()


@router.post("/classify", response_model=ClassificationResponse, responses=_RESPONSES)
async def create_classification(body: ClassificationRequest, raw_request: Request,
                                server: OpenAIServer = Depends(get_server)) -> Response:
    pooler = _pooler(server, body, "/classify")
    if pooler.task != "classify":
        raise APIError(400, f"model: {server.info.served_model_name} is an embedding model, not a classifier",
                       param="model")
    prompts = _input_prompts(body.input, "input")
    _check_num_inputs(server, len(prompts), "input")
    ids = await server.prompt_token_ids(prompts, body.add_special_tokens, body.truncate_prompt_tokens,
                                        "input")
    params = PoolingParams(activation=body.activation, task="classify")
    outputs = await _pool(server, body, raw_request, "classify", ids, params)
    if outputs is None:
        return Response(status_code=499)
    data = []
    for index, out in enumerate(outputs):
        probs = np.asarray(out.outputs.data, np.float32)
        label = pooler.labels[int(probs.argmax())] if pooler.labels else None
        data.append(ClassificationData(index=index, label=label, probs=probs.tolist(), num_classes=len(probs)))
    return json_response(ClassificationResponse(id=f"classify-{random_uuid()}", created=unix_time(),
                                                model=server.response_model_name(body.model), data=data,
                                                usage=_usage(ids)))


async def _pair_scores(server: OpenAIServer, body: PoolingFields, raw_request: Request, first: Any, second: Any,
                       fields: tuple[str, str], prefix: str) -> tuple[list[float], list[list[int]]] | None:
    """Scores of the pairs of ``first`` x ``second`` (1:N or N:N): a cross-encoder's over each pair's encoding, or
    an embedder's cosine similarity -> (scores, the prompts run); None when the client left."""
    pooler = _pooler(server, body, f"/{prefix}")
    try:
        check_cross_encoder(pooler)
        pairs = pair_inputs(first, second, fields)
    except ValueError as exc:  # the message starts with the field: model, or one of ``fields``
        raise APIError(400, str(exc), param=str(exc).split(":")[0].split()[0]) from exc
    texts, pair_indices = distinct_texts(pairs)  # an embedder embeds each distinct text once
    _check_num_inputs(server, len(pairs) if pooler.task == "classify" else len(texts), fields[1])
    params = PoolingParams(task="score" if pooler.task == "classify" else "embed")
    if pooler.task == "classify":
        ids = [server.truncate(await server.encode_pair(a, b, fields[0]), body.truncate_prompt_tokens)
               for a, b in pairs]
        for pair_ids in ids:
            server.check_prompt_length(len(pair_ids), fields[0])
        outputs = await _pool(server, body, raw_request, prefix, ids, params)
        return None if outputs is None else ([float(out.outputs.data[0]) for out in outputs], ids)
    ids = await server.prompt_token_ids(texts, body.add_special_tokens, body.truncate_prompt_tokens,
                                        fields[0])
    outputs = await _pool(server, body, raw_request, prefix, ids, params)
    if outputs is None:
        return None
    return [cosine_similarity(outputs[i].outputs.data, outputs[j].outputs.data) for i, j in pair_indices], ids


@router.post("/v1/score", response_model=ScoreResponse, responses=_RESPONSES)
@router.post("/score", response_model=ScoreResponse, responses=_RESPONSES, include_in_schema=False)
async def create_score(body: ScoreRequest, raw_request: Request,
                       server: OpenAIServer = Depends(get_server)) -> Response:
    scored = await _pair_scores(server, body, raw_request, body.text_1, body.text_2, ("text_1", "text_2"), "score")
    if scored is None:
        return Response(status_code=499)
    scores, ids = scored
    return json_response(ScoreResponse(id=f"score-{random_uuid()}", created=unix_time(),
                                       model=server.response_model_name(body.model),
                                       data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                                       usage=_usage(ids)))


@router.post("/v1/rerank", response_model=RerankResponse, responses=_RESPONSES)
@router.post("/rerank", response_model=RerankResponse, responses=_RESPONSES, include_in_schema=False)
@router.post("/v2/rerank", response_model=RerankResponse, responses=_RESPONSES, include_in_schema=False)
async def create_rerank(body: RerankRequest, raw_request: Request,
                        server: OpenAIServer = Depends(get_server)) -> Response:
    if not body.documents:
        raise APIError(400, "documents must not be empty", param="documents")
    scored = await _pair_scores(server, body, raw_request, body.query, body.documents, ("query", "documents"),
                                "rerank")
    if scored is None:
        return Response(status_code=499)
    scores, ids = scored
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    top = order[:body.top_n] if body.top_n else order
    results = [RerankResult(index=i, document=RerankDocument(text=body.documents[i]), relevance_score=scores[i])
               for i in top]
    return json_response(RerankResponse(id=f"rerank-{random_uuid()}", model=server.response_model_name(body.model),
                                        usage=RerankUsage(total_tokens=sum(len(x) for x in ids)), results=results))
