"""The Responses API (``/v1/responses``) through the official ``openai`` client: SmolLM2 on CPU (the shared
``serving_engine``), served with ``--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3``.

Replies are greedy, so a Responses request and the chat completion of the conversation it stands for give the same
text: that is how the tests check what reaches the model (instructions, stored conversations, tool results)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from serving.responses_protocol import ResponsesResponse
from serving.responses_store import ResponseStore, StoredResponse
from tests.test_serving import ServerThread, wait_until

MODEL_NAME = "smollm2-responses"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}
ASK = "What is the weather in Paris?"
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
               "response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server(serving_engine):
    from serving.app import create_app

    app = create_app(serving_engine, served_model_name=MODEL_NAME, enable_auto_tool_choice=True,
                     tool_parser="hermes", reasoning_parser="qwen3")
    with ServerThread(app) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=300)


def collapse(types: list[str]) -> list[str]:
    """``types`` without repeats in a row (one entry per run of deltas)."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


def chat_text(client, messages, max_tokens: int) -> str:
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0,
                                           max_completion_tokens=max_tokens)
    return reply.choices[0].message.content


def test_create_matches_chat_and_is_retrieved(client):
    response = client.responses.create(model=MODEL_NAME, input="What is the capital of France?",
                                       instructions="Answer in one word.", max_output_tokens=8, temperature=0)
    assert response.id.startswith("resp_") and response.status in ("completed", "incomplete")
    assert response.model == MODEL_NAME and response.max_output_tokens == 8 and response.temperature == 0
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text == chat_text(client, [{"role": "system", "content": "Answer in one word."},
                                                      {"role": "user", "content": "What is the capital of France?"}], 8)
    assert 0 < response.usage.output_tokens <= 8 and response.usage.input_tokens > 10
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    stored = client.responses.retrieve(response.id)
    assert stored.id == response.id and stored.output_text == response.output_text and stored.status == response.status


@pytest.mark.parametrize("api", ["stream", "create"])
def test_streamed_events_build_the_same_response(client, api):
    kwargs = dict(model=MODEL_NAME, input="Name a color.", max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kwargs)
    if api == "stream":
        with client.responses.stream(**kwargs) as stream:
            events = list(stream)
            final = stream.get_final_response()
    else:
        events = list(client.responses.create(stream=True, **kwargs))
        final = events[-1].response
    types = [event.type for event in events]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert collapse(types[2:-1]) == TEXT_EVENTS
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(deltas) == final.output_text == whole.output_text and len(deltas) > 1
    added, done = events[2].item, events[-2].item
    assert added.id == done.id == final.output[0].id and done.status == final.output[0].status
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=MODEL_NAME, input="My name is Ada.", instructions="Be brief.",
                                    max_output_tokens=12, temperature=0)
    second = client.responses.create(model=MODEL_NAME, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=12, temperature=0)
    assert second.previous_response_id == first.id and second.instructions is None
    # The stored turn (its instructions do not carry over), the reply, then the new input.
    expected = chat_text(client, [{"role": "user", "content": "My name is Ada."},
                                  {"role": "assistant", "content": first.output_text},
                                  {"role": "user", "content": "What is my name?"}], 12)
    assert second.output_text == expected
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=MODEL_NAME, input="Hi", previous_response_id="resp_unknown")
    assert info.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_function_tool_round_trip(client, stream):
    kwargs = dict(model=MODEL_NAME, tools=[WEATHER], temperature=0, max_output_tokens=40)
    if stream:
        with client.responses.stream(input=ASK, tool_choice="required", **kwargs) as events:
            types = [event.type for event in events]
            first = events.get_final_response()
        assert "response.function_call_arguments.delta" in types
        assert "response.function_call_arguments.done" in types and "response.output_text.delta" not in types
    else:
        first = client.responses.create(input=ASK, tool_choice="required", **kwargs)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(call.name == "get_weather" for call in calls)
    call = calls[0]
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome") and call.call_id and call.status == "completed"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 degrees."}
    # Continued from the stored response, or with the whole conversation passed back (stateless): the same prompt.
    stored = client.responses.create(input=[result], previous_response_id=first.id, tool_choice="none", **kwargs)
    passed_back = client.responses.create(input=[{"role": "user", "content": ASK}, *first.output, result],
                                          tool_choice="none", **kwargs)
    assert stored.output_text and stored.output_text == passed_back.output_text
    assert [item.type for item in stored.output] == ["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_is_an_output_item(client, stream):
    kwargs = dict(model=MODEL_NAME, input=ASK, temperature=0, max_output_tokens=60,
                  extra_body={"structured_outputs": {"regex": r"<think>\nThe user asks\.\n</think>\n\n"
                                                              r"It is (sunny|rainy)\."}})
    if stream:
        with client.responses.stream(**kwargs) as events:
            types = [event.type for event in events]
            response = events.get_final_response()
        assert types.index("response.reasoning_text.delta") < types.index("response.output_text.delta")
    else:
        response = client.responses.create(**kwargs)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text.startswith("\nThe user asks")
    assert message.type == "message" and response.output_text.strip() in ("It is sunny.", "It is rainy.")
    assert response.usage.output_tokens_details.reasoning_tokens > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_output_text_logprobs(client, stream):
    kwargs = dict(model=MODEL_NAME, input="Name a color.", max_output_tokens=6, temperature=0,
                  include=["message.output_text.logprobs"], top_logprobs=2)
    if stream:
        with client.responses.stream(**kwargs) as events:
            streamed = [entry for event in events if event.type == "response.output_text.delta"
                        for entry in event.logprobs]
            response = events.get_final_response()
    else:
        response = client.responses.create(**kwargs)
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == response.usage.output_tokens
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in logprobs)
    assert logprobs[0].token == logprobs[0].top_logprobs[0].token  # greedy: the most likely token
    if stream:
        assert [entry.token for entry in streamed] == [entry.token for entry in logprobs[:len(streamed)]]


