"""Speculative decoding: draft tokens proposed on the host, verified by the target model in the step that computes
the next token (``config``: vLLM's ``speculative_config``; ``ngram`` / ``suffix``: the proposers; ``verify``: the
acceptance rule and the metrics; ``decoder``: what the engine core drives)."""

from paged_jax.spec_decode.config import SpeculativeConfig, parse_speculative_config

__all__ = ["SpeculativeConfig", "parse_speculative_config"]
