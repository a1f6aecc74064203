"""Engine start-up with and without the converted-weights cache (models.weight_cache).

Every start is a fresh child process constructing an ``LLMEngine``; three modes, ``--repeats`` times each, in the
order no_cache, cold, warm:
  no_cache: ``weight_cache=False`` (safetensors -> conversion, nothing written);
  cold:     cache on, no entry (conversion, then the orbax save);
  warm:     cache on, entry present (orbax restore straight into the target shardings, no safetensors read).
Reported per mode (medians, and every run): ``model_load_s`` (the engine's weight loading,
``startup_timings["model_load_s"]``),
``engine_init_s`` (the whole ``LLMEngine(...)``: weights, KV pool, compilation of every step bucket) and
``process_s`` (child start to engine ready, imports included); cold also ``convert_s`` / ``save_s``, warm
``restore_s``. Before the timed runs one start with dummy weights of the same shape fills JAX's persistent
compilation cache, so every timed run sees it warm and the modes differ only in how the weights arrive. The OS page
cache is left as it is: the checkpoint (and the cache entry) are usually in memory after their first read.

With ``--shape`` (a models/presets.py name) there are no real weights: a safetensors checkpoint of random weights in
that shape is written first (numpy writer, ``--checkpoint-dtype``, shards of at most 5 GB; reused if already there).

Two more modes time JAX's persistent compilation cache (the weights cache warm in both):
  compile_cold: an empty compilation cache of its own (every executable compiles, ``PAGED_JAX_COMPILE_THREADS``
                at a time);
  compile_warm: the shared compilation cache, filled by the starts before (every executable loaded from the
                runner's executable cache, ``paged_jax.worker.executable_cache``, or else from JAX's cache).
Every start also reports per phase: ``imports_s`` (child start to ``LLMEngine(...)``), the engine's stages
(``engine_backend_s``, ``engine_load_s``, ``engine_kv_sizing_s``, ``engine_runner_init_s``, ``engine_warm_up_s``,
``engine_other_s`` the rest; ``LLMEngine.startup_timings``), ``model_load_s``, ``warm_up_compile_s`` (the
concurrent compiles, or loads: ``executables_loaded`` of them came from the executable cache),
``kv_pool_s``, ``warm_up_run_s`` (one run of each executable),
``first_token_s`` (ready -> the first token of a 4-token greedy request) and ``process_to_first_token_s`` (child
start to that token, imports included; ``cpu_to_first_token_s``: the CPU seconds the child used until then),
``process_to_all_ready_s`` / ``all_ready_s`` (child start / ready -> every
step executable ready: with background compilation, the default, the engine serves after ``first_executables`` and
compiles ``background_executables`` while it serves; ``--no-background-compilation``: all before serving); ``compile_threads``, ``num_compiles`` and the compilation cache's
``compile_cache_requests`` / ``_hits`` / ``_misses`` with ``compile_cache_missed`` (the executables that missed),
``compile_jobs`` (every warm-up compile job, ``[label, start s, seconds, lowering s]`` by end time: a cold start's
critical path)
and ``num_gpu_blocks`` (the KV pool's block count, a compiled shape).

``--serve`` times each start as ``paged-jax serve`` instead (``python -m serving`` with the same engine flags):
``process_to_first_token_s`` to the response of a one-token completion, ``process_to_all_ready_s`` to the engine's
log line saying every step executable is ready, then SIGTERM (``exit_s``, ``exit_code``). ``--load-format dummy``
with ``--shape``: random weights made at load, nothing written (the compile modes only).

Examples (one command each; prints one JSON line):
  python -m benchmarks.startup --model ~/.cache/paged_jax/SmolLM2-135M-Instruct --repeats 2
  python -m benchmarks.startup --shape llama-3.1-8b --workdir /tmp/startup   # GPU: writes ~16 GB, then times
  python -m benchmarks.startup --shape qwen3-0.6b --modes compile_cold,compile_warm --repeats 3 \
      --max-num-batched-tokens 2048 --max-model-len 4096
  python -m benchmarks.startup --modes compile_cold --repeats 1 --no-compile-warmup [--serve]   # CPU, built-in model
  python -m benchmarks.startup --shape llama-3.1-8b --load-format dummy --modes compile_cold --repeats 1 \
      --no-compile-warmup --max-model-len 4096 [--serve]   # GPU: first token, every bucket ready
Figures: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import time

_T_PROCESS_START = time.perf_counter()  # before jax is imported: a child's process_s counts from here

import argparse
import json
import logging
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

MODES = ("no_cache", "cold", "warm", "compile_cold", "compile_warm")
_MAX_SHARD_BYTES = 5 * 1024 ** 3
_POOL_ELEMENTS = 1 << 22  # distinct random values, cycled through to fill every tensor


# --------------------------------------------------------------------------------------------------------------------
# A random checkpoint in a given shape
# --------------------------------------------------------------------------------------------------------------------

def write_random_checkpoint(hf_config: dict, out_dir: str | os.PathLike, *, dtype: str = "bfloat16",
                            seed: int = 0, max_shard_bytes: int = _MAX_SHARD_BYTES) -> Path:
    """Write an HF safetensors checkpoint of ``hf_config``'s shape with random weights, without torch.

    Matrices hold N(0, 0.02) values (a pool of 4M random values cycled from a per-tensor offset, so writing 16 GB is
    disk-bound, not RNG-bound), norms and biases the loader's dummy constants (``models.loader.dummy_fill``: norms 1,
    or 0 where they scale by 1 + weight; biases 0). Tensor names and shapes come from the model itself
    (``models.loader.checkpoint_tensor_shapes``), so every supported architecture works. Written into a staging
    directory and renamed, so an existing ``out_dir`` is always complete (then it is returned as is).

    Args:
      hf_config: an HF ``config.json`` dict (e.g. ``models.presets.PRESETS[name]``).
      out_dir: the checkpoint directory.
      dtype: "bfloat16", "float16" or "float32" (the safetensors dtype).
      max_shard_bytes: above this total the checkpoint is split into ``model-0000i-of-0000n.safetensors`` + index.
    Returns:
      ``out_dir``.
    """
    import jax.numpy as jnp
    import ml_dtypes
    from flax import nnx

    from models.architectures import model_class
    from models.config import ModelConfig
    from models.llama import INIT_STD
    from models.loader import checkpoint_tensor_shapes, dummy_fill

    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    np_dtype, tag = {"bfloat16": (np.dtype(ml_dtypes.bfloat16), "BF16"), "float16": (np.dtype(np.float16), "F16"),
                     "float32": (np.dtype(np.float32), "F32")}[dtype]
    config = ModelConfig.from_hf_config(hf_config)
    abstract = nnx.eval_shape(lambda: model_class(config)(config, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    tensors = []  # (hf name, hf shape, fill: None = random)
    for path, variable in nnx.to_flat_state(nnx.state(abstract)):
        fill = dummy_fill(path, config)
        tensors += [(name, shape, fill)
                    for name, shape in checkpoint_tensor_shapes(config, path, tuple(variable.get_value().shape))]

    shards, current, current_bytes = [], [], 0
    for tensor in tensors:
        nbytes = int(np.prod(tensor[1])) * np_dtype.itemsize
        if current and current_bytes + nbytes > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(tensor)
        current_bytes += nbytes
    shards.append(current)

    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(2 * _POOL_ELEMENTS, dtype=np.float32) * INIT_STD).astype(np_dtype)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.writing-", dir=out_dir.parent))
    try:
        weight_map = {}
        for index, shard in enumerate(shards):
            file_name = ("model.safetensors" if len(shards) == 1
                         else f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors")
            _write_safetensors(staging / file_name, shard, np_dtype, tag, pool, rng)
            weight_map.update({name: file_name for name, _, _ in shard})
        if len(shards) > 1:
            (staging / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}, indent=1))
        (staging / "config.json").write_text(json.dumps({**hf_config, "torch_dtype": dtype}, indent=1))
        os.chmod(staging, 0o755)
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _write_safetensors(path: Path, tensors: list, np_dtype: np.dtype, tag: str, pool: np.ndarray,
                       rng: np.random.Generator) -> None:
    """One safetensors file: 8-byte header length, JSON header (padded to 8 bytes), then each tensor's bytes."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in tensors:
        nbytes = int(np.prod(shape)) * np_dtype.itemsize
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(len(header_bytes).to_bytes(8, "little"))
        f.write(header_bytes)
        for name, shape, fill in tensors:
            remaining = int(np.prod(shape))
            if fill is not None:
                f.write(np.full(remaining, fill, np_dtype).tobytes())
                continue
            start = int(rng.integers(_POOL_ELEMENTS))
            while remaining:
                chunk = min(remaining, _POOL_ELEMENTS)
                f.write(pool[start:start + chunk].tobytes())
                remaining -= chunk


