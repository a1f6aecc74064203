"""Online serving benchmark for any OpenAI-compatible completions endpoint (ours or vLLM), in vLLM `bench serve` terms.

Requests arrive as a Poisson process at ``--request-rate`` requests/s (``inf``: all at once), optionally capped at
``--max-concurrency`` in flight; each one streams ``/v1/completions`` (token-id prompt, ``ignore_eos``,
``stream_options.include_usage``) with ``benchmarks.sse_client`` (httptools). Per request we record:

* TTFT: time from sending the request to the first streamed chunk with a choice,
* ITL: the gaps between successive such chunks,
* E2E latency: time to the end of the stream,
* TPOT: ``(e2e - ttft) / (output_tokens - 1)`` (output tokens from the final usage chunk).

and report their mean / median / p90 / p99 in milliseconds, plus request, output-token and total-token throughput.

Workloads (benchmarks/workloads.py): ``--dataset nano-vllm`` (256 requests, prompts of randint(100, 1024) ids in
[0, 10000], max_tokens randint(100, 1024), Python ``random`` seeded 0, temperature 0.6) or ``--dataset random``
with ``--num-prompts/--random-input-len/--random-output-len``.

Offline vs served in one invocation (``--shape`` or ``--suite``; engine flags after ``--``): the offline engine
(an ``LLMEngine`` stepped in a loop, at most C requests in it) on nano-vllm's prompts (at least 256 requests, at
least one per stream), then ``python -m serving`` with the same engine flags and the same workload at C concurrent
streams, for each C of ``--concurrency``, then admission bursts (``--burst``: N requests sent at once;
``time_to_admit_all_s`` = from the first send to the last request's response headers, which a streamed response
sends once the engine has accepted the request). One JSON line per figure; served lines carry
``fraction_of_offline`` and ``itl_p99_over_median``. The client runs in ``--num-client-processes`` processes.

Examples:
  python -m benchmarks.serving --shape qwen3-0.6b --concurrency 64 256 512 --burst 256 1024 \\
      --result-file $OUT/serving.json -- --max-num-batched-tokens 2048 --max-model-len 4096 --async-scheduling
  python -m serving --port 8000 &
  python -m benchmarks.serving --base-url http://127.0.0.1:8000 --dataset nano-vllm --request-rate 8
  python -m benchmarks.serving --dataset random --num-prompts 100 --random-input-len 512 --random-output-len 128 \\
      --max-concurrency 16 --result-file results.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

from benchmarks.report import write_json  # noqa: E402
from benchmarks.sse_client import post_sse  # noqa: E402
from benchmarks.workloads import Req, Workload, nanovllm, random_fixed  # noqa: E402

PERCENTILES = (50, 90, 99)
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class RequestResult:
    """What one streamed request measured (times in seconds, from ``time.perf_counter``)."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    start_time: float = 0.0
    headers_time: float = 0.0  # when the response headers arrived (the server has admitted the request)


