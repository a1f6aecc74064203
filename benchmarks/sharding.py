"""One workload through several sharding layouts: throughput, step latency and memory per device.

The workload is model-level (no scheduler): ``--batch`` sequences of ``--prompt-len`` random tokens are prefilled
as one ragged step on the paged KV pool, then ``--decode-steps`` greedy decode steps run, each feeding the previous
step's tokens back on device. Every layout runs the same global batch; with dp > 1 each dp group owns
``batch / dp`` of the sequences and its own part of the KV pool (``paged_jax.parallel``).

Layout names: ``tp<N>`` (N-way tensor parallel, KV pool sharded over kv heads), ``dp<M>xtp<N>``, and a ``-kvrep``
suffix for the replicated-attention layout (attention weights and the KV pool whole on every tp device, only MLP /
embedding / LM head split). ``pp<K>xtp<N>``: K pipeline stages of N-way tp (``paged_jax.parallel.pipeline``), run through
the engine's model runner (``ModelRunner`` with the pipeline's ``PipelineForward``; ``pp1xtp<N>`` = the plain tp
runner, its baseline): the same prefill and greedy decode steps, as runner steps (bucketed, sampler included), the decode steps fed on device.
A pp layout splits a step into pp overlapping micro-batches when it has at least ``--pipeline-microbatch-min-tokens``
per micro-batch (``paged_jax.parallel.pipeline``); ``--compare-unpipelined`` runs it again with every step one batch, stage
after stage, and reports both step times, the speedup and its ideal, and the prefill compute floors (all stages busy
vs one stage at a time).

Reported per layout: prefill time, median decode-step latency with a host sync per step ("sync") and per step of
the same steps dispatched back to back ("decode step ms", the device-bound figure that throughput, the
weight-read floor per device and the per-GPU scaling use), decode throughput (tokens/s over the whole batch),
weights and KV bytes held per device (exact, from the arrays' addressable shards), and whether the greedy tokens
agree with the first layout's (a correctness check; bf16 on GPU may legitimately flip a near-tie).

Examples:
  # correctness / smoke on 8 fake CPU devices (speed figures are meaningless there)
  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python -m benchmarks.sharding --shape small
  # pipelined (micro-batched) vs stage-after-stage pp steps
  python -m benchmarks.sharding --shape llama-3.1-8b --dtype bfloat16 --layouts pp1xtp1,pp2xtp1,pp4xtp1,pp2xtp2 \
      --batch 16 --prompt-len 512 --decode-steps 32 --compare-unpipelined
  # real figures (8 GPUs)
  python -m benchmarks.sharding --shape qwen3-0.6b --dtype bfloat16 --batch 64 --prompt-len 512 --decode-steps 64
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

from paged_jax.worker.attention_impl import ATTENTION_IMPLS, DEPRECATED_ATTENTION_IMPLS

PREFILL_STEPS_BACK_TO_BACK = 4  # prefill steps timed together for the device-bound prefill step time
DEFAULT_LAYOUTS = ("tp1", "tp2", "tp4", "tp8", "dp2xtp4", "dp4xtp2", "dp8xtp1", "tp4-kvrep", "tp8-kvrep")

# A small Qwen3-shaped model for CPU runs: 8 q heads / 4 kv heads (tp = 8 replicates each kv head twice).
SMALL_SHAPE = {
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 768,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "max_position_embeddings": 4096,
    "bos_token_id": 1, "eos_token_id": 2,
}


def parse_pipeline_layout(name: str) -> tuple[int, int] | None:
    """"pp2xtp4" -> (pp=2, tp=4); None for a layout without a pp part."""
    match = re.fullmatch(r"pp(\d+)xtp(\d+)", name)
    if not match:
        return None
    pp, tp = int(match.group(1)), int(match.group(2))
    if pp < 1 or tp < 1:
        raise ValueError(f"layout {name!r}: pp and tp must be >= 1")
    return pp, tp


def parse_layout(name: str) -> tuple[int, int, str]:
    """"dp2xtp4-kvrep" -> (dp=2, tp=4, kv_layout="replicated"); ValueError naming the layout otherwise."""
    match = re.fullmatch(r"(?:dp(\d+)x)?tp(\d+)(-kvrep)?", name)
    if not match:
        raise ValueError(f"layout {name!r} is not of the form tp<N>, dp<M>xtp<N>, ...-kvrep or pp<K>xtp<N>")
    dp, tp = int(match.group(1) or 1), int(match.group(2))
    if dp < 1 or tp < 1:
        raise ValueError(f"layout {name!r}: dp and tp must be >= 1")
    return dp, tp, "replicated" if match.group(3) else "sharded"


def bytes_per_device(tree) -> dict:
    """Bytes of every jax Array leaf of ``tree`` (a pytree or ``nnx.State``) held on each addressable device:
    ``{jax.Device: int}``, from the arrays' shards, so it counts exactly what each device stores."""
    import jax
    from flax import nnx

    totals: dict = {}
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, nnx.Variable):
            leaf = leaf.get_value()
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            totals[shard.device] = totals.get(shard.device, 0) + shard.data.size * shard.data.dtype.itemsize
    return totals


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Count collective ops (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute) in HLO text.

    Counts instruction definitions (``= f32[..] all-reduce(``), async starts once (``all-reduce-start``).
    """
    counts = {}
    for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"):
        counts[op] = len(re.findall(rf"\s{op}(?:-start)?\(", hlo_text))
    return counts


def run_layout(config, layout: str, *, batch: int, prompt_len: int, decode_steps: int, block_size: int, dtype,
               impl: str, seed: int = 0, repeats: int = 1) -> dict:
    """Run the workload under one layout; returns its measurements and greedy tokens (int32[decode_steps+1, B])."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from models.tensor_parallel import load_sharded_model
    from paged_jax.parallel import ShardingPlan, make_mesh

    dp, tp, kv_layout = parse_layout(layout)
    if batch % dp:
        raise ValueError(f"--batch ({batch}) must be divisible by dp ({dp}) for layout {layout}")
    if dp * tp > len(jax.devices()):
        return {"layout": layout, "skipped": f"needs {dp * tp} devices, {len(jax.devices())} available"}
    plan = ShardingPlan.create(config, make_mesh(tp, dp), kv_layout=kv_layout)
    model = load_sharded_model(None, plan, dtype=dtype, load_format="dummy", seed=seed)
    graphdef, state = nnx.split(model)
    # The jitted steps take the weights as a flat list (flattened in C++ on every call) rather than the nnx.State
    # (flattened through Python callbacks), so the synchronous step time is not inflated by pytree handling.
    leaves, state_treedef = jax.tree.flatten(state)

    seqs_per_group = batch // dp
    max_len = prompt_len + decode_steps
    blocks_per_seq = -(-max_len // block_size)
    blocks_per_group = 1 + seqs_per_group * blocks_per_seq  # local block 0: the group's null block
    kv_pool = plan.make_kv_caches(blocks_per_group * dp, block_size, dtype)
    sm_scale = config.head_dim ** -0.5

    # Local block tables, identical for every dp group, stacked: int32[dp * S, blocks_per_seq].
    local_tables = 1 + np.arange(seqs_per_group * blocks_per_seq, dtype=np.int32).reshape(seqs_per_group, -1)
    tables = np.tile(local_tables, (dp, 1))
    prompts = np.random.default_rng(seed).integers(3, config.vocab_size, (batch, prompt_len), dtype=np.int32)

    def tile(x):
        return np.concatenate([x] * dp)

    # Prefill metadata (host, once): sequence-major flat tokens; each group's tokens are its S sequences.
    positions = np.tile(np.arange(prompt_len, dtype=np.int32), batch)
    prefill_slots = (tables[np.repeat(np.arange(batch), prompt_len), positions // block_size] * block_size
                     + positions % block_size).astype(np.int32)
    prefill_meta = (prefill_slots, np.full(batch, prompt_len, np.int32), tables,
                    tile(np.arange(seqs_per_group + 1, dtype=np.int32) * prompt_len))
    last_token_rows = np.arange(batch) * prompt_len + prompt_len - 1
    decode_cu = tile(np.arange(seqs_per_group + 1, dtype=np.int32))
    token_sharding = plan.token_sharding

    def forward(leaves, kv_pool, tokens, positions, meta, logits_rows):
        model = nnx.merge(graphdef, jax.tree.unflatten(state_treedef, leaves))
        slots, kv_lens, block_tables, cu = meta
        attention = plan.paged_attention(slot_mapping=slots, kv_lens=kv_lens, block_tables=block_tables,
                                         cu_q_lens=cu, sm_scale=sm_scale, sliding_window=config.sliding_window,
                                         impl=impl)
        hidden, kv_pool = model(tokens, positions, kv_pool, attention)
        if logits_rows is not None:
            hidden = hidden[logits_rows]
        logits = model.compute_logits(hidden)  # gathered over tp by the tensor-parallel model
        next_tokens = jax.lax.with_sharding_constraint(jnp.argmax(logits, -1).astype(jnp.int32), token_sharding)
        return next_tokens, kv_pool

    def prefill(leaves, kv_pool, tokens, positions, meta, logits_rows):
        return forward(leaves, kv_pool, tokens, positions, meta, logits_rows)

    prefill = jax.jit(prefill, donate_argnums=(1,))
    block_tables_dev = jax.device_put(tables, token_sharding)
    decode_cu_dev = jax.device_put(decode_cu, token_sharding)

    def decode(leaves, kv_pool, tokens, step):
        """tokens int32[B] at position prompt_len + step of every sequence -> (next tokens, kv_pool)."""
        pos = jnp.full((batch,), prompt_len, jnp.int32) + step
        slots = (jnp.take_along_axis(block_tables_dev, (pos // block_size)[:, None], axis=1)[:, 0] * block_size
                 + pos % block_size)
        meta = (slots, pos + 1, block_tables_dev, decode_cu_dev)
        return forward(leaves, kv_pool, tokens, pos, meta, None)

    decode = jax.jit(decode, donate_argnums=(1,))
    put = lambda x: jax.device_put(x, token_sharding)  # noqa: E731
    prefill_args = (put(prompts.reshape(-1)), put(positions), tuple(put(m) for m in prefill_meta),
                    put(last_token_rows.astype(np.int32)))

    def workload(kv_pool):
        t0 = time.perf_counter()
        tokens, kv_pool = prefill(leaves, kv_pool, *prefill_args)
        tokens.block_until_ready()
        prefill_s = time.perf_counter() - t0
        # Synchronous steps (host dispatch + device, one sync per step), then the same steps dispatched back to
        # back with one sync at the end (device-bound time per step; the slots are simply overwritten).
        generated, step_times = [tokens], []
        for step in range(decode_steps):
            t0 = time.perf_counter()
            tokens, kv_pool = decode(leaves, kv_pool, tokens, jnp.int32(step))
            tokens.block_until_ready()
            step_times.append(time.perf_counter() - t0)
            generated.append(tokens)
        tokens = generated[0]
        t0 = time.perf_counter()
        for step in range(decode_steps):
            tokens, kv_pool = decode(leaves, kv_pool, tokens, jnp.int32(step))
        tokens.block_until_ready()
        pipelined_s = (time.perf_counter() - t0) / max(decode_steps, 1)
        return kv_pool, prefill_s, step_times, pipelined_s, generated

    t0 = time.perf_counter()
    kv_pool, *_ = workload(kv_pool)  # compile + warm-up (overwrites the same slots when timed)
    compile_s = time.perf_counter() - t0
    best = None
    for _ in range(repeats):
        kv_pool, prefill_s, step_times, pipelined_s, generated = workload(kv_pool)
        if best is None or pipelined_s < best[2]:
            best = (prefill_s, step_times, pipelined_s, generated)
    prefill_s, step_times, pipelined_s, generated = best
    sync_step_s = statistics.median(step_times) if step_times else float("nan")
    weight_bytes = bytes_per_device(state)
    kv_bytes = bytes_per_device(kv_pool)
    devices = sorted(weight_bytes, key=lambda d: d.id)
    return {
        "layout": layout, "dp": dp, "tp": tp, "kv_layout": kv_layout,
        "q_heads": plan.model_config.num_attention_heads, "kv_heads": plan.model_config.num_key_value_heads,
        "compile_and_first_run_s": round(compile_s, 3),
        "prefill_s": round(prefill_s, 4), "prefill_tok_s": round(batch * prompt_len / prefill_s, 1),
        "decode_step_ms": round(pipelined_s * 1e3, 3), "decode_tok_s": round(batch / pipelined_s, 1),
        "sync_decode_step_ms": round(sync_step_s * 1e3, 3),
        "weights_mib_per_device": round(max(weight_bytes[d] for d in devices) / 2**20, 2),
        "kv_mib_per_device": round(max(kv_bytes.get(d, 0) for d in devices) / 2**20, 2),
        "tokens": np.stack([np.asarray(t) for t in generated]),
    }


def run_pipeline_layout(config, layout: str, *, batch: int, prompt_len: int, decode_steps: int, block_size: int,
                        dtype, impl: str, seed: int = 0, repeats: int = 1, min_microbatch_tokens: int | None = None,
                        compare_unpipelined: bool = False) -> dict:
    """The workload of ``run_layout`` as model-runner steps over ``pp`` stages of ``tp`` devices: one prefill step
    of every prompt, then greedy decode steps (each fed the previous step's tokens on device); same keys, plus
    ``microbatches`` (of the prefill and decode steps: ``PipelineForward.num_microbatches``, whose threshold
    ``min_microbatch_tokens`` overrides), ``prefill_step_ms`` (prefill steps back to back, device-bound) and its
    compute floors on H200s: ``prefill_compute_floor_ms`` (every device of every stage busy: what overlapping stages
    can reach) and ``prefill_serial_floor_ms`` (one stage at a time).
    With ``compare_unpipelined`` (pp > 1) the same runs again with every step one batch, stage after stage:
    ``unpipelined_*`` figures, the speedups of the micro-batched run over it, and ``unpipelined_agreement``."""
    import jax
    import numpy as np

    from benchmarks.floors import H200_BF16_FLOPS, prefill_flops

    from models.tensor_parallel import load_sharded_model
    from paged_jax.worker.model_runner import ModelRunner
    from paged_jax.parallel import ShardingPlan, make_mesh
    from paged_jax.parallel.pipeline import PipelineForward, PipelinePlan
    from paged_jax.core.hand_steps import HandScheduler
    from paged_jax.sampling_params import SamplingParams

    pp, tp = parse_pipeline_layout(layout)
    if pp * tp > len(jax.devices()):
        return {"layout": layout, "skipped": f"needs {pp * tp} devices, {len(jax.devices())} available"}
    if pp > 1:
        plan = PipelinePlan.create(config, pp, tp)
    else:
        plan = ShardingPlan.create(config, make_mesh(tp))
    model = load_sharded_model(None, plan, dtype=dtype, load_format="dummy", seed=seed)
    max_len = prompt_len + decode_steps
    blocks_per_seq = -(-max_len // block_size)

    def make_runner(min_tokens):
        extra = {} if pp == 1 else {"forward": PipelineForward(min_microbatch_tokens=min_tokens)}
        return ModelRunner(model, plan.model_config, num_blocks=1 + batch * blocks_per_seq, block_size=block_size,
                          max_model_len=blocks_per_seq * block_size, max_num_seqs=batch,
                          max_num_batched_tokens=batch * prompt_len, attention_impl=impl, sharding_plan=plan,
                          buckets=[(batch, batch), (batch * prompt_len, batch)], **extra)

    runner = make_runner(min_microbatch_tokens)
    microbatches = getattr(runner.forward_strategy, "num_microbatches", {})  # {} for the one-program forward
    t0 = time.perf_counter()
    runner.warm_up(use_tqdm=False)
    compile_s = time.perf_counter() - t0
    prompts = np.random.default_rng(seed).integers(3, config.vocab_size, (batch, prompt_len), dtype=np.int32)
    greedy = SamplingParams(temperature=0.0)
    tables = [list(range(1 + b * blocks_per_seq, 1 + (b + 1) * blocks_per_seq)) for b in range(batch)]

    def measure(runner):
        """-> (prefill s, sync decode step times, back-to-back decode step s, greedy tokens), best of repeats."""
        hand = HandScheduler()
        keys = [str(b) for b in range(batch)]

        def prefill():
            """Every prompt from position 0, as fresh rows (the previous ones leave the runner's batch)."""
            for key in list(hand.requests):
                hand.finish(key)
            for b, key in enumerate(keys):
                hand.add(key, prompts[b].tolist(), tables[b], params=greedy)
            return step({key: prompt_len for key in keys})

        def step(num_new: dict[str, int]):
            out = hand.step(num_new)
            handle = runner.execute(out)
            hand.update(out, None)  # the sampled tokens stay on the device: the next step feeds on them
            return handle

        def decode():
            return step({key: 1 for key in keys})

        best = None
        for _ in range(repeats):
            t0 = time.perf_counter()
            first = prefill().result().sampled_token_ids
            prefill_s = time.perf_counter() - t0
            generated, step_times = [np.asarray(first)], []
            for i in range(decode_steps):
                t0 = time.perf_counter()
                out = decode().result().sampled_token_ids
                step_times.append(time.perf_counter() - t0)
                generated.append(np.asarray(out))
            t0 = time.perf_counter()
            for _ in range(PREFILL_STEPS_BACK_TO_BACK):  # the same prefill again (same slots), one sync at the end
                handle = prefill()
            handle.result()
            prefill_step_s = (time.perf_counter() - t0) / PREFILL_STEPS_BACK_TO_BACK
            t0 = time.perf_counter()
            for i in range(decode_steps):  # dispatched back to back, one sync at the end
                handle = decode()
            handle.result()
            pipelined_s = (time.perf_counter() - t0) / max(decode_steps, 1)
            if best is None or pipelined_s < best[2]:
                best = [prefill_s, step_times, pipelined_s, generated, prefill_step_s]
            best[4] = min(best[4], prefill_step_s)
        return best

    prefill_s, step_times, pipelined_s, generated, prefill_step_s = measure(runner)
    weight_bytes, kv_bytes = bytes_per_device(runner._param_leaves), bytes_per_device(runner.kv_pool)
    devices = sorted(weight_bytes, key=lambda d: d.id)
    flops = prefill_flops(plan.model_config, batch, prompt_len)
    result = {
        "layout": layout, "dp": 1, "tp": tp, "pp": pp, "kv_layout": "sharded",
        "q_heads": plan.model_config.num_attention_heads, "kv_heads": plan.model_config.num_key_value_heads,
        "compile_and_first_run_s": round(compile_s, 3), "num_compiles_since_warmup": runner.num_compiles_since_warmup,
        "microbatches": {"prefill": microbatches.get(batch * prompt_len, 1), "decode": microbatches.get(batch, 1)},
        "prefill_s": round(prefill_s, 4), "prefill_tok_s": round(batch * prompt_len / prefill_s, 1),
        "prefill_step_ms": round(prefill_step_s * 1e3, 3),
        "prefill_compute_floor_ms": round(flops / (pp * tp * H200_BF16_FLOPS) * 1e3, 4),
        "prefill_serial_floor_ms": round(flops / (tp * H200_BF16_FLOPS) * 1e3, 4),
        "decode_step_ms": round(pipelined_s * 1e3, 3), "decode_tok_s": round(batch / pipelined_s, 1),
        "sync_decode_step_ms": round(statistics.median(step_times) * 1e3, 3) if step_times else float("nan"),
        "weights_mib_per_device": round(max(weight_bytes[d] for d in devices) / 2**20, 2),
        "kv_mib_per_device": round(max(kv_bytes.get(d, 0) for d in devices) / 2**20, 2),
        "tokens": np.stack(generated),
    }
    if compare_unpipelined and pp > 1:
        runner.close()
        del runner
        serial = make_runner(1 << 62)  # no bucket splits: every step one batch, stage after stage
        serial.warm_up(use_tqdm=False)
        s_prefill_s, _, s_decode_s, s_generated, s_prefill_step_s = measure(serial)
        result.update({
            "unpipelined_prefill_s": round(s_prefill_s, 4),
            "unpipelined_prefill_step_ms": round(s_prefill_step_s * 1e3, 3),
            "unpipelined_decode_step_ms": round(s_decode_s * 1e3, 3),
            "prefill_overlap_speedup": round(s_prefill_step_s / prefill_step_s, 3),
            "decode_overlap_speedup": round(s_decode_s / pipelined_s, 3),
            # What M micro-batches over pp compute-bound stages can give: pp stage times -> (M + pp - 1) / M.
            "ideal_prefill_overlap_speedup": round(pp * result["microbatches"]["prefill"]
                                                   / (result["microbatches"]["prefill"] + pp - 1), 3),
            "unpipelined_agreement": f"{float(np.mean(np.stack(s_generated) == result['tokens'])):.3f}",
        })
    return result


def markdown_table(results: list[dict]) -> str:
    header = ("| layout | dp | tp | KV | q/kv heads | prefill s | prefill tok/s | decode step ms (sync) | "
              "decode step ms | decode tok/s | "
              "weights MiB/dev | KV MiB/dev | weight-read floor ms | step / floor | per-GPU tok/s vs first | "
              "greedy = first layout |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['layout']} | skipped: {r['skipped']} |" + " |" * 14)
            continue
        lines.append(
            f"| {r['layout']} | {r['dp']} | {r['tp']} | {r['kv_layout']} | {r['q_heads']}/{r['kv_heads']} | "
            f"{r['prefill_s']:.4f} | {r['prefill_tok_s']:,.0f} | {r['sync_decode_step_ms']:.2f} | "
            f"{r['decode_step_ms']:.2f} | "
            f"{r['decode_tok_s']:,.0f} | {r['weights_mib_per_device']:,.2f} | {r['kv_mib_per_device']:,.2f} | "
            f"{r['weight_read_floor_ms']:.2f} | {r['step_over_floor']:.2f}x | {r['scaling_vs_first']:.2f} | "
            f"{r['agreement']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="small", help="'small' (CPU) or a models/presets.py name")
    p.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS), help="comma-separated layout names")
    p.add_argument("--batch", type=int, default=8, help="sequences (divisible by every layout's dp)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--attention-impl", default="auto", choices=[*ATTENTION_IMPLS, *DEPRECATED_ATTENTION_IMPLS])
    p.add_argument("--repeats", type=int, default=2, help="timed repetitions per layout (best is kept)")
    p.add_argument("--pipeline-microbatch-min-tokens", type=int, default=None,
                   help="pp layouts: fewest tokens per micro-batch for a step to be split into pp overlapping "
                        "micro-batches (default: paged_jax.parallel.pipeline.MIN_MICROBATCH_TOKENS)")
    p.add_argument("--compare-unpipelined", action="store_true",
                   help="pp layouts: also run every step as one batch, stage after stage, and report the "
                        "micro-batched (overlapping) step times against it")
    p.add_argument("--out", help="write the JSON results here")
    args = p.parse_args(argv)

    import jax
    import numpy as np

    from models.config import ModelConfig
    from models.loader import resolve_dtype
    from models.presets import preset_config

    config = ModelConfig.from_hf_config(SMALL_SHAPE) if args.shape == "small" else preset_config(args.shape)
    dtype = resolve_dtype(args.dtype)
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    for name in layouts:
        parse_pipeline_layout(name) or parse_layout(name)
    from benchmarks.floors import H200_HBM_BYTES_PER_S

    results, reference_tokens, first_per_gpu = [], None, None
    for name in layouts:
        run, extra = run_layout, {}
        if parse_pipeline_layout(name):
            run, extra = run_pipeline_layout, dict(min_microbatch_tokens=args.pipeline_microbatch_min_tokens,
                                                   compare_unpipelined=args.compare_unpipelined)
        result = run(config, name, batch=args.batch, prompt_len=args.prompt_len, decode_steps=args.decode_steps,
                     block_size=args.block_size, dtype=dtype, impl=args.attention_impl, repeats=args.repeats, **extra)
        if "tokens" in result:
            tokens = result.pop("tokens")
            if reference_tokens is None:
                reference_tokens = tokens
            result["agreement"] = f"{float(np.mean(tokens == reference_tokens)):.3f}"
            # Decode floor per step: each device streams its own share of the weights once (KV reads excluded,
            # so this is the batch-1 floor / N of the issue); scaling compares tok/s per GPU with the first layout.
            floor_ms = result["weights_mib_per_device"] * 2**20 / H200_HBM_BYTES_PER_S * 1e3
            result["weight_read_floor_ms"] = round(floor_ms, 3)
            result["step_over_floor"] = round(result["decode_step_ms"] / floor_ms, 3)
            per_gpu = result["decode_tok_s"] / (result["dp"] * result["tp"] * result.get("pp", 1))
            first_per_gpu = first_per_gpu or per_gpu
            result["scaling_vs_first"] = round(per_gpu / first_per_gpu, 3)
        results.append(result)
        print(json.dumps(result), flush=True)
    device = jax.devices()[0]
    print(f"\n{args.shape}, {args.dtype}, batch {args.batch} x prompt {args.prompt_len} + {args.decode_steps} decode "
          f"steps, block {args.block_size}, {len(jax.devices())} x {device.device_kind} ({jax.default_backend()}), "
          f"jax {jax.__version__}\n")
    print(markdown_table(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "device": device.device_kind, "backend": jax.default_backend(),
                       "num_devices": len(jax.devices()), "jax": jax.__version__, "results": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
