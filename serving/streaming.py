"""Serving engine request streams over HTTP: SSE framing, merging several request streams, client disconnects, and
aborting whatever a response leaves unfinished.

The streams carry delta outputs (``paged_jax.engine.output_processor``). A streamed response sends each delta as an SSE chunk
as it comes; a non-streamed one accumulates each stream's deltas into its whole output (``collect_final``), the
only place the server accumulates.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from json.encoder import encode_basestring  # type: ignore[attr-defined]
from typing import Any, AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import StreamingResponse

from paged_jax.outputs import RequestOutput
from serving.async_engine import AsyncEngine, EngineDeadError, RequestStream
from serving.errors import APIError, engine_error
from serving.protocol import PromptTokenUsageInfo, StreamOptions, UsageInfo


# ------------------------------------------------------------------------------------------------ SSE framing
def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def sse_error(error: APIError) -> str:
    return sse(error.body().model_dump_json())


def usage_options(stream_options: StreamOptions | None) -> tuple[bool, bool]:
    """``(include_usage, continuous_usage_stats)`` of a streamed request (vLLM's ``should_include_usage``): no
    ``stream_options``, no usage; continuous usage only together with the final usage chunk."""
    if stream_options is None:
        return False, False
    include_usage = bool(stream_options.include_usage)
    return include_usage, include_usage and bool(stream_options.continuous_usage_stats)


class SSEChunks:
    """The SSE lines of one streamed response: every chunk has the same id, creation time and model.

    Args:
      response_cls: the chunk model (``CompletionStreamResponse`` or ``ChatCompletionStreamResponse``).
      include_usage: ``stream_options.include_usage``: chunks carry ``"usage"`` (null, or the usage so far with
        ``continuous_usage_stats``) and a final usage chunk follows (without it, chunks have no ``usage`` key).
    """

    def __init__(self, response_cls: type, response_id: str, created: int, model: str, include_usage: bool) -> None:
        self._response_cls = response_cls
        self._header = dict(id=response_id, created=created, model=model)
        self.include_usage = include_usage

    def choice(self, choice: Any, usage: UsageInfo | None = None) -> str:
        """One choice's chunk; ``usage``: the usage so far (``continuous_usage_stats``)."""
        response = self._response_cls(**self._header, choices=[choice], usage=usage)
        return sse(response.model_dump_json(exclude=None if self.include_usage else {"usage"}))

    @staticmethod
    def usage_info(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int | None = None
                   ) -> UsageInfo:
        """A response's usage; ``num_cached_tokens``: ``prompt_tokens_details.cached_tokens`` (None: no details)."""
        details = None if num_cached_tokens is None else PromptTokenUsageInfo(cached_tokens=num_cached_tokens)
        return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                         total_tokens=num_prompt_tokens + num_completion_tokens, prompt_tokens_details=details)

    def usage(self, num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int | None = None) -> str:
        """The final ``stream_options.include_usage`` chunk: usage and no choices, as OpenAI sends it."""
        usage = self.usage_info(num_prompt_tokens, num_completion_tokens, num_cached_tokens)
        return sse(self._response_cls(**self._header, choices=[], usage=usage).model_dump_json())


