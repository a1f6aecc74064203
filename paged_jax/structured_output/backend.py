"""The grammar backend: xgrammar. Turns a ``StructuredOutputsParams`` into an ``xgrammar.Grammar`` (parsing only:
milliseconds, and where an invalid spec is caught, as a ValueError naming its field), compiles grammars against the
tokenizer (the expensive part, run on the manager's thread pool) and makes matchers.

Why xgrammar (over llguidance, also maintained and installed): its per-token mask is computed from a token-mask
cache built at compile time, so filling a row of the bitmask, which happens on the step's critical path for every
constrained row, is a few microseconds; llguidance compiles lazily (much faster compiles) but pays for it in the
per-token mask, with long tails. Compiles are cached and run off the critical path, masks are not.
benchmarks/RESULTS.md has the measurements.

Spec -> grammar, as vLLM's xgrammar backend: ``json`` (``any_whitespace`` unless ``disable_any_whitespace``; strict
mode: no properties beyond the listed ones unless the schema allows them), ``json_object`` (any JSON object),
``regex``, ``choice`` (an EBNF alternation of the quoted strings), ``grammar`` (EBNF with ``::=``, else Lark),
``structural_tag`` (vLLM's ``{"structures", "triggers"}`` form or xgrammar's own).
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from paged_jax.sampling_params import StructuredOutputsParams

# Rows from which the bitmask fill fans out over threads (vLLM's threshold). Below it one thread is faster: on the
# GPU host xgrammar's threaded fill of a few dozen rows took longer than one thread's (benchmarks/structured.py
# times both at the run's row count; RESULTS.md).
PARALLEL_FILL_MIN_ROWS = 128

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest is the useful message.
_CPP_ERROR_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")


def _clean_error(exc: Exception) -> str:
    return _CPP_ERROR_PREFIX.sub("", str(exc)).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def spec_key(spec: StructuredOutputsParams) -> str:
    """The cache key of a spec: its constraint and the options that change the grammar, as canonical JSON."""
    value: Any = getattr(spec, spec.kind)
    if spec.kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            pass  # parse_grammar reports it
    return json.dumps([spec.kind, value, spec.disable_any_whitespace], sort_keys=True, default=str)


def _choice_ebnf(choices: Sequence[str]) -> str:
    """``root ::= "a" | "b"`` with the strings escaped for EBNF (JSON string escapes are xgrammar's)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def parse_grammar(spec: StructuredOutputsParams):
    """-> ``xgrammar.Grammar`` for ``spec``. Raises ValueError naming the spec's field (``json``, ``regex``,
    ``choice``, ``grammar``, ``structural_tag``) when it does not parse."""
    import xgrammar as xgr

    kind = spec.kind
    value = getattr(spec, kind)
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(value if isinstance(value, str) else json.dumps(value),
                                                any_whitespace=not spec.disable_any_whitespace)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=not spec.disable_any_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(value)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(_choice_ebnf(value))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(value) if "::=" in value else xgr.Grammar.from_lark(value)
        tag = json.loads(value)
        if isinstance(tag, dict) and "structures" in tag:  # vLLM's form
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in tag["structures"]]
            return xgr.Grammar.from_structural_tag(items, list(tag.get("triggers", ())))
        return xgr.Grammar.from_structural_tag(value)
    except Exception as exc:  # xgrammar raises RuntimeError / its own errors / KeyError, TypeError on bad shapes
        raise ValueError(f"{kind}: cannot be compiled into a grammar: {_clean_error(exc)}") from exc


