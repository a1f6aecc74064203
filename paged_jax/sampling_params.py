"""Per-request sampling parameters, with vLLM's field names, defaults and validation rules.

``SamplingParams`` is what users pass to ``LLM.generate`` / ``LLMEngine.add_request``. It is validated once, on
construction, so the engine and the on-device sampler can trust every field. The sampler reads it through
``paged_jax.worker.sampler.build_sampling_tensors``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

# Below this temperature a request is sampled greedily (argmax), exactly as vLLM's ``_SAMPLING_EPS``.
SAMPLING_EPS = 1e-5
# The most top alternatives a request may ask for per generated token (``logprobs``); vLLM's default
# ``max_logprobs`` is 20 as well (it bounds ``prompt_logprobs`` too). The model runner compiles its logprob variants
# and its prompt logprobs up to this width.
MAX_LOGPROBS = 20
# ``logit_bias`` values are clamped to this range (the OpenAI API's range; vLLM clamps the same way).
MAX_ABS_LOGIT_BIAS = 100.0


class SamplingType(enum.IntEnum):
    """How a request draws its tokens (vLLM's ``SamplingType``)."""

    GREEDY = 0
    RANDOM = 1  # random, seed chosen by the engine
    RANDOM_SEED = 2  # random, seed chosen by the user


def _is_int(value) -> bool:
    # bool is an int subclass but never a meaningful token id / count.
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


_CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's ``StructuredOutputsParams``): exactly one of

      json: a JSON schema (dict or JSON text); the output is a JSON value valid against it.
      regex: the output matches this regular expression.
      choice: the output is exactly one of these strings.
      grammar: the output is in the language of this grammar (EBNF in GBNF/xgrammar syntax, or Lark).
      json_object: True: the output is some JSON object (OpenAI's ``response_format: json_object``).
      structural_tag: a JSON text: ``{"type": "structural_tag", "structures": [{"begin", "schema", "end"}],
        "triggers": [...]}`` (free text in which each ``begin`` ... ``end`` span follows its schema) or the grammar
        engine's own structural-tag format (``{"type": "structural_tag", "format": ...}``).

    Options: ``disable_any_whitespace`` (JSON without free whitespace between tokens: compact separators),
    ``disable_additional_properties`` (objects of a JSON schema take no properties beyond those listed, unless the
    schema says otherwise), ``disable_fallback`` (accepted: there is one grammar backend, so nothing falls back).
    ``whitespace_pattern`` is refused (ValueError naming it): the grammar backend has no such option.
    The grammar itself is compiled by the engine (``paged_jax.structured_output``), which also rejects a spec that
    does not parse with a ValueError naming the field.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: exactly one of {', '.join(_CONSTRAINT_FIELDS)} must be given, "
                             f"got {', '.join(given) or 'none'}")
        if self.whitespace_pattern is not None:
            raise ValueError("whitespace_pattern: not supported by the grammar backend (xgrammar); use "
                             "disable_any_whitespace for compact JSON")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"json: a JSON schema must be a dict or a JSON string, got {type(self.json).__name__}")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name}: must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"choice: must be a non-empty list of strings, got {self.choice!r}")
            self.choice = list(self.choice)
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"json_object: must be True when given, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        """The constraint's field name: one of json, regex, choice, grammar, json_object, structural_tag."""
        return next(name for name in _CONSTRAINT_FIELDS if getattr(self, name) is not None)


