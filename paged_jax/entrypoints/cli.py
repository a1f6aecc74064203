"""Engine flags for command lines, and ``paged-jax generate`` (offline generation).

    paged-jax generate [--model DIR] --prompt TEXT [--prompt TEXT ...] [--chat] [--max-tokens N] [--temperature T]
                       [--top-p P] [--top-k K] [--sampling-seed S] [engine flags, e.g. --max-model-len 2048]

The ``paged-jax`` console script is ``serving.commands.main``: it hands ``serve`` to ``serving.cli`` and ``generate`` to
``generate_main`` here (the engine package never imports the server). ``generate`` runs through ``paged_jax.LLM``
and prints one completion per prompt.

Engine flags are every ``EngineArgs`` field, spelled as vLLM spells them (``--max-num-seqs``,
``--num-gpu-blocks-override``, ...; underscores too, ``normalize_flag_spelling``); ``add_engine_args`` adds them
to a parser, for ``generate`` and ``serve`` alike. Unknown flags are refused (exit status 2, naming them).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Sequence
from typing import Any

from paged_jax.config import EngineArgs

# Extra spellings (vLLM's) and help texts of some engine flags.
_FLAG_ALIASES = {"tensor_parallel_size": ("-tp",), "pipeline_parallel_size": ("-pp",), "data_parallel_size": ("-dp",)}
_FLAG_HELP = {
    "model": "HF checkpoint directory or Hub repo id (default: the built-in SmolLM2-135M-Instruct)",
    "tokenizer": "tokenizer directory or Hub repo id (default: the model's)",
    "revision": "Hub branch, tag or commit of the model",
    "tokenizer_revision": "Hub branch, tag or commit of the tokenizer",
    "download_dir": "Hub cache directory (default: huggingface_hub's, $HF_HOME/hub)",
    "generation_config": "default sampling parameters: auto (the model's generation_config.json), vllm (none), or "
                         "a directory holding a generation_config.json",
    "dtype": "weights and activations: auto (bfloat16 on GPU, float32 on CPU), bfloat16, float16, float32 (float32 "
             "runs every matmul at full precision)",
    "load_format": "auto / safetensors: read the checkpoint; dummy: random weights in its shapes (or a named "
                   "shape's, e.g. qwen3-0.6b)",
    "max_num_seqs": "most sequences in one step (default: 256 on GPU, 32 on CPU)",
    "max_num_batched_tokens": "most tokens in one step (default: 8192 on GPU, 512 on CPU)",
    "block_size": "tokens per KV-cache block: 8, 16, 32, 64 or 128",
    "num_gpu_blocks_override": "KV-cache blocks to allocate, instead of sizing the pool from "
                               "--gpu-memory-utilization",
    "enable_prefix_caching": "reuse the KV blocks of a shared prompt prefix across requests",
    "preemption_mode": "what happens to a preempted sequence's KV: recompute it later, or swap it to host memory "
                       "(--swap-space)",
    "scheduling_policy": "fcfs, or priority (a request's priority field; lower runs first)",
    "tensor_parallel_size": "devices each layer's weights and KV heads are split over",
    "compilation_cache_dir": "JAX's persistent compilation cache and the saved step executables (default: "
                             "~/.cache/paged_jax/jax_cache; \"\" turns both off)",
    "weight_cache": "save the converted weights with orbax on the first start and restore them on later ones",
    "attention_impl": "paged attention implementation: auto, triton, mosaic (Hopper prefill) or reference (jnp)",
    "max_stop_strings": "most stop strings one request may give",
    "max_stop_string_len": "most characters in one stop string",
    "served_model_name": "model name(s) the API accepts; responses report the first (default: MODEL as given)",
    "seed": "seeds dummy weights and the sampling of requests that bring no seed of their own",
    "max_model_len": "model context length (default: the model's max_position_embeddings; 2048 at most on CPU)",
    "gpu_memory_utilization": "fraction of the device's total memory this engine uses (weights, activations, KV)",
    "swap_space": "GiB of host memory for swapped-out KV",
    "kv_offloading_size": "GiB of host memory for the prefix cache's host tier: blocks the device prefix cache "
                          "evicts keep their KV there, later prefix hits load it back instead of recomputing it "
                          "(default: off; one device, no sliding-window layers)",
    "kv_offloading_backend": "the host tier's implementation: native (vLLM's own CPU offloading; lmcache is not "
                             "supported)",
    "async_scheduling": "build and dispatch the next step while the current one runs on the device",
    "enable_chunked_prefill": "split long prompts over steps (on by default)",
    "enforce_eager": "accepted for vLLM compatibility: JAX compiles every step shape at start-up, no eager mode",
    "background_compilation": "serve once the smallest step shapes are compiled, compiling the others in the "
                              "background (steps capped at the largest ready meanwhile); default on "
                              "(--no-background-compilation or PAGED_JAX_BACKGROUND_COMPILATION=0: every step "
                              "executable compiled before serving)",
    "trust_remote_code": "accepted for vLLM compatibility: no remote code is run, architectures are built in",
    "disable_log_stats": "no periodic stats log line (serve)",
    "quantization": "quantized weights: the checkpoint's quantization_config by default; fp8 / int8 also quantize "
                    "an unquantized checkpoint at load; mxfp4: gpt-oss's published experts",
    "kv_cache_dtype": "KV cache element type: auto (the model dtype) or fp8 (e4m3, checkpoint k/v scales or 1.0)",
    "pipeline_parallel_size": "contiguous layer stages, each on its own tp devices",
    "data_parallel_size": "engine replicas (each pp * tp devices, its own scheduler and KV pool) behind a "
                          "prefix-aware router",
    "enable_expert_parallel": "mixture-of-experts models: split the experts over the tp devices (num_experts / tp "
                              "whole experts each) instead of each expert's width",
    "enable_return_routed_experts": "return each token's expert ids at every sparse layer (RL router replay; "
                                    "needs --no-enable-prefix-caching)",
    "enable_expert_load_metrics": "count the tokens routed to each expert of each layer (/metrics: "
                                  "vllm:moe_expert_tokens)",
    "nnodes": "hosts (processes) of one multi-host engine (jax.distributed)",
    "node_rank": "this host's rank; rank 0 schedules and serves, the others run the same steps",
    "master_addr": "address of node 0 (the jax.distributed coordinator)",
    "master_port": "port of the jax.distributed coordinator on node 0",
    "distributed_timeout_seconds": "multi-host: seconds a node may be silent before the others declare it dead and "
                                   "exit with status 1 (an exited node is noticed at once; default 10)",
    "enable_lora": "serve PEFT LoRA adapters (requests name one; serve: --lora-modules)",
    "max_loras": "most LoRA adapters in one batch (device slots)",
    "runner": "generate, or pooling (embeddings, classification, scores); auto: pooling for a checkpoint without "
              "an LM head (a *Model or *ForSequenceClassification)",
    "convert": "what the pooling runner does: embed or classify; auto: classify with a score head, else embed",
    "task": "vLLM's legacy spelling: embed / embedding (pooling, embed), classify / score (pooling, classify), "
            "generate",
    "max_lora_rank": "largest LoRA rank an adapter may have",
    "max_cpu_loras": "LoRA adapters kept in host memory (default: --max-loras)",
    "enable_sleep_mode": "allow sleep / wake_up (free the weights' and KV pool's device memory between rollouts)",
    "logprobs_mode": "logprobs reported: raw_logprobs / raw_logits of the model, or processed_logprobs / "
                     "processed_logits of the distribution sampled from (after penalties, temperature, top-k/p)",
    "speculative_config": "speculative decoding, as JSON: {\"method\": ngram, suffix, draft_model, eagle, eagle3 or "
                          "mtp, \"num_speculative_tokens\": k, ...} (vLLM's keys: model, prompt_lookup_min / _max, "
                          "suffix_decoding_*, disable_by_batch_size)",
    "weight_transfer_config": "weights from a trainer process, as JSON: {\"backend\": \"jax\"} (the engine is one "
                              "process of the trainer's jax.distributed job; vLLM's flag)",
    "batch_invariant": "a request's tokens and logprobs the same bits whatever else runs in its steps (fixed-tile "
                       "matmuls and attention; slower); VLLM_BATCH_INVARIANT=1 turns it on too",
}


def _engine_flag_type(field: dataclasses.Field) -> tuple[Any, list | None, str | None]:
    """(argparse converter, choices, nargs) of an ``EngineArgs`` field (its annotation is a string under __future__
    annotations). A ``list[X]`` member of the annotation makes a flag that takes one or more values."""
    hint = typing.get_type_hints(EngineArgs)[field.name]
    if typing.get_origin(hint) is typing.Literal:
        return str, list(typing.get_args(hint)), None
    args = [a for a in typing.get_args(hint) if a is not type(None)]  # X | None -> X
    lists = [a for a in args if typing.get_origin(a) is list]
    if lists:
        return typing.get_args(lists[0])[0], None, "+"
    base = args[0] if args else hint
    if typing.get_origin(base) is typing.Literal:
        return str, list(typing.get_args(base)), None
    return base, None, None


def add_engine_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add one flag per ``EngineArgs`` field to ``parser`` (``--max-model-len`` for ``max_model_len``; booleans
    get ``--flag`` / ``--no-flag``; list fields take several values, ``--served-model-name a b``); each flag's
    default is the field's. ``engine_kwargs`` reads them back."""
    for field in dataclasses.fields(EngineArgs):
        flags = ["--" + field.name.replace("_", "-"), *_FLAG_ALIASES.get(field.name, ())]
        converter, choices, nargs = _engine_flag_type(field)
        help_text = _FLAG_HELP.get(field.name)
        if converter is bool:
            parser.add_argument(*flags, dest=field.name, action=argparse.BooleanOptionalAction,
                                default=field.default, help=help_text)
        else:
            parser.add_argument(*flags, dest=field.name, type=converter, choices=choices, nargs=nargs,
                                default=field.default, help=help_text)


