"""Host overhead of one engine decode step, with the device wait split out (issue 8).

Builds ``LLMEngine`` on a tiny random Qwen3 config (``--num-layers``, default 2; vocab 1024, dummy weights; CPU is
fine), fills it with ``--num-seqs`` running sequences (random prompts, temperature sampling, ignore_eos), runs the
prefill steps, then times ``--steps`` decode steps. Every phase of a step is timed with ``time.perf_counter``:

* ``wait_ms``: inside ``PendingStep.result()`` (block on the device + device->host copy): device time, not host work.
* ``schedule_ms``, ``execute_ms`` (host packing + dispatch; ``dispatch_ms`` is the part inside the two jitted calls,
  ``packing_ms`` the rest), ``update_ms`` (scheduler update), ``outputs_ms``
  (per-token bookkeeping, detokenization and ``RequestOutput`` construction: everything of the step after the wait
  except the scheduler update).
* ``host_ms`` = step time - wait time.
* ``*_cpu_ms``: the same phases in this thread's CPU time (``time.thread_time``), which other processes on a shared
  machine inflate far less than wall time; ``host_cpu_ms`` = the step's minus the wait's.

Each is the median over the timed steps (``host_ms_mean`` is the mean), so other processes on a shared machine
skew it less.

Also reports the number of executables compiled at start-up and, for the given (max_num_batched_tokens,
max_num_seqs) pairs of ``--plan``, how many ``warm_up`` would compile (from the bucket plan, without compiling).

Example: ``JAX_PLATFORMS=cpu python -m benchmarks.host_overhead --num-seqs 256 --steps 40``. Prints one JSON line.
On a CPU backend add ``--isolate-host`` (``isolate_host``): the step's computation otherwise runs on the same cores
while the host phases are timed and inflates them; with it the phases are the host work alone, as an accelerator
host sees it (``--finished-only`` is how ``LLM.generate`` and benchmarks/throughput.py step the engine).
``--speculative-config JSON`` (vLLM's flag) times the steps with speculation on and reports their draft counters
(``speculative_decoding``): with ``{"method": "ngram", "num_speculative_tokens": 4}`` (n-grams of 5) the random
prompts and outputs propose no drafts, so the figures are what speculation costs a step that proposes nothing.

``--stream-outputs`` measures instead what streaming every running request's delta costs per step, in microseconds
per running stream per step (medians): ``--steps`` steps as ``LLM.generate`` runs them (``step(finished_only=True)``:
``offline``), then ``--steps`` steps as a server with its core in another process runs them (``core_process``):
``host_us`` (the core step minus the device wait), ``encode_us`` and ``write_us`` (the ``EngineCoreOutputs``
message and the pipe write; a thread here drains the other end): ``core_process_us``; ``decode_us`` and
``outputs_us`` (the output processor's delta ``RequestOutput`` s): ``api_server_us``; ``gc_us_mean`` (garbage
collection during the step, a mean: collections are rare and long); ``full_gc_ms``: one full collection before and
after ``serving.lifecycle.freeze_gc_heap`` (run before the ``core_process`` steps, as the core process runs it).
The tokenizer is the built-in SmolLM2's (``--tokenizer``), so texts are detokenized and streamed as served. One JSON
line: ``{"benchmark": "stream_outputs", "offline": {...}, "core_process": {...}, ...}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from typing import Any

import numpy as np


def _timed(owner, name: str, totals: dict[str, float], key: str) -> None:
    """Replace ``owner.name`` by a wrapper adding its wall time to ``totals[key]`` and, where ``totals`` has the key
    ``key + "_cpu"``, its thread CPU time there."""
    original = getattr(owner, name)
    cpu_key = key + "_cpu"

    def wrapper(*args, **kwargs):
        start, cpu_start = time.perf_counter(), time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start
            if cpu_key in totals:
                totals[cpu_key] += time.thread_time() - cpu_start

    # A compiled step function: the wrapper reports the compiles ModelRunner counts for it (an ahead-of-time table's
    # calls that compiled, else jit's cache), so num_compiles_since_warmup stays true under instrumentation.
    counter = getattr(original, "jit_compiles", None) or getattr(original, "_cache_size", None)
    if counter is not None:
        wrapper._cache_size = counter
    setattr(owner, name, wrapper)


PHASES = ("wait", "schedule", "execute", "dispatch", "update")


def instrument_phases(engine, totals: dict[str, float]) -> None:
    """Time the phases of ``engine``'s steps into ``totals`` (seconds, keys ``PHASES``): device wait, scheduling,
    ``execute`` (packing + dispatch), the jitted dispatch alone, and the scheduler update."""
    from paged_jax.worker import step_io

    for key in PHASES:
        totals.setdefault(key, 0.0)
    _timed(engine.engine_core.runner, "_forward", totals, "dispatch")
    _timed(engine.engine_core.runner, "_sample", totals, "dispatch")
    _timed(step_io.PendingStep, "result", totals, "wait")
    _timed(engine.engine_core.scheduler, "schedule", totals, "schedule")
    _timed(engine.engine_core.runner, "execute", totals, "execute")
    _timed(engine.engine_core.scheduler, "update_from_output", totals, "update")


def measure_stream_outputs(engine, num_steps: int) -> dict[str, Any]:
    """On an engine whose requests all keep running: ``num_steps`` steps with ``finished_only=True`` (offline), then
    ``num_steps`` as a server with its core in another process runs them: the core's step and its
    ``EngineCoreOutputs`` encoded and written to a pipe (the core process's work), then decoded and turned into delta
    ``RequestOutput`` s by the output processor (the API server's work); microseconds per running stream per step
    (medians) of each part, and the message size."""
    import multiprocessing
    import threading

    from paged_jax.engine.messages import CORE_MESSAGE_DECODER, EngineCoreOutputs, encode
    from serving.lifecycle import freeze_gc_heap

    reader, writer = multiprocessing.Pipe(duplex=False)
    received: list[bytes] = []

    def drain() -> None:
        try:
            while data := reader.recv_bytes():
                received.append(data)
        except EOFError:
            pass

    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()
    totals: dict[str, float] = {"gc": 0.0}
    gc_started = [0.0]

    def time_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            totals["gc"] += time.perf_counter() - gc_started[0]

    gc.callbacks.append(time_gc)
    instrument_phases(engine, totals)
    core = engine.engine_core

    def run(mode: str) -> dict[str, float]:
        parts: dict[str, list[float]] = {"host": [], "gc": [], "encode": [], "write": [], "decode": [],
                                         "outputs": []}
        sizes, streams = [], []
        for _ in range(num_steps):
            before, start = dict(totals), time.perf_counter()
            if mode == "offline":
                engine.step(finished_only=True)
                parts["host"].append(time.perf_counter() - start - (totals["wait"] - before["wait"]))
                parts["gc"].append(totals["gc"] - before["gc"])
                streams.append(max(engine.stats()["num_running"], 1))
                continue
            core_outputs = core.step()
            stepped_at = time.perf_counter()
            payload = encode(EngineCoreOutputs(core_outputs, dict(core.stats())))
            encoded_at = time.perf_counter()
            writer.send_bytes(payload)
            written_at = time.perf_counter()
            message = CORE_MESSAGE_DECODER.decode(payload)
            decoded_at = time.perf_counter()
            engine.output_processor.process_outputs(message.outputs)
            parts["host"].append(stepped_at - start - (totals["wait"] - before["wait"]))
            parts["gc"].append(totals["gc"] - before["gc"])
            parts["encode"].append(encoded_at - stepped_at)
            parts["write"].append(written_at - encoded_at)
            parts["decode"].append(decoded_at - written_at)
            parts["outputs"].append(time.perf_counter() - decoded_at)
            streams.append(max(len(core_outputs), 1))
            sizes.append(len(payload) / streams[-1])
        per_stream = np.asarray(streams, dtype=np.float64)
        figures = {f"{key}_us": round(float(np.median(np.asarray(values) / per_stream)) * 1e6, 2)
                   for key, values in parts.items() if values and key != "gc"}
        figures["gc_us_mean"] = round(float(np.mean(np.asarray(parts["gc"]) / per_stream)) * 1e6, 2)  # rare, long
        if sizes:
            figures["core_process_us"] = round(figures["encode_us"] + figures["write_us"], 2)
            figures["api_server_us"] = round(figures["decode_us"] + figures["outputs_us"], 2)
            figures["message_bytes_per_stream"] = round(float(np.median(sizes)), 1)
        return figures

    result: dict[str, Any] = {"offline": run("offline")}

    # The core process freezes its start-up heap before serving (serving.lifecycle.freeze_gc_heap); what one full
    # collection (a pause of every stream) costs without and with that.
    def full_gc_ms() -> float:
        start = time.perf_counter()
        gc.collect()
        return round((time.perf_counter() - start) * 1e3, 2)

    result["full_gc_ms"] = {"unfrozen": full_gc_ms()}
    freeze_gc_heap()
    result["core_process"] = run("core_process")
    result["full_gc_ms"]["frozen"] = full_gc_ms()  # what the core-process steps left, less what froze
    gc.unfreeze()
    gc.callbacks.remove(time_gc)
    writer.send_bytes(b"")
    drainer.join(10)
    return result


def isolate_host(engine, totals: dict[str, float]) -> None:
    """Make every ``runner.execute`` (after ``instrument_phases``) wait until its step's device work is done, that wait
    counted as ``totals["wait"]`` (its thread CPU time as ``totals["wait_cpu"]``): on a CPU backend the model's
    computation then never runs while the host phases are timed (there it competes with them for the same cores; an
    accelerator runs it beside them)."""
    import concurrent.futures

    import jax

    execute = engine.engine_core.runner.execute

    def execute_then_wait(scheduler_output, *args, **kwargs):
        handle = execute(scheduler_output, *args, **kwargs)
        if handle is None:  # a step without rows (swap copies or dropped rows only): nothing dispatched
            return None
        start, cpu_start = time.perf_counter(), time.thread_time()
        outputs = handle._device_outputs  # None while a deferred (grammar) step's sampling is not dispatched
        if isinstance(outputs, concurrent.futures.Future):
            outputs = outputs.result()
        jax.block_until_ready(outputs if outputs is not None else engine.engine_core.runner.kv_pool)
        totals["wait"] += time.perf_counter() - start
        if "wait_cpu" in totals:  # the wait's own CPU (polling the device) is no host work either
            totals["wait_cpu"] += time.thread_time() - cpu_start
        return handle

    engine.engine_core.runner.execute = execute_then_wait


def planned_compiles(max_num_batched_tokens: int, max_num_seqs: int, swap: bool = False) -> int:
    """Executables ``ModelRunner.warm_up`` compiles for this step shape (without building a model)."""
    from paged_jax.worker.buckets import planned_num_compiles

    return planned_num_compiles(max_num_batched_tokens, max_num_seqs, swap=swap)


def fill_decoding(llm, num_seqs: int, num_steps: int, max_num_batched_tokens: int, max_model_len: int) -> None:
    """Add ``num_seqs`` requests (random prompts, temperature sampling, ignore_eos, room for ``num_steps`` decode steps
    after the prefill) to ``llm``'s engine and step it until every running sequence decodes, then 3 steps more."""
    from paged_jax import SamplingParams

    engine = llm.llm_engine
    rng = random.Random(0)
    # Nobody finishes during the timed steps, however many steps the prompts' prefill takes.
    prefill_steps = -(-num_seqs * 150 // max_num_batched_tokens)
    max_tokens = num_steps + 40 + prefill_steps
    max_prompt = max(8, min(150, max_model_len - max_tokens - 1))
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(max_prompt // 3, max_prompt))]
               for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens, seed=i)
              for i in range(num_seqs)]
    llm.generate([{"prompt_token_ids": q} for q in prompts[:4]], params[:4], use_tqdm=False)  # untimed warm-up
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params[i])
    # Until every running sequence decodes (the last prompts' chunks are done): the timed steps are decode steps.
    while True:
        num_outputs = len(engine.step())
        stats = engine.stats()
        if stats["num_waiting"] == 0 and num_outputs >= stats["num_running"]:
            break
    for _ in range(3):
        engine.step()


def time_decode_steps(engine, max_steps: int, isolate: bool, finished_only: bool) -> tuple[dict, int, int]:
    """Time up to ``max_steps`` steps of ``engine`` -> (per-step medians in ms of each phase, wall and thread CPU
    (``PHASES``, ``host``, ``packing``, ``outputs``, ``host_cpu``), with ``host_ms_mean``; steps run; outputs)."""
    totals = {"step": 0.0, "step_cpu": 0.0, **{f"{key}_cpu": 0.0 for key in PHASES}}
    instrument_phases(engine, totals)
    if isolate:
        isolate_host(engine, totals)
    num_steps = num_outputs = 0
    samples: dict[str, list[float]] = {key: [] for key in totals}
    while engine.has_unfinished_requests() and num_steps < max_steps:
        before = dict(totals)
        step_start, cpu_start = time.perf_counter(), time.thread_time()
        num_outputs += len(engine.step(finished_only=finished_only))
        totals["step"] += time.perf_counter() - step_start
        totals["step_cpu"] += time.thread_time() - cpu_start
        for key in totals:
            samples[key].append(totals[key] - before[key])
        num_steps += 1

    # Medians over the steps: this machine's cores are shared, so means are skewed by other processes.
    steps = {key: np.asarray(values) for key, values in samples.items()}
    derived = {
        "host": steps["step"] - steps["wait"],
        # Packing = execute minus the jitted calls (on CPU a dispatch may also run part of the computation inline).
        "packing": steps["execute"] - steps["dispatch"],
        "outputs": steps["step"] - steps["wait"] - steps["schedule"] - steps["execute"] - steps["update"],
        "host_cpu": steps["step_cpu"] - steps["wait_cpu"],
    }
    per_step = {f"{key}_ms": round(float(np.median(values)) * 1e3, 3) for key, values in {**steps, **derived}.items()}
    per_step["host_ms_mean"] = round(float(derived["host"].mean()) * 1e3, 3)
    return per_step, num_steps, num_outputs


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=256, help="running sequences during the timed decode steps")
    p.add_argument("--steps", type=int, default=40, help="timed decode steps")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=2,
                   help="decoder layers of the tiny model (28 = Qwen3-0.6B's count: the forward's dispatch handles "
                        "every layer's weights and KV arrays, so dispatch_ms grows with it)")
    p.add_argument("--async-scheduling", action="store_true")
    p.add_argument("--isolate-host", action="store_true",
                   help="wait for each step's device work right after its dispatch (counted as wait_ms), so that on a "
                        "CPU backend the computation does not slow the timed host phases (isolate_host)")
    p.add_argument("--finished-only", action="store_true",
                   help="call step(finished_only=True), as LLM.generate does (no per-step snapshots of running requests)")
    p.add_argument("--stream-outputs", action="store_true",
                   help="measure the engine process's per-step cost of streaming outputs (see above)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer for --stream-outputs (default: the built-in SmolLM2's; 'none': token ids only)")
    p.add_argument("--speculative-config", metavar="JSON",
                   help="vLLM's --speculative-config, e.g. "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}': the timed steps run with "
                        "speculation on; the result has their draft counters "
                        "(speculative_decoding: spec_decode_num_drafts 0 means the steps proposed nothing)")
    p.add_argument("--plan", default="2048x256,8192x256",
                   help="comma-separated TOKENSxSEQS shapes whose warm-up compile count is reported")
    args = p.parse_args(argv)
    if args.num_seqs < 1 or args.steps < 1:
        raise ValueError("--num-seqs and --steps must be >= 1")

    from benchmarks.report import speculation_stats
    from models.testing import tiny_config
    from paged_jax import LLM

    model_dir = tempfile.mkdtemp(prefix="paged_jax_host_overhead_")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(tiny_config("Qwen3ForCausalLM", vocab_size=1024, num_hidden_layers=args.num_layers,
                              max_position_embeddings=max(512, args.max_model_len)), f)  # room for --max-model-len

    tokenizer = None
    if args.stream_outputs and args.tokenizer != "none":
        from models.smollm2 import ensure_smollm2

        tokenizer = args.tokenizer or str(ensure_smollm2())
    start = time.perf_counter()
    llm = LLM(model=model_dir, load_format="dummy", dtype="float32", max_num_seqs=args.num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
              async_scheduling=args.async_scheduling, use_tqdm=False, tokenizer=tokenizer,
              speculative_config=args.speculative_config)
    startup_s = time.perf_counter() - start
    engine = llm.llm_engine
    compiles_at_startup = engine.engine_core.runner.num_compiles()

    fill_decoding(llm, args.num_seqs, args.steps * (4 if args.stream_outputs else 1), args.max_num_batched_tokens,
                  args.max_model_len)
    running = engine.stats()["num_running"]
    if args.stream_outputs:
        result = {"benchmark": "stream_outputs", "num_seqs_running": running, "decode_steps": args.steps,
                  **measure_stream_outputs(engine, args.steps), "async_scheduling": args.async_scheduling,
                  "tokenizer": tokenizer}
        print(json.dumps(result))
        return result

    stats_before = engine.stats()
    per_step, num_steps, num_outputs = time_decode_steps(engine, args.steps, args.isolate_host, args.finished_only)
    speculation = (speculation_stats(engine.stats(), stats_before) if args.speculative_config else None)
    plan = {}
    for shape in filter(None, args.plan.split(",")):
        tokens, seqs = (int(v) for v in shape.lower().split("x"))
        plan[shape] = planned_compiles(tokens, seqs)
    result = {"benchmark": "host_overhead", "num_seqs_running": running, "decode_steps": num_steps,
              "outputs_per_step": round(num_outputs / num_steps, 1), **per_step,
              "startup_s": round(startup_s, 2), "compiles_at_startup": compiles_at_startup,
              "planned_compiles": plan, "async_scheduling": args.async_scheduling,
              "finished_only": args.finished_only, "isolate_host": args.isolate_host,
              "speculative_config": args.speculative_config, "speculative_decoding": speculation}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
