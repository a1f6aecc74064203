"""One step's packed inputs, built from the persistent batch (``InputBatch``) and the step's rows: the int32 step
buffer (``StepLayout``), the optional penalty history and bias table, the sampler variant, and what the step's
``PendingStep`` needs to give its outputs back in row order.

Rows are packed decodes first, then multi-token chunks (the layout the attention kernels are tuned for), then fork
rows (no new tokens; the kernels see them as padding sequences). Everything per row is whole-array numpy over the
batch's arrays; only rare rows (fork rows, prompt logprobs, the general sampling path) take Python loops. A steady
decode step (the same rows as the step before, each one token further) is packed from the previous step's buffer:
only positions, lengths, input tokens, slots, sampling steps and the block tables that changed are written.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from paged_jax.worker import sampler as sampler_lib
from paged_jax.worker.buckets import pick_bucket
from paged_jax.worker.step_io import SPEC_ROW_WORDS, DraftSampleRows, StepLayout, pack_block_copies
from paged_jax.worker.input_batch import InputBatch
from paged_jax.worker.kv_group_pool import pack_group_slots

_GREEDY_RANK = sampler_lib.MODE_ORDER.index(sampler_lib.SamplingMode.GREEDY)
_GREEDY_OR_TEMPERATURE = sampler_lib.SamplingMode.GREEDY_OR_TEMPERATURE
_STEPS_FIELD = sampler_lib.SAMPLING_WIRE_FIELDS.index("steps")  # its row of the sampling words' vectors


@dataclasses.dataclass
class StepRows:
    """A step's rows in step order: batch rows int64[n], new tokens int64[n], tokens in the pool before the step
    int64[n], ``fork_parents``: per fork row (the last ones) the step row of the row it samples from, and
    ``num_drafts`` int64[n]: draft tokens among each row's new tokens (speculative decoding; None: none)."""

    batch_rows: np.ndarray
    num_new: np.ndarray
    starts: np.ndarray
    fork_parents: list[int]
    num_drafts: np.ndarray | None = None


@dataclasses.dataclass
class PackedStep:
    """A step ready to dispatch.

    Attributes:
      buf: int32[layout.size] the step buffer; bucket_tokens / bucket_seqs: its bucket.
      history: int32[R, max_model_len] penalty history, or None; bias_table: int32[R, W], or None.
      mode / num_logprobs / wants_logprobs: the sampler variant.
      rows_to_packed: int64[n] packed index of each step row; sampled: bool[n] rows that sample (step order).
      prompt_targets: int32[T] prompt-logprob targets, or None; prompt_spans: per step row ``(first packed token,
        count)`` or None.
      packed_batch_rows: int64[n] the batch row of each packed row; packed_sampled: bool[n] whether it samples.
      draft_sample_rows: the step rows that verify drafts and their draft positions' sample rows (after the n rows'
        own), or None.
    """

    buf: np.ndarray
    layout: StepLayout
    history: np.ndarray | None
    bias_table: np.ndarray | None
    mode: sampler_lib.SamplingMode
    num_logprobs: int
    wants_logprobs: bool
    rows_to_packed: np.ndarray
    sampled: np.ndarray
    prompt_targets: np.ndarray | None
    prompt_spans: list | None
    packed_batch_rows: np.ndarray
    packed_sampled: np.ndarray
    draft_sample_rows: DraftSampleRows | None = None
    # A decode step whose every row samples on the fast sampling path, without block copies, LoRA, drafts, prompt
    # logprobs or a drafter's words: the next step of the same rows may be packed from it (``_repack_decode``).
    reusable: bool = False

    def token_spans(self) -> tuple[np.ndarray, np.ndarray]:
        """(first packed token, token count) int64[n] of each step row (step order)."""
        a, b = self.layout.fields["cu_q_lens"]
        cu = self.buf[a:b].astype(np.int64)
        return cu[self.rows_to_packed], cu[self.rows_to_packed + 1] - cu[self.rows_to_packed]


@functools.lru_cache(maxsize=8)
def _identity(n: int) -> np.ndarray:
    """int64[n] 0..n-1, read-only (shared by the steps of n rows)."""
    out = np.arange(n)
    out.flags.writeable = False
    return out


