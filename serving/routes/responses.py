"""The Responses API as vLLM serves it: ``POST /v1/responses`` (JSON, SSE events with ``stream: true``, or a
background response with ``background: true``), ``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``.

A Responses request is served as the chat request it translates into (``serving.responses_input``, then
``serving.chat_request``: the chat template, the tool and reasoning parsers, the sampling parameters); its reply
becomes output items (``serving.responses_output``). With ``store`` (the default) the response is kept in the app's
``ResponseStore`` (``serving.responses_store``), where ``previous_response_id`` continues its conversation and
``GET`` finds it. ``cancel`` stops a background response that is queued or in progress (as vLLM; a synchronous one
is refused). A background response created with ``stream: true`` keeps its events: the POST streams them as they
come, and ``GET ...?stream=true&starting_after=N`` replays them from any sequence number (vLLM's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from serving.chat_request import ChatSubmission, choice_output, submit_chat
from serving.errors import APIError
from serving.openai_server import OpenAIServer, get_server
from serving.protocol import ChatCompletionRequest, unix_time
from serving.responses_input import chat_request, conversation, output_history, responses_error
from serving.responses_output import OutputBuilder
from serving.responses_protocol import (IncompleteDetails, InputTokensDetails, LifecycleEvent, OutputTokensDetails,
                                        ResponseError, ResponseEvent, ResponsesRequest, ResponsesResponse,
                                        ResponseUsage)
from serving.responses_store import ResponseStore, StoredResponse
from serving.routes import GENERATION_RESPONSES, error_responses, json_response
from serving.streaming import EngineStreamingResponse, abort_unfinished, collect_final
from serving.unsupported_fields import OUTPUT_LOGPROBS, RESPONSES_REFUSED_FIELDS, refuse_unsupported

logger = logging.getLogger(__name__)
router = APIRouter()


def get_store(request: Request) -> ResponseStore:
    """The app's ``ResponseStore`` (a FastAPI dependency)."""
    return request.app.state.response_store


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param=param)


