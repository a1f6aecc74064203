"""``paged-jax serve`` as a vLLM user launches it: a typical vLLM launch line through the real CLI parser, the app it
builds served over HTTPS by the real uvicorn configuration (CORS, root path, several served model names, API key,
request and stats log lines), unknown flags refused by name, and vLLM's engine defaults (max_model_len,
gpu_memory_utilization as a fraction of the device's total memory, seed).

The server tests share the session ``serving_engine`` (SmolLM2 on CPU); only the engine differs from what
``serve`` would build (``serving.cli.build_app_from_args`` loads its own).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import threading
import time

import httpx
import pytest

from tests.test_device_memory import GIB, TOTAL, FakeGpu
from tests.test_serving import wait_until

API_KEY = "cli-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ORIGIN = "https://allowed.example"


# ------------------------------------------------------------------------------------------------- the parser
def parse(argv):
    from serving.cli import parse_serve_args
    from serving.settings import engine_args_from_namespace

    _, args = parse_serve_args(argv)
    return args, engine_args_from_namespace(args)


def test_vllm_launch_line_parses_into_engine_and_server_settings():
    args, engine_args = parse([
        "Qwen/Qwen3-0.6B", "--host", "0.0.0.0", "--port", "8001", "--served-model-name", "qwen", "qwen3",
        "--seed", "7", "--max-model-len", "4096", "--gpu-memory-utilization", "0.85", "--enable-chunked-prefill",
        "--enforce-eager", "--trust-remote-code", "--disable-log-stats", "--disable-log-requests",
        "--allowed-origins", json.dumps([ORIGIN]), "--allowed-methods", '["GET", "POST"]', "--allowed-headers",
        '["Authorization"]', "--allow-credentials", "--root-path", "/api", "--ssl-keyfile", "key.pem",
        "--ssl-certfile", "cert.pem", "--max_num_seqs", "4", "--tensor-parallel-size=1"])
    assert engine_args.model == "Qwen/Qwen3-0.6B"
    assert engine_args.served_model_name == ["qwen", "qwen3"] and engine_args.served_model_names == ["qwen", "qwen3"]
    assert (engine_args.seed, engine_args.max_model_len, engine_args.gpu_memory_utilization) == (7, 4096, 0.85)
    assert engine_args.enable_chunked_prefill and engine_args.enforce_eager and engine_args.trust_remote_code
    assert engine_args.disable_log_stats and engine_args.max_num_seqs == 4  # underscores accepted, as in vLLM
    assert (args.host, args.port, args.root_path) == ("0.0.0.0", 8001, "/api")
    assert (args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials) == (
        [ORIGIN], ["GET", "POST"], ["Authorization"], True)
    assert (args.ssl_keyfile, args.ssl_certfile) == ("key.pem", "cert.pem")
    assert args.disable_log_requests and not args.enable_log_requests


def test_vllm_defaults_of_the_server_flags():
    from serving.cli import bind_socket
    from serving.settings import app_kwargs, uvicorn_config

    args, engine_args = parse([])
    assert args.host is None and uvicorn_config(None, args).host == "0.0.0.0"  # vLLM: every interface
    with bind_socket(args.host, 0) as sock:
        assert sock.getsockname()[0] == "0.0.0.0"
    kwargs = app_kwargs(args, engine_args)
    assert kwargs["allowed_origins"] == kwargs["allowed_methods"] == kwargs["allowed_headers"] == ["*"]
    assert not kwargs["allow_credentials"] and uvicorn_config(None, args).root_path == ""
    assert kwargs["log_stats"] and not kwargs["log_requests"]  # vLLM: stats on, request lines opt-in
    assert kwargs["served_model_name"] is None  # the built-in model: the server names it
    assert parse(["/models/llama"])[1].served_model_names == ["/models/llama"]  # vLLM: the model as given
    assert not app_kwargs(*parse(["--disable-log-stats"]))["log_stats"]
    assert app_kwargs(*parse(["--enable-log-requests", "--max-log-len", "5"]))["log_requests"]
    assert not parse(["--no-enable-chunked-prefill"])[1].enable_chunked_prefill
    assert args.shutdown_timeout == 0  # vLLM: running requests are ended at once on SIGTERM
    assert kwargs["max_seqs_per_request"] is None and not kwargs["api_key_protect_all"]
    assert (parse(["--max-stop-strings", "8"])[1].max_stop_strings, engine_args.max_stop_string_len) == (8, 512)


UNSUPPORTED_VLLM_FLAGS = [
    ["--tokenizer-mode", "mistral"], ["--fully-sharded-loras"],
    ["--max-num-partial-prefills", "2"], ["--distributed-executor-backend", "ray"], ["--config", "serve.yaml"],
    ["--uds", "/tmp/vllm.sock"], ["--disable-custom-all-reduce"], ["--limit-mm-per-prompt", '{"image": 1}'],
    ["--max-model", "64"],  # an abbreviation of --max-model-len: refused, not guessed
]


@pytest.mark.parametrize("flag", UNSUPPORTED_VLLM_FLAGS, ids=lambda f: f[0])
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_unsupported_flags_exit_2_naming_the_flag(command, flag, capsys):
    from serving.commands import main

    argv = [command, *(["--prompt", "hi"] if command == "generate" else []), *flag]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert re.search(r"unrecognized arguments: .*" + re.escape(flag[0]), capsys.readouterr().err)


@pytest.mark.parametrize("argv, named", [
    (["--allowed-origins", "*"], "--allowed-origins"),  # vLLM takes a JSON list
    (["--allowed-headers", '{"a": 1}'], "--allowed-headers"),
    (["--enable-log-requests", "--disable-log-requests"], "--disable-log-requests"),
    (["--ssl-keyfile", "key.pem"], "--ssl-certfile"),
    (["--max-log-len", "-1"], "--max-log-len"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
    (["--max-seqs-per-request", "0"], "--max-seqs-per-request"),
    (["--max-request-body-size", "0"], "--max-request-body-size"),
    (["--api-key-protect-all"], "--api-key"),
    (["--enable-auto-tool-choice"], "--tool-call-parser"),  # vLLM: auto tool choice needs a parser
    (["--tool-call-parser", "no-such-parser"], "--tool-call-parser"),
    (["--reasoning-parser", "no-such-parser"], "--reasoning-parser"),
    (["--api-server-count", "0"], "--api-server-count"),
    (["-asc", "2", "--no-engine-process"], "--no-engine-process"),  # several servers share one engine process
    (["--api-server-count", "2", "--nnodes", "2"], "--nnodes"),
])
def test_bad_server_flag_values_exit_2_naming_the_flag(argv, named, capsys):
    from serving.commands import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2 and named in capsys.readouterr().err


def test_api_server_count_refuses_runtime_lora_updating(monkeypatch, capsys):
    """An adapter loaded through one API server would be unknown to the others: refused naming both (vLLM too)."""
    from serving.commands import main

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--api-server-count", "2"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--api-server-count" in err and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in err


def test_port_in_use_fails_before_loading_the_model(capsys):
    from serving.commands import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        start = time.monotonic()
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", "--host", "127.0.0.1", "--port", str(taken.getsockname()[1])])
    assert exit_info.value.code == 2 and "--host/--port" in capsys.readouterr().err
    assert time.monotonic() - start < 10  # no engine was built


# ------------------------------------------------------------------------------------------------- the server
class TLSServer:
    """The app served the way ``serve_main`` serves it (``bind_socket`` + ``uvicorn_config``), from a thread."""

    def __init__(self, app, args) -> None:
        import uvicorn

        from serving.cli import bind_socket
        from serving.settings import uvicorn_config

        self.socket = bind_socket("127.0.0.1", 0)
        self.base_url = f"https://127.0.0.1:{self.socket.getsockname()[1]}"
        self.app = app
        self._server = uvicorn.Server(uvicorn_config(app, args))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self) -> "TLSServer":
        self._thread.start()
        if not wait_until(lambda: self._server.started or not self._thread.is_alive(), timeout=60) \
                or not self._server.started:
            raise RuntimeError("uvicorn did not start")
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=60)
        self.app.state.server.engine.shutdown()
        self.socket.close()

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, verify=False, timeout=120)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tls")
    key, cert = directory / "key.pem", directory / "cert.pem"
    try:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                        str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"openssl cannot make a test certificate: {exc}")
    return str(key), str(cert)


@pytest.fixture(scope="module")
def server(serving_engine, tls_files):
    """A vLLM-style launch line's app over HTTPS, with the stats line every 0.3 s."""
    from serving.app import create_app
    from serving.settings import app_kwargs

    key, cert = tls_files
    args, engine_args = parse([
        "--served-model-name", "smol-a", "smol-b", "--api-key", API_KEY, "--allowed-origins", json.dumps([ORIGIN]),
        "--allow-credentials", "--root-path", "/api", "--enable-log-requests", "--max-log-len", "3",
        "--ssl-keyfile", key, "--ssl-certfile", cert, "--uvicorn-log-level", "warning"])
    previous = os.environ.get("PAGED_JAX_LOG_STATS_INTERVAL")
    os.environ["PAGED_JAX_LOG_STATS_INTERVAL"] = "0.3"
    try:
        app = create_app(serving_engine, **app_kwargs(args, engine_args))
    finally:
        if previous is None:
            del os.environ["PAGED_JAX_LOG_STATS_INTERVAL"]
        else:
            os.environ["PAGED_JAX_LOG_STATS_INTERVAL"] = previous
    with TLSServer(app, args) as handle:
        yield handle


