"""One generation request as the scheduler and the KV-cache manager see it (host-side state only).

A request owns a growing token sequence ``prompt_token_ids + output_token_ids``. ``num_computed_tokens`` counts the
leading tokens of that sequence whose K/V sits in the device pool (in ``block_ids``), so the tokens still to be fed to
the model are ``all_token_ids[num_computed_tokens:]``: the rest of the prompt while prefilling, the last sampled token
while decoding, and the whole sequence (prompt and outputs) after a recompute preemption.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import time
from typing import Any

import numpy as np


class RequestStatus(enum.IntEnum):
    """Life cycle: WAITING -> RUNNING -> (PREEMPTED | SWAPPED -> RUNNING)* -> FINISHED_*."""

    WAITING = enum.auto()  # queued, never scheduled
    RUNNING = enum.auto()  # admitted: holds device blocks
    PREEMPTED = enum.auto()  # blocks dropped (recompute mode): back in the waiting queue, re-prefills all its tokens
    SWAPPED = enum.auto()  # blocks moved to the host pool (swap mode): back in the waiting queue, resumes by swap-in
    FINISHED_STOPPED = enum.auto()  # EOS, a stop token id, or a stop string
    FINISHED_LENGTH = enum.auto()  # max_tokens or max_model_len reached
    FINISHED_ABORTED = enum.auto()  # aborted by the client

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI/vLLM finish_reason string, ``None`` while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}

# finish_reason string -> status, for Scheduler.finish_request(request_id, "stop").
FINISH_STATUS_BY_REASON = {reason: status for status, reason in _FINISH_REASONS.items()}


# Identity semantics (requests are dict keys, compared with ``is``); slots: the scheduler reads every running
# request's attributes every step, so they sit in the object itself, a few cache lines.
@dataclasses.dataclass(eq=False, slots=True)
class Request:
    """Mutable per-request state.

    ``params`` is duck-typed (``paged_jax.sampling_params.SamplingParams``): the scheduler reads ``max_tokens``
    (int | None, None = up to max_model_len), ``min_tokens`` (int), ``ignore_eos`` (bool) and ``stop_token_ids``
    (list[int] | None); missing attributes take those defaults. They are read once, at construction, into the
    request's attributes of the same names (and ``eos_stop_ids``, ``stop_token_id_set``).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: Any = None
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # lower value = scheduled earlier / preempted later (policy="priority"), as in vLLM
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0  # leading tokens of all_token_ids whose K/V is in the device pool
    block_ids: list[int] = dataclasses.field(default_factory=list)  # device block table
    host_block_ids: list[int] = dataclasses.field(default_factory=list)  # host block table while SWAPPED
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it (None for EOS/length)
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    # Take no prefix-cache hits (its blocks are still cached for others): prompt logprobs need every prompt position
    # computed (vLLM skips reading the cache for such requests too).
    skip_prefix_cache: bool = False
    # vLLM's cache_salt: enters the first block's hash, so only requests with the same salt share cached blocks.
    cache_salt: str | None = None
    # Chained hashes of the full blocks of all_token_ids, owned by the KVCacheManager: filled incrementally (the
    # token sequence only grows), cut back when an async-scheduling placeholder is replaced (invalidate_block_hashes).
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)
    # The LoRA adapter it runs with (``paged_jax.lora.slots.LoadedLoRA``: ``lora_int_id``, ``cache_key``), or None.
    lora: Any = None
    # Structured outputs: this sequence's ``structured_output.SequenceGrammar`` (None = unconstrained); the
    # scheduler leaves the request waiting until ``grammar.is_ready`` (its grammar compiled).
    grammar: Any = None
    # n > 1 / best_of: the other sequences of the request, forked from this one once its prompt is computed (they
    # share its blocks and sample their first token from its last prompt position's logits, in the same step).
    pending_forks: list["Request"] = dataclasses.field(default_factory=list)
    # Extra running-sequence slots this request may fill by forking (pending_forks; beam search's beam width - 1);
    # admission keeps them free so the forked sequences always fit in max_num_seqs.
    reserved_seats: int = 0
    # Beam search: after each sampled token the request is held (not scheduled) until Scheduler.resume, so the beam
    # search can pick the next beams first.
    hold_after_sample: bool = False
    held: bool = False
    # The seed of its sampling row (the engine's, per sequence; ``sampler.seed_to_u32`` folds it).
    seed: int = 0
    # What the model runner's persistent row holds of it (``paged_jax.core.sched_output``): its first tokens
    # (-1: no row; behind by ``SteadyDecode.runner_lag`` while that runs) and its first block ids; the rest: a diff.
    runner_num_tokens: int = -1
    runner_num_blocks: int = 0
    # Speculative decoding: draft tokens proposed to follow its tokens (``paged_jax.spec_decode``); the scheduler
    # computes them with its next token and trims them to what fits, the step's verification keeps the accepted ones.
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)
    # The stop rule's constants, read from ``params`` once (``_read_stop_rule``).
    max_tokens: int | None = dataclasses.field(init=False, default=None)
    min_tokens: int = dataclasses.field(init=False, default=0)
    ignore_eos: bool = dataclasses.field(init=False, default=False)
    stop_token_ids: list[int] = dataclasses.field(init=False, default_factory=list)
    eos_stop_ids: frozenset[int] = dataclasses.field(init=False, default=frozenset())
    stop_token_id_set: frozenset[int] = dataclasses.field(init=False, default=frozenset())
    # Both sets together, and max_tokens as an int (no limit: sys.maxsize): the per-token screen of the stop rule.
    stop_ids: frozenset[int] = dataclasses.field(init=False, default=frozenset())
    max_output_tokens: int = dataclasses.field(init=False, default=sys.maxsize)
    # Sampling reads the values of its previous outputs (``SamplingParams.reads_output_tokens``: penalties, bad words):
    # with async scheduling its previous step's tokens must reach the host first.
    reads_output_tokens: bool = dataclasses.field(init=False, default=False)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty str, got {self.request_id!r}")
        if not isinstance(self.prompt_token_ids, (list, tuple)) or len(self.prompt_token_ids) == 0:
            raise ValueError(f"prompt_token_ids must be a non-empty list of ints, got {self.prompt_token_ids!r}")
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        if min(self.prompt_token_ids) < 0:
            raise ValueError("prompt_token_ids must be non-negative token ids")
        if isinstance(self.eos_token_ids, int):
            self.eos_token_ids = frozenset((self.eos_token_ids,))
        self.eos_token_ids = frozenset(int(t) for t in (self.eos_token_ids or ()))
        if not isinstance(self.priority, int):
            raise ValueError(f"priority must be an int, got {self.priority!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string if provided, got {self.cache_salt!r}")

        self._read_stop_rule()

    # ---- sampling parameters (duck-typed) ----
    def _read_stop_rule(self) -> None:
        """Read the stop rule's constants (and ``reads_output_tokens``) from ``params`` once: they are checked for
        every sampled token (``params`` is fixed once the request exists)."""
        params = self.params
        self.max_tokens = getattr(params, "max_tokens", None)
        self.min_tokens = getattr(params, "min_tokens", 0) or 0
        self.ignore_eos = bool(getattr(params, "ignore_eos", False))
        self.stop_token_ids = list(getattr(params, "stop_token_ids", None) or ())
        # Token ids that finish it once past min_tokens: EOS ids (none with ignore_eos), then stop_token_ids.
        self.eos_stop_ids = frozenset() if self.ignore_eos else self.eos_token_ids
        self.stop_token_id_set = frozenset(self.stop_token_ids)
        self.stop_ids = self.eos_stop_ids | self.stop_token_id_set
        self.max_output_tokens = sys.maxsize if self.max_tokens is None else self.max_tokens
        self.reads_output_tokens = bool(getattr(params, "reads_output_tokens", False))

    @property
    def lora_int_id(self) -> int:
        """Its LoRA adapter's id; 0 = the base model."""
        return 0 if self.lora is None else self.lora.lora_int_id

    # ---- token bookkeeping ----
    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the sampled tokens: list[int] of length num_tokens (a fresh list)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        """``all_token_ids[start:stop]`` without copying the whole sequence (hot path: called per step)."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:stop - num_prompt]
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - num_prompt]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def startable(self) -> bool:
        """Whether admission may start it: not held (beam search) and its grammar, if any, compiled."""
        return not self.held and (self.grammar is None or self.grammar.is_ready)

    @property
    def num_tokens_to_compute(self) -> int:
        """Known tokens whose K/V is not yet in the pool (the next step's query tokens, before any budget cap)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """"stop" | "length" | "abort", or None while unfinished."""
        return self.status.finish_reason


def child_seed(seed: int, index: int) -> int:
    """Seed of the ``index``-th sequence of a request (n > 1, best_of, beams): the request seed itself for index 0,
    a well-mixed 64-bit function of (seed, index) for the others."""
    if index == 0:
        return seed
    return int(np.random.SeedSequence([seed % (1 << 64), index]).generate_state(2, np.uint32).view(np.uint64)[0])


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """Stop conditions for the token just appended: a stop token (``stops_on_token``; never a placeholder, whose stop
    rule ``Scheduler.resolve_placeholder`` applies), else the length limits (max_tokens, max_model_len), which always
    apply."""
    output_token_ids = request.output_token_ids
    num_output = len(output_token_ids)
    token = output_token_ids[-1]
    if token >= 0 and stops_on_token(request, token, num_output):
        return RequestStatus.FINISHED_STOPPED
    max_tokens = request.max_tokens
    if max_tokens is not None and num_output >= max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if len(request.prompt_token_ids) + num_output >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def stops_on_token(request: Request, token: int, num_output: int) -> bool:
    """Whether ``token``, the ``num_output``-th output token of ``request``, ends it: EOS (unless ignore_eos) or one of
    its stop_token_ids, counted only once more than min_tokens outputs exist. Sets ``request.stop_reason`` when it
    does (the stop token id; None for EOS)."""
    if num_output <= request.min_tokens:
        return False
    if token in request.eos_stop_ids:
        request.stop_reason = None
        return True
    if token in request.stop_token_id_set:
        request.stop_reason = token
        return True
    return False
