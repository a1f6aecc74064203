"""Offline throughput of the paged-jax engine on the standard workloads (benchmarks/workloads.py).

Examples (on the H200, dummy weights in real shapes):
  python -m benchmarks.throughput --shape qwen3-0.6b --workload nano-vllm --out $OUT/nanovllm.json
  python -m benchmarks.throughput --shape llama-3.1-8b --workload vllm-default
  python -m benchmarks.throughput --model /path/to/hf_dir --workload random --input-len 512 --output-len 128
  python -m benchmarks.throughput --shape llama-3.1-8b --workload random --num-prompts 256 --input-len 128 \
      --output-len 128 --temperature 0 --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'

Prints one JSON object: requests/s, total and output tok/s, wall time, and the fraction of the physical floor
(benchmarks/floors.py). Compilation stays out of the timed region: the engine compiles every bucket at start-up,
and a short warm-up generate runs before the clock starts.
"""

from __future__ import annotations

import time

_T_PROCESS_START = time.perf_counter()  # before jax is imported: start-up time counts from here

import argparse
import contextlib
import dataclasses
import json
import random
import sys

from benchmarks.report import show_engine_logs, speculation_stats, versions, write_json


# The quantization_config of a typical Hub checkpoint per checkpoint-only method (4-bit, group 128), for dummy weights
# in a named shape: the loader quantizes random weights into that method's layout.
CHECKPOINT_QUANTIZATION_CONFIGS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False},
}


def _quantized_shape_dir(shape: str, method: str) -> str:
    """A directory holding only the config.json of ``shape`` quantized with ``method`` (for ``load_format=dummy``)."""
    import tempfile

    from models.presets import PRESETS

    directory = tempfile.mkdtemp(prefix=f"paged_jax_{shape}_{method}_")
    hf_config = {**PRESETS[shape.lower()], "quantization_config": CHECKPOINT_QUANTIZATION_CONFIGS[method]}
    with open(f"{directory}/config.json", "w") as f:
        json.dump(hf_config, f)
    return directory