def test_served_model_names_over_https(server):
    with server.client() as c:
        models = c.get("/v1/models", headers=AUTH).json()
        assert [m["id"] for m in models["data"]] == ["smol-a", "smol-b"]
        for name in ("smol-a", "smol-b"):  # every name is accepted; responses report the first (vLLM)
            r = c.post("/v1/completions", headers=AUTH,
                       json={"model": name, "prompt": "Hello", "max_tokens": 2, "temperature": 0.0})
            assert r.status_code == 200 and r.json()["model"] == "smol-a"
        r = c.post("/v1/completions", headers=AUTH, json={"model": "smol-c", "prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_root_path_behind_a_prefix_stripping_proxy_keeps_auth(server):
    """--root-path /api: the proxy strips /api; the app sees it as its root path (ASGI ``root_path``)."""
    with server.client() as c:
        assert c.get("/openapi.json").json()["servers"] == [{"url": "/api"}]
        assert c.get("/docs").status_code == 200 and "/api/openapi.json" in c.get("/docs").text
        assert c.get("/v1/models", headers=AUTH).status_code == 200
        assert c.get("/v1/models").status_code == 401  # the request path carries the root path: still checked
        assert c.get("/health").status_code == 200


def test_cors(server):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with server.client() as c:
        r = c.options("/v1/completions", headers=preflight)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert r.headers["access-control-allow-credentials"] == "true"
        r = c.options("/v1/completions", headers={**preflight, "Origin": "https://other.example"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        # A refused request still carries the CORS headers, so a browser page can read the 401.
        r = c.get("/v1/models", headers={"Origin": ORIGIN})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN
        r = c.get("/v1/models", headers={**AUTH, "Origin": "https://other.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_request_and_stats_log_lines(server, caplog):
    caplog.set_level(logging.INFO)
    with server.client() as c:
        r = c.post("/v1/completions", headers=AUTH,
                   json={"model": "smol-a", "prompt": "The capital of France is", "max_tokens": 6,
                         "temperature": 0.0, "ignore_eos": True})
        assert r.status_code == 200
    received = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("Received request")]
    assert len(received) == 1
    # --max-log-len 3: three ids shown, the count in full.
    assert re.search(r"prompt_token_ids: \[\d+, \d+, \d+\] \(\d+ tokens\)", received[0]), received[0]
    assert "max_tokens=6" in received[0]

    pattern = re.compile(r"Engine 000: Avg prompt throughput: (\d+\.\d) tokens/s, "
                         r"Avg generation throughput: (\d+\.\d) tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, "
                         r"GPU KV cache usage: \d+\.\d%, Prefix cache hit rate: \d+\.\d%")

    def generation_lines():
        return [m for rec in caplog.records if rec.levelno == logging.INFO
                and (m := pattern.fullmatch(rec.getMessage())) and float(m.group(2)) > 0]

    assert wait_until(lambda: generation_lines(), timeout=10), [r.getMessage() for r in caplog.records]


def test_stats_line_arithmetic_and_idle_quiet(caplog):
    from serving.server_logs import StatsLogger

    caplog.set_level(logging.DEBUG, logger="serving.server_logs")
    stats = {"prompt_tokens_total": 100, "generation_tokens_total": 40, "num_running": 0, "num_waiting": 0,
             "kv_cache_usage": 0.0, "prefix_cache_queries": 0, "prefix_cache_hits": 0}
    stats_logger = StatsLogger(lambda: stats, interval_s=10, clock=lambda: 0.0)
    stats_logger._last_totals = (100.0, 40.0)  # what start() records
    stats.update(prompt_tokens_total=600, generation_tokens_total=240, num_running=3, num_waiting=1,
                 kv_cache_usage=0.25, prefix_cache_queries=400, prefix_cache_hits=100)
    assert stats_logger.log(now=10.0) == (
        "Engine 000: Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 20.0 tokens/s, "
        "Running: 3 reqs, Waiting: 1 reqs, GPU KV cache usage: 25.0%, Prefix cache hit rate: 25.0%")
    stats.update(num_running=0, num_waiting=0, kv_cache_usage=0.0)
    stats_logger.log(now=20.0)  # the interval after activity: zeros, still INFO (vLLM)
    stats_logger.log(now=30.0)  # idle: DEBUG only
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO, logging.DEBUG]
    assert caplog.records[1].getMessage().startswith("Engine 000: Avg prompt throughput: 0.0 tokens/s")


# -------------------------------------------------------------------------------------- vLLM's engine defaults
def _num_blocks(device, utilization, max_model_len=4096, override=None, weight_bytes=None, dequantization_bytes=0):
    from models.config import ModelConfig
    from models.testing import tiny_config
    from paged_jax.worker.kv_pool_sizing import determine_num_blocks, kv_bytes_per_block

    config = ModelConfig.from_hf_config(tiny_config("llama", num_hidden_layers=32, num_attention_heads=32,
                                                    num_key_value_heads=8, head_dim=128,
                                                    max_position_embeddings=131072))
    blocks = determine_num_blocks(config, block_size=16, dtype="bfloat16", max_model_len=max_model_len,
                                  max_num_seqs=8, max_num_batched_tokens=64, gpu_memory_utilization=utilization,
                                  num_blocks_override=override, device=device, weight_bytes=weight_bytes,
                                  dequantization_bytes=dequantization_bytes)
    return blocks, kv_bytes_per_block(config, 16, "bfloat16")


def test_fp8_pool_stays_addressable(caplog):
    """One layer's FP8 pool stays under 2**31 elements (the Pallas kernels' 32-bit offsets below 2**32 bytes): the
    sized pool is capped with a warning, an override above the cap is refused by name; bf16 pools are not capped."""
    from models.config import ModelConfig
    from models.testing import tiny_config
    from paged_jax.worker.kv_pool_sizing import determine_num_blocks, max_addressable_blocks

    config = ModelConfig.from_hf_config(tiny_config("qwen3", num_hidden_layers=2, num_attention_heads=16,
                                                    num_key_value_heads=8, head_dim=128))
    limit = max_addressable_blocks(config, 16, "float8_e4m3fn")
    assert limit == (2 ** 31 - 1) // (16 * 8 * 128) and max_addressable_blocks(config, 16, "bfloat16") is None
    kwargs = dict(block_size=16, max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=64,
                  gpu_memory_utilization=0.9, device=FakeGpu(int(0.9 * TOTAL), GIB), weight_bytes=GIB)
    with caplog.at_level("WARNING"):
        assert determine_num_blocks(config, dtype="float8_e4m3fn", **kwargs) == limit
    assert "capped" in caplog.text
    assert determine_num_blocks(config, dtype="bfloat16", **kwargs) > limit // 2  # memory-bound, uncapped
    with pytest.raises(ValueError, match="num_gpu_blocks_override"):
        determine_num_blocks(config, dtype="float8_e4m3fn", num_blocks_override=limit + 1, **kwargs)


def test_pool_size_counts_the_weights_not_loading_leftovers():
    """With the weights' own bytes the block count (a compiled shape) is the same on every start, whatever buffers
    loading left in the allocator; device_bytes counts a pytree's arrays on one device."""
    import jax
    import jax.numpy as jnp

    from paged_jax.worker.kv_pool_sizing import device_bytes

    weights = 16 * GIB
    counts = {_num_blocks(FakeGpu(int(0.9 * TOTAL), weights + leftover), 0.9, weight_bytes=weights)[0]
              for leftover in (0, 300 << 20, 2 * GIB)}
    assert len(counts) == 1 and counts == {_num_blocks(FakeGpu(int(0.9 * TOTAL), weights), 0.9)[0]}
    device = jax.devices()[0]
    tree = {"a": jnp.zeros((4, 8), jnp.bfloat16, device=device), "b": [jnp.ones(3, jnp.float32, device=device)],
            "c": None}
    assert device_bytes(tree, device) == 4 * 8 * 2 + 3 * 4


def test_pool_leaves_room_for_weights_xla_dequantizes(monkeypatch):
    """A weight-only quantized model whose matmuls dequantize in XLA (an H200 start of Llama-3.1-8B with int8 weights
    ran out of memory in its first forward: XLA held several layers' dequantized weights) gets the dequantized bytes
    of its largest decoder layer as headroom (each matmul ties its weights to its input, so one layer's are live at
    a time); the Pallas kernels (packed tiles dequantized in registers) need none."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models.quantization.linear import WeightOnlyLinear, quantize_weight_only
    from paged_jax.worker.kv_pool_sizing import dequantized_weight_bytes

    weights = 8 * GIB
    plain, per_block = _num_blocks(FakeGpu(int(0.9 * TOTAL), weights), 0.9, weight_bytes=weights)
    scratch = 13 * GIB
    with_scratch, _ = _num_blocks(FakeGpu(int(0.9 * TOTAL), weights), 0.9, weight_bytes=weights,
                                  dequantization_bytes=scratch)
    assert plain - with_scratch in (scratch // per_block, scratch // per_block + 1)

    def linear(k, n, bits, matmul_impl):
        w = jax.random.normal(jax.random.key(k + n), (k, n), jnp.float32)
        q, sc, z = quantize_weight_only(w, bits=bits, group_size=32, zero_point=True, dtype=jnp.bfloat16)
        return WeightOnlyLinear(q, sc, z, bits=bits, group_size=32, dtype=jnp.bfloat16, matmul_impl=matmul_impl)

    class Layer(nnx.Module):
        def __init__(self, width, matmul_impl):
            self.up = linear(64, width, 4, matmul_impl)
            self.down = linear(width, 64, 8, matmul_impl)

    class Model(nnx.Module):
        def __init__(self, matmul_impl):
            self.layers = nnx.List([Layer(width, matmul_impl) for width in (96, 160, 64)])

    device = jax.devices()[0]
    widest_layer_bytes = (64 * 160 + 160 * 64) * 2
    for impl in ("xla", "xla_native", "xla_native_grouped"):
        assert dequantized_weight_bytes(Model(impl), 64, device) == widest_layer_bytes, impl
    # Projections outside a list of layers count one by one.
    assert dequantized_weight_bytes(Layer(96, "xla"), 64, device) == 64 * 96 * 2
    assert dequantized_weight_bytes(Model("pallas"), 64, device) == 0
    assert dequantized_weight_bytes(nnx.Linear(8, 8, rngs=nnx.Rngs(0)), 64, device) == 0
    # "auto" asks the selector at the widest step's rows (a GPU's: the Pallas kernels up to 16 rows, XLA above).
    from models.quantization import linear as linear_module

    gpu_like = Model("auto")
    monkeypatch.setattr(linear_module, "_MATMUL_SELECTOR", [lambda fmt, m: "pallas" if m <= 16 else "xla"])
    assert dequantized_weight_bytes(gpu_like, 16, device) == 0
    assert dequantized_weight_bytes(gpu_like, 8192, device) == widest_layer_bytes


@pytest.fixture
def jax_default_fraction(monkeypatch):
    """Neither allocator-fraction variable set: JAX's GPU allocator holds its default 75%."""
    from paged_jax.worker import device_memory

    monkeypatch.delenv(device_memory.MEM_FRACTION_ENV, raising=False)
    monkeypatch.delenv(device_memory.DEPRECATED_MEM_FRACTION_ENV, raising=False)


def test_gpu_memory_utilization_is_a_fraction_of_total_memory(jax_default_fraction, monkeypatch, caplog):
    from paged_jax.worker import device_memory

    weights = 16 * GIB
    # JAX's default cap (75% of the device): 0.5 of the TOTAL fits under it.
    blocks, per_block = _num_blocks(FakeGpu(int(0.75 * TOTAL), weights), 0.5)
    kv = blocks * per_block
    assert 0.5 * TOTAL - weights - 2 * GIB < kv <= 0.5 * TOTAL - weights  # headroom for activations: < 2 GiB here
    # 0.9 of the total exceeds JAX's cap: the cap is used, with a warning naming the variable to set.
    with caplog.at_level(logging.WARNING, logger="paged_jax.worker.device_memory"):
        blocks, _ = _num_blocks(FakeGpu(int(0.75 * TOTAL), weights), 0.9)
    assert blocks * per_block <= 0.75 * TOTAL - weights
    assert "XLA_CLIENT_MEM_FRACTION=0.9" in caplog.text
    # With the variable set to the utilization (what LLMEngine does before JAX starts), 0.9 of the total is used.
    caplog.clear()
    monkeypatch.setenv(device_memory.MEM_FRACTION_ENV, "0.9")
    blocks, _ = _num_blocks(FakeGpu(int(0.9 * TOTAL), weights), 0.9)
    assert 0.9 * TOTAL - weights - 2 * GIB < blocks * per_block <= 0.9 * TOTAL - weights
    assert not caplog.records
    assert device_memory.usable_device_bytes({"bytes_limit": 64 * GIB}, "tpu", 0.5) == (64 * GIB, 32 * GIB)


def test_reserve_gpu_memory_fraction_only_before_jax_starts(jax_default_fraction, monkeypatch):
    import jax
    from jax._src import xla_bridge

    from paged_jax.worker import device_memory

    jax.devices()  # the test session's CPU backend is running
    assert xla_bridge.backends_are_initialized()
    assert not device_memory.reserve_gpu_memory_fraction(0.85)  # too late: nothing set
    assert device_memory.MEM_FRACTION_ENV not in os.environ
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setenv(device_memory.DEPRECATED_MEM_FRACTION_ENV, "0.6")  # the user's own choice wins
    assert not device_memory.reserve_gpu_memory_fraction(0.85)
    monkeypatch.delenv(device_memory.DEPRECATED_MEM_FRACTION_ENV)
    monkeypatch.setenv(device_memory.MEM_FRACTION_ENV, "")  # registered with monkeypatch, so undone after
    assert device_memory.reserve_gpu_memory_fraction(0.85)
    assert os.environ[device_memory.MEM_FRACTION_ENV] == "0.85" and device_memory.allocator_fraction() == 0.85


def test_kv_pool_too_small_for_max_model_len_is_a_clear_error(jax_default_fraction):
    with pytest.raises(ValueError, match=r"max_model_len=131072.*can hold \d+ tokens.*--max-model-len.*"
                                         r"--gpu-memory-utilization.*--num-gpu-blocks-override"):
        _num_blocks(FakeGpu(int(0.75 * TOTAL), 30 * GIB), 0.5, max_model_len=131072)  # 16 GiB KV needed
    with pytest.raises(ValueError, match=r"max_model_len=4096 needs 256 KV blocks.*num_gpu_blocks_override=100 "
                                         r"leaves 99.*1584 tokens"):
        _num_blocks(FakeGpu(TOTAL, 0), 0.9, override=100)
    assert _num_blocks(FakeGpu(TOTAL, 0), 0.9, override=257)[0] == 257


def test_max_model_len_defaults_to_the_models_own(caplog):
    from paged_jax.engine.core_setup import default_max_model_len

    assert default_max_model_len(None, 131072, on_accelerator=True) == 131072  # no 8192 cap (vLLM)
    assert default_max_model_len(None, 1024, on_accelerator=False) == 1024
    with caplog.at_level(logging.INFO, logger="paged_jax.engine.core_setup"):
        assert default_max_model_len(None, 8192, on_accelerator=False) == 2048
    assert "--max-model-len 8192" in caplog.text  # the CPU cap is logged with the flag that lifts it
    assert default_max_model_len(8192, 8192, on_accelerator=False) == 8192
    with pytest.raises(ValueError, match="max_model_len"):
        default_max_model_len(4096, 2048, on_accelerator=True)


@pytest.fixture
def tiny_model_dir(tmp_path):
    from models.testing import tiny_config

    (tmp_path / "config.json").write_text(json.dumps(tiny_config("llama", max_position_embeddings=128)))
    return str(tmp_path)


def test_no_enable_chunked_prefill_reaches_the_scheduler(tiny_model_dir):
    """--no-enable-chunked-prefill works (a prompt is prefilled whole), so a step budget below max_model_len is
    refused, as vLLM refuses it."""
    from paged_jax.config import EngineArgs
    from paged_jax.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(16\) must be >= max_model_len \(128\) when "
                                         r"chunked prefill is disabled"):
        LLMEngine(EngineArgs(model=tiny_model_dir, load_format="dummy", dtype="float32", max_num_seqs=2,
                             max_num_batched_tokens=16, enable_chunked_prefill=False), use_tqdm=False)


def test_seed_makes_unseeded_sampling_reproducible(tiny_model_dir):
    """vLLM V1's --seed: a fresh engine with the same seed samples the same outputs for the same unseeded requests
    in the same order, while requests within a run still differ."""
    from paged_jax.config import EngineArgs
    from paged_jax.engine.llm_engine import LLMEngine
    from paged_jax.sampling_params import SamplingParams

    def sample_twice(seed):
        engine = LLMEngine(EngineArgs(model=tiny_model_dir, load_format="dummy", dtype="float32", seed=seed,
                                      max_num_seqs=2, max_num_batched_tokens=16, num_gpu_blocks_override=20),
                           use_tqdm=False)
        assert engine.max_model_len == 128  # the model's own
        params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
        outputs = []
        for request_id in ("a", "b"):
            engine.add_request(request_id, [5, 6, 7], params)
            tokens = []
            while engine.has_unfinished_requests():
                tokens += [t for out in engine.step() for c in out.outputs for t in c.token_ids]
            outputs.append(tokens)
        return outputs

    first, again = sample_twice(3), sample_twice(3)
    assert first == again and first[0] != first[1]


def test_accepted_vllm_flags_with_nothing_to_change_say_so(caplog):
    from paged_jax.config import EngineArgs

    with caplog.at_level(logging.INFO, logger="paged_jax.config"):
        EngineArgs().log_compatibility_notes()
        assert caplog.text == ""
        EngineArgs(enforce_eager=True, trust_remote_code=True).log_compatibility_notes()
    assert "enforce_eager: nothing to change" in caplog.text and "trust_remote_code: nothing to change" in caplog.text


def test_flags_that_cannot_act_here_warn_once_each(caplog):
    """GPU memory on the CPU, swap space without swap preemption: a warning naming the flag; none by default or
    where the flag acts."""
    from paged_jax.config import EngineArgs

    with caplog.at_level(logging.INFO, logger="paged_jax.config"):
        EngineArgs().log_compatibility_notes(on_accelerator=False)
        EngineArgs(gpu_memory_utilization=0.5).log_compatibility_notes(on_accelerator=True)
        EngineArgs(swap_space=8, preemption_mode="swap").log_compatibility_notes(on_accelerator=False)
        assert caplog.text == ""
        EngineArgs(gpu_memory_utilization=0.5, swap_space=8).log_compatibility_notes(on_accelerator=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert warnings[0].startswith("gpu_memory_utilization=0.5 has no effect on the CPU")
    assert warnings[1].startswith("swap_space=8 has no effect with preemption_mode='recompute'")


def test_a_flag_given_at_its_default_value_still_warns_where_it_cannot_act(caplog):
    """``--gpu-memory-utilization 0.9`` / ``--swap-space 4`` given explicitly on the CPU / without swap preemption
    warn once each though they equal the defaults (so do the keywords); the defaults alone do not, also after the
    pickling that takes them to the engine process."""
    import pickle

    from paged_jax.config import EngineArgs
    from paged_jax.entrypoints.cli import build_generate_parser, engine_kwargs

    def warnings_of(engine_args: EngineArgs) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="paged_jax.config"):
            engine_args.log_compatibility_notes(on_accelerator=False)
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    def from_flags(*flags: str) -> EngineArgs:
        args = build_generate_parser().parse_args(["--prompt", "hi", *flags])
        return pickle.loads(pickle.dumps(EngineArgs(**engine_kwargs(args))))

    assert warnings_of(from_flags()) == []
    explicit = from_flags("--gpu-memory-utilization", "0.9", "--swap-space", "4")
    assert (explicit.gpu_memory_utilization, explicit.swap_space) == (0.9, 4.0)
    warnings = warnings_of(explicit)
    assert len(warnings) == 2 and warnings[0].startswith("gpu_memory_utilization=0.9 has no effect on the CPU")
    assert warnings[1].startswith("swap_space=4.0 has no effect with preemption_mode='recompute'")
    assert len(warnings_of(EngineArgs(gpu_memory_utilization=0.9))) == 1
    assert warnings_of(from_flags("--swap-space", "4", "--preemption-mode", "swap")) == []


def test_top_level_help_lists_each_command():
    """``paged-jax --help`` names every subcommand with a line saying what it does."""
    import contextlib
    import io

    from serving.commands import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--help"]) == 0
    lines = out.getvalue().splitlines()
    for command in ("serve", "generate", "bench serve", "bench throughput", "bench latency"):
        assert any(line.strip().startswith(command + " ") and len(line.split()) > 3 for line in lines), command