class XgrammarBackend:
    """Compiles grammars for one tokenizer and vocabulary.

    Args:
      tokenizer: the engine's HF tokenizer.
      vocab_size: V, the model's vocabulary (>= the tokenizer's; ids past the tokenizer's are never allowed).
      stop_token_ids: the engine's EOS ids: allowed only where the grammar may end, and then the only ones allowed.
      max_threads: xgrammar's threads per compile.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int], max_threads: int = 1):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        # The grammars' vocabulary: the tokenizer's ids (and the stop ids). Ids past them (the model's padding rows,
        # e.g. a vocabulary padded to a multiple of 128) never continue a grammar; xgrammar would count each as a
        # special token, a list it scans on every accepted token, so they stay out and ``fill_rows`` bans them.
        self.stop_token_ids = sorted({int(t) for t in stop_token_ids if 0 <= int(t) < vocab_size})
        self.grammar_vocab_size = min(vocab_size, max([*tokenizer.get_vocab().values(), *self.stop_token_ids]) + 1)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.grammar_vocab_size,
                                                  stop_token_ids=self.stop_token_ids or None)
        # Our own cache (StructuredOutputManager) keeps compiled grammars by spec; xgrammar's would be a second copy.
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)

    def compile(self, grammar):
        """``xgrammar.Grammar`` -> ``xgrammar.CompiledGrammar`` (the slow part: builds its token-mask cache)."""
        return self._compiler.compile_grammar(grammar)

    @staticmethod
    def new_matcher(compiled):
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)


    def fill_rows(self, matchers: Sequence, bitmask: np.ndarray, rows: Sequence[int]) -> None:
        """Write the allowed next tokens of each of ``matchers`` into its row ``rows[i]`` of the step's ``bitmask``
        (i32[R, ceil(V / 32)]) in one xgrammar call (``BatchGrammarMatcher``: one Python -> C++ crossing for the
        whole step instead of one per row; from ``PARALLEL_FILL_MIN_ROWS`` rows on, over up to 8 threads). Ids past
        ``grammar_vocab_size`` are banned."""
        threads = fill_threads(len(matchers))
        words = -(-self.grammar_vocab_size // 32)
        if words == bitmask.shape[1]:
            _batch_matcher(threads).batch_fill_next_token_bitmask(list(matchers), bitmask, list(rows))
            return
        narrow = np.empty((len(matchers), words), np.int32)  # xgrammar fills whole C-contiguous rows only
        _batch_matcher(threads).batch_fill_next_token_bitmask(list(matchers), narrow)
        bitmask[rows, :words] = narrow
        bitmask[rows, words:] = 0

    def fill_draft_rows(self, matchers: Sequence, drafts: Sequence[Sequence[int]], rows: Sequence[Sequence[int]],
                        bitmask: np.ndarray, stop_only_row: np.ndarray) -> None:
        """Speculative decoding: ``matchers[i]`` decides the ``len(drafts[i]) + 1`` rows ``rows[i]`` of ``bitmask``
        (i32[R, ceil(V / 32)]), row j the allowed tokens after it has accepted ``drafts[i][:j]`` (vLLM's bitmask of
        every draft position). Position by position over the whole step: one ``fill_rows`` and one batch accept per
        draft position, then every matcher is rolled back to where it was (xgrammar's rollback). A matcher that
        ends on a draft (a stop token) leaves its later rows to ``stop_only_row``; one that refuses a draft (drafts
        are validated before they are scheduled, ``SequenceGrammar.validate_tokens``, so only defensively) repeats
        its last row: that draft is masked out at its own position, so nothing after it is ever kept.

        Why not xgrammar's ``GrammarMatcher.traverse_draft_tree`` (a chain is a tree): one call per matcher rather
        than per position, and it raises on a draft that ends the grammar (the stop token, a valid draft)."""
        batch = _batch_matcher(1)
        live = list(range(len(matchers)))
        frozen: dict[int, np.ndarray] = {}  # matcher -> the row its later positions repeat
        num_accepted = [0] * len(matchers)
        for pos in range(max(map(len, drafts), default=0) + 1):
            live = [i for i in live if pos <= len(drafts[i])]
            if live:
                self.fill_rows([matchers[i] for i in live], bitmask, [rows[i][pos] for i in live])
            for i, row in frozen.items():
                if pos <= len(drafts[i]):
                    bitmask[rows[i][pos]] = row
            advancing = [i for i in live if pos < len(drafts[i])]
            if not advancing:
                continue
            accepted = batch.batch_accept_token([matchers[i] for i in advancing],
                                                [int(drafts[i][pos]) for i in advancing])
            for i, ok in zip(advancing, accepted):
                num_accepted[i] += ok
                if not ok or matchers[i].is_terminated():
                    frozen[i] = stop_only_row if ok else bitmask[rows[i][pos]].copy()
            live = [i for i in live if i not in frozen]
        rolled = [i for i, n in enumerate(num_accepted) if n]
        if rolled:
            batch.batch_rollback([matchers[i] for i in rolled], [num_accepted[i] for i in rolled])


def fill_threads(num_rows: int) -> int:
    """xgrammar threads for a step's fill of ``num_rows`` grammar rows: one below ``PARALLEL_FILL_MIN_ROWS``, else up
    to 8 (half the host's cores: the engine loop and the device runtime keep theirs)."""
    return 1 if num_rows < PARALLEL_FILL_MIN_ROWS else max(1, min(8, (os.cpu_count() or 2) // 2))


@functools.lru_cache(maxsize=2)
def _batch_matcher(max_threads: int):
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher(max_threads=max_threads)
