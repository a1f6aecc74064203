"""Request, response and stream-event models of the Responses API (``POST /v1/responses``), in OpenAI's wire format
with vLLM's extras (``vllm/entrypoints/openai/responses/protocol.py``).

``input`` is a string (one user message) or a list of items: messages (``role`` user / system / developer /
assistant, ``content`` a string or ``input_text`` / ``output_text`` parts), ``function_call``,
``function_call_output`` and ``reasoning`` items; any other item type, content part or tool type is refused with a
400 naming it (``input[i]...``, ``tools[i]``). ``tools`` are function tools. Fields the server does not serve are
listed in ``serving.unsupported_fields.RESPONSES_REFUSED_FIELDS`` (refused when they ask for something).

The response side (``ResponsesResponse``, its output items and the stream events) is written as OpenAI's SDK parses
it: every documented key present, ``null`` where unset.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BeforeValidator, Discriminator, Field, Tag

from serving.protocol import (Bool, Float, Int, JSONObject, OpenAIBaseModel, RequestBody, RequestModel, Seed,
                              unix_time)

# The input item types served, and the message content part types.
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
CONTENT_PART_TYPES = ("input_text", "output_text")


# ----------------------------------------------------------------------------------------------- input items
class ContentPart(RequestModel):
    """A message's text part: ``input_text`` (user, system, developer) or ``output_text`` (an assistant's, e.g. a
    previous response's output passed back)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(RequestModel):
    """A message; an assistant message whose ``status`` is ``in_progress`` or ``incomplete`` and that ends the
    input is continued by the reply (vLLM's partial-message completion)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class FunctionCallItem(RequestModel):
    """A call the model made (a previous response's ``function_call`` output item)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(RequestModel):
    """The result of the call ``call_id``, as text."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(part.text for part in self.output)


class ReasoningText(RequestModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(RequestModel):
    """The model's reasoning (a previous response's ``reasoning`` output item): its content, else its summary."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None

    def text(self) -> str:
        parts = self.content or self.summary
        return "\n".join(part.text for part in parts)


def _item_type(item: Any) -> str | None:
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", None)


def _check_input(value: Any) -> Any:
    """Name the first unsupported item type or content part (pydantic would list a failure per union member)."""
    if not isinstance(value, list):
        return value
    for index, item in enumerate(value):
        kind = _item_type(item)
        if kind not in INPUT_ITEM_TYPES:
            raise ValueError(f"input[{index}]: item type {kind!r} is not supported (supported: "
                             f"{', '.join(INPUT_ITEM_TYPES)})")
        content = item.get("content") if isinstance(item, dict) and kind == "message" else None
        for part_index, part in enumerate(content if isinstance(content, list) else ()):
            part_type = part.get("type") if isinstance(part, dict) else None
            if part_type not in CONTENT_PART_TYPES:
                raise ValueError(f"input[{index}].content[{part_index}]: content type {part_type!r} is not supported "
                                 f"(the served models read text: {', '.join(CONTENT_PART_TYPES)})")
        if kind == "reasoning" and isinstance(item, dict) and item.get("encrypted_content") is not None:
            raise ValueError(f"input[{index}].encrypted_content: encrypted reasoning is not supported")
    return value


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]], Discriminator(_item_type)]
ResponsesInput = Annotated[str | list[InputItem], BeforeValidator(_check_input)]


# ------------------------------------------------------------------------------------------------------ tools
class FunctionTool(RequestModel):
    """A function the model may call (the Responses API's flat form of a chat tool)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: JSONObject | None = None
    strict: Bool | None = None


def _check_tools(value: Any) -> Any:
    for index, tool in enumerate(value if isinstance(value, list) else ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ValueError(f"tools[{index}]: tool type {kind!r} is not supported: only function tools "
                             f"({{\"type\": \"function\", \"name\": ..., \"parameters\": {{...}}}})")
    return value


# ---------------------------------------------------------------------------------------------------- request
class ResponsesRequest(RequestBody):
    """Body of ``POST /v1/responses``: OpenAI's fields, then vLLM's extras (defaults are vLLM's)."""

    model: str | None = None
    input: ResponsesInput
    instructions: str | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: Float | None = Field(None, ge=0.0, le=2.0)
    top_p: Float | None = Field(None, gt=0.0, le=1.0)
    tools: Annotated[list[FunctionTool] | None, BeforeValidator(_check_tools)] = None
    tool_choice: str | JSONObject | None = None
    parallel_tool_calls: Bool | None = None
    previous_response_id: str | None = None
    store: Bool = True
    background: Bool = False
    stream: Bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: JSONObject | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # a routing hint: the one prefix cache serves every request
    safety_identifier: str | None = None  # like user: identifies the end user, nothing to do
    # Fields this server refuses when they ask for something (serving.unsupported_fields).
    include: list[str] | None = None
    top_logprobs: Int | None = Field(None, ge=0)
    truncation: str | None = None
    max_tool_calls: Int | None = None
    prompt: Any = None
    reasoning: JSONObject | None = None
    conversation: Any = None
    stream_options: JSONObject | None = None
    # vLLM extras.
    request_id: str | None = Field(None, min_length=1)  # the response id's suffix (default: X-Request-Id or random)
    priority: Int = 0
    cache_salt: str | None = Field(None, min_length=1)
    top_k: Int | None = Field(None, ge=-1)
    repetition_penalty: Float | None = Field(None, gt=0.0, le=100.0)
    seed: Seed | None = None
    stop: str | list[str] | None = None
    ignore_eos: Bool = False
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    logit_bias: dict[str, Float] | None = None
    structured_outputs: JSONObject | None = None
    enable_response_messages: Bool = False
    previous_input_messages: list[Any] | None = None
    previous_response: JSONObject | None = None
    mm_processor_kwargs: JSONObject | None = None
    vllm_xargs: JSONObject | None = None


# ------------------------------------------------------------------------------------------------ output items
class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningContent(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputMessage(OpenAIBaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: str
    content: list[OutputText]


class OutputFunctionCall(OpenAIBaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: str


class OutputReasoning(OpenAIBaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningContent] = Field(default_factory=list)
    encrypted_content: str | None = None
    status: str


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


# --------------------------------------------------------------------------------------------------- response
class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(OpenAIBaseModel):
    code: str
    message: str


class IncompleteDetails(OpenAIBaseModel):
    reason: str  # "max_output_tokens"


ResponseStatus = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]


class ResponsesResponse(OpenAIBaseModel):
    """A response object (``POST /v1/responses``, ``GET /v1/responses/{id}``, the lifecycle events)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=unix_time)
    status: ResponseStatus
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: JSONObject | None = None
    tool_choice: str | JSONObject = "auto"
    tools: list[JSONObject] = Field(default_factory=list)
    truncation: str = "disabled"
    background: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    service_tier: str = "auto"
    user: str | None = None
    usage: ResponseUsage | None = None


# ----------------------------------------------------------------------------------------------- stream events
class ResponseEvent(OpenAIBaseModel):
    sequence_number: int


class LifecycleEvent(ResponseEvent):
    type: Literal["response.created", "response.in_progress", "response.completed"]
    response: ResponsesResponse


class OutputItemEvent(ResponseEvent):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(ResponseEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningContent


class OutputTextDeltaEvent(ResponseEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class OutputTextDoneEvent(ResponseEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningTextDeltaEvent(ResponseEvent):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDoneEvent(ResponseEvent):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDeltaEvent(ResponseEvent):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDoneEvent(ResponseEvent):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str
