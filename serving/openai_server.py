"""``OpenAIServer``: the request handling the routes share, and ``get_server``, the routes' way to reach it.

One ``OpenAIServer`` per app, in ``app.state.server``: it holds the ``AsyncEngine``, the server's own tokenizer
copy, the served model's facts and the metrics. Prompts are tokenized here, on the event loop, with that copy (HF
tokenizers are not safe to share with the engine thread), so prompt-length checks and usage counts need no engine
round trip. Input problems raise ``APIError`` (400 naming the field, 404 for an unknown model).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Sequence

from fastapi import Request

from paged_jax.chat import ChatTemplateError, render_chat
from serving.async_engine import (AsyncEngine, EngineDeadError, EngineOverloadedError, EngineRequest,
                                  RequestStream)
from serving.engine_client import EngineClient
from serving.errors import APIError, param_from_message
from serving.metrics import ServingMetrics
from serving.protocol import (ChatCompletionLogProbs, ChatCompletionLogProbsContent, ChatCompletionTopLogprob,
                              ChatMessageParam, CompletionLogProbs, SamplingFields)

# Logprobs of -inf (or nan) are not valid JSON; vLLM clamps them to this value.
MIN_LOGPROB = -9999.0


# ----------------------------------------------------------------------------------------------- engine facts
# The name of the built-in model (EngineArgs.model None) in the API.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclasses.dataclass
class ModelInfo:
    """What the HTTP layer needs to know about the served model. ``served_model_names``: every name a request's
    ``model`` may carry (vLLM's ``--served-model-name``); ``served_model_name`` is the first, which responses report."""

    served_model_name: str
    root: str | None  # checkpoint directory (None for a named dummy shape)
    max_model_len: int
    vocab_size: int
    served_model_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.served_model_names:
            self.served_model_names = (self.served_model_name,)


def model_info_from_engine(engine: EngineClient, served_model_name: str | Sequence[str] | None) -> ModelInfo:
    """The served model's facts from the engine (``max_model_len``, ``vocab_size``, ``model_path``,
    ``engine_args``). Names: ``served_model_name``, else ``engine_args.served_model_names`` (vLLM: the model as
    given), else the checkpoint directory's name (the built-in model: ``DEFAULT_MODEL_NAME``)."""
    engine_args = engine.engine_args
    root = engine.model_path or engine_args.model
    if served_model_name is not None:
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    else:
        names = list(getattr(engine_args, "served_model_names", None) or [])
    if not names:
        names = [DEFAULT_MODEL_NAME if engine_args.model is None
                 else os.path.basename(os.path.normpath(str(root))) if root else "paged-jax"]
    return ModelInfo(served_model_name=str(names[0]), root=str(root) if root is not None else None,
                     max_model_len=int(engine.max_model_len), vocab_size=int(engine.vocab_size),
                     served_model_names=tuple(str(n) for n in names))


# ------------------------------------------------------------------------------------------- the server state
class OpenAIServer:
    """Request handling shared by the endpoints (tokenization, validation, engine submission, formatting)."""

    def __init__(self, async_engine: AsyncEngine, tokenizer: Any, info: ModelInfo, metrics: ServingMetrics) -> None:
        self.engine = async_engine
        self.tokenizer = tokenizer
        self.info = info
        self.metrics = metrics

    # ---------------------------------------------------------------- input handling
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.info.served_model_names and model != self.info.root:
            raise APIError(404, f"The model `{model}` does not exist.", param="model")

    def check_token_ids(self, token_ids: Sequence[int], param: str) -> None:
        for position, token_id in enumerate(token_ids):
            if not 0 <= token_id < self.info.vocab_size:
                raise APIError(400, f"{param}: token id {token_id} at position {position} is out of range "
                                    f"[0, {self.info.vocab_size})", param=param)

    def require_tokenizer(self, param: str) -> Any:
        if self.tokenizer is None:
            raise APIError(400, f"{param}: this model has no tokenizer, so only token-id prompts are accepted",
                           param=param)
        return self.tokenizer

    def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        self.require_tokenizer(param)
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except Exception as exc:  # noqa: BLE001 - e.g. lone surrogates the tokenizer cannot encode
            raise APIError(400, f"{param}: cannot tokenize the text ({exc})", param=param) from exc

    def decode(self, token_ids: Sequence[int], param: str) -> str:
        return self.require_tokenizer(param).decode(list(token_ids))

    def render_chat(self, messages: Sequence[ChatMessageParam], add_generation_prompt: bool) -> str:
        """The prompt text of ``messages`` (``paged_jax.chat.render_chat``); a template error is the input's (400)."""
        tokenizer = self.require_tokenizer("messages")
        try:
            return render_chat(tokenizer, [message.model_dump() for message in messages], add_generation_prompt)
        except ChatTemplateError as exc:  # e.g. an unsupported role order
            raise APIError(400, f"messages: the chat template rejected the conversation ({exc})",
                           param="messages") from exc
        except RuntimeError as exc:  # the template rendered something other than a string: the model's fault
            raise APIError(500, str(exc)) from exc

    def check_prompt_length(self, num_prompt_tokens: int, param: str) -> None:
        if num_prompt_tokens == 0:
            raise APIError(400, f"{param} must not be empty", param=param)
        if num_prompt_tokens >= self.info.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.info.max_model_len} tokens. "
                                f"However, your request has {num_prompt_tokens} input tokens. Please reduce the "
                                f"length of the input.", param=param)

    def resolve_max_tokens(self, requested: int | None, num_prompt_tokens: int, param: str) -> int:
        room = self.info.max_model_len - num_prompt_tokens
        if requested is None:
            return room
        if requested > room:
            raise APIError(400, f"{param}: '{requested}' is too large: the prompt has {num_prompt_tokens} tokens "
                                f"and this model's maximum context length is {self.info.max_model_len}, so at most "
                                f"{room} tokens can be generated.", param=param)
        return requested

    def sampling_params(self, body: SamplingFields, *, max_tokens: int, logprobs: int | None,
                        aliases: dict[str, str]):
        from paged_jax.sampling_params import SamplingParams

        if body.stop_token_ids:
            self.check_token_ids(body.stop_token_ids, "stop_token_ids")
        try:
            return SamplingParams(
                n=body.n,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                # top_k >= vocab keeps every token, i.e. is off; mapping it to 0 also keeps huge values out of
                # the sampler's int32 tensors.
                top_k=0 if body.top_k is None or body.top_k >= self.info.vocab_size else body.top_k,
                min_p=0.0 if body.min_p is None else body.min_p,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                seed=body.seed,
                stop=body.stop,
                stop_token_ids=body.stop_token_ids,
                ignore_eos=body.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=body.min_tokens,
                logprobs=logprobs,
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
            )
        except ValueError as exc:
            raise self.bad_request(exc, body, aliases) from exc

    def bad_request(self, exc: Exception, body: Any, aliases: dict[str, str]) -> APIError:
        known = set(type(body).model_fields) | {"prompt", "messages"}
        return APIError(400, str(exc), param=param_from_message(str(exc), known, aliases))

    async def submit(self, requests: list[EngineRequest], body: Any, aliases: dict[str, str]) -> list[RequestStream]:
        try:
            return await self.engine.add_requests(requests)
        except EngineOverloadedError as exc:
            raise APIError(503, str(exc), headers={"Retry-After": str(exc.retry_after_s)}) from exc
        except EngineDeadError as exc:
            raise APIError(500, str(exc)) from exc
        except ValueError as exc:
            raise self.bad_request(exc, body, aliases) from exc

    # ---------------------------------------------------------------- logprobs formatting
    def token_text(self, token_id: int, logprob: Any) -> str:
        decoded = getattr(logprob, "decoded_token", None)
        if decoded is not None:
            return decoded
        if self.tokenizer is None:
            return f"token_id:{token_id}"  # vLLM's spelling for tokens it cannot show as text
        return self.tokenizer.decode([token_id])

    @staticmethod
    def clamp(value: float) -> float:
        value = float(value)
        return MIN_LOGPROB if math.isnan(value) or value < MIN_LOGPROB else value

    def _ranked(self, entries: dict) -> list[tuple[int, Any]]:
        return sorted(entries.items(), key=lambda item: (getattr(item[1], "rank", None) or 1 << 30, item[0]))

    def completion_logprobs(self, token_ids: Sequence[int], logprobs: Sequence[dict], num_top: int,
                            text_offset: int) -> CompletionLogProbs:
        """Legacy format for generated tokens ``token_ids`` (the sampled token plus the ``num_top`` most likely)."""
        result = CompletionLogProbs()
        for token_id, entries in zip(token_ids, logprobs):
            sampled = entries.get(token_id)
            text = self.token_text(token_id, sampled)
            result.tokens.append(text)
            result.token_logprobs.append(self.clamp(sampled.logprob) if sampled is not None else None)
            top: dict[str, float] = {}
            for other_id, entry in self._ranked(entries)[:num_top]:
                top[self.token_text(other_id, entry)] = self.clamp(entry.logprob)
            if sampled is not None:
                top.setdefault(text, self.clamp(sampled.logprob))
            result.top_logprobs.append(top)
            result.text_offset.append(text_offset)
            text_offset += len(text)
        return result

    def chat_logprobs(self, token_ids: Sequence[int], logprobs: Sequence[dict], num_top: int
                      ) -> ChatCompletionLogProbs:
        content = []
        for token_id, entries in zip(token_ids, logprobs):
            sampled = entries.get(token_id)
            text = self.token_text(token_id, sampled)
            top = [ChatCompletionTopLogprob(token=(t := self.token_text(other_id, entry)),
                                            logprob=self.clamp(entry.logprob), bytes=list(t.encode("utf-8")))
                   for other_id, entry in self._ranked(entries)[:num_top]]
            content.append(ChatCompletionLogProbsContent(
                token=text, logprob=self.clamp(sampled.logprob) if sampled is not None else MIN_LOGPROB,
                bytes=list(text.encode("utf-8")), top_logprobs=top))
        return ChatCompletionLogProbs(content=content)


def get_server(request: Request) -> OpenAIServer:
    """The app's ``OpenAIServer`` (a FastAPI dependency of the routes)."""
    return request.app.state.server
