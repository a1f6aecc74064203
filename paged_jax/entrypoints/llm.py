"""``LLM``: the offline batch API (vLLM's name and signatures).

    llm = LLM()                                    # built-in SmolLM2-135M-Instruct
    outs = llm.generate(["Hello", "The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    outs = llm.chat([{"role": "user", "content": "Hi!"}])
    beams = llm.beam_search([{"prompt": "The capital of France is"}], BeamSearchParams(beam_width=4, max_tokens=16))
    vectors = LLM(embedding_checkpoint, runner="pooling").embed(["Hello"])  # .outputs.embedding
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
from collections.abc import Sequence
from typing import Any

from paged_jax.engine.beam_search import BeamSearchOutput, to_beam_search_output
from paged_jax.entrypoints.chat import chat_prompt_token_ids
from paged_jax.config import EngineArgs
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.generation_config import sampling_defaults
from paged_jax.entrypoints.llm_pooling import PoolingMethods
from paged_jax.lora.request import LoRARequest
from paged_jax.metrics import Metric, metrics_from_stats
from paged_jax.outputs import RequestOutput
from paged_jax.sampling_params import BeamSearchParams, SamplingParams

_ENGINE_ARG_NAMES = {f.name for f in dataclasses.fields(EngineArgs)}


class LLM(PoolingMethods):
    """Offline inference over one model: ``generate`` / ``chat`` / ``beam_search``, or with a pooling model
    (``runner="pooling"``) ``embed`` / ``classify`` / ``score`` / ``encode`` (``paged_jax.entrypoints.llm_pooling``).

    Args:
      model: HF checkpoint directory; None = the built-in SmolLM2-135M-Instruct; with ``load_format="dummy"`` a
        known shape name.
      **kwargs: any ``EngineArgs`` field (e.g. ``max_model_len``, ``max_num_seqs``, ``dtype``, ``seed``), plus
        ``use_tqdm`` (start-up progress bars).
    """

    def __init__(self, model: str | None = None, **kwargs: Any):
        use_tqdm = kwargs.pop("use_tqdm", True)
        unknown = sorted(set(kwargs) - _ENGINE_ARG_NAMES)
        if unknown:
            raise ValueError(f"{unknown[0]} is not an engine argument (known: {', '.join(sorted(_ENGINE_ARG_NAMES))})")
        # Its core is an EngineCore, or a DataParallelCore of data_parallel_size replicas.
        self.llm_engine = LLMEngine(EngineArgs(model=model, **kwargs), use_tqdm=use_tqdm)
        self._request_counter = itertools.count()
        # The generation config's sampling defaults (read once: sampling_defaults logs them).
        self._sampling_defaults = sampling_defaults(self.llm_engine.generation_config)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> None:
        """Forget every prefix-cache entry (vLLM's ``LLM.reset_prefix_cache``): later prompts compute their KV again,
        e.g. so that a benchmark's warm-up cannot serve its timed run."""
        self.llm_engine.reset_prefix_cache()

    # ------------------------------------------------------------------ RL rollouts (vLLM's names)
    def update_weights(self, params) -> None:
        """Replace the weights without a restart or a compile: ``params`` is the model's ``nnx.State`` (or its pure
        dict, or a flat dict of dotted paths or HF names) in the engine's dtype, on any device. Fused projections and
        online quantization are re-applied, LoRA adapters stay, the prefix cache is reset. A ValueError naming the
        first missing, unexpected or mismatched parameter leaves the old weights serving."""
        self.llm_engine.update_weights(params)

    def update_weights_from_disk(self, path: str) -> None:
        """``update_weights`` from an HF safetensors checkpoint directory or an orbax checkpoint of
        ``nnx.to_pure_dict(nnx.state(model))`` (other float dtypes are cast)."""
        self.llm_engine.update_weights_from_disk(path)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        """vLLM's: prepare to take weights from a trainer process of the same ``jax.distributed`` job (the engine
        started with ``weight_transfer_config={"backend": "jax"}``); ``init_info``: ``{"trainer_process": i}``, the
        trainer's ``jax.process_index()``."""
        self.llm_engine.init_weight_transfer_engine(init_info)

    def update_weights_from_distributed(self, names: list[str], dtype_names: list[str], shapes: list) -> None:
        """Take the weights the trainer sends (``paged_jax.parallel.weight_transfer.send_weights``, at the same time):
        vLLM's update info, each parameter's name (model path or HF name), dtype name and shape in the trainer's
        order; checked, then ``update_weights``. ValueError (and the trainer's send a RuntimeError) when they do
        not fit the model."""
        self.llm_engine.update_weights_from_distributed(names, dtype_names, shapes)

    def sleep(self, level: int = 1) -> dict:
        """Free device memory for a trainer (needs ``enable_sleep_mode=True``): level 1 moves the weights to host
        memory, level 2 drops them; both free the KV pool. Returns the device's bytes in use before and after."""
        return self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back the memory of ``tags`` ("weights", "kv_cache"; default both)."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def pause_generation(self, mode: str = "abort") -> None:
        """Stop scheduling: "abort" ends unfinished requests, "wait" runs them to their end first, "keep" freezes
        them with their KV until ``resume_generation``."""
        engine = self.llm_engine
        engine.pause_generation(mode)
        while not engine.is_paused():  # "wait": the engine's own requests run to their end
            engine.step()

    def resume_generation(self) -> None:
        self.llm_engine.resume_generation()

    def get_metrics(self) -> list[Metric]:
        """The engine's gauges and counters as vLLM's ``LLM.get_metrics`` gives them (``paged_jax.metrics``: names
        ``vllm:...``; with speculative decoding its counters and the per-position ``Vector``)."""
        return metrics_from_stats(self.llm_engine.stats())

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters ``generate`` / ``chat`` use when given none (vLLM's): ``SamplingParams()`` with
        the defaults of the checkpoint's generation config (``--generation-config``; e.g. its temperature, top_p,
        top_k, and ``max_new_tokens`` as ``max_tokens``)."""
        return SamplingParams(**self._sampling_defaults)

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]] | Sequence[dict] | dict,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; returns the finished ``RequestOutput``s in input order.

        Args:
          prompts: a str, a list of str, a list of token-id lists, or (a list of) dicts with ``prompt_token_ids``
            or ``prompt``.
          sampling_params: one ``SamplingParams`` for all, one per prompt, or None
            (``get_default_sampling_params()``).
          use_tqdm: show a progress bar over finished prompts.
          lora_request: the LoRA adapter (``LoRARequest``; needs ``enable_lora=True``) for all prompts, one per
            prompt (None = the base model), or None.
        Raises:
          ValueError for a bad prompt or parameter (nothing is left queued in the engine).
        """
        prompt_list = self._normalize_prompts(prompts)
        if sampling_params is None:
            params_list = [self.get_default_sampling_params()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"sampling_params has {len(params_list)} entries for {len(prompt_list)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_list = [lora_request] * len(prompt_list)
        else:
            lora_list = list(lora_request)
            if len(lora_list) != len(prompt_list):
                raise ValueError(f"lora_request has {len(lora_list)} entries for {len(prompt_list)} prompts")
        return self._run(prompt_list, params_list, use_tqdm, lora_list)

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None,
             chat_template: str | None = None, continue_final_message: bool = False,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them (``paged_jax.entrypoints.chat``), then
        generate.

        Args:
          messages: ``[{"role": ..., "content": ...}, ...]`` (OpenAI-style: content may be a list of text parts)
            or a list of such conversations.
          add_generation_prompt: end the prompt with the assistant turn header.
          chat_template_kwargs: extra variables for the template (e.g. ``{"enable_thinking": False}``).
          chat_template: a Jinja template replacing the tokenizer's.
          continue_final_message: the reply continues the final message (set ``add_generation_prompt=False``).
          lora_request: as in ``generate``.
        """
        tokenizer = self.get_tokenizer()
        if tokenizer is None or (chat_template is None and getattr(tokenizer, "chat_template", None) is None):
            raise ValueError("chat needs a tokenizer with a chat template (or chat_template)")
        if not messages:
            raise ValueError("messages must not be empty")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": chat_prompt_token_ids(
                        tokenizer, conversation, add_generation_prompt, chat_template_kwargs,
                        chat_template=chat_template, continue_final_message=continue_final_message)}
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(self, prompts: str | Sequence[str] | Sequence[Sequence[int]] | Sequence[dict] | dict,
                    params: BeamSearchParams, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search`` (``paged_jax.engine.beam_search``): per prompt, the best ``params.beam_width``
        sequences (tokens = prompt + output, ``text`` their decoding), best first.

        Args:
          prompts: as ``generate`` (vLLM passes ``{"prompt_token_ids": ...}`` / ``{"prompt": ...}`` dicts).
          params: ``BeamSearchParams``.
          use_tqdm: a progress bar over finished prompts.
          concurrency_limit: at most this many prompts searched at once (None: all).
        """
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be None or an int >= 1, got {concurrency_limit!r}")
        prompt_list = self._normalize_prompts(prompts)
        tokenizer = self.get_tokenizer()
        decode = tokenizer.decode if tokenizer is not None else None
        limit = concurrency_limit or max(len(prompt_list), 1)
        results = []
        for start in range(0, len(prompt_list), limit):
            batch = prompt_list[start:start + limit]
            for output in self._run(batch, [params] * len(batch), use_tqdm):
                results.append(to_beam_search_output(output, params, decode))
        return results

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _normalize_prompts(prompts) -> list:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(p, int) for p in prompts):
            raise ValueError("prompts: a flat list of ints is ambiguous; pass [token_ids] or "
                             "[{'prompt_token_ids': token_ids}]")
        return prompts

    def _run(self, prompts: list, params_list: list[SamplingParams | BeamSearchParams], use_tqdm: bool,
             lora_list: list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        engine = self.llm_engine
        request_ids = []
        try:
            for prompt, params, lora_request in zip(prompts, params_list, lora_list or [None] * len(prompts)):
                request_id = f"llm-{next(self._request_counter)}"
                engine.add_request(request_id, prompt, params, lora_request=lora_request)
                request_ids.append(request_id)
        except Exception:
            engine.abort_request(request_ids)  # all-or-nothing: leave nothing queued
            raise
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar, _start_heap_frozen():
            while len(finished) < len(request_ids):
                if not engine.has_unfinished_requests():
                    raise RuntimeError("the engine has no unfinished requests but some outputs are missing")
                # Only finished outputs, so each is a request's only output: its whole generation, nothing to
                # accumulate (and no per-step outputs of running requests are built).
                for output in engine.step(finished_only=True):
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]


@contextlib.contextmanager
def _start_heap_frozen():
    """While a generation runs, the heap alive when it started (the engine, the model, compiled executables:
    hundreds of thousands of objects, none freed by the steps) sits in the garbage collector's permanent generation,
    so the full collections the steps trigger walk only what the steps allocate; put back afterwards, so that
    nothing frozen stays uncollectable. A no-op where the heap is frozen already (``serving.lifecycle``)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
