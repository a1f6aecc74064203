"""Decode steps at a long context through the engine, against their memory floor.

``--batch`` requests of ``--context`` random prompt tokens each are prefilled (untimed), then the engine decodes
``--steps`` more tokens per request; each decode step (``LLMEngine.step``, every request one token) is timed and the
median reported beside the floor of one such step (``benchmarks.floors.decode_step_floor_s``: the weights a step
reads plus every row's K/V, a sliding-window layer's window only) at ``--hbm-gbps`` and at the copy rate measured in
the same run (``--ceilings``). A model with sliding-window layers runs with its KV-cache groups, so the pool holds
what the windows keep.

Example (GPU): ``python -m benchmarks.decode_context --shape gemma-3-12b --context 32768 --batch 1 --ceilings``;
``--attention-impl reference`` times the same steps on the jnp attention (e.g. DeepSeek-V2-Lite's latent cache
against the MLA kernel that ``auto`` runs).
CPU check: ``JAX_PLATFORMS=cpu python -m benchmarks.decode_context --tiny --context 96 --steps 4``. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

from benchmarks.floors import decode_step_floor_s, measure_ceilings_apart
from benchmarks.report import show_engine_logs
from models.presets import preset_config
from models.testing import tiny_config
from paged_jax.worker.attention_impl import ATTENTION_IMPLS


def _engine_model(args) -> tuple[str, object]:
    """(model argument for ``LLM``, its ``ModelConfig``): a named shape's config.json or a tiny Gemma 3 one."""
    from models.config import ModelConfig
    from models.presets import PRESETS

    hf_config = (tiny_config("gemma3", num_hidden_layers=6, sliding_window=16, sliding_window_pattern=3)
                 if args.tiny else PRESETS[args.shape.lower()])
    if not args.tiny:
        preset_config(args.shape)  # unknown names: the presets' error
    model_dir = tempfile.mkdtemp(prefix="paged_jax_decode_context_")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(hf_config, f)
    return model_dir, ModelConfig.from_hf_config(hf_config)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="gemma-3-12b", help="named shape with dummy weights (models/presets.py)")
    p.add_argument("--tiny", action="store_true", help="a 6-layer random Gemma 3 config (CPU check of the script)")
    p.add_argument("--context", type=int, default=32768, help="prompt tokens of each request")
    p.add_argument("--batch", type=int, default=1, help="requests decoding together")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--hbm-gbps", type=float, default=4300.0, help="bandwidth of the fixed floor")
    p.add_argument("--ceilings", action="store_true", help="also measure the copy rate in this run")
    p.add_argument("--attention-impl", default="auto", choices=ATTENTION_IMPLS,
                   help="the engine's attention_impl (e.g. reference against auto's kernels)")
    args = p.parse_args(argv)
    if args.context < 1 or args.batch < 1 or args.steps < 2:
        p.error("--context and --batch must be >= 1, --steps >= 2")

    from paged_jax import LLM, SamplingParams
    from paged_jax.worker.device_memory import reserve_gpu_memory_fraction

    show_engine_logs()
    reserve_gpu_memory_fraction(args.gpu_memory_utilization)
    ceilings = measure_ceilings_apart() if args.ceilings else None  # before this process's backend starts
    model_dir, config = _engine_model(args)
    max_model_len = args.context + args.steps + 8
    llm = LLM(model=model_dir, load_format="dummy", dtype="float32" if args.tiny else args.dtype,
              max_model_len=max_model_len, max_num_seqs=max(args.batch, 1),
              max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
              enable_prefix_caching=False, attention_impl=args.attention_impl, use_tqdm=False)
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 2, ignore_eos=True)
    for i in range(args.batch):
        prompt = rng.integers(3, min(config.vocab_size, 30000), size=args.context).tolist()
        engine.add_request(f"d{i}", {"prompt_token_ids": prompt}, params)
    start = time.perf_counter()
    while engine.stats()["num_waiting"] > 0 or engine.engine_core.scheduler.running[0].num_computed_tokens < args.context:
        engine.step()
    prefill_s = time.perf_counter() - start
    engine.step()  # the first step where every request decodes: its sampler variant is warm after it
    step_s = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - start)
    median_ms = float(np.median(step_s)) * 1e3
    dtype_bytes = 4 if args.tiny else 2
    floor_ms = decode_step_floor_s(config, args.batch, args.context, dtype_bytes, hbm=args.hbm_gbps * 1e9) * 1e3
    result = {"benchmark": "decode_context", "shape": "tiny" if args.tiny else args.shape, "context": args.context,
              "batch": args.batch, "steps": args.steps, "attention_impl": args.attention_impl,
              "decode_step_ms": round(median_ms, 3),
              "floor_ms": round(floor_ms, 3), "of_floor": round(floor_ms / median_ms, 3),
              "prefill_s": round(prefill_s, 2), "kv_groups": engine.engine_core.kv_cache_manager.num_groups,
              "num_compiles_since_warmup": engine.engine_core.runner.num_compiles_since_warmup}
    if ceilings is not None:
        same_run_floor = decode_step_floor_s(config, args.batch, args.context, dtype_bytes,
                                             hbm=ceilings["copy_GBps"] * 1e9) * 1e3
        result.update(ceilings=ceilings, floor_ms_at_copy_rate=round(same_run_floor, 3),
                      of_floor_at_copy_rate=round(same_run_floor / median_ms, 3))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
