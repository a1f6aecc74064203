"""``paged-jax run-batch``: an OpenAI batch file answered offline through the server's own routes, for a pooling
model (embeddings, scores) and a generative one (completions, chat); bad lines answered 400 naming the field."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pooling_models import causal_lm_checkpoint, sentence_transformer_checkpoint

ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens",
                "16", "--no-weight-cache", "--compilation-cache-dir", ""]


def run(tmp_path, model_dir, requests: list) -> list[dict]:
    from serving.commands import main

    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in requests))
    assert main(["run-batch", "-i", str(source), "-o", str(target), "--model", str(model_dir),
                 "--served-model-name", "tiny", *ENGINE_FLAGS]) == 0
    return [json.loads(line) for line in target.read_text().splitlines()]


@pytest.fixture(scope="module")
def base_dir(smollm2_dir, tmp_path_factory):
    return causal_lm_checkpoint(smollm2_dir, tmp_path_factory.mktemp("base"), "llama")


def test_run_batch_embeddings_and_scores(base_dir, tmp_path):
    directory, model = sentence_transformer_checkpoint(base_dir, tmp_path / "st", "lasttoken", True)
    texts = ["hello there", "the capital of France is Paris"]
    outputs = run(tmp_path, directory, [
        {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"model": "tiny", "input": texts}},
        {"custom_id": "s", "method": "POST", "url": "/v1/score", "body": {"text_1": texts[0], "text_2": texts[1:]}},
        {"custom_id": "d", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x", "dimensions": 3}},
        {"custom_id": "u", "method": "POST", "url": "/v1/files", "body": {}},
        "not json"])
    assert [o["custom_id"] for o in outputs] == ["e", "s", "d", "u", None]
    expected = model.encode(texts)
    embeddings = outputs[0]["response"]["body"]["data"]
    for data, reference in zip(embeddings, expected):
        assert float(np.dot(data["embedding"], reference)) >= 0.9999  # both normalized
    assert outputs[1]["response"]["body"]["data"][0]["score"] == pytest.approx(float(expected[0] @ expected[1]),
                                                                               abs=1e-4)
    assert outputs[0]["error"] is None and outputs[0]["response"]["status_code"] == 200
    assert [(o["response"]["status_code"], o["error"]["param"]) for o in outputs[2:]] == [
        (400, "dimensions"), (400, "url"), (400, "body")]


def test_run_batch_completions_and_chat(base_dir, tmp_path, capsys):
    outputs = run(tmp_path, base_dir, [
        {"custom_id": "c", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "hello", "max_tokens": 3, "temperature": 0}},
        {"custom_id": "m", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}},
        {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"input": "hi"}}])
    completion = outputs[0]["response"]["body"]
    assert completion["object"] == "text_completion" and completion["usage"]["completion_tokens"] == 3
    assert (outputs[1]["error"]["param"], outputs[2]["error"]["param"]) == ("stream", "model")
    progress = capsys.readouterr().err  # vLLM's progress bar over the lines answered, on stderr
    assert "Running batch" in progress and "3/3" in progress and "0/3" in progress
