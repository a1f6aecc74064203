"""Multi-LoRA decode steps against the base model, in one run (issue 18).

Builds one model of a named shape with dummy weights, then, for each decode batch, times the same steps on three
runners over those weights: the base model (no LoRA), and LoRA runners (``--impls``: ``masked`` and/or ``gather``,
``paged_jax.lora.layers``) whose rows cycle through ``--num-adapters`` random adapters of rank ``--rank`` on every
target projection (slots sized by ``--max-loras`` / ``--max-lora-rank``), so every step mixes all adapters. One
runner at a time holds a KV pool.

Per (batch, runner) one JSON line: ``step_ms`` (``--inner`` steps dispatched back to back, one wait, per step: the
device's step time when the host overlaps it), ``sync_step_ms`` (one ``execute(...).result()``), the ratio to the base
model's, and the memory floor (weights + KV read + the LoRA slot weights, at ``--hbm-gbps``). The rows are made once;
each timed step runs the same decode again (its diff carrying nothing new: the rows already hold their tokens).

On the H200: ``python -m benchmarks.lora --shape llama-3.1-8b --batches 32,256 --context 1024 --out $OUT/lora.json``.
On CPU ``--tiny`` uses a 2-layer random config (checks the script, not for figures).
"""

from __future__ import annotations

import argparse
import gc
import json

import numpy as np

from benchmarks.report import median_seconds, write_json


def _median_ms(fn, repeats: int) -> float:
    """Median milliseconds of ``fn()`` (which waits for its own results) over ``repeats`` calls, none untimed."""
    return median_seconds(fn, repeats, warmup=0) * 1e3


