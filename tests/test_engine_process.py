"""The engine in its own process (serving/engine_process.py): same outputs as in-process, errors cross the pipe,
aborts free blocks, a dead child fails loudly, and the server runs on it."""

from __future__ import annotations

import asyncio
import json
import os
import time

import numpy as np
import pytest

from models.testing import tiny_config
from paged_jax.config import EngineArgs
from paged_jax.sampling_params import SamplingParams, StructuredOutputsParams

ENGINE_KWARGS = dict(load_format="dummy", dtype="float32", max_num_seqs=8, max_num_batched_tokens=64,
                     max_model_len=128, seed=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(tiny_config("Qwen3ForCausalLM", vocab_size=512, max_position_embeddings=256), f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"top_k": 5}, f)  # a sampling default the client side must see too
    return str(path)


@pytest.fixture(scope="module")
def client(model_dir):
    from serving.engine_process import start_engine_process

    client = start_engine_process(EngineArgs(model=model_dir, **ENGINE_KWARGS), start_timeout=300)
    yield client
    client.close()


def run_all(engine, requests):
    """Add ``[(id, prompt, params)]``, step until done; -> {id: finished RequestOutput, its deltas accumulated},
    number of outputs seen."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    totals, final, seen = {}, {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen += 1
            assert output.request_id not in final, "an output came after the finished one"
            if output.request_id in totals:
                totals[output.request_id].add(output)
            else:
                totals[output.request_id] = output
            if output.finished:
                final[output.request_id] = totals[output.request_id]
    return final, seen


def test_outputs_equal_the_in_process_engine(client, model_dir):
    from paged_jax.engine.llm_engine import LLMEngine

    rng = np.random.default_rng(0)
    requests = [(f"r{i}", {"prompt_token_ids": rng.integers(1, 500, size=n).tolist()}, params)
                for i, (n, params) in enumerate([
                    (5, SamplingParams(temperature=0.0, max_tokens=9)),
                    (23, SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, prompt_logprobs=3)),
                    (11, SamplingParams(temperature=0.8, seed=3, max_tokens=7, n=2)),
                    (40, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[7]))])]
    local_engine = LLMEngine(EngineArgs(model=model_dir, **ENGINE_KWARGS), use_tqdm=False)
    # The same LLMEngine; only the one over a core process can die on its own.
    assert not client.core_in_process and local_engine.core_in_process
    assert client.generation_config == local_engine.generation_config and client.generation_config["top_k"] == 5
    remote, num_outputs = run_all(client, requests)
    local, _ = run_all(local_engine, requests)
    assert num_outputs > len(requests)  # streamed step by step, not only the final ones
    assert sorted(remote) == sorted(local)
    for request_id, want in local.items():
        got = remote[request_id]
        assert got.prompt_token_ids == want.prompt_token_ids
        assert (got.prompt_logprobs is None) == (want.prompt_logprobs is None)
        if want.prompt_logprobs is not None:  # crossed the pipe
            assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(want.prompt_logprobs)
            assert [sorted(e) for e in got.prompt_logprobs[1:]] == [sorted(e) for e in want.prompt_logprobs[1:]]
        assert [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in got.outputs] == \
            [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in want.outputs]
        for g, w in zip(got.outputs, want.outputs):
            if w.logprobs is not None:
                assert [sorted(e) for e in g.logprobs] == [sorted(e) for e in w.logprobs]
                np.testing.assert_allclose([v.logprob for e in g.logprobs for _, v in sorted(e.items())],
                                           [v.logprob for e in w.logprobs for _, v in sorted(e.items())], rtol=1e-5)
    assert client.stats()["num_running"] == 0


def test_bad_request_raises_and_engine_keeps_serving(client):
    with pytest.raises(ValueError, match="prompt"):
        client.add_request("bad", {"prompt_token_ids": [1, 2, 100000]}, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError):
        client.add_request("long", {"prompt_token_ids": [1] * 500}, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="priority"):  # the priority reaches the child's add_request
        client.add_request("bad-priority", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2),
                           priority="high")
    client.add_request("prioritized", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2), priority=-1)
    final, _ = run_all(client, [("ok", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3))])
    assert len(final["ok"].outputs[0].token_ids) == 3 and len(final["prioritized"].outputs[0].token_ids) == 2


def test_abort_frees_blocks(client):
    client.add_request("a", {"prompt_token_ids": list(range(1, 30))}, SamplingParams(max_tokens=100, ignore_eos=True))
    client.add_request("b", {"prompt_token_ids": list(range(1, 9))}, SamplingParams(max_tokens=3))
    outputs = client.step()
    assert outputs and not any(o.finished for o in outputs if o.request_id == "a")
    client.abort_request("a")
    final, _ = run_all(client, [])
    assert "a" not in final and not client.has_unfinished_requests()
    # No other request needed: the client keeps stepping until the child has applied the abort and sent its stats.
    stats = client.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0.0


def test_stats_refresh_after_aborting_everything(client):
    """Clients that all leave: the idle child reports the freed blocks at once (no later step would)."""
    client.add_request("x", {"prompt_token_ids": list(range(1, 40))}, SamplingParams(max_tokens=100, ignore_eos=True))
    while not client.step():
        pass
    assert client.stats()["kv_cache_usage"] > 0.0
    client.abort_request("x")
    assert client.has_unfinished_requests()  # until the child has answered the abort
    while client.has_unfinished_requests():
        assert client.step() == []
    stats = client.stats()
    assert stats["num_running"] == 0 and stats["num_unfinished_requests"] == 0 and stats["kv_cache_usage"] == 0.0


def test_burst_is_admitted_within_a_few_steps(client):
    """A burst of adds while the engine is busy costs the engine no step per request: the child applies every
    command that arrived during a step before the next one, and admission needs no round trip per request."""
    busy = SamplingParams(max_tokens=100, ignore_eos=True)
    client.add_request("busy", {"prompt_token_ids": [1, 2, 3]}, busy)
    client.step()
    steps_before = client.stats()["num_steps"]
    num_requests = 32
    groups = {client.submit_requests([(f"burst{i}", {"prompt_token_ids": [5, 6, i + 1]}, busy, 0)])
              for i in range(num_requests)}
    # What the input processor can check is refused here, at once, nothing sent; what only the core can check (a
    # grammar; this model has no tokenizer) comes back as the group's answer, and nothing of the group stays.
    with pytest.raises(ValueError, match="prompt"):
        client.submit_requests([("burst-ok", {"prompt_token_ids": [1]}, busy, 0),
                                ("burst-bad", {"prompt_token_ids": [1, 100000]}, busy, 0)])
    constrained = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+"))
    refused = client.submit_requests([("burst-ok", {"prompt_token_ids": [1]}, busy, 0),
                                      ("burst-bad", {"prompt_token_ids": [1]}, constrained, 0)])
    answers = {}
    while len(answers) < num_requests + 1:
        client.step()
        answers.update(client.take_admissions())
    assert client.stats()["num_steps"] - steps_before <= 4  # one request per step would take 33
    assert all(answers[group] is None for group in groups)
    assert isinstance(answers[refused], ValueError) and "structured_outputs" in str(answers[refused])
    assert "burst-ok" not in client.output_processor
    assert client.stats()["num_unfinished_requests"] == num_requests + 1  # the refused group left nothing behind
    client.abort_request(["busy", *(f"burst{i}" for i in range(num_requests))])
    while client.has_unfinished_requests():
        client.step()
    assert client.stats()["num_unfinished_requests"] == 0 and client.stats()["kv_cache_usage"] == 0.0


def test_start_up_progress_reaches_stderr(model_dir, capfd, caplog):
    """What `serve` prints while the child loads and compiles: model loading, weights, KV pool size, compile count
    and the bucket progress bar (i of N), then ready; at the parent's log level (INFO here, as serve runs).
    Without --max-model-len the model's own length (256) is used."""
    import logging
    import re

    from serving.engine_process import start_engine_process

    caplog.set_level(logging.INFO)
    kwargs = {k: v for k, v in ENGINE_KWARGS.items() if k != "max_model_len"}
    client = start_engine_process(EngineArgs(model=model_dir, **kwargs), start_timeout=300)
    try:
        assert client.max_model_len == 256
    finally:
        client.close()
    err = capfd.readouterr().err
    stages = [r"\(EngineCore pid=\d+\) paged_jax\.engine\.core_setup: Loading model " + re.escape(model_dir),
              r"model weights ready in \d+\.\d+ s",
              r"KV cache: \d+ blocks x 16 tokens in \d+ group\(s\) = \d+ tokens .*max_model_len 256",
              r"Compiling \d+ step executables \(\d+ step shapes\)",
              r"Compiling step executables: +\d+%.*\| *\d+/\d+ ",
              r"Compiled in \d+\.\d+ s; engine ready in \d+\.\d+ s"]
    positions = []
    for stage in stages:
        match = re.search(stage, err)
        assert match, (stage, err)
        positions.append(match.start())
    assert positions == sorted(positions), err
    assert "engine process ready" in caplog.text