@dataclass
class SamplingParams:
    """Sampling parameters for one request (vLLM's ``SamplingParams``).

    Fields (defaults as vLLM):
      n: number of output sequences per prompt (>= 1).
      best_of: None or >= n (vLLM V0's): generate best_of sequences and return the n with the highest cumulative
        logprob (only once finished: they cannot be streamed); more than n needs random sampling.
      presence_penalty: in [-2, 2]; subtracted from the logit of every token already in the *output*.
      frequency_penalty: in [-2, 2]; subtracted once per occurrence of the token in the *output*.
      repetition_penalty: > 0; logits of tokens in the prompt or the output are divided by it when positive and
        multiplied by it otherwise (1.0 = off).
      temperature: >= 0; below ``SAMPLING_EPS`` the request is greedy.
      top_p: in (0, 1]; keep the smallest set of most likely tokens whose probability mass is >= top_p.
      top_k: -1 or 0 = off, else keep the k most likely tokens.
      min_p: in [0, 1]; drop tokens whose probability is below min_p times the top token's probability.
      seed: optional int; with a seed the output only depends on (seed, token index), not on the batch.
      stop: stop strings (a str is normalised to a one-element list); the output text is cut before them.
      stop_token_ids: extra token ids that end generation (the token is kept in ``token_ids``).
      ignore_eos: keep generating after the EOS token.
      max_tokens: >= 1, most output tokens; None = up to the model's maximum length.
      min_tokens: >= 0, stop tokens / EOS / stop strings are not allowed before this many output tokens.
      logprobs: None, or the number of top alternatives (0..MAX_LOGPROBS) to return per output token besides
        the sampled one (0 = only the sampled token's logprob).
      prompt_logprobs: None, or the number of top alternatives (0..MAX_LOGPROBS) to return per prompt token besides
        the prompt token itself (``RequestOutput.prompt_logprobs``); such a request takes no prefix-cache hits.
      detokenize, skip_special_tokens, spaces_between_special_tokens, include_stop_str_in_output: as vLLM.
      logit_bias: {token id: bias} added to the logits before sampling (keys may be strings of ints, as in the
        OpenAI API; biases are clamped to [-100, 100] as vLLM does). The engine checks the ids against the vocab.
      allowed_token_ids: only these ids may be sampled (non-empty when set).
      bad_words: words that must not be generated. ``update_from_tokenizer`` (called by the engine) tokenizes each
        with and without a leading space; a word's last token is banned whenever the output ends with its other
        tokens (single-token words: always).
      structured_outputs: a ``StructuredOutputsParams`` constraint (JSON schema, regex, choice, grammar, ...); the
        engine masks every token that would leave it, and EOS until the constraint is complete.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by __post_init__: the list form of ``stop`` (always a list, possibly empty).
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False, compare=False)
    # Filled by update_from_tokenizer: the token sequences of ``bad_words`` (vLLM's ``_bad_words_token_ids``).
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            stop_list: list[str] = []
        elif isinstance(self.stop, str):
            stop_list = [self.stop]
        else:
            stop_list = list(self.stop)
        if self.stop is not None:
            self.stop = stop_list
        self._stop_list = stop_list
        if self.stop_token_ids is not None:
            self.stop_token_ids = list(self.stop_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = _normalise_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            if isinstance(self.bad_words, str):
                raise ValueError(f"bad_words must be a list of strings, got the string {self.bad_words!r}")
            self.bad_words = list(self.bad_words)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        # Plain ints passed as floats are fine for float fields; normalise so arrays get the right dtype.
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            setattr(self, name, float(value))
        self._verify_args()

    def _verify_args(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n!r}")
        if self.best_of is not None:
            if not _is_int(self.best_of) or self.best_of < self.n:
                raise ValueError(f"best_of must be greater than or equal to n, got n={self.n} and "
                                 f"best_of={self.best_of!r}")
            if self.best_of > self.n and self.temperature < SAMPLING_EPS:
                raise ValueError(f"best_of must equal n when using greedy sampling (every sequence would be the "
                                 f"same), got n={self.n} and best_of={self.best_of}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 1e30:  # also rejects nan and inf
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}")
        if not 0.0 <= self.temperature <= 1e30:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable), or at least 1, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.prompt_logprobs!r}")
        for stop_str in self._stop_list:
            if not isinstance(stop_str, str):
                raise ValueError(f"stop must be a str or a list of str, got element {stop_str!r}")
            if not stop_str:
                raise ValueError("stop cannot contain an empty string")
        if self.stop_token_ids is not None:
            for token_id in self.stop_token_ids:
                if not _is_int(token_id) or token_id < 0:
                    raise ValueError(f"stop_token_ids must be non-negative ints, got element {token_id!r}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty when set")
            for token_id in self.allowed_token_ids:
                if not _is_int(token_id) or token_id < 0:
                    raise ValueError(f"allowed_token_ids must be non-negative ints, got element {token_id!r}")
        for word in self.bad_words or ():
            if not isinstance(word, str) or not word.strip():
                raise ValueError(f"bad_words must be non-empty strings, got element {word!r}")
        if self.include_stop_str_in_output and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (include_stop_str_in_output was set)")
        if self._stop_list and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True")

    # ---- derived properties -------------------------------------------------------------------------------------

    @property
    def num_sequences(self) -> int:
        """Sequences the request runs (``num_sequences(n, best_of)``)."""
        return num_sequences(self.n, self.best_of)

    @property
    def sampled_logprobs(self) -> int | None:
        """Top alternatives the sampler returns per token: ``logprobs``; 0 when only the sampled token's logprob is
        needed (``best_of > n`` ranks sequences by cumulative logprob); None when no logprob is needed."""
        if self.logprobs is None and self.num_sequences > self.n:
            return 0
        return self.logprobs

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (empty when unset)."""
        return list(self._stop_list)

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def uses_truncation(self) -> bool:
        """True when top-k, top-p or min-p change the distribution (never for greedy requests)."""
        if self.is_greedy:
            return False
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def uses_bias_table(self) -> bool:
        """True when the sampler needs this request's row of the bias table (``logit_bias``, ``allowed_token_ids``)."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """Token sequences of ``bad_words`` (empty until ``update_from_tokenizer``)."""
        return self._bad_words_token_ids

    @property
    def reads_output_tokens(self) -> bool:
        """True when sampling the next token reads the values of the previous output tokens (penalties, bad words of
        several tokens): with async scheduling the previous step's tokens must reach the host first."""
        # Checked per in-flight row per step: the common case (no bad words) skips building the generator.
        return self.uses_penalties or (bool(self._bad_words_token_ids)
                                       and any(len(ids) > 1 for ids in self._bad_words_token_ids))

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenize ``bad_words`` (vLLM's ``update_from_tokenizer``): each word without and with a leading space
        (so it is banned at the start of the text and after a space), no special tokens; duplicates dropped."""
        sequences: list[list[int]] = []
        for word in self.bad_words or ():
            for prefix in ("", " "):
                ids = [int(t) for t in tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)]
                if ids and ids not in sequences:
                    sequences.append(ids)
        self._bad_words_token_ids = sequences

    def clone(self) -> "SamplingParams":
        """A deep copy (lists are copied), e.g. for the n sequences of one request."""
        copy = dataclasses.replace(
            self,
            stop=list(self._stop_list) if self.stop is not None else None,
            stop_token_ids=list(self.stop_token_ids) if self.stop_token_ids is not None else None,
            logit_bias=dict(self.logit_bias) if self.logit_bias is not None else None,
            allowed_token_ids=list(self.allowed_token_ids) if self.allowed_token_ids is not None else None,
            bad_words=list(self.bad_words) if self.bad_words is not None else None,
            structured_outputs=(dataclasses.replace(self.structured_outputs) if self.structured_outputs is not None
                                else None),
        )
        copy._bad_words_token_ids = [list(ids) for ids in self._bad_words_token_ids]
        return copy


def num_sequences(n: int, best_of: int | None = None) -> int:
    """The sequences a request of ``n`` choices runs for one prompt: ``best_of`` (when set, the candidates the ``n``
    best are picked from) or ``n`` (for a beam search, its width). The one count of a request's work: the engine
    makes this many scheduler requests per prompt, and admission (``--max-seqs-per-request``, the waiting-queue
    bound) counts it, summed over a batch's prompts."""
    return best_of if best_of is not None else n


def _normalise_logit_bias(logit_bias: Any) -> dict[int, float]:
    """{int token id: bias clamped to [-100, 100]}; keys may be ints or strings of ints (the OpenAI wire form)."""
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(logit_bias).__name__}")
    normalised: dict[int, float] = {}
    for key, bias in logit_bias.items():
        try:
            token_id = int(key) if not isinstance(key, (bool, float)) else None
        except ValueError:
            token_id = None
        if token_id is None:
            raise ValueError(f"logit_bias keys must be token ids (ints or strings of ints), got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float, np.integer, np.floating)) or math.isnan(bias):
            raise ValueError(f"logit_bias values must be numbers, got {bias!r} for token {token_id}")
        normalised[token_id] = min(MAX_ABS_LOGIT_BIAS, max(-MAX_ABS_LOGIT_BIAS, float(bias)))
    return normalised


def validate_token_ids(token_ids: Sequence[int], vocab_size: int, field: str = "prompt") -> None:
    """Raise ValueError naming ``field`` unless every id is an int in [0, vocab_size).

    Args:
      token_ids: ids to check (e.g. a tokenized prompt, or ``stop_token_ids``).
      vocab_size: the model's vocabulary size.
      field: name used in the error message.
    """
    for position, token_id in enumerate(token_ids):
        if not _is_int(token_id):
            raise ValueError(f"{field} token ids must be ints, got {token_id!r} at position {position}")
        if not 0 <= int(token_id) < vocab_size:
            raise ValueError(
                f"{field} token id {int(token_id)} at position {position} is out of range [0, {vocab_size})"
            )


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``.

    beam_width: beams kept per step (>= 1; 2 * beam_width logprobs per step, so at most ``MAX_LOGPROBS / 2``).
    max_tokens: most generated tokens (>= 1).
    ignore_eos: EOS is a token like any other (beams never complete early).
    temperature: the sampled token joins the candidates (0: the most likely, already among them).
    length_penalty: scores are ``cumulative logprob / length ** length_penalty``.
    include_stop_str_in_output: the server's output keeps a completed beam's EOS token in ``token_ids``.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    @property
    def n(self) -> int:
        """Sequences the request returns (the beam width), under ``SamplingParams``' name for it."""
        return self.beam_width

    @property
    def num_sequences(self) -> int:
        """Sequences the request runs at once (the beam width)."""
        return self.beam_width

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if 2 * self.beam_width > MAX_LOGPROBS:
            raise ValueError(f"beam_width must be at most {MAX_LOGPROBS // 2} (each step reads the 2 * beam_width "
                             f"most likely tokens, at most max_logprobs={MAX_LOGPROBS}), got {self.beam_width}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 1e30:
            raise ValueError(f"temperature must be non-negative, got {self.temperature!r}")
        if not isinstance(self.length_penalty, (int, float)) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
