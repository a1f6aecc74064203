"""A lean client for one streamed (SSE) HTTP/1.1 POST, for benchmarks that must read tens of thousands of events a
second from one process.

httpx reads an SSE stream through several layers of async generators (httpcore, h11, anyio, text decoding, line
splitting) per event; at the offline engine's token rate (one event per token and stream) that costs the
benchmark client more CPU than the server spends producing the events (benchmarks/serving_host.py measures both).
Here an ``asyncio.Protocol`` feeds the bytes to httptools' C parser (a dependency already: uvicorn's parser), which
undoes the chunked transfer encoding; events are split on the blank line that ends each one and handed over with
the time their bytes arrived. One connection per request (``Connection: close``), as the benchmark's requests
are long streams.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import urllib.parse
from typing import Callable

import httptools


class HTTPStatusError(Exception):
    """The server answered with a status other than 200 (``status``, the start of the body in the message)."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:300]!r}")
        self.status = status


class _SSEProtocol(asyncio.Protocol):
    def __init__(self, on_event: Callable[[bytes, float], bool], loop: asyncio.AbstractEventLoop) -> None:
        self._on_event = on_event
        self._parser = httptools.HttpResponseParser(self)
        self._buffer = b""
        self._status = 0
        self._error_body = b""
        self.headers_time = 0.0
        self.done: asyncio.Future = loop.create_future()
        self.transport: asyncio.Transport | None = None

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._finish(RuntimeError("unexpected protocol upgrade"))
        except Exception as exc:  # noqa: BLE001 - a parse error (or a callback's) ends this request only
            self._finish(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(exc or ConnectionError("the server closed the connection before the end of the stream"))

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self._status = self._parser.get_status_code()
        self.headers_time = time.perf_counter()

    def on_body(self, body: bytes) -> None:
        if self._status != 200:
            self._error_body += body
            return
        now = time.perf_counter()
        self._buffer += body
        *events, self._buffer = self._buffer.split(b"\n\n")
        for event in events:
            if event and not self._on_event(event, now):  # the consumer saw the end ([DONE] or an error)
                self._finish(None)
                return

    def on_message_complete(self) -> None:
        self._finish(None if self._status == 200 else HTTPStatusError(self._status, self._error_body))

    def _finish(self, error: BaseException | None) -> None:
        if not self.done.done():
            self.done.set_exception(error) if error is not None else self.done.set_result(None)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


async def post_sse(url: str, body: dict, on_event: Callable[[bytes, float], bool],
                   headers: dict[str, str] | None = None) -> float:
    """POST ``body`` (JSON) to ``url`` (http or https) and call ``on_event(event_bytes, arrival_time)`` for each SSE
    event (the bytes between blank lines, e.g. ``b'data: {...}'``; ``arrival_time`` from ``time.perf_counter``)
    until the response ends or ``on_event`` returns False. Returns the time the response headers arrived.

    Raises:
      HTTPStatusError: a status other than 200.
      OSError / ConnectionError / httptools.HttpParserError: the connection failed or the response was malformed.
    """
    parts = urllib.parse.urlsplit(url)
    secure = parts.scheme == "https"
    port = parts.port or (443 if secure else 80)
    payload = json.dumps(body, separators=(",", ":")).encode()
    lines = [f"POST {parts.path or '/'}{'?' + parts.query if parts.query else ''} HTTP/1.1",
             f"Host: {parts.netloc}", "Content-Type: application/json", "Accept: text/event-stream",
             f"Content-Length: {len(payload)}", "Connection: close",
             *(f"{name}: {value}" for name, value in (headers or {}).items())]
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_connection(
        lambda: _SSEProtocol(on_event, loop), parts.hostname, port,
        ssl=ssl.create_default_context() if secure else None)
    try:
        transport.write(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
        await protocol.done
    finally:
        transport.close()
    return protocol.headers_time
