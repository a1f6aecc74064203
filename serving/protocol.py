"""Request and response models of the OpenAI-compatible API, in OpenAI's wire format (plus vLLM's extras).

The generation requests declare every field of OpenAI's schema and of vLLM's (``CompletionRequest`` and
``ChatCompletionRequest`` in ``vllm/entrypoints/openai/protocol.py``). Each declared field either works as in vLLM
or is refused with a 400 naming it (``serving.unsupported_fields``, the one list of refusals). A key in neither
schema is dropped and logged once per name (vLLM logs such "ignored fields"), as OpenAI's SDKs send new fields
before servers know them. Fields that are refused have loose types, so the refusal (not a type error) answers them.
Responses serialize with every documented key present (``null`` where unset), because OpenAI clients index fields
such as ``logprobs`` and ``finish_reason`` directly.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, ValidationError,
                      WrapValidator, model_validator)

logger = logging.getLogger(__name__)

# OpenAI's upper bound on n (and ours on best_of); the server's admission limits bound the work further.
MAX_N = 128
# Seeds are handed to a 64-bit PRNG key; OpenAI documents seed as int64.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1



# Request numbers and flags are typed strictly where JSON has the type (OpenAI's schema): pydantic's lax mode would
# take ``true`` as the token id 1, ``"5"`` as n = 5 and ``"yes"`` as ``stream: true``. An integral JSON number
# (``16.0``) stays a valid integer, as JSON Schema's ``integer`` has it, and an integer a valid number.
def _number(value: Any) -> Any:
    if isinstance(value, (bool, str)):
        raise ValueError(f"must be a JSON number, not {type(value).__name__} {value!r}")
    return value


Int = Annotated[int, BeforeValidator(_number)]
Float = Annotated[float, BeforeValidator(_number)]
Bool = StrictBool
# Token ids come in long lists: strict ints (no per-item Python validator); a token id is never written 5.0.
MAX_TOKEN_ID = 2**31 - 1
TokenId = Annotated[StrictInt, Field(ge=0, le=MAX_TOKEN_ID)]
Seed = Annotated[Int, Field(ge=SEED_MIN, le=SEED_MAX)]
JSONObject = dict[str, Any]


def random_uuid() -> str:
    return uuid.uuid4().hex


def unix_time() -> int:
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# (model, key) pairs already logged as ignored: each is logged once per process, not once per request.
_LOGGED_IGNORED_KEYS: set[tuple[str, str]] = set()


class RequestModel(OpenAIBaseModel):
    """A request body (or part of one): keys outside the schema are dropped and logged once per name."""

    @model_validator(mode="wrap")
    @classmethod
    def _log_ignored_keys(cls, data: Any, handler: Any) -> Any:
        result = handler(data)
        if isinstance(data, dict):
            for key in sorted(str(key) for key in data if key not in cls.model_fields):
                if (cls.__name__, key) not in _LOGGED_IGNORED_KEYS:
                    _LOGGED_IGNORED_KEYS.add((cls.__name__, key))
                    logger.warning("%s: the field %r is in neither the OpenAI nor the vLLM schema; it is ignored "
                                   "(logged once)", cls.__name__, key)
        return result


class RequestBody(RequestModel):
    """A whole request body: refused (400) when any of its strings holds a lone UTF-16 surrogate (JSON lets
    ``"\\ud800"`` through, but it is no Unicode text: it could neither be tokenized nor echoed back in a response)."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_lone_surrogates(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, value in data.items():
                if not _is_unicode(key) or not _is_unicode(value):
                    raise ValueError(f"{key if _is_unicode(key) else 'body'}: contains a lone UTF-16 surrogate (an "
                                     f"unpaired \\ud800-\\udfff escape), which is not valid Unicode text")
        return data


def _is_unicode(value: Any) -> bool:
    """No string in the JSON value ``value`` holds a surrogate code point (only strings, lists and dicts are
    visited: a long token-id list costs one cheap pass)."""
    kind = type(value)
    if kind is str:
        if value.isascii():
            return True
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if kind is list:
        return all(_is_unicode(item) for item in value if type(item) in _CONTAINERS)
    if kind is dict:
        return all(_is_unicode(key) and _is_unicode(item) for key, item in value.items())
    return True


