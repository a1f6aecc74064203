"""An RL rollout worker's costs: weight updates, sleep / wake_up, and the device memory sleep leaves.

One engine (``enable_sleep_mode``, on ``--tensor-parallel-size`` devices) of a shape with random weights
(``--shape``, a models/presets.py name: dummy weights, and for the from-disk updates a random safetensors checkpoint
written once under ``--workdir``) or of a checkpoint (``--model``). A trainer's parameters (the model's own layout,
unfused, on the engine's first device: a tensor-parallel update reshards them device to device) are then pushed
``--repeats`` times, and each phase is timed (medians; ``*_first_s`` is the first call, which traces and compiles
the weight transform):

  update_s:            ``LLM.update_weights(state)`` in-process (device to device: one jitted program re-applies the
                       engine's transforms into the old, donated buffers), until the new buffers are ready;
  update_disk_s:       ``update_weights_from_disk`` of the safetensors checkpoint (read, cast, transposed, fused);
  update_orbax_s:      ``update_weights_from_disk`` of an orbax checkpoint of the trainer's pure dict;
  sleep1_s / sleep2_s: ``sleep(level=1)`` (weights copied to host memory) / ``sleep(level=2)``;
  wake1_s / wake2_s:   ``wake_up()`` after each (level 1: weights back from the host; level 2: zeros allocated);
  bytes_*:             the engine's devices' ``bytes_in_use`` (summed) before sleeping and after each level (the
                       trainer's parameters deleted first, so what remains is the engine's), with ``weight_bytes``,
                       ``kv_pool_bytes`` and ``level2_fraction`` = bytes in use after level 2 / (weights + KV pool)
                       (target <= 0.05).
Also ``num_compiles_since_warmup`` (0: no update or wake-up compiled a step) and that a greedy request after the
last update returns as many tokens as asked.

Examples (prints one JSON line):
  python -m benchmarks.weight_update --shape llama-3.1-8b --workdir /tmp/weight_update   # H100: ~16 GB checkpoint
  python -m benchmarks.weight_update --shape llama-3.1-8b --workdir /tmp/weight_update --tensor-parallel-size 2
  python -m benchmarks.weight_update --model /path/to/tiny --repeats 2 --dtype float32    # CPU smoke run
Figures: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import os

# The trainer's parameters and the update's new buffers live beside the engine: JAX's allocator may take most of the
# device, the engine's own share (its KV pool) is set by --gpu-memory-utilization.
os.environ.setdefault("XLA_CLIENT_MEM_FRACTION", "0.95")

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
from flax import nnx

from paged_jax.entrypoints.llm import LLM
from paged_jax.sampling_params import SamplingParams
from paged_jax.worker.sleep_mode import device_bytes_in_use


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _engine_ready(llm: LLM) -> None:
    jax.block_until_ready([x for x in llm.llm_engine.engine_core.runner.param_leaves if x is not None])


def _trainer_state(args: argparse.Namespace, config):
    """The trainer's parameters: the model's unfused layout, engine dtype, on the engine's device."""
    from models.loader import init_dummy_model, load_model, resolve_dtype

    if args.model is not None:
        model, _ = load_model(args.model, dtype=args.dtype)
    else:
        model = init_dummy_model(config, dtype=resolve_dtype(args.dtype), seed=1)
    return nnx.state(model)


def _checkpoint(args: argparse.Namespace) -> str:
    if args.model is not None:
        return args.model
    from benchmarks.startup import write_random_checkpoint
    from models.presets import PRESETS

    return str(write_random_checkpoint(PRESETS[args.shape], Path(args.workdir) / f"{args.shape}-{args.dtype}",
                                       dtype=args.dtype))


def _time_updates(llm: LLM, update, repeats: int) -> tuple[float, float]:
    """(first call s, median of the rest s) of ``update()`` until the engine's new buffers are ready."""
    times = [_timed(lambda: (update(), _engine_ready(llm))) for _ in range(repeats + 1)]
    return times[0], statistics.median(times[1:])


def _bytes_in_use(devices) -> int | None:
    counts = [device_bytes_in_use(device) for device in devices]
    return None if None in counts else sum(counts)


def _sleep_phases(llm: LLM, result: dict, devices) -> None:
    runner = llm.llm_engine.engine_core.runner
    result["weight_bytes"] = sum(x.nbytes for x in runner.param_leaves)
    result["kv_pool_bytes"] = sum(k.nbytes + v.nbytes for k, v in runner.kv_pool)
    result["bytes_awake"] = _bytes_in_use(devices)
    result["sleep1_s"] = _timed(lambda: llm.sleep(level=1))
    result["bytes_after_sleep1"] = _bytes_in_use(devices)
    result["wake1_s"] = _timed(lambda: (llm.wake_up(), _engine_ready(llm)))
    result["sleep2_s"] = _timed(lambda: llm.sleep(level=2))
    result["bytes_after_sleep2"] = _bytes_in_use(devices)
    result["wake2_s"] = _timed(lambda: (llm.wake_up(), _engine_ready(llm)))
    if result["bytes_after_sleep2"] is not None:
        result["level2_fraction"] = result["bytes_after_sleep2"] / (result["weight_bytes"] + result["kv_pool_bytes"])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--shape", help="a models/presets.py shape, random weights (e.g. llama-3.1-8b)")
    source.add_argument("--model", help="an HF checkpoint directory")
    parser.add_argument("--workdir", default=None, help="where the random checkpoint and the orbax one are written")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.45,
                        help="the engine's share (weights + KV pool): the rest holds the trainer's copy")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args(argv)
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="weight_update-")

    llm = LLM(model=args.shape or args.model, load_format="dummy" if args.shape else "auto", dtype=args.dtype,
              enable_sleep_mode=True, weight_cache=False, gpu_memory_utilization=args.gpu_memory_utilization,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, tensor_parallel_size=args.tensor_parallel_size,
              use_tqdm=False)
    core = llm.llm_engine.engine_core
    devices = sorted(core.runner.kv_pool[0][0].sharding.device_set, key=lambda d: d.id)
    result: dict = {"device": str(devices[0]), "tensor_parallel_size": args.tensor_parallel_size,
                    "shape": args.shape or args.model, "dtype": args.dtype}

    state = _trainer_state(args, core.model_config)
    result["trainer_bytes"] = sum(x.nbytes for x in jax.tree.leaves(state))
    result["update_first_s"], result["update_s"] = _time_updates(llm, lambda: llm.update_weights(state), args.repeats)

    import orbax.checkpoint as ocp

    orbax_dir = Path(args.workdir) / "orbax"
    if not orbax_dir.exists():
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(orbax_dir, nnx.to_pure_dict(state))
    for leaf in jax.tree.leaves(state):
        leaf.delete()  # from here on the device holds only the engine's buffers
    del state
    checkpoint = _checkpoint(args)
    result["update_disk_first_s"], result["update_disk_s"] = _time_updates(
        llm, lambda: llm.update_weights_from_disk(checkpoint), max(args.repeats - 1, 1))
    result["update_orbax_first_s"], result["update_orbax_s"] = _time_updates(
        llm, lambda: llm.update_weights_from_disk(str(orbax_dir)), max(args.repeats - 1, 1))

    _sleep_phases(llm, result, devices)
    llm.update_weights_from_disk(str(orbax_dir))  # level 2 dropped the weights
    output = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(temperature=0, max_tokens=4,
                                                                               ignore_eos=True), use_tqdm=False)
    result["generated_tokens"] = len(output[0].outputs[0].token_ids)
    result["num_compiles_since_warmup"] = core.runner.num_compiles_since_warmup
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