def pack_order(num_new: np.ndarray, num_forks: int) -> tuple[np.ndarray, np.ndarray]:
    """(order int64[n]: the step rows in packed order, rows_to_packed int64[n]: its inverse)."""
    n = len(num_new)
    kind = (num_new > 1).astype(np.int8)
    if num_forks:
        kind[n - num_forks:] = 2
    if (kind[1:] >= kind[:-1]).all():  # already in packed order (e.g. every row verifying drafts)
        identity = np.arange(n)
        return identity, identity
    order = np.argsort(kind, kind="stable")
    inverse = np.empty((n,), np.int64)
    inverse[order] = np.arange(n)
    return order, inverse


def pack_step(batch: InputBatch, rows: StepRows, *, buckets, layout_for, block_size: int, num_blocks: int,
              max_logprobs: int, block_copies: Sequence[tuple[int, int]], lora_slots: dict[int, int] | None,
              lora: bool) -> PackedStep:
    """Pack one step (see the module docstring): a steady decode step from the previous one, any other whole.
    Raises ValueError when a row's block table does not cover its tokens or the step exceeds the largest bucket."""
    packed = None if block_copies or lora else _repack_decode(batch, rows, buckets, block_size)
    if packed is None:
        packed = _pack_whole(batch, rows, buckets=buckets, layout_for=layout_for, block_size=block_size,
                             num_blocks=num_blocks, max_logprobs=max_logprobs, block_copies=block_copies,
                             lora_slots=lora_slots, lora=lora)
    batch.last_packed = packed if packed.reusable else None
    return packed


def _repack_decode(batch: InputBatch, rows: StepRows, buckets, block_size: int) -> PackedStep | None:
    """``pack_step`` of a decode step from ``batch.last_packed`` (a reusable step of the same rows in the same
    order: ``InputBatch._rows_of``' array), when every row is one token further and samples and the step keeps its
    bucket; None (nothing written) otherwise. The previous buffer is copied (the executable may still hold it) and
    only what changes is written: positions, KV lengths, input tokens (and placeholders), slots, sampling steps,
    and the block tables of the rows whose table the diff wrote (``InputBatch.table_diff_rows``)."""
    last, batch_rows = batch.last_packed, rows.batch_rows
    if last is None or batch_rows is not last.packed_batch_rows or rows.fork_parents or rows.num_drafts is not None:
        return None
    layout, n, starts = last.layout, len(batch_rows), rows.starts
    positions_at = layout.fields["positions"][0]
    ends = starts + 1
    if (not (rows.num_new == 1).all() or not np.array_equal(starts, last.buf[positions_at:positions_at + n] + 1)
            or not np.array_equal(ends, batch.num_tokens[batch_rows])
            or pick_bucket(buckets, n, n) != (layout.num_tokens, layout.num_seqs)):
        return None
    buf = last.buf.copy()
    views = {name: buf[a:b] for name, (a, b) in layout.fields.items()}
    groups = layout.num_kv_groups
    block_tables = views["block_tables"].reshape(layout.num_seqs, -1)
    table_lens = _covering_table_lens(batch, batch_rows, ends, groups, block_size)
    changed = batch.table_diff_rows
    if len(changed):
        width = int(table_lens[changed].max())
        block_tables[changed, :width] = batch.block_table[batch_rows[changed], :width]
    views["kv_lens"][:n] = ends
    views["positions"][:n] = starts
    identity = _identity(n)
    pack_group_slots(block_tables, identity, starts, block_size, groups, views["slot_mapping"])
    input_ids = batch.token_ids[batch_rows, starts]
    views["input_ids"][:n] = input_ids
    _feed_placeholders(batch, input_ids, batch_rows, rows.num_new, identity, views["prev_rows"])
    steps = np.maximum(ends - batch.num_prompt_tokens[batch_rows], 0)
    views["sampling"][_STEPS_FIELD * layout.num_sample_rows:][:n] = steps
    return dataclasses.replace(last, buf=buf)


