"""Pooling models offline (``LLM.embed`` / ``classify`` / ``score`` / ``encode``): outputs against
sentence-transformers and transformers on tiny random checkpoints with SmolLM2's tokenizer (fp32, cosine >= 0.9999),
through the engine's scheduler, chunked prefill and prefix cache, with no compile after warm-up."""

from __future__ import annotations

import numpy as np
import pytest

from pooling_models import (causal_lm_checkpoint, classifier_checkpoint, sentence_transformer_checkpoint)

TEXTS = ["The capital of France is Paris.", "hello",
         "A much longer sentence that runs over more than one prefill chunk of the engine, so that the pooled state "
         "is gathered across several steps of the scheduler before the request finishes and reports its vector."]
# Small steps: the long text is prefilled in several chunks.
ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, use_tqdm=False,
              weight_cache=False, compilation_cache_dir="")


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def base_dir(smollm2_dir, tmp_path_factory):
    return causal_lm_checkpoint(smollm2_dir, tmp_path_factory.mktemp("base"), "llama")


@pytest.fixture(scope="module")
def st_last(base_dir, tmp_path_factory):
    return sentence_transformer_checkpoint(base_dir, tmp_path_factory.mktemp("st_last"), "lasttoken", True)


@pytest.fixture(scope="module")
def last_llm(st_last):
    from paged_jax import LLM

    return LLM(str(st_last[0]), **ENGINE)


def test_embed_matches_sentence_transformers_last_token(last_llm, st_last):
    outputs = last_llm.embed(TEXTS)
    reference = st_last[1].encode(TEXTS)
    for output, expected in zip(outputs, reference):
        assert output.outputs.hidden_size == 64
        assert cosine(output.outputs.embedding, expected) >= 0.9999
        assert np.linalg.norm(output.outputs.embedding) == pytest.approx(1.0, abs=1e-5)
    assert last_llm.llm_engine.info.pooler.pooling_type == "LAST"
    assert last_llm.llm_engine.engine_core.runner.num_compiles_since_warmup == 0


def test_embed_prefix_cache_and_token_ids(last_llm):
    tokenizer = last_llm.get_tokenizer()
    ids = tokenizer.encode(TEXTS[2])
    first = last_llm.embed([{"prompt_token_ids": ids}])[0]
    again = last_llm.embed([{"prompt_token_ids": ids}])[0]
    assert again.num_cached_tokens > 0  # last-token pooling shares cached prefixes
    assert cosine(first.outputs.embedding, again.outputs.embedding) >= 0.99999
    assert again.prompt_token_ids == ids


def test_pooling_params_dimensions_normalize_truncate(last_llm, st_last):
    from paged_jax import PoolingParams

    raw = last_llm.embed(TEXTS[:1], PoolingParams(normalize=False))[0].outputs.embedding
    assert np.linalg.norm(raw) != pytest.approx(1.0, abs=1e-3)
    truncated = last_llm.embed(TEXTS[2:], PoolingParams(truncate_prompt_tokens=5))[0]
    assert len(truncated.prompt_token_ids) == 5
    by_keyword = last_llm.embed(TEXTS[2:], truncate_prompt_tokens=5)[0]
    assert by_keyword.prompt_token_ids == truncated.prompt_token_ids
    assert by_keyword.outputs.embedding == pytest.approx(truncated.outputs.embedding, abs=1e-6)
    with pytest.raises(ValueError, match="^dimensions"):  # not a Matryoshka model
        last_llm.embed(TEXTS[:1], PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="^task"):
        last_llm.classify(TEXTS[:1])
    with pytest.raises(ValueError, match="^params"):
        last_llm.generate(TEXTS[:1])