async def stream_completion(url: str, model: str, req: Req, temperature: float, ignore_eos: bool,
                            headers: dict[str, str]) -> RequestResult:
    """Send one streaming completion and time its chunks (``benchmarks.sse_client``: the client must read every
    event of every stream without becoming the bottleneck)."""
    payload = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens,
               "temperature": temperature, "ignore_eos": ignore_eos, "stream": True,
               "stream_options": {"include_usage": True}}
    result = RequestResult(prompt_len=len(req.prompt_token_ids))
    num_chunks = 0
    start = time.perf_counter()
    result.start_time = start
    last = start

    def on_event(event: bytes, now: float) -> bool:
        nonlocal num_chunks, last
        if not event.startswith(b"data:"):
            return True
        data = event[len(b"data:"):].strip()
        if data == b"[DONE]":
            return False
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = str(chunk["error"])
            return False
        # Every chunk with a choice is a token arrival (as vLLM's bench counts them): text may be empty while the
        # detokenizer holds back an incomplete character, or for a model without tokenizer; a chunk may carry
        # several tokens when the server merged the deltas of a stream that fell behind.
        if chunk.get("choices"):
            if num_chunks == 0:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now
            num_chunks += 1
        usage = chunk.get("usage")
        if usage:
            result.output_tokens = int(usage.get("completion_tokens") or 0)
        return True

    try:
        result.headers_time = await post_sse(url, payload, on_event, headers)
        if result.error:
            return result
        result.latency = time.perf_counter() - start
        if result.output_tokens == 0:  # server without usage in streams: count one token per chunk
            result.output_tokens = num_chunks
        result.success = num_chunks > 0 or result.output_tokens > 0
        if not result.success:
            result.error = "no output"
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def arrival_delays(num_requests: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps between arrivals: gamma-distributed with mean 1/rate (burstiness 1 = Poisson), zero for rate inf."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(num_requests)]


async def run_benchmark(base_url: str, model: str, workload: Workload, *, request_rate: float,
                        max_concurrency: int | None, burstiness: float = 1.0, seed: int = 0,
                        temperature: float | None = None, api_key: str | None = None,
                        num_warmup: int = 1, endpoint: str = "/v1/completions") -> dict[str, Any]:
    """Drive the endpoint with the workload and return the metrics dict (see ``summarize``)."""
    url = base_url.rstrip("/") + endpoint
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    temp = workload.temperature if temperature is None else temperature
    for req in workload.requests[:num_warmup]:  # compile / warm caches outside the clock
        warm = await stream_completion(url, model, Req(req.prompt_token_ids, min(req.max_tokens, 8)), temp,
                                       workload.ignore_eos, headers)
        if not warm.success:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def limited(req: Req) -> RequestResult:
        if semaphore is None:
            return await stream_completion(url, model, req, temp, workload.ignore_eos, headers)
        async with semaphore:
            return await stream_completion(url, model, req, temp, workload.ignore_eos, headers)

    tasks = []
    start = time.perf_counter()
    for req, delay in zip(workload.requests, arrival_delays(len(workload.requests), request_rate, burstiness,
                                                             seed)):
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(limited(req)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    summary = summarize(results, duration)
    summary.update({"base_url": base_url, "endpoint": endpoint, "model": model, "dataset": workload.name,
                    "request_rate": request_rate, "max_concurrency": max_concurrency, "burstiness": burstiness,
                    "temperature": temp})
    return summary


def _stats_ms(name: str, values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {f"mean_{name}_ms": float("nan"), f"median_{name}_ms": float("nan"),
                **{f"p{p}_{name}_ms": float("nan") for p in PERCENTILES}}
    ordered = sorted(values)

    def percentile(p: float) -> float:  # linear interpolation, as numpy.percentile
        rank = (len(ordered) - 1) * p / 100.0
        low = math.floor(rank)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)

    out = {f"mean_{name}_ms": 1000.0 * sum(ordered) / len(ordered), f"median_{name}_ms": 1000.0 * percentile(50)}
    out.update({f"p{p}_{name}_ms": 1000.0 * percentile(p) for p in PERCENTILES})
    return out


def summarize(results: Sequence[RequestResult], duration_s: float) -> dict[str, Any]:
    """vLLM `bench serve`'s metrics from per-request results."""
    ok = [r for r in results if r.success]
    total_output = sum(r.output_tokens for r in ok)
    total_input = sum(r.prompt_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary: dict[str, Any] = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:5],
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else float("nan"),
        "output_throughput": total_output / duration_s if duration_s > 0 else float("nan"),
        "total_token_throughput": (total_input + total_output) / duration_s if duration_s > 0 else float("nan"),
    }
    summary.update(_stats_ms("ttft", [r.ttft for r in ok]))
    summary.update(_stats_ms("tpot", tpots))
    summary.update(_stats_ms("itl", [gap for r in ok for gap in r.itl]))
    summary.update(_stats_ms("e2el", [r.latency for r in ok]))
    return summary


def format_report(summary: dict[str, Any]) -> str:
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]
    rows = [("Successful requests:", summary["completed"]), ("Failed requests:", summary["failed"]),
            ("Benchmark duration (s):", f"{summary['duration_s']:.2f}"),
            ("Total input tokens:", summary["total_input_tokens"]),
            ("Total generated tokens:", summary["total_output_tokens"]),
            ("Request throughput (req/s):", f"{summary['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{summary['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{summary['total_token_throughput']:.2f}")]
    lines += [f"{label:<44}{value:>16}" for label, value in rows]
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append("{s:{c}^60}".format(s=f" {title} ", c="-"))
        for stat in ("mean", "median", *(f"p{p}" for p in PERCENTILES if p != 50)):  # p50 == median
            label = f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} {name.upper()} (ms):"
            lines.append(f"{label:<44}{summary[f'{stat}_{name}_ms']:>16.2f}")
    lines.append("=" * 60)
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ client worker processes
def _worker_main(base_url: str, model: str, requests: list[Req], temperature: float, ignore_eos: bool,
                 max_concurrency: int | None, start_at: float, api_key: str | None) -> list[RequestResult]:
    """One client process: wait until ``start_at`` (``time.perf_counter``, shared by every process on Linux),
    then stream ``requests`` with at most ``max_concurrency`` in flight."""
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/completions"

    async def drive() -> list[RequestResult]:
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def limited(req: Req) -> RequestResult:
            if semaphore is None:
                return await stream_completion(url, model, req, temperature, ignore_eos, headers)
            async with semaphore:
                return await stream_completion(url, model, req, temperature, ignore_eos, headers)

        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        return await asyncio.gather(*[limited(req) for req in requests])

    return run(drive())