def _json_scalar(value: str | int | None) -> str:
    """A finish / stop reason as JSON: ``encode_basestring`` is the C string encoder ``json.dumps`` ends in, without
    its per-call encoder set-up (``json.dumps(..., ensure_ascii=False)`` builds a ``JSONEncoder`` every call)."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return encode_basestring(value)
    return str(int(value))


class CompletionTextChunk:
    """The SSE line of a completion chunk without logprobs, rendered from a fixed prefix and suffix.

    Per chunk this replaces building two pydantic models and serializing them (tens of microseconds, on the event
    loop, under the GIL the engine thread also needs) by one C string encoding of the text. The JSON is the same
    document ``CompletionStreamResponse.model_dump_json`` gives (tests compare them)."""

    def __init__(self, response_id: str, created: int, model: str, include_usage: bool):
        self._prefix = (f'data: {{"id":{json.dumps(response_id)},"object":"text_completion","created":{int(created)},'
                        f'"model":{json.dumps(model)},"choices":[{{"index":')
        self._suffix = ',"usage":null}\n\n' if include_usage else '}\n\n'

    def __call__(self, index: int, text: str, finish_reason: str | None, stop_reason: int | str | None) -> str:
        return (f'{self._prefix}{int(index)},"text":{encode_basestring(text)},"logprobs":null,'
                f'"finish_reason":{_json_scalar(finish_reason)},"stop_reason":{_json_scalar(stop_reason)}}}]'
                f'{self._suffix}')


# ------------------------------------------------------------------------------------------ request streams
async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield ``(stream_index, output)`` from several streams as outputs arrive, until all are finished."""
    if len(streams) == 1:  # the common case: no task per output, just await the one stream
        stream = streams[0]
        while True:
            output = await stream.next_output()  # re-raises engine errors
            yield 0, output
            if stream.finished:
                return
    pending: dict[asyncio.Task, int] = {}
    try:
        for index, stream in enumerate(streams):
            pending[asyncio.ensure_future(stream.next_output())] = index
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                output = task.result()  # re-raises engine errors
                if not streams[index].finished:
                    pending[asyncio.ensure_future(streams[index].next_output())] = index
                yield index, output
    finally:
        for task in pending:
            task.cancel()


def abort_unfinished(async_engine: AsyncEngine, streams: Sequence[RequestStream]) -> None:
    unfinished = [stream.request_id for stream in streams if not stream.finished]
    if unfinished:
        async_engine.abort(unfinished)


async def wait_for_disconnect(raw_request: Request) -> None:
    """Return when the client closes the connection (the request body was already read by FastAPI)."""
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect_final(async_engine: AsyncEngine, streams: Sequence[RequestStream],
                        raw_request: Request) -> list[RequestOutput] | None:
    """Each stream's deltas accumulated into its whole final output, in stream order; None if the client left
    first. Whatever is unfinished when this returns (or raises) is aborted.

    Raises:
      APIError: 500, the engine failed.
    """
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def consume() -> None:
        async for index, output in merge_streams(streams):
            if finals[index] is None:
                finals[index] = output  # a stream's outputs belong to its consumer: accumulate in place
            else:
                finals[index].add(output)

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not consumer.done():
            return None
        consumer.result()
        return finals
    except (EngineDeadError, RuntimeError) as exc:
        raise engine_error(exc) from exc
    finally:
        consumer.cancel()
        watcher.cancel()
        abort_unfinished(async_engine, streams)


# -------------------------------------------------------------------------------------------- SSE responses
async def _framed(chunks: AsyncIterator[str], async_engine: AsyncEngine,
                  streams: Sequence[RequestStream], done_marker: bool = True) -> AsyncIterator[str]:
    """``chunks``, then ``data: [DONE]`` (with ``done_marker``; the Responses API's stream ends without it); an
    engine failure mid-stream becomes an error event, and the requests are aborted however the stream ends (a
    client that leaves closes this generator)."""
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk
    except (EngineDeadError, RuntimeError) as exc:
        yield sse_error(engine_error(exc))
    finally:
        abort_unfinished(async_engine, streams)
    if done_marker:
        yield sse("[DONE]")


class EngineStreamingResponse(StreamingResponse):
    """SSE response over engine request streams that aborts its engine requests however it ends.

    The framing generator's own ``finally`` covers disconnects mid-stream, but if the client leaves before the
    first chunk, Starlette cancels the response before the generator ever starts, and a never-started generator
    runs no ``finally``; this wrapper covers that case.
    """

    def __init__(self, chunks: AsyncIterator[str], async_engine: AsyncEngine, streams: Sequence[RequestStream],
                 done_marker: bool = True):
        super().__init__(_framed(chunks, async_engine, streams, done_marker), media_type="text/event-stream")
        self._async_engine = async_engine
        self._streams = list(streams)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            abort_unfinished(self._async_engine, self._streams)
