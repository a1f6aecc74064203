"""benchmarks/throughput.py on the real small model (CPU): tiny workloads run end to end and report what was done."""

import pytest


@pytest.mark.parametrize("num_prompts", [1, 3])
def test_throughput_random_workload_counts_every_token(smollm2_dir, tmp_path, num_prompts):
    """A single-prompt workload works (the warm-up once asked for 4 prompts' params), --temperature overrides the
    workload's, and the JSON counts exactly the requested output tokens."""
    import json

    from benchmarks.throughput import main

    out = tmp_path / "t.json"
    result = main(["--model", str(smollm2_dir), "--workload", "random", "--num-prompts", str(num_prompts),
                   "--input-len", "12", "--output-len", "5", "--max-num-batched-tokens", "32", "--max-num-seqs", "4",
                   "--max-model-len", "128", "--dtype", "float32", "--temperature", "0", "--out", str(out)])
    assert result["num_requests"] == num_prompts
    assert result["output_tokens"] == 5 * num_prompts
    assert result["prompt_tokens"] == 12 * num_prompts
    assert result["output_tok_s"] > 0
    assert json.loads(out.read_text())["output_tokens"] == 5 * num_prompts
    assert "--temperature" in result["argv"]
