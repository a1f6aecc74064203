"""A request's structured-output fields -> the engine's ``StructuredOutputsParams`` (vLLM's names and rules).

Sources, at most one per request (else a 400 naming the second):
* ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}``, ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}`` (the schema is enforced whether or not ``strict`` is set, as in
  vLLM), ``{"type": "structural_tag", ...}``;
* vLLM's ``structured_outputs``: ``{json | regex | choice | grammar | json_object | structural_tag, options}``;
* the older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``, ``structural_tag`` (chat);
* a tool choice of ``"required"`` or a named function (``serving.tool_parsers.tool_choice``).
``guided_decoding_backend`` may name ``auto`` or ``xgrammar`` (the one backend); ``guided_whitespace_pattern`` is
refused (``serving.unsupported_fields``). A spec the grammar engine cannot compile is refused by the engine's
``add_request`` with a ValueError naming the spec's field, which the route maps back to the request field
(``aliases``).
"""

from __future__ import annotations

import json
from typing import Any

from paged_jax.sampling_params import StructuredOutputsParams
from serving.errors import APIError

BACKENDS = ("auto", "xgrammar")
_LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
           "structural_tag": "structural_tag"}


def _from_response_format(response_format: dict) -> dict[str, Any] | None:
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise APIError(400, "response_format: json_schema must be {\"name\": ..., \"schema\": {...}, "
                                "\"strict\": ...}", param="response_format")
        # OpenAI: a missing schema means any JSON value; vLLM takes it as any object.
        return {"json": spec.get("schema") or {"type": "object"}}
    if kind == "structural_tag":
        return {"structural_tag": json.dumps(response_format)}
    raise APIError(400, f"response_format: type must be text, json_object, json_schema or structural_tag, got "
                        f"{kind!r}", param="response_format")


def structured_outputs_from_request(body: Any, tool_schema: dict | None = None
                                    ) -> tuple[StructuredOutputsParams | None, dict[str, str]]:
    """-> (the constraint or None, {spec field: request field} for naming the request field in engine errors).
    Raises APIError 400 naming the field for a malformed or conflicting spec."""
    backend = getattr(body, "guided_decoding_backend", None)
    if backend is not None and backend not in BACKENDS:
        raise APIError(400, f"guided_decoding_backend: the grammar backend is xgrammar; got {backend!r} (allowed: "
                            f"{', '.join(BACKENDS)})", param="guided_decoding_backend")
    sources: list[tuple[str, dict[str, Any]]] = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        spec = _from_response_format(response_format)
        if spec is not None:
            sources.append(("response_format", spec))
    if getattr(body, "structured_outputs", None) is not None:
        sources.append(("structured_outputs", dict(body.structured_outputs)))
    for field, name in _LEGACY.items():
        value = getattr(body, field, None)
        if value is not None:
            sources.append((field, {name: value}))
    if tool_schema is not None:
        sources.append(("tool_choice", {"json": tool_schema}))
    if not sources:
        return None, {}
    if len(sources) > 1:
        raise APIError(400, f"{sources[1][0]}: only one structured-output constraint per request, but "
                            f"{sources[0][0]} already sets one", param=sources[1][0])
    field, spec = sources[0]
    try:
        params = StructuredOutputsParams(**spec)
    except TypeError as exc:  # an unknown key of structured_outputs
        raise APIError(400, f"{field}: {exc}", param=field) from exc
    except ValueError as exc:
        raise APIError(400, f"{field}: {exc}", param=field) from exc
    return params, {params.kind: field, "structured_outputs": field}
