"""Grammar compilation off the step's critical path, and the per-sequence matcher.

``StructuredOutputManager.grammar_for(spec)`` parses the spec on the caller's thread (a spec that does not parse is a
ValueError naming its field, raised by ``LLMEngine.add_request``) and compiles it on a small thread pool; compiled
grammars are cached by the spec (``backend.spec_key``, LRU), so a repeated schema is ready at once. A request whose
grammar is still compiling waits in the scheduler's waiting queue (``Request.grammar.is_ready``), as vLLM's
WAITING_FOR_FSM requests do; the rest of the batch runs on.

``SequenceGrammar`` is one output sequence's matcher (n > 1: one each). It advances only with real, confirmed tokens
(``EngineCore._token_outputs``, in output order, also under async scheduling where a token reaches the host a step
late; a row that verified drafts: its kept drafts and the token after them), so it always describes
``request.output_token_ids``: a preemption (recompute or swap) keeps the output tokens, hence the matcher needs no
rollback, and a token sampled for a sequence that already ended is never fed to it. Speculative decoding advances it
through a sequence's drafts twice and rolls it back each time: to validate them before they are scheduled
(``validate_tokens``) and to fill the bitmask of every draft position (``bitmask.fill_step_bitmask``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from collections.abc import Sequence

import numpy as np

from paged_jax.worker.sampler import allowed_mask_words
from paged_jax.sampling_params import StructuredOutputsParams
from paged_jax.structured_output.backend import XgrammarBackend, parse_grammar, spec_key

logger = logging.getLogger(__name__)


class SequenceGrammar:
    """The grammar state of one output sequence. ``is_ready`` once its grammar is compiled; then ``live_matcher``
    decides the allowed next tokens (``bitmask.fill_step_bitmask``) and ``accept`` advances with the sampled token.
    After the grammar has ended (the matcher accepted a stop token) or failed, only the stop tokens are allowed."""

    def __init__(self, compiled: concurrent.futures.Future, manager: "StructuredOutputManager"):
        self._compiled = compiled
        self._manager = manager
        self._matcher = None
        self.error: str | None = None  # why the constraint could not be followed (then only stop tokens are allowed)

    @property
    def is_ready(self) -> bool:
        return self._compiled.done()

    def _get_matcher(self):
        if self._matcher is None and self.error is None:
            try:
                self._matcher = XgrammarBackend.new_matcher(self._compiled.result())
            except Exception as exc:  # a compile that failed in the pool: end the sequence, disturb nothing else
                self.error = f"grammar compilation failed: {exc}"
                logger.error("structured output: %s", self.error)
        return self._matcher

    @property
    def is_terminated(self) -> bool:
        """The grammar has ended (a stop token was accepted where it may end)."""
        matcher = self._get_matcher()
        return matcher is None or matcher.is_terminated()

    def accept(self, token_id: int) -> None:
        """Advance with the sampled ``token_id`` (ignored once terminated or failed)."""
        matcher = self._get_matcher()
        if matcher is None or matcher.is_terminated():
            return
        if not matcher.accept_token(int(token_id)):
            # Only a token the mask allowed can be sampled, unless another rule emptied the row (min_tokens banning
            # the stop token of a finished grammar): from here on only stop tokens.
            self.error = f"token {int(token_id)} does not continue the grammar"
            self._matcher = None
            logger.warning("structured output: %s; only stop tokens are allowed from here on", self.error)

    def validate_tokens(self, token_ids: Sequence[int]) -> list[int]:
        """The longest prefix of ``token_ids`` (a sequence's drafts) the grammar allows from where it is (vLLM's
        ``validate_tokens``): the matcher advances through them and is rolled back; [] once ended or failed."""
        matcher = self.live_matcher()
        count = 0
        while (matcher is not None and count < len(token_ids) and not matcher.is_terminated()
               and matcher.accept_token(int(token_ids[count]))):
            count += 1
        if count:
            matcher.rollback(count)
        return list(token_ids[:count])

    def live_matcher(self):
        """The xgrammar matcher that decides the next token, or None once the grammar has ended or failed (then
        only the stop tokens are allowed: ``stop_only_row``)."""
        matcher = self._get_matcher()
        return None if matcher is None or matcher.is_terminated() else matcher

    @property
    def stop_only_row(self) -> np.ndarray:
        """i32[ceil(V / 32)]: the bitmask row allowing only the engine's stop tokens."""
        return self._manager.stop_only_row

    @property
    def backend(self) -> XgrammarBackend:
        """The engine's grammar backend (built by the first compile, so it exists once the grammar is ready)."""
        return self._manager.backend


class StructuredOutputManager:
    """Compiles and caches grammars for one engine (its tokenizer, vocabulary and EOS ids).

    Args:
      tokenizer: the engine's HF tokenizer.
      vocab_size: V of the model.
      eos_token_ids: the stop tokens the grammar allows only where it may end.
      max_workers: compile threads.
      cache_size: compiled grammars kept (least recently used dropped first).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], *, max_workers: int = 2,
                 cache_size: int = 256):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers,
                                                               thread_name_prefix="paged-jax-grammar")
        self._cache: collections.OrderedDict[str, concurrent.futures.Future] = collections.OrderedDict()
        self._cache_size = cache_size
        self._backend: XgrammarBackend | None = None
        self._backend_lock = threading.Lock()
        stop_bits = np.zeros(allowed_mask_words(vocab_size) * 32, np.bool_)
        stop_bits[[t for t in self.eos_token_ids if 0 <= t < vocab_size]] = True
        self.stop_only_row = np.packbits(stop_bits, bitorder="little").view("<i4")

    @property
    def backend(self) -> XgrammarBackend:
        return self._get_backend()

    def _get_backend(self) -> XgrammarBackend:
        # Built on the first compile, on a pool thread: the tokenizer's vocabulary scan takes a noticeable moment.
        with self._backend_lock:
            if self._backend is None:
                self._backend = XgrammarBackend(self._tokenizer, self.vocab_size, self.eos_token_ids)
            return self._backend

    def _compile(self, grammar):
        return self._get_backend().compile(grammar)

    def grammar_for(self, spec: StructuredOutputsParams) -> concurrent.futures.Future:
        """The compiled grammar of ``spec``: cached, or parsed now and compiled on the pool. Raises ValueError naming
        the spec's field when it does not parse (nothing is cached then)."""
        if self._tokenizer is None:
            raise ValueError("structured_outputs: constrained decoding needs a tokenizer, and this model has none")
        key = spec_key(spec)
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        try:
            grammar = parse_grammar(spec)
        except ImportError as exc:
            raise ValueError("structured_outputs: the grammar backend is not installed (pip install "
                             "'paged-jax[structured]', which brings xgrammar)") from exc
        future = self._executor.submit(self._compile, grammar)
        self._cache[key] = future
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return future

    def new_sequence(self, compiled: concurrent.futures.Future) -> SequenceGrammar:
        """A fresh matcher state for one output sequence of a request with this compiled grammar."""
        return SequenceGrammar(compiled, self)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