def run_in_processes(base_url: str, model: str, requests: Sequence[Req], *, temperature: float, ignore_eos: bool,
                     max_concurrency: int | None, num_processes: int, api_key: str | None = None
                     ) -> tuple[list[RequestResult], float]:
    """Stream ``requests`` (all sent at once, at most ``max_concurrency`` in flight in all) from ``num_processes``
    client processes, so that parsing tens of thousands of SSE chunks a second is not what limits the figures.
    Requests go round-robin to the processes, each with an equal share of the concurrency. Returns the results in
    request order and the duration (first send to last byte, seconds)."""
    import concurrent.futures
    import multiprocessing

    num_processes = max(1, min(num_processes, len(requests), max_concurrency or len(requests)))
    shares = [list(requests[i::num_processes]) for i in range(num_processes)]
    concurrency = [None if max_concurrency is None else
                   max_concurrency // num_processes + (i < max_concurrency % num_processes)
                   for i in range(num_processes)]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(num_processes, mp_context=context) as pool:
        list(pool.map(_ready, range(num_processes)))  # every process started and importing done
        start_at = time.perf_counter() + 0.5
        futures = [pool.submit(_worker_main, base_url, model, share, temperature, ignore_eos, limit, start_at,
                               api_key) for share, limit in zip(shares, concurrency)]
        per_process = [future.result() for future in futures]
    results: list[RequestResult] = [None] * len(requests)  # type: ignore[list-item]
    for i, process_results in enumerate(per_process):
        results[i::num_processes] = process_results
    ends = [r.start_time + r.latency for r in results if r.success]
    duration = (max(ends) if ends else time.perf_counter()) - start_at
    return results, duration


def _ready(_: int) -> bool:
    return True


