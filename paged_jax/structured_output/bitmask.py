"""The step's grammar bitmask (host side). On the device it goes through ``logit_processing.apply_allowed_token_mask`` (the
same packed layout as ``allowed_token_ids``), in its own small jitted call before the sampler (``ModelRunner``).

Why a second host-to-device transfer, only on steps with a constrained row, instead of a field of the one step
buffer: the mask is ``ceil(V / 32)`` words per row (19 KB a row at a 152k vocabulary, megabytes for a full batch),
so a fixed slot in the step buffer would make every step, constrained or not, copy and unpack it; a per-step flag
cannot change the buffer's compiled shape. It follows the rule already used for the penalty history and the bias
table: large per-row state travels apart, only when some row uses it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from paged_jax.worker.sampler import allowed_mask_words
from paged_jax.structured_output.manager import SequenceGrammar


def fill_step_bitmask(grammars: Sequence[SequenceGrammar | None], num_rows: int,
                      vocab_size: int) -> np.ndarray | None:
    """i32[num_rows, allowed_mask_words(V)]: row i from ``grammars[i]`` (rows without a grammar, and padding rows past
    ``len(grammars)``, all ones = every token allowed); None when no row has a grammar (nothing to send)."""
    if all(grammar is None for grammar in grammars):
        return None
    bitmask = np.full((num_rows, allowed_mask_words(vocab_size)), -1, np.int32)
    matchers, rows, backend = [], [], None
    for row, grammar in enumerate(grammars):
        if grammar is None:
            continue
        matcher = grammar.live_matcher()
        if matcher is None:  # ended or failed: stop tokens only
            bitmask[row] = grammar.stop_only_row
        else:
            matchers.append(matcher)
            rows.append(row)
            backend = grammar.backend
    if matchers:
        backend.fill_rows(matchers, bitmask, rows)
    return bitmask
