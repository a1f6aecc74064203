"""vLLM's ``speculative_config`` (``--speculative-config '{"method": ..., "num_speculative_tokens": k}'``,
``LLM(speculative_config={...})``): parsed and validated once, at start-up; a ValueError names the key."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

# Methods vLLM accepts, all run here; vLLM's other names for one of them (its ``deepseek_mtp`` is ``mtp``).
PROPOSER_METHODS = ("ngram", "suffix", "draft_model", "eagle", "eagle3", "mtp")
METHOD_ALIASES = {"deepseek_mtp": "mtp"}
# Methods whose drafts a network computes on the device (``paged_jax.spec_decode.draft_runner``); all but ``mtp`` (the
# target checkpoint's own multi-token prediction layers) read it from ``model``.
MODEL_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
CHECKPOINT_METHODS = ("draft_model", "eagle", "eagle3")
MAX_SPECULATIVE_TOKENS = 32


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """One engine's speculative decoding (vLLM's field names and defaults).

    Attributes:
      method: "ngram" (prompt lookup), "suffix" (suffix-tree lookup over the request and recent requests),
        "draft_model" (a smaller model with the target's vocabulary), "eagle" (an EAGLE-1 / EAGLE-2 head on the
        target's final hidden states), "eagle3" (an EAGLE-3 head on the target's hidden states) or "mtp" (the
        target checkpoint's multi-token prediction layers, DeepSeek-V3's ``num_nextn_predict_layers``; vLLM's alias
        "deepseek_mtp" is read as "mtp").
      model: draft_model / eagle / eagle3: the drafter's checkpoint directory (a Hugging Face model id is resolved
        like the target's); not taken by mtp (the target's checkpoint).
      num_speculative_tokens: drafts per sequence per step, k (fixed for the engine: its compiled shapes).
      prompt_lookup_min / prompt_lookup_max: ngram: the n-gram lengths matched (longest first).
      suffix_decoding_max_tree_depth: suffix: the longest context and draft the trees hold.
      suffix_decoding_max_cached_requests: suffix: finished requests whose outputs are kept for lookups (0: none).
      suffix_decoding_max_spec_factor: suffix: drafts at most this times the matched context length.
      suffix_decoding_min_token_prob: suffix: a draft stops at a token whose estimated probability is below this.
      disable_by_batch_size: no drafts on steps after one with at least this many running sequences (None: never).
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", METHOD_ALIASES.get(self.method, self.method))
        if self.method not in PROPOSER_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(PROPOSER_METHODS)}, got "
                             f"{self.method!r}")
        if self.method in CHECKPOINT_METHODS and not (isinstance(self.model, str) and self.model):
            raise ValueError(f"speculative_config.model (the drafter's checkpoint) is required with method "
                             f"{self.method!r}")
        if self.method not in CHECKPOINT_METHODS and self.model is not None:
            raise ValueError(f"speculative_config.model applies to methods {', '.join(CHECKPOINT_METHODS)}, not "
                             f"{self.method!r}" + (" (it drafts with the target checkpoint's own multi-token "
                                                   "prediction layers)" if self.method == "mtp" else ""))
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an int in [1, "
                             f"{MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.method == "ngram":
            low, high = self.prompt_lookup_min, self.prompt_lookup_max
            low, high = (5, 5) if low is None and high is None else (low or high, high or low)
            for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
                if not isinstance(value, int) or value < 1:
                    raise ValueError(f"speculative_config.{name} must be an int >= 1, got {value!r}")
            if low > high:
                raise ValueError(f"speculative_config.prompt_lookup_min ({low}) must be <= prompt_lookup_max "
                                 f"({high})")
            object.__setattr__(self, "prompt_lookup_min", low)
            object.__setattr__(self, "prompt_lookup_max", high)
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError("speculative_config.prompt_lookup_min / prompt_lookup_max apply to method 'ngram' "
                             f"only, not {self.method!r}")
        checks = (("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth >= 1),
                  ("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests >= 0),
                  ("suffix_decoding_max_spec_factor", self.suffix_decoding_max_spec_factor > 0),
                  ("suffix_decoding_min_token_prob", 0 <= self.suffix_decoding_min_token_prob <= 1),
                  ("disable_by_batch_size", self.disable_by_batch_size is None or self.disable_by_batch_size >= 2))
        for name, ok in checks:
            if not ok:
                raise ValueError(f"speculative_config.{name} is out of range, got {getattr(self, name)!r}")


def parse_speculative_config(value: dict[str, Any] | str | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """``speculative_config`` as given (a dict, its JSON text, a ``SpeculativeConfig`` or None) -> the config.
    ``num_speculative_tokens`` is required (vLLM infers it only from a drafter checkpoint); unknown keys are refused
    by name."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    known = {field.name for field in dataclasses.fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"speculative_config: unsupported key(s) {', '.join(unknown)}; supported: "
                         f"{', '.join(sorted(known))}")
    for name in ("method", "num_speculative_tokens"):
        if name not in value:
            raise ValueError(f"speculative_config.{name} is required")
    return SpeculativeConfig(**value)
