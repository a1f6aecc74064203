"""The table behind tests/test_serving_fields.py: for every request field of /v1/completions and
/v1/chat/completions, what a request sends and how the response (or what reached the engine) shows it was honoured,
or ``REFUSED`` (a 400 naming the field)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

MODEL_NAME = "smollm2-fields"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
# A template that shows everything chat rendering passes on (documents, tool calls, tool results, template kwargs).
SHOW_ALL_TEMPLATE = (
    "{% if greeting is defined %}{{ greeting }}|{% endif %}"
    "{% for d in documents or [] %}[doc {{ d.title }}: {{ d.text }}]{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}(call {{ c.id }} {{ c.function.name }} city={{ c.function.arguments.city }})"
    "{% endfor %}{% if m.tool_call_id is defined %}(result of {{ m.tool_call_id }}){% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")
SHOW_TOOLS_TEMPLATE = "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}" + SHOW_ALL_TEMPLATE


@dataclasses.dataclass
class Added:
    request_id: str
    prompt: list[int]
    prompt_text: str  # the prompt ids decoded
    params: Any
    priority: int
    cache_salt: str | None = None


# ------------------------------------------------------------------------------------------ every field
@dataclasses.dataclass
class Case:
    """What a request sends for one field (``body``: that field plus any companions it needs) and how it is
    honoured (``check(response, added)``); ``check=None``: refused with a 400 naming the field."""

    body: dict
    check: Callable[[Any, list[Added]], None] | None = None


REFUSED = None


def _params(name: str, value: Any) -> Callable:
    def check(response, added):
        assert getattr(added[-1].params, name) == value

    return check


def _constraint(name: str, value: Any) -> Callable:
    def check(response, added):
        assert getattr(added[-1].params.structured_outputs, name) == value

    return check


def _tool_schema(check_schema: Callable[[dict], bool]) -> Callable:
    def check(response, added):
        assert check_schema(added[-1].params.structured_outputs.json)

    return check


_LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]}}}
_STRUCTURAL_TAG = ('{"type": "structural_tag", "structures": [{"begin": "<f>", "schema": {"type": "object"}, '
                   '"end": "</f>"}], "triggers": ["<f>"]}')


def _streamed(response, added):
    chunks = list(response)
    assert chunks and all(chunk.usage is not None for chunk in chunks)  # continuous_usage_stats
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


def _prompt_logprobs(response, added):
    """One entry per prompt token (None first), each the prompt token plus at most 1 alternative: on the response
    (chat) or on each choice (completions), as vLLM."""
    entries = getattr(response, "prompt_logprobs", None) or response.choices[0].prompt_logprobs
    assert added[-1].params.prompt_logprobs == 1
    assert entries[0] is None and len(entries) == response.usage.prompt_tokens == len(added[-1].prompt)
    for token_id, entry in zip(added[-1].prompt[1:], entries[1:]):
        assert str(token_id) in entry and 1 <= len(entry) <= 2
        assert all(value["logprob"] <= 0 and value["rank"] >= 1 for value in entry.values())


# Fields both endpoints share, with the same meaning.
COMMON: dict[str, Case] = {
    "model": Case({"model": MODEL_NAME}, lambda r, a: r.model == MODEL_NAME),
    "n": Case({"n": 2}, lambda r, a: len(r.choices) == 2),
    "best_of": Case({"best_of": 2, "temperature": 1.0}, lambda r, a: len(r.choices) == 1 and a[-1].params.best_of == 2),
    "temperature": Case({"temperature": 0.5}, _params("temperature", 0.5)),
    "top_p": Case({"top_p": 0.5}, _params("top_p", 0.5)),
    "presence_penalty": Case({"presence_penalty": 0.5}, _params("presence_penalty", 0.5)),
    "frequency_penalty": Case({"frequency_penalty": 0.5}, _params("frequency_penalty", 0.5)),
    "logit_bias": Case({"logit_bias": {"42": 5.0}}, _params("logit_bias", {42: 5.0})),
    "seed": Case({"seed": 7}, _params("seed", 7)),
    "stop": Case({"stop": ["Paris"]}, _params("stop", ["Paris"])),
    "stream": Case({"stream": True, "stream_options": {"continuous_usage_stats": True}}, _streamed),
    "stream_options": Case({"stream": True, "stream_options": {"continuous_usage_stats": True}}, _streamed),
    "user": Case({"user": "user-1"}, lambda r, a: None),  # identifies the end user: nothing to do (as vLLM)
    "use_beam_search": Case({"use_beam_search": True, "n": 2},
                            lambda r, a: len(r.choices) == 2 and a[-1].params.beam_width == 2),
    "top_k": Case({"top_k": 3}, _params("top_k", 3)),
    "min_p": Case({"min_p": 0.2}, _params("min_p", 0.2)),
    "repetition_penalty": Case({"repetition_penalty": 1.3}, _params("repetition_penalty", 1.3)),
    "length_penalty": Case({"use_beam_search": True, "length_penalty": 0.5}, _params("length_penalty", 0.5)),
    "stop_token_ids": Case({"stop_token_ids": [13]}, _params("stop_token_ids", [13])),
    "include_stop_str_in_output": Case({"include_stop_str_in_output": True},
                                       _params("include_stop_str_in_output", True)),
    "ignore_eos": Case({"ignore_eos": True}, _params("ignore_eos", True)),
    "min_tokens": Case({"min_tokens": 2}, _params("min_tokens", 2)),
    "skip_special_tokens": Case({"skip_special_tokens": False}, _params("skip_special_tokens", False)),
    "spaces_between_special_tokens": Case({"spaces_between_special_tokens": False},
                                          _params("spaces_between_special_tokens", False)),
    "truncate_prompt_tokens": Case({"truncate_prompt_tokens": 2}, lambda r, a: r.usage.prompt_tokens == 2),
    "allowed_token_ids": Case({"allowed_token_ids": [1, 2]}, _params("allowed_token_ids", [1, 2])),
    "prompt_logprobs": Case({"prompt_logprobs": 1}, _prompt_logprobs),
    "bad_words": Case({"bad_words": ["Paris"]}, _params("bad_words", ["Paris"])),
    "response_format": Case({"response_format": {"type": "json_object"}}, _constraint("json_object", True)),
    "structured_outputs": Case({"structured_outputs": {"regex": "a+"}}, _constraint("regex", "a+")),
    "guided_json": Case({"guided_json": {"type": "object"}}, _constraint("json", {"type": "object"})),
    "guided_regex": Case({"guided_regex": "a+"}, _constraint("regex", "a+")),
    "guided_choice": Case({"guided_choice": ["yes", "no"]}, _constraint("choice", ["yes", "no"])),
    "guided_grammar": Case({"guided_grammar": 'root ::= "a"'}, _constraint("grammar", 'root ::= "a"')),
    "guided_decoding_backend": Case({"guided_decoding_backend": "xgrammar", "guided_regex": "a+"},
                                    _constraint("regex", "a+")),
    "guided_whitespace_pattern": Case({"guided_whitespace_pattern": " "}, REFUSED),
    "priority": Case({"priority": 1}, REFUSED),  # this server schedules FCFS; see test_priority_*
    "request_id": Case({"request_id": "my-id"}, lambda r, a: r.id.endswith("-my-id")),
    "logits_processors": Case({"logits_processors": ["my.Processor"]}, REFUSED),
    # The engine gets vLLM's prompt dict (isolation itself: tests/test_hostile.py).
    "cache_salt": Case({"cache_salt": "salt"}, lambda r, a: a[-1].cache_salt == "salt"),
    "kv_transfer_params": Case({"kv_transfer_params": {"do_remote_prefill": True}}, REFUSED),
    "vllm_xargs": Case({"vllm_xargs": {"key": 1}}, REFUSED),
}


def _completion_logprobs_as_ids(response, added):
    tokens = response.choices[0].logprobs.tokens
    assert tokens and all(token.startswith("token_id:") for token in tokens)


COMPLETION: dict[str, Case] = {
    "prompt": Case({"prompt": [504, 3575, 282]}, lambda r, a: a[-1].prompt == [504, 3575, 282]),
    "prompt_embeds": Case({"prompt_embeds": "AAAA"}, REFUSED),
    "suffix": Case({"suffix": " is the answer."}, REFUSED),
    "max_tokens": Case({"max_tokens": 2, "ignore_eos": True}, lambda r, a: r.usage.completion_tokens == 2),
    "logprobs": Case({"logprobs": 2}, lambda r, a: all(len(top) >= 2 for top in r.choices[0].logprobs.top_logprobs)),
    "echo": Case({"echo": True}, lambda r, a: r.choices[0].text.startswith(PROMPT)),
    "add_special_tokens": Case({"add_special_tokens": False}, lambda r, a: r.usage.prompt_tokens == len(a[-1].prompt)),
    "return_tokens_as_token_ids": Case({"return_tokens_as_token_ids": True, "logprobs": 1},
                                       _completion_logprobs_as_ids),
}


def _rendered_contains(*parts: str) -> Callable:
    def check(response, added):
        for part in parts:
            assert part in added[-1].prompt_text, (part, added[-1].prompt_text)

    return check


PARTIAL_ASSISTANT_TURN = [*CHAT, {"role": "assistant", "content": "The capital of France"}]
TOOL_TURN = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Paris is the capital."}]

CHAT_ONLY: dict[str, Case] = {
    "messages": Case({"messages": TOOL_TURN, "chat_template": SHOW_ALL_TEMPLATE},
                     _rendered_contains("(call call_1 lookup city=Paris)", "<tool>Paris is the capital.",
                                        "(result of call_1)")),
    "max_tokens": Case({"max_tokens": 2, "max_completion_tokens": None, "ignore_eos": True},
                       lambda r, a: r.usage.completion_tokens == 2),
    "max_completion_tokens": Case({"max_completion_tokens": 2, "ignore_eos": True},
                                  lambda r, a: r.usage.completion_tokens == 2),
    "logprobs": Case({"logprobs": True}, lambda r, a: len(r.choices[0].logprobs.content) == r.usage.completion_tokens),
    "top_logprobs": Case({"logprobs": True, "top_logprobs": 2},
                         lambda r, a: all(len(e.top_logprobs) == 2 for e in r.choices[0].logprobs.content)),
    # tool_choice "auto" needs --enable-auto-tool-choice (tests/test_tool_calls.py); this server has none.
    "tools": Case({"tools": [_LOOKUP], "tool_choice": "none", "chat_template": SHOW_TOOLS_TEMPLATE},
                  _rendered_contains("[tool lookup]")),
    "tool_choice": Case({"tools": [_LOOKUP], "tool_choice": {"type": "function", "function": {"name": "lookup"}}},
                        _tool_schema(lambda schema: schema == _LOOKUP["function"]["parameters"])),
    "parallel_tool_calls": Case({"tools": [_LOOKUP], "tool_choice": "required", "parallel_tool_calls": False},
                                _tool_schema(lambda schema: schema["maxItems"] == 1)),
    "functions": Case({"functions": [{"name": "lookup"}]}, REFUSED),
    "function_call": Case({"function_call": "auto"}, REFUSED),
    "reasoning_effort": Case({"reasoning_effort": "low"}, REFUSED),
    "include_reasoning": Case({"include_reasoning": False}, REFUSED),
    "audio": Case({"audio": {"voice": "alloy", "format": "wav"}}, REFUSED),
    "modalities": Case({"modalities": ["text", "audio"]}, REFUSED),
    "prediction": Case({"prediction": {"type": "content", "content": "Paris"}}, REFUSED),
    "web_search_options": Case({"web_search_options": {}}, REFUSED),
    "verbosity": Case({"verbosity": "low"}, REFUSED),
    "store": Case({"store": True}, REFUSED),
    "service_tier": Case({"service_tier": "flex"}, REFUSED),
    "metadata": Case({"metadata": {"team": "a"}}, lambda r, a: None),  # only kept with stored completions
    "prompt_cache_key": Case({"prompt_cache_key": "k"}, lambda r, a: None),  # one prefix cache serves all
    "safety_identifier": Case({"safety_identifier": "s"}, lambda r, a: None),  # like user
    "echo": Case({"echo": True, "messages": PARTIAL_ASSISTANT_TURN, "add_generation_prompt": False,
                  "continue_final_message": True},
                 lambda r, a: r.choices[0].message.content.startswith("The capital of France")),
    "add_generation_prompt": Case({"add_generation_prompt": False},
                                  lambda r, a: r.choices[0].message.role == "user"),  # continues the last role
    "continue_final_message": Case({"messages": PARTIAL_ASSISTANT_TURN, "add_generation_prompt": False,
                                    "continue_final_message": True},
                                   _rendered_contains("assistant\nThe capital of France")),
    "add_special_tokens": Case({"add_special_tokens": True}, lambda r, a: r.usage.prompt_tokens == len(a[-1].prompt)),
    "documents": Case({"documents": [{"title": "t", "text": "banana"}], "chat_template": SHOW_ALL_TEMPLATE},
                      _rendered_contains("[doc t: banana]")),
    "chat_template": Case({"chat_template": SHOW_ALL_TEMPLATE}, _rendered_contains("<user>What is the capital")),
    "chat_template_kwargs": Case({"chat_template_kwargs": {"greeting": "Ahoy"}, "chat_template": SHOW_ALL_TEMPLATE},
                                 _rendered_contains("Ahoy|")),
    "mm_processor_kwargs": Case({"mm_processor_kwargs": {"num_crops": 4}}, REFUSED),
    "structural_tag": Case({"structural_tag": _STRUCTURAL_TAG}, _constraint("structural_tag", _STRUCTURAL_TAG)),
    "return_tokens_as_token_ids": Case({"return_tokens_as_token_ids": True, "logprobs": True},
                                       lambda r, a: r.choices[0].logprobs.content[0].token.startswith("token_id:")),
}