_CONTAINERS = (str, list, dict)


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
class StreamOptions(RequestModel):
    # vLLM's defaults: ``stream_options: {}`` already asks for the usage chunk.
    include_usage: Bool | None = True
    # vLLM extra: every chunk carries the usage so far.
    continuous_usage_stats: Bool | None = False


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None  # with --enable-prompt-tokens-details


class ResponseFields(OpenAIBaseModel):
    """The fields of every generation response and stream chunk, in OpenAI's order. Each response narrows
    ``object`` and ``choices`` (pydantic keeps a redeclared field at its first position, so the order holds)."""

    id: str
    object: str
    created: int = Field(default_factory=unix_time)
    model: str
    choices: list
    usage: UsageInfo | None = None


class SamplingFields(RequestBody):
    """Fields shared by /v1/completions and /v1/chat/completions: OpenAI's, then vLLM's sampling extras, then
    vLLM's other extras. Defaults are vLLM's; ``None`` sampling values take the generation config's default."""

    model: str | None = None
    n: Int = Field(1, ge=1, le=MAX_N)
    best_of: Int | None = Field(None, ge=1, le=MAX_N)
    temperature: Float | None = Field(None, ge=0.0, le=2.0)
    top_p: Float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Float] | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM sampling extras.
    use_beam_search: Bool = False
    top_k: Int | None = Field(None, ge=-1)
    min_p: Float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Float | None = Field(None, gt=0.0, le=100.0)
    length_penalty: Float = 1.0
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: Bool = False
    ignore_eos: Bool = False
    min_tokens: Int = Field(0, ge=0)
    skip_special_tokens: Bool = True
    spaces_between_special_tokens: Bool = True
    truncate_prompt_tokens: Int | None = Field(None, ge=1)  # keep the last k prompt tokens
    allowed_token_ids: list[StrictInt] | None = None
    prompt_logprobs: Int | None = None
    bad_words: list[str] | None = None
    # vLLM extras.
    response_format: JSONObject | None = None
    structured_outputs: JSONObject | None = None
    guided_json: str | JSONObject | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    priority: Int = 0  # lower runs earlier with --scheduling-policy priority
    request_id: str | None = Field(None, min_length=1)  # the response id's suffix (default: X-Request-Id or random)
    logits_processors: list[Any] | None = None
    return_tokens_as_token_ids: Bool | None = None  # logprob tokens as "token_id:N"
    # vLLM's: prefix-cache entries are shared only among requests with the same salt (tenant isolation).
    cache_salt: str | None = Field(None, min_length=1)
    kv_transfer_params: JSONObject | None = None
    vllm_xargs: JSONObject | None = None


# ----------------------------------------------------------------------------------------------- completions
_PROMPT_FORMS = "a string, a list of strings, a list of token ids or a list of token-id lists"
_TOKEN_ID_RULE = f"a token id is an integer in [0, {MAX_TOKEN_ID}]"


