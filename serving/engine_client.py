"""``EngineClient``: the engine interface the server drives, as a ``typing.Protocol``.

Two implementations: ``paged_jax.engine.llm_engine.LLMEngine`` itself (the engine on a thread of the server process) and
``serving.engine_process.EngineProcessClient`` (the engine in a child process, the default). The server hands
either to ``serving.async_engine.AsyncEngine``, whose one engine thread makes every call; nothing here is
thread-safe.

Outputs are deltas (``paged_jax.outputs``): ``step()`` returns, per request that progressed, what is new since that
request's previous output; the request's last output has ``finished=True``. The server keeps that form up to the
HTTP layer, which accumulates only for non-streaming responses.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from paged_jax.config import EngineArgs
    from paged_jax.outputs import RequestOutput
    from paged_jax.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    """What the server reads from and calls on an engine.

    Attributes:
      tokenizer: the engine's tokenizer (None: token-id prompts only). The server copies it; it never shares it
        with the engine thread.
      max_model_len: tokens per sequence, prompt included.
      vocab_size: token ids are in ``[0, vocab_size)``.
      model_path: the checkpoint directory (None for a named dummy shape).
      engine_args: the ``EngineArgs`` the engine was built from.
      generation_config: the checkpoint's generation config (``--generation-config``) as a dict; requests take
        their default sampling parameters from it.
    """

    tokenizer: Any
    max_model_len: int
    vocab_size: int
    model_path: str | None
    engine_args: EngineArgs
    generation_config: dict

    def add_request(self, request_id: str, prompt: list[int] | str | dict, params: SamplingParams | None = None,
                    priority: int = 0) -> None:
        """Queue a request; raises ValueError naming the bad field (the request then leaves no state behind).
        An engine with LoRA (``enable_lora``) also takes ``lora_request=`` (a ``LoRARequest``) and has
        ``add_lora(lora_request) -> bool``, ``remove_lora(lora_id) -> bool`` and ``list_loras() -> set[int]``
        (called through ``AsyncEngine.call``); only LoRA requests pass the keyword."""

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Drop requests (unknown or finished ids are ignored); an aborted request produces no more outputs."""

    def step(self) -> list[RequestOutput]:
        """Advance every unfinished request; returns the delta outputs of those that progressed."""

    def has_unfinished_requests(self) -> bool:
        """Whether ``step()`` has anything to do."""

    def stats(self) -> dict[str, float]:
        """Engine gauges and counters (``LLMEngine.stats``'s keys) for metrics and admission control."""


@runtime_checkable
class ProcessEngineClient(EngineClient, Protocol):
    """An ``EngineClient`` whose engine runs elsewhere and can die on its own (``EngineProcessClient``).

    Admission without a round trip per request: ``submit_requests`` sends a group and returns at once; the engine
    adds the group all or none before its next step, and the answer comes out of ``take_admissions`` after a later
    ``step()`` (which returns early for it). ``add_request`` remains, waiting for its own answer."""

    def submit_requests(self, requests: Sequence[tuple]) -> int:
        """Send ``[(request_id, prompt, params, priority[, lora_request])]`` as one group; returns the group's id.
        Raises ValueError (an id already in use; nothing sent)."""

    def take_admissions(self) -> list[tuple[int, BaseException | None]]:
        """``(group id, None or the error that refused the whole group)`` for every answer received so far."""

    def wakeup(self) -> None:
        """Make a ``step()`` blocked waiting for the engine return now (safe from any thread)."""

    def is_alive(self) -> bool:
        """Whether the engine is running (safe from any thread: ``/health`` asks it)."""

    def close(self) -> None:
        """Stop the engine and release it (after the engine thread has stopped calling it)."""
