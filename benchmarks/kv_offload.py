"""The prefix cache's host-memory tier (``--kv-offloading-size``) on a multi-turn chat workload whose conversations
outgrow the device's KV pool (issue 52): time to first token of the turns after the first, and throughput, without
and with the tier, on one engine configuration.

``--conversations`` chats of ``--turns`` turns each; every conversation reaches ``--context-len`` tokens by its last
turn (``--output-len`` generated tokens a turn, or a length drawn from ``--random-range-ratio``'s range around it, the
rest of each turn's share of the context a new user message of random token ids, after a ``--system-len``-token
system prompt shared by all; all drawn up front from ``--seed``). A turn's prompt is its conversation
so far, so it shares everything but its new message with the conversation's previous turn. At most
``--max-concurrency`` turns run at once, and a conversation's next turn is queued when its previous one ends, behind
every other conversation's (round robin): between two turns of a conversation all the others pass through the pool,
so with more conversation than the device holds the prefix cache has evicted a turn's prefix by the time it
returns. Without the tier the turn recomputes it; with it, the prefix is loaded back from host memory. Turns of one
length end together, so their conversations' next turns arrive together and share their first step: each later turn
then waits for its whole burst's prefill, in both configurations alike; ``--random-range-ratio`` (e.g. 0.5) spreads
the turns' ends, so that a turn's time to first token follows its own prefill (and loads).

A turn's time to first token runs from ``add_request`` to the step output that carries its first token. Each
configuration runs in its own process (default; ``--in-process`` runs both here, for a CPU smoke run), so the second
engine sizes its pool on a device the first has left. Reports, per configuration, the median (and p90) time to first
token of the first turns and of the later turns, output and total tokens per second, the prefix-cache counters and
the tier's, and ``later_ttft_speedup`` = median later-turn TTFT without / with the tier (issue 52's target on the
GPU: >= 2). ``ttft_later_turns_parts`` (and a line on stderr per configuration) splits the later turns' time to first
token: the queue (to the start of the step that first schedules the turn: no seat, no budget or no free device blocks
for it), then the steps to its first token (how many; the host time they spent on the tier's copies);
``ttft_median_by_turn_s`` the median of each turn (the last turns, the longest, wait longest for free blocks).
The run with the tier also reports (``copies``, and lines on stderr) the bytes it loaded and saved, the step time
spent dispatching those copies (``host_work``: the compiled gathers / scatters and ``device_put`` calls, the seconds
before the forwards and after them, the waits for copies in flight past the cap), and the achieved host <-> device
copy bandwidth: after the workload, ``--bandwidth-blocks`` of the tier's host blocks go through the host pool's own
transfers each way, timed to completion (GB/s, to set against the link's ceiling).

Engine flags as ``paged-jax serve`` takes them (``--model``, ``--load-format dummy``, ``--max-model-len``, ...);
``--kv-offloading-size`` is the tier's size in the run with the tier (required).

Examples:
  python -m benchmarks.kv_offload --model llama-3.1-8b --load-format dummy --max-model-len 4096 \\
      --gpu-memory-utilization 0.45 --kv-offloading-size 48 --conversations 96 --turns 4 --context-len 4096 \\
      --max-concurrency 24 --random-range-ratio 0.5 --async-scheduling --out $OUT/kv_offload.json
CPU smoke run (tests/test_benchmarks.py): a tiny checkpoint, ``--num-gpu-blocks-override`` a few blocks,
``--in-process``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import numpy as np

from benchmarks.report import versions, write_json
from paged_jax.core.request import RequestStatus
from paged_jax.entrypoints.cli import add_engine_args, engine_kwargs, normalize_flag_spelling


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_offload", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--conversations", type=int, default=200)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--context-len", type=int, default=4096, help="tokens of a conversation after its last turn")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated each turn (the mean, with "
                   "--random-range-ratio)")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="each turn's output length is drawn uniformly from [output_len * (1 - R), output_len * "
                   "(1 + R)] (vLLM's benchmark flag; its user message takes the rest of the turn's share): turns of "
                   "equal length end in lockstep and arrive in bursts")
    p.add_argument("--system-len", type=int, default=0, help="tokens of the system prompt every conversation shares")
    p.add_argument("--max-concurrency", type=int, default=32, help="turns running at once")
    p.add_argument("--bandwidth-blocks", type=int, default=512,
                   help="host blocks the copy bandwidth measurement after the tier's run moves each way")
    p.add_argument("--in-process", action="store_true", help="run both configurations in this process")
    p.add_argument("--only", choices=["baseline", "tier"], help=argparse.SUPPRESS)  # one configuration (a child)
    p.add_argument("--out", help="write the JSON result here")
    add_engine_args(p.add_argument_group("engine (EngineArgs, vLLM names)"))
    return p


def _turn_len(args: argparse.Namespace) -> int:
    """Tokens each turn adds to its conversation: its user message and its output."""
    per_turn = (args.context_len - args.system_len) // args.turns
    longest_output = int(args.output_len * (1 + args.random_range_ratio))
    if not 0 <= args.random_range_ratio < 1:
        raise SystemExit(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if per_turn - longest_output < 1:
        raise SystemExit(f"--context-len {args.context_len} leaves {per_turn} tokens a turn, not more than the longest "
                         f"output ({longest_output}: --output-len {args.output_len}, --random-range-ratio "
                         f"{args.random_range_ratio})")
    return per_turn


def draw_workload(args: argparse.Namespace, vocab: int) -> tuple[list[int], list[list[tuple[list[int], int]]]]:
    """The system prompt and each conversation's turns ``(user message, output length)``, drawn up front (the engine's
    --seed seeds them) so that both configurations run the same workload whatever order their turns end in."""
    rng = np.random.default_rng(args.seed)
    per_turn = _turn_len(args)
    low = int(args.output_len * (1 - args.random_range_ratio))
    high = int(args.output_len * (1 + args.random_range_ratio))
    system = rng.integers(1, vocab, size=args.system_len).tolist()
    turns = []
    for _ in range(args.conversations):
        output_lens = rng.integers(max(low, 1), high + 1, size=args.turns).tolist()
        turns.append([(rng.integers(1, vocab, size=per_turn - n).tolist(), n) for n in output_lens])
    return system, turns


class TurnTimes:
    """Where a later turn's time to first token goes, from the in-process engine's scheduler: the queue (from
    ``add_request`` to the start of the step that first schedules it) and the steps from then to its first token
    (how many, and the host time they spent on the host tier's copies: dispatching them, and waiting for copies in
    flight past the cap)."""

    def __init__(self, engine) -> None:
        self.scheduler = engine.engine_core.scheduler
        self.host_pool = engine.engine_core.runner.host_pool
        self.first_scheduled: dict[str, float] = {}
        self.steps: dict[str, int] = collections.Counter()
        self.copy_seconds: dict[str, float] = collections.Counter()
        self.parts = {"queue_s": [], "scheduled_to_token_s": [], "copies_s": [], "steps": []}
        self._step_start = self._copies_before = 0.0

    def before_step(self) -> None:
        self._step_start = time.perf_counter()
        self._copies_before = self.host_pool.swap_seconds if self.host_pool is not None else 0.0

    def after_step(self, waiting_for_token: list[str]) -> None:
        """After a step: the requests still without a token that it scheduled (the first time, or again)."""
        copies = (self.host_pool.swap_seconds if self.host_pool is not None else 0.0) - self._copies_before
        for request_id in waiting_for_token:
            request = self.scheduler.requests.get(request_id)
            if request_id not in self.first_scheduled and (request is None or request.num_computed_tokens
                                                           or request.status == RequestStatus.RUNNING):
                self.first_scheduled[request_id] = self._step_start
            if request_id in self.first_scheduled:
                self.steps[request_id] += 1
                self.copy_seconds[request_id] += copies

    def first_token(self, request_id: str, added: float, now: float) -> None:
        scheduled = self.first_scheduled.get(request_id, self._step_start)
        self.parts["queue_s"].append(scheduled - added)
        self.parts["scheduled_to_token_s"].append(now - scheduled)
        self.parts["copies_s"].append(self.copy_seconds[request_id])
        self.parts["steps"].append(self.steps[request_id])

    def summary(self) -> dict:
        return {name: {"median": statistics.median(values), "mean": statistics.fmean(values)}
                for name, values in self.parts.items() if values}


def run_chat(engine, args: argparse.Namespace, vocab: int) -> dict:
    """Drive the workload through ``engine``; -> per-turn TTFTs, the later turns' ``TurnTimes``, token counts and
    wall time."""
    from paged_jax.sampling_params import SamplingParams

    system, turns = draw_workload(args, vocab)
    histories = [list(system) for _ in range(args.conversations)]
    turn_of = [0] * args.conversations
    ready = collections.deque(range(args.conversations))
    in_flight: dict[str, tuple[int, float]] = {}  # request id -> (conversation, added at)
    outputs: dict[str, list[int]] = {}
    ttft = {"first": [], "later": []}
    by_turn = [[] for _ in range(args.turns)]
    times = TurnTimes(engine)
    prompt_tokens = output_tokens = 0
    start = time.perf_counter()
    while ready or in_flight:
        while ready and len(in_flight) < args.max_concurrency:
            c = ready.popleft()
            message, output_len = turns[c][turn_of[c]]
            histories[c] += message
            request_id = f"c{c}t{turn_of[c]}"
            params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
            engine.add_request(request_id, {"prompt_token_ids": list(histories[c])}, params)
            in_flight[request_id] = (c, time.perf_counter())
            prompt_tokens += len(histories[c])
        times.before_step()
        step_outputs = engine.step()
        now = time.perf_counter()
        times.after_step([r for r in in_flight if not outputs.get(r)])
        for out in step_outputs:
            c, added = in_flight[out.request_id]
            tokens = outputs.setdefault(out.request_id, [])
            if not tokens and out.outputs[0].token_ids:
                ttft["first" if turn_of[c] == 0 else "later"].append(now - added)
                by_turn[turn_of[c]].append(now - added)
                if turn_of[c]:
                    times.first_token(out.request_id, added, now)
            tokens.extend(out.outputs[0].token_ids)
            if out.finished:
                del in_flight[out.request_id]
                histories[c] += tokens
                output_tokens += len(tokens)
                turn_of[c] += 1
                if turn_of[c] < args.turns:
                    ready.append(c)
    wall = time.perf_counter() - start
    return {"ttft": ttft, "later_parts": times.summary(), "wall_s": wall, "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "ttft_median_by_turn_s": [statistics.median(values) if values else None for values in by_turn]}


def _summary(run: dict, stats: dict) -> dict:
    def quantiles(values: list[float]) -> dict:
        if not values:
            return {"median_s": None, "p90_s": None}
        return {"median_s": statistics.median(values), "p90_s": float(np.percentile(values, 90))}

    wall = run["wall_s"]
    keys = ("prefix_cache_queries", "prefix_cache_hits", "external_prefix_cache_queries",
            "external_prefix_cache_hits", "num_offloaded_blocks", "num_onloaded_blocks", "num_preemptions",
            "num_gpu_blocks", "num_offload_blocks", "num_compiles_since_warmup")
    return {"ttft_first_turn": quantiles(run["ttft"]["first"]), "ttft_later_turns": quantiles(run["ttft"]["later"]),
            "ttft_later_turns_parts": run["later_parts"], "ttft_median_by_turn_s": run["ttft_median_by_turn_s"],
            "wall_s": wall, "output_tokens_per_s": run["output_tokens"] / wall,
            "total_tokens_per_s": (run["prompt_tokens"] + run["output_tokens"]) / wall,
            "prompt_tokens": run["prompt_tokens"], "output_tokens": run["output_tokens"],
            **{key: stats[key] for key in keys if key in stats}}


def _gb_per_s(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else float("inf")


def copy_bandwidth(host_pool, num_blocks: int, trials: int = 3) -> dict:
    """The host KV pool's own transfers, timed to completion: up to ``num_blocks`` saved host blocks fetched to the
    device (host -> device) and those device blocks put back in host memory (device -> host), best of ``trials``;
    -> GB/s each way (1e9 bytes), the blocks, their bytes and the host memory kind."""
    import jax

    host_pool.flush()
    ids = [h for h in range(host_pool.num_blocks) if host_pool.block_array(h) is not None][:num_blocks]
    if not ids:
        return {}
    num_bytes, loaded_before = len(ids) * host_pool.block_bytes, host_pool.bytes_loaded
    h2d = d2h = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        on_device = jax.block_until_ready(host_pool.fetch(ids))
        h2d = min(h2d, time.perf_counter() - start)
        host_sharding = on_device[0].sharding.with_memory_kind(host_pool.memory_kind)
        start = time.perf_counter()
        jax.block_until_ready(jax.device_put(on_device, host_sharding))
        d2h = min(d2h, time.perf_counter() - start)
        del on_device
    host_pool.bytes_loaded = loaded_before  # the measurement is not the workload's
    return {"host_to_device_gb_per_s": _gb_per_s(num_bytes, h2d), "device_to_host_gb_per_s": _gb_per_s(num_bytes, d2h),
            "blocks": len(ids), "block_bytes": host_pool.block_bytes, "memory_kind": host_pool.memory_kind}


def _copy_summary(host_pool, args: argparse.Namespace) -> dict:
    """What the run copied each way, the host time its steps spent dispatching the copies, and ``copy_bandwidth``."""
    return {"loaded_gb": host_pool.bytes_loaded / 1e9, "saved_gb": host_pool.bytes_saved / 1e9,
            "swap_dispatch_s": host_pool.swap_seconds, "host_work": dict(host_pool.counts),
            **copy_bandwidth(host_pool, args.bandwidth_blocks)}


def _print_copies(copies: dict) -> None:
    work = copies["host_work"]
    if work.get("steps"):
        print(f"host tier copies' host work over {work['steps']} steps with copies: {work.get('programs', 0)} gathers "
              f"/ scatters and {work.get('transfers', 0)} device_put calls ({work.get('blocks_loaded', 0)} blocks "
              f"loaded, {work.get('blocks_saved', 0)} saved); {work.get('swap_dispatch_s', 0):.2f} s before the "
              f"forwards, {work.get('save_dispatch_s', 0):.2f} s after them (the saves' transfers), of which "
              f"{work.get('waits', 0)} waits for copies past the in-flight cap took {work.get('wait_s', 0):.2f} s",
              file=sys.stderr)
    if "host_to_device_gb_per_s" not in copies:
        return
    print(f"host tier copies: {copies['loaded_gb']:.3g} GB loaded, {copies['saved_gb']:.3g} GB saved, "
          f"{copies['swap_dispatch_s']:.2f} s of step time dispatching them; achieved bandwidth over "
          f"{copies['blocks']} blocks of {copies['block_bytes']} bytes ({copies['memory_kind']}): host -> device "
          f"{copies['host_to_device_gb_per_s']:.3g} GB/s, device -> host {copies['device_to_host_gb_per_s']:.3g} GB/s",
          file=sys.stderr)


def _print_parts(name: str, summary: dict) -> None:
    """One line: the later turns' median time to first token and its parts (``TurnTimes``)."""
    parts = summary["ttft_later_turns_parts"]
    if not parts:
        return
    median = summary["ttft_later_turns"]["median_s"]
    print(f"{name}: later-turn TTFT median {median:.3f} s = queue (to the step that first schedules it) median "
          f"{parts['queue_s']['median']:.3f} s (mean {parts['queue_s']['mean']:.3f}) + scheduled to first token median "
          f"{parts['scheduled_to_token_s']['median']:.3f} s (mean {parts['scheduled_to_token_s']['mean']:.3f}) over "
          f"{parts['steps']['mean']:.2f} steps on average, of which host time on the tier's copies median "
          f"{parts['copies_s']['median']:.3f} s (mean {parts['copies_s']['mean']:.3f})", file=sys.stderr)


