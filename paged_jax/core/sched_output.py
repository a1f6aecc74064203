"""The step contract between the scheduler and the model runner: what one step runs, as a diff of the runner's
persistent batch (vLLM V1's ``SchedulerOutput``).

A request enters the runner's batch once, as ``NewRequestData`` (everything its row needs: tokens, sampling
parameters, seed, block table, adapter); while it keeps running, each step carries only what changed for it
(``CachedRequestData``: new token ids, new block ids, where it stands). Finished and preempted requests leave the
batch by id; a preempted request that runs again comes back as new. The runner never reads the scheduler's
``Request`` objects.

Rows of a step, in this order: the cached requests, then the new ones, then the fork rows (``fork_rows``). The
runner's ``StepOutput`` is aligned with that order, and so is ``Scheduler.update_from_output``'s input.

On the wire (multi-host: node 0 -> the other nodes, ``paged_jax.parallel.follower``) a step is ``encode_step``'s
msgpack: the diff types are msgspec Structs (``SamplingParams`` a dataclass msgspec encodes field by field), the
grammars only as the ids of the constrained rows (their bitmask is node 0's to fill), the scheduler's own
``requests`` left out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import msgspec

from paged_jax.core.request import Request
from paged_jax.sampling_params import SamplingParams

# Stands for a sampled token still on the device (async scheduling): the runner feeds the row from the previous
# step's on-device sample instead. Real token ids are >= 0.
PLACEHOLDER_TOKEN = -1


class NewRequestData(msgspec.Struct):
    """A request the runner has no row for (first admission, or running again after a preemption).

    Attributes:
      req_id: the request id (the row's key).
      prompt_token_ids: list[int] the prompt (P tokens).
      output_token_ids: list[int] outputs already sampled (recompute after preemption, forked beams), fed after the
        prompt.
      params: its ``SamplingParams`` (read once, when the row is made; None: greedy, as padding rows).
      seed: the seed of its sampling row (``sampler.seed_to_u32`` folds it).
      block_ids: list[int] its device block table, covering the tokens computed after this step.
      num_computed_tokens: leading tokens whose K/V is already in the pool (prefix-cache hits).
      lora_int_id: its LoRA adapter's id (0: the base model).
      prompt_logprobs: compute prompt logprobs for its prompt chunks.
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams | None
    seed: int
    block_ids: list[int]
    num_computed_tokens: int
    lora_int_id: int = 0
    prompt_logprobs: bool = False


class CachedRequestData(msgspec.Struct):
    """The running requests of a step that the runner already holds, as columns (one entry per request).

    Attributes:
      req_ids: list[str].
      new_token_ids: list[list[int]] tokens the row does not hold yet, appended to it (a decode: the token sampled
        last, or ``PLACEHOLDER_TOKEN`` while it is on the device).
      new_block_ids: list[list[int]] block ids written into the row's table from ``block_starts[i]`` on (appended
        blocks, or a copy-on-write block replacing a shared one and those after it).
      block_starts: list[int].
      num_computed_tokens: list[int] tokens already in the pool before this step.
      decode_token_ids: list[int] | None: a decode step's new tokens as one column, set (and ``new_token_ids``
        then empty) when every row gets exactly one new token: row i's (``tokens_of_rows`` gives either form).
    """

    req_ids: list[str] = msgspec.field(default_factory=list)
    new_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    new_block_ids: list[list[int]] = msgspec.field(default_factory=list)
    block_starts: list[int] = msgspec.field(default_factory=list)
    num_computed_tokens: list[int] = msgspec.field(default_factory=list)
    decode_token_ids: list[int] | None = None

    def tokens_of_rows(self) -> list[list[int]]:
        """Each row's new tokens (``new_token_ids``, or ``decode_token_ids`` one list per row)."""
        if self.decode_token_ids is None:
            return self.new_token_ids
        return [[token] for token in self.decode_token_ids]


@dataclasses.dataclass(frozen=True)
class ScheduledRow:
    """A read-only view of one row of a step (``SchedulerOutput.scheduled_rows``), for inspection (tests,
    ``benchmarks.schedule``): its scheduler ``Request``, where it starts, how many tokens it computes, whether it
    samples, and for a fork row the parent's id."""

    request: Any
    num_computed_tokens: int
    num_new_tokens: int
    samples: bool
    fork_parent: str | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclasses.dataclass
class SchedulerOutput:
    """What to run this step.

    Attributes:
      scheduled_cached_reqs / scheduled_new_reqs: the step's requests (see the module docstring for the row order).
      num_scheduled_tokens: list[int] new tokens per row, cached then new (fork rows compute none).
      fork_rows: ``(child, parent req_id)`` per fork row (n > 1, best_of): the child's row is made (no blocks yet) and
        samples its first token from the logits of the parent's last token of this step.
      finished_req_ids / preempted_req_ids: rows to drop before this step's rows are applied.
      block_copies: copy-on-write ``(src_block, dst_block)`` pairs applied before the step's K/V writes.
      swap_out / swap_in: ``(device_block, host_block)`` / ``(host_block, device_block)`` copies, applied before the
        step (out gathered first; ``paged_jax.worker.host_kv_pool``): swap preemption's, then the host tier's.
      grammars: req_id -> ``structured_output.SequenceGrammar`` of the step's constrained requests (their sampling
        rows are masked by it).
      requests / samples: the scheduler's own view of the rows (its ``Request`` per row and whether the row samples),
        read back by ``update_from_output``; the runner does not read them (a decoded step has no ``requests``).
      spec_token_ids: req_id -> list[int] the draft tokens a running row computes after its known tokens
        (speculative decoding; its ``num_scheduled_tokens`` count them): the runner feeds them and samples the
        target at each of their positions as well as at the last one.
    """

    scheduled_cached_reqs: CachedRequestData
    scheduled_new_reqs: list[NewRequestData]
    num_scheduled_tokens: list[int]
    fork_rows: list[tuple[NewRequestData, str]]
    finished_req_ids: list[str]
    preempted_req_ids: list[str]
    block_copies: list[tuple[int, int]]
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    grammars: dict[str, Any]
    requests: list[Any]
    samples: list[bool]
    spec_token_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return len(self.scheduled_cached_reqs.req_ids) + len(self.scheduled_new_reqs) + len(self.fork_rows)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def has_rows(self) -> bool:
        return self.num_rows > 0

    @property
    def is_empty(self) -> bool:
        """Nothing for the runner to do (no rows, copies or ids to drop)."""
        return not (self.has_rows or self.swap_out or self.swap_in or self.finished_req_ids
                    or self.preempted_req_ids)

    def row_num_computed_tokens(self) -> list[int]:
        """Tokens in the pool before this step, per row (fork rows: 0)."""
        return (self.scheduled_cached_reqs.num_computed_tokens
                + [new.num_computed_tokens for new in self.scheduled_new_reqs] + [0] * len(self.fork_rows))

    def scheduled_rows(self) -> list[ScheduledRow]:
        """Every row of the step, in row order (see ``ScheduledRow``)."""
        num_new = self.num_scheduled_tokens + [0] * len(self.fork_rows)
        parents = [None] * (self.num_rows - len(self.fork_rows)) + [parent for _, parent in self.fork_rows]
        return [ScheduledRow(*row) for row in zip(self.requests, self.row_num_computed_tokens(), num_new,
                                                  self.samples, parents)]

    def row_req_ids(self) -> list[str]:
        """The request id of each row, in row order."""
        return (self.scheduled_cached_reqs.req_ids + [new.req_id for new in self.scheduled_new_reqs]
                + [child.req_id for child, _ in self.fork_rows])


def new_request_data(request: Request) -> NewRequestData:
    """The whole row of a request the runner does not hold; from now on it holds its tokens and blocks."""
    request.runner_num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
    request.runner_num_blocks = len(request.block_ids)
    return NewRequestData(
        req_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
        output_token_ids=list(request.output_token_ids), params=request.params, seed=request.seed,
        block_ids=list(request.block_ids), num_computed_tokens=request.num_computed_tokens,
        lora_int_id=request.lora_int_id, prompt_logprobs=request.skip_prefix_cache)


class StepBuilder:
    """Builds one step's ``SchedulerOutput`` row by row (the scheduler's, and ``hand_steps``' for tests and
    benchmarks): a request's whole row the first time, afterwards only what its row lacks; rows come out as the
    runner's, then new ones, then fork rows."""

    def __init__(self) -> None:
        self.cached = CachedRequestData()
        self.new_reqs: list[NewRequestData] = []
        self._cached_columns: tuple[list, list, list] = ([], [], [])  # requests, new tokens, samples
        self._new_columns: tuple[list, list, list] = ([], [], [])
        self.forks: list[tuple[NewRequestData, str]] = []
        self._fork_requests: list[Request] = []
        self.grammars: dict[str, Any] = {}
        self.spec_token_ids: dict[str, list[int]] = {}
        self._last_samples = False

    def add(self, request: Request, num_new: int) -> bool:
        """Add ``request`` computing ``num_new`` tokens from its ``num_computed_tokens`` (as ``add_rows``); returns
        whether the row samples (the step reaches the end of its known tokens)."""
        self.add_rows(((request, num_new),))
        return self._last_samples

    def add_rows(self, rows: Iterable[tuple[Request, int]]) -> None:
        """``add`` each ``(request, num_new)`` in order, and after a request that samples and has
        ``pending_forks``, a fork row per child (the scheduler's order). One pass over every running request each
        step: a held row's diff is the tokens and block ids it lacks (``Request.runner_num_tokens`` /
        ``runner_num_blocks`` say what it holds)."""
        cached = self.cached
        add_req_id, add_tokens, add_blocks = (cached.req_ids.append, cached.new_token_ids.append,
                                              cached.new_block_ids.append)
        add_block_start, add_num_computed = cached.block_starts.append, cached.num_computed_tokens.append
        held_requests, held_num_new, held_samples = self._cached_columns
        add_held, add_held_num_new, add_held_samples = held_requests.append, held_num_new.append, held_samples.append
        samples = False
        for request, num_new in rows:
            output_token_ids = request.output_token_ids
            num_prompt = len(request.prompt_token_ids)
            num_tokens = num_prompt + len(output_token_ids)
            num_computed = request.num_computed_tokens
            spec = request.spec_token_ids
            if spec:  # drafts follow the known tokens (only rows the runner holds get them: the scheduler's rule)
                self.spec_token_ids[request.request_id] = spec
                samples = num_computed + num_new - len(spec) == num_tokens
            else:
                samples = num_computed + num_new == num_tokens
            held_tokens = request.runner_num_tokens
            if held_tokens < 0:
                self._add_new(request, num_new, samples)
            else:
                add_req_id(request.request_id)
                add_tokens(output_token_ids[held_tokens - num_prompt:] if held_tokens >= num_prompt
                           else request.token_ids_slice(held_tokens, num_tokens))
                block_ids = request.block_ids
                held_blocks = request.runner_num_blocks
                add_blocks(block_ids[held_blocks:])
                add_block_start(held_blocks)
                add_num_computed(num_computed)
                request.runner_num_tokens = num_tokens
                request.runner_num_blocks = len(block_ids)
                add_held(request)
                add_held_num_new(num_new)
                add_held_samples(samples)
            if request.grammar is not None:
                self.grammars[request.request_id] = request.grammar
            if samples and request.pending_forks:
                for child in request.pending_forks:
                    self.add_fork(child, request.request_id)
        self._last_samples = samples

    def _add_new(self, request: Request, num_new: int, samples: bool) -> None:
        """A row for a request the runner does not hold."""
        self.new_reqs.append(new_request_data(request))
        new_requests, new_num_new, new_samples = self._new_columns
        new_requests.append(request)
        new_num_new.append(num_new)
        new_samples.append(samples)

    def add_fork(self, child: Request, parent_id: str) -> None:
        """A fork row: ``child``'s row is made and samples its first token from ``parent_id``'s last token."""
        self.forks.append((new_request_data(child), parent_id))
        self._fork_requests.append(child)
        if child.grammar is not None:  # its first token is sampled in this step
            self.grammars[child.request_id] = child.grammar

    def build(self, *, finished_req_ids: list[str], preempted_req_ids: list[str],
              block_copies: list[tuple[int, int]], swap_out: list[tuple[int, int]],
              swap_in: list[tuple[int, int]]) -> SchedulerOutput:
        """The step, with what the builder's caller collected besides its rows."""
        (requests, num_new, samples), (new_requests, new_num_new, new_samples) = (self._cached_columns,
                                                                                  self._new_columns)
        return SchedulerOutput(
            scheduled_cached_reqs=self.cached, scheduled_new_reqs=self.new_reqs,
            num_scheduled_tokens=num_new + new_num_new, fork_rows=self.forks, finished_req_ids=finished_req_ids,
            preempted_req_ids=preempted_req_ids, block_copies=block_copies, swap_out=swap_out, swap_in=swap_in,
            grammars=self.grammars, requests=requests + new_requests + self._fork_requests,
            samples=samples + new_samples + [True] * len(self.forks), spec_token_ids=self.spec_token_ids)


class _RemoteGrammar:
    """A constrained row of a step decoded from the wire: its bitmask row comes from node 0."""

    def __repr__(self) -> str:
        return "REMOTE_GRAMMAR"


REMOTE_GRAMMAR = _RemoteGrammar()


class StepMessage(msgspec.Struct, array_like=True):
    """A step on the wire (``encode_step``): what the runner reads of a ``SchedulerOutput``, plus the step's LoRA
    slots ``{lora_int_id: slot}`` (None: none)."""

    cached: CachedRequestData
    new_reqs: list[NewRequestData]
    num_scheduled_tokens: list[int]
    fork_rows: list[tuple[NewRequestData, str]]
    finished_req_ids: list[str]
    preempted_req_ids: list[str]
    block_copies: list[tuple[int, int]]
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    grammar_req_ids: list[str]
    samples: list[bool]
    lora_slots: dict[int, int] | None = None
    spec_token_ids: dict[str, list[int]] = {}


_STEP_ENCODER = msgspec.msgpack.Encoder()
_STEP_DECODER = msgspec.msgpack.Decoder(StepMessage)


def encode_step(scheduler_output: SchedulerOutput, lora_slots: dict[int, int] | None = None) -> bytes:
    """The step as msgpack bytes (``StepMessage``)."""
    out = scheduler_output
    return _STEP_ENCODER.encode(StepMessage(
        out.scheduled_cached_reqs, out.scheduled_new_reqs, out.num_scheduled_tokens, out.fork_rows,
        out.finished_req_ids, out.preempted_req_ids, out.block_copies, out.swap_out, out.swap_in,
        list(out.grammars), out.samples, lora_slots, out.spec_token_ids))


def decode_step(data: bytes) -> tuple[SchedulerOutput, dict[int, int] | None]:
    """``encode_step``'s bytes -> ``(SchedulerOutput without requests, lora_slots)``; each constrained row's grammar
    is ``REMOTE_GRAMMAR`` (its bitmask comes from node 0)."""
    message = _STEP_DECODER.decode(data)
    return SchedulerOutput(
        scheduled_cached_reqs=message.cached, scheduled_new_reqs=message.new_reqs,
        num_scheduled_tokens=message.num_scheduled_tokens, fork_rows=message.fork_rows,
        finished_req_ids=message.finished_req_ids, preempted_req_ids=message.preempted_req_ids,
        block_copies=message.block_copies, swap_out=message.swap_out, swap_in=message.swap_in,
        grammars=dict.fromkeys(message.grammar_req_ids, REMOTE_GRAMMAR), requests=[],
        samples=message.samples, spec_token_ids=message.spec_token_ids), message.lora_slots
