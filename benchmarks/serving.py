"""Online serving benchmark for any OpenAI-compatible completions endpoint (ours or vLLM), in vLLM `bench serve` terms.

Requests arrive as a Poisson process at ``--request-rate`` requests/s (``inf``: all at once), optionally capped at
``--max-concurrency`` in flight; each one streams ``/v1/completions`` (token-id prompt, ``ignore_eos``,
``stream_options.include_usage``) over httpx. Per request we record:

* TTFT: time from sending the request to the first streamed chunk with a choice,
* ITL: the gaps between successive such chunks,
* E2E latency: time to the end of the stream,
* TPOT: ``(e2e - ttft) / (output_tokens - 1)`` (output tokens from the final usage chunk).

and report their mean / median / p90 / p99 in milliseconds, plus request, output-token and total-token throughput.

Workloads (benchmarks/workloads.py): ``--dataset nano-vllm`` (256 requests, prompts of randint(100, 1024) ids in
[0, 10000], max_tokens randint(100, 1024), Python ``random`` seeded 0, temperature 0.6) or ``--dataset random``
with ``--num-prompts/--random-input-len/--random-output-len``.

Examples:
  python -m serving --port 8000 &
  python -m benchmarks.serving --base-url http://127.0.0.1:8000 --dataset nano-vllm --request-rate 8
  python -m benchmarks.serving --dataset random --num-prompts 100 --random-input-len 512 --random-output-len 128 \\
      --max-concurrency 16 --result-file results.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import sys
import time
from typing import Any, Sequence

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

from benchmarks.report import write_json  # noqa: E402
from benchmarks.workloads import Req, Workload, nanovllm, random_fixed  # noqa: E402

PERCENTILES = (50, 90, 99)


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


async def stream_completion(client: httpx.AsyncClient, url: str, model: str, req: Req, temperature: float,
                            ignore_eos: bool, headers: dict[str, str]) -> RequestResult:
    """Send one streaming completion and time its chunks."""
    payload = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens,
               "temperature": temperature, "ignore_eos": ignore_eos, "stream": True,
               "stream_options": {"include_usage": True}}
    result = RequestResult(prompt_len=len(req.prompt_token_ids))
    num_chunks = 0
    start = time.perf_counter()
    result.start_time = start
    last = start
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = await response.aread()
                result.error = f"HTTP {response.status_code}: {body[:300]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                now = time.perf_counter()
                # Every chunk with a choice is a token arrival (as vLLM's bench counts them): text may be empty
                # while the detokenizer holds back an incomplete character, or for a model without tokenizer.
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
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        for req in workload.requests[:num_warmup]:  # compile / warm caches outside the clock
            warm = await stream_completion(client, url, model, Req(req.prompt_token_ids, min(req.max_tokens, 8)),
                                           temp, workload.ignore_eos, headers)
            if not warm.success:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def limited(req: Req) -> RequestResult:
            if semaphore is None:
                return await stream_completion(client, url, model, req, temp, workload.ignore_eos, headers)
            async with semaphore:
                return await stream_completion(client, url, model, req, temp, workload.ignore_eos, headers)

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


def build_workload(args: argparse.Namespace) -> Workload:
    if args.dataset == "nano-vllm":
        return nanovllm(args.num_prompts or 256)
    if args.dataset == "random":
        return random_fixed(args.num_prompts or 100, args.random_input_len, args.random_output_len, seed=args.seed)
    raise ValueError(f"dataset must be nano-vllm or random, got {args.dataset!r}")


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
    args = parser.parse_args(argv)
    if not args.request_rate > 0:
        parser.error(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.burstiness <= 0:
        parser.error(f"--burstiness must be > 0, got {args.burstiness}")
    workload = build_workload(args)
    model = args.model
    if model is None:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        listing = httpx.get(args.base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30).json()
        model = listing["data"][0]["id"]
    summary = asyncio.run(run_benchmark(
        args.base_url, model, workload, request_rate=args.request_rate, max_concurrency=args.max_concurrency,
        burstiness=args.burstiness, seed=args.seed, temperature=args.temperature, api_key=args.api_key,
        num_warmup=args.num_warmup, endpoint=args.endpoint))
    print(format_report(summary))
    write_json(args.result_file, summary, indent=2)
    return summary


if __name__ == "__main__":
    main()
