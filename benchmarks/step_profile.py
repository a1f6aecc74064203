"""Where the time of one engine step goes, on the device (issue 8).

Builds the model runner for a named shape with dummy weights and a few fixed buckets, then times, for decode batches
(every sequence at the same context) and prefill batches:

* ``step_ms``: one synchronous step, ``execute(...).result()`` (host packing + dispatch + device + fetch), median.
  The rows are made once (their ``NewRequestData``); each timed call runs the same step again, its diff carrying
  nothing new (the rows already hold their tokens and blocks), where an engine's decode diff appends one token per
  row (one numpy scatter more).
* ``pipelined_ms``: ``--inner`` steps dispatched back to back, one wait at the end, per step: what the device needs
  per step when host work overlaps it.
* ``execute_ms``: the host side of ``execute`` alone (packing + the two dispatches), median over those calls.
* ``forward_ms`` / ``sample_ms``: the jitted forward and the jitted sampler alone, each called ``--inner`` times on the
  same inputs with one wait at the end.
* ``floor_ms``: the weight bytes a step must read (benchmarks/floors.py) + KV bytes read, at ``--hbm-gbps``.

Then the sampler alone on random logits [rows, vocab] for each compiled variant (and lax.top_k / Gumbel noise / argmax
on their own), and the compiled forward's memory analysis (a temp size near the pool size would mean the donated
pool is copied instead of updated in place).

Example (on the H200): ``python -m benchmarks.step_profile --shape qwen3-0.6b --out $OUT/step_qwen.json``;
``python -m benchmarks.step_profile --shape llama-3.1-8b --decode 1x1024,32x1024 --prefill '' --out ...``.
On CPU ``--tiny`` uses a 2-layer random config (for checking the script, not for figures).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from benchmarks.report import median_seconds, write_json


def _median_ms(fn, repeats: int) -> float:
    """Median milliseconds of ``fn()`` (which waits for its own results) over ``repeats`` calls, none untimed."""
    return median_seconds(fn, repeats, warmup=0) * 1e3


def _parse_cases(text: str) -> list[tuple[int, int]]:
    """'256x1024,1x2048' -> [(256, 1024), (1, 2048)] (batch x length)."""
    return [tuple(int(v) for v in item.lower().split("x")) for item in filter(None, text.split(","))]


def main(argv: list[str] | None = None) -> dict:
    from models.norm import RMS_NORM_IMPLS
    from paged_jax.ops.qk_prepare import QK_PREPARE_IMPLS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-0.6b", help="named shape (models/presets.py)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer random config instead (CPU check of the script)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--decode", default="256x1024,256x128,64x1024,1x1024",
                   help="decode cases BATCHxCONTEXT (one new token per sequence after CONTEXT cached tokens)")
    p.add_argument("--prefill", default="1x2048,8x256", help="prefill cases SEQSxPROMPT_LEN (from an empty cache)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.6, help="sampling temperature of every row (0 = greedy)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--inner", type=int, default=10, help="back-to-back calls per pipelined measurement")
    p.add_argument("--hbm-gbps", type=float, default=4300.0,
                   help="bandwidth of the floor (the H200 figure of benchmarks/floors.py)")
    p.add_argument("--attention-impl", default="auto")
    p.add_argument("--rms-norm-impl", default="auto", choices=RMS_NORM_IMPLS,
                   help="the decoder norms (residual add fused in): models.norm.RMS_NORM_IMPLS; 'xla' = XLA's fusions "
                        "of the jnp form, 'pallas' = paged_jax.ops.rms_norm's kernel ('auto': that on a GPU)")
    p.add_argument("--qk-prepare-impl", default="auto", choices=QK_PREPARE_IMPLS,
                   help="q/k norm + RoPE + KV write: paged_jax.ops.qk_prepare ('pallas' = one kernel per layer, "
                        "'xla' = XLA's fusions of the jnp form, 'auto': the kernel on a GPU)")
    p.add_argument("--no-fuse-projections", action="store_true",
                   help="keep q/k/v and gate/up as separate matmuls (the HF layout) instead of the engine's fused one")
    p.add_argument("--exact-decode-buckets", action="store_true",
                   help="compile each decode case at its own size (batch B -> bucket (B, B)) instead of the engine's "
                        "default buckets (smallest: 16 tokens x 8 seqs, then 16 x 16); shows what bucket padding costs")
    p.add_argument("--trace", action="store_true",
                   help="also profile the forward (jax.profiler) and print GPU kernel time per step by kernel name")
    p.add_argument("--trace-top", type=int, default=25, help="kernel names listed with --trace")
    p.add_argument("--out")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from models.config import ModelConfig
    from models.loader import init_dummy_model
    from benchmarks.floors import decode_weight_bytes, kv_read_bytes
    from models.presets import preset_config
    from paged_jax.worker import sampler as sampler_lib
    from paged_jax.worker.top_k import TOP_K_CANDIDATES, vocab_top_k
    from benchmarks.trace import trace_kernels
    from paged_jax.worker.buckets import make_buckets, pick_bucket
    from paged_jax.worker.model_runner import ModelRunner
    from paged_jax.core.hand_steps import HandScheduler
    from paged_jax.sampling_params import SamplingParams

    if args.tiny:
        from models.testing import tiny_config
        config = ModelConfig.from_hf_config(tiny_config("Qwen3ForCausalLM", vocab_size=1024, num_hidden_layers=2))
    else:
        config = preset_config(args.shape)
    dtype = jnp.dtype(args.dtype)
    decode_cases, prefill_cases = _parse_cases(args.decode), _parse_cases(args.prefill)
    bs = args.block_size
    blocks_needed = 1
    for batch, length in decode_cases + prefill_cases:
        blocks_needed = max(blocks_needed, batch * -(-(length + 1) // bs))
    num_blocks = blocks_needed + 1

    model = init_dummy_model(config, dtype=dtype, seed=0)
    import paged_jax.ops  # noqa: F401  (registers rms_norm_impl "pallas")
    from models.llama import set_rms_norm_impl

    set_rms_norm_impl(model, args.rms_norm_impl)
    if not args.no_fuse_projections:  # as the engine runs it
        from models.llama import fuse_projections

        fuse_projections(model)
    all_buckets = make_buckets(args.max_num_batched_tokens, args.max_num_seqs)

    def bucket_for(tokens, seqs):
        return next(b for b in all_buckets if b[0] >= tokens and b[1] >= seqs)

    decode_bucket = (lambda b: (b, b)) if args.exact_decode_buckets else (lambda b: bucket_for(b, b))
    buckets = sorted({decode_bucket(b) for b, _ in decode_cases} | {bucket_for(b * n, b) for b, n in prefill_cases})
    runner = ModelRunner(model, config, num_blocks=num_blocks, block_size=bs, max_model_len=args.max_model_len,
                         max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                         buckets=buckets, attention_impl=args.attention_impl, qk_prepare_impl=args.qk_prepare_impl)
    t0 = time.perf_counter()
    runner.warm_up(use_tqdm=False)
    result: dict = {"benchmark": "step_profile", "shape": "tiny" if args.tiny else args.shape, "dtype": args.dtype,
                    "device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "buckets": buckets,
                    "warm_up_s": round(time.perf_counter() - t0, 2), "num_blocks": num_blocks,
                    "hbm_gbps_for_floor": args.hbm_gbps,
                    "fused_projections": not args.no_fuse_projections, "rms_norm_impl": args.rms_norm_impl,
                    "qk_prepare_impl": args.qk_prepare_impl, "cases": []}
    print(json.dumps({k: v for k, v in result.items() if k != "cases"}), flush=True)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=1 << 20)

    hand = HandScheduler()

    def step_for(batch, new_tokens, context):
        """The step of ``batch`` rows each computing ``new_tokens`` tokens after ``context`` cached ones (and
        sampling), run once to make the rows; returned as the same step again, a diff with nothing new, which each
        ``execute`` of it runs once more (the rows of the previous case leave the batch)."""
        for req_id in list(hand.requests):
            hand.finish(req_id)
        nb = -(-(context + new_tokens) // bs)
        for i in range(batch):
            hand.add(f"s{i}", rng.integers(0, min(config.vocab_size, 10000), context + new_tokens).tolist(),
                     list(range(1 + i * nb, 1 + (i + 1) * nb)), params=params, seed=i, num_computed_tokens=context)
        plan = {f"s{i}": new_tokens for i in range(batch)}
        runner.execute(hand.step(plan)).result()
        return hand.step(plan)  # not updated: the same rows, tokens and blocks again

    def time_case(kind, batch, new_tokens, context):
        step = step_for(batch, new_tokens, context)
        runner.execute(step).result()  # first call of this layout: host caches
        step_ms = _median_ms(lambda: runner.execute(step).result(), args.repeats)
        exec_times, pipelined = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            pending = None
            for _ in range(args.inner):
                t = time.perf_counter()
                pending = runner.execute(step)
                exec_times.append(time.perf_counter() - t)
            pending.result()
            pipelined.append((time.perf_counter() - start) / args.inner)

        # The jitted pieces alone: rebuild the exact inputs execute() sends by capturing them once.
        captured = {}
        original_forward, original_sample = runner._forward, runner._sample

        def capture_forward(*a, **kw):
            captured["forward"] = (a, kw)
            out = original_forward(*a, **kw)
            captured["forward_out"] = out
            return out

        def capture_sample(*a, **kw):
            captured["sample"] = (a, kw)
            return original_sample(*a, **kw)

        runner._forward, runner._sample = capture_forward, capture_sample
        try:
            runner.execute(step).result()
        finally:
            runner._forward, runner._sample = original_forward, original_sample
        (f_params, _, f_buf, f_prev, f_lora), f_kw = captured["forward"]

        def forward_loop():
            out = None
            for _ in range(args.inner):
                runner.kv_pool, logits, words, _ = original_forward(f_params, runner.kv_pool, f_buf, f_prev, f_lora,
                                                                    **f_kw)
                out = logits
            jax.block_until_ready(out)

        forward_ms = _median_ms(forward_loop, args.repeats) / args.inner
        kernels = trace_kernels(forward_loop, args.inner, args.trace_top) if args.trace else None
        s_args, s_kw = captured["sample"]

        def sample_loop():
            out = None
            for _ in range(args.inner):
                out = original_sample(*s_args, **s_kw)
            jax.block_until_ready(out)

        sample_ms = _median_ms(sample_loop, args.repeats) / args.inner
        # Each row reads its cached tokens' K/V once (a sliding-window layer only its window's).
        kv_read = batch * kv_read_bytes(config, context + new_tokens, 1, dtype.itemsize)
        weight_bytes = decode_weight_bytes(config, batch * new_tokens, dtype.itemsize)
        floor_ms = (weight_bytes + kv_read) / (args.hbm_gbps * 1e9) * 1e3
        row = {"kind": kind, "batch": batch, "new_tokens_per_seq": new_tokens, "context": context,
               "bucket": list(pick_bucket(buckets, batch * new_tokens, batch)), "sampler_mode": s_kw.get("mode"),
               "num_logprobs": s_kw.get("num_logprobs"),
               "step_ms": round(step_ms, 3), "pipelined_ms": round(float(np.median(pipelined)) * 1e3, 3),
               "execute_ms": round(float(np.median(exec_times)) * 1e3, 3),
               "forward_ms": round(forward_ms, 3), "sample_ms": round(sample_ms, 3),
               "floor_ms": round(floor_ms, 3), "weight_bytes_read": weight_bytes, "kv_bytes_read": kv_read,
               "tokens_per_s_pipelined": round(batch * new_tokens / (float(np.median(pipelined)) or 1e-9), 1)}
        if kernels is not None:
            row["forward_kernels"] = kernels
        result["cases"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "forward_kernels"}), flush=True)
        if kernels is not None:
            print(json.dumps({"kind": kind, "batch": batch, **{k: v for k, v in kernels.items() if k != "top"}}))
            for entry in kernels["top"]:
                print(f"    {entry['us_per_step']:8.1f} us/step  x{entry['count_per_step']:<5g} {entry['name'][:110]}")

    for batch, context in decode_cases:
        time_case("decode", batch, 1, context)
    for batch, length in prefill_cases:
        time_case("prefill", batch, length, 0)

    # Memory analysis of the largest forward: is the donated pool updated in place?
    try:
        num_tokens, num_seqs = buckets[-1]
        layout = runner.layout(num_tokens, num_seqs)
        buf = jax.device_put(np.zeros((layout.size,), np.int32), runner.device)
        compiled = runner._forward.lower(runner._param_leaves, runner.kv_pool, buf, runner._prev_tokens,
                                         num_tokens=num_tokens, num_seqs=num_seqs).compile()
        mem = compiled.memory_analysis()
        pool_bytes = sum(k.nbytes + v.nbytes for k, v in runner.kv_pool)
        # What the step launches: top-level ops of the optimized entry computation (each a kernel launch or a
        # command buffer, i.e. a CUDA graph, holding several).
        text = compiled.as_text() or ""
        entry = text[text.rfind("ENTRY"):]
        result["forward_hlo"] = {
            "entry_fusions": entry.count(" fusion("), "entry_custom_calls": entry.count(" custom-call("),
            "entry_command_buffers": entry.count("command_buffer"), "entry_instructions": entry.count("\n"),
            "all_custom_calls": text.count(" custom-call("), "all_fusions": text.count(" fusion("),
            # XLA's dot merger turns dots that share an input into one dot over concatenated weights, built at
            # run time on every call: a weight-sized concatenate here means weights are copied each step.
            "all_concatenates": text.count(" concatenate("), "all_dots": text.count(" dot(")}
        print(json.dumps(result["forward_hlo"]), flush=True)
        result["forward_memory"] = {
            "bucket": [num_tokens, num_seqs], "pool_bytes": pool_bytes,
            **{name: int(getattr(mem, name)) for name in ("temp_size_in_bytes", "argument_size_in_bytes",
                                                           "output_size_in_bytes", "alias_size_in_bytes")
               if mem is not None and hasattr(mem, name)}}
        print(json.dumps(result["forward_memory"]), flush=True)
    except Exception as exc:  # memory analysis is backend-dependent; the timings above stand without it
        result["forward_memory"] = {"error": repr(exc)}

    # The sampler's pieces on random logits [rows, vocab].
    rows = runner.sampler_seq_buckets[-1]
    key = jax.random.key(1)
    logits = jax.random.normal(key, (rows, config.vocab_size), jnp.float32) * 3
    temps = np.full(rows, args.temperature if args.temperature > 0 else 0.6, np.float32)
    tensors, _ = sampler_lib.build_sampling_tensors(
        [(SamplingParams(temperature=float(t)), i, 0, (), ()) for i, t in enumerate(temps)], rows)
    tensors = jax.device_put(tensors)
    pieces = {}

    def time_fn(name, fn, *fn_args):
        jitted = jax.jit(fn)
        jax.block_until_ready(jitted(*fn_args))

        def loop():
            out = None
            for _ in range(args.inner):
                out = jitted(*fn_args)
            jax.block_until_ready(out)

        pieces[name] = round(_median_ms(loop, args.repeats) / args.inner, 3)

    for mode, k in (("greedy", 0), ("greedy_or_temperature", 0), ("greedy_or_temperature", 20), ("full", 0),
                    ("full", 20)):
        time_fn(f"sample[{mode},k={k}]",
                lambda lg, t, mode=mode, k=k: sampler_lib.sample(lg, t, mode=mode, num_logprobs=k), logits, tensors)
    # Qwen3's generation config on every row: top_k mode (top-k / top-p from the candidates) against the sort.
    qwen3_tensors, qwen3_mode = sampler_lib.build_sampling_tensors(
        [(SamplingParams(temperature=float(t), top_k=20, top_p=0.95), i, 0, (), ()) for i, t in enumerate(temps)],
        rows, vocab_size=config.vocab_size)
    qwen3_tensors = jax.device_put(qwen3_tensors)
    for mode in (qwen3_mode.value, "full"):
        time_fn(f"sample[{mode},k=0,top_k=20,top_p=0.95]",
                lambda lg, t, mode=mode: sampler_lib.sample(lg, t, mode=mode), logits, qwen3_tensors)
    time_fn("vocab_top_k(k=20)", lambda lg: vocab_top_k(lg, 20), logits)  # the sampler's top-20 logprobs (two stages)
    time_fn(f"vocab_top_k(k={TOP_K_CANDIDATES})", lambda lg: vocab_top_k(lg, TOP_K_CANDIDATES), logits)
    for k in (20, 16, 8):
        time_fn(f"lax.top_k(k={k})", lambda lg, k=k: jax.lax.top_k(lg, k), logits)
    time_fn("gumbel_noise", lambda t: sampler_lib.gumbel_noise(t.seeds, t.steps, config.vocab_size), tensors)
    time_fn("argmax", lambda lg: jnp.argmax(lg, axis=-1), logits)
    time_fn("logsumexp", lambda lg: jax.nn.logsumexp(lg, axis=-1), logits)
    result["sampler_pieces_ms"] = {"rows": rows, "vocab": config.vocab_size, **pieces}
    print(json.dumps(result["sampler_pieces_ms"]), flush=True)
    result["compiles_after_warm_up"] = runner.num_compiles_since_warmup
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