def test_bad_engine_args_raise_value_error(model_dir):
    from serving.engine_process import start_engine_process

    with pytest.raises(ValueError, match="max_model_len"):
        start_engine_process(EngineArgs(model=model_dir, **{**ENGINE_KWARGS, "max_model_len": 100000}),
                            start_timeout=300)


def test_server_on_engine_process_and_dead_child(model_dir):
    """The OpenAI server on a process engine: streamed == non-streamed greedy; killing the child turns /health
    unhealthy and answers 500 instead of hanging; shutdown reaps the child."""
    import httpx
    import openai

    from serving.app import create_app
    from serving.engine_process import start_engine_process
    from tests.test_serving import ServerThread, metric_value, wait_until

    engine = start_engine_process(EngineArgs(model=model_dir, **ENGINE_KWARGS), start_timeout=300)
    app = create_app(engine, served_model_name="tiny")
    assert app.state.server.default_sampling_params == {"top_k": 5}  # from the child's generation config
    with ServerThread(app) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
        prompt = [3, 14, 15, 92, 65]
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0.0)
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0.0, stream=True) if chunk.choices)
        assert whole.usage.completion_tokens == 8
        assert streamed == whole.choices[0].text
        assert httpx.get(server.base_url + "/health").status_code == 200
        # Every child step's stats reach the metrics, however the client batches outputs: tokens per step add up.
        text = httpx.get(server.base_url + "/metrics").text
        tokens = sum(metric_value(text, f"paged_jax:{kind}_tokens_total") for kind in ("prompt", "generation"))
        assert metric_value(text, "paged_jax:iteration_tokens_total_sum") == tokens == 2 * (len(prompt) + 8)
        # A burst of streams admitted together, one refused by the child (400), every other one complete.
        texts = asyncio.run(_stream_burst(server.base_url, prompt, 16))
        assert texts[-1] == 400
        assert all(text == whole.choices[0].text for text in texts[:-1])

        os.kill(engine.engine_core.pid, 9)
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0.0)
        assert wait_until(lambda: httpx.get(server.base_url + "/health").status_code != 200, timeout=30)
    assert not engine.engine_core.is_alive()


