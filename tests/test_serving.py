"""The OpenAI-compatible server end to end: the real engine with the real SmolLM2-135M-Instruct on CPU, served by
uvicorn on a free localhost port (in a background thread, started once for this file), driven by the official
``openai`` client and raw httpx where the client hides what we check (status codes, headers, SSE bytes).

The server runs with an API key (so every test also covers auth), a small engine (max_model_len 256, 4 sequences)
and a waiting queue bounded at 4 requests. The last test injects an engine failure, so it must stay last.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import re
import socket
import threading
import time
from typing import Any, Callable

import httpx
import openai
import pytest

MODEL_NAME = "smollm2-test"
API_KEY = "test-key"
MAX_MODEL_LEN = 256
MAX_WAITING = 4
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


# ------------------------------------------------------------------------------------------------- helpers
class ServerThread:
    """uvicorn serving ``app`` on a free localhost port from a background thread (context manager)."""

    def __init__(self, app) -> None:
        import uvicorn

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.app = app
        self.async_engine = app.state.server.engine
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, name="uvicorn-test", daemon=True)

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        if not wait_until(lambda: self._server.started or not self._thread.is_alive(), timeout=60):
            raise RuntimeError("uvicorn did not start")
        if not self._server.started:
            raise RuntimeError("uvicorn exited during start-up")
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=60)
        self.async_engine.shutdown()


def wait_until(condition: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def metric_value(text: str, sample_name: str, all_labels: bool = False) -> Any:
    """Value of the first sample called ``sample_name`` in a Prometheus exposition (None if absent), or with
    ``all_labels`` a list of ``(labels, value)`` for every such sample."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = [(sample.labels, sample.value) for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == sample_name]
    if all_labels:
        return samples
    return samples[0][1] if samples else None


