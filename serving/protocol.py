"""Request and response models of the OpenAI-compatible API, in OpenAI's wire format (plus vLLM's extras).

Requests are validated by pydantic on arrival; the bounds below are OpenAI's (temperature in [0, 2], n <= 128,
logprobs <= 20, ...) so a request the schema accepts is one the engine can run. Unknown request fields are ignored,
as OpenAI's SDKs send new fields before servers know them. Responses serialize with every documented key present
(``null`` where unset), because OpenAI clients index fields such as ``logprobs`` and ``finish_reason`` directly.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

# Largest number of top alternatives per token (OpenAI's limit and paged_jax.sampling_params.MAX_LOGPROBS).
MAX_TOP_LOGPROBS = 20
# OpenAI's upper bound on n; it also bounds the work one request can ask for.
MAX_N = 128
# Seeds are handed to a 64-bit PRNG key; OpenAI documents seed as int64.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]


def random_uuid() -> str:
    return uuid.uuid4().hex


def unix_time() -> int:
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# --------------------------------------------------------------------------------------------------------- errors
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    """``{"error": {"message", "type", "param", "code"}}`` as OpenAI answers failed requests."""

    error: ErrorInfo


# ---------------------------------------------------------------------------------------------- shared pieces
class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ResponseFields(OpenAIBaseModel):
    """The fields of every generation response and stream chunk, in OpenAI's order. Each response narrows
    ``object`` and ``choices`` (pydantic keeps a redeclared field at its first position, so the order holds)."""

    id: str
    object: str
    created: int = Field(default_factory=unix_time)
    model: str
    choices: list
    usage: UsageInfo | None = None


class SamplingFields(OpenAIBaseModel):
    """Sampling fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM's extras)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


# ----------------------------------------------------------------------------------------------- completions
CompletionPrompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(SamplingFields):
    """Body of ``POST /v1/completions``. ``prompt`` is one text, a batch of texts, one token-id list, or a batch of
    token-id lists; every prompt gets ``n`` choices, numbered ``prompt_index * n + i``."""

    prompt: CompletionPrompt
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False


class CompletionLogProbs(OpenAIBaseModel):
    """Legacy completions logprobs: parallel lists over the generated tokens."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    # vLLM extra: the stop string or token id that ended the choice (None for EOS / length).
    stop_reason: int | str | None = None


class CompletionResponse(ResponseFields):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamChoice(CompletionResponseChoice):
    """A streamed choice: the same fields, ``text`` being the new text of this chunk."""


class CompletionStreamResponse(ResponseFields):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionStreamChoice]


# ------------------------------------------------------------------------------------------------------ chat
class ChatContentPartText(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatMessageParam(OpenAIBaseModel):
    """One input message. Content is a string or a list of text parts (images/audio are not supported)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatContentPartText] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    """Body of ``POST /v1/chat/completions``; the prompt is ``messages`` rendered by the tokenizer's chat template."""

    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # vLLM extra: end the prompt with the assistant turn's opening (False to continue a final assistant message).
    add_generation_prompt: bool = True


class ChatCompletionTopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionTopLogprob):
    top_logprobs: list[ChatCompletionTopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseFields):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(ResponseFields):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionStreamChoice]


# ---------------------------------------------------------------------------------------------------- models
class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=unix_time)
    owned_by: str = "paged-jax"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ----------------------------------------------------------------------------------------- tokenize (vLLM's)
class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    messages: list[ChatMessageParam] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the chat template already writes the special tokens
    return_token_strs: bool = False


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


