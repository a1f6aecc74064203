"""Hostile and unlucky input (issue 25): stop-string limits and their bounded per-token work, request body and
prompt-length limits, tokenization off the event loop, auth scheme and scope, strict types, lone surrogates,
admission counted in sequences, ``cache_salt`` isolation, the bounded shutdown drain, the exit on engine death, and
a soak of 200 concurrent streams with random disconnects.

The server tests share one app over the session's real SmolLM2 engine (``serving_engine``: max_model_len 256,
4 sequences per step), with the engine on a thread of the server (``--no-engine-process``); the drain test ends
that app, so it runs last.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import socket
import threading
import uuid

import httpx
import pytest
from test_serving import ServerThread, wait_until

from paged_jax.engine.detokenizer import IncrementalDetokenizer, check_stop_strings
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import Request

MODEL_NAME = "smollm2-hostile"
API_KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_WAITING = 8
MAX_SEQS_PER_REQUEST = 6
MAX_BODY = 256 * 1024


# ------------------------------------------------------------------------------------- stop strings (offline)
def test_stop_string_search_work_is_bounded_per_token(smollm2_tokenizer):
    """64 stop strings of 512 characters: each token searches at most the new characters plus the held-back
    window per stop string, however long the output already is (the work is counted, not timed)."""
    stops = [f"{i:03d}" + "z" * 509 for i in range(64)]
    window = max(len(s) for s in stops) - 1
    output_ids = smollm2_tokenizer.encode(" The quick brown fox jumps over the lazy dog." * 100)
    detokenizer = IncrementalDetokenizer(smollm2_tokenizer, [], stop=stops)
    per_token = []
    for token in output_ids:
        searched, text_len = detokenizer.num_stop_chars_searched, len(detokenizer.text)
        detokenizer.append([token])
        new_chars = len(detokenizer.text) - text_len
        per_token.append(detokenizer.num_stop_chars_searched - searched)
        assert per_token[-1] <= len(stops) * (new_chars + window)
    assert len(detokenizer.text) > 4 * window  # long enough that a whole-text scan would show
    # Flat once the text is longer than the window: the 1,000th token costs what the 300th did.
    assert max(per_token[-50:]) <= max(per_token[300:350]) + len(stops) * 16
    # The held-back window: all but the last max(len(stop)) - 1 characters are out.
    assert detokenizer.emitted_text == detokenizer.text[:-window]
    assert detokenizer.stop_reason is None


def test_stop_string_still_cuts_with_the_window(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(" alpha beta gamma delta")
    detokenizer = IncrementalDetokenizer(smollm2_tokenizer, [], stop=["gamma", "a much longer stop string"])
    emitted = ""
    for token in ids:
        delta, stop = detokenizer.append([token])
        emitted += delta
        if stop:
            break
    assert stop == "gamma" and emitted == " alpha beta "


def test_stop_string_limits():
    check_stop_strings(["a"] * 4, max_stop_strings=4, max_stop_string_len=1)
    with pytest.raises(ValueError, match=r"^stop: at most 4 stop strings.*max_stop_strings"):
        check_stop_strings(["a"] * 5, max_stop_strings=4, max_stop_string_len=10)
    with pytest.raises(ValueError, match=r"^stop: a stop string may have at most 3 characters.*max_stop_string_len"):
        check_stop_strings(["abcd"], max_stop_strings=4, max_stop_string_len=3)


# ------------------------------------------------------------------------------------ cache_salt (KV manager)
def test_cache_salt_isolates_prefix_cache_entries():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    prompt = list(range(1, 14))  # 3 full blocks

    def run(request_id, salt):
        request = Request(request_id, prompt, cache_salt=salt)
        blocks, num_hit = kv.get_computed_blocks(request)
        assert kv.allocate_slots(request, len(prompt) - num_hit, blocks)
        request.num_computed_tokens = len(prompt)
        kv.cache_full_blocks(request)
        kv.free(request)
        return num_hit

    assert run("a1", "tenant-a") == 0
    assert run("b1", "tenant-b") == 0  # same prompt, another salt: no hit
    assert run("none", None) == 0  # unsalted requests do not see salted entries either
    assert run("a2", "tenant-a") == 12  # same salt: the 3 full blocks hit
    with pytest.raises(ValueError, match="^cache_salt must be a non-empty string"):
        Request("bad", prompt, cache_salt="")


def test_cache_salt_offline_prompt_dict(serving_engine):
    """vLLM's offline form: ``{"prompt_token_ids": ..., "cache_salt": ...}`` (runs before this file's server
    exists, so this thread alone drives the engine)."""
    from paged_jax.sampling_params import SamplingParams

    engine = serving_engine
    ids = [1 + (i * 7919 + hash(uuid.uuid4().hex)) % 40000 for i in range(40)]  # fresh: no earlier cache entry
    params = SamplingParams(max_tokens=1)

    def hits(request_id, salt):
        before = engine.stats()["prefix_cache_hits"]
        prompt = {"prompt_token_ids": ids} if salt is None else {"prompt_token_ids": ids, "cache_salt": salt}
        engine.add_request(request_id, prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        return engine.stats()["prefix_cache_hits"] - before

    assert hits("salt-a-1", "a") == 0
    assert hits("salt-b-1", "b") == 0
    assert hits("salt-a-2", "a") > 0
    with pytest.raises(ValueError, match="^cache_salt"):
        engine.add_request("salt-bad", {"prompt_token_ids": ids, "cache_salt": ""}, params)
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="^stop: at most 64"):
        engine.add_request("stops", ids, SamplingParams(max_tokens=1, stop=["x"] * 65))


# ------------------------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server(serving_engine):
    from serving.app import create_app

    app = create_app(serving_engine, served_model_name=MODEL_NAME, api_key=API_KEY, api_key_protect_all=True,
                     max_waiting_requests=MAX_WAITING, max_seqs_per_request=MAX_SEQS_PER_REQUEST,
                     max_request_body_size=MAX_BODY)
    with ServerThread(app) as handle:
        yield handle


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def _completion(**fields):
    return {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, **fields}


def _error(response, status, param):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == status, error
    return error["message"]


@pytest.mark.parametrize("fields, param", [
    ({"prompt": [True, 2]}, "prompt"),  # a bool is no token id
    ({"max_tokens": True}, "max_tokens"),
    ({"n": "2"}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"echo": 1}, "echo"),
    ({"temperature": "0.5"}, "temperature"),
    ({"stop_token_ids": [False]}, "stop_token_ids"),
    ({"cache_salt": ""}, "cache_salt"),
])
def test_strict_types(http, fields, param):
    _error(http.post("/v1/completions", json=_completion(**fields), headers=AUTH), 400, param)


def test_schema_values_still_accepted(http):
    response = http.post("/v1/completions", json=_completion(max_tokens=2.0, temperature=0, stream=False),
                         headers=AUTH)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", '{"model": "\\ud800", "prompt": "Hi", "max_tokens": 1}', "model"),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 1, "stop": ["\\udc00"]}', "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud83d"}]}', "messages"),
    ("/tokenize", '{"prompt": "\\udfff"}', "prompt"),
])
def test_lone_surrogate_is_400(http, path, body, param):
    response = http.post(path, content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert "surrogate" in _error(response, 400, param)
    # A surrogate pair is one valid character.
    ok = http.post("/tokenize", content='{"prompt": "\\ud83d\\ude00"}',
                   headers={**AUTH, "Content-Type": "application/json"})
    assert ok.status_code == 200


def test_auth_scheme_case_and_scope(http):
    assert http.post("/v1/completions", json=_completion()).status_code == 401
    for scheme in ("bearer", "BEARER", "Bearer"):
        response = http.post("/v1/completions", json=_completion(), headers={"Authorization": f"{scheme} {API_KEY}"})
        assert response.status_code == 200, (scheme, response.text)
    assert http.post("/v1/completions", json=_completion(),
                     headers={"Authorization": f"Basic {API_KEY}"}).status_code == 401
    # --api-key-protect-all: the key guards /tokenize, /detokenize and /metrics too; /health stays open.
    assert http.post("/tokenize", json={"prompt": "hi"}).status_code == 401
    assert http.post("/detokenize", json={"tokens": [1]}).status_code == 401
    assert http.get("/metrics").status_code == 401
    assert http.get("/metrics", headers=AUTH).status_code == 200
    assert http.get("/health").status_code == 200


def test_body_size_limit(http):
    big = _completion(prompt="a " * MAX_BODY)
    message = _error(http.post("/v1/completions", json=big, headers=AUTH), 413, "body")
    assert "--max-request-body-size" in message

    def chunked():  # no Content-Length: counted as it arrives
        for _ in range(MAX_BODY // 1024 + 2):
            yield b" " * 1024

    _error(http.post("/v1/completions", content=chunked(), headers={**AUTH, "Content-Type": "application/json"}),
           413, "body")
    assert http.post("/v1/completions", json=_completion(), headers=AUTH).status_code == 200


class _RecordingTokenizer:
    """The server's tokenizer copy, recording the threads that encode with it."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.encode_threads: list[str] = []

    def encode(self, *args, **kwargs):
        self.encode_threads.append(threading.current_thread().name)
        return self._tokenizer.encode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_prompt_text_checked_before_tokenization_off_the_event_loop(server, http):
    openai_server = server.app.state.server
    recording = _RecordingTokenizer(openai_server.tokenizer)
    openai_server.tokenizer = recording
    try:
        too_long = "x" * (openai_server.max_prompt_chars + 1)  # still under the body limit
        assert len(too_long) < MAX_BODY
        message = _error(http.post("/v1/completions", json=_completion(prompt=too_long), headers=AUTH), 400,
                         "prompt")
        assert "characters" in message and not recording.encode_threads  # refused untokenized
        assert http.post("/v1/completions", json=_completion(), headers=AUTH).status_code == 200
        assert http.post("/tokenize", json={"prompt": "hello"}, headers=AUTH).status_code == 200
        assert recording.encode_threads and all(name.startswith("paged-jax-tokenizer")
                                                for name in recording.encode_threads)
    finally:
        openai_server.tokenizer = recording._tokenizer