def _pack_whole(batch: InputBatch, rows: StepRows, *, buckets, layout_for, block_size: int, num_blocks: int,
                max_logprobs: int, block_copies: Sequence[tuple[int, int]], lora_slots: dict[int, int] | None,
                lora: bool) -> PackedStep:
    """``pack_step`` from the batch's arrays alone."""
    num_forks = len(rows.fork_parents)
    num_rows = len(rows.batch_rows)
    num_tokens = int(rows.num_new.sum())
    # A decode step (one new token per row, no forks) is already in packed order: no reordering copies.
    decode = num_tokens == num_rows and not num_forks
    if decode:
        order = rows_to_packed = _identity(num_rows)
        batch_rows, q_lens, starts = rows.batch_rows, rows.num_new, rows.starts
    else:
        order, rows_to_packed = pack_order(rows.num_new, num_forks)
        batch_rows, q_lens, starts = rows.batch_rows[order], rows.num_new[order], rows.starts[order]
    ends = starts + q_lens
    num_drafts = None if rows.num_drafts is None else rows.num_drafts[order]
    known_ends = ends if num_drafts is None else ends - num_drafts  # drafts follow the row's known tokens
    sampled = known_ends == batch.num_tokens[batch_rows]
    if num_forks:
        sampled[num_rows - num_forks:] = True
    num_sample_rows = num_rows + (0 if num_drafts is None else int(num_drafts.sum()))
    bucket_tokens, bucket_seqs = pick_bucket(buckets, num_tokens, num_rows, num_sample_rows=num_sample_rows,
                                             sample_rows_of=lambda bucket: layout_for(*bucket).num_sample_rows)
    layout = layout_for(bucket_tokens, bucket_seqs)
    buf = np.zeros((layout.size,), np.int32)
    views = {name: buf[a:b] for name, (a, b) in layout.fields.items()}

    groups = layout.num_kv_groups
    block_tables, table_lens = _pack_block_tables(batch, batch_rows, ends, views["block_tables"], bucket_seqs, groups,
                                                  block_size)

    cu = np.cumsum(q_lens)
    views["cu_q_lens"][1:num_rows + 1] = cu
    views["cu_q_lens"][num_rows + 1:] = num_tokens  # padding seqs: q_len 0, kv_len 0; their tokens -> null slot
    views["kv_lens"][:num_rows] = ends  # fork rows: 0 (no tokens, no blocks)
    logits_indices = views["logits_indices"]
    logits_indices[:num_rows] = cu - 1
    for fork_row, parent in enumerate(rows.fork_parents):
        logits_indices[num_rows - num_forks + fork_row] = cu[rows_to_packed[parent]] - 1
    sample_batch_rows, sample_ends, drafting, draft_sample_rows = batch_rows, ends, None, None
    if num_drafts is not None:
        sample_batch_rows, sample_ends, drafting, draft_sample_rows = _draft_sample_rows(
            num_drafts, batch_rows, ends, cu, order, logits_indices)
    pack_block_copies(block_copies, views["copy_src"], views["copy_dst"], num_blocks)
    if "spec_rows" in views:
        _pack_spec_rows(views["spec_rows"], batch, batch_rows, ends, num_drafts, sampled, num_forks,
                        (drafting, None if draft_sample_rows is None else draft_sample_rows.first_rows()),
                        table_lens // groups * block_size)

    if decode:  # one token per row at position kv_len - 1
        token_rows, token_batch_rows, positions = order, batch_rows, starts
    else:
        token_rows = np.repeat(np.arange(num_rows), q_lens)
        token_batch_rows = batch_rows[token_rows]
        positions = np.arange(num_tokens) - np.repeat(cu - q_lens, q_lens) + np.repeat(starts, q_lens)
    views["positions"][:num_tokens] = positions
    pack_group_slots(block_tables, token_rows, positions, block_size, groups, views["slot_mapping"])
    input_ids = batch.token_ids[token_batch_rows, positions]
    views["input_ids"][:num_tokens] = input_ids
    _feed_placeholders(batch, input_ids, token_batch_rows, q_lens, token_rows, views["prev_rows"])
    if lora:
        views["lora_slot_ids"][:num_tokens] = _lora_slots(batch, batch_rows, lora_slots)[token_rows]

    sample_rows_sampled = sampled if len(sample_ends) == num_rows else np.concatenate(
        [sampled, np.ones((len(sample_ends) - num_rows,), bool)])
    sampling = _pack_sampling(batch, sample_batch_rows, sample_rows_sampled, sample_ends, views["sampling"],
                              layout.num_sample_rows, max_logprobs)
    prompt_targets = prompt_spans = None
    if batch.num_prompt_logprob_rows:
        prompt_targets, prompt_spans = _prompt_logprob_targets(batch, batch_rows, starts, q_lens, cu, bucket_tokens,
                                                               rows_to_packed)
    reusable = (sampling.pop("fast") and decode and num_drafts is None and not lora and not block_copies
                and prompt_targets is None and "spec_rows" not in views and bool(sampled.all()))
    return PackedStep(buf=buf, layout=layout, **sampling, rows_to_packed=rows_to_packed,
                      sampled=sampled[rows_to_packed], prompt_targets=prompt_targets, prompt_spans=prompt_spans,
                      packed_batch_rows=batch_rows, packed_sampled=sampled, draft_sample_rows=draft_sample_rows,
                      reusable=reusable)


def _pack_block_tables(batch: InputBatch, batch_rows: np.ndarray, ends: np.ndarray, out: np.ndarray, bucket_seqs: int,
                       groups: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows' block tables into ``out`` (the layout's flat field) as ``int32[bucket_seqs, width]``; returns that
    view and the rows' table lengths ``int[n]`` (``_covering_table_lens``)."""
    table_lens = _covering_table_lens(batch, batch_rows, ends, groups, block_size)
    width = int(table_lens.max()) if len(batch_rows) else 0
    block_tables = out.reshape(bucket_seqs, -1)
    block_tables[:len(batch_rows), :width] = batch.block_table[batch_rows, :width]
    return block_tables, table_lens


def _covering_table_lens(batch: InputBatch, batch_rows: np.ndarray, ends: np.ndarray, groups: int,
                         block_size: int) -> np.ndarray:
    """The rows' block-table lengths int64[n]; ValueError when a row's table does not cover its ``ends`` tokens
    (``groups`` entries per block)."""
    table_lens = batch.num_blocks[batch_rows]
    bad = table_lens // groups * block_size < ends
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"request {batch.req_ids[batch_rows[i]]!r}: a block table of {int(table_lens[i])} entries "
                         f"({groups} per block) does not cover {int(ends[i])} tokens")
    return table_lens


