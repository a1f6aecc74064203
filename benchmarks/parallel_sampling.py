"""Parallel sampling and beam search on copy-on-write blocks (paged_jax/engine/core.py, paged_jax/engine/beam_search.py).

Modes (one JSON line each):
  n         --num-prompts prompts, each one request with SamplingParams(n=N): the prompt is computed once and the N
            sequences fork from it, sharing its blocks;
  separate  the same N x num-prompts sequences as separate n=1 requests (same seeds: the same tokens), each
            computing its own prompt (prefix caching is off by default, so nothing is shared);
  beam      --beam-prompts prompts, LLM.beam_search with beam width --beam-width (EOS ignored: every beam runs
            --beam-output-len steps).
Each line has output tok/s (for beam: beam width x steps tokens per prompt), the prompt tokens actually computed,
the peak of KV blocks in use (sampled after every step) and the physical floor of the run (benchmarks/floors.py).

Examples (on the H200, dummy weights in real shapes):
  python -m benchmarks.parallel_sampling --shape llama-3.1-8b --out $OUT/parallel_sampling.json
  python -m benchmarks.parallel_sampling --shape qwen3-0.6b --num-prompts 64 --n 8 --input-len 2048
CPU smoke test: python -m benchmarks.parallel_sampling --shape smollm2-135m --num-prompts 2 --n 4 --input-len 40 \
  --output-len 8 --beam-prompts 2 --beam-output-len 4 --max-model-len 256 --max-num-seqs 16 \
  --max-num-batched-tokens 128 --num-gpu-blocks-override 400 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.report import versions, write_json


def _drive(engine, add_requests) -> tuple[float, int, int]:
    """Add the requests, step to the end; returns (seconds, peak KV blocks in use, tokens scheduled)."""
    kv = engine.engine_core.kv_cache_manager
    schedule = engine.engine_core.scheduler.schedule
    scheduled_tokens = 0

    def counting_schedule():
        nonlocal scheduled_tokens
        out = schedule()
        scheduled_tokens += out.total_num_scheduled_tokens
        return out

    engine.engine_core.scheduler.schedule = counting_schedule
    try:
        start = time.perf_counter()
        add_requests()
        peak = 0
        while engine.has_unfinished_requests():
            engine.step(finished_only=True)
            peak = max(peak, kv.num_usable_blocks - kv.num_free_blocks)
        return time.perf_counter() - start, peak, scheduled_tokens
    finally:
        engine.engine_core.scheduler.schedule = schedule


def _floor(config, *, prompt_tokens: int, num_seqs: int, input_len: int, output_len: int, max_num_seqs: int) -> dict:
    """The run's floor: every decode step reads the weights and each sequence its context; the computed prompt
    tokens and the generated ones cost 2 * params FLOPs each."""
    from benchmarks.floors import H200_BF16_FLOPS, H200_HBM_BYTES_PER_S
    from models.presets import kv_bytes_per_token, num_params

    steps = max(output_len, -(-num_seqs * output_len // max_num_seqs))
    kv_read = num_seqs * kv_bytes_per_token(config, 2) * (input_len * output_len + output_len * (output_len - 1) // 2)
    memory_s = (steps * num_params(config) * 2 + kv_read) / H200_HBM_BYTES_PER_S
    compute_s = 2 * num_params(config) * (prompt_tokens + num_seqs * output_len) / H200_BF16_FLOPS
    floor_s = max(memory_s, compute_s)
    return {"memory_floor_s": memory_s, "compute_floor_s": compute_s, "floor_s": floor_s,
            "floor_output_tok_s": num_seqs * output_len / floor_s}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF checkpoint directory")
    src.add_argument("--shape", help="named shape with dummy weights (models/presets.py)")
    p.add_argument("--modes", nargs="+", default=["n", "separate", "beam"], choices=["n", "separate", "beam"])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--beam-prompts", type=int, default=32)
    p.add_argument("--beam-width", type=int, default=4)
    p.add_argument("--beam-output-len", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-gpu-blocks-override", type=int, help="KV pool size in blocks (default: from memory)")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="let separate requests share their prompts through the prefix cache too")
    p.add_argument("--out", help="write the JSON lines' list here")
    args = p.parse_args(argv)

    from benchmarks.workloads import random_fixed
    from models.config import ModelConfig
    from models.presets import preset_config
    from paged_jax import LLM, SamplingParams
    from paged_jax.sampling_params import BeamSearchParams
    from paged_jax.core.request import child_seed

    llm = LLM(model=args.model or args.shape, load_format="dummy" if args.shape else "auto", dtype=args.dtype,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
              num_gpu_blocks_override=args.num_gpu_blocks_override,
              enable_prefix_caching=args.enable_prefix_caching, use_tqdm=False)
    engine = llm.llm_engine
    config = preset_config(args.shape) if args.shape else ModelConfig.from_pretrained(args.model)
    vocab = min(config.vocab_size, 10000)
    prompts = [r.prompt_token_ids for r in random_fixed(args.num_prompts, args.input_len, 1, vocab=vocab).requests]
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(n=2, max_tokens=4), use_tqdm=False)  # warm
    common = {"versions": versions(), "shape": args.shape or args.model, "num_usable_blocks":
              engine.engine_core.kv_cache_manager.num_usable_blocks, "block_size": engine.engine_core.kv_cache_manager.block_size,
              "prefix_caching": args.enable_prefix_caching}
    results = []
    num_seqs = args.n * args.num_prompts
    for mode in args.modes:
        if mode == "beam":
            beam_prompts = [r.prompt_token_ids for r in
                            random_fixed(args.beam_prompts, args.input_len, 1, seed=1, vocab=vocab).requests]
            params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.beam_output_len, ignore_eos=True)

            def add_beams():
                for i, prompt in enumerate(beam_prompts):
                    engine.add_request(f"beam-{i}", prompt, params)

            elapsed, peak, scheduled = _drive(engine, add_beams)
            out_tokens = args.beam_prompts * args.beam_width * args.beam_output_len
            result = {"mode": "beam", "beam_width": args.beam_width, "num_prompts": args.beam_prompts,
                      "input_len": args.input_len, "output_len": args.beam_output_len,
                      "prompt_tokens_computed": scheduled - (out_tokens - args.beam_prompts * args.beam_width),
                      "floor": _floor(config, prompt_tokens=args.beam_prompts * args.input_len,
                                      num_seqs=args.beam_prompts * args.beam_width, input_len=args.input_len,
                                      output_len=args.beam_output_len, max_num_seqs=args.max_num_seqs)}
        else:
            def add_requests(mode=mode):
                for i, prompt in enumerate(prompts):
                    if mode == "n":
                        engine.add_request(f"n-{i}", prompt, SamplingParams(
                            n=args.n, temperature=1.0, seed=i, max_tokens=args.output_len, ignore_eos=True))
                        continue
                    for j in range(args.n):
                        engine.add_request(f"sep-{i}-{j}", prompt, SamplingParams(
                            temperature=1.0, seed=child_seed(i, j), max_tokens=args.output_len, ignore_eos=True))

            elapsed, peak, scheduled = _drive(engine, add_requests)
            out_tokens = num_seqs * args.output_len
            computed = scheduled - num_seqs * (args.output_len - 1)  # every output token but the last is fed back
            result = {"mode": mode, "n": args.n, "num_prompts": args.num_prompts, "input_len": args.input_len,
                      "output_len": args.output_len, "prompt_tokens_computed": computed,
                      "floor": _floor(config, prompt_tokens=computed, num_seqs=num_seqs, input_len=args.input_len,
                                      output_len=args.output_len, max_num_seqs=args.max_num_seqs)}
        result.update({"elapsed_s": elapsed, "output_tokens": out_tokens, "output_tok_s": out_tokens / elapsed,
                       "peak_kv_blocks": peak, "fraction_of_floor": result["floor"]["floor_s"] / elapsed,
                       "num_preemptions": engine.stats()["num_preemptions"], **common})
        print(json.dumps(result))
        results.append(result)
    write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