def test_admission_counts_sequences(http, server):
    # n above what the waiting queue holds: never admissible, so 400 (not 503 forever).
    message = _error(http.post("/v1/completions", json=_completion(n=MAX_WAITING + 1), headers=AUTH), 400, "n")
    assert "--max-seqs-per-request" in message or "--max-waiting-requests" in message
    message = _error(http.post("/v1/completions", json=_completion(prompt=["a", "b", "c", "d"], n=2),
                               headers=AUTH), 400, "n")
    assert "8 sequences (4 prompt(s) x n=2)" in message and "--max-seqs-per-request" in message
    assert http.post("/v1/completions", json=_completion(prompt=["a", "b", "c"], n=2),
                     headers=AUTH).status_code == 200


def test_stop_string_limits_are_400(http):
    _error(http.post("/v1/completions", json=_completion(stop=["s"] * 65), headers=AUTH), 400, "stop")
    _error(http.post("/v1/completions", json=_completion(stop=["s" * 513]), headers=AUTH), 400, "stop")


def test_cache_salt_isolates_tenants(server, http):
    async_engine = server.async_engine
    prompt = f"{uuid.uuid4().hex} " + "The same long shared system prompt for every tenant. " * 4

    def hits_after(salt):
        before = async_engine.latest_stats["prefix_cache_hits"]
        fields = {"cache_salt": salt} if salt else {}
        response = http.post("/v1/completions", json=_completion(prompt=prompt, max_tokens=1, **fields),
                             headers=AUTH)
        assert response.status_code == 200, response.text
        return async_engine.latest_stats["prefix_cache_hits"] - before

    assert hits_after("tenant-a") == 0
    assert hits_after("tenant-b") == 0
    assert hits_after(None) == 0
    assert hits_after("tenant-a") > 0
    assert hits_after(None) > 0