def startup_breakdown(engine) -> dict:
    """Where the start went: ``LLMEngine.startup_timings`` and the runner's warm-up timings (``compile_jobs``: a
    cold start's compile timeline); empty for engines without them (data parallel)."""
    timings = getattr(engine, "startup_timings", None)
    warm_up = getattr(getattr(engine, "runner", None), "warm_up_timings", None)
    return {"startup_stages": timings, "warm_up": warm_up} if timings is not None else {}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF checkpoint directory")
    src.add_argument("--shape", help="named shape with dummy weights (models/presets.py)")
    p.add_argument("--workload", default="nano-vllm", choices=["nano-vllm", "vllm-default", "random"])
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--input-len", type=int)
    p.add_argument("--output-len", type=int)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--load-format", help="default: dummy with --shape, auto with --model")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the engine's (256 on GPU, 32 on CPU)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="default: the engine's (8192 on GPU, 512 on CPU)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--no-enable-prefix-caching", action="store_true")
    p.add_argument("--long-prefill-token-threshold", type=int,
                   help="the scheduler's (default: the engine's, 4%% of max_model_len; 0: running requests first)")
    p.add_argument("--attention-impl", default="auto")
    p.add_argument("--async-scheduling", action="store_true",
                   help="vLLM's --async-scheduling: build and dispatch step k+1 while step k runs on the device")
    p.add_argument("--speculative-config", metavar="JSON",
                   help="vLLM's --speculative-config, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' "
                        "(EngineArgs.speculative_config); the result then has the timed run's draft counters and mean "
                        "acceptance length")
    p.add_argument("--batch-invariant", action="store_true",
                   help="the engine's batch-invariant mode (fixed-tile matmuls and attention; VLLM_BATCH_INVARIANT=1)")
    p.add_argument("--startup-only", action="store_true",
                   help="only measure process start -> first token (run twice: cold, then warm compile cache)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time the phases of every step (device wait, schedule, packing + dispatch, update); "
                        "adds a few microseconds per step")
    p.add_argument("--max-concurrency", type=int,
                   help="keep at most this many requests in the engine (a new one enters as one finishes), as a "
                        "server at that many concurrent streams would see them; default: all at once")
    p.add_argument("--temperature", type=float,
                   help="override the workload's sampling temperature (0 = greedy, as benchmarks/generate.py)")
    p.add_argument("--top-k", type=int, default=0,
                   help="every request's top_k (0 = off; 20 with --top-p 0.95 is Qwen3's generation config)")
    p.add_argument("--top-p", type=float, default=1.0, help="every request's top_p (1 = off)")
    p.add_argument("--ceilings", action="store_true",
                   help="also measure the device's copy bandwidth and matmul rate in this run (benchmarks/floors.py "
                        "measure_ceilings) and state the result against the floor at those ceilings")
    p.add_argument("--quantization", help="awq | gptq | compressed-tensors | fp8 | int8 (fp8 / int8 quantize dummy "
                                          "or bf16 weights at load)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    p.add_argument("-dp", "--data-parallel-size", type=int, default=1,
                   help="engine replicas behind the prefix-aware router (paged_jax.parallel.data_parallel)")
    p.add_argument("--trace", type=int, metavar="TOP", default=0,
                   help="trace the timed run with jax.profiler and report GPU busy time and the TOP kernels by time "
                        "(the profiler slows the host: a diagnostic run, not a throughput figure)")
    p.add_argument("--trace-dir", help="with --trace: keep the raw profile in this directory (TensorBoard / XProf) "
                                       "rather than a temporary one")
    p.add_argument("--out", help="write the JSON result here")
    args = p.parse_args(argv)
    if args.trace_dir and not args.trace:
        p.error("--trace-dir keeps the profile of --trace TOP: give --trace too")
    if args.breakdown and args.data_parallel_size > 1:
        p.error("--breakdown times one engine's steps; it does not combine with --data-parallel-size > 1")

    from benchmarks.floors import measure_ceilings_apart, workload_floor
    from benchmarks.workloads import by_name
    from models.config import ModelConfig
    from models.presets import preset_config
    from paged_jax import LLM, SamplingParams
    from paged_jax.worker.device_memory import reserve_gpu_memory_fraction

    # Before the engine, in a child process: the ceilings' buffers neither compete with the KV pool nor split the
    # memory it is allocated from.
    show_engine_logs()
    reserve_gpu_memory_fraction(args.gpu_memory_utilization)
    ceilings_start = time.perf_counter()
    ceilings = measure_ceilings_apart() if args.ceilings else None
    ceilings_s = time.perf_counter() - ceilings_start  # not start-up: taken out of startup_to_first_token_s
    load_format = args.load_format or ("dummy" if args.shape else "auto")
    model = args.model or args.shape
    if args.shape and args.quantization in CHECKPOINT_QUANTIZATION_CONFIGS:
        model = _quantized_shape_dir(args.shape, args.quantization)
    llm = LLM(model=model, load_format=load_format, dtype=args.dtype,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, block_size=args.block_size,
              gpu_memory_utilization=args.gpu_memory_utilization,
              enable_prefix_caching=not args.no_enable_prefix_caching, attention_impl=args.attention_impl,
              long_prefill_token_threshold=args.long_prefill_token_threshold,
              async_scheduling=args.async_scheduling, quantization=args.quantization,
              batch_invariant=args.batch_invariant, kv_cache_dtype=args.kv_cache_dtype,
              speculative_config=args.speculative_config,
              tensor_parallel_size=args.tensor_parallel_size,
              pipeline_parallel_size=args.pipeline_parallel_size, data_parallel_size=args.data_parallel_size)
    first = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=1), use_tqdm=False)
    t_first_token = time.perf_counter() - _T_PROCESS_START - ceilings_s
    assert len(first[0].outputs[0].token_ids) == 1
    result: dict = {"startup_to_first_token_s": t_first_token, "versions": versions(),
                    "argv": sys.argv[1:] if argv is None else argv, **startup_breakdown(llm.llm_engine)}
    if args.startup_only:
        print(json.dumps(result, indent=1))
        write_json(args.out, result)
        return result

    workload = by_name(args.workload, num_prompts=args.num_prompts, input_len=args.input_len,
                       output_len=args.output_len)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests]
    if args.temperature is not None:
        workload = dataclasses.replace(workload, temperature=args.temperature)
    truncation = dict(top_k=args.top_k, top_p=args.top_p)
    params = [SamplingParams(temperature=workload.temperature, ignore_eos=workload.ignore_eos, max_tokens=r.max_tokens,
                             seed=i, **truncation) for i, r in enumerate(workload.requests)]
    # Warm-up on a few fresh random prompts of the workload's lengths (never its own prompts) so lazily created host
    # state is in place; then the prefix cache is emptied so the warm-up cannot serve the timed run.
    warm_rng = random.Random(12345)
    warm_prompts = [{"prompt_token_ids": [warm_rng.randint(0, 10000) for _ in r.prompt_token_ids]}
                    for r in workload.requests[:4]]
    llm.generate(warm_prompts, [SamplingParams(temperature=workload.temperature, ignore_eos=True, max_tokens=8,
                                               **truncation)]
                 * len(warm_prompts), use_tqdm=False)
    llm.reset_prefix_cache()
    stats_before = llm.llm_engine.stats()

    totals = None
    if args.breakdown:
        from benchmarks.host_overhead import instrument_phases

        engine = llm.llm_engine
        totals = {}
        instrument_phases(engine, totals)
        bucket_counts: dict[str, int] = {}
        runner = engine.engine_core.runner
        timed_run_forward = runner.run_forward

        # Wrapping the runner's method, not its compiled forward, keeps the compile counters (which read the
        # forward's executable tables) untouched.
        def counting_run_forward(buf, num_tokens, num_seqs):
            key = f"{num_tokens}x{num_seqs}"
            bucket_counts[key] = bucket_counts.get(key, 0) + 1
            return timed_run_forward(buf, num_tokens, num_seqs)

        runner.run_forward = counting_run_forward
    steps_before = stats_before.get("num_steps", 0)

    from benchmarks.trace import kernel_trace

    with kernel_trace(1, args.trace, args.trace_dir) if args.trace else contextlib.nullcontext() as trace:
        t0 = time.perf_counter()
        if args.max_concurrency:
            out_tokens = _run_with_concurrency(llm.llm_engine, prompts, params, args.max_concurrency)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        elapsed = time.perf_counter() - t0
    if trace is not None:
        # Busy = the sum of kernel durations over the run (all devices' lines): 1 - busy / (wall x devices) is the
        # time the GPUs sat idle. Figures of a traced run are diagnostic: the profiler slows the host.
        devices = args.data_parallel_size * args.pipeline_parallel_size * args.tensor_parallel_size
        result["trace"] = {**trace, "diagnostic_run_under_profiler": True,
                           "gpu_busy_fraction": trace.get("busy_us_per_step", 0) / 1e6 / elapsed / devices}
    if totals is not None:
        # Seconds over the whole timed run; "other" is per-token bookkeeping, detokenization and outputs.
        breakdown = {f"{key}_s": round(value, 3) for key, value in totals.items()}
        if args.async_scheduling:
            # The dispatch ran on the runner's worker thread, overlapping the main thread's phases: not a part of
            # "execute" (which is then the main thread's packing and hand-over alone).
            breakdown["dispatch_on_worker_thread"] = True
        else:
            breakdown["packing_s"] = round(totals["execute"] - totals["dispatch"], 3)
        breakdown["other_s"] = round(elapsed - totals["wait"] - totals["schedule"] - totals["execute"]
                                     - totals["update"], 3)
        breakdown["steps"] = llm.llm_engine.stats().get("num_steps", 0) - steps_before
        breakdown["steps_per_bucket"] = dict(sorted(bucket_counts.items(), key=lambda kv: -kv[1]))
        result["breakdown"] = breakdown

    assert out_tokens == workload.output_tokens, (out_tokens, workload.output_tokens)
    config = llm.llm_engine.engine_core.model_config if args.model else preset_config(args.shape)
    if not isinstance(config, ModelConfig):
        config = ModelConfig.from_pretrained(args.model)
    # Bytes per weight / KV element of the floor: fp8 and int8 weights 1, 4-bit weights 0.5 (their scales and the
    # bf16 LM head charged at that width too: a lower bound), the fp8 KV cache 1.
    weight_bytes = {"fp8": 1, "int8": 1, "compressed-tensors": 1, "awq": 0.5, "gptq": 0.5}.get(args.quantization, 2)
    max_num_seqs = args.max_num_seqs or llm.llm_engine.max_num_seqs  # the flag, else the engine's platform default
    floor = workload_floor(config, workload, max_num_seqs, dtype_bytes=weight_bytes,
                           kv_dtype_bytes=1 if args.kv_cache_dtype != "auto" else 2)
    result.update({"quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype})
    stats = llm.llm_engine.stats()
    if ceilings is not None:
        # The same workload against the ceilings of this run instead of the fixed H200 figures.
        same_run = workload_floor(config, workload, max_num_seqs, dtype_bytes=weight_bytes,
                                  kv_dtype_bytes=1 if args.kv_cache_dtype != "auto" else 2,
                                  hbm=ceilings["copy_GBps"] * 1e9, flops=ceilings["matmul_TFLOPs"] * 1e12)
        result["same_run_ceilings"] = ceilings
        result["fraction_of_same_run_floor"] = same_run["floor_s"] / elapsed
    result.update({
        "workload": workload.name, "num_requests": len(workload.requests),
        "prompt_tokens": workload.prompt_tokens, "output_tokens": out_tokens, "elapsed_s": elapsed,
        "requests_per_s": len(workload.requests) / elapsed,
        "total_tok_s": (workload.prompt_tokens + out_tokens) / elapsed,
        "output_tok_s": out_tokens / elapsed,
        "sampling": {"temperature": workload.temperature, **truncation},
        "floor": floor, "fraction_of_floor": floor["floor_s"] / elapsed, "max_concurrency": args.max_concurrency,
        # The floor is one device's; with dp / pp / tp this many devices share the work.
        "devices_used": args.data_parallel_size * args.pipeline_parallel_size * args.tensor_parallel_size,
        "engine_stats": {k: v for k, v in stats.items() if isinstance(v, (int, float))},
        # Prefix-cache hits inside the timed region only (the warm-up's entries were reset before it).
        "timed_prefix_cache_hit_tokens": stats["prefix_cache_hits"] - stats_before["prefix_cache_hits"],
        "speculative_decoding": speculation_stats(stats, stats_before) if args.speculative_config else None,
    })
    print(json.dumps(result, indent=1))
    write_json(args.out, result)
    return result


def _run_with_concurrency(engine, prompts: list, params: list, max_concurrency: int) -> int:
    """Drive ``engine`` with at most ``max_concurrency`` requests in it; returns the output tokens generated."""
    next_index = in_engine = out_tokens = 0
    while next_index < len(prompts) or engine.has_unfinished_requests():
        while next_index < len(prompts) and in_engine < max_concurrency:
            engine.add_request(f"c{next_index}", prompts[next_index], params[next_index])
            next_index += 1
            in_engine += 1
        for output in engine.step(finished_only=True):
            if output.finished:
                in_engine -= 1
                out_tokens += len(output.outputs[0].token_ids)
    return out_tokens


if __name__ == "__main__":
    main()