class ThreadRecordingEngine:
    """Delegates to the real engine and records which threads call its methods (it is not thread-safe: only the
    engine thread may call it)."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.calling_threads: set[int] = set()

    def __getattr__(self, name: str):
        value = getattr(self._engine, name)
        if not inspect.ismethod(value):
            return value  # plain attributes (tokenizer, max_model_len, ...) are read at app construction

        def recorded(*args, **kwargs):
            self.calling_threads.add(threading.get_ident())
            return value(*args, **kwargs)

        return recorded


@pytest.fixture(scope="module")
def server(serving_engine):
    from serving.app import create_app

    # --max-seqs-per-request at the engine's 4 seats (its default is half): the tests run n and batches up to 4.
    app = create_app(ThreadRecordingEngine(serving_engine), served_model_name=MODEL_NAME, api_key=API_KEY,
                     max_waiting_requests=MAX_WAITING, max_seqs_per_request=4)
    with ServerThread(app) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def http(server) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=120)


def tokenize(server, text: str) -> list[int]:
    with http(server) as c:
        return c.post("/tokenize", json={"prompt": text}).json()["tokens"]


# ------------------------------------------------------------------------------------------------- basics
def test_models_health_and_auth(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].max_model_len == MAX_MODEL_LEN
    with http(server) as c:
        assert c.get("/health").status_code == 200
        # Every /v1 route needs the key; /health, /metrics and /tokenize stay open (as in vLLM).
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = c.request(method, path, headers=headers, json={"prompt": "hi", "messages": CHAT})
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["code"] == 401
    bad_client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)


def test_completion_greedy_with_usage(server, client):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL_NAME
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].text
    assert r.usage.prompt_tokens == len(tokenize(server, prompt))
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # Same prompt as token ids: same greedy text.
    r_ids = client.completions.create(model=MODEL_NAME, prompt=tokenize(server, prompt), max_tokens=8, temperature=0)
    assert r_ids.choices[0].text == r.choices[0].text


def test_chat_completion(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=12, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content  # SmolLM2-135M-Instruct greedily answers "The capital of France is Paris."
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 10


def test_max_completion_tokens_and_finish_length(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
    assert r.choices[0].finish_reason == "length"


def test_n2_and_prompt_batch(client):
    r = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", n=2, max_tokens=6, temperature=1.0,
                                  seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1]
    r = client.completions.create(model=MODEL_NAME, prompt=["Hello", "Goodbye"], n=2, max_tokens=4,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 16  # ignore_eos: all four choices run to max_tokens
    # Greedy choices of one prompt agree; the two prompts are separate requests.
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text


def test_stop_string(client):
    prompt = "List the days of the week: Monday,"
    base = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0)
    text = base.choices[0].text
    words = re.findall(r"[A-Za-z]{3,}", text)
    assert words, f"greedy output has no word to stop on: {text!r}"
    stop = words[min(1, len(words) - 1)]
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    kept = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0, stop=stop,
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]


def test_top_k_beyond_vocab_means_off(client):
    greedy = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4, temperature=0)
    huge = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4, temperature=0,
                                     extra_body={"top_k": 2**40})
    assert huge.choices[0].text == greedy.choices[0].text


def test_seed_reproducibility(client):
    def sample(seed: int) -> str:
        r = client.completions.create(model=MODEL_NAME, prompt="My favourite animal is", max_tokens=12,
                                      temperature=1.0, seed=seed, extra_body={"ignore_eos": True})
        return r.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=5, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0.0
        assert 2 <= len(top) <= 3  # the 2 most likely, plus the sampled token if it is not among them
        # Greedy: the sampled token is the most likely one.
        assert token in top and logprob == pytest.approx(max(top.values()), abs=1e-4)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        assert entry.bytes == list(entry.token.encode("utf-8"))
        ranked = [t.logprob for t in entry.top_logprobs]
        assert ranked == sorted(ranked, reverse=True)


# ------------------------------------------------------------------------------------------------- streaming
def test_streaming_completion_with_usage(client):
    stream = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=10, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    *text_chunks, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 10
    assert all(c.usage is None for c in text_chunks)
    assert text_chunks[-1].choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in text_chunks)
    full = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert streamed == full.choices[0].text
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens


def test_streamed_chat_equals_non_streamed(client):
    full = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == full.choices[0].message.content
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_sse_wire_format(server):
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 3, "stream": True, "temperature": 0}
    with http(server) as c:
        r = c.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = r.text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ")
        assert "usage" not in json.loads(event[len("data: "):])  # usage only with stream_options.include_usage


# ------------------------------------------------------------------------------------------------- tokenizer
def test_tokenize_detokenize_round_trip(server):
    text = "Paged attention, in JAX!"
    with http(server) as c:
        tok = c.post("/tokenize", json={"model": MODEL_NAME, "prompt": text}).json()
        assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == MAX_MODEL_LEN
        assert c.post("/detokenize", json={"model": MODEL_NAME, "tokens": tok["tokens"]}).json() == {"prompt": text}
        chat = c.post("/tokenize", json={"messages": CHAT}).json()
        assert chat["count"] > tok["count"]
        r = c.post("/detokenize", json={"tokens": [10**9]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


# ------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "max_tokens": MAX_MODEL_LEN + 10}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": [1, 2, 10**9]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "word " * (MAX_MODEL_LEN + 5)}, "prompt"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"max_tokens": 3}, "prompt"),
])
def test_bad_completion_input_is_400_naming_the_field(server, body, param):
    with http(server) as c:
        r = c.post("/v1/completions", json={"model": MODEL_NAME, **body}, headers=AUTH)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == 400 and error["type"] == "invalid_request_error"
    assert error["message"]


def test_bad_chat_input_and_engine_still_serves(server, client):
    with http(server) as c:
        for body, param in (({"messages": []}, "messages"),
                            ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
                            ({"messages": CHAT, "max_completion_tokens": 10**6}, "max_completion_tokens"),
                            ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                            ({"messages": CHAT, "presence_penalty": 3}, "presence_penalty")):
            r = c.post("/v1/chat/completions", json={"model": MODEL_NAME, **body}, headers=AUTH)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        r = c.post("/v1/completions", content=b"{not json", headers={**AUTH, "content-type": "application/json"})
        assert r.status_code == 400
        r = c.post("/v1/completions", json={"model": "no-such-model", "prompt": "hi"}, headers=AUTH)
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="hi", temperature=5)
    assert info.value.body["param"] == "temperature"
    assert client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


# ------------------------------------------------------------------------------------------------- stress
def _engine_idle(server) -> bool:
    with http(server) as c:
        text = c.get("/metrics").text
    return (metric_value(text, "paged_jax:num_requests_running") == 0
            and metric_value(text, "paged_jax:num_requests_waiting") == 0
            and metric_value(text, "paged_jax:kv_cache_usage_perc") == 0
            and server.async_engine.num_in_flight == 0)


def _successes(server) -> float:
    with http(server) as c:
        text = c.get("/metrics").text
    return sum(value for labels, value in metric_value(text, "paged_jax:request_success_total", all_labels=True))


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_blocks(server, stream):
    assert wait_until(lambda: _engine_idle(server), timeout=60)
    successes_before = _successes(server)
    # 2 x 240 tokens take several seconds on CPU; the client leaves after a few chunks / 1 s.
    body = {"model": MODEL_NAME, "prompt": "Tell me a long story.", "max_tokens": 240, "n": 2, "ignore_eos": True,
            "temperature": 0, "stream": stream}
    with httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(120, read=1.0)) as c:
        if stream:
            with c.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                received = [line for line, _ in zip(lines, range(4)) if line.startswith("data: ")]
                assert received  # tokens were flowing; leaving the block closes the connection mid-stream
        else:
            # The client gives up (read timeout) long before the tokens are done and closes the connection.
            with pytest.raises(httpx.ReadTimeout):
                c.post("/v1/completions", json=body, headers=AUTH)
    assert wait_until(lambda: _engine_idle(server), timeout=60), "request was not aborted / blocks not freed"
    assert _successes(server) == successes_before  # it was aborted, not run to completion


def test_lagging_stream_gets_merged_multi_token_chunks(server, client):
    """A stream whose consumer falls behind the engine gets the deltas queued meanwhile merged into one chunk
    (fewer, larger chunks, nothing lost): text, token ids / logprobs and usage stay exact."""
    assert wait_until(lambda: _engine_idle(server), timeout=60)
    async_engine = server.async_engine
    deliver = async_engine._deliver
    stalled = []

    def stalling_deliver(items):  # on the event loop: block it once while the engine takes 3 more steps
        deliver(items)
        if not stalled:
            stalled.append(True)
            steps = async_engine.num_steps
            wait_until(lambda: async_engine.num_steps >= steps + 3, timeout=60, interval=0.02)

    kwargs = dict(model=MODEL_NAME, prompt="Count to ten:", max_tokens=24, temperature=0, logprobs=1,
                  extra_body={"ignore_eos": True})
    async_engine._deliver = stalling_deliver
    try:
        chunks = [c for c in client.completions.create(stream=True, stream_options={"include_usage": True},
                                                         **kwargs)]
    finally:
        del async_engine._deliver
    whole = client.completions.create(**kwargs).choices[0]
    *text_chunks, usage_chunk = chunks
    tokens_per_chunk = [len(c.choices[0].logprobs.tokens) for c in text_chunks]
    assert max(tokens_per_chunk) > 1 and sum(tokens_per_chunk) == 24, tokens_per_chunk
    assert usage_chunk.usage.completion_tokens == 24
    assert "".join(c.choices[0].text for c in text_chunks) == whole.text
    streamed = [(c.choices[0].logprobs, c.choices[0].text) for c in text_chunks]
    assert [t for lp, _ in streamed for t in lp.tokens] == whole.logprobs.tokens
    assert [x for lp, _ in streamed for x in lp.token_logprobs] == pytest.approx(whole.logprobs.token_logprobs)
    sent = 0  # a chunk's offsets start at the characters streamed before it (vLLM's initial_text_offset)
    for lp, text in streamed:
        assert lp.text_offset[0] == sent and lp.text_offset == sorted(lp.text_offset)
        sent += len(text)
    assert all(len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) for lp, _ in streamed)
    assert text_chunks[-1].choices[0].finish_reason == "length"


def test_overload_answers_503_with_retry_after(server, client):
    assert wait_until(lambda: _engine_idle(server), timeout=60)
    body = {"model": MODEL_NAME, "prompt": "Count to one hundred:", "max_tokens": 48, "ignore_eos": True}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, headers=AUTH) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(16)))

    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    rejected = [r for r in responses if r.status_code == 503]
    # 4 run and at most 4 wait; the rest of a 16-request burst must be turned away.
    assert rejected and set(codes) <= {200, 503}, codes
    assert codes.count(200) >= MAX_WAITING
    for r in rejected:
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == 503
    assert wait_until(lambda: _engine_idle(server), timeout=120)
    assert client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_metrics_exposition(server):
    with http(server) as c:
        r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total",
                 "generation_tokens_total"):
        assert metric_value(text, f"paged_jax:{name}") is not None, name
    assert metric_value(text, "paged_jax:generation_tokens_total") > 0
    assert metric_value(text, "paged_jax:prompt_tokens_total") > 0
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert metric_value(text, f"paged_jax:{name}_count") > 0, name
    reasons = {labels.get("finished_reason") for labels, _ in
               metric_value(text, "paged_jax:request_success_total", all_labels=True)}
    assert {"length", "stop"} <= reasons


def test_engine_thread_owns_the_engine_and_sleeps_when_idle(server):
    engine = server.async_engine.engine
    assert engine.calling_threads == {server.async_engine.engine_thread_id}
    assert wait_until(lambda: _engine_idle(server), timeout=60)
    before = server.async_engine.num_loop_iterations
    time.sleep(0.5)
    assert server.async_engine.num_loop_iterations == before  # blocked on the command queue, not spinning


def test_benchmark_load_generator_against_server(server):
    from benchmarks.serving import run_benchmark
    from benchmarks.workloads import random_fixed

    workload = random_fixed(num_prompts=3, input_len=16, output_len=6)
    summary = asyncio.run(run_benchmark(server.base_url, MODEL_NAME, workload, request_rate=50.0,
                                        max_concurrency=2, api_key=API_KEY, num_warmup=1))
    assert summary["completed"] == 3 and summary["failed"] == 0, summary["errors"]
    assert summary["total_output_tokens"] == 18 and summary["total_input_tokens"] == 48  # ignore_eos
    assert 0 < summary["mean_ttft_ms"] <= summary["mean_e2el_ms"]
    assert math.isfinite(summary["mean_tpot_ms"]) and summary["mean_tpot_ms"] > 0
    assert summary["p99_itl_ms"] >= summary["median_itl_ms"] > 0
    assert summary["output_throughput"] > 0


# ------------------------------------------------------------------------------------------------- failure (last)
def test_engine_failure_answers_500_and_health_503(server, client):
    engine = server.async_engine.engine
    assert wait_until(lambda: _engine_idle(server), timeout=60)

    def failing_step():
        raise RuntimeError("injected device failure")

    engine.step = failing_step  # instance attribute: the engine thread picks it up on its next step
    try:
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=4)
        with http(server) as c:
            assert c.get("/health").status_code == 503
            r = c.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": CHAT, "stream": True},
                       headers=AUTH)
            assert r.status_code == 500  # refused up front: no hanging stream
    finally:
        del engine.step  # the shared engine object is reused by other test files


@pytest.mark.parametrize("include_usage", [False, True])
def test_fast_completion_chunk_equals_pydantic(include_usage):
    """The pre-rendered text chunk is the same JSON document as the pydantic model's, for awkward texts too."""
    from serving.protocol import CompletionStreamChoice, CompletionStreamResponse
    from serving.streaming import CompletionTextChunk

    render = CompletionTextChunk('cmpl-"x"\\1', 1764450000, "models/Qwen3 \u00e9", include_usage)
    texts = ["", "Paris", ' "quoted" \\ back', "line\nbreak\ttab\r", "\u00e9\u4e2d\U0001F600", "\x00\x1f\x7f", "</script>"]
    for i, text in enumerate(texts):
        for finish_reason, stop_reason in ((None, None), ("stop", "END"), ("stop", 13), ("length", None)):
            fast = render(i, text, finish_reason, stop_reason)
            model = CompletionStreamResponse(
                id='cmpl-"x"\\1', created=1764450000, model="models/Qwen3 \u00e9",
                choices=[CompletionStreamChoice(index=i, text=text, finish_reason=finish_reason,
                                                stop_reason=stop_reason)])
            want = model.model_dump_json(exclude=None if include_usage else {"usage"})
            assert fast.startswith("data: ") and fast.endswith("\n\n")
            assert json.loads(fast[len("data: "):]) == json.loads(want)
