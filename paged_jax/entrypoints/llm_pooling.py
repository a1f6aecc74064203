"""The offline ``LLM``'s pooling methods (vLLM's names and return types): ``encode``, ``embed``, ``classify``,
``score``, for a model run by the pooling runner (``paged_jax.pooling``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from paged_jax.pooling.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput,
                                       ScoringOutput, ScoringRequestOutput)
from paged_jax.pooling.params import PoolingParams
from paged_jax.pooling.scoring import (check_cross_encoder, cosine_similarity, distinct_texts, pair_inputs,
                                      pair_prompt_token_ids)


class PoolingMethods:
    """Mixed into ``LLM`` (it supplies ``llm_engine``, ``_normalize_prompts`` and ``_run``)."""

    def encode(self, prompts, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = True, *, truncate_prompt_tokens: int | None = None,
               task: str | None = None) -> list[PoolingRequestOutput]:
        """Pool every prompt (text, token ids, or prompt dicts as ``generate`` takes); ``PoolingRequestOutput``s
        in input order (``.outputs.data``: float32[W]). ``truncate_prompt_tokens`` / ``task``: set on every
        prompt's ``PoolingParams``. ValueError for a generative model or a parameter the model's pooler does not
        support (``dimensions``, the task)."""
        prompt_list = self._normalize_prompts(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompt_list)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"pooling_params has {len(params_list)} entries for {len(prompt_list)} prompts")
        overrides = {name: value for name, value in (("truncate_prompt_tokens", truncate_prompt_tokens),
                                                     ("task", task)) if value is not None}
        if overrides:
            params_list = [dataclasses.replace(params, **overrides) for params in params_list]
        return self._run(prompt_list, params_list, use_tqdm)

    def embed(self, prompts, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True, *, truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """Embeddings (``.outputs.embedding``: list[float]) of every prompt, in input order."""
        return [EmbeddingRequestOutput.from_base(out) for out in self.encode(
            prompts, pooling_params, use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens, task="embed")]

    def classify(self, prompts, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 use_tqdm: bool = True, *, truncate_prompt_tokens: int | None = None
                 ) -> list[ClassificationRequestOutput]:
        """Class probabilities (``.outputs.probs``) of every prompt, in input order."""
        return [ClassificationRequestOutput.from_base(out) for out in self.encode(
            prompts, pooling_params, use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens, task="classify")]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str],
              pooling_params: PoolingParams | None = None, use_tqdm: bool = True, *,
              truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
        """Scores of text pairs (``.outputs.score``), 1:N or N:N (``paged_jax.pooling.scoring``): a cross-encoder's
        sigmoid over each pair, or an embedder's cosine similarity."""
        pooler = self.llm_engine.info.pooler
        if pooler is None:
            raise ValueError("score needs a pooling model (--runner pooling); this model generates")
        check_cross_encoder(pooler)
        pairs = pair_inputs(data_1, data_2)
        params = pooling_params or PoolingParams()
        if truncate_prompt_tokens is not None:
            params = dataclasses.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        if pooler.task == "classify":
            tokenizer = self.llm_engine.tokenizer
            prompts = [{"prompt_token_ids": pair_prompt_token_ids(tokenizer, a, b)} for a, b in pairs]
            outs = self.encode(prompts, params, use_tqdm, task="score")
            return [ScoringRequestOutput(out.request_id, ScoringOutput(float(out.outputs.data[0])),
                                         out.prompt_token_ids, True, out.num_cached_tokens) for out in outs]
        texts, pair_indices = distinct_texts(pairs)
        embeddings = self.encode(texts, params, use_tqdm, task="embed")
        outputs = []
        for i, j in pair_indices:
            first, second = embeddings[i], embeddings[j]
            score = cosine_similarity(first.outputs.data, second.outputs.data)
            outputs.append(ScoringRequestOutput(f"{first.request_id}+{second.request_id}", ScoringOutput(score),
                                                first.prompt_token_ids + second.prompt_token_ids))
        return outputs