def normalize_flag_spelling(argv: Sequence[str]) -> list[str]:
    """``--max_model_len=8`` -> ``--max-model-len=8`` (vLLM accepts both spellings); values are untouched."""
    out = []
    for arg in argv:
        if arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            key, sep, value = arg.partition("=")
            arg = key.replace("_", "-") + sep + value
        out.append(arg)
    return out


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineArgs`` fields from flags added by ``add_engine_args``, as keyword arguments."""
    return {field.name: getattr(args, field.name) for field in dataclasses.fields(EngineArgs)}


def build_generate_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: an unknown (e.g. vLLM) flag must not be taken as a longer flag it happens to prefix.
    parser = argparse.ArgumentParser(prog="paged-jax generate", description="Offline generation with paged-jax.",
                                     allow_abbrev=False)
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn of the chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="SamplingParams.seed")
    add_engine_args(parser.add_argument_group("engine (EngineArgs, vLLM names)"))
    return parser


def generate_main(argv: Sequence[str]) -> int:
    """``paged-jax generate``: ``argv`` are the arguments after ``generate``."""
    from paged_jax.entrypoints.llm import LLM
    from paged_jax.sampling_params import SamplingParams

    parser = build_generate_parser()
    args = parser.parse_args(normalize_flag_spelling(argv))
    if args.node_rank > 0:  # multi-host: node 0 generates, this node runs the same steps
        from paged_jax.parallel.follower import run_follower

        return run_follower(EngineArgs(**engine_kwargs(args)))
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.sampling_seed)
        llm = LLM(**engine_kwargs(args))
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
        else:
            outputs = llm.generate(args.prompt, params)
    except ValueError as exc:
        parser.error(str(exc))
    for prompt, output in zip(args.prompt, outputs):
        completion = output.outputs[0]
        print(f"=== {prompt!r} -> ({completion.finish_reason})")
        print(completion.text)
    return 0


if __name__ == "__main__":
    sys.exit(generate_main(sys.argv[1:]))