class ResponseRun:
    """One admitted Responses request: its reply read into output items, the response object at each stage, and
    storing the finished response (``store``)."""

    def __init__(self, server: OpenAIServer, store: ResponseStore, body: ResponsesRequest,
                 chat_body: ChatCompletionRequest, submission: ChatSubmission, response_id: str,
                 messages: list[dict]) -> None:
        self.server, self.store, self.body, self.submission = server, store, body, submission
        self.response_id = response_id
        self.messages = messages
        self.created_at = unix_time()
        self.builder = OutputBuilder()
        self.choice = choice_output(server, chat_body, submission)

    def response(self, status: str, usage: ResponseUsage | None = None,
                 error: ResponseError | None = None) -> ResponsesResponse:
        """The response object as it stands (the output items finished so far)."""
        body, params = self.body, self.submission.params
        return ResponsesResponse(
            id=self.response_id, created_at=self.created_at, status=status, error=error,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=body.instructions, max_output_tokens=params.max_tokens,
            model=self.server.response_model_name(body.model), output=list(self.builder.items),
            parallel_tool_calls=body.parallel_tool_calls is not False, previous_response_id=body.previous_response_id,
            temperature=params.temperature, top_p=params.top_p, text=body.text or {"format": {"type": "text"}},
            tool_choice=body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none"),
            tools=[tool.model_dump(exclude_none=True) for tool in body.tools or ()], background=body.background,
            store=body.store, metadata=body.metadata, service_tier=body.service_tier or "auto", user=body.user,
            usage=usage)

    async def finish(self, finish_reason: str | None, num_output_tokens: int, num_cached_tokens: int
                     ) -> tuple[list[ResponseEvent], ResponsesResponse]:
        """The events that close the reply's last item, and the finished response (stored with ``store``, unless it
        was cancelled meanwhile)."""
        status = {"length": "incomplete", "abort": "cancelled"}.get(finish_reason or "", "completed")
        events = self.builder.close("incomplete" if status == "incomplete" else "completed")
        reasoning, _ = self.builder.text
        num_reasoning = len(await self.server.encode(reasoning, False, "input", truncating=True)) if reasoning else 0
        num_input = self.submission.num_prompt_tokens
        usage = ResponseUsage(input_tokens=num_input, output_tokens=num_output_tokens,
                              total_tokens=num_input + num_output_tokens,
                              input_tokens_details=InputTokensDetails(cached_tokens=num_cached_tokens),
                              output_tokens_details=OutputTokensDetails(reasoning_tokens=num_reasoning))
        response = self.response(status, usage)
        stored = self.store.get(self.response_id)
        if self.body.store and not (stored is not None and stored.response.status == "cancelled"):
            stored = stored or StoredResponse(response, [])
            stored.response = response
            stored.history = conversation(self.messages, output_history(response.output))
            self.store.put(stored)
        return events, response

    def _logprobs(self, completion) -> list[dict] | None:
        """The logprob entries of ``completion``'s tokens (``include``), as output_text carries them."""
        if self.submission.num_top is None or completion.logprobs is None:
            return None
        content = self.server.chat_logprobs(completion.token_ids, completion.logprobs, self.submission.num_top)
        return [entry.model_dump() for entry in content.content]

    async def whole(self, final) -> ResponsesResponse:
        """The response of a finished ``RequestOutput`` (the reply fed in one delta)."""
        (completion,) = final.outputs
        self.builder.feed(self.choice.feed(completion.text, final=True, token_ids=completion.token_ids),
                          self._logprobs(completion))
        _, response = await self.finish(completion.finish_reason, len(completion.token_ids), final.num_cached_tokens)
        return response

    async def events(self) -> AsyncIterator[ResponseEvent]:
        """The stream's events: ``response.created``, ``response.in_progress``, the items', ``response.completed``."""
        builder = self.builder
        yield builder.event(LifecycleEvent, type="response.created", response=self.response("in_progress"))
        yield builder.event(LifecycleEvent, type="response.in_progress", response=self.response("in_progress"))
        num_tokens, num_cached, finish_reason = 0, 0, None
        async for output in self.submission.streams[0]:
            num_cached = output.num_cached_tokens
            for completion in output.outputs:
                num_tokens += len(completion.token_ids)
                finish_reason = completion.finish_reason
                delta = self.choice.feed(completion.text, final=finish_reason is not None,
                                         token_ids=completion.token_ids)
                for event in builder.feed(delta, self._logprobs(completion)):
                    yield event
        events, response = await self.finish(finish_reason, num_tokens, num_cached)
        for event in events:
            yield event
        yield builder.event(LifecycleEvent, type="response.completed", response=response)

    async def sse(self) -> AsyncIterator[str]:
        async for event in self.events():
            yield _sse(event)

    async def background(self, entry: StoredResponse) -> None:
        """Generate a background response, keeping ``entry`` (stored) up to date (and its events, when streamed);
        its engine request is aborted however this ends (``cancel`` cancels the task)."""
        try:
            async for event in self.events():
                if event.type == "response.in_progress":
                    entry.response = event.response
                if entry.events is not None:
                    entry.events.append(event)
                    entry.changed.set()
        except Exception as exc:  # noqa: BLE001 - the engine failed: the stored response says so
            logger.exception("background response %s failed", self.response_id)
            entry.response = self.response("failed", error=ResponseError(code="server_error", message=str(exc)))
        finally:
            abort_unfinished(self.server.engine, self.submission.streams)
            entry.changed.set()


def _sse(event: ResponseEvent) -> str:
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"


async def _replay(entry: StoredResponse, starting_after: int | None) -> AsyncIterator[str]:
    """A streamed background response's events after ``starting_after`` (a sequence number), then the rest as they
    come, until its generation ends (``response.completed``, or cancelled or failed)."""
    index = 0 if starting_after is None else starting_after + 1
    while True:
        entry.changed.clear()
        while index < len(entry.events):
            yield _sse(entry.events[index])
            index += 1
        if not entry.running:
            return
        await entry.changed.wait()