@pytest.mark.parametrize("mode", ["mean", "cls"])
def test_mean_and_first_token_pooling_without_normalize_over_chunks(base_dir, tmp_path, mode):
    from paged_jax import LLM

    directory, model = sentence_transformer_checkpoint(base_dir, tmp_path / "st", mode, False)
    llm = LLM(str(directory), **ENGINE)
    pooler = llm.llm_engine.info.pooler
    assert pooler.pooling_type == mode.upper() and not pooler.normalize
    assert not llm.llm_engine.engine_core.kv_cache_manager.enable_prefix_caching  # needs every token's state
    outputs = llm.embed(TEXTS)
    for output, expected in zip(outputs, model.encode(TEXTS)):
        assert cosine(output.outputs.embedding, expected) >= 0.9999
        np.testing.assert_allclose(output.outputs.embedding, expected, rtol=1e-3, atol=1e-5)
    assert llm.llm_engine.engine_core.runner.num_compiles_since_warmup == 0


def test_matryoshka_dimensions_and_convert_embed_of_causal_lm(smollm2_dir, tmp_path):
    """A ``*ForCausalLM`` converted to an embedder (``convert="embed"``; vLLM's defaults: last token, normalized);
    ``is_matryoshka`` lets ``dimensions`` truncate before normalizing."""
    import json

    import torch
    from transformers import AutoModel

    from paged_jax import LLM, PoolingParams

    directory = causal_lm_checkpoint(smollm2_dir, tmp_path / "lm", "qwen3")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    llm = LLM(str(directory), convert="embed", **ENGINE)
    full, short = (llm.embed(TEXTS[:1], PoolingParams(dimensions=d))[0].outputs.embedding for d in (None, 16))
    hf = AutoModel.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = hf(torch.tensor([llm.get_tokenizer().encode(TEXTS[0])])).last_hidden_state[0, -1].numpy()
    assert cosine(full, hidden) >= 0.9999
    assert len(short) == 16 and cosine(short, hidden[:16]) >= 0.9999
    assert np.linalg.norm(short) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("architecture", ["qwen3", "llama"])
def test_classify_matches_transformers(smollm2_dir, tmp_path, architecture):
    import torch

    from paged_jax import LLM

    directory, model = classifier_checkpoint(smollm2_dir, tmp_path / "cls", 3, architecture=architecture)
    llm = LLM(str(directory), **ENGINE)  # runner "auto": a classification checkpoint pools
    pooler = llm.llm_engine.info.pooler
    assert (pooler.task, pooler.width) == ("classify", 3)
    outputs = llm.classify(TEXTS)
    tokenizer = llm.get_tokenizer()
    for text, output in zip(TEXTS, outputs):
        with torch.no_grad():
            logits = model(torch.tensor([tokenizer.encode(text)])).logits[0]
        np.testing.assert_allclose(output.outputs.probs, torch.softmax(logits, -1).numpy(), rtol=1e-4, atol=1e-6)
        assert output.outputs.num_classes == 3
    with pytest.raises(ValueError, match="^model: scoring needs a cross-encoder"):
        llm.score("a", ["b"])
    assert llm.llm_engine.engine_core.runner.num_compiles_since_warmup == 0


def test_score_cross_encoder_and_embedder(smollm2_dir, tmp_path, last_llm, st_last):
    import torch

    from paged_jax import LLM

    directory, model = classifier_checkpoint(smollm2_dir, tmp_path / "ce", 1, architecture="qwen2")
    llm = LLM(str(directory), task="score", **ENGINE)
    tokenizer = llm.get_tokenizer()
    query, documents = "What is the capital of France?", ["Paris is the capital.", "Bananas are yellow."]
    scores = llm.score(query, documents)
    for document, output in zip(documents, scores):
        ids = tokenizer(query, document)["input_ids"]
        with torch.no_grad():
            expected = torch.sigmoid(model(torch.tensor([ids])).logits[0, 0]).item()
        assert output.outputs.score == pytest.approx(expected, rel=1e-4)
    embedded = last_llm.score(query, documents)  # an embedder: cosine similarity of the embeddings
    a, b = st_last[1].encode([query] + documents[:1])
    assert embedded[0].outputs.score == pytest.approx(cosine(a, b), abs=1e-4)
    with pytest.raises(ValueError, match="^text_2"):
        llm.score(["a", "b"], ["c", "d", "e"])


