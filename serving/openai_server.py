"""``OpenAIServer``: the request handling the routes share, and ``get_server``, the routes' way to reach it.

One ``OpenAIServer`` per app, in ``app.state.server``: it holds the ``AsyncEngine``, the server's own tokenizer
copy, the served model's facts and the metrics. Prompts are rendered and tokenized here with that copy (HF tokenizers
are not safe to share with the engine thread), so prompt-length checks and usage counts need no engine round trip;
the work runs on one tokenizer thread (vLLM's single-worker executor), never on the event loop, so a long prompt
cannot stall other connections or ``/health``. A prompt text longer than any prompt of ``max_model_len`` tokens
can be is refused before tokenization (``serving.request_limits.max_prompt_chars``). Input problems raise
``APIError`` (400 naming the field, 404 for an unknown model).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Sequence

from fastapi import Request

from paged_jax.entrypoints.chat import ChatTemplateError, render_chat
from paged_jax.pooling.scoring import pair_prompt_token_ids
from paged_jax.sampling_params import MAX_LOGPROBS
from serving.async_engine import (AsyncEngine, EngineDeadError, EngineOverloadedError, EngineRequest,
                                  RequestStream)
from serving.errors import APIError, param_from_message
from serving.harmony import check_parsers, load_harmony_for
from serving.metrics import ServingMetrics
from serving.protocol import (ChatCompletionLogProbs, ChatCompletionLogProbsContent, ChatCompletionTopLogprob,
                              ChatMessageParam, CompletionLogProbs, PromptLogprob, SamplingFields, random_uuid)
from serving.request_limits import check_field_sizes, check_num_seqs, max_prompt_chars
from serving.tool_parsers import TOOL_PARSERS
from serving.tool_parsers.detect import implied_tool_parser, template_text
from serving.unsupported_fields import refuse_unsupported

logger = logging.getLogger(__name__)

# Logprobs of -inf (or nan) are not valid JSON; vLLM clamps them to this value.
MIN_LOGPROB = -9999.0
# The first token of a fill-in-the-middle prompt, in the spellings of the FIM-trained tokenizers.
_FIM_PREFIX_TOKENS = ("<fim_prefix>", "<|fim_prefix|>", "<PRE>", "<\uff5cfim\u2581begin\uff5c>")


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
    pooler: Any = None  # the pooling runner's PoolerConfig (paged_jax.pooling.config); None: a generative model

    def __post_init__(self) -> None:
        if not self.served_model_names:
            self.served_model_names = (self.served_model_name,)


def model_info_from_engine(engine, served_model_name: str | Sequence[str] | None) -> ModelInfo:
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
                     served_model_names=tuple(str(n) for n in names),
                     pooler=getattr(getattr(engine, "info", None), "pooler", None))


# ------------------------------------------------------------------------------------------- the server state
class OpenAIServer:
    """Request handling shared by the endpoints (tokenization, validation, engine submission, formatting).

    Args:
      async_engine: the engine, on its thread.
      tokenizer: the HTTP layer's own tokenizer copy (None: token-id prompts only).
      info: the served model's facts.
      metrics: the Prometheus metrics.
      default_sampling_params: ``SamplingParams`` defaults for fields a request leaves unset (the generation
        config's, ``paged_jax.engine.generation_config.sampling_defaults``).
      max_logprobs: most top logprobs a request may ask for (``--max-logprobs``).
      chat_template: the server's chat template (``--chat-template``); None: the tokenizer's.
      response_role: the role of chat replies when the prompt ends with the generation prompt (``--response-role``).
      scheduling_policy: the engine's (``priority`` makes a request's ``priority`` count).
      max_seqs_per_request: most sequences (each prompt's n, best_of or beam width, summed) one request may run
        (``--max-seqs-per-request``; ``create_app`` defaults it to half the engine's ``max_num_seqs``).
      enable_auto_tool_choice / tool_parser: ``--enable-auto-tool-choice`` / ``--tool-call-parser`` (a name of
        ``serving.tool_parsers.TOOL_PARSERS``): ``tool_choice: "auto"`` reads tool calls from replies.
      reasoning_parser: ``--reasoning-parser`` (a name of ``serving.reasoning_parsers.REASONING_PARSERS``).
        gpt-oss's (``openai_gptoss``, ``openai``) need the ``gpt-oss`` extra and load the harmony encoding here;
        a harmony parser beside a text one is refused (ValueError).
      loras: the served LoRA adapters (``serving.lora.LoRARegistry``; a request's ``model`` may name one), or None
        without ``--enable-lora``.
      enable_prompt_tokens_details: ``--enable-prompt-tokens-details``: usage reports
        ``prompt_tokens_details.cached_tokens`` (``cached_tokens``).
      trust_request_chat_template: ``--trust-request-chat-template``: a request's own ``chat_template`` (a Jinja
        program run on the tokenizer thread, at no bounded cost) is rendered; else it is refused (vLLM's default).
    """

    def __init__(self, async_engine: AsyncEngine, tokenizer: Any, info: ModelInfo, metrics: ServingMetrics, *,
                 default_sampling_params: dict[str, Any] | None = None, max_logprobs: int = MAX_LOGPROBS,
                 chat_template: str | None = None, response_role: str = "assistant",
                 scheduling_policy: str = "fcfs", max_seqs_per_request: int | None = None,
                 enable_auto_tool_choice: bool = False, tool_parser: str | None = None,
                 reasoning_parser: str | None = None, loras: Any = None,
                 trust_request_chat_template: bool = False, enable_prompt_tokens_details: bool = False) -> None:
        from serving.reasoning_parsers import REASONING_PARSERS

        self.engine = async_engine
        self.tokenizer = tokenizer
        self.info = info
        self.metrics = metrics
        self.default_sampling_params = dict(default_sampling_params or {})
        self.max_logprobs = max_logprobs
        self.chat_template = chat_template
        self.response_role = response_role
        self.scheduling_policy = scheduling_policy
        self.max_seqs_per_request = max_seqs_per_request
        self.max_prompt_chars = max_prompt_chars(tokenizer, info.max_model_len)
        # One thread: the tokenizer copy is used by one thread at a time (HF fast tokenizers may refuse concurrent
        # use), and prompts are tokenized in arrival order.
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="paged-jax-tokenizer")
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_parser = TOOL_PARSERS[tool_parser]() if tool_parser else None
        # Without --tool-call-parser: the parser the chat template implies reads tool calls of requests that give
        # tools and no tool_choice (serving.tool_parsers.detect); logged when first used.
        template = template_text(chat_template if chat_template is not None
                                 else getattr(tokenizer, "chat_template", None)) or ""
        self.implied_tool_parser = None if tool_parser else implied_tool_parser(template)
        self._implied_parser_logged = False
        self.reasoning_parser = REASONING_PARSERS[reasoning_parser]() if reasoning_parser else None
        check_parsers(self.reasoning_parser, self.tool_parser)
        # gpt-oss's parsers read token ids with the harmony encoding, loaded now so that a missing vocabulary
        # stops the start rather than a request.
        load_harmony_for(self.reasoning_parser, self.tool_parser)
        self.implied_tool_parser = self._usable_implied_parser(self.implied_tool_parser)
        # A harmony parser chosen by flag: every reply is harmony (requests that would constrain it are refused).
        self.reads_harmony = any(parser is not None and parser.harmony
                                 for parser in (self.reasoning_parser, self.tool_parser))
        self.takes_reasoning_effort = self.reads_harmony and "reasoning_effort" in template
        self.loras = loras
        self.trust_request_chat_template = trust_request_chat_template
        self.enable_prompt_tokens_details = enable_prompt_tokens_details

    @staticmethod
    def _usable_implied_parser(name: str | None) -> str | None:
        """``name`` (the parser the chat template implies), or None with a warning when it is a harmony one whose
        encoding cannot load here (no ``gpt-oss`` extra, or no vocabulary offline): nobody asked for it by flag,
        so the server still starts and tools without tool_choice get the default refusal."""
        if name is None:
            return None
        try:
            load_harmony_for(TOOL_PARSERS[name])
        except ValueError as exc:
            logger.warning("the chat template implies the %s tool-call parser, which cannot be used here: %s",
                           name, exc)
            return None
        return name

    def reads_harmony_for(self, tool_parser) -> bool:
        """Whether a request's reply is gpt-oss's harmony format: a harmony parser chosen by flag (every reply), or
        ``tool_parser`` (``tool_call_parser``'s for the request) a harmony one."""
        return self.reads_harmony or (tool_parser is not None and tool_parser.harmony)

    def tool_call_parser(self, tool_choice) -> Any:
        """The ``ToolParser`` that reads the calls of a ``tool_choice`` resolved in ``auto`` mode (None otherwise):
        ``--tool-call-parser``'s, or the one the chat template implies (logged the first time)."""
        if tool_choice.mode != "auto":
            return None
        if self.tool_parser is not None and tool_choice.parser_name == self.tool_parser.name:
            return self.tool_parser
        if not self._implied_parser_logged:
            self._implied_parser_logged = True
            logger.info("tools without tool_choice: reading tool calls with the %s parser, which the chat template "
                        "implies (--enable-auto-tool-choice --tool-call-parser NAME chooses one)",
                        tool_choice.parser_name)
        return TOOL_PARSERS[tool_choice.parser_name]()

    async def _off_loop(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread,
                                                                functools.partial(fn, *args, **kwargs))

    # ---------------------------------------------------------------- input handling
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.info.served_model_names and model != self.info.root \
                and self.lora_request(model) is None:
            raise APIError(404, f"The model `{model}` does not exist.", param="model")

    def lora_request(self, model: str | None):
        """The ``LoRARequest`` of the adapter a request's ``model`` names, None for the base model."""
        return self.loras.get(model) if self.loras is not None else None

    def response_model_name(self, model: str | None) -> str:
        """The ``model`` a response reports: the adapter's name for a LoRA request (vLLM), else the served name."""
        lora = self.lora_request(model)
        return lora.lora_name if lora is not None else self.info.served_model_name

    def check_request(self, body: SamplingFields) -> None:
        """The checks every generation request passes before its prompt is built (400 naming the field)."""
        self.check_model(body.model)
        if self.info.pooler is not None:
            raise APIError(400, f"model: {self.info.served_model_name} is a pooling model ({self.info.pooler.task}); "
                                "it does not generate (use /v1/embeddings, /classify, /v1/score or /rerank)",
                           param="model")
        # include_reasoning: false is refused only where there is no reasoning to leave out; reasoning_effort only
        # where gpt-oss's chat template takes it (serving.harmony.with_reasoning_effort).
        allowed = ("include_reasoning",) if self.reasoning_parser is not None else ()
        refuse_unsupported(body, allowed=allowed + (("reasoning_effort",) if self.takes_reasoning_effort else ()))
        check_field_sizes(body, self.max_prompt_chars)
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options: Stream options can only be defined when `stream=True`.",
                           param="stream_options")
        if body.priority != 0 and self.scheduling_policy != "priority":
            raise APIError(400, f"priority: got priority {body.priority} but priority scheduling is not enabled "
                                f"(serve with --scheduling-policy priority)", param="priority")
        if body.truncate_prompt_tokens is not None and body.truncate_prompt_tokens > self.info.max_model_len:
            raise APIError(400, f"truncate_prompt_tokens: value ({body.truncate_prompt_tokens}) is greater than "
                                f"max_model_len ({self.info.max_model_len}). Please, select a smaller truncation "
                                f"size.", param="truncate_prompt_tokens")

    def check_num_seqs(self, body: SamplingFields, num_prompts: int) -> None:
        """The admission rule for the work ``body`` creates (``serving.request_limits.check_num_seqs``), checked
        before its ``num_prompts`` prompts are tokenized."""
        check_num_seqs(body, num_prompts, max_waiting_requests=self.engine.max_waiting_requests,
                       max_seqs_per_request=self.max_seqs_per_request)

    def check_num_logprobs(self, num_logprobs: int | None, param: str, kind: str = "sample") -> None:
        if num_logprobs is not None and num_logprobs > self.max_logprobs:
            raise APIError(400, f"{param}: Requested {kind} logprobs of {num_logprobs}, which is greater than max "
                                f"allowed: {self.max_logprobs} (--max-logprobs)", param=param)

    def check_prompt_logprobs(self, body: SamplingFields) -> None:
        """vLLM's rules for ``prompt_logprobs``: >= 0, or -1 for the whole vocabulary (which exceeds
        ``--max-logprobs``), at most ``--max-logprobs``; never with ``stream`` (the chunks have no place for them)."""
        value = body.prompt_logprobs
        if value is None:
            return
        if value < -1:
            raise APIError(400, "prompt_logprobs: `prompt_logprobs` must be a non-negative value or -1.",
                           param="prompt_logprobs")
        if body.stream:
            raise APIError(400, "prompt_logprobs: `prompt_logprobs` are not available when `stream=True`.",
                           param="prompt_logprobs")
        self.check_num_logprobs(self.info.vocab_size if value == -1 else value, "prompt_logprobs", "prompt")

    def check_suffix(self, suffix: str | None) -> None:
        """``suffix`` asks for a fill-in-the-middle prompt, which needs the model's FIM tokens."""
        if not suffix:
            return
        vocab = self.tokenizer.get_vocab() if self.tokenizer is not None else {}
        if any(token in vocab for token in _FIM_PREFIX_TOKENS):
            raise APIError(400, "suffix: fill-in-the-middle prompts are not implemented", param="suffix")
        raise APIError(400, "suffix: this model has no fill-in-the-middle (FIM) support", param="suffix")

    def response_id(self, prefix: str, body: Any, raw_request: Request, separator: str = "-") -> str:
        """``{prefix}{separator}{base}``: base is the ``X-Request-Id`` header, else the body's ``request_id``, else
        random (vLLM's ``_base_request_id``)."""
        base = raw_request.headers.get("X-Request-Id") or body.request_id or random_uuid()
        return f"{prefix}{separator}{base}"

    @staticmethod
    def truncate(token_ids: list[int], truncate_prompt_tokens: int | None) -> list[int]:
        """The last ``truncate_prompt_tokens`` ids (vLLM truncates prompts from the left)."""
        return token_ids if truncate_prompt_tokens is None else token_ids[-truncate_prompt_tokens:]

    def check_token_ids(self, token_ids: Sequence[int], param: str, where: str | None = None) -> None:
        """400 naming ``param`` (and ``where``, e.g. ``prompt[2]`` for a batch's prompt) and the index of the first
        id outside the vocabulary."""
        for index, token_id in enumerate(token_ids):
            if not 0 <= token_id < self.info.vocab_size:
                raise APIError(400, f"{where or param}[{index}]: token id {token_id} is out of range "
                                    f"[0, {self.info.vocab_size}) (the model's vocabulary)", param=param)

    def require_tokenizer(self, param: str) -> Any:
        if self.tokenizer is None:
            raise APIError(400, f"{param}: this model has no tokenizer, so only token-id prompts are accepted",
                           param=param)
        return self.tokenizer

    async def encode(self, text: str, add_special_tokens: bool, param: str, *, truncating: bool = False) -> list[int]:
        """The token ids of ``text`` (on the tokenizer thread). Unless the prompt is truncated afterwards
        (``truncating``), a text too long for any prompt of ``max_model_len`` tokens is refused untokenized."""
        self.require_tokenizer(param)
        if not truncating and self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise APIError(400, f"{param}: the text has {len(text)} characters, more than any prompt within this "
                                f"model's maximum context length of {self.info.max_model_len} tokens can have "
                                f"({self.max_prompt_chars}). Please reduce the length of the input.", param=param)
        return await self._off_loop(self._encode, text, add_special_tokens, param)

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except Exception as exc:  # noqa: BLE001 - e.g. lone surrogates the tokenizer cannot encode
            raise APIError(400, f"{param}: cannot tokenize the text ({exc})", param=param) from exc

    async def prompt_token_ids(self, prompts: Sequence[str | list[int]], add_special_tokens: bool,
                               truncate_prompt_tokens: int | None, param: str) -> list[list[int]]:
        """Each prompt (a text or token ids) as token ids: tokenized, checked against the vocabulary (400 naming
        ``param[i]`` of a batch), truncated to its last ``truncate_prompt_tokens`` and checked for length."""
        out = []
        for index, prompt in enumerate(prompts):
            ids = (await self.encode(prompt, add_special_tokens, param, truncating=truncate_prompt_tokens is not None)
                   if isinstance(prompt, str) else list(prompt))
            self.check_token_ids(ids, param, f"{param}[{index}]" if len(prompts) > 1 else None)
            ids = self.truncate(ids, truncate_prompt_tokens)
            self.check_prompt_length(len(ids), param)
            out.append(ids)
        return out

    async def encode_pair(self, first: str, second: str, param: str) -> list[int]:
        """The token ids of a text pair as the tokenizer encodes pairs (a cross-encoder's prompt,
        ``paged_jax.pooling.scoring.pair_prompt_token_ids``), on the tokenizer thread."""
        return await self._off_loop(pair_prompt_token_ids, self.require_tokenizer(param), first, second)

    async def decode(self, token_ids: Sequence[int], param: str) -> str:
        tokenizer = self.require_tokenizer(param)
        return await self._off_loop(tokenizer.decode, list(token_ids))

    async def render_chat(self, messages: Sequence[ChatMessageParam], body: Any) -> str:
        """The prompt text of ``messages`` (``paged_jax.entrypoints.chat.render_chat``, on the tokenizer thread) with
        ``body``'s chat options; a template error is the input's (400)."""
        self.require_tokenizer("messages")
        self.check_request_chat_template(body)
        return await self._off_loop(self._render_chat, messages, body)

    def check_request_chat_template(self, body: Any) -> None:
        """A request's own chat template (``chat_template``, or one in ``chat_template_kwargs``) is refused unless
        the server trusts them (``--trust-request-chat-template``, as vLLM)."""
        if self.trust_request_chat_template:
            return
        for field, given in (("chat_template", getattr(body, "chat_template", None) is not None),
                             ("chat_template_kwargs", "chat_template" in (body.chat_template_kwargs or {}))):
            if given:
                raise APIError(400, f"{field}: a chat template is passed with the request, but the server does not "
                                    f"run request templates (serve with --trust-request-chat-template)", param=field)

    def _render_chat(self, messages: Sequence[ChatMessageParam], body: Any) -> str:
        tokenizer = self.tokenizer
        template = getattr(body, "chat_template", None)
        try:
            return render_chat(tokenizer, [message.model_dump() for message in messages], body.add_generation_prompt,
                               body.chat_template_kwargs, continue_final_message=body.continue_final_message,
                               chat_template=template if template is not None else self.chat_template,
                               documents=getattr(body, "documents", None), tools=getattr(body, "tools", None))
        except ChatTemplateError as exc:  # e.g. an unsupported role order
            raise APIError(400, f"messages: the chat template rejected the conversation ({exc})",
                           param=_chat_error_param(str(exc))) from exc
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
        """vLLM's ``get_max_tokens``: the request's value (400 if it does not fit), else the room left in the
        context; capped by the generation config's ``max_new_tokens``."""
        room = self.info.max_model_len - num_prompt_tokens
        if requested is not None and requested > room:
            raise APIError(400, f"{param}: '{requested}' is too large: the prompt has {num_prompt_tokens} tokens "
                                f"and this model's maximum context length is {self.info.max_model_len}, so at most "
                                f"{room} tokens can be generated.", param=param)
        limits = [room if requested is None else requested, self.default_sampling_params.get("max_tokens")]
        return min(limit for limit in limits if limit is not None)

    def sampling_params(self, body: SamplingFields, *, max_tokens: int, logprobs: int | None,
                        aliases: dict[str, str], prompt_logprobs: int | None = None, tool_schema: dict | None = None,
                        skip_special_tokens: bool | None = None):
        """``SamplingParams`` of ``body``; fields it leaves unset take the generation config's default, else
        vLLM's. ``logprobs`` / ``prompt_logprobs``: as the endpoint reads them from its fields. ``tool_schema``:
        the JSON schema a required / named tool choice constrains the reply to; ``skip_special_tokens``: the tool
        parser's override. ``aliases`` gains the structured-output spec's field -> the request field."""
        from paged_jax.sampling_params import SamplingParams
        from serving.structured_outputs import structured_outputs_from_request

        structured_outputs, spec_fields = structured_outputs_from_request(body, tool_schema)
        aliases.update(spec_fields)

        if body.stop_token_ids:
            self.check_token_ids(body.stop_token_ids, "stop_token_ids")
        defaults = self.default_sampling_params

        def value(name: str, builtin: Any) -> Any:
            requested = getattr(body, name)
            return requested if requested is not None else defaults.get(name, builtin)

        top_k = value("top_k", 0)
        try:
            return SamplingParams(
                n=body.n,
                best_of=body.best_of,
                temperature=value("temperature", 1.0),
                top_p=value("top_p", 1.0),
                # top_k >= vocab keeps every token, i.e. is off; mapping it to 0 also keeps huge values out of
                # the sampler's int32 tensors.
                top_k=0 if top_k >= self.info.vocab_size else top_k,
                min_p=value("min_p", 0.0),
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=value("repetition_penalty", 1.0),
                seed=body.seed,
                stop=body.stop,
                stop_token_ids=body.stop_token_ids,
                ignore_eos=body.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=body.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=(body.skip_special_tokens if skip_special_tokens is None
                                     else skip_special_tokens),
                spaces_between_special_tokens=body.spaces_between_special_tokens,
                logit_bias=body.logit_bias,
                allowed_token_ids=body.allowed_token_ids,
                bad_words=body.bad_words,
                structured_outputs=structured_outputs,
            )
        except ValueError as exc:
            raise self.bad_request(exc, body, aliases) from exc

    def generation_params(self, body: SamplingFields, *, max_tokens: int, logprobs: int | None,
                          aliases: dict[str, str], **sampling_kwargs):
        """``BeamSearchParams`` for a ``use_beam_search`` request (vLLM's ``to_beam_search_params``: beam width n,
        temperature default as sampling's), else ``sampling_params(..., **sampling_kwargs)``."""
        if not body.use_beam_search:
            return self.sampling_params(body, max_tokens=max_tokens, logprobs=logprobs, aliases=aliases,
                                        **sampling_kwargs)
        from paged_jax.sampling_params import BeamSearchParams

        temperature = body.temperature if body.temperature is not None else \
            self.default_sampling_params.get("temperature", 1.0)
        try:
            return BeamSearchParams(beam_width=body.n, max_tokens=max_tokens, ignore_eos=body.ignore_eos,
                                    temperature=temperature, length_penalty=body.length_penalty,
                                    include_stop_str_in_output=body.include_stop_str_in_output)
        except ValueError as exc:
            raise self.bad_request(exc, body, {**aliases, "beam_width": "n"}) from exc

    def bad_request(self, exc: Exception, body: Any, aliases: dict[str, str]) -> APIError:
        known = set(type(body).model_fields) | {"prompt", "messages"}
        return APIError(400, str(exc), param=param_from_message(str(exc), known, aliases))

    def engine_prompt(self, token_ids: list[int], body: Any) -> list[int] | dict:
        """What the engine gets as the prompt: the ids, with the request's ``cache_salt`` (vLLM's prompt dict)."""
        salt = getattr(body, "cache_salt", None)
        return token_ids if salt is None else {"prompt_token_ids": token_ids, "cache_salt": salt}

    async def submit(self, requests: list[EngineRequest], body: Any, aliases: dict[str, str]) -> list[RequestStream]:
        """Admit ``requests`` (one API request's prompts, counted by ``check_num_seqs`` already) as a group; a full
        waiting queue is 503 with Retry-After."""
        try:
            return await self.engine.add_requests(requests)
        except EngineOverloadedError as exc:
            raise APIError(503, str(exc), headers={"Retry-After": str(exc.retry_after_s)}) from exc
        except EngineDeadError as exc:
            raise APIError(500, str(exc)) from exc
        except ValueError as exc:
            raise self.bad_request(exc, body, aliases) from exc

    def cached_tokens(self, num_cached_tokens: Iterable[int]) -> int | None:
        """The usage's ``prompt_tokens_details.cached_tokens``: the prompts' tokens served from the prefix cache
        (``RequestOutput.num_cached_tokens`` of each prompt), None without ``--enable-prompt-tokens-details``."""
        return sum(num_cached_tokens) if self.enable_prompt_tokens_details else None

    # ---------------------------------------------------------------- logprobs formatting
    def token_text(self, token_id: int, logprob: Any, as_token_id: bool = False) -> str:
        """How a logprobs entry shows a token: its text, or ``token_id:N`` (``return_tokens_as_token_ids``)."""
        if as_token_id:
            return f"token_id:{token_id}"
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

    def prompt_logprobs(self, entries: Sequence[dict | None] | None) -> list[dict[int, PromptLogprob] | None] | None:
        """A ``RequestOutput.prompt_logprobs`` as responses show it (logprobs clamped to JSON numbers, as vLLM)."""
        if entries is None:
            return None
        return [None if entry is None else {token_id: PromptLogprob(logprob=self.clamp(lp.logprob), rank=lp.rank,
                                                                    decoded_token=lp.decoded_token)
                                            for token_id, lp in entry.items()}
                for entry in entries]

    def completion_logprobs(self, token_ids: Sequence[int], logprobs: Sequence[dict | None], num_top: int,
                            text_offset: int, as_token_ids: bool = False) -> CompletionLogProbs:
        """Legacy format for tokens ``token_ids`` (the token plus the ``num_top`` most likely); an entry of None (an
        echoed prompt's first token) has no logprob; ``as_token_ids``: tokens shown as ``token_id:N``."""
        result = CompletionLogProbs()
        for token_id, entries in zip(token_ids, logprobs):
            if entries is None:
                text = self.token_text(token_id, None, as_token_ids)
                result.tokens.append(text)
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                result.text_offset.append(text_offset)
                text_offset += len(text)
                continue
            sampled = entries.get(token_id)
            text = self.token_text(token_id, sampled, as_token_ids)
            result.tokens.append(text)
            result.token_logprobs.append(self.clamp(sampled.logprob) if sampled is not None else None)
            top: dict[str, float] = {}
            for other_id, entry in self._ranked(entries)[:num_top]:
                top[self.token_text(other_id, entry, as_token_ids)] = self.clamp(entry.logprob)
            if sampled is not None:
                top.setdefault(text, self.clamp(sampled.logprob))
            result.top_logprobs.append(top)
            result.text_offset.append(text_offset)
            text_offset += len(text)  # also for token_id:N spellings, as vLLM
        return result

    def chat_logprobs(self, token_ids: Sequence[int], logprobs: Sequence[dict], num_top: int,
                      as_token_ids: bool = False) -> ChatCompletionLogProbs:
        content = []
        for token_id, entries in zip(token_ids, logprobs):
            sampled = entries.get(token_id)
            text = self.token_text(token_id, sampled, as_token_ids)
            top = [ChatCompletionTopLogprob(token=(t := self.token_text(other_id, entry, as_token_ids)),
                                            logprob=self.clamp(entry.logprob), bytes=list(t.encode("utf-8")))
                   for other_id, entry in self._ranked(entries)[:num_top]]
            content.append(ChatCompletionLogProbsContent(
                token=text, logprob=self.clamp(sampled.logprob) if sampled is not None else MIN_LOGPROB,
                bytes=list(text.encode("utf-8")), top_logprobs=top))
        return ChatCompletionLogProbs(content=content)


def _chat_error_param(message: str) -> str:
    """The request field a chat rendering error is about."""
    if "continue_final_message" in message:
        return "continue_final_message"
    if "chat_template_kwargs" in message:
        return "chat_template_kwargs"
    return "messages"


def get_server(request: Request) -> OpenAIServer:
    """The app's ``OpenAIServer`` (a FastAPI dependency of the routes)."""
    return request.app.state.server
