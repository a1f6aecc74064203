"""Property-based API fuzzing: schemathesis generates requests from the app's own OpenAPI schema (valid ones and
deliberately invalid ones) and every answer must be a non-5xx response (invalid input is a 4xx in OpenAI's error
shape, never a crash) that the schema describes: its status code, content type, headers and body (schemathesis'
response-conformance checks); each path's ``Allow`` lists exactly its documented methods.

Runs against the ASGI app (no socket) built over the real engine with the real SmolLM2. Fuzzed requests may ask
for a lot of generation work (n up to 128, no max_tokens = fill the whole context), which is legitimate but would
take minutes on CPU, so the test shrinks *valid* work sizes before sending (``cap_generation_work``); invalid
values are left alone so the validation paths are still exercised.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis.checks import (content_type_conformance, not_a_server_error,  # noqa: E402
                                 response_headers_conformance, response_schema_conformance,
                                 status_code_conformance)
from schemathesis.generation import GenerationMode  # noqa: E402

MODEL_NAME = "smollm2-schema"
MAX_EXAMPLES = 25
# Per fuzzed request: at most this many output tokens, choices and prompts.
MAX_FUZZ_TOKENS, MAX_FUZZ_N, MAX_FUZZ_PROMPTS = 4, 2, 2


@pytest.fixture(scope="module")
def schema_app(serving_engine):
    from serving.app import create_app

    app = create_app(serving_engine, served_model_name=MODEL_NAME)
    yield app
    app.state.server.engine.shutdown()


@pytest.fixture(scope="module")
def api_schema(schema_app):
    return schemathesis.openapi.from_asgi("/openapi.json", schema_app)


# Every operation the app serves (checked against the schema below, so a new route cannot go unfuzzed).
OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
              ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/health"), ("GET", "/metrics"),
              ("GET", "/ping"), ("POST", "/ping"), ("GET", "/version"), ("POST", "/v1/embeddings"),
              ("POST", "/v1/score"), ("POST", "/v1/rerank"), ("POST", "/classify"), ("POST", "/v1/responses"),
              ("GET", "/v1/responses/{response_id}"), ("POST", "/v1/responses/{response_id}/cancel")]


def _valid_int(value) -> bool:
    """An int, or an integral float (pydantic coerces 99.0 to 99, so it is a valid size too)."""
    if isinstance(value, float):
        return value.is_integer()
    return isinstance(value, int) and not isinstance(value, bool)


def cap_generation_work(body, path: str) -> None:
    """Shrink valid generation sizes in a fuzzed body in place (invalid values stay as generated)."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if _valid_int(body.get(key)) and body[key] > MAX_FUZZ_TOKENS:
            body[key] = MAX_FUZZ_TOKENS
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = MAX_FUZZ_TOKENS  # chat default is "the rest of the context"
    if path == "/v1/responses" and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = MAX_FUZZ_TOKENS  # Responses default: the rest of the context
    if "prompt" in body and "max_tokens" not in body:
        body["max_tokens"] = MAX_FUZZ_TOKENS  # completions default: 16
    if _valid_int(body.get("n")) and body["n"] > MAX_FUZZ_N:
        body["n"] = MAX_FUZZ_N
    if _valid_int(body.get("min_tokens")) and body["min_tokens"] > MAX_FUZZ_TOKENS:
        body["min_tokens"] = MAX_FUZZ_TOKENS
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        body["prompt"] = prompt[:MAX_FUZZ_PROMPTS]


def test_schema_lists_every_operation(api_schema):
    listed = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert listed == set(OPERATIONS)


# schemathesis' own pytest plugin (schema.parametrize / from_fixture) does not run under pytest 9, so each
# operation's hypothesis strategy is driven directly.
# Negative cases (schema-violating bodies) exist only for operations that take a body.
NO_BODY = {("POST", "/ping"), ("POST", "/v1/responses/{response_id}/cancel")}
CASES = [(method, path, mode) for method, path in OPERATIONS for mode in GenerationMode
         if mode is GenerationMode.POSITIVE or (method == "POST" and (method, path) not in NO_BODY)]


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]


@pytest.mark.parametrize("method, path, mode", CASES, ids=[f"{m} {p} {g.value}" for m, p, g in CASES])
def test_responses_conform_to_the_schema(api_schema, method, path, mode):
    operation = api_schema[path][method]

    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=True, database=None, phases=[Phase.explicit, Phase.generate])  # no shrinking: bounded time
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case):
        cap_generation_work(case.body, path)
        response = case.call()
        assert response.status_code < 500, (
            f"{method} {path} -> {response.status_code}: {response.text[:500]}\nbody: {case.body!r}")
        case.validate_response(response, checks=CHECKS)
        if response.status_code >= 400:  # every refusal uses OpenAI's error body, naming the status
            error = response.json()["error"]
            assert {"message", "type", "param", "code"} <= set(error) and error["code"] == response.status_code

    check()


def test_each_path_allows_exactly_its_documented_methods(schema_app, api_schema):
    """An undocumented method is 405 with ``Allow`` naming every documented one (a path served by a GET and a
    POST route, /ping, lists both; HEAD comes with GET)."""
    from fastapi.testclient import TestClient

    client = TestClient(schema_app)
    documented: dict[str, set[str]] = {}
    for method, path in OPERATIONS:
        documented.setdefault(path, set()).add(method)
    for path, methods in documented.items():
        for probe in ("OPTIONS", "PUT", "DELETE"):
            response = client.request(probe, path)
            assert response.status_code == 405, (probe, path, response.text)
            allowed = {m.strip() for m in response.headers["allow"].split(",")} - {"HEAD"}
            assert allowed == methods, (probe, path, response.headers["allow"])
            assert response.json()["error"]["code"] == 405


def test_health_ping_metrics_content_types(schema_app, api_schema):
    """/health and /ping answer 200 with an empty body (documented without content); /metrics Prometheus text."""
    from fastapi.testclient import TestClient

    client = TestClient(schema_app)
    paths = api_schema.raw_schema["paths"]
    for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
        response = client.request(method, path)
        assert response.status_code == 200 and response.content == b""
        assert "content" not in paths[path][method.lower()]["responses"]["200"]
    response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
