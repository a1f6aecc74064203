"""What the engine's steps hold on a standard workload: the scheduler alone, no model (CPU, seconds).

Runs ``paged_jax.core.scheduler.Scheduler`` over a workload of ``benchmarks.workloads`` as the engine would (every step's
sampled token fed back at once, EOS ignored as the workloads prescribe) and reports the step mix: decode-only steps
(no prompt token in them), prefill-bearing steps, the buckets they pad to, and the bytes the decode-only steps must
read (weights once per step, plus each sequence's KV context). A throughput figure's floor counts compute and
memory over the whole run as if they overlapped; decode-only steps hold no prefill FLOP to overlap with, so this is
what a phase-by-phase bound needs (benchmarks/RESULTS.md, "vLLM default throughput workload").

    python -m benchmarks.schedule --workload vllm-default --shape llama-3.1-8b

One JSON line. The KV pool is sized so that no request is preempted (``--num-blocks``). The engine's own run may take a
few more steps (async scheduling's placeholders: 551 on the H200 against 542 here for vLLM's default workload); its
step mix on the GPU is not recorded.
"""

from __future__ import annotations

import argparse
import collections
import json
import types


def simulate(workload, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, num_blocks: int,
             block_size: int) -> list[tuple[int, int, int, int, tuple[int, int]]]:
    """Steps as ``(batched tokens, decode rows, prompt tokens, decode rows' KV tokens, bucket)``: a decode row is one
    whose new tokens are all past its prompt (a one-token last piece of a chunked prompt is prompt work); a row's KV
    tokens are its context after the step (the keys its attention reads); the bucket is the ``(tokens, seqs)`` shape
    the engine pads the step to."""
    from paged_jax.worker.buckets import make_buckets, pick_bucket
    from paged_jax.core.kv_cache_manager import KVCacheManager
    from paged_jax.core.request import Request
    from paged_jax.core.scheduler import Scheduler

    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=True)
    scheduler = Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=max_model_len)
    for i, req in enumerate(workload.requests):
        params = types.SimpleNamespace(max_tokens=req.max_tokens, min_tokens=0, ignore_eos=workload.ignore_eos,
                                       stop_token_ids=None)
        scheduler.add_request(Request(request_id=f"r{i}", prompt_token_ids=list(req.prompt_token_ids),
                                      params=params))
    buckets = make_buckets(max_num_batched_tokens, max_num_seqs)
    steps = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        if not (out.has_rows or out.swap_out or out.swap_in):
            raise RuntimeError("the scheduler made an empty step with requests left (KV pool too small?)")
        prompt_tokens, decode_rows, kv_tokens = 0, 0, 0
        for seq in out.scheduled_rows():
            end = seq.num_computed_tokens + seq.num_new_tokens
            in_prompt = max(0, min(end, len(seq.request.prompt_token_ids)) - seq.num_computed_tokens)
            prompt_tokens += in_prompt
            if in_prompt == 0 and seq.num_new_tokens:
                decode_rows += 1
                kv_tokens += end
        num_tokens = out.total_num_scheduled_tokens
        steps.append((num_tokens, decode_rows, prompt_tokens, kv_tokens,
                      pick_bucket(buckets, num_tokens, out.num_rows)))
        scheduler.update_from_output(out, [1] * out.num_rows)  # any token: EOS is ignored
    return steps


def summarize(steps, *, weight_bytes, kv_bytes_per_token: int, hbm_bytes_per_s: float) -> dict:
    """The step mix of ``simulate``'s ``steps``. ``weight_bytes(rows)``: the weight bytes a decode step of that many
    rows reads (int); ``kv_bytes_per_token``: KV bytes per token of context (all layers); ``hbm_bytes_per_s``: the
    bandwidth of ``decode_only_floor_s`` (the decode-only steps' bytes at that rate)."""
    decode_only = [s for s in steps if s[2] == 0]
    prefill = [s for s in steps if s[2] > 0]
    decode_bytes = sum(s[3] * kv_bytes_per_token + weight_bytes(s[1]) for s in decode_only)
    return {
        "steps": len(steps),
        "decode_only_steps": len(decode_only),
        "prefill_steps": len(prefill),
        "tokens": sum(s[0] for s in steps),
        "bucket_tokens": sum(s[4][0] for s in steps),
        "prefill_step_tokens": sum(s[0] for s in prefill),
        "prefill_step_bucket_tokens": sum(s[4][0] for s in prefill),
        "decode_only_rows": collections.Counter(s[1] for s in decode_only).most_common(3),
        "decode_only_mean_context": sum(s[3] for s in decode_only) / max(1, sum(s[1] for s in decode_only)),
        "decode_only_bytes": decode_bytes,
        "decode_only_floor_s": decode_bytes / hbm_bytes_per_s,
        "buckets": sorted(collections.Counter(str(list(s[4])) for s in steps).items()),
    }


def main(argv: list[str] | None = None) -> dict:
    from benchmarks.floors import H200_HBM_BYTES_PER_S, decode_weight_bytes
    from benchmarks.workloads import by_name
    from models.presets import kv_bytes_per_token, preset_config

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="vllm-default", choices=["nano-vllm", "vllm-default"])
    p.add_argument("--shape", default="llama-3.1-8b", help="named shape for the bytes (models/presets.py)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=60000)
    args = p.parse_args(argv)
    config = preset_config(args.shape)
    steps = simulate(by_name(args.workload), max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                     num_blocks=args.num_blocks, block_size=args.block_size)
    result = {"benchmark": "schedule", "workload": args.workload, "shape": args.shape,
              **summarize(steps, weight_bytes=lambda rows: decode_weight_bytes(config, rows, 2),
                          kv_bytes_per_token=kv_bytes_per_token(config, 2), hbm_bytes_per_s=H200_HBM_BYTES_PER_S)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
