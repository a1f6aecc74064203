"""Request and response models of the pooling endpoints (``serving.routes.pooling``), in OpenAI's embeddings wire
format and vLLM's score / rerank (Jina / Cohere compatible) / classify formats (``vllm/entrypoints/openai/protocol.py``:
``EmbeddingCompletionRequest``, ``ScoreRequest``, ``RerankRequest``, ``ClassificationRequest``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from serving.protocol import Bool, Int, OpenAIBaseModel, RequestModel, TokenId, UsageInfo

# A text, a list of texts, one token-id prompt or a list of token-id prompts (OpenAI's embeddings ``input``).
PoolingInput = str | list[str] | list[TokenId] | list[list[TokenId]]


class PoolingFields(RequestModel):
    """The fields every pooling request has (vLLM's names)."""

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[Int, Field(ge=1)] | None = None
    add_special_tokens: Bool = True
    priority: Int = 0
    request_id: str | None = None


class EmbeddingRequest(PoolingFields):
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[Int, Field(ge=1)] | None = None
    normalize: Bool | None = None


class EmbeddingData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


class ClassificationRequest(PoolingFields):
    input: PoolingInput
    activation: Bool | None = None


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


class ScoreRequest(PoolingFields):
    text_1: str | list[str]
    text_2: str | list[str]


class ScoreData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankRequest(PoolingFields):
    query: str
    documents: list[str]
    top_n: Annotated[Int, Field(ge=0)] = 0  # 0: every document


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