def _shown(value: Any) -> str:
    """``value`` as JSON, shortened (what the client sent)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_token_id(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_TOKEN_ID


def prompt_error(prompt: Any) -> str:
    """Why ``prompt`` is none of the completions prompt forms, naming the first offending item by its index
    (pydantic would list a failure per member of the union instead)."""
    if not isinstance(prompt, list) or not prompt:
        return f"prompt: must be {_PROMPT_FORMS}, got {_shown(prompt)}"
    if isinstance(prompt[0], str):
        index = next(i for i, item in enumerate(prompt) if not isinstance(item, str))
        return f"prompt[{index}]: a batch of text prompts holds only strings, got {_shown(prompt[index])}"
    if isinstance(prompt[0], list):
        for i, ids in enumerate(prompt):
            if not isinstance(ids, list):
                return f"prompt[{i}]: a batch of token-id prompts holds only lists of token ids, got {_shown(ids)}"
            bad = next((j for j, token_id in enumerate(ids) if not _is_token_id(token_id)), None)
            if bad is not None:
                return f"prompt[{i}][{bad}]: {_TOKEN_ID_RULE}, got {_shown(ids[bad])}"
    bad = next((i for i, token_id in enumerate(prompt) if not _is_token_id(token_id)), None)
    if bad is not None:
        return f"prompt[{bad}]: {_TOKEN_ID_RULE}, got {_shown(prompt[bad])}"
    return f"prompt: must be {_PROMPT_FORMS}"


def _one_prompt_error(value: Any, handler: Any) -> Any:
    try:
        return handler(value)
    except ValidationError:
        raise ValueError(prompt_error(value)) from None


# Checked as a whole: a prompt that fits no form is one error naming the offending item (checked only on failure,
# so a long token-id list costs no per-item Python call).
CompletionPrompt = Annotated[str | list[str] | list[TokenId] | list[list[TokenId]], WrapValidator(_one_prompt_error)]


class CompletionRequest(SamplingFields):
    """Body of ``POST /v1/completions``. ``prompt`` is one text, a batch of texts, one token-id list, or a batch of
    token-id lists; every prompt gets ``n`` choices, numbered ``prompt_index * n + i``."""

    prompt: CompletionPrompt
    prompt_embeds: Any = None
    suffix: str | None = None
    max_tokens: Int | None = Field(16, ge=1)
    logprobs: Int | None = Field(None, ge=0)  # at most the server's --max-logprobs
    echo: Bool = False  # prefix each choice's text with its prompt
    add_special_tokens: Bool = True


class CompletionLogProbs(OpenAIBaseModel):
    """Legacy completions logprobs: parallel lists over the generated tokens."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    """vLLM's ``Logprob`` as its responses show it in ``prompt_logprobs`` (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM extra: per prompt token, null (the first) or {token id: PromptLogprob} for the token and the top alternatives.
PromptLogprobsField = list[dict[int, PromptLogprob] | None] | None


class CompletionStreamChoice(OpenAIBaseModel):
    """A streamed choice, ``text`` being the new text of this chunk."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    # vLLM extra: the stop string or token id that ended the choice (None for EOS / length).
    stop_reason: int | str | None = None


class CompletionResponseChoice(CompletionStreamChoice):
    """A choice of a whole response: the streamed fields, plus the prompt's logprobs when asked for
    (``prompt_logprobs``, or ``echo`` with ``logprobs``)."""

    prompt_logprobs: PromptLogprobsField = None
    # vLLM's: with --enable-return-routed-experts, the base64 of the .npy bytes of the choice's
    # CompletionOutput.routed_experts ([prompt + completion tokens - 1, sparse layers, top_k]).
    routed_experts: str | None = None


class CompletionResponse(ResponseFields):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(ResponseFields):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionStreamChoice]


# ------------------------------------------------------------------------------------------------------ chat
def _text_parts_only(content: Any) -> Any:
    """A message's content as given, or a ValueError naming the first part that is not text (images, audio)."""
    kinds = [part.get("type") for part in content if isinstance(part, dict)] if isinstance(content, list) else []
    if any(kind not in (None, "text") for kind in kinds):
        raise ValueError(f"content part type {next(k for k in kinds if k not in (None, 'text'))!r} is not supported: "
                         "the model takes text inputs only (no images or audio)")
    return content


class ChatContentPartText(RequestModel):
    type: Literal["text"]
    text: str


class ChatFunctionCall(RequestModel):
    name: str
    arguments: str | JSONObject  # OpenAI sends a JSON string; the chat template receives it parsed


class ChatToolCall(RequestModel):
    id: str
    type: Literal["function"] = "function"
    function: ChatFunctionCall


