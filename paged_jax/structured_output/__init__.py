"""Structured outputs (constrained decoding): a request's ``StructuredOutputsParams`` (JSON schema, regex, choice,
grammar, structural tag) becomes a grammar, compiled off the step's critical path, whose matcher follows the
sequence and masks, every step, the tokens that would leave it.

* ``backend``: the grammar engine (xgrammar): spec -> grammar (fast, validates; errors name the field), grammar ->
  compiled grammar (slow: a token-mask cache per grammar), matchers.
* ``manager``: ``StructuredOutputManager`` (compile thread pool, cache keyed by the spec) and
  ``SequenceGrammar`` (one matcher per output sequence: ready?, accept, fill its bitmask row).
* ``bitmask``: the step's packed bitmask, a row per sampled position, draft positions included (host; the device
  applies it with ``logit_processing.apply_allowed_token_mask``).
"""

from paged_jax.structured_output.bitmask import fill_step_bitmask, step_grammars
from paged_jax.structured_output.manager import SequenceGrammar, StructuredOutputManager

__all__ = ["StructuredOutputManager", "SequenceGrammar", "fill_step_bitmask", "step_grammars"]
