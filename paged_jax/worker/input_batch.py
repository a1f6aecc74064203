"""The model runner's persistent batch (vLLM V1's ``InputBatch``): one row per request the runner holds, in
preallocated host arrays updated in place from each step's ``SchedulerOutput`` diff; a finished row is filled by
the last row (rows stay dense), so nothing is rebuilt per step.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from paged_jax.worker import sampler as sampler_lib
from paged_jax.core.sched_output import CachedRequestData, NewRequestData


class InputBatch:
    """Rows of the requests the runner holds.

    Args:
      max_num_reqs: rows (the scheduler never runs more requests at once).
      max_model_len: tokens per row.
      max_blocks_per_seq: block-table entries per row.
      eos_token_ids / vocab_size: for each row's sampling words (``sampler.sampling_row_words``).

    Per row (arrays of ``max_num_reqs`` rows; ``num_rows`` leading rows are in use):
      token_ids: int32[N, max_model_len] the prompt, then the outputs fed so far (``PLACEHOLDER_TOKEN`` where a
        token was still on the device when it was fed, and stays so: rows whose sampling reads their outputs
        (penalties, bad words) are always fed real tokens, the engine waits for them); num_tokens int64[N] how
        many; num_prompt_tokens int64[N].
      block_table: int32[N, max_blocks_per_seq]; num_blocks int64[N].
      sampling_words: int32[N, len(SAMPLING_WIRE_FIELDS)]; mode_rank int8[N] (index in ``sampler.MODE_ORDER``);
      general_sampling: bool[N] (rows whose steps need ``build_sampling_tensors``); min_tokens int64[N] (below it
      a step needs it too);
      num_logprobs: int32[N] top logprobs wanted (-1: no logprob at all).
      lora_int_id: int32[N]; prompt_logprobs: bool[N].
      prev_sample: int32[N] the packed row of the previous step that sampled this row's token (-1: none).
      params / seeds: the rows' ``SamplingParams`` and seeds (lists, for the general sampling path).

    Between steps: ``table_diff_rows`` int64[k], the entries of the last ``apply_cached`` diff whose block table it
    wrote, and ``last_packed``, the last step packed from the batch when the next steady decode step may be packed
    from it (``step_packing``; None otherwise).
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_seq: int, *,
                 eos_token_ids: Sequence[int], vocab_size: int):
        n = max_num_reqs
        self.max_num_reqs = n
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = vocab_size
        self.req_ids: list[str] = []
        self.row_of: dict[str, int] = {}
        self.token_ids = np.zeros((n, max_model_len), np.int32)
        self.num_tokens = np.zeros((n,), np.int64)
        self.num_prompt_tokens = np.zeros((n,), np.int64)
        self.block_table = np.zeros((n, max_blocks_per_seq), np.int32)
        self.num_blocks = np.zeros((n,), np.int64)
        self.sampling_words = np.zeros((n, len(sampler_lib.SAMPLING_WIRE_FIELDS)), np.int32)
        self.mode_rank = np.zeros((n,), np.int8)
        self.general_sampling = np.zeros((n,), bool)
        self.min_tokens = np.zeros((n,), np.int64)
        self.num_logprobs = np.full((n,), -1, np.int32)
        self.lora_int_id = np.zeros((n,), np.int32)
        self.prompt_logprobs = np.zeros((n,), bool)
        self.prev_sample = np.full((n,), -1, np.int32)
        self.num_prompt_logprob_rows = 0  # rows with ``prompt_logprobs`` set (none: packing skips them whole)
        self.params: list = [None] * n
        self.seeds: list[int] = [0] * n
        self._per_row_arrays = (self.num_tokens, self.num_prompt_tokens, self.num_blocks, self.sampling_words,
                                self.mode_rank, self.general_sampling, self.min_tokens, self.num_logprobs,
                                self.lora_int_id, self.prompt_logprobs, self.prev_sample)
        # Bumped whenever a row is made or moved: ``_rows_of``' last answer is good while it stays.
        self._version = 0
        self._last_rows: tuple[list[str], np.ndarray, int] = ([], np.zeros((0,), np.int64), -1)
        self.table_diff_rows = np.zeros((0,), np.int64)
        self.last_packed = None

    @property
    def num_rows(self) -> int:
        return len(self.req_ids)

    def add(self, new: NewRequestData) -> int:
        """Make ``new``'s row (its tokens, blocks and sampling words); returns the row."""
        if new.req_id in self.row_of:
            raise ValueError(f"request {new.req_id!r} already has a row in the runner's batch")
        if self.num_rows == self.max_num_reqs:
            raise ValueError(f"the runner's batch is full ({self.max_num_reqs} rows): request {new.req_id!r}")
        num_prompt, num_tokens = len(new.prompt_token_ids), len(new.prompt_token_ids) + len(new.output_token_ids)
        if num_tokens > self.max_model_len:
            raise ValueError(f"request {new.req_id!r} has {num_tokens} tokens, over max_model_len="
                             f"{self.max_model_len}")
        row = self.num_rows
        self._version += 1
        self.req_ids.append(new.req_id)
        self.row_of[new.req_id] = row
        self.token_ids[row, :num_prompt] = new.prompt_token_ids
        self.token_ids[row, num_prompt:num_tokens] = new.output_token_ids
        self.num_tokens[row], self.num_prompt_tokens[row] = num_tokens, num_prompt
        self.set_blocks(row, 0, new.block_ids)
        params = new.params
        self.params[row], self.seeds[row] = params, new.seed
        if params is not None:
            words, rank, general = sampler_lib.sampling_row_words(
                params, new.seed, num_prompt, eos_token_ids=self.eos_token_ids, vocab_size=self.vocab_size)
            self.sampling_words[row], self.mode_rank[row], self.general_sampling[row] = words, rank, general
            self.min_tokens[row] = params.min_tokens
            logprobs = params.sampled_logprobs
            self.num_logprobs[row] = -1 if logprobs is None else logprobs
        else:  # rows that never sample with parameters of their own: greedy
            self.sampling_words[row] = sampler_lib.padding_row_words()
            self.mode_rank[row], self.general_sampling[row], self.min_tokens[row] = 0, False, 0
            self.num_logprobs[row] = -1
        self.lora_int_id[row] = new.lora_int_id
        self.prompt_logprobs[row] = new.prompt_logprobs
        self.num_prompt_logprob_rows += bool(new.prompt_logprobs)
        self.prev_sample[row] = -1
        return row

    def remove(self, req_id: str) -> None:
        """Drop ``req_id``'s row (if it has one): the last row moves into its place."""
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        self._version += 1
        self.num_prompt_logprob_rows -= bool(self.prompt_logprobs[row])
        last = self.num_rows - 1
        moved_id = self.req_ids.pop()
        if row == last:
            return
        self.req_ids[row] = moved_id
        self.row_of[moved_id] = row
        num_tokens, num_blocks = int(self.num_tokens[last]), int(self.num_blocks[last])
        self.token_ids[row, :num_tokens] = self.token_ids[last, :num_tokens]
        self.block_table[row, :num_blocks] = self.block_table[last, :num_blocks]
        for array in self._per_row_arrays:
            array[row] = array[last]
        self.params[row], self.seeds[row] = self.params[last], self.seeds[last]

    def set_blocks(self, row: int, start: int, block_ids: Sequence[int]) -> None:
        """Write ``block_ids`` into the row's table from entry ``start``; the table ends after them."""
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            raise ValueError(f"request {self.req_ids[row]!r}: a block table of {end} blocks, over the "
                             f"{self.block_table.shape[1]} of max_model_len={self.max_model_len}")
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def apply_cached(self, cached: CachedRequestData) -> np.ndarray:
        """Apply the running requests' diffs (new tokens appended, new block ids written); returns their rows
        int64[len(cached.req_ids)]."""
        num = len(cached.req_ids)
        rows = self._rows_of(cached.req_ids)
        if cached.decode_token_ids is not None:  # one token per row, as a column
            self._append_one_token(rows, cached.decode_token_ids)
            lens = total = 0
        else:
            lens = np.fromiter(map(len, cached.new_token_ids), np.int64, num)
            total = int(lens.sum())
        if total:
            starts = self.num_tokens[rows]
            if int((starts + lens).max()) > self.max_model_len:
                raise ValueError(f"a running request grows past max_model_len={self.max_model_len}")
            if total == num and int(lens.min()) == 1:  # one token per row (decodes): a plain scatter
                self.token_ids[rows, starts] = np.fromiter(
                    itertools.chain.from_iterable(cached.new_token_ids), np.int32, num)
            else:
                self.token_ids[_spans(rows, starts, lens)] = np.fromiter(
                    itertools.chain.from_iterable(cached.new_token_ids), np.int32, total)
            self.num_tokens[rows] = starts + lens
        new_block_ids = cached.new_block_ids
        block_lens = np.fromiter(map(len, new_block_ids), np.int64, num)
        crossed = self.table_diff_rows = np.flatnonzero(block_lens)  # (a decode: rows entering a new block)
        if len(crossed):
            picked = crossed.tolist()
            lens, crossed_rows = block_lens[crossed], rows[crossed]
            starts = np.fromiter(map(cached.block_starts.__getitem__, picked), np.int64, len(picked))
            ends = starts + lens
            if int(ends.max()) > self.block_table.shape[1]:
                i = int(np.argmax(ends))
                raise ValueError(f"request {self.req_ids[crossed_rows[i]]!r}: a block table of {int(ends[i])} "
                                 f"blocks, over the {self.block_table.shape[1]} of max_model_len={self.max_model_len}")
            ids = np.fromiter(itertools.chain.from_iterable(map(new_block_ids.__getitem__, picked)), np.int32,
                              int(lens.sum()))
            if len(ids) == len(picked):  # one new block per row (decodes entering their next block): a scatter
                self.block_table[crossed_rows, starts] = ids
            else:
                self.block_table[_spans(crossed_rows, starts, lens)] = ids
            self.num_blocks[crossed_rows] = ends
        return rows

    def _append_one_token(self, rows: np.ndarray, token_ids: list[int]) -> None:
        """Append ``token_ids[i]`` to row ``rows[i]``."""
        if len(token_ids) != len(rows):
            raise ValueError(f"decode_token_ids has {len(token_ids)} entries for {len(rows)} running requests")
        starts = self.num_tokens[rows]
        if len(rows) and int(starts.max()) >= self.max_model_len:
            raise ValueError(f"a running request grows past max_model_len={self.max_model_len}")
        self.token_ids[rows, starts] = np.fromiter(token_ids, np.int32, len(rows))
        self.num_tokens[rows] = starts + 1

    def feed_drafts(self, req_ids: list[str], spec_token_ids: dict[str, list[int]], batch_rows: np.ndarray
                    ) -> np.ndarray:
        """Write the draft tokens of step rows ``req_ids`` (batch rows ``batch_rows`` int64[n]) after their known
        ones (fed, not held: ``num_tokens`` stays, the next diff overwrites them); returns the drafts per step row
        int64[n]."""
        num_drafts = np.zeros((len(batch_rows),), np.int64)
        for step_row, req_id in enumerate(req_ids):
            drafts = spec_token_ids.get(req_id)
            if drafts:
                row = int(batch_rows[step_row])
                start = int(self.num_tokens[row])
                if start + len(drafts) > self.max_model_len:
                    raise ValueError(f"request {req_id!r}: drafts reach past max_model_len={self.max_model_len}")
                self.token_ids[row, start:start + len(drafts)] = drafts
                num_drafts[step_row] = len(drafts)
        return num_drafts

    def _rows_of(self, req_ids: list[str]) -> np.ndarray:
        """The rows of ``req_ids`` int64[n]; the last step's answer while neither the ids nor the rows changed (the
        running requests of a steady decode)."""
        last_ids, last_rows, last_version = self._last_rows
        if last_version == self._version and req_ids == last_ids:
            return last_rows
        try:
            rows = np.fromiter(map(self.row_of.__getitem__, req_ids), np.int64, len(req_ids))
        except KeyError as e:
            raise ValueError(f"request {e.args[0]!r} is scheduled as running but has no row in the runner's batch "
                             "(send it as new)") from None
        rows.flags.writeable = False  # shared by the steps that reuse it (and their packed rows)
        self._last_rows = (req_ids, rows, self._version)
        return rows

    def output_token_ids(self, row: int) -> list[int]:
        """The row's outputs fed so far."""
        return self.token_ids[row, self.num_prompt_tokens[row]:self.num_tokens[row]].tolist()

    def prompt_token_ids(self, row: int) -> list[int]:
        return self.token_ids[row, :self.num_prompt_tokens[row]].tolist()


def _spans(rows: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index arrays (row, column) int64[sum(lens)] of ``lens[i]`` entries from column ``starts[i]`` of row
    ``rows[i]``, in order."""
    offsets = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    return np.repeat(rows, lens), np.repeat(starts, lens) + offsets
