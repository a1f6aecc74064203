"""The input processor: a user request -> one ``EngineCoreRequest``, validated once against the model's limits
(vLLM V1's name).

Everything a request can get wrong that does not need the core's state is checked here, so a bad request is refused
(ValueError naming the field) before it reaches the core: the id, the prompt (text needs a tokenizer; token ids in the
vocabulary; 1..max_model_len tokens), the parameters' fit to the model (token ids in the vocabulary, the sampler's
fixed widths, stop strings' limits, logprob widths), beam search's width, the adapter's presence.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from paged_jax.config import EngineArgs
from paged_jax.engine.detokenizer import check_stop_strings
from paged_jax.engine.messages import EngineCoreInfo, EngineCoreRequest
from paged_jax.pooling.params import PoolingParams
from paged_jax.sampling_params import BeamSearchParams, SamplingParams, validate_token_ids
from paged_jax.worker.sampler import check_request_fits


# A pooling request's run in the core: its prompt, then one placeholder token that ends it (paged_jax.pooling).
POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)


class InputProcessor:
    """Validates and tokenizes requests for a core described by ``info`` (see the module docstring).

    Args:
      info: the core's ``EngineCoreInfo``.
      tokenizer: the HF tokenizer (None: token-id prompts only).
      engine_args: the engine's ``EngineArgs`` (stop-string limits, ``enable_lora``).
    """

    def __init__(self, info: EngineCoreInfo, tokenizer, engine_args: EngineArgs):
        self.info = info
        self.tokenizer = tokenizer
        self.engine_args = engine_args

    def process(self, request_id: str, prompt: str | Sequence[int] | dict,
                params: SamplingParams | BeamSearchParams | None = None, priority: int = 0,
                arrival_time: float | None = None, lora_request=None) -> tuple[EngineCoreRequest, str | None]:
        """``(the EngineCoreRequest, the prompt's text or None)``; ValueError naming the offending field:
        ``request_id``, ``params``, ``priority``, ``prompt``, ``stop_token_ids``, ``stop``, ``logit_bias`` /
        ``allowed_token_ids``, ``bad_words``, ``logprobs`` / ``prompt_logprobs``, ``beam_width``, ``lora_request``.

        ``prompt``: text, a list of token ids, or a dict with ``prompt_token_ids`` or ``prompt`` (and optionally
        vLLM's ``cache_salt``)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if params is None:
            params = PoolingParams() if self.info.pooler is not None else SamplingParams()
        if not isinstance(params, (SamplingParams, BeamSearchParams, PoolingParams)):
            raise ValueError(f"params must be a SamplingParams, BeamSearchParams or PoolingParams, got "
                             f"{type(params).__name__}")
        self._check_runner(params)
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
            raise ValueError(f"priority must be an int, got {priority!r}")
        pooling = params if isinstance(params, PoolingParams) else None
        prompt_text, prompt_token_ids = self._tokenize_prompt(prompt, pooling and pooling.truncate_prompt_tokens)
        if pooling is not None:
            params = POOLING_SAMPLING_PARAMS
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None  # vLLM's prompt-dict key
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string if provided, got {cache_salt!r}")
        if lora_request is not None and not self.engine_args.enable_lora:
            raise ValueError("lora_request: LoRA is not enabled; start the engine with enable_lora=True "
                             "(--enable-lora)")
        beam_search = None
        if isinstance(params, BeamSearchParams):
            self._check_beam_search(params, len(prompt_token_ids), lora_request)
            beam_search, params = params, None
        else:
            params = self._checked_sampling_params(params)
        request = EngineCoreRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids, sampling_params=params,
            beam_search_params=beam_search, arrival_time=time.time() if arrival_time is None else float(arrival_time),
            priority=int(priority), lora_request=lora_request, cache_salt=cache_salt, pooling_params=pooling)
        return request, prompt_text

    def _check_runner(self, params) -> None:
        """A pooling model takes ``PoolingParams`` fitting its pooler, a generative one anything else."""
        pooler = self.info.pooler
        if pooler is None:
            if isinstance(params, PoolingParams):
                raise ValueError("params: PoolingParams need a pooling model (--runner pooling); this model "
                                 "generates")
            return
        if not isinstance(params, PoolingParams):
            raise ValueError(f"params: this is a pooling model ({pooler.task}); it takes PoolingParams, not "
                             f"{type(params).__name__}")
        if params.task is not None and params.task != pooler.task and (params.task, pooler.task) != (
                "score", "classify"):
            raise ValueError(f"task: the model's pooler does {pooler.task!r}, not {params.task!r}")
        if params.dimensions is not None and (pooler.task != "embed" or not pooler.supports_dimensions(
                params.dimensions)):
            raise ValueError(f"dimensions: this model does not support Matryoshka dimensions={params.dimensions}"
                             + (f" (supported: {pooler.matryoshka_dimensions})" if pooler.matryoshka_dimensions
                                else ""))
        if params.truncate_prompt_tokens is not None and params.truncate_prompt_tokens > self.info.max_model_len:
            raise ValueError(f"truncate_prompt_tokens ({params.truncate_prompt_tokens}) is greater than "
                             f"max_model_len ({self.info.max_model_len})")

    def _check_beam_search(self, params: BeamSearchParams, num_prompt_tokens: int, lora_request) -> None:
        if lora_request is not None:
            raise ValueError("lora_request is not supported with beam search (BeamSearchParams)")
        if params.beam_width > self.info.max_num_seqs:
            raise ValueError(f"beam_width ({params.beam_width}) must be at most max_num_seqs "
                             f"({self.info.max_num_seqs})")
        if 2 * params.beam_width > self.info.max_logprobs:
            raise ValueError(f"beam_width ({params.beam_width}) needs 2 * beam_width logprobs, more than "
                             f"max_logprobs ({self.info.max_logprobs})")
        if self.info.max_model_len - num_prompt_tokens < 1:
            raise ValueError(f"prompt has {num_prompt_tokens} tokens: no room left to generate within "
                             f"max_model_len={self.info.max_model_len}")

    def _checked_sampling_params(self, params: SamplingParams) -> SamplingParams:
        """Check what the request's parameters ask of this model; returns them with ``bad_words`` tokenized (a copy,
        as vLLM leaves the caller's object as it was)."""
        info = self.info
        if params.stop_token_ids:
            validate_token_ids(params.stop_token_ids, info.vocab_size, "stop_token_ids")
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer, and this model has none")
            params = params.clone()
            params.update_from_tokenizer(self.tokenizer)
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(params, field)
            if value is not None and value > info.max_logprobs:
                raise ValueError(f"{field} ({value}) must be at most max_logprobs ({info.max_logprobs})")
        check_request_fits(params, vocab_size=info.vocab_size, eos_token_ids=info.eos_token_ids)
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none")
        check_stop_strings(params.stop_strings, max_stop_strings=self.engine_args.max_stop_strings,
                           max_stop_string_len=self.engine_args.max_stop_string_len)
        return params

    def _tokenize_prompt(self, prompt, truncate_prompt_tokens: int | None = None) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt dict must have a 'prompt_token_ids' or 'prompt' key")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer and this model has none; pass token ids")
            if not prompt:
                raise ValueError("prompt must not be empty")
            text, token_ids = prompt, list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            text, token_ids = None, list(prompt)
            validate_token_ids(token_ids, self.info.vocab_size, "prompt")
            token_ids = [int(t) for t in token_ids]
        else:
            raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if truncate_prompt_tokens is not None:  # the last k tokens, as vLLM truncates
            token_ids = token_ids[-truncate_prompt_tokens:]
        if len(token_ids) > self.info.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len={self.info.max_model_len}")
        return text, token_ids
