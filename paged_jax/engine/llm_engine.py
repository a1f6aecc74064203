"""``LLMEngine``: the synchronous engine loop (vLLM's name and API).

One ``step()`` = schedule (continuous batching, chunked prefill, preemption) -> swap copies -> one bucketed model
step on device (forward + sampling) -> scheduler update (stop tokens, lengths) -> incremental detokenization (stop
strings) -> ``RequestOutput`` deltas (what is new since the last output) of the requests that progressed.

A request with ``SamplingParams.n > 1`` (or ``best_of``) runs as several sequences in the scheduler: the first
computes the prompt once, the others are forked from it with copy-on-write blocks when it samples its first token
(``paged_jax.engine.sequence_group``). A ``BeamSearchParams`` request runs vLLM's beam search on forked beams
(``paged_jax.engine.beam_search``).

Thread-safety: none; the serving layer drives one engine from one thread (``serving.async_engine``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

import jax
import numpy as np

from paged_jax.engine.async_scheduling import AsyncSchedulingMixin, InFlightStep
from paged_jax.engine.beam_search import BeamSearchParams, BeamSearchState
from paged_jax.worker.buckets import planned_num_compiles
from paged_jax.config import EngineArgs
from paged_jax.engine.detokenizer import IncrementalDetokenizer, check_stop_strings
from paged_jax.worker.device_check import warn_if_gpu_unused
from paged_jax.worker.device_memory import reserve_gpu_memory_fraction
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.lora.engine_api import LoRAEngineMixin, make_lora_manager, make_lora_slots
from paged_jax.worker.model_loader import load_engine_model
from paged_jax.worker.kv_pool_sizing import (dequantized_weight_bytes, determine_num_blocks, device_bytes,
                                     enable_compilation_cache, kv_bytes_per_block, num_host_blocks_for)
from paged_jax.parallel.multihost import agree_on_smallest, leader_channel, start_distributed
from paged_jax.parallel.pipeline import runner_class
from paged_jax.outputs import Logprob, RequestMetrics, RequestOutput, make_logprob_dict
from paged_jax.engine.sequence_group import RequestState, SequenceState, child_seed
from paged_jax.worker.prompt_logprobs import PromptLogprobsCollector
from paged_jax.core.request import Request, RequestStatus
from paged_jax.worker.sampler import check_request_fits
from paged_jax.sampling_params import SamplingParams, validate_token_ids
from paged_jax.core.sched_output import SchedulerOutput
from paged_jax.core.scheduler import Scheduler
from paged_jax.worker.step_io import PendingStep
from paged_jax.engine.step_outputs import StreamDeltas, make_delta_output
from paged_jax.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

_CPU_MAX_NUM_SEQS, _GPU_MAX_NUM_SEQS = 32, 256
_CPU_MAX_BATCHED_TOKENS, _GPU_MAX_BATCHED_TOKENS = 512, 8192
_CPU_DEFAULT_MAX_MODEL_LEN = 2048


class LLMEngine(AsyncSchedulingMixin, LoRAEngineMixin):
    """An inference engine over one model: add requests, call ``step()`` until none are left.

    Args:
      engine_args: ``EngineArgs`` (vLLM names). ``model=None`` loads the built-in SmolLM2-135M-Instruct.
      use_tqdm: show progress bars for weight loading / compilation.

    Attributes (read by the serving layer): ``tokenizer`` (None for dummy shapes without one), ``model_config``,
    ``max_model_len``, ``vocab_size``, ``eos_token_ids``, ``engine_args``, ``model_path``, ``runner``,
    ``scheduler``; ``startup_timings``: seconds of each start-up stage (``backend_s``: to the first device,
    ``load_s``: weights, tokenizer and generation config, ``kv_sizing_s``, ``runner_init_s``, ``warm_up_s``).
    """

    def __init__(self, engine_args: EngineArgs, *, use_tqdm: bool = True, devices: Sequence | None = None):
        args = engine_args
        if args.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size={args.data_parallel_size}: one LLMEngine is one replica; build "
                             "replicas with paged_jax.create_engine (paged_jax.parallel.data_parallel.DataParallelEngine)")
        self.engine_args = args
        start = time.perf_counter()
        # Before anything starts a JAX backend: its GPU allocator cap is fixed then (paged_jax.worker.device_memory), and
        # a multi-host job must be joined before (paged_jax.parallel.multihost).
        reserve_gpu_memory_fraction(args.gpu_memory_utilization)
        start_distributed(args)
        warn_if_gpu_unused()
        enable_compilation_cache(args.compilation_cache_dir)
        device = devices[0] if devices else jax.local_devices()[0]  # a follower node sizes for its own devices
        on_accelerator = device.platform != "cpu"
        args.log_compatibility_notes(on_accelerator)
        # Seconds of each start-up stage (benchmarks/startup.py reports them); warm-up's own phases are the runner's.
        self.startup_timings = {"backend_s": time.perf_counter() - start}
        stage_start = time.perf_counter()

        logger.info("Loading model %s (dtype %s) on %s", args.model or "SmolLM2-135M-Instruct (built-in)", args.dtype,
                    device)
        loaded = load_engine_model(args, on_accelerator, devices)
        self.startup_timings["load_s"], stage_start = time.perf_counter() - stage_start, time.perf_counter()
        model, config, plan = loaded.model, loaded.config, loaded.plan
        run_config, memory_config = loaded.run_config, loaded.memory_config
        self.model_path = loaded.model_path
        self.model_load_seconds = loaded.load_seconds
        self.generation_config = loaded.generation_config
        self.model_config = config
        self.vocab_size = config.vocab_size
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids

        max_model_len = self._max_model_len(args.max_model_len, config.max_position_embeddings, on_accelerator)
        self.max_model_len = max_model_len
        max_num_seqs = args.max_num_seqs or (_GPU_MAX_NUM_SEQS if on_accelerator else _CPU_MAX_NUM_SEQS)
        max_num_batched_tokens = args.max_num_batched_tokens or (
            _GPU_MAX_BATCHED_TOKENS if on_accelerator else _CPU_MAX_BATCHED_TOKENS)
        if not args.enable_chunked_prefill and args.max_num_batched_tokens is None:
            max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)  # a whole prompt fits one step (vLLM)
        max_num_seqs = min(max_num_seqs, max_num_batched_tokens)  # every scheduled sequence has >= 1 token
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens

        kv_dtype = loaded.kv_cache_dtype or model.dtype  # --kv-cache-dtype fp8: 1 byte per element
        num_blocks, num_host_blocks = self._size_kv_pool(loaded, kv_dtype, device)
        self.startup_timings["kv_sizing_s"], stage_start = time.perf_counter() - stage_start, time.perf_counter()
        self.runner = runner_class(plan)(  # a PipelineModelRunner with pipeline_parallel_size > 1
            model, run_config, num_blocks=num_blocks, block_size=args.block_size, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            num_host_blocks=num_host_blocks, eos_token_ids=self.eos_token_ids, attention_impl=args.attention_impl,
            device=device, sharding_plan=plan, dispatch_thread=bool(args.async_scheduling), kv_cache_dtype=kv_dtype,
            lora_slots=make_lora_slots(args, model, run_config, plan, device))  # None unless enable_lora
        self.lora_manager = make_lora_manager(args, self.runner)
        self.kv_cache_manager = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching,
                                               num_host_blocks=num_host_blocks)
        self.scheduler = Scheduler(self.kv_cache_manager, max_num_seqs, max_num_batched_tokens, max_model_len,
                                   preemption_mode=args.preemption_mode, policy=args.scheduling_policy,
                                   enable_chunked_prefill=args.enable_chunked_prefill,
                                   max_loras=args.max_loras if args.enable_lora else 0)
        self._warm_up(num_blocks, num_host_blocks, kv_bytes_per_block(memory_config, args.block_size, kv_dtype),
                      use_tqdm, stage_start, start)

        self._seed_rng = np.random.default_rng(args.seed)
        self.structured_outputs = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._requests: dict[str, RequestState] = {}  # unfinished user requests
        self._seq_by_id: dict[str, tuple[RequestState, SequenceState]] = {}  # scheduler request id -> sequence
        self.async_scheduling = bool(args.async_scheduling)
        self._in_flight: InFlightStep | None = None
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_steps = 0

    def _warm_up(self, num_blocks: int, num_host_blocks: int, block_bytes: int, use_tqdm: bool,
                 stage_start: float, start: float) -> None:
        """Log the KV pool, then compile (or load) every step executable (``ModelRunner.warm_up``)."""
        args, max_model_len = self.engine_args, self.max_model_len
        max_num_batched_tokens, max_num_seqs = self.max_num_batched_tokens, self.max_num_seqs
        kv_tokens = (num_blocks - 1) * args.block_size
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB), %d host blocks; max_model_len %d "
                    "(%.2fx concurrency at full length)", num_blocks - 1, args.block_size, kv_tokens,
                    num_blocks * block_bytes / 2**30,
                    num_host_blocks, max_model_len, kv_tokens / max_model_len)
        num_compiles = planned_num_compiles(max_num_batched_tokens, max_num_seqs, swap=num_host_blocks > 0,
                                            num_blocks=num_blocks)
        logger.info("Compiling %d step executables (%d step shapes) ahead of serving%s", num_compiles,
                    len(self.runner.buckets), "" if args.compilation_cache_dir == "" else
                    "; the JAX compilation cache makes later starts faster")
        compile_start = time.perf_counter()
        self.startup_timings["runner_init_s"] = compile_start - stage_start
        self.runner.warm_up(use_tqdm=use_tqdm)
        self.startup_timings["warm_up_s"] = time.perf_counter() - compile_start
        self.runner.step_channel = leader_channel()  # multi-host node 0: the other nodes replay its steps
        logger.info("Compiled in %.1f s; engine ready in %.1f s", time.perf_counter() - compile_start,
                    time.perf_counter() - start)

    def _size_kv_pool(self, loaded, kv_dtype, device) -> tuple[int, int]:
        """(device KV blocks, host swap blocks) for the loaded model and this engine's limits: what the device's
        memory leaves after the weights (``kv_pool_sizing``), the same count on every node of a multi-host job."""
        args, model = self.engine_args, loaded.model
        max_model_len, max_num_seqs = self.max_model_len, self.max_num_seqs
        max_num_batched_tokens = self.max_num_batched_tokens
        memory_config, run_config = loaded.memory_config, loaded.run_config
        dequantization_bytes = dequantized_weight_bytes(model, max_num_batched_tokens, device)
        if dequantization_bytes and device.platform != "cpu":
            logger.info("KV cache sizing leaves %.2f GiB for weights XLA dequantizes in the wider steps (weight-only "
                        "quantized layers)", dequantization_bytes / 2**30)
        num_blocks = determine_num_blocks(
            memory_config, block_size=args.block_size, dtype=kv_dtype, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            gpu_memory_utilization=args.gpu_memory_utilization, num_blocks_override=args.num_gpu_blocks_override,
            device=device, weight_bytes=device_bytes(model, device),
            dequantization_bytes=dequantization_bytes)
        num_blocks = agree_on_smallest("num_gpu_blocks", num_blocks)  # a compiled shape: one count on every node
        num_host_blocks = (num_host_blocks_for(run_config, block_size=args.block_size, dtype=kv_dtype,
                                               swap_space_gib=args.swap_space)
                           if args.preemption_mode == "swap" else 0)
        return num_blocks, num_host_blocks

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs) -> "LLMEngine":
        return cls(engine_args, **kwargs)

    @staticmethod
    def _max_model_len(requested: int | None, model_max: int, on_accelerator: bool) -> int:
        """``max_model_len``: the requested one (at most the model's ``max_position_embeddings``), else the model's
        own (vLLM). On the CPU the default is capped at ``_CPU_DEFAULT_MAX_MODEL_LEN``: the CPU attention (the jnp
        reference) reads a whole max_model_len context for every token, so the model's full length (8k to 128k)
        would make every step that many times slower; the note says how to ask for more."""
        if requested is not None:
            if requested > model_max:
                raise ValueError(f"max_model_len ({requested}) exceeds the model's max_position_embeddings "
                                 f"({model_max})")
            return requested
        if not on_accelerator and model_max > _CPU_DEFAULT_MAX_MODEL_LEN:
            logger.info("max_model_len defaults to %d on the CPU (the model supports %d): the CPU attention reads "
                        "the whole max_model_len context for every token; pass --max-model-len %d (max_model_len=) "
                        "for the full length", _CPU_DEFAULT_MAX_MODEL_LEN, model_max, model_max)
            return _CPU_DEFAULT_MAX_MODEL_LEN
        return model_max

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | Sequence[int] | dict,
                    params: SamplingParams | BeamSearchParams | None = None, priority: int = 0,
                    arrival_time: float | None = None, lora_request=None) -> None:
        """Queue a request. Everything is validated here, so a bad request never reaches the scheduler.

        Args:
          request_id: unique among unfinished requests.
          prompt: text (needs a tokenizer), a list of token ids, or a dict with ``prompt_token_ids`` or ``prompt``
            (and optionally vLLM's ``cache_salt``: prefix-cache entries are shared only among equal salts).
          params: ``SamplingParams`` (default ``SamplingParams()``), or ``BeamSearchParams`` for a beam search (its
            one output, when finished, holds the best ``beam_width`` beams).
          priority: lower runs earlier with ``scheduling_policy="priority"``.
          arrival_time: ``time.time()`` of arrival (default now); used for metrics and FCFS order.
          lora_request: the ``LoRARequest`` of the adapter to run with (``enable_lora``), or None.
        Raises:
          ValueError naming the offending field: ``request_id`` (empty / in use), ``params``, ``prompt`` (empty,
          longer than max_model_len, token ids outside the vocabulary, text without a tokenizer),
          ``stop_token_ids`` (outside the vocabulary, too many with min_tokens), ``stop`` (without a tokenizer),
          ``logit_bias`` / ``allowed_token_ids`` (outside the vocabulary, too many biases), ``bad_words`` (without a
          tokenizer, too many), ``priority``, ``beam_width``, ``lora_request`` (LoRA off, bad adapter, beam search).
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._requests or request_id in self._seq_by_id:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        if params is None:
            params = SamplingParams()
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise ValueError(f"params must be a SamplingParams or BeamSearchParams, got {type(params).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
            raise ValueError(f"priority must be an int, got {priority!r}")
        prompt_text, prompt_token_ids = self._tokenize_prompt(prompt)
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None  # vLLM's prompt-dict key
        arrival = time.time() if arrival_time is None else float(arrival_time)
        # The scheduler orders FCFS by arrival_time; it expects time.monotonic()-based values.
        monotonic_arrival = time.monotonic() - (time.time() - arrival)
        lora = self.resolve_lora(lora_request, beam_search=isinstance(params, BeamSearchParams))
        if isinstance(params, BeamSearchParams):
            self._add_beam_search(request_id, prompt_text, prompt_token_ids, params, int(priority), arrival,
                                  monotonic_arrival)
            return
        params = self._checked_sampling_params(params)
        # Parsed here (a bad spec is a ValueError naming its field), compiled on the manager's threads meanwhile.
        grammar = self.structured_outputs.grammar_for(params.structured_outputs) if params.structured_outputs else None

        base_seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 1 << 63))
        state = RequestState(request_id=request_id, prompt=prompt_text, prompt_token_ids=prompt_token_ids,
                              params=params, seqs=[], metrics=RequestMetrics(arrival_time=arrival))
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = PromptLogprobsCollector(prompt_token_ids, params.prompt_logprobs,
                                                            self._decode_one)
        num_seqs = params.num_sequences
        for index in range(num_seqs):
            seq_id = request_id if num_seqs == 1 else f"{request_id}::{index}"
            if seq_id in self._seq_by_id:
                raise ValueError(f"request_id {request_id!r} collides with the sequence ids of another request")
            state.seqs.append(self._new_sequence(state, index, seq_id, grammar, lora, cache_salt, int(priority),
                                                 monotonic_arrival, base_seed))
        # Sequences 1.. fork from sequence 0 when it samples its first token (as many as max_num_seqs lets run
        # together; any more start on their own, sharing the prompt only through the prefix cache).
        first = state.seqs[0].request
        first.pending_forks = [seq.request for seq in state.seqs[1:self.max_num_seqs]]
        first.reserved_seats = len(first.pending_forks)
        # Only now, with everything validated, touch shared state.
        self._register(state)
        for seq in state.seqs:
            seq.admitted = True
        for seq in [state.seqs[0], *state.seqs[self.max_num_seqs:]]:
            self.scheduler.add_request(seq.request)

    def _new_sequence(self, state: RequestState, index: int, seq_id: str, grammar, lora, cache_salt: str | None,
                      priority: int, monotonic_arrival: float, base_seed: int) -> SequenceState:
        """Sequence ``index`` of a new request: its scheduler ``Request`` and its detokenizer."""
        params, prompt_token_ids = state.params, state.prompt_token_ids
        request = Request(request_id=seq_id, prompt_token_ids=list(prompt_token_ids), params=params,
                          eos_token_ids=frozenset(self.eos_token_ids), priority=priority,
                          arrival_time=monotonic_arrival,
                          skip_prefix_cache=index == 0 and not self._prompt_logprobs_done(state),
                          cache_salt=cache_salt, lora=lora, seed=child_seed(base_seed, index),
                          grammar=self.structured_outputs.new_sequence(grammar) if grammar else None)
        detokenizer = None
        if params.detokenize and self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                stop=params.stop_strings, include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens)
        return SequenceState(index=index, request=request, detokenizer=detokenizer,
                             logprobs=[] if params.logprobs is not None else None,
                             cumulative_logprob=0.0 if params.sampled_logprobs is not None else None)

    def _checked_sampling_params(self, params: SamplingParams) -> SamplingParams:
        """Check what the request's parameters ask of this model (token ids in the vocabulary, the sampler's fixed
        widths, a tokenizer for stop strings and bad words); returns them with ``bad_words`` tokenized (a copy, as
        vLLM leaves the caller's object as it was). ValueError naming the field."""
        if params.stop_token_ids:
            validate_token_ids(params.stop_token_ids, self.vocab_size, "stop_token_ids")
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer, and this model has none")
            params = params.clone()  # as vLLM: the caller's object is left as it was
            params.update_from_tokenizer(self.tokenizer)
        check_request_fits(params, vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids)
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none")
        check_stop_strings(params.stop_strings, max_stop_strings=self.engine_args.max_stop_strings,
                           max_stop_string_len=self.engine_args.max_stop_string_len)
        return params

    def _register(self, state: RequestState) -> None:
        self._requests[state.request_id] = state
        for seq in state.seqs:
            self._seq_by_id[seq.request.request_id] = (state, seq)

    def _add_beam_search(self, request_id: str, prompt_text: str | None, prompt_token_ids: list[int],
                         params: BeamSearchParams, priority: int, arrival: float, monotonic_arrival: float) -> None:
        """A beam search request (``paged_jax.engine.beam_search``): its beams are forked scheduler requests."""
        if params.beam_width > self.max_num_seqs:
            raise ValueError(f"beam_width ({params.beam_width}) must be at most max_num_seqs ({self.max_num_seqs})")
        if 2 * params.beam_width > self.runner.max_logprobs:
            raise ValueError(f"beam_width ({params.beam_width}) needs 2 * beam_width logprobs, more than "
                             f"max_logprobs ({self.runner.max_logprobs})")
        num_steps = min(params.max_tokens, self.max_model_len - len(prompt_token_ids))
        if num_steps < 1:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens: no room left to generate within "
                             f"max_model_len={self.max_model_len}")
        state = RequestState(request_id=request_id, prompt=prompt_text, prompt_token_ids=prompt_token_ids,
                             params=SamplingParams(n=params.beam_width), seqs=[],
                             metrics=RequestMetrics(arrival_time=arrival))
        state.beam_search = BeamSearchState(state, params, num_steps, self.eos_token_ids, self.scheduler,
                                            self._seq_by_id, int(self._seed_rng.integers(0, 1 << 63)), priority,
                                            monotonic_arrival)
        if state.seqs[0].request.request_id in self._seq_by_id:
            raise ValueError(f"request_id {request_id!r} collides with the sequence ids of another request")
        self._register(state)
        self.scheduler.add_request(state.seqs[0].request)

    def _tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
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
            validate_token_ids(token_ids, self.vocab_size, "prompt")
            token_ids = [int(t) for t in token_ids]
        else:
            raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len={self.max_model_len}")
        return text, token_ids

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); their blocks are freed at once. No output is
        produced for an aborted request."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            state = self._requests.pop(rid, None)
            if state is None:
                continue
            for seq in state.seqs:
                if seq.admitted and not seq.finished:
                    self.scheduler.abort_request(seq.request.request_id)
                seq.finish_reason = seq.finish_reason or "abort"
                self._seq_by_id.pop(seq.request.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ the loop
    def step(self, *, finished_only: bool = False, stream_deltas: StreamDeltas | None = None) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of the requests that got a new token (finished ones included,
        with ``finished=True``), each the delta since the request's previous one. ``finished_only=True`` (FINAL_ONLY)
        returns just the finished ones: a caller asking only those (``LLM.generate``) gets each generation whole.
        ``stream_deltas``: plain running streams' deltas are appended to these columns instead of being returned
        (``paged_jax.engine.step_outputs``; the engine process's wire message).

        With ``async_scheduling`` the step's own tokens are reported by the next call: this call schedules and
        dispatches step k+1, then (while the device runs it) brings step k's tokens to the host, checks stop
        conditions and detokenizes. A call that schedules nothing just reports the step in flight.
        """
        if self.async_scheduling:
            return self._step_async(finished_only, stream_deltas)
        # A step left in flight by async scheduling just turned off is reported first.
        outputs = self._finish_in_flight(finished_only, stream_deltas) if self._in_flight is not None else []
        scheduler_output = self.scheduler.schedule()
        handle = self._launch(scheduler_output)
        if handle is not None:
            outputs += self._finish_sync(scheduler_output, handle, finished_only, stream_deltas)
        return outputs

    def _launch(self, scheduler_output: SchedulerOutput, defer_sampling: bool = False) -> PendingStep | None:
        """Hand the step to the runner (its diff, swap copies, then forward + sampling; ``defer_sampling``: only
        the forward when a row has a grammar, ``ModelRunner.execute``); None when it has no rows."""
        if scheduler_output.is_empty:
            return None
        if scheduler_output.scheduled_new_reqs:
            now = time.time()
            for new in scheduler_output.scheduled_new_reqs:
                metrics = self._seq_by_id[new.req_id][0].metrics
                if metrics.first_scheduled_time is None:
                    metrics.first_scheduled_time = now
                    metrics.time_in_queue = now - metrics.arrival_time
        lora_slots = self.lora_slots_for_step(scheduler_output.requests)
        handle = self.runner.execute(scheduler_output, lora_slots, defer_sampling=defer_sampling)
        if handle is not None:
            self.num_steps += 1
        return handle

    def _finish_sync(self, scheduler_output: SchedulerOutput, handle: PendingStep, finished_only: bool = False,
                     stream_deltas: StreamDeltas | None = None) -> list[RequestOutput]:
        """Synchronous path: wait for the tokens, let the scheduler apply them (stop tokens, lengths)."""
        result = handle.result()
        self._record_prompt_logprobs(scheduler_output, result)
        requests = scheduler_output.requests
        progressed = self.scheduler.update_from_output(scheduler_output, result.sampled_token_ids.tolist())
        row_of = {r.request_id: i for i, r in enumerate(requests)} if progressed else {}
        now = time.time()
        touched: dict[str, RequestState] = {}
        for request in progressed:
            state, seq = self._seq_by_id[request.request_id]
            self._on_token(state, seq, request, request.num_output_tokens - 1, result, row_of[request.request_id],
                           now)
            touched[state.request_id] = state
        return self._collect_outputs(touched.values(), now, finished_only, stream_deltas)

    def _collect_outputs(self, states: Iterable[RequestState], now: float, finished_only: bool = False,
                         stream_deltas: StreamDeltas | None = None) -> list[RequestOutput]:
        outputs = []
        decode = self.tokenizer.decode if self.tokenizer is not None else None  # beam search's texts
        for state in states:
            if state.beam_search is not None:
                state.beam_search.advance()  # every beam has its token: the next beams
            finished = state.finished
            if finished:
                state.metrics.finished_time = now
            if finished or (not finished_only and state.reports_deltas):
                if finished or stream_deltas is None or not stream_deltas.take(state):
                    outputs.append(make_delta_output(state, finished, decode))
            if finished:
                del self._requests[state.request_id]
                for seq in state.seqs:
                    self._seq_by_id.pop(seq.request.request_id, None)
        return outputs

    def _on_token(self, state: RequestState, seq: SequenceState, request: Request, output_index: int, result,
                  row: int, now: float) -> None:
        """Account, record logprobs and detokenize the output token ``output_index`` of ``request`` (known)."""
        token = request.output_token_ids[output_index]
        if request.grammar is not None:
            request.grammar.accept(token)
        self.generation_tokens_total += 1
        if output_index == 0:
            self.prompt_tokens_total += len(state.prompt_token_ids)
        metrics = state.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        if seq.logprobs is not None:
            seq.logprobs.append(self._token_logprobs(request.params, token, result, row))
        if seq.cumulative_logprob is not None:
            seq.cumulative_logprob += float(result.logprobs[row])
        finished = request.is_finished
        if seq.detokenizer is not None:
            _, stop_str = seq.detokenizer.append([token], finished=finished)
            if stop_str is not None and not finished:
                self.scheduler.finish_request(request.request_id, "stop")
                request.stop_reason = stop_str
                finished = request.is_finished
            elif stop_str is not None:  # the same token also ended it by EOS / length: the stop string wins
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = stop_str
        if finished:
            seq.finish_reason = request.finish_reason
            seq.stop_reason = request.stop_reason

    def _token_logprobs(self, params: SamplingParams, token: int, result, row: int) -> dict[int, Logprob]:
        return make_logprob_dict(token, result.logprobs[row], result.ranks[row],
                                 result.top_token_ids[row][:params.logprobs], result.top_logprobs[row][:params.logprobs],
                                 self._decode_one)

    @staticmethod
    def _prompt_logprobs_done(state: RequestState) -> bool:
        """True unless the request asked for prompt logprobs and some are still to compute."""
        return state.prompt_logprobs is None or state.prompt_logprobs.complete

    def _record_prompt_logprobs(self, scheduler_output: SchedulerOutput, result) -> None:
        """Record the prompt logprobs a finished step computed (``result.prompt_logprobs``, one per row)."""
        if result.prompt_logprobs is None:
            return
        starts = scheduler_output.row_num_computed_tokens()
        for request, start, chunk in zip(scheduler_output.requests, starts, result.prompt_logprobs):
            entry = self._seq_by_id.get(request.request_id)
            if chunk is None or entry is None or entry[1].request is not request:
                continue  # no prompt logprobs in this row, or aborted meanwhile
            collector = entry[0].prompt_logprobs
            collector.record(start, chunk)
            if collector.complete:
                request.skip_prefix_cache = False  # a later recompute may take hits again

    def _decode_one(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    # ------------------------------------------------------------------ metrics
    def stats(self) -> dict[str, float]:
        """A snapshot for metrics: scheduler gauges and counters plus token totals.

        Keys: num_running, num_waiting (includes n > 1 sequences waiting for their first sibling's prompt),
        num_unfinished_requests, kv_cache_usage (0..1), num_preemptions, num_swap_outs, num_swap_ins, num_gpu_blocks /
        num_cpu_blocks (KV pool sizes), prefix_cache_queries / prefix_cache_hits (tokens), prompt_tokens_total,
        generation_tokens_total, num_steps, num_compiles_since_warmup.
        """
        stats = dict(self.scheduler.stats())
        stats["num_unfinished_requests"] = len(self._requests)
        stats["prompt_tokens_total"] = self.prompt_tokens_total
        stats["generation_tokens_total"] = self.generation_tokens_total
        stats["num_steps"] = self.num_steps
        stats["num_compiles_since_warmup"] = self.runner.num_compiles_since_warmup
        return stats

    def get_tokenizer(self):
        return self.tokenizer