# ----------------------------------------------------------------------------- offline vs served, in one run
def offline_main(concurrencies: Sequence[int], engine_argv: Sequence[str], num_prompts: int,
                 max_lens: Sequence[int] = (1024, 1024)) -> None:
    """The offline engine (``LLMEngine`` stepped in a loop, no server) on the served workloads: one JSON line per
    concurrency (at most that many requests in the engine, a new one entering as one finishes)."""
    from benchmarks.throughput import _run_with_concurrency
    from paged_jax.engine.llm_engine import LLMEngine
    from paged_jax.sampling_params import SamplingParams
    from serving.cli import parse_serve_args
    from serving.settings import engine_args_from_namespace

    # The flags after `--` are serve's: the server-only ones (e.g. --api-server-count) leave the engine as it is.
    engine = LLMEngine(engine_args_from_namespace(parse_serve_args(engine_argv, "engine flags")[1]), use_tqdm=False)
    warm = nanovllm(4, *max_lens)
    _run_with_concurrency(engine, [{"prompt_token_ids": r.prompt_token_ids} for r in warm.requests],
                          [SamplingParams(temperature=warm.temperature, ignore_eos=True, max_tokens=8)] * 4, 4)
    for concurrency in concurrencies:
        workload = suite_workload(concurrency, num_prompts, max_lens)
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests]
        params = [SamplingParams(temperature=workload.temperature, ignore_eos=workload.ignore_eos,
                                 max_tokens=r.max_tokens, seed=i) for i, r in enumerate(workload.requests)]
        start = time.perf_counter()
        out_tokens = _run_with_concurrency(engine, prompts, params, concurrency)
        elapsed = time.perf_counter() - start
        print(json.dumps({"figure": "offline", "concurrency": concurrency, "num_requests": len(prompts),
                          "output_tokens": out_tokens, "duration_s": elapsed, "output_throughput": out_tokens / elapsed}),
              flush=True)


def suite_workload(concurrency: int, num_prompts: int, max_lens: Sequence[int] = (1024, 1024)) -> Workload:
    """The workload at one concurrency: nano-vllm's, at least ``num_prompts`` requests and at least one per
    stream (``max_lens``: its longest prompt and output)."""
    return nanovllm(max(num_prompts, concurrency), *max_lens)