async def _stream_burst(base_url: str, prompt: list[int], num_streams: int) -> list:
    """``num_streams`` greedy streamed completions of ``prompt`` at once plus one the engine refuses (a logit_bias
    id outside the vocabulary): each stream's text, the refused one's HTTP status last."""
    import httpx

    async def one(client, body):
        async with client.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 8,
                                                                   "temperature": 0.0, "stream": True, **body}) as r:
            if r.status_code != 200:
                return r.status_code
            chunks = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: {")]
            return "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"])

    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        return await asyncio.gather(*[one(client, {}) for _ in range(num_streams)],
                                    one(client, {"logit_bias": {"100000": 1.0}}))


def test_engine_process_is_the_default_and_can_be_turned_off(monkeypatch):
    """The server's measured choice (benchmarks/RESULTS.md): the engine in its own process unless told otherwise."""
    from serving.cli import build_parser
    from serving.engine_process import engine_process_enabled

    monkeypatch.delenv("PAGED_JAX_ENGINE_PROCESS", raising=False)
    parser = build_parser("serve")
    assert engine_process_enabled(parser.parse_args([]).engine_process) is True
    assert engine_process_enabled(parser.parse_args(["--no-engine-process"]).engine_process) is False
    monkeypatch.setenv("PAGED_JAX_ENGINE_PROCESS", "0")
    assert engine_process_enabled(parser.parse_args([]).engine_process) is False
    assert engine_process_enabled(parser.parse_args(["--engine-process"]).engine_process) is True


