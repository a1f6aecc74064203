"""``paged-jax bench {serve,throughput,latency}``: vLLM's flags in, vLLM's lines and JSON out, on the built-in model
(CPU, short settings: the engine settings of the shared ``serving_engine``, so its compiled executables are reused)."""

from __future__ import annotations

import json
import re

import pytest

# The shared serving engine's settings (tests/conftest.py), so the executable cache serves every compile.
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens",
                "64"]


def test_bench_help_lists_each_command(capsys):
    from serving.commands import main

    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for command in ("serve", "throughput", "latency"):
        assert re.search(rf"^  {command} +\S", out, re.M), command
    assert main(["bench"]) == 2


@pytest.mark.parametrize("argv, named", [
    (["latency", "--profile"], "--profile"),
    (["throughput", "--dataset-path", "sharegpt.json"], "--dataset-path"),
    (["throughput", "--dataset-name", "sharegpt"], "--dataset-name"),
    (["serve", "--dataset-name", "sharegpt"], "--dataset-name"),
    (["serve", "--endpoint", "/v1/chat/completions"], "--endpoint"),
    (["serve", "--ignore-eos"], "--ignore-eos"),
    (["serve", "--result-filename", "r.json"], "--save-result"),
])
def test_unimplemented_vllm_bench_flags_exit_2_naming_the_flag(argv, named, capsys):
    from serving.commands import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2 and named in capsys.readouterr().err


@pytest.mark.slow
def test_bench_latency_prints_average_and_percentiles(smollm2_dir, tmp_path, capsys):
    from serving.commands import main

    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", str(smollm2_dir), "--input-len", "8", "--output-len", "3",
                 "--batch-size", "2", "--num-iters-warmup", "1", "--num-iters", "3", "--output-json", str(out),
                 *ENGINE_FLAGS]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 3 and all(t > 0 for t in result["latencies"])
    assert result["avg_latency"] == pytest.approx(sum(result["latencies"]) / 3)
    assert list(result["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    assert min(result["latencies"]) <= result["percentiles"]["50"] <= max(result["latencies"])
    assert f"Avg latency: {result['avg_latency']} seconds" in printed
    assert f"99% percentile latency: {result['percentiles']['99']} seconds" in printed


# Slow: the wrapped benchmark stays covered by tests/test_benchmarks.py's throughput runs.
@pytest.mark.slow
def test_bench_throughput_reports_requests_and_tokens_per_second(tmp_path, capsys):
    """No --model: the built-in one, as ``paged-jax serve`` without MODEL."""
    from serving.commands import main

    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--input-len", "10", "--output-len", "4", "--num-prompts", "3",
                 "--dataset-name", "random", "--output-json", str(out), *ENGINE_FLAGS]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["num_requests"] == 3 and result["total_num_tokens"] == 3 * (10 + 4)
    assert result["requests_per_second"] == pytest.approx(3 / result["elapsed_time"])
    assert result["tokens_per_second"] == pytest.approx(42 / result["elapsed_time"])
    assert re.search(r"^Throughput: [\d.]+ requests/s, [\d.]+ total tokens/s, [\d.]+ output tokens/s$", printed, re.M)


def test_bench_serve_reports_ttft_tpot_itl_against_a_live_server(serving_engine, tmp_path, capsys):
    from serving.app import create_app
    from serving.commands import main
    from tests.test_serving import ServerThread

    with ServerThread(create_app(serving_engine)) as server:
        assert main(["bench", "serve", "--backend", "openai", "--host", "127.0.0.1", "--port", str(server.port),
                     "--dataset-name", "random", "--random-input-len", "6", "--random-output-len", "4",
                     "--num-prompts", "3", "--request-rate", "inf", "--max-concurrency", "2", "--save-result",
                     "--result-dir", str(tmp_path), "--result-filename", "serve.json"]) == 0
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "serve.json").read_text())
    assert (result["completed"], result["failed"]) == (3, 0)
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (18, 12)
    assert result["max_concurrency"] == 2
    for name in ("ttft", "tpot", "itl"):
        assert result[f"mean_{name}_ms"] > 0 and result[f"p99_{name}_ms"] >= result[f"median_{name}_ms"]
    for label in ("Mean TTFT (ms):", "Median TPOT (ms):", "P99 ITL (ms):", "Request throughput (req/s):"):
        assert label in printed