def wait_for_health(server: subprocess.Popen, base_url: str, timeout_s: float, hint: str = "") -> None:
    """Return once ``base_url``/health answers 200; RuntimeError (with ``hint``) if ``server`` exits or
    ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}; {hint}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not answer /health within {timeout_s} s; {hint}")
        try:
            if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


@contextlib.contextmanager
def launched_server(engine_argv: Sequence[str], port: int, cwd: str, log_path: str, timeout_s: float):
    """``python -m serving`` with ``engine_argv`` on ``port``, from ``cwd``; yields its base URL once /health
    answers 200; stopped with SIGINT (then SIGKILL) at the end."""
    env = dict(os.environ)
    env["PYTHONPATH"] = cwd + os.pathsep + env.get("PYTHONPATH", "")
    command = [sys.executable, "-m", "serving", *engine_argv, "--host", "127.0.0.1", "--port", str(port),
               "--disable-uvicorn-access-log", "--disable-log-stats"]
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        base_url = f"http://127.0.0.1:{port}"
        try:
            wait_for_health(server, base_url, timeout_s, f"see {log_path}")
            yield base_url
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(10)


def burst_admission(base_url: str, model: str, num_requests: int, num_processes: int, max_tokens: int,
                    max_lens: Sequence[int] = (1024, 1024)) -> dict[str, Any]:
    """Send ``num_requests`` streamed completions at once (nano-vllm prompts, ``max_tokens`` each) and time
    admission: ``time_to_admit_all_s`` = from the moment every client starts sending to the last response headers
    (a streamed response's headers leave the server once the engine has accepted the request), plus the time to
    every first token and to the last byte. Every request must complete (nothing dropped)."""
    workload = nanovllm(num_requests, *max_lens)
    requests = [Req(r.prompt_token_ids, max_tokens) for r in workload.requests]
    results, duration = run_in_processes(base_url, model, requests, temperature=workload.temperature,
                                         ignore_eos=True, max_concurrency=None, num_processes=num_processes)
    start = min(r.start_time for r in results)
    ok = [r for r in results if r.success]
    headers = [r.headers_time - start for r in ok]
    first_tokens = [r.start_time + r.ttft - start for r in ok]
    return {"figure": "burst", "num_requests": num_requests, "max_tokens": max_tokens, "completed": len(ok),
            "failed": len(results) - len(ok), "errors": sorted({r.error for r in results if not r.success})[:5],
            "time_to_admit_all_s": max(headers) if headers else float("nan"),
            "median_time_to_headers_s": statistics.median(headers) if headers else float("nan"),
            "time_to_all_first_tokens_s": max(first_tokens) if first_tokens else float("nan"),
            "time_to_all_done_s": duration}


def suite_main(args: argparse.Namespace, engine_argv: list[str]) -> dict[str, Any]:
    """Offline engine, then the server, on one engine configuration: one JSON line per figure."""
    if args.shape:
        engine_argv = ["--model", args.shape, "--load-format", "dummy", *engine_argv]
    repo = _REPO_ROOT  # the engine and the server run from this checkout
    figures: list[dict[str, Any]] = []

    def emit(figure: dict[str, Any]) -> None:
        figures.append(figure)
        print(json.dumps(figure), flush=True)

    offline: dict[int, float] = {}
    if not args.skip_offline:
        env = dict(os.environ)
        env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
        command = [sys.executable, "-m", "benchmarks.serving", "--offline-only",
                   "--concurrency", *map(str, args.concurrency), "--num-prompts", str(args.num_prompts or 256),
                   "--nano-vllm-max-lens", *map(str, args.nano_vllm_max_lens), "--", *engine_argv]
        run = subprocess.run(command, cwd=repo, env=env, stdout=subprocess.PIPE, text=True)
        for line in run.stdout.splitlines():
            if line.startswith("{"):
                figure = json.loads(line)
                offline[figure["concurrency"]] = figure["output_throughput"]
                emit(figure)
        if run.returncode != 0:
            raise RuntimeError(f"the offline run failed (exit code {run.returncode})")
    log_path = args.server_log or os.path.join(tempfile.gettempdir(), f"paged-jax-serve-{os.getpid()}.log")
    with launched_server(engine_argv, args.port, repo, log_path, args.server_timeout) as base_url:
        model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        warm = nanovllm(args.num_client_processes, *args.nano_vllm_max_lens)
        run_in_processes(base_url, model, [Req(r.prompt_token_ids, 8) for r in warm.requests],
                         temperature=warm.temperature, ignore_eos=True, max_concurrency=None,
                         num_processes=args.num_client_processes)
        for concurrency in args.concurrency:
            workload = suite_workload(concurrency, args.num_prompts or 256, args.nano_vllm_max_lens)
            results, duration = run_in_processes(base_url, model, workload.requests, temperature=workload.temperature,
                                                 ignore_eos=workload.ignore_eos, max_concurrency=concurrency,
                                                 num_processes=args.num_client_processes)
            summary = summarize(results, duration)
            figure = {"figure": "served", "concurrency": concurrency, "num_requests": len(workload.requests),
                      **{k: v for k, v in summary.items() if not k.startswith("mean_")}}
            if concurrency in offline:
                figure["offline_output_throughput"] = offline[concurrency]
                figure["fraction_of_offline"] = summary["output_throughput"] / offline[concurrency]
            figure["itl_p99_over_median"] = summary["p99_itl_ms"] / summary["median_itl_ms"]
            emit(figure)
        for num_requests in args.burst:
            emit(burst_admission(base_url, model, num_requests, args.num_client_processes, args.burst_max_tokens,
                                 args.nano_vllm_max_lens))
    result = {"engine_argv": engine_argv, "figures": figures}
    write_json(args.result_file, result, indent=2)
    return result


def build_workload(args: argparse.Namespace) -> Workload:
    if args.dataset == "nano-vllm":
        return nanovllm(args.num_prompts or 256)
    if args.dataset == "random":
        return random_fixed(args.num_prompts or 100, args.random_input_len, args.random_output_len, seed=args.seed)
    raise ValueError(f"dataset must be nano-vllm or random, got {args.dataset!r}")


def first_served_model(base_url: str, api_key: str | None) -> str:
    """The first model id of the server's ``GET /v1/models``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    listing = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30).json()
    return listing["data"][0]["id"]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--model", default=None, help="model id to send (default: the first of GET /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--dataset", default="nano-vllm", choices=["nano-vllm", "random"])
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf = all at once")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 = Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None, help="default: the workload's")
    parser.add_argument("--num-warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-file", default=None, help="write the metrics as JSON here")
    suite = parser.add_argument_group(
        "offline vs served in one run (engine flags after `--`, given to the offline engine and to the server)")
    suite.add_argument("--shape", default=None,
                       help="run the suite on this model shape with dummy weights (models/presets.py); same as "
                            "`-- --model SHAPE --load-format dummy`")
    suite.add_argument("--suite", action="store_true", help="run the suite on the engine flags after `--`")
    suite.add_argument("--concurrency", type=int, nargs="+", default=[64, 256, 512],
                       help="concurrent streams of the served runs (and in-engine requests of the offline ones)")
    suite.add_argument("--burst", type=int, nargs="*", default=[256, 1024],
                       help="sizes of the admission bursts (requests sent at once)")
    suite.add_argument("--burst-max-tokens", type=int, default=16)
    suite.add_argument("--nano-vllm-max-lens", type=int, nargs=2, default=[1024, 1024], metavar=("INPUT", "OUTPUT"),
                       help="longest prompt and output of the nano-vllm workload (its own: 1024 1024; smaller for a "
                            "smoke test on a small --max-model-len)")
    suite.add_argument("--num-client-processes", type=int, default=4,
                       help="client processes that send the requests and parse the streams")
    suite.add_argument("--port", type=int, default=8011)
    suite.add_argument("--server-log", default=None, help="the server's output (default: a file in the temp dir)")
    suite.add_argument("--server-timeout", type=float, default=1800.0, help="seconds to wait for /health")
    suite.add_argument("--skip-offline", action="store_true")
    suite.add_argument("--offline-only", action="store_true", help=argparse.SUPPRESS)  # the suite's offline part
    argv = list(sys.argv[1:] if argv is None else argv)
    engine_argv: list[str] = []
    if "--" in argv:
        argv, engine_argv = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = parser.parse_args(argv)
    if args.offline_only:
        offline_main(args.concurrency, engine_argv, args.num_prompts or 256, args.nano_vllm_max_lens)
        return {}
    if args.shape or args.suite:
        if min(args.concurrency) < 1 or any(n < 1 for n in args.burst):
            parser.error("--concurrency and --burst take positive counts")
        return suite_main(args, engine_argv)
    if engine_argv:
        parser.error("engine flags after `--` need --shape or --suite")
    if not args.request_rate > 0:
        parser.error(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.burstiness <= 0:
        parser.error(f"--burstiness must be > 0, got {args.burstiness}")
    workload = build_workload(args)
    model = args.model or first_served_model(args.base_url, args.api_key)
    summary = asyncio.run(run_benchmark(
        args.base_url, model, workload, request_rate=args.request_rate, max_concurrency=args.max_concurrency,
        burstiness=args.burstiness, seed=args.seed, temperature=args.temperature, api_key=args.api_key,
        num_warmup=args.num_warmup, endpoint=args.endpoint))
    print(format_report(summary))
    write_json(args.result_file, summary, indent=2)
    return summary


if __name__ == "__main__":
    main()
