"""The serving path's host cost without a model: can the server (and the benchmark client) carry the offline engine's
token rate?

A model-free core (``ModelFreeCore``: one token per running request per step, at a fixed step rate) runs in the
engine process behind the real core client pipe (``serving.engine_process.start_engine_process``), the real app (``serving.app.create_app``) and uvicorn as
``paged-jax serve`` configures it; benchmarks/serving.py's client streams ``/v1/completions`` from
``--num-client-processes`` processes. At C concurrent streams and R steps/s the engine offers C x R tokens/s; the
figure is how many of them reach the clients, and the CPU seconds per 1,000 delivered tokens of each process (the
server's event-loop thread and its other threads, i.e. the engine-client thread, the engine process, the clients).
A process near one CPU second per wall second is the bottleneck. Runs on CPU; no accelerator is used.
``--api-server-count N`` puts N API server processes in front of the engine process (serve's flag,
``serving.api_servers``); ``server_event_loop`` is then the sum over the servers and ``server_<i>_event_loop`` each
one's.

One JSON line per concurrency:
  {"figure": "serving_host", "concurrency", "api_server_count", "steps_per_s", "offered_tokens_per_s",
   "output_throughput", "fraction_of_offered", "median_itl_ms", "p99_itl_ms", "cpu_ms_per_1k_tokens": {...},
   "cpu_util": {...}}

Example:
  python -m benchmarks.serving_host --concurrency 256 512 --steps-per-s 90 --max-tokens 256 --api-server-count 2
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys
import time
from typing import Any, Sequence

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.workloads import Req  # noqa: E402

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ModelFreeCore:
    """``EngineCore``'s interface without a model, for measuring the serving path alone.

    Each ``step()`` waits for the next tick of a fixed step rate (a slower caller just gets the next step at once),
    moves waiting requests into the running set (at most ``engine_args.max_num_seqs``, first come first served) and
    gives every running request one token (id ``token_id``) as an ``EngineCoreOutput``; a request finishes with
    "length" after ``params.max_tokens`` tokens. No tokenizer: token-id prompts only, outputs without text.
    """

    def __init__(self, engine_args: Any, use_tqdm: bool = False, *, steps_per_s: float, token_id: int = 1000) -> None:
        from paged_jax.engine.messages import EngineCoreInfo, EngineCoreOutput

        self._output_cls = EngineCoreOutput
        self.engine_args = engine_args
        self.info = EngineCoreInfo(max_model_len=engine_args.max_model_len or 4096, vocab_size=32000,
                                   eos_token_ids=[], max_num_seqs=engine_args.max_num_seqs or 256,
                                   max_num_batched_tokens=8192, max_logprobs=20, model_path=None,
                                   generation_config={})
        self.tokenizer = None
        self._period = 1.0 / steps_per_s
        self._token_id = token_id
        self._max_running = self.info.max_num_seqs
        self._waiting: collections.OrderedDict[str, list] = collections.OrderedDict()
        self._running: dict[str, list] = {}
        self._next_step = time.perf_counter()
        self.num_steps = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def add_requests(self, requests) -> None:
        for request in requests:
            if request.request_id in self._waiting or request.request_id in self._running:
                raise ValueError(f"request_id {request.request_id!r} is already in use")
            max_tokens = request.sampling_params.max_tokens or 16
            self._waiting[request.request_id] = [len(request.prompt_token_ids), max_tokens, 0]

    def abort_requests(self, request_ids=(), sequences=()) -> None:
        for request_id in [*request_ids, *(r for r, _ in sequences)]:
            self._waiting.pop(request_id, None)
            self._running.pop(request_id, None)

    def step(self) -> list:
        now = time.perf_counter()
        if now < self._next_step:
            time.sleep(self._next_step - now)
        self._next_step = max(self._next_step + self._period, time.perf_counter())
        wall = time.time()
        first = set()
        while self._waiting and len(self._running) < self._max_running:
            request_id, state = self._waiting.popitem(last=False)
            self.prompt_tokens_total += state[0]
            self._running[request_id] = state
            first.add(request_id)
        outputs = []
        self.generation_tokens_total += len(self._running)  # one token each
        for request_id, state in list(self._running.items()):
            state[2] += 1
            finished = state[2] >= state[1]
            if finished:
                del self._running[request_id]
            outputs.append(self._output_cls(request_id, 0, [self._token_id], "length" if finished else None,
                                            scheduled_time=wall if request_id in first else None))
        self.num_steps += 1
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._waiting or request_id in self._running

    def get_num_unfinished_requests(self) -> int:
        return len(self._waiting) + len(self._running)

    def stats(self) -> dict[str, float]:
        return {"num_running": len(self._running), "num_waiting": len(self._waiting),
                "num_unfinished_requests": self.get_num_unfinished_requests(), "kv_cache_usage": 0.0,
                "num_preemptions": 0, "num_swap_outs": 0, "num_swap_ins": 0, "num_gpu_blocks": 1, "num_cpu_blocks": 0,
                "prefix_cache_queries": 0, "prefix_cache_hits": 0, "prompt_tokens_total": self.prompt_tokens_total,
                "generation_tokens_total": self.generation_tokens_total, "num_steps": self.num_steps,
                "num_compiles_since_warmup": 0}


# ------------------------------------------------------------------------------------------------ the server
def serve(port: int, steps_per_s: float, max_num_seqs: int, api_server_count: int = 1,
          pid_file: str | None = None) -> int:
    """The real app and uvicorn (``paged-jax serve``'s configuration) over a ``ModelFreeCore`` in the engine
    process, with ``api_server_count`` API server processes (``--api-server-count``; 1: the server in this process);
    runs until SIGINT. ``pid_file``: where to write ``{"servers": [pid, ...], "engine": pid}`` once started."""
    import logging

    from paged_jax.config import EngineArgs
    from serving.app import create_app
    from serving.cli import bind_socket, parse_serve_args
    from serving.engine_process import start_engine_process
    from serving.lifecycle import ServingServer
    from serving.settings import uvicorn_config

    logging.basicConfig(level=logging.WARNING)
    engine_args = EngineArgs(model="model-free", load_format="dummy", max_num_seqs=max_num_seqs, max_model_len=4096,
                             disable_log_stats=True)
    core_factory = functools.partial(ModelFreeCore, steps_per_s=steps_per_s)
    _, args = parse_serve_args(["--host", "127.0.0.1", "--port", str(port), "--uvicorn-log-level", "warning",
                                "--disable-uvicorn-access-log", "--shutdown-timeout", "5",
                                "--api-server-count", str(api_server_count)])

    def write_pids(engine_pid: int, server_pids: list[int]) -> None:
        if pid_file:
            with open(pid_file, "w") as f:
                json.dump({"servers": server_pids, "engine": engine_pid}, f)

    sock = bind_socket("127.0.0.1", port)
    if api_server_count > 1:
        from serving.api_servers import run_api_servers

        try:
            return run_api_servers(args, engine_args, sock, core_factory=core_factory, start_timeout=120,
                                   on_started=write_pids)
        finally:
            sock.close()
    engine = start_engine_process(engine_args, start_timeout=120, core_factory=core_factory)
    app = create_app(engine)
    server = ServingServer(uvicorn_config(app, args), app.state.server.engine, args.shutdown_timeout)
    write_pids(engine.pid, [os.getpid()])
    return server.serve_on_socket(sock)


# ------------------------------------------------------------------------------------------------ CPU accounting
def _cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of ``pid``, by thread id (``/proc``; Linux)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def _server_cpu(pids: dict) -> dict[str, float]:
    """CPU seconds so far: the API servers' event-loop (main) threads, their other threads, and the engine process
    (its threads included); ``pids``: ``serve``'s pid file."""
    servers = [_cpu_seconds(pid) for pid in pids["servers"]]
    out = {"server_event_loop": sum(threads.get(pid, 0.0) for pid, threads in zip(pids["servers"], servers)),
           "server_other_threads": sum(v for pid, threads in zip(pids["servers"], servers)
                                       for tid, v in threads.items() if tid != pid),
           "engine_process": sum(_cpu_seconds(pids["engine"]).values())}
    for index, (pid, threads) in enumerate(zip(pids["servers"], servers)):
        out[f"server_{index}_event_loop"] = threads.get(pid, 0.0)
    return out


def _timed_worker(*args: Any) -> tuple[list, float]:
    from benchmarks.serving import _worker_main

    start = time.process_time()
    results = _worker_main(*args)
    return results, time.process_time() - start


def run_clients(base_url: str, requests: Sequence[Req], concurrency: int, num_processes: int
                ) -> tuple[list, float, float]:
    """benchmarks/serving.py's client in ``num_processes`` processes: (results, duration s, client CPU s)."""
    import concurrent.futures
    import multiprocessing

    from benchmarks.serving import _ready

    shares = [list(requests[i::num_processes]) for i in range(num_processes)]
    limits = [concurrency // num_processes + (i < concurrency % num_processes) for i in range(num_processes)]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(num_processes, mp_context=context) as pool:
        list(pool.map(_ready, range(num_processes)))
        start_at = time.perf_counter() + 0.5
        futures = [pool.submit(_timed_worker, base_url, "model-free", share, 0.0, True, limit, start_at, None)
                   for share, limit in zip(shares, limits)]
        per_process = [future.result() for future in futures]
    results = [r for process_results, _ in per_process for r in process_results]
    ends = [r.start_time + r.latency for r in results if r.success]
    duration = (max(ends) if ends else time.perf_counter()) - start_at
    return results, duration, sum(cpu for _, cpu in per_process)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--steps-per-s", type=float, default=90.0, help="the model-free engine's step rate")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per request")
    parser.add_argument("--requests-per-stream", type=int, default=1, help="requests = concurrency x this")
    parser.add_argument("--num-client-processes", type=int, default=4)
    parser.add_argument("--port", type=int, default=8021)
    parser.add_argument("--api-server-count", type=int, default=1,
                        help="API server processes in front of the engine process (serve's --api-server-count)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server process
    parser.add_argument("--pid-file", default=None, help=argparse.SUPPRESS)  # where --serve writes its pids
    args = parser.parse_args(argv)
    if args.serve:
        sys.exit(serve(args.port, args.steps_per_s, max(args.concurrency), args.api_server_count, args.pid_file))
    import signal
    import subprocess

    from benchmarks.serving import wait_for_health

    env = dict(os.environ, PYTHONPATH=_REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    import tempfile

    pid_file = os.path.join(tempfile.mkdtemp(prefix="serving-host-"), "pids.json")
    command = [sys.executable, "-m", "benchmarks.serving_host", "--serve", "--port", str(args.port),
               "--steps-per-s", str(args.steps_per_s), "--concurrency", *map(str, args.concurrency),
               "--api-server-count", str(args.api_server_count), "--pid-file", pid_file]
    server = subprocess.Popen(command, cwd=_REPO_ROOT, env=env)
    base_url = f"http://127.0.0.1:{args.port}"
    figures = []
    try:
        wait_for_health(server, base_url, 180, "the model-free server did not start")
        with open(pid_file) as f:
            pids = json.load(f)
        run_clients(base_url, [Req(list(range(1, 33)), 8)] * args.num_client_processes, args.num_client_processes,
                    args.num_client_processes)  # warm-up
        for concurrency in args.concurrency:
            requests = [Req(list(range(1, 65)), args.max_tokens)] * (concurrency * args.requests_per_stream)
            before, wall = _server_cpu(pids), time.perf_counter()
            results, duration, client_cpu = run_clients(base_url, requests, concurrency, args.num_client_processes)
            after, wall = _server_cpu(pids), time.perf_counter() - wall
            from benchmarks.serving import summarize

            summary = summarize(results, duration)
            tokens = summary["total_output_tokens"]
            cpu = {name: after[name] - before[name] for name in after}
            cpu["clients"] = client_cpu
            figure = {"figure": "serving_host", "concurrency": concurrency, "api_server_count": args.api_server_count,
                      "steps_per_s": args.steps_per_s,
                      "offered_tokens_per_s": concurrency * args.steps_per_s,
                      "output_throughput": summary["output_throughput"],
                      "fraction_of_offered": summary["output_throughput"] / (concurrency * args.steps_per_s),
                      "completed": summary["completed"], "failed": summary["failed"],
                      "num_chunks_per_token": sum(len(r.itl) + 1 for r in results if r.success) / max(tokens, 1),
                      "median_itl_ms": summary["median_itl_ms"], "p99_itl_ms": summary["p99_itl_ms"],
                      "cpu_ms_per_1k_tokens": {k: round(1e6 * v / max(tokens, 1), 1) for k, v in cpu.items()},
                      "cpu_util": {k: round(v / wall, 2) for k, v in cpu.items()}}
            figures.append(figure)
            print(json.dumps(figure), flush=True)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    return figures


if __name__ == "__main__":
    main()