def _draft_sample_rows(num_drafts: np.ndarray, batch_rows: np.ndarray, ends: np.ndarray, cu: np.ndarray,
                       order: np.ndarray, logits_indices: np.ndarray):
    """Speculative decoding: one more sample row per draft token, after the packed rows' own (each of which samples
    its last position, the one after its last draft). A row with k drafts fed at positions p+1..p+k (p: its last
    known token) samples the target at p..p+k-1 too: the tokens that would follow each prefix, compared with the
    drafts by the verification. Writes their ``logits_indices``; returns (batch row int64[n + D] and end int64[n + D]
    (the sampled position + 1) of every sample row, the drafting rows (packed) int64[m], their ``DraftSampleRows`` or
    None without drafts)."""
    num_rows = len(batch_rows)
    draft_rows = np.flatnonzero(num_drafts)
    counts = num_drafts[draft_rows]
    owner = np.repeat(draft_rows, counts)  # the packed row of each draft sample row
    back = np.repeat(np.cumsum(counts), counts) - np.arange(len(owner))  # k, k - 1, ..., 1 for a row of k drafts
    if num_rows + len(owner) > len(logits_indices):
        raise ValueError(f"{num_rows} rows with {len(owner)} drafts exceed the bucket's {len(logits_indices)} "
                         "sample rows")
    logits_indices[num_rows:num_rows + len(owner)] = cu[owner] - 1 - back
    return (np.concatenate([batch_rows, batch_rows[owner]]), np.concatenate([ends, ends[owner] - back]), draft_rows,
            DraftSampleRows(order[draft_rows], counts, num_rows) if len(draft_rows) else None)