def test_runner_resolution_refusals(base_dir):
    from paged_jax.pooling.config import resolve_runner

    assert resolve_runner("auto", "auto", None, "lm_head") == ("generate", "none")
    assert resolve_runner("auto", "auto", "embed", "lm_head") == ("pooling", "embed")
    assert resolve_runner("pooling", "auto", None, "score") == ("pooling", "classify")
    assert resolve_runner("auto", "auto", None, "none") == ("pooling", "embed")
    with pytest.raises(ValueError, match="^runner='generate'"):
        resolve_runner("generate", "auto", None, "score")
    with pytest.raises(ValueError, match="^convert='classify'"):
        resolve_runner("pooling", "classify", None, "lm_head")
    with pytest.raises(ValueError, match="^task"):
        resolve_runner("auto", "auto", "transcription", "lm_head")


def test_pooling_engine_core_in_its_own_process(st_last, last_llm):
    """Pooling requests, their parameters, the pooler and the pooled vectors cross the core process's pipe."""
    from paged_jax import EngineArgs, PoolingParams
    from serving.engine_process import start_engine_process

    args = EngineArgs(model=str(st_last[0]), **{k: v for k, v in ENGINE.items() if k != "use_tqdm"})
    engine = start_engine_process(args, start_timeout=300)  # an LLMEngine over a core process
    try:
        assert not engine.core_in_process
        assert engine.info.pooler == last_llm.llm_engine.info.pooler
        engine.add_request("a", TEXTS[2], PoolingParams(normalize=False))
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        expected = last_llm.embed(TEXTS[2:], PoolingParams(normalize=False))[0].outputs.embedding
        assert [o.request_id for o in outputs] == ["a"] and outputs[0].finished
        np.testing.assert_allclose(outputs[0].outputs.data, expected, rtol=1e-5, atol=1e-6)
    finally:
        engine.close()


def test_qwen3_reranker_style_classifier_from_token(smollm2_dir, tmp_path):
    """vLLM's recipe for Qwen3-Reranker: a ``Qwen3ForCausalLM``'s weights under ``Qwen3ForSequenceClassification``
    with ``classifier_from_token: ["no", "yes"]`` and ``is_original_qwen3_reranker``: the score is
    sigmoid(logit(yes) - logit(no)) at the last token; without the two-way flag each token's logit is a class."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from paged_jax import LLM

    directory = causal_lm_checkpoint(smollm2_dir, tmp_path / "reranker", "qwen3")
    config = json.loads((directory / "config.json").read_text())
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    (directory / "config.json").write_text(json.dumps({
        **config, "architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
        "is_original_qwen3_reranker": True}))
    llm = LLM(str(directory), **ENGINE)  # runner auto: a classifier
    tokenizer = llm.get_tokenizer()
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    pooler = llm.llm_engine.info.pooler
    assert (pooler.task, pooler.width, pooler.logit_token_ids, pooler.two_way) == ("classify", 1, [no, yes], True)
    query, documents = "Is Paris in France?", ["Paris is the capital of France.", "Bananas are yellow."]
    scores = llm.score(query, documents)
    for document, output in zip(documents, scores):
        with torch.no_grad():
            logits = hf(torch.tensor([tokenizer(query, document)["input_ids"]])).logits[0, -1]
        assert output.outputs.score == pytest.approx(torch.sigmoid(logits[yes] - logits[no]).item(), rel=1e-4)
    assert llm.llm_engine.engine_core.runner.num_compiles_since_warmup == 0

    (directory / "config.json").write_text(json.dumps({
        **config, "architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"]}))
    probs = LLM(str(directory), **ENGINE).classify([query])[0].outputs.probs
    with torch.no_grad():
        logits = hf(torch.tensor([tokenizer.encode(query)])).logits[0, -1]
    np.testing.assert_allclose(probs, torch.softmax(logits[[no, yes]], -1).numpy(), rtol=1e-4)