class ChatMessageParam(RequestModel):
    """One input message. Content is a string or a list of text parts (images/audio are not supported). An
    assistant message may carry ``tool_calls`` and its ``reasoning`` (vLLM's), a ``tool`` message its
    ``tool_call_id``: they reach the chat template."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[ChatContentPartText] | None, BeforeValidator(_text_parts_only)] = None
    name: str | None = None
    tool_calls: list[ChatToolCall] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None


class ChatCompletionRequest(SamplingFields):
    """Body of ``POST /v1/chat/completions``; the prompt is ``messages`` rendered by the chat template."""

    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1)  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: Bool | None = False
    top_logprobs: Int | None = Field(None, ge=0)  # at most the server's --max-logprobs
    tools: list[JSONObject] | None = None
    tool_choice: str | JSONObject | None = None
    parallel_tool_calls: Bool | None = None
    functions: list[JSONObject] | None = None  # OpenAI's deprecated form of tools
    function_call: str | JSONObject | None = None
    reasoning_effort: str | None = None
    include_reasoning: Bool = True
    # OpenAI fields vLLM does not declare.
    audio: JSONObject | None = None
    modalities: list[str] | None = None
    prediction: JSONObject | None = None
    web_search_options: JSONObject | None = None
    verbosity: str | None = None
    store: Bool | None = None
    service_tier: str | None = None
    metadata: dict[str, str] | None = None  # only kept with stored completions (store is refused)
    prompt_cache_key: str | None = None  # a routing hint: the one prefix cache serves every request
    safety_identifier: str | None = None  # like user: identifies the end user, nothing to do
    # vLLM extras.
    echo: Bool = False  # prefix the reply with the last message's content when it has the reply's role
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False  # the reply continues the final (assistant) message
    add_special_tokens: Bool = False  # the chat template already writes the special tokens
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: JSONObject | None = None
    mm_processor_kwargs: JSONObject | None = None
    structural_tag: str | None = None


class ChatCompletionTopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionTopLogprob):
    top_logprobs: list[ChatCompletionTopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-tool-{random_uuid()}")
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    """A streamed piece of tool call ``index``: its first piece carries ``id``, ``type`` and the function's name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning_content: str | None = None  # vLLM extra, with --reasoning-parser


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    routed_experts: str | None = None  # as CompletionResponseChoice's


class ChatCompletionResponse(ResponseFields):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsField = None  # vLLM extra, with the request's prompt_logprobs


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


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


class VersionResponse(OpenAIBaseModel):
    """``GET /version``: the installed paged-jax package's version."""

    version: str


# --------------------------------------------------------------------------- LoRA adapters at run time (vLLM's)
class LoadLoRAAdapterRequest(RequestModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace the adapter of that name if it is loaded


class UpdateWeightsFromDiskRequest(RequestModel):
    """``POST /update_weights_from_disk`` (SGLang's name and field): an HF safetensors or orbax checkpoint directory."""

    model_path: str


class InitWeightTransferRequest(RequestModel):
    """``POST /init_weight_transfer_engine`` (vLLM's): the backend's init info; backend "jax":
    ``{"trainer_process": <the trainer's jax.process_index()>}``."""

    init_info: dict[str, Any]


class WeightTransferUpdateInfo(RequestModel):
    """vLLM's update info: each parameter's name, dtype name and shape, in the order the trainer sends them."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class UpdateWeightsRequest(RequestModel):
    """``POST /update_weights`` (vLLM's): receive the trainer's weights (``update_weights_from_distributed``)."""

    update_info: WeightTransferUpdateInfo


class UpdateWeightsResponse(OpenAIBaseModel):
    success: bool
    message: str


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: str
    lora_int_id: int | None = None


# ----------------------------------------------------------------------------------------- tokenize (vLLM's)
class TokenizeCompletionRequest(RequestBody):
    model: str | None = None
    prompt: str
    add_special_tokens: Bool = True
    return_token_strs: Bool = False


class TokenizeChatRequest(RequestBody):
    model: str | None = None
    messages: list[ChatMessageParam] = Field(min_length=1)
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    add_special_tokens: Bool = False  # the chat template already writes the special tokens
    return_token_strs: Bool = False
    chat_template: str | None = None
    chat_template_kwargs: JSONObject | None = None
    tools: list[JSONObject] | None = None
    mm_processor_kwargs: JSONObject | None = None


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


