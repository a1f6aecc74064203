"""Stored responses (the Responses API's ``store``): what ``previous_response_id``, ``GET /v1/responses/{id}`` and
``POST /v1/responses/{id}/cancel`` read.

vLLM keeps every stored response in memory for ever; this store is bounded: beyond ``max_size`` entries the least
recently stored finished one is evicted (a later ``previous_response_id`` naming it is a 404). A background response
still running is never evicted (the engine's waiting queue bounds how many there are).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses

from serving.responses_protocol import ResponsesResponse

# Default bound on the stored responses of one API server.
DEFAULT_MAX_STORED_RESPONSES = 1024


@dataclasses.dataclass
class StoredResponse:
    """A stored response, the conversation that continues from it (chat messages, its output included, without
    the request's instructions) and, for a background response, the task generating it; for a streamed background
    response also its events so far (replayed by ``GET /v1/responses/{id}?stream=true``) and the signal of a new
    one."""

    response: ResponsesResponse
    history: list[dict]
    task: asyncio.Task | None = None
    events: list | None = None
    changed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()


class ResponseStore:
    """Stored responses by id, at most ``max_size`` finished ones (the oldest evicted first)."""

    def __init__(self, max_size: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        self.max_size = max_size
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def put(self, entry: StoredResponse) -> None:
        """Store (or replace) ``entry`` as the most recent; evict the oldest finished entries beyond the bound."""
        response_id = entry.response.id
        self._entries.pop(response_id, None)
        self._entries[response_id] = entry
        excess = len(self._entries) - self.max_size
        if excess > 0:
            evicted = [key for key, stored in self._entries.items() if not stored.running][:excess]
            for key in evicted:
                del self._entries[key]
