"""The pooling endpoints through real clients: the openai SDK's ``client.embeddings.create`` (float and base64),
httpx for ``/v1/score``, ``/rerank`` (and ``/v1/rerank``, ``/v2/rerank``) and ``/classify``; bad input answered 400
with OpenAI's error body naming the field. Checked against sentence-transformers and transformers."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
from test_serving import ServerThread

from pooling_models import causal_lm_checkpoint, classifier_checkpoint, sentence_transformer_checkpoint

ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=16, weight_cache=False,
              compilation_cache_dir="")
QUERY = "What is the capital of France?"
DOCUMENTS = ["Bananas are yellow.", "Paris is the capital of France.", "The sky is blue."]


def serve(model_dir, **engine_args) -> ServerThread:
    from paged_jax.config import EngineArgs
    from paged_jax.engine.llm_engine import LLMEngine
    from serving.app import create_app

    engine = LLMEngine(EngineArgs(model=str(model_dir), **ENGINE, **engine_args), use_tqdm=False)
    return ServerThread(create_app(engine, served_model_name="tiny"))


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def assert_error(response: httpx.Response, param: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["code"] == 400
    return error


@pytest.fixture(scope="module")
def base_dir(smollm2_dir, tmp_path_factory):
    return causal_lm_checkpoint(smollm2_dir, tmp_path_factory.mktemp("base"), "qwen3")


@pytest.fixture(scope="module")
def embedder(base_dir, tmp_path_factory):
    directory, model = sentence_transformer_checkpoint(base_dir, tmp_path_factory.mktemp("st"), "lasttoken", True)
    with serve(directory) as server:
        yield server, model


def test_embeddings_openai_client_float_base64_batched_token_ids(embedder):
    server, model = embedder
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    expected = model.encode([QUERY] + DOCUMENTS)
    for encoding_format in ("float", "base64"):
        response = client.embeddings.create(model="tiny", input=[QUERY] + DOCUMENTS, encoding_format=encoding_format)
        assert [d.index for d in response.data] == [0, 1, 2, 3] and response.model == "tiny"
        for data, reference in zip(response.data, expected):
            vector = data.embedding
            if encoding_format == "base64" and isinstance(vector, str):  # the SDK leaves it encoded when asked
                vector = np.frombuffer(base64.b64decode(vector), "<f4")
            assert cosine(vector, reference) >= 0.9999
    default = client.embeddings.create(model="tiny", input=QUERY)  # the SDK asks base64 and decodes it
    assert cosine(default.data[0].embedding, expected[0]) >= 0.9999
    ids = model.tokenizer(QUERY)["input_ids"]
    by_ids = client.embeddings.create(model="tiny", input=[ids, ids[:3]], encoding_format="float")
    assert cosine(by_ids.data[0].embedding, expected[0]) >= 0.9999
    assert by_ids.usage.prompt_tokens == len(ids) + 3 == by_ids.usage.total_tokens
    truncated = client.embeddings.create(model="tiny", input=QUERY, encoding_format="float",
                                         extra_body={"truncate_prompt_tokens": 3})
    assert truncated.usage.prompt_tokens == 3
    assert cosine(truncated.data[0].embedding, by_ids.data[1].embedding) < 0.9999  # the last 3, not the first
    last_three = client.embeddings.create(model="tiny", input=[ids[-3:]], encoding_format="float")
    assert cosine(truncated.data[0].embedding, last_three.data[0].embedding) >= 0.99999
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        raw = c.post("/v1/embeddings", json={"input": QUERY, "encoding_format": "base64"}).json()
        decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
        assert raw["object"] == "list" and cosine(decoded, expected[0]) >= 0.9999


def test_embedder_scores_and_reranks_by_cosine(embedder):
    server, model = embedder
    query_vector, *document_vectors = model.encode([QUERY] + DOCUMENTS)
    expected = [cosine(query_vector, v) for v in document_vectors]
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        scores = c.post("/v1/score", json={"model": "tiny", "text_1": QUERY, "text_2": DOCUMENTS}).json()
        assert [d["score"] for d in scores["data"]] == pytest.approx(expected, abs=1e-4)
        ranked = c.post("/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2}).json()
        order = list(np.argsort(expected)[::-1][:2])
        assert [r["index"] for r in ranked["results"]] == order
        assert ranked["results"][0]["document"]["text"] == DOCUMENTS[order[0]]


def test_bad_pooling_requests_answer_400_naming_the_field(embedder):
    server, _ = embedder
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        error = assert_error(c.post("/v1/embeddings", json={"input": QUERY, "dimensions": 8}), "dimensions")
        assert "Matryoshka" in error["message"]
        assert_error(c.post("/v1/embeddings", json={"input": ["a"] * 5}), "input")  # more than --max-seqs-per-request
        assert_error(c.post("/v1/embeddings", json={"input": []}), "input")
        assert_error(c.post("/v1/embeddings", json={"input": [[10**6]]}), "input")
        assert_error(c.post("/v1/embeddings", json={"input": QUERY, "encoding_format": "int8"}), "encoding_format")
        assert_error(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}),
                     "model")
        assert_error(c.post("/v1/completions", json={"prompt": "hi"}), "model")
        assert_error(c.post("/v1/responses", json={"input": "hi"}), "model")
        assert_error(c.post("/classify", json={"input": "hi"}), "model")  # an embedder, not a classifier
        assert_error(c.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}), "text_2")
        assert_error(c.post("/rerank", json={"query": "q", "documents": []}), "documents")


def test_cross_encoder_score_rerank_classify(smollm2_dir, tmp_path):
    import torch

    directory, model = classifier_checkpoint(smollm2_dir, tmp_path / "ce", 1, architecture="qwen2")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    with torch.no_grad():
        expected = [torch.sigmoid(model(torch.tensor([tokenizer(QUERY, d)["input_ids"]])).logits[0, 0]).item()
                    for d in DOCUMENTS]
        single = torch.sigmoid(model(torch.tensor([tokenizer(QUERY)["input_ids"]])).logits[0, 0]).item()
    with serve(directory) as server, httpx.Client(base_url=server.base_url, timeout=120) as c:
        scores = c.post("/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS}).json()
        assert [d["score"] for d in scores["data"]] == pytest.approx(expected, rel=1e-4)
        assert scores["usage"]["prompt_tokens"] == sum(len(tokenizer(QUERY, d)["input_ids"]) for d in DOCUMENTS)
        order = [int(i) for i in np.argsort(expected)[::-1]]
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            ranked = c.post(path, json={"model": "tiny", "query": QUERY, "documents": DOCUMENTS}).json()
            assert [r["index"] for r in ranked["results"]] == order
            assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx(
                [expected[i] for i in order], rel=1e-4)
        classified = c.post("/classify", json={"model": "tiny", "input": [QUERY]}).json()["data"][0]
        assert classified["num_classes"] == 1 and classified["label"] == "LABEL_0"
        assert classified["probs"][0] == pytest.approx(single, rel=1e-4)
        assert_error(c.post("/v1/embeddings", json={"input": QUERY}), "model")  # a classifier, not an embedder


def test_generative_model_refuses_pooling_endpoints(base_dir):
    with serve(base_dir) as server, httpx.Client(base_url=server.base_url, timeout=120) as c:
        error = assert_error(c.post("/v1/embeddings", json={"input": QUERY}), "model")
        assert "--runner pooling" in error["message"]
        for path, body in (("/v1/score", {"text_1": "a", "text_2": "b"}), ("/classify", {"input": "a"}),
                           ("/rerank", {"query": "a", "documents": ["b"]})):
            assert_error(c.post(path, json=body), "model")
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