def random_adapter(config, rank: int, seed: int, std: float = 0.02):
    """A ``LoRAAdapter`` with random A and B of ``rank`` on every target projection of every layer."""
    from paged_jax.lora.peft import SUPPORTED_MODULES, LoRAAdapter, module_dims

    rng = np.random.default_rng(seed)
    weights = {}
    for layer in range(config.num_hidden_layers):
        for module in SUPPORTED_MODULES:
            in_features, out_features = module_dims(config, module)
            weights[(layer, module)] = (rng.normal(0, std, (in_features, rank)).astype(np.float32),
                                        rng.normal(0, std, (rank, out_features)).astype(np.float32))
    return LoRAAdapter(lora_int_id=seed + 1, lora_name=f"random-{seed}", lora_path="", rank=rank, weights=weights)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.1-8b", help="named shape (models/presets.py)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer random config instead (CPU check of the script)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="32,256", help="decode batch sizes")
    p.add_argument("--context", type=int, default=1024, help="cached tokens of every sequence")
    p.add_argument("--num-adapters", type=int, default=4, help="distinct adapters cycled over the rows")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--impls", default="masked,gather", help="LoRA implementations to time")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--inner", type=int, default=10, help="back-to-back steps per pipelined measurement")
    p.add_argument("--hbm-gbps", type=float, default=4300.0, help="bandwidth of the floor (H200)")
    p.add_argument("--out")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from models.config import ModelConfig
    from models.llama import fuse_projections
    from models.loader import init_dummy_model
    from models.presets import kv_bytes_per_token, num_params, preset_config
    from paged_jax.lora.request import LoRARequest
    from paged_jax.lora.slots import LoRASlots
    from paged_jax.worker.kv_pool_sizing import enable_compilation_cache
    from paged_jax.worker.model_runner import ModelRunner
    from paged_jax.core.hand_steps import HandScheduler
    from paged_jax.sampling_params import SamplingParams

    enable_compilation_cache(None)  # the three runners share their sampler executables through it
    if args.tiny:
        from models.testing import tiny_config
        config = ModelConfig.from_hf_config(tiny_config("LlamaForCausalLM", vocab_size=1024, num_hidden_layers=2))
    else:
        config = preset_config(args.shape)
    if args.num_adapters > args.max_loras or args.rank > args.max_lora_rank:
        p.error("--num-adapters must be <= --max-loras and --rank <= --max-lora-rank")
    dtype = jnp.dtype(args.dtype)
    batches = [int(b) for b in args.batches.split(",") if b]
    bs = args.block_size
    blocks_per_seq = -(-(args.context + 1) // bs)
    num_blocks = max(batches) * blocks_per_seq + 1
    max_model_len = blocks_per_seq * bs
    buckets = sorted({(b, b) for b in batches})
    model = fuse_projections(init_dummy_model(config, dtype=dtype, seed=0))  # as the engine runs it
    weight_bytes = num_params(config) * dtype.itemsize
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1 << 20)
    rng = np.random.default_rng(0)
    device = jax.devices()[0]
    results: list[dict] = []

    def time_runner(label, lora_slots, slot_bytes):
        runner = ModelRunner(model, config, num_blocks=num_blocks, block_size=bs, max_model_len=max_model_len,
                             max_num_seqs=max(batches), max_num_batched_tokens=max(batches), buckets=buckets,
                             lora_slots=lora_slots)
        runner.warm_up(use_tqdm=False)
        adapters = []  # the request-side adapter of each slot 1.. (its lora_int_id)
        if lora_slots is not None:
            for slot in range(1, args.num_adapters + 1):
                adapter = random_adapter(config, args.rank, seed=slot)
                runner.write_lora_slot(slot, lora_slots.to_slot_form(
                    adapter, LoRARequest(adapter.lora_name, adapter.lora_int_id, "random")))
                adapters.append(adapter)
        slot_of = {adapter.lora_int_id: slot for slot, adapter in enumerate(adapters, 1)}
        hand = HandScheduler()
        for batch in batches:
            for req_id in list(hand.requests):  # the previous batch's rows leave the runner's batch
                hand.finish(req_id)
            for i in range(batch):
                prompt = rng.integers(0, min(config.vocab_size, 10000), args.context + 1).tolist()
                hand.add(f"s{i}", prompt, list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)),
                         params=params, seed=i, num_computed_tokens=args.context,
                         lora=adapters[i % len(adapters)] if adapters else None)
            plan = {f"s{i}": 1 for i in range(batch)}
            runner.execute(hand.step(plan), slot_of).result()
            step = hand.step(plan)  # not updated: the same decode again, a diff with nothing new
            runner.execute(step, slot_of).result()
            sync_ms = _median_ms(lambda: runner.execute(step, slot_of).result(), args.repeats)

            def pipelined():
                pending = None
                for _ in range(args.inner):
                    pending = runner.execute(step, slot_of)
                pending.result()

            step_ms = _median_ms(pipelined, args.repeats) / args.inner
            kv_read = batch * (args.context + 1) * kv_bytes_per_token(config, dtype.itemsize)
            row = {"benchmark": "lora_decode", "shape": "tiny" if args.tiny else args.shape, "runner": label,
                   "batch": batch, "context": args.context, "num_adapters": 0 if lora_slots is None else
                   args.num_adapters, "rank": args.rank, "max_loras": args.max_loras,
                   "max_lora_rank": args.max_lora_rank, "step_ms": round(step_ms, 3), "sync_step_ms": round(sync_ms, 3),
                   "floor_ms": round((weight_bytes + kv_read + slot_bytes) / (args.hbm_gbps * 1e9) * 1e3, 3),
                   "lora_slot_bytes": slot_bytes, "device": str(device.device_kind),
                   "compiles_after_warmup": runner.num_compiles_since_warmup}
            base = next((r for r in results if r["runner"] == "base" and r["batch"] == batch), None)
            if base is not None:
                row["ratio_to_base"] = round(step_ms / base["step_ms"], 3)
            results.append(row)
            print(json.dumps(row), flush=True)
        runner.close()

    time_runner("base", None, 0)
    gc.collect()  # the runner's KV pool goes before the next one is built
    for impl in filter(None, args.impls.split(",")):
        slots = LoRASlots(config, fused=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                          dtype=dtype, device=device, impl=impl)
        slot_bytes = sum(a.nbytes + b.nbytes for layer in slots.arrays for a, b in layer.values())
        time_runner(f"lora-{impl}", slots, slot_bytes)
        del slots
        gc.collect()
    if args.out:
        write_json(args.out, {"benchmark": "lora", "rows": results})
    return results


if __name__ == "__main__":
    main()
