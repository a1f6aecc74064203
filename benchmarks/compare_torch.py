"""The same workload through PyTorch engines available on the machine, with the same dummy-weight shape.

Engines: HF transformers continuous batching (paged attention, ``init_continuous_batching``), HF plain
``generate`` with a static cache (static batches, left-padded), and vLLM / SGLang when importable.

  python -m benchmarks.compare_torch --shape qwen3-0.6b --workload nano-vllm --engines hf-cb --out $OUT/torch.json

Throughput counts only the requested output tokens (a static batch that runs past a short request's max_tokens
does the extra work without credit, as a user would see it).
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.report import write_json


def _hf_model(shape: str, dtype: str, attn: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from models.presets import PRESETS

    cfg_dict = dict(PRESETS[shape])
    model_type = cfg_dict.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **{k: v for k, v in cfg_dict.items() if k != "architectures"})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype), attn_implementation=attn)
    return model.to("cuda" if torch.cuda.is_available() else "cpu").eval()


def run_hf_continuous_batching(shape, workload, dtype="bfloat16") -> dict:
    import torch
    from transformers import GenerationConfig

    model = _hf_model(shape, dtype, "paged|sdpa")
    gen = GenerationConfig(do_sample=workload.temperature > 0, temperature=workload.temperature or None,
                           max_new_tokens=max(r.max_tokens for r in workload.requests), eos_token_id=None)
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    try:
        # Warm-up request, then the timed workload.
        manager.add_request([1, 2, 3, 4], request_id="warmup", max_new_tokens=4)
        while manager.get_result(request_id="warmup", timeout=60) is None:
            pass
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        t0 = time.perf_counter()
        for i, r in enumerate(workload.requests):
            manager.add_request(r.prompt_token_ids, request_id=f"r{i}", max_new_tokens=r.max_tokens)
        done, out_tokens = 0, 0
        while done < len(workload.requests):
            res = manager.get_result(timeout=5)
            if res is not None and res.is_finished():
                done += 1
                out_tokens += len(res.generated_tokens)
        elapsed = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
    return {"engine": "hf-continuous-batching (paged|sdpa)", "elapsed_s": elapsed, "output_tokens": out_tokens,
            "output_tok_s": out_tokens / elapsed}


def run_hf_static_generate(shape, workload, dtype="bfloat16", batch_size=64) -> dict:
    import torch

    model = _hf_model(shape, dtype, "sdpa")
    device = next(model.parameters()).device
    reqs = sorted(workload.requests, key=lambda r: len(r.prompt_token_ids))

    def run_batch(batch):
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(batch):  # left padding
            ids[j, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[j, width - len(r.prompt_token_ids):] = 1
        with torch.no_grad():
            model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                           max_new_tokens=max(r.max_tokens for r in batch), min_new_tokens=max(r.max_tokens for r in batch),
                           do_sample=workload.temperature > 0, temperature=workload.temperature or None,
                           cache_implementation="static", pad_token_id=0)

    run_batch(reqs[:2])  # warm-up
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        run_batch(reqs[i:i + batch_size])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    out_tokens = workload.output_tokens
    return {"engine": f"hf-generate static cache (batch {batch_size})", "elapsed_s": elapsed,
            "output_tokens": out_tokens, "output_tok_s": out_tokens / elapsed}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--workload", default="nano-vllm", choices=["nano-vllm", "vllm-default", "random"])
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--input-len", type=int)
    p.add_argument("--output-len", type=int)
    p.add_argument("--engines", default="hf-cb,hf-static", help="comma list of hf-cb, hf-static, vllm")
    p.add_argument("--out")
    args = p.parse_args(argv)

    from benchmarks.workloads import by_name

    workload = by_name(args.workload, num_prompts=args.num_prompts, input_len=args.input_len,
                       output_len=args.output_len)
    results = []
    for engine in args.engines.split(","):
        if engine == "hf-cb":
            results.append(run_hf_continuous_batching(args.shape, workload))
        elif engine == "hf-static":
            results.append(run_hf_static_generate(args.shape, workload))
        elif engine == "vllm":
            try:
                import vllm  # noqa: F401
            except ImportError:
                results.append({"engine": "vllm", "skipped": "not importable on this machine"})
                continue
            from vllm import LLM, SamplingParams

            llm = LLM(model=args.shape, load_format="dummy")
            sp = [SamplingParams(temperature=workload.temperature, ignore_eos=True, max_tokens=r.max_tokens)
                  for r in workload.requests]
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests], sp)
            elapsed = time.perf_counter() - t0
            results.append({"engine": "vllm", "elapsed_s": elapsed, "output_tokens": workload.output_tokens,
                            "output_tok_s": workload.output_tokens / elapsed})
        else:
            raise ValueError(f"unknown engine {engine!r}")
        print(json.dumps(results[-1]), flush=True)
    out = {"shape": args.shape, "workload": workload.name, "num_requests": len(workload.requests), "results": results}
    print("| engine | output tokens | seconds | output tok/s |\n|---|---|---|---|")
    for r in results:
        if "skipped" not in r:
            print(f"| {r['engine']} | {r['output_tokens']} | {r['elapsed_s']:.1f} | {r['output_tok_s']:.0f} |")
    write_json(args.out, out)


if __name__ == "__main__":
    main()
