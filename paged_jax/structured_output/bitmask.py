"""The step's grammar bitmask (host side). On the device it goes through ``logit_processing.apply_allowed_token_mask`` (the
same packed layout as ``allowed_token_ids``), in its own small jitted call before the sampler (``ModelRunner``).

Why a second host-to-device transfer, only on steps with a constrained row, instead of a field of the one step
buffer: the mask is ``ceil(V / 32)`` words per row (19 KB a row at a 152k vocabulary, megabytes for a full batch),
so a fixed slot in the step buffer would make every step, constrained or not, copy and unpack it; a per-step flag
cannot change the buffer's compiled shape. It follows the rule already used for the penalty history and the bias
table: large per-row state travels apart, only when some row uses it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from paged_jax.worker.sampler import allowed_mask_words
from paged_jax.structured_output.manager import SequenceGrammar

if TYPE_CHECKING:
    from paged_jax.worker.step_packing import PackedStep


def step_grammars(grammars: Mapping[str, SequenceGrammar], spec_token_ids: Mapping[str, list[int]],
                  req_ids: Sequence[str | None], packed: PackedStep) -> tuple[list, dict] | None:
    """The grammar of each packed row of ``packed`` that samples (None: unconstrained; ``req_ids``: the request of
    each batch row) and, for the constrained rows that verify drafts, packed row -> (its drafts, the sample row of
    its first draft): ``fill_step_bitmask``'s ``grammars`` and ``drafts``. None when no row has a grammar."""
    if not grammars:
        return None
    out = [grammars.get(req_ids[row]) if sampled else None
           for row, sampled in zip(packed.packed_batch_rows.tolist(), packed.packed_sampled.tolist())]
    if all(g is None for g in out):
        return None
    drafting, drafts = packed.draft_sample_rows, {}
    for step_row, first in ([] if drafting is None else zip(drafting.step_rows, drafting.first_rows().tolist())):
        row = int(packed.rows_to_packed[step_row])
        if out[row] is not None:
            drafts[row] = (spec_token_ids[req_ids[packed.packed_batch_rows[row]]], first)
    return out, drafts


def fill_step_bitmask(grammars: Sequence[SequenceGrammar | None], num_rows: int, vocab_size: int,
                      drafts: Mapping[int, tuple[Sequence[int], int]] | None = None) -> np.ndarray | None:
    """i32[num_rows, allowed_mask_words(V)]: row i from ``grammars[i]`` (rows without a grammar, and padding rows past
    ``len(grammars)``, all ones = every token allowed); None when no row has a grammar (nothing to send).

    ``drafts`` (speculative decoding): row i -> (its k draft tokens, the sample row of its first draft) for the
    constrained rows that verify drafts. Such a row's grammar decides k + 1 rows: draft position j's sample row
    (``first + j``) gets the mask after the grammar has accepted ``drafts[:j]``, row i itself (which samples after
    the last draft) the mask after all k; the grammar is left where it was (``XgrammarBackend.fill_draft_rows``)."""
    if all(grammar is None for grammar in grammars):
        return None
    drafts = drafts or {}
    bitmask = np.full((num_rows, allowed_mask_words(vocab_size)), -1, np.int32)
    matchers, row_drafts, rows, backend, stop_only = [], [], [], None, None
    for row, grammar in enumerate(grammars):
        if grammar is None:
            continue
        tokens, first = drafts.get(row, ((), 0))
        sample_rows = [*range(first, first + len(tokens)), row]
        matcher = grammar.live_matcher()
        if matcher is None:  # ended or failed: stop tokens only
            bitmask[sample_rows] = grammar.stop_only_row
        else:
            matchers.append(matcher)
            row_drafts.append(tokens)
            rows.append(sample_rows)
            backend, stop_only = grammar.backend, grammar.stop_only_row
    if not matchers:
        return bitmask
    if not any(row_drafts):  # one row each: one batch fill
        backend.fill_rows(matchers, bitmask, [sample_rows[0] for sample_rows in rows])
    else:
        backend.fill_draft_rows(matchers, row_drafts, rows, bitmask, stop_only)
    return bitmask