def test_background_response_is_polled_and_cancelled(client):
    done = client.responses.create(model=MODEL_NAME, input="Say hi.", max_output_tokens=4, background=True)
    assert done.status == "queued" and done.background
    assert wait_until(lambda: client.responses.retrieve(done.id).status in ("completed", "incomplete"), timeout=120)
    assert client.responses.retrieve(done.id).output_text
    running = client.responses.create(model=MODEL_NAME, input="Count to a thousand.", max_output_tokens=200,
                                      background=True, extra_body={"ignore_eos": True})
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(running.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(running.id)
    synchronous = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.cancel(synchronous.id)
    assert "synchronous" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")


@pytest.mark.parametrize("extra, param", [
    (dict(include=["reasoning.encrypted_content"]), "include"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(include=["message.output_text.logprobs"], top_logprobs=1000), "top_logprobs"),
    (dict(truncation="auto"), "truncation"),
    (dict(reasoning={"effort": "high"}), "reasoning"),
    (dict(tools=[{"type": "web_search"}]), "tools"),
    (dict(tool_choice={"type": "web_search_preview"}, tools=[WEATHER]), "tool_choice"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "input"),
    (dict(input=[{"type": "item_reference", "id": "x"}]), "input"),
    (dict(max_output_tokens=100_000), "max_output_tokens"),
    (dict(input=[]), "input"),
    (dict(text={"format": {"type": "xml"}}), "text"),
    (dict(background=True, store=False), "background"),
    (dict(extra_body={"vllm_xargs": {"a": 1}}), "vllm_xargs"),
])
def test_bad_input_is_400_naming_the_field(client, extra, param):
    kwargs = dict(model=MODEL_NAME, input="Hi", max_output_tokens=4) | extra
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**kwargs)
    assert info.value.body["param"] == param, info.value.body
    assert info.value.body["message"].startswith(param), info.value.body


def test_streamed_background_response_is_replayed(client, server):
    kwargs = dict(model=MODEL_NAME, input="Name a color.", max_output_tokens=8, temperature=0)
    live = list(client.responses.create(background=True, stream=True, **kwargs))
    final = live[-1].response
    assert [e.type for e in live[:2]] == ["response.created", "response.in_progress"] and final.background
    assert final.output_text == client.responses.create(**kwargs).output_text
    assert [e.sequence_number for e in live] == list(range(len(live)))
    replayed = list(client.responses.retrieve(final.id, stream=True, starting_after=1))
    assert [e.model_dump() for e in replayed] == [e.model_dump() for e in live[2:]]
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        created = http.post("/v1/responses", json={"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 2})
        replay = http.get(f"/v1/responses/{created.json()['id']}", params={"stream": "true"})
        assert replay.status_code == 400 and replay.json()["error"]["param"] == "stream"
        replay = http.get(f"/v1/responses/{created.json()['id']}", params={"starting_after": 3})
        assert replay.status_code == 400 and replay.json()["error"]["param"] == "starting_after"


def test_store_keeps_running_responses_and_evicts_the_oldest_finished():
    def entry(name: str, running: bool = False) -> StoredResponse:
        response = ResponsesResponse(id=name, status="in_progress" if running else "completed", model="m")
        task = type("Task", (), {"done": lambda self: not running})()
        return StoredResponse(response, [], task)

    store = ResponseStore(max_size=2)
    store.put(entry("running", running=True))
    store.put(entry("a"))
    store.put(entry("b"))
    assert store.get("a") is None and store.get("running") is not None and store.get("b") is not None
    store.put(entry("c"))
    assert store.get("b") is None and len(store) == 2