def run_config(args: argparse.Namespace, tier: bool) -> dict:
    """One configuration in this process: the engine flags, with the tier or without (with it, ``copies``: what the
    tier copied and the copies' bandwidth, measured after the workload)."""
    from paged_jax.config import EngineArgs
    from paged_jax.engine.llm_engine import LLMEngine

    kwargs = engine_kwargs(args)
    if not tier:
        kwargs["kv_offloading_size"] = None
    engine = LLMEngine(EngineArgs(**kwargs), use_tqdm=False)
    try:
        runner = engine.engine_core.runner
        summary = _summary(run_chat(engine, args, runner.vocab_size), engine.engine_core.stats())
        _print_parts("tier" if tier else "baseline", summary)
        if tier:
            summary["copies"] = _copy_summary(runner.host_pool, args)
            _print_copies(summary["copies"])
    finally:
        engine.close()
    return summary


def _without(argv: Sequence[str], flag: str, takes_value: bool) -> list[str]:
    """``argv`` less ``flag`` (``--flag value`` or ``--flag=value``) and ``--in-process``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = takes_value
        elif not arg.startswith(flag + "=") and arg != "--in-process":
            out.append(arg)
    return out


def _run_child(argv: Sequence[str], only: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        subprocess.run([sys.executable, "-m", "benchmarks.kv_offload", *argv, "--only", only, "--out", out],
                       check=True)
        with open(out) as f:
            return json.load(f)


def main(argv: Sequence[str] | None = None) -> dict:
    argv = normalize_flag_spelling(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    if not args.kv_offloading_size:
        raise SystemExit("--kv-offloading-size: the tier's size (GiB) in the run with the tier is required")
    _turn_len(args)
    if args.only:
        result = run_config(args, tier=args.only == "tier")
        write_json(args.out, result)
        return result
    child_argv = _without(argv, "--out", takes_value=True)  # each child writes its own file
    runs = {name: (run_config(args, tier=name == "tier") if args.in_process else _run_child(child_argv, name))
            for name in ("baseline", "tier")}
    base, tier = (runs[name]["ttft_later_turns"]["median_s"] for name in ("baseline", "tier"))
    result = {"argv": argv, "versions": versions(), **runs,
              "later_ttft_speedup": base / tier if base and tier else None,
              "throughput_ratio": runs["tier"]["total_tokens_per_s"] / runs["baseline"]["total_tokens_per_s"]}
    print(json.dumps(result, indent=1))
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