# ------------------------------------------------------------------------------------------------ the soak
NUM_STREAMS, BURST, DISCONNECT_FRACTION = 200, 100, 0.3


async def _soak_stream(client: httpx.AsyncClient, index: int, disconnect: bool, rng: random.Random) -> str:
    max_tokens = rng.randint(1, 2)
    body = _completion(prompt=f"Request {index}: count to ten.", max_tokens=max_tokens, ignore_eos=True,
                       stream=True, temperature=0)
    async with client.stream("POST", "/v1/completions", json=body, headers=AUTH) as response:
        assert response.status_code == 200, await response.aread()
        if disconnect and rng.random() < 0.5:
            return "left before reading"
        num_tokens, finish, done = 0, None, False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if disconnect:
                return "left mid-stream"
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                break
            choice = json.loads(payload)["choices"][0]
            assert "error" not in payload
            num_tokens += 1 if choice["text"] or choice["finish_reason"] is None else 0
            finish = choice["finish_reason"] or finish
    assert done and finish == "length", (index, finish, done)
    return "completed"


# CI time: a soak; the disconnect and drain paths stay in CI through the shutdown and engine-death tests here.
@pytest.mark.slow
def test_soak_streams_with_disconnects_and_a_burst(server, serving_engine):
    """200 concurrent streams (the first 100 at once), 30% of the clients leaving early: every other stream
    completes, and the engine returns to idle with no block held (engine on a thread of the server)."""
    async_engine = server.async_engine
    async_engine.max_waiting_requests = None  # this test is about the burst, not the admission bound
    rng = random.Random(25)
    disconnects = [rng.random() < DISCONNECT_FRACTION for _ in range(NUM_STREAMS)]

    async def main():
        limits = httpx.Limits(max_connections=NUM_STREAMS + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as client:
            burst = [_soak_stream(client, i, disconnects[i], random.Random(i)) for i in range(BURST)]

            async def later(i):
                await asyncio.sleep(rng.random() * 0.5)
                return await _soak_stream(client, i, disconnects[i], random.Random(i))

            rest = [later(i) for i in range(BURST, NUM_STREAMS)]
            return await asyncio.gather(*burst, *rest)

    try:
        results = asyncio.run(main())
    finally:
        async_engine.max_waiting_requests = MAX_WAITING
    assert results.count("completed") == disconnects.count(False)
    assert len(results) == NUM_STREAMS

    def idle():
        stats = async_engine.latest_stats
        return (async_engine.num_in_flight == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
                and stats["kv_cache_usage"] == 0)

    assert wait_until(idle, timeout=2.0, interval=0.05), async_engine.latest_stats
    kv = serving_engine.engine_core.kv_cache_manager  # the engine thread is idle now
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert all(block.ref_cnt == 0 for block in kv.blocks)
    assert not serving_engine.has_unfinished_requests()


# --------------------------------------------------------------------------------------- shutdown / death
class _DyingEngine:
    """An AsyncEngine stand-in whose engine dies after a few ticks."""

    def __init__(self) -> None:
        self.dead_error = None
        self.is_healthy = True
        self.num_in_flight = 0
        self.shutdowns = 0

    def die(self) -> None:
        self.dead_error = RuntimeError("a step failed")
        self.is_healthy = False

    def shutdown(self) -> None:
        self.shutdowns += 1


def test_serve_exits_non_zero_when_the_engine_dies(monkeypatch):
    from fastapi import FastAPI

    from serving import cli

    engine = _DyingEngine()
    app = FastAPI()
    app.state.server = type("Server", (), {"engine": engine})()
    monkeypatch.setattr(cli, "build_app_from_args", lambda args: (app, None))
    threading.Timer(1.0, engine.die).start()
    assert cli.serve_main(["--host", "127.0.0.1", "--port", "0"]) == 1
    assert engine.shutdowns >= 1


def test_shutdown_drain_is_bounded_and_ends_streams_with_an_error(server, http):
    """Last (it ends the module's app): after SIGTERM, a stream still running when --shutdown-timeout passes
    ends with an error event and [DONE], and the server stops."""
    import uvicorn

    from serving.lifecycle import ServingServer

    drain = ServingServer(uvicorn.Config(server.app, host="127.0.0.1", port=0, log_level="warning"),
                          server.async_engine, shutdown_timeout=0.5)
    server._server.should_exit = True  # the module's uvicorn stops; its app and engine go on under `drain`
    server._thread.join(timeout=60)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sockets = [sock]
    base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    thread = threading.Thread(target=drain.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    assert wait_until(lambda: drain.started, timeout=30)
    events = []

    def read_stream():
        body = _completion(prompt="Tell me a long story.", max_tokens=200, ignore_eos=True, stream=True)
        with httpx.stream("POST", base_url + "/v1/completions", json=body, headers=AUTH, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])

    reader = threading.Thread(target=read_stream, daemon=True)
    reader.start()
    assert wait_until(lambda: len(events) >= 2, timeout=30)
    drain.handle_exit(signal.SIGTERM, None)
    reader.join(timeout=30)
    thread.join(timeout=30)
    assert not reader.is_alive() and not thread.is_alive()
    assert events[-1] == "[DONE]"
    assert "error" in json.loads(events[-2]), events[-2]
    assert not drain.engine_died and not server.async_engine.is_healthy