# ------------------------------------------------------------------------------- --api-server-count (api_servers)
def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start(argv: list[str], log_path, env: dict | None = None):
    """``python <argv>`` from the repository root with its output in ``log_path``."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": repo, **(env or {})}
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, *argv], cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait_healthy(process, base_url: str, log_path) -> None:
    import httpx

    from tests.test_serving import wait_until

    def healthy() -> bool:
        assert process.poll() is None, open(log_path).read()
        try:
            return httpx.get(base_url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    assert wait_until(healthy, timeout=240, interval=0.25), open(log_path).read()


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie has exited
    except OSError:
        return True


def _successes_by_process(metrics_dir) -> dict[int, float]:
    """request_success_total per API server process, from each process's own metrics file."""
    from prometheus_client.mmap_dict import MmapedDict

    counts = {}
    for name in os.listdir(metrics_dir):
        if name.startswith("counter_"):
            values = MmapedDict.read_all_values_from_file(os.path.join(metrics_dir, name))
            total = sum(value for key, value, *_ in values if json.loads(key)[1] == "paged_jax:request_success_total")
            if total:
                counts[int(name[len("counter_"):-len(".db")])] = total
    return counts


async def _completions(base_url: str, prompt: list[int], num_each: int) -> list[list[int]]:
    """``num_each`` streamed and ``num_each`` whole greedy completions at once, each on a new connection: the token
    ids of each."""
    import httpx

    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "logprobs": 0,
            "return_tokens_as_token_ids": True}

    def ids(tokens: list[str]) -> list[int]:
        return [int(token.removeprefix("token_id:")) for token in tokens]

    async def one(client, stream: bool) -> list[int]:
        if not stream:
            response = await client.post("/v1/completions", json=body)
            return ids(response.json()["choices"][0]["logprobs"]["tokens"])
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            chunks = [json.loads(line[6:]) async for line in response.aiter_lines() if line.startswith("data: {")]
        return ids([t for chunk in chunks if chunk["choices"] for t in chunk["choices"][0]["logprobs"]["tokens"]])

    limits = httpx.Limits(max_keepalive_connections=0)  # every request on a connection of its own
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        return await asyncio.gather(*[one(client, stream) for stream in (True, False) for _ in range(num_each)])