def _pack_spec_rows(view: np.ndarray, batch: InputBatch, batch_rows: np.ndarray, ends: np.ndarray,
                    num_drafts: np.ndarray | None, sampled: np.ndarray, num_forks: int,
                    first_draft_rows: tuple[np.ndarray | None, np.ndarray | None], capacity: np.ndarray) -> None:
    """A model drafter's words per packed sequence (``StepLayout.spec_rows``, int32[S, SPEC_ROW_WORDS]): drafts
    verified, the sample row of its first draft, the prompt token after a chunk that does not sample (0 otherwise),
    whether it proposes drafts (it samples and is no fork row), and the tokens its block table holds."""
    num_rows = len(batch_rows)
    words = view.reshape(-1, SPEC_ROW_WORDS)
    words[:] = 0
    if num_drafts is not None:
        words[:num_rows, 0] = num_drafts
    if first_draft_rows[1] is not None:  # (drafting packed rows int64[m], their first draft sample rows int64[m])
        words[first_draft_rows[0], 1] = first_draft_rows[1]
    pending = np.flatnonzero(~sampled)
    words[pending, 2] = batch.token_ids[batch_rows[pending], ends[pending]]
    words[:num_rows, 3] = sampled
    if num_forks:
        words[num_rows - num_forks:num_rows, 3] = 0
    words[:num_rows, 4] = capacity


def _feed_placeholders(batch: InputBatch, input_ids: np.ndarray, token_batch_rows: np.ndarray, q_lens: np.ndarray,
                       token_rows: np.ndarray, prev_rows: np.ndarray) -> None:
    """Tokens fed while still on the device (async scheduling) come from the previous step's samples: point their
    ``prev_rows`` entry (int32[T], -1 elsewhere) at the packed row that sampled them."""
    prev_rows[:] = -1
    placeholders = np.flatnonzero(input_ids < 0)
    if not len(placeholders):
        return
    rows = token_batch_rows[placeholders]
    sources = batch.prev_sample[rows]
    bad = (q_lens[token_rows[placeholders]] != 1) | (sources < 0)
    if bad.any():
        raise ValueError(f"request {batch.req_ids[rows[int(np.argmax(bad))]]!r}: a token still on the device can "
                         "only be fed alone, by the step after the one that sampled it")
    prev_rows[placeholders] = sources


def _lora_slots(batch: InputBatch, batch_rows: np.ndarray, lora_slots: dict[int, int] | None) -> np.ndarray:
    """int32[n] each packed row's adapter slot (0: none)."""
    ids = batch.lora_int_id[batch_rows]
    slots = np.zeros((len(batch_rows),), np.int32)
    for lora_int_id, slot in (lora_slots or {}).items():
        slots[ids == lora_int_id] = slot
    missing = (ids != 0) & (slots == 0)
    if missing.any():
        raise ValueError(f"request {batch.req_ids[batch_rows[int(np.argmax(missing))]]!r}: its LoRA adapter "
                         f"{int(ids[np.argmax(missing)])} has no slot in this step")
    return slots


