"""What one model-runner step gives back (host-side outputs, the pending dispatched step) and the static layout of
the packed int32 metadata buffer that carries a step's inputs to the device."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from collections.abc import Sequence

import jax
import numpy as np

from paged_jax.worker import sampler as sampler_lib
from paged_jax.worker.buckets import MAX_BLOCK_COPIES
from paged_jax.worker.moe_outputs import row_routed_experts
from paged_jax.ops.block_copy import copy_blocks


@dataclasses.dataclass
class PromptLogprobsChunk:
    """Prompt logprobs of one sequence's chunk, host side: entry i is about the chunk's new token i (position p) and
    its target, prompt token p + 1, under log_softmax of the raw logits at that position.

    Attributes:
      logprobs: float32[n] the target's logprob.
      ranks: int32[n] the target's 1-based rank (1 + number of strictly more likely tokens).
      top_token_ids: int32[n, K] / top_logprobs: float32[n, K]: the K most likely tokens, K = the runner's
        ``max_logprobs``.
    """

    logprobs: np.ndarray
    ranks: np.ndarray
    top_token_ids: np.ndarray
    top_logprobs: np.ndarray


@dataclasses.dataclass
class StepOutput:
    """Host-side results of one step, aligned with the step's rows (``SchedulerOutput``'s row order).

    Attributes:
      sampled_token_ids: int32[num_rows]; -1 for rows that did not sample.
      logprobs: float32[num_rows] raw logprob of the sampled token; None unless some row asked for logprobs.
      ranks: int32[num_rows] 1-based rank of the sampled token; None unless some row asked for logprobs.
      top_token_ids: int32[num_rows, K] / top_logprobs: float32[num_rows, K]: the K most likely tokens, K = 0 or the
        compiled width (>= every row's request); None unless some row asked for logprobs.
      prompt_logprobs: per row a ``PromptLogprobsChunk`` (rows computing prompt logprobs) or None; None unless some
        row computes them.
      pooled: float32[num_rows, W] a pooling step's per-row pooled outputs (``paged_jax.pooling``; its rows that
        complete their prompt "sample" ``POOLED_TOKEN``), else None.
      draft_outputs / draft_rows: speculative decoding: the same fields for the target's samples at every draft
        position of the step (a ``StepOutput`` without prompt logprobs) and, per row that verified drafts, the range
        of its positions there, in draft order; None on steps without drafts.
      routed_experts: per row its forwarded tokens' expert ids ``uint8 | uint16[n, num_sparse_layers, top_k]``
        (``--enable-return-routed-experts``, ``paged_jax.worker.moe_outputs``), else None.
      expert_load: ``int32[num_sparse_layers, E]`` the step's tokens per expert (``--enable-expert-load-metrics``),
        else None.
      proposed_draft_ids: int32[num_rows, k] a model drafter's drafts for each row's next step (-1: none; rows that
        did not sample or fork rows), or None without a model drafter.
    """

    sampled_token_ids: np.ndarray
    logprobs: np.ndarray | None = None
    ranks: np.ndarray | None = None
    top_token_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    prompt_logprobs: list[PromptLogprobsChunk | None] | None = None
    pooled: np.ndarray | None = None
    draft_outputs: "StepOutput | None" = None
    draft_rows: dict[int, range] | None = None
    routed_experts: list[np.ndarray] | None = None
    expert_load: np.ndarray | None = None
    proposed_draft_ids: np.ndarray | None = None


def _sampler_rows(host: list[np.ndarray], rows: np.ndarray | slice) -> StepOutput:
    """The sampler's host outputs (tokens, then logprob, top ids, top logprobs, rank when fetched) at sample rows
    ``rows`` (int64[n] or a slice)."""
    out = StepOutput(sampled_token_ids=host[0][rows].astype(np.int32))
    if len(host) > 1:
        out.logprobs, out.top_token_ids, out.top_logprobs, out.ranks = (host[i][rows] for i in (1, 2, 3, 4))
    return out


@dataclasses.dataclass(frozen=True)
class DraftSampleRows:
    """Speculative decoding: the step rows that verify drafts, int64[m] in packed order, their draft counts int64[m],
    and ``first``, the sample row of the first draft: the draft positions' sample rows follow the n rows' own,
    ``first``, ``first`` + 1, ... in that order (a row's k drafts contiguous)."""

    step_rows: np.ndarray
    counts: np.ndarray
    first: int

    @property
    def sample_rows(self) -> slice:
        """Every draft position's sample row, row by row."""
        return slice(self.first, self.first + int(self.counts.sum()))

    def first_rows(self) -> np.ndarray:
        """int64[m]: each row's first draft sample row."""
        return self.first + np.cumsum(self.counts) - self.counts

    def ranges(self) -> dict[int, range]:
        """``StepOutput.draft_rows``: step row -> its draft positions' range in ``sample_rows``."""
        stops = np.cumsum(self.counts).tolist()
        return dict(zip(self.step_rows.tolist(), map(range, [0] + stops[:-1], stops)))


# The token a pooling row "samples" when its prompt is complete: its one output token, which ends it (max_tokens=1).
POOLED_TOKEN = 0


class PendingStep:
    """A dispatched step whose results are still on the device; ``result()`` waits and copies them to the host.

    ``device_outputs`` is the pair (sampler outputs, prompt-logprob outputs) of tuples of device arrays to fetch (their
    host copies already started by ``ModelRunner.run_sampling``; the second is empty unless some row gave prompt-logprob
    targets), then optionally the dict of ``paged_jax.worker.moe_outputs`` (empty when off) and a model drafter's
    proposals (a tuple of one int32[S, k] array: ``StepOutput.proposed_draft_ids``); or a ``concurrent.futures.Future``
    of these when the step is dispatched by the runner's dispatch thread.
    ``prompt_spans``: per input row, ``(first packed token, number of targets)`` or None. ``draft_sample_rows``:
    the rows that verify drafts and their draft positions' sample rows (speculative decoding), or None.
    ``pooled``: a pooling step (its one output is the pooled rows). ``token_spans`` (first packed token, count)
    int64[n] per input row splits the routed experts by row. ``in_order``: ``rows_to_packed`` is 0..n-1 and every
    row samples (a decode step).
    """

    def __init__(self, device_outputs, rows_to_packed: np.ndarray, sampled_rows: np.ndarray,
                 prompt_spans: list[tuple[int, int] | None] | None = None,
                 draft_sample_rows: DraftSampleRows | None = None, pooled: bool = False,
                 token_spans: tuple[np.ndarray, np.ndarray] | None = None, in_order: bool = False):
        self._in_order = in_order
        self._token_spans = token_spans
        self._pooled = pooled
        self._device_outputs = device_outputs
        self._rows_to_packed = rows_to_packed
        self._sampled_rows = sampled_rows
        self._prompt_spans = prompt_spans
        self._draft_sample_rows = draft_sample_rows
        self._result: StepOutput | None = None

    def set_device_outputs(self, device_outputs) -> None:
        """The runner's device outputs of a step created before its sampling was dispatched (deferred sampling)."""
        self._device_outputs = device_outputs

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Some row of the step computes prompt logprobs."""
        return self._prompt_spans is not None

    def wait(self) -> None:
        """Block until the step's outputs are computed on the device (without copying them to the host)."""
        outputs = self._device_outputs
        if isinstance(outputs, concurrent.futures.Future):
            outputs = outputs.result()
        if outputs:
            jax.block_until_ready(outputs)

    def result(self) -> StepOutput:
        if self._result is None:
            outputs = self._device_outputs
            if outputs is None:
                raise RuntimeError("result() of a step whose sampling was never dispatched "
                                   "(ModelRunner.dispatch_sampling)")
            if isinstance(outputs, concurrent.futures.Future):
                outputs = outputs.result()  # the dispatch itself (re-raises its error)
            sampler_outputs, prompt_outputs, *extra = outputs  # then the MoE outputs' dict, the drafts' fetch
            moe, draft_outputs = (extra + [{}, ()])[:2]
            host = [np.asarray(x) for x in sampler_outputs]  # their host copies were started at dispatch
            rows = self._rows_to_packed
            if self._pooled:
                self._result = StepOutput(np.where(self._sampled_rows, POOLED_TOKEN, -1).astype(np.int32),
                                          pooled=host[0][rows])
                self._device_outputs = ()
                return self._result
            out = _sampler_rows(host, slice(0, len(rows)) if self._in_order else rows)
            if not self._in_order:
                out.sampled_token_ids[~self._sampled_rows] = -1
            if self._draft_sample_rows is not None:
                out.draft_rows = self._draft_sample_rows.ranges()
                out.draft_outputs = _sampler_rows(host, self._draft_sample_rows.sample_rows)
            if draft_outputs:  # the drafter's proposals int32[S, k], packed order
                out.proposed_draft_ids = np.asarray(draft_outputs[0])[rows]
            if prompt_outputs:  # (logprob f32[T], rank i32[T], top ids i32[T, K], top logprobs f32[T, K])
                arrays = [np.asarray(x) for x in prompt_outputs]
                out.prompt_logprobs = [
                    None if span is None else PromptLogprobsChunk(*(a[span[0]:span[0] + span[1]] for a in arrays))
                    for span in self._prompt_spans]
            if moe:
                self._add_moe_outputs(out, moe)
            self._result = out
            self._device_outputs = ()
        return self._result

    def _add_moe_outputs(self, out: StepOutput, moe: dict) -> None:
        if "routed_experts" in moe:
            out.routed_experts = row_routed_experts(np.asarray(moe["routed_experts"]), *self._token_spans)
        if "expert_load" in moe:
            out.expert_load = np.asarray(moe["expert_load"])


SPEC_ROW_WORDS = 5


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """Static offsets of the fields of the packed int32 step buffer for one (num_tokens, num_seqs) bucket.

    ``copy_src`` / ``copy_dst`` (C = min(S, ``MAX_BLOCK_COPIES``) * G each): the step's copy-on-write block copies
    (at most one per sequence and group: only the block holding a sequence's first new token can be shared), padded
    with
    destination ``num_blocks`` (out of range: the scatter drops it)."""

    num_tokens: int
    num_seqs: int
    max_blocks_per_seq: int
    num_sample_rows: int  # R >= S: rows of the logits / sampler (``sampler_rows_for``); rows past S are padding
    lora: bool = False  # with LoRA: each token's adapter slot (int32[T], ``lora_slot_ids``)
    # KV-cache groups G (``kv_group_pool``): ``max_blocks_per_seq`` counts every group's entries, ``slot_mapping`` is
    # int32[G * T] and a sequence's copy-on-write copies one block per group.
    num_kv_groups: int = 1
    # With a model drafter (``paged_jax.spec_decode.draft_runner``): per sequence ``SPEC_ROW_WORDS`` words
    # (``spec_rows``: its drafts, first draft sample row, next prompt token, whether it proposes, block capacity).
    spec_rows: bool = False

    @functools.cached_property
    def fields(self) -> dict[str, tuple[int, int]]:
        T, S, B, R = self.num_tokens, self.num_seqs, self.max_blocks_per_seq, self.num_sample_rows
        G = self.num_kv_groups
        C = min(S, MAX_BLOCK_COPIES) * G
        sizes = [("input_ids", T), ("positions", T), ("slot_mapping", T * G), ("prev_rows", T),
                 ("cu_q_lens", S + 1), ("kv_lens", S), ("logits_indices", R), ("block_tables", S * B),
                 *([("lora_slot_ids", T)] if self.lora else []), ("copy_src", C), ("copy_dst", C),
                 *([("spec_rows", S * SPEC_ROW_WORDS)] if self.spec_rows else []),
                 ("sampling", R * sampler_lib.SAMPLING_WORDS_PER_ROW)]
        out, offset = {}, 0
        for name, size in sizes:
            out[name] = (offset, offset + size)
            offset += size
        return out

    @property
    def size(self) -> int:
        return self.fields["sampling"][1]


@dataclasses.dataclass(frozen=True)
class SamplerVariant:
    """One compiled sampler variant: the sampler mode, whether penalty history is passed, the top-logprob width,
    whether the bias table (``logit_bias`` / ``allowed_token_ids``, ``sampler.pack_bias_table``) is passed."""

    mode: str
    penalties: bool
    num_logprobs: int
    bias_table: bool = False


def pack_block_copies(copies: Sequence[tuple[int, int]], src: np.ndarray, dst: np.ndarray, num_blocks: int) -> None:
    """Write a step's copy-on-write ``copies`` ``[(src_block, dst_block)]`` into the layout's ``copy_src`` /
    ``copy_dst`` views (int32[S] each), padding with the dropped destination ``num_blocks``."""
    if len(copies) > len(src):
        raise ValueError(f"{len(copies)} block copies in a step of {len(src)} sequence slots")
    dst[:] = num_blocks
    if copies:
        pairs = np.asarray(copies, np.int32)
        src[:len(copies)], dst[:len(copies)] = pairs[:, 0], pairs[:, 1]


def apply_block_copies(kv_pool: list, src, dst, *, impl: str = "xla") -> list:
    """Inside the jitted step, on the donated pool: block ``dst[i]`` of every layer's K and V becomes a copy of block
    ``src[i]`` (int32[C] each); out-of-range destinations (padding) are dropped. ``impl``: see
    ``paged_jax.ops.block_copy.copy_blocks`` ("auto" only for a pool on one device)."""
    return copy_blocks(kv_pool, src, dst, impl=impl)