def test_api_server_count_2_over_one_engine_process(model_dir, client, tmp_path):
    """`serve --api-server-count 2`: connections land on both API servers (each process's own metrics file), greedy
    outputs equal the single engine process's, streamed and whole; a dropped stream is aborted and frees its blocks;
    /metrics on either server reports both servers' requests and the engine's counters; SIGTERM stops every process
    (exit status 0)."""
    import re
    import signal

    import httpx

    from tests.test_serving import metric_value, wait_until

    prompt = [3, 14, 15, 92, 65]
    reference, _ = run_all(client, [("ref", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0,
                                                                                         max_tokens=8))])
    want = reference["ref"].outputs[0].token_ids
    metrics_dir, log_path, port = tmp_path / "metrics", tmp_path / "serve.log", _free_port()
    metrics_dir.mkdir()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_KWARGS.items()]
    launcher = _start(["-m", "serving", model_dir, *flags, "--served-model-name", "tiny", "--api-server-count", "2",
                       "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"], log_path,
                      {"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)})
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(launcher, base_url, log_path)
        log = open(log_path).read()
        pids = [int(p) for p in re.search(r"Started 2 API servers \(pids (\d+), (\d+)\)", log).groups()]
        engine_pid = int(re.search(r"engine process started \(pid (\d+)\)", log).group(1))
        num_requests = 0

        def both_servers_answered() -> bool:
            # Both servers accept on the one listening socket: whichever accepts first takes a connection, and a
            # server still starting up (a loaded machine) takes none. Rounds go on until both have had some.
            nonlocal num_requests
            results = asyncio.run(_completions(base_url, prompt, 4))
            num_requests += len(results)
            assert all(tokens == want for tokens in results)
            return len(_successes_by_process(metrics_dir)) == 2

        wait_until(both_servers_answered, timeout=120, interval=0.5)
        assert set(_successes_by_process(metrics_dir)) == set(pids)

        # A stream that its client leaves is aborted in the engine: blocks freed, never counted a success.
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 120, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=base_url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as response:
                assert next(line for line in response.iter_lines() if line.startswith("data: {"))

        def engine_idle() -> bool:
            text = httpx.get(base_url + "/metrics").text
            return (metric_value(text, "paged_jax:num_requests_running") == 0
                    and metric_value(text, "paged_jax:kv_cache_usage_perc") == 0.0)

        assert wait_until(engine_idle, timeout=60)
        for _ in range(4):  # whichever server answers reports the whole system
            text = httpx.get(base_url + "/metrics").text
            assert metric_value(text, "paged_jax:request_success_total") == num_requests
            assert metric_value(text, "paged_jax:e2e_request_latency_seconds_count") == num_requests
            generated = metric_value(text, "paged_jax:generation_tokens_total")
            assert 8 * num_requests < generated < 8 * num_requests + 120  # the abandoned stream stopped early
            tokens = generated + metric_value(text, "paged_jax:prompt_tokens_total")
            assert metric_value(text, "paged_jax:iteration_tokens_total_sum") == tokens

        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(60) == 0, open(log_path).read()
        assert all(_gone(pid) for pid in [*pids, engine_pid])
    finally:
        if launcher.poll() is None:
            launcher.kill()


# The engine-death case is marked slow (CI budget): the same supervision, and the servers' own engine watch is the
# single-server one (test_server_on_engine_process_and_dead_child).
@pytest.mark.parametrize("victim", ["api_server", pytest.param("engine", marks=pytest.mark.slow)])
def test_api_servers_exit_1_when_a_process_dies(victim, tmp_path):
    """A dead API server: the launcher stops the others and exits 1; a dead engine process: every API server exits
    1, then the launcher (model-free engine: benchmarks/serving_host.py)."""
    import signal

    port, log_path, pid_file = _free_port(), tmp_path / "serve.log", tmp_path / "pids.json"
    launcher = _start(["-m", "benchmarks.serving_host", "--serve", "--api-server-count", "2", "--port", str(port),
                       "--concurrency", "4", "--pid-file", str(pid_file)], log_path)
    try:
        _wait_healthy(launcher, f"http://127.0.0.1:{port}", log_path)
        pids = json.loads(pid_file.read_text())
        os.kill(pids["servers"][0] if victim == "api_server" else pids["engine"], signal.SIGKILL)
        assert launcher.wait(60) == 1, open(log_path).read()
        assert all(_gone(pid) for pid in [*pids["servers"], pids["engine"]])
        if victim == "engine":
            assert "API servers exited with status [1, 1]" in open(log_path).read()
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_multi_client_engine_keeps_each_clients_requests_apart():
    """The multi-client engine loop (in-process, model-free engine, two clients): both may use the same request id,
    each gets only its own outputs; --max-waiting-requests is enforced by the engine for every client; a client
    that detaches has its requests aborted."""
    import multiprocessing
    import threading

    from benchmarks.serving_host import ModelFreeCore
    from paged_jax.engine.core_proc import EngineCoreProc
    from paged_jax.engine.messages import Shutdown, encode
    from serving.async_engine import EngineOverloadedError
    from serving.engine_process import EngineOptions, _admission_check, attach_engine
    from tests.test_serving import wait_until

    engine_args = EngineArgs(model="model-free", load_format="dummy", max_num_seqs=4, max_model_len=64)
    engine = ModelFreeCore(engine_args, steps_per_s=2000)
    control, engine_control = multiprocessing.Pipe()
    pipes = [multiprocessing.Pipe() for _ in range(2)]
    loop = EngineCoreProc(engine, [child for _, child in pipes], engine_control,
                          admission_check=_admission_check(EngineOptions(max_waiting_requests=3)))
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    first, second = [attach_engine(engine_args, conn, engine.info, os.getpid()) for conn, _ in pipes]
    try:
        first.add_request("same", [1, 2], SamplingParams(max_tokens=3))
        second.add_request("same", [1, 2, 3], SamplingParams(max_tokens=5))
        tokens = {first: 0, second: 0}
        while first.has_unfinished_requests() or second.has_unfinished_requests():
            for client in (first, second):
                if client.has_unfinished_requests():
                    for output in client.step():
                        assert output.request_id == "same"
                        tokens[client] += len(output.outputs[0].token_ids) if output.outputs else 0
        assert tokens == {first: 3, second: 5}

        too_many = [(f"r{i}", [1], SamplingParams(max_tokens=2), 0) for i in range(4)]  # 4 sequences > 3
        group = first.submit_requests(too_many)
        while not (answers := dict(first.take_admissions())):
            first.step()
        assert isinstance(answers[group], EngineOverloadedError) and not first.has_unfinished_requests()

        second.add_request("long", [1], SamplingParams(max_tokens=10_000))
        assert second.step() or second.step()
        second.close()  # its API server leaves: the engine aborts what it had
        assert wait_until(lambda: not engine.has_unfinished_requests(), timeout=10)
    finally:
        control.send_bytes(encode(Shutdown()))
        thread.join(10)
        first.close()


def _sleep_then_exit(seconds: float, code: int) -> None:
    import sys
    import time

    time.sleep(seconds)
    sys.exit(code)


def test_supervisor_exits_as_the_api_server_that_refused_its_arguments():
    """--api-server-count > 1: a server that exits 2 (an argument refused) makes the whole command exit 2, as one
    server's serve does; any other server exit is 1."""
    import multiprocessing

    from serving.api_servers import _supervise

    context = multiprocessing.get_context("spawn")
    for server_code, want in ((2, 2), (3, 1)):
        engine = context.Process(target=_sleep_then_exit, args=(30.0, 0), daemon=True)
        servers = [context.Process(target=_sleep_then_exit, args=(30.0, 0), daemon=True),
                   context.Process(target=_sleep_then_exit, args=(0.0, server_code), daemon=True)]
        for process in (engine, *servers):
            process.start()
        try:
            assert _supervise(engine, servers, shutdown_timeout=1.0) == want
        finally:
            for process in (engine, *servers):
                process.kill()
                process.join()


def test_core_loop_forgets_a_request_whose_last_sequence_is_stopped_by_the_client():
    """A stop string ends a sequence in the client's output processor, which aborts that sequence in the core; when
    it was the request's last, no core output says so, and the loop must still stop counting it as the client's."""
    import multiprocessing
    import threading

    from benchmarks.serving_host import ModelFreeCore
    from paged_jax.engine.core_proc import EngineCoreProc
    from paged_jax.engine.messages import AbortRequests, AddRequests, EngineCoreRequest, Shutdown, encode
    from tests.test_serving import wait_until

    engine_args = EngineArgs(model="model-free", load_format="dummy", max_num_seqs=4, max_model_len=64)
    core = ModelFreeCore(engine_args, steps_per_s=200)
    client_end, core_end = multiprocessing.Pipe()
    loop = EngineCoreProc(core, [core_end])
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        request = EngineCoreRequest("a", [1, 2], SamplingParams(max_tokens=10_000))
        client_end.send_bytes(encode(AddRequests(0, [request])))
        assert wait_until(lambda: loop.clients[0].owned == {"a": "a"}, timeout=10)
        client_end.send_bytes(encode(AbortRequests(sequences=[("a", 0)])))
        assert wait_until(lambda: not loop.clients[0].owned and not core.has_unfinished_requests(), timeout=10)
        assert not loop.owner
    finally:
        client_end.send_bytes(encode(Shutdown()))
        thread.join(10)