# --------------------------------------------------------------------------------------------------------------------
# One engine start (child process)
# --------------------------------------------------------------------------------------------------------------------

class _CacheEvents(logging.Handler):
    """Collects models.weight_cache's timings from its log records (hit: restore s; miss: convert s, save s)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.timings: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.msg
        if message.startswith("weights cache hit"):
            self.timings["restore_s"] = record.args[1]
        elif message.startswith("weights converted") and "cached to" in message:
            self.timings["convert_s"], self.timings["save_s"] = record.args[0], record.args[2]


class _CompileCacheEvents(logging.Handler):
    """Counts JAX's persistent compilation cache requests and hits (jax.monitoring events) and collects the names
    of the executables that missed it (jax._src.compiler's DEBUG line written on a miss)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.requests = self.hits = 0
        self.missed: list[str] = []

    def on_event(self, name: str, **_) -> None:
        if name == "/jax/compilation_cache/compile_requests_use_cache":
            self.requests += 1
        elif name == "/jax/compilation_cache/cache_hits":
            self.hits += 1

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("PERSISTENT COMPILATION CACHE MISS"):
            self.missed.append(str(record.args[0]) if record.args else record.getMessage())


def _cpu_seconds() -> float:
    """CPU seconds (user + system) this process has used: on a shared machine, the work behind a wall time."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _child(engine_kwargs: dict) -> dict:
    from jax import monitoring

    from paged_jax.config import EngineArgs
    from paged_jax.engine.llm_engine import LLMEngine
    from paged_jax.sampling_params import SamplingParams

    logging.basicConfig(format="%(name)s: %(message)s")  # shows the cache's INFO lines below on stderr
    events = _CacheEvents()
    cache_logger = logging.getLogger("models.weight_cache")
    cache_logger.addHandler(events)
    cache_logger.setLevel(logging.INFO)
    compile_cache = _CompileCacheEvents()
    monitoring.register_event_listener(compile_cache.on_event)
    compiler_logger = logging.getLogger("jax._src.compiler")
    compiler_logger.addHandler(compile_cache)
    compiler_logger.setLevel(logging.DEBUG)
    compiler_logger.propagate = False
    start = time.perf_counter()
    engine = LLMEngine(EngineArgs(**engine_kwargs), use_tqdm=False)
    ready = time.perf_counter()
    stages = engine.startup_timings
    # The first token: one greedy request of a few prompt tokens, to its first output.
    engine.add_request("first-token", [1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=1))
    while not engine.step():
        pass
    first_token = time.perf_counter()
    cpu_to_first_token = _cpu_seconds()
    runner = engine.engine_core.runner
    if runner.background is not None:  # the rest of the step executables, compiling in the background
        runner.background.wait()
    all_ready = time.perf_counter()
    warm_up = runner.warm_up_timings
    return {"model_load_s": engine.startup_timings["model_load_s"], "engine_init_s": ready - start,
            "imports_s": start - _T_PROCESS_START, **{f"engine_{k}": v for k, v in stages.items()},
            "engine_other_s": ready - start - sum(stages.values()),
            "warm_up_compile_s": warm_up.get("compile_s"), "kv_pool_s": warm_up.get("kv_pool_s"),
            "executables_loaded": warm_up.get("executables_loaded"),
            "warm_up_run_s": warm_up.get("run_s"), "first_token_s": first_token - ready,
            "process_s": ready - _T_PROCESS_START, "process_to_first_token_s": first_token - _T_PROCESS_START,
            "process_to_all_ready_s": all_ready - _T_PROCESS_START, "all_ready_s": all_ready - ready,
            "cpu_to_first_token_s": cpu_to_first_token, "cpu_to_all_ready_s": _cpu_seconds(),
            "first_executables": warm_up.get("first_executables"),
            "background_executables": warm_up.get("background_executables"),
            "compile_threads": warm_up.get("threads"), "num_compiles": runner.num_compiles(),
            "compile_jobs": warm_up.get("compile_jobs"),
            "num_gpu_blocks": runner.num_blocks,  # a compiled shape: must be the same on every start
            "num_compiles_since_warmup": runner.num_compiles_since_warmup,
            "compile_cache_requests": compile_cache.requests, "compile_cache_hits": compile_cache.hits,
            "compile_cache_misses": compile_cache.requests - compile_cache.hits,
            "compile_cache_missed": compile_cache.missed, **events.timings}


def _run_child(engine_kwargs: dict, env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.startup", "--child", json.dumps(engine_kwargs)],
                          env=env, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# The engine's line once every step executable is ready: the background thread's last, or (compiled before serving)
# the start-up's last.
_ALL_READY = {True: re.compile(r"all \d+ step executables ready"), False: re.compile(r"Compiled in ")}


def _serve_flags(engine_kwargs: dict) -> list[str]:
    flags = []
    for key, value in engine_kwargs.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def _run_serve(engine_kwargs: dict, env: dict, timeout: float = 1800.0) -> dict:
    """One ``paged-jax serve`` start (``python -m serving``, its engine flags from ``engine_kwargs``): seconds from
    the process start to the first token of a one-token completion (``process_to_first_token_s``) and to the
    engine's line saying every step executable is ready (``process_to_all_ready_s``); then SIGTERM
    (``exit_s``: until the server has exited, ``exit_code``)."""
    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "serving", "--host", "127.0.0.1", "--port", str(port),
                             *_serve_flags(engine_kwargs)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    all_ready: list[float] = []

    def read_log() -> None:
        for line in proc.stderr:
            sys.stderr.write(line)
            if not all_ready and _ALL_READY[engine_kwargs.get("background_compilation", True)].search(line):
                all_ready.append(time.perf_counter() - start)
    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    result: dict = {}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            while "process_to_first_token_s" not in result:
                if proc.poll() is not None or time.perf_counter() - start > timeout:
                    raise RuntimeError(f"the server exited or never answered (exit code {proc.poll()})")
                try:
                    model = client.get("/v1/models").json()["data"][0]["id"]
                    response = client.post("/v1/completions", json={"model": model, "prompt": [1, 2, 3, 4],
                                                                     "max_tokens": 1, "temperature": 0})
                except (httpx.HTTPError, KeyError, ValueError):
                    time.sleep(0.05)
                    continue
                if response.status_code == 200:
                    result["process_to_first_token_s"] = time.perf_counter() - start
                else:
                    time.sleep(0.05)
        while not all_ready and proc.poll() is None and time.perf_counter() - start < timeout:
            time.sleep(0.05)
        result["process_to_all_ready_s"] = all_ready[0] if all_ready else None
    finally:
        stop = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        try:
            result["exit_code"] = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            result["exit_code"] = proc.wait()
        result["exit_s"] = time.perf_counter() - stop
        reader.join(timeout=5)
    return result


# --------------------------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------------------------

def _dir_gib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1024 ** 3


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", help=argparse.SUPPRESS)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="HF checkpoint directory (default: the built-in SmolLM2-135M-Instruct)")
    src.add_argument("--shape", help="models/presets.py name: write a random checkpoint of that shape first")
    p.add_argument("--workdir", help="holds the random checkpoint and the weights cache (default: a temp dir; the "
                                     "cache part is always emptied first)")
    p.add_argument("--checkpoint-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--no-compile-warmup", action="store_true",
                   help="skip the dummy-weights start that fills the compilation cache")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tokenizer", help="tokenizer directory or repo id (default: the checkpoint's)")
    p.add_argument("--compile-threads", type=int,
                   help="PAGED_JAX_COMPILE_THREADS for every start (default: the engine's, from the CPU count)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy (with --shape): random weights made at load, no checkpoint written, no weights cache")
    p.add_argument("--no-background-compilation", action="store_true",
                   help="compile every step executable before serving (the engine's --no-background-compilation)")
    p.add_argument("--serve", action="store_true",
                   help="time each start as `paged-jax serve` (python -m serving) answering a one-token completion")
    p.add_argument("--out", help="also write the JSON here")
    return p


def main(argv: list[str] | None = None) -> dict:
    p = _parser()
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return {}

    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= set(MODES):
        p.error(f"--modes must be a subset of {','.join(MODES)}")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="paged_jax_startup_"))
    workdir.mkdir(parents=True, exist_ok=True)
    result: dict = {"argv": sys.argv[1:] if argv is None else argv}
    dummy = args.load_format == "dummy"
    if dummy:
        checkpoint = args.shape or p.error("--load-format dummy needs --shape")
    elif args.shape:
        from models.presets import PRESETS

        start = time.perf_counter()
        checkpoint = workdir / f"{args.shape}-random-{args.checkpoint_dtype}"
        reused = (checkpoint / "config.json").is_file()
        write_random_checkpoint(PRESETS[args.shape.lower()], checkpoint, dtype=args.checkpoint_dtype)
        result["checkpoint_write_s"] = None if reused else time.perf_counter() - start
    elif args.model:
        checkpoint = Path(args.model)
    else:
        from models.smollm2 import ensure_smollm2

        checkpoint = ensure_smollm2()  # resolved before PAGED_JAX_CACHE is pointed at the workdir below
    result.update({"checkpoint": str(checkpoint), "checkpoint_gib": None if dummy else round(_dir_gib(checkpoint), 3)})

    cache_root = workdir / "cache"
    shutil.rmtree(cache_root, ignore_errors=True)
    env = {**os.environ, "PAGED_JAX_CACHE": str(cache_root)}
    if args.compile_threads is not None:
        env["PAGED_JAX_COMPILE_THREADS"] = str(args.compile_threads)
    compile_cache = cache_root / "jax_cache"  # shared by every start but compile_cold's
    engine_kwargs = {"model": str(checkpoint), "dtype": args.dtype, "tensor_parallel_size": args.tensor_parallel_size,
                     "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
                     "max_num_batched_tokens": args.max_num_batched_tokens, "tokenizer": args.tokenizer,
                     "compilation_cache_dir": str(compile_cache), "load_format": args.load_format,
                     "background_compilation": not args.no_background_compilation}
    if not args.no_compile_warmup and set(modes) - {"compile_cold"}:
        # Dummy weights unless only the compilation cache is timed: then this start fills the weights cache too.
        result["compile_warmup"] = _run_child({**engine_kwargs, "load_format": "dummy"} if set(modes) & {
            "no_cache", "cold", "warm"} else {**engine_kwargs, "weight_cache": True}, env)

    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    weights_dir = cache_root / "weights"
    for repeat in range(args.repeats):
        for mode in modes:
            kwargs = {**engine_kwargs, "weight_cache": mode != "no_cache" and not dummy}
            if mode == "cold":
                shutil.rmtree(weights_dir, ignore_errors=True)
            if mode == "compile_cold":  # an empty compilation cache of its own: every executable compiles
                kwargs["compilation_cache_dir"] = str(cache_root / f"jax_cache_cold_{repeat}")
                shutil.rmtree(kwargs["compilation_cache_dir"], ignore_errors=True)
            if mode != "cold" and kwargs["weight_cache"] and not (weights_dir.is_dir() and any(weights_dir.iterdir())):
                _run_child(kwargs, env)  # a warm weights cache needs an entry: make one, untimed
                if mode == "compile_cold":  # ... without leaving its executables to the timed start
                    shutil.rmtree(kwargs["compilation_cache_dir"], ignore_errors=True)
            runs[mode].append(_run_serve(kwargs, env) if args.serve else _run_child(kwargs, env))
    for mode, mode_runs in runs.items():
        keys = sorted({k for run in mode_runs for k, v in run.items() if isinstance(v, (int, float))})
        result[mode] = {**{k: round(statistics.median(run[k] for run in mode_runs), 3) for k in keys},
                        "runs": mode_runs}
    if weights_dir.is_dir():
        result["cache_entry_gib"] = round(_dir_gib(weights_dir), 3)

    from benchmarks.report import versions as _versions

    result["versions"] = _versions()
    line = json.dumps(result)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")
    return result


if __name__ == "__main__":
    main()