def _pack_sampling(batch: InputBatch, batch_rows: np.ndarray, sampled: np.ndarray, ends: np.ndarray,
                   out: np.ndarray, num_sample_rows: int, max_logprobs: int) -> dict:
    """Sampling words of the packed rows into ``out`` and the sampler variant: rows' precomputed words unless some
    sampling row needs the general path this step (penalties, bans, the bias table; ``fast``: none does)."""
    steps = ends - batch.num_prompt_tokens[batch_rows]
    every_row_samples = bool(sampled.all())  # a decode step: no row selections to copy
    if not every_row_samples:
        steps[~sampled] = 0
    np.maximum(steps, 0, out=steps)  # fork rows: their first token
    sample_rows = batch_rows if every_row_samples else batch_rows[sampled]
    wanted = batch.num_logprobs[sample_rows]
    most_wanted = int(wanted.max()) if len(wanted) else -1
    wants_logprobs, wants_top = most_wanted >= 0, most_wanted > 0
    # Rows below their min_tokens ban stop ids and EOS; others that need the general path need it every step.
    general = batch.general_sampling[sample_rows] | ((steps if every_row_samples else steps[sampled])
                                                     < batch.min_tokens[sample_rows])
    history = bias_table = None
    fast = not general.any()
    if not fast:
        rows = [_general_row(batch, int(row), int(step)) if s else None
                for row, step, s in zip(batch_rows.tolist(), steps.tolist(), sampled.tolist())]
        tensors, mode = sampler_lib.build_sampling_tensors(
            rows, num_sample_rows, penalty_len=batch.max_model_len, eos_token_ids=batch.eos_token_ids,
            vocab_size=batch.vocab_size)
        sampler_lib.pack_sampling_tensors(tensors, out)
        bias_table = sampler_lib.pack_bias_table(tensors)
        history = tensors.prev_token_ids if tensors.prev_token_ids.shape[1] > 0 else None
    else:
        words = batch.sampling_words[batch_rows]
        sampler_lib.pack_sampling_rows(words, steps, _PADDING_WORDS, out)
        if not every_row_samples:  # rows that do not sample stay greedy padding
            vectors = out[:len(_PADDING_WORDS) * num_sample_rows].reshape(len(_PADDING_WORDS), num_sample_rows)
            vectors[:, np.flatnonzero(~sampled)] = _PADDING_WORDS[:, None]
        rank = int(batch.mode_rank[sample_rows].max()) if len(sample_rows) else _GREEDY_RANK
        mode = sampler_lib.MODE_ORDER[rank]
    if wants_logprobs and mode == sampler_lib.SamplingMode.GREEDY:
        mode = _GREEDY_OR_TEMPERATURE  # all rows greedy: the same argmax, plus the logprobs (the greedy variant's none)
    return dict(history=history, bias_table=bias_table, mode=mode,
                num_logprobs=max_logprobs if wants_top else 0, wants_logprobs=wants_logprobs, fast=fast)


def _general_row(batch: InputBatch, row: int, step: int):
    """``build_sampling_tensors``' row tuple of a batch row sampling its output ``step``; its tokens only when the
    sampler reads them (penalties read the prompt and outputs, bad words the outputs)."""
    params = batch.params[row]
    if params is None:  # a row without parameters of its own samples greedily, as padding does
        return None
    if not (params.uses_penalties or params.bad_words_token_ids):
        return params, batch.seeds[row], step, (), ()
    # The outputs before the one sampled: a draft position's include the drafts before it (speculative decoding).
    num_prompt = int(batch.num_prompt_tokens[row])
    outputs = batch.token_ids[row, num_prompt:num_prompt + step].tolist()
    return params, batch.seeds[row], step, batch.prompt_token_ids(row) if params.uses_penalties else (), outputs


_PADDING_WORDS = sampler_lib.padding_row_words()


def _prompt_logprob_targets(batch: InputBatch, batch_rows: np.ndarray, starts: np.ndarray, q_lens: np.ndarray,
                            cu: np.ndarray, num_tokens: int, rows_to_packed: np.ndarray):
    """(targets int32[num_tokens] (-1: none) or None, per step row ``(first packed token, count)`` or None) for the
    rows computing prompt logprobs: position p of a prompt chunk targets prompt token p + 1."""
    wanted = np.flatnonzero(batch.prompt_logprobs[batch_rows] & (q_lens > 0))
    if not len(wanted):
        return None, None
    targets = np.full((num_tokens,), -1, np.int32)
    spans: list[tuple[int, int] | None] = [None] * len(batch_rows)
    for packed in wanted.tolist():
        row, start = int(batch_rows[packed]), int(starts[packed])
        stop = min(start + int(q_lens[packed]), int(batch.num_prompt_tokens[row]) - 1)
        if stop <= start:
            continue
        first = int(cu[packed] - q_lens[packed])
        targets[first:first + stop - start] = batch.token_ids[row, start + 1:stop + 1]
        spans[packed] = (first, stop - start)
    if not any(spans):
        return None, None
    return targets, [spans[packed] for packed in rows_to_packed.tolist()]
