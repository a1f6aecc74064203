"""The request fields the server refuses (HTTP 400 naming the field), and why: the one list of refusals.

Every field the request models (``serving.protocol``) declare either works as in vLLM or is listed here. A listed
field is refused only when it asks for something: a value that is unset, empty or the field's no-op (e.g.
``tool_choice: "none"``, ``response_format: {"type": "text"}``) is accepted, since it changes nothing. When a feature
lands, its entry is removed here and the route honours the field.

The tables list features the server does not have (yet), and (``BEAM_SEARCH_UNUSED``) the sampling fields that beam
search does not read (refused with ``use_beam_search``, not silently dropped as vLLM does).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from pydantic import BaseModel

from serving.errors import APIError


def _unset_or_empty(value: Any) -> bool:
    return value is None or (isinstance(value, (str, list, dict)) and not value)


def _unset(value: Any) -> bool:
    return value is None


def _one_of(*noops: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in noops


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a field is refused, and which of its values ask for nothing (accepted)."""

    reason: str
    is_noop: Callable[[Any], bool] = _unset_or_empty


_FUNCTIONS = "the deprecated functions API is not supported; use tools and tool_choice"
# Features this server does not have (the functions API, ...).
NOT_SUPPORTED: dict[str, Refusal] = {
    "functions": Refusal(_FUNCTIONS),
    "function_call": Refusal(_FUNCTIONS, _one_of("none")),
    "guided_whitespace_pattern": Refusal("the grammar backend (xgrammar) has no whitespace pattern; "
                                         "structured_outputs.disable_any_whitespace gives compact JSON"),
    "prompt_embeds": Refusal("prompt embeddings are not supported", _unset),
    "mm_processor_kwargs": Refusal("no multimodal processor: the served models are text-only"),
    "audio": Refusal("audio output is not supported", _unset),
    "modalities": Refusal("only the text modality is supported", _one_of(["text"])),
    "prediction": Refusal("predicted outputs are not supported", _unset),
    "web_search_options": Refusal("web search is not supported", _unset),
    "verbosity": Refusal("verbosity control is not supported", _unset),
    "reasoning_effort": Refusal("reasoning effort control is gpt-oss's: it needs --reasoning-parser openai_gptoss or "
                                "--tool-call-parser openai and a chat template that takes reasoning_effort", _unset),
    "include_reasoning": Refusal("no reasoning parser is configured", _one_of(True)),
    "store": Refusal("stored completions are not supported", _one_of(False)),
    "service_tier": Refusal("there is one service tier", _one_of("auto", "default")),
    # vLLM V1 refuses per-request logits processors as well.
    "logits_processors": Refusal("per-request logits processors are not supported (as in vLLM V1)"),
    "kv_transfer_params": Refusal("KV transfer (disaggregated prefill) is not supported"),
    "vllm_xargs": Refusal("no extension reads vllm_xargs on this server"),
}
REFUSED_FIELDS: dict[str, Refusal] = dict(NOT_SUPPORTED)


# The one ``include`` of the Responses API served: the reply's token logprobs on its output_text.
OUTPUT_LOGPROBS = "message.output_text.logprobs"


def _no_obfuscation(value: Any) -> bool:
    return value is None or not value or value == {"include_obfuscation": False}


# The Responses API (``POST /v1/responses``): the refusals above, less ``store`` (a stored response serves
# ``previous_response_id`` and ``GET /v1/responses/{id}``), plus its own fields.
RESPONSES_REFUSED_FIELDS: dict[str, Refusal] = {
    **{name: refusal for name, refusal in REFUSED_FIELDS.items() if name != "store"},
    "include": Refusal(f"only {OUTPUT_LOGPROBS!r} is supported (not encrypted reasoning or tool outputs)",
                       lambda value: value is None or set(value) <= {OUTPUT_LOGPROBS}),
    "truncation": Refusal("automatic truncation of the conversation is not supported", _one_of("disabled")),
    "max_tool_calls": Refusal("there are no built-in tools to limit", _unset),
    "prompt": Refusal("prompt templates are not supported", _unset),
    "reasoning": Refusal("reasoning effort and summary control are not supported"),
    "conversation": Refusal("conversations are not supported; continue one with previous_response_id", _unset),
    "stream_options": Refusal("stream obfuscation is not supported", _no_obfuscation),
    "enable_response_messages": Refusal("raw input and output messages are not returned", _one_of(False)),
    "previous_input_messages": Refusal("Harmony message histories (gpt-oss) are not supported; use "
                                       "previous_response_id"),
    "previous_response": Refusal("stateless continuation (previous_response) is not supported; use "
                                 "previous_response_id", _unset),
}

_UNUSED_BY_BEAM_SEARCH = "is not used by beam search (use_beam_search)"
# Sampling fields beam search does not read (it reads n = beam width, max_tokens, temperature, ignore_eos,
# length_penalty, include_stop_str_in_output): refused with use_beam_search unless they ask for nothing.
BEAM_SEARCH_UNUSED: dict[str, Refusal] = {
    name: Refusal(_UNUSED_BY_BEAM_SEARCH, noop) for name, noop in (
        ("best_of", _unset), ("top_p", _one_of(1.0)), ("top_k", _one_of(0, -1)), ("min_p", _one_of(0.0)),
        ("presence_penalty", _one_of(0.0)), ("frequency_penalty", _one_of(0.0)),
        ("repetition_penalty", _one_of(1.0)), ("seed", _unset), ("stop", _unset_or_empty),
        ("stop_token_ids", _unset_or_empty), ("min_tokens", _one_of(0)), ("logit_bias", _unset_or_empty),
        ("allowed_token_ids", _unset), ("bad_words", _unset_or_empty), ("prompt_logprobs", _unset),
        ("logprobs", _one_of(False)), ("top_logprobs", _one_of(0)),
        # Constrained decoding and tools are sampling features; beam search ranks free continuations.
        ("response_format", _one_of({"type": "text"})), ("structured_outputs", _unset), ("guided_json", _unset),
        ("guided_regex", _unset), ("guided_choice", _unset), ("guided_grammar", _unset), ("structural_tag", _unset),
        ("tools", _unset_or_empty))
}


def refuse_unsupported(body: BaseModel, allowed: tuple[str, ...] = (),
                       refused: dict[str, Refusal] = REFUSED_FIELDS) -> None:
    """Raise the 400 for the first refused field of ``body`` that asks for something (``allowed``: fields this
    server's configuration serves although listed, e.g. ``include_reasoning`` with a reasoning parser; ``refused``:
    the endpoint's table).

    Raises:
      APIError: 400 naming the field (``param``), the message saying why.
    """
    beam_search = bool(getattr(body, "use_beam_search", False))
    for name in type(body).model_fields:
        refusal = refused.get(name) or (BEAM_SEARCH_UNUSED.get(name) if beam_search else None)
        if (refusal is not None and name not in allowed and name in body.model_fields_set
                and not refusal.is_noop(getattr(body, name))):
            raise APIError(400, f"{name}: {refusal.reason}", param=name)
    if not beam_search and getattr(body, "length_penalty", 1.0) != 1.0:
        raise APIError(400, "length_penalty: only applies to beam search (use_beam_search)", param="length_penalty")
    best_of, n = getattr(body, "best_of", None), getattr(body, "n", 1)
    if best_of is not None and best_of > n and getattr(body, "stream", False):
        raise APIError(400, "best_of: best_of > n cannot be streamed (the best n are known only at the end)",
                       param="best_of")