def _check_request(body: ResponsesRequest, store: ResponseStore) -> list[dict]:
    """The Responses-only checks; the stored conversation ``previous_response_id`` continues ([] if none)."""
    refuse_unsupported(body, refused=RESPONSES_REFUSED_FIELDS)
    if body.top_logprobs and OUTPUT_LOGPROBS not in (body.include or ()):
        raise APIError(400, f"top_logprobs: requires include [{OUTPUT_LOGPROBS!r}]", param="top_logprobs")
    if body.background and not body.store:
        raise APIError(400, "background: a background response must be stored (store: true)", param="background")
    if body.previous_response_id is None:
        return []
    previous = store.get(body.previous_response_id)
    if previous is None:
        raise _not_found(body.previous_response_id, "previous_response_id")
    if previous.response.status not in ("completed", "incomplete"):
        raise APIError(400, f"previous_response_id: response '{body.previous_response_id}' is "
                            f"{previous.response.status}; only a finished response can be continued",
                       param="previous_response_id")
    return previous.history


@router.post("/v1/responses", response_model=ResponsesResponse, responses=GENERATION_RESPONSES)
async def create_response(body: ResponsesRequest, raw_request: Request, server: OpenAIServer = Depends(get_server),
                          store: ResponseStore = Depends(get_store)) -> Response:
    messages = conversation(_check_request(body, store), body.input)
    try:
        server.check_model(body.model)
        chat_body = chat_request(body, messages)
        response_id = server.response_id("resp", body, raw_request, separator="_")
        submission = await submit_chat(server, chat_body, response_id)
    except APIError as exc:
        raise responses_error(exc) from exc
    run = ResponseRun(server, store, body, chat_body, submission, response_id, messages)
    if body.background:
        entry = StoredResponse(run.response("queued"), history=[], events=[] if body.stream else None)
        store.put(entry)
        entry.task = asyncio.get_running_loop().create_task(run.background(entry))
        if body.stream:  # the events as the task makes them; a client that leaves does not stop it
            return StreamingResponse(_replay(entry, None), media_type="text/event-stream")
        return json_response(entry.response)
    if body.stream:
        return EngineStreamingResponse(run.sse(), server.engine, submission.streams, done_marker=False)
    finals = await collect_final(server.engine, submission.streams, raw_request)
    if finals is None:
        return Response(status_code=499)  # the client left
    return json_response(await run.whole(finals[0]))


@router.get("/v1/responses/{response_id}", response_model=ResponsesResponse, responses={
    **error_responses(400, 401, 404),
    200: {"description": "The stored response (JSON), or with stream=true a streamed background response's events",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}}})
async def retrieve_response(response_id: str, stream: bool = False, starting_after: int | None = None,
                            store: ResponseStore = Depends(get_store)) -> Response:
    entry = store.get(response_id)
    if entry is None:
        raise _not_found(response_id, "response_id")
    if starting_after is not None and not stream:
        raise APIError(400, "starting_after: applies to a streamed retrieval (stream=true)", param="starting_after")
    if not stream:
        return json_response(entry.response)
    if entry.events is None:
        raise APIError(400, "stream: only a background response created with stream: true has events to stream",
                       param="stream")
    return StreamingResponse(_replay(entry, starting_after), media_type="text/event-stream")


@router.post("/v1/responses/{response_id}/cancel", response_model=ResponsesResponse,
             responses=error_responses(400, 401, 404))
async def cancel_response(response_id: str, store: ResponseStore = Depends(get_store)) -> Response:
    entry = store.get(response_id)
    if entry is None:
        raise _not_found(response_id, "response_id")
    if not entry.response.background:
        raise APIError(400, "response_id: Cannot cancel a synchronous response.", param="response_id")
    if entry.response.status not in ("queued", "in_progress"):
        raise APIError(400, f"response_id: the response is {entry.response.status}; only a queued or in-progress "
                            f"background response can be cancelled", param="response_id")
    entry.response = entry.response.model_copy(update={"status": "cancelled"})
    entry.task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await entry.task
    return json_response(entry.response)
