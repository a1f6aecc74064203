"""benchmarks/throughput.py on the real small model (CPU): tiny workloads run end to end and report what was done."""

import pytest


# Three prompts (batching in the benchmark) run with `make test-all` (marker `slow`): CI time.
@pytest.mark.parametrize("num_prompts", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_throughput_random_workload_counts_every_token(smollm2_dir, tmp_path, num_prompts):
    """A single-prompt workload works (the warm-up once asked for 4 prompts' params), --temperature overrides the
    workload's, and the JSON counts exactly the requested output tokens; --breakdown counts the timed steps by bucket
    without disturbing the runner's compile counter."""
    import json

    from benchmarks.throughput import main

    out = tmp_path / "t.json"
    result = main(["--model", str(smollm2_dir), "--workload", "random", "--num-prompts", str(num_prompts),
                   "--input-len", "12", "--output-len", "5", "--max-num-batched-tokens", "16", "--max-num-seqs", "2",
                   "--max-model-len", "128", "--dtype", "float32", "--temperature", "0", "--out", str(out),
                   "--breakdown"])
    assert result["num_requests"] == num_prompts
    assert result["output_tokens"] == 5 * num_prompts
    assert result["prompt_tokens"] == 12 * num_prompts
    assert result["output_tok_s"] > 0
    assert json.loads(out.read_text())["output_tokens"] == 5 * num_prompts
    assert "--temperature" in result["argv"]
    assert result["speculative_decoding"] is None
    breakdown = result["breakdown"]
    assert sum(breakdown["steps_per_bucket"].values()) == breakdown["steps"] > 0
    assert result["engine_stats"]["num_compiles_since_warmup"] == 0


# CI time: the speculative engines are tested in test_spec_decode*; this checks the benchmark's report of them.
@pytest.mark.slow
def test_throughput_with_speculative_config_reports_the_timed_run_drafts(smollm2_dir):
    """--speculative-config goes to the engine (vLLM's flag): the JSON has the timed run's draft counters and mean
    acceptance length, and the outputs count exactly as without drafts."""
    from benchmarks.throughput import main

    spec = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'
    result = main(["--model", str(smollm2_dir), "--workload", "random", "--num-prompts", "1", "--input-len", "12",
                   "--output-len", "16", "--max-num-batched-tokens", "16", "--max-num-seqs", "1", "--max-model-len",
                   "128", "--dtype", "float32", "--temperature", "0", "--speculative-config", spec])
    assert result["output_tokens"] == 16
    drafts = result["speculative_decoding"]
    assert drafts["spec_decode_num_drafts"] >= 1
    assert 0 <= drafts["spec_decode_num_accepted_tokens"] <= drafts["spec_decode_num_draft_tokens"]
    assert drafts["spec_decode_num_draft_tokens"] <= 2 * drafts["spec_decode_num_drafts"]
    assert drafts["mean_acceptance_length"] == pytest.approx(
        1 + drafts["spec_decode_num_accepted_tokens"] / drafts["spec_decode_num_drafts"])


def test_host_overhead_times_decode_steps_only():
    """benchmarks/host_overhead.py on a tiny model (prompts longer than the step budget): every timed step decodes
    every sequence, and the host phases come in wall and thread CPU time."""
    from benchmarks.host_overhead import main

    result = main(["--num-seqs", "4", "--steps", "3", "--isolate-host", "--max-num-batched-tokens", "16",
                   "--max-model-len", "256"])
    assert result["num_seqs_running"] == 4 and result["decode_steps"] == 3
    assert result["outputs_per_step"] == 4.0
    assert 0 < result["host_cpu_ms"] <= result["step_cpu_ms"]
    assert result["schedule_cpu_ms"] > 0 and result["update_cpu_ms"] > 0


# Slow: tensor-parallel exactness stays covered by tests/test_sharding.py.
@pytest.mark.slow
def test_sharding_benchmark_reports_floor_scaling_and_exact_agreement(tmp_path):
    """benchmarks/sharding.py on the fake CPU devices: fp32 layouts agree exactly with tp1, the pipelined step,
    floor and per-GPU scaling columns are filled, and each tp device holds half of tp1's weights."""
    import json

    import jax

    from benchmarks.sharding import main

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (conftest sets 8 fake CPU devices)")
    results = main(["--shape", "small", "--layouts", "tp1,tp2,dp2xtp1", "--batch", "4", "--prompt-len", "8",
                    "--decode-steps", "3", "--repeats", "1", "--out", str(tmp_path / "s.json")])
    by_name = {r["layout"]: r for r in results}
    assert all(r["agreement"] == "1.000" for r in results)
    assert by_name["tp1"]["scaling_vs_first"] == 1.0
    assert by_name["tp2"]["weights_mib_per_device"] < 0.6 * by_name["tp1"]["weights_mib_per_device"]
    for r in results:
        assert r["decode_step_ms"] > 0 and r["sync_decode_step_ms"] > 0 and r["weight_read_floor_ms"] > 0
        expected = r["decode_tok_s"] / (r["dp"] * r["tp"]) / (by_name["tp1"]["decode_tok_s"])
        assert abs(r["scaling_vs_first"] - expected) < 1e-2
    assert len(json.loads((tmp_path / "s.json").read_text())["results"]) == 3


def test_sharding_diagnostics_count_collectives_and_bytes_per_device():
    """count_collectives counts each collective instruction once (an async start included, its done not);
    bytes_per_device sums each device's own shards (a split array 1/n per device, a replicated one whole)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from benchmarks.sharding import bytes_per_device, count_collectives

    hlo = "\n".join([
        "  %ar = f32[4,8]{1,0} all-reduce(f32[4,8]{1,0} %x), replica_groups={{0,1}}",
        "  %ags = (f32[4], f32[8]) all-gather-start(f32[4] %y), dimensions={0}",
        "  %agd = f32[8] all-gather-done((f32[4], f32[8]) %ags)",
        "  %cp = f32[4] collective-permute(f32[4] %z), source_target_pairs={{0,1}}",
    ])
    assert count_collectives(hlo) == {"all-reduce": 1, "all-gather": 1, "reduce-scatter": 0, "all-to-all": 0,
                                      "collective-permute": 1}

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (conftest sets 8 fake CPU devices)")
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    split = jax.device_put(jnp.zeros((8, 4), jnp.float32), NamedSharding(mesh, PartitionSpec("tp")))
    whole = jax.device_put(jnp.zeros((3,), jnp.int32), NamedSharding(mesh, PartitionSpec()))
    per_device = bytes_per_device({"split": split, "whole": whole, "not an array": 1.5})
    assert per_device == {device: 8 * 4 * 4 // 2 + 3 * 4 for device in jax.devices()[:2]}


def test_floors_charge_only_the_work_a_step_must_do():
    """A decode step reads an untied input embedding's batch rows only (the LM head whole); a tied table is read once
    as the LM head; the compute floor counts the LM head for sampled rows only and adds causal attention."""
    from benchmarks.floors import decode_step_floor_s, decode_weight_bytes, workload_floor
    from benchmarks.workloads import Req, Workload
    from models.presets import num_params, preset_config

    llama = preset_config("llama-3.1-8b")  # untied
    embed_bytes = llama.vocab_size * llama.hidden_size * 2
    assert decode_weight_bytes(llama, 1) == num_params(llama) * 2 - embed_bytes + llama.hidden_size * 2
    assert 3.45e-3 < decode_step_floor_s(llama, 1, 0) < 3.52e-3  # the corrected batch-1 floor
    qwen = preset_config("qwen3-0.6b")  # tied: the table is the LM head
    assert decode_weight_bytes(qwen, 64) == num_params(qwen) * 2

    one = Workload("one", [Req(prompt_token_ids=[1] * 10, max_tokens=3)], temperature=0.0,
                   ignore_eos=True)
    floor = workload_floor(llama, one, max_num_seqs=1)
    head = llama.vocab_size * llama.hidden_size
    body = num_params(llama) - 2 * head
    assert floor["matmul_flops"] == 2 * body * (10 + 3 - 1) + 2 * head * 3
    per_key = 4 * llama.num_hidden_layers * llama.num_attention_heads * llama.head_dim
    assert floor["attention_flops"] == per_key * (55 + 11 + 12)  # prompt 1..10 keys, fed-back tokens 11 and 12
    kv_per_token = 2 * llama.num_hidden_layers * llama.num_key_value_heads * llama.head_dim * 2
    assert floor["kv_read_bytes"] == kv_per_token * (10 + 11)  # two fed-back tokens read 10 and 11 cached tokens


def test_floors_of_experts_and_sliding_windows():
    """A mixture-of-experts step reads the experts its rows route to (all of them for a large batch, k per layer for
    one token) and multiplies by k experts per token; a sliding-window layer reads only its window's K/V."""
    from benchmarks.floors import active_body_params, decode_step_floor_s, decode_weight_bytes, kv_read_bytes
    from models.presets import num_params, preset_config

    moe = preset_config("qwen3-30b-a3b")
    assert 30.4e9 < num_params(moe) < 30.6e9  # the published 30.5B
    expert = 3 * moe.hidden_size * moe.moe.moe_intermediate_size
    one_token = decode_weight_bytes(moe, 1)
    assert one_token == pytest.approx(decode_weight_bytes(moe, 10_000) - 2 * 48 * (128 - 8) * expert
                                      - 2 * 9_999 * moe.hidden_size, rel=1e-6)
    assert decode_weight_bytes(moe, 10_000) < num_params(moe) * 2 + 10_000 * moe.hidden_size * 2
    assert active_body_params(moe) * 2 == pytest.approx(one_token - 2 * moe.vocab_size * moe.hidden_size
                                                        - 2 * moe.hidden_size, rel=1e-6)
    fp8 = preset_config("qwen3-30b-a3b-fp8")  # block-FP8 experts: one byte per expert weight
    assert fp8.moe.expert_format == "fp8" and fp8.fp8_weight_block == (128, 128)
    assert decode_weight_bytes(fp8, 1) == one_token - 48 * 8 * expert
    gemma = preset_config("gemma-3-12b")  # 8 full layers, 40 with a 1,024-token window
    per_layer_token = 2 * gemma.num_key_value_heads * gemma.head_dim * 2
    assert kv_read_bytes(gemma, 32768, 1) == per_layer_token * (8 * 32768 + 40 * 1024)
    assert kv_read_bytes(gemma, 1000, 30) == per_layer_token * 48 * sum(range(1000, 1024)) + per_layer_token * (
        8 * sum(range(1024, 1030)) + 40 * 6 * 1024)
    assert decode_step_floor_s(gemma, 2, 32768) == pytest.approx(
        (decode_weight_bytes(gemma, 2) + 2 * kv_read_bytes(gemma, 32768, 1)) / 4.3e12)


def test_decode_context_benchmark_times_decode_steps_with_kv_groups():
    """benchmarks/decode_context.py on the CPU: a tiny Gemma 3 (three KV-cache groups), decode steps timed after the
    prefill, nothing compiled after warm-up; the same-run ceilings measured in a child process."""
    from benchmarks.decode_context import main

    result = main(["--tiny", "--context", "40", "--batch", "2", "--steps", "3", "--ceilings"])
    assert result["kv_groups"] == 3 and result["batch"] == 2 and result["steps"] == 3
    assert result["ceilings"]["copy_GBps"] > 0 and result["ceilings"]["matmul_TFLOPs"] > 0
    assert result["decode_step_ms"] > 0 and result["num_compiles_since_warmup"] == 0


def test_pool_memory_benchmark_reports_each_step_against_the_pool():
    """benchmarks/pool_memory.py on the CPU: a tiny Gemma 3's steps (three KV-cache groups) compiled without a pool,
    each writing the donated pool in place."""
    from benchmarks.pool_memory import main

    result = main(["--tiny"])
    assert result["kv_groups"] == 3 and len(result["steps"]) == 3 and result["in_place"]
    assert all(step["alias_bytes"] == result["pool_bytes"] for step in result["steps"])


@pytest.mark.slow  # two engine processes, the first compiling every executable: over the CI budget on 2 cores
def test_second_start_loads_every_executable_from_the_compilation_cache(tmp_path):
    """benchmarks/startup.py's compile_warm mode: a first engine start (its own process) fills the persistent
    compilation cache and the executable cache, a second start in a fresh process with the same cache dir misses
    them for nothing (the keys are the same on every start), compiles nothing after warm-up and reports each
    phase."""
    from benchmarks.startup import main
    from models.testing import save_random_hf_checkpoint, tiny_config

    checkpoint = save_random_hf_checkpoint(tiny_config("qwen3", vocab_size=256), tmp_path / "ckpt")
    result = main(["--model", str(checkpoint), "--workdir", str(tmp_path / "work"), "--modes", "compile_warm",
                   "--repeats", "1", "--max-num-batched-tokens", "16", "--max-num-seqs", "2", "--max-model-len", "32",
                   "--dtype", "float32", "--compile-threads", "2"])
    first, second = result["compile_warmup"], result["compile_warm"]["runs"][0]
    assert first["compile_cache_misses"] > 0 and first["compile_threads"] == 2
    assert second["compile_cache_misses"] == 0, second["compile_cache_missed"]
    # The step executables come from the runner's executable cache (the first start compiled them fresh and saved
    # them): nothing traced, lowered or looked up in JAX's cache.
    assert first["executables_loaded"] == 0 and second["executables_loaded"] == second["num_compiles"] > 0
    assert second["num_compiles_since_warmup"] == 0
    for phase in ("model_load_s", "warm_up_compile_s", "kv_pool_s", "warm_up_run_s", "first_token_s", "imports_s",
                  "engine_backend_s", "engine_load_s", "engine_kv_sizing_s", "engine_runner_init_s",
                  "engine_warm_up_s"):
        assert second[phase] >= 0


@pytest.mark.slow  # two engine processes on a cold compilation cache
def test_cold_start_reports_the_first_token_before_every_executable_is_ready(tmp_path):
    """benchmarks/startup.py's compile_cold mode with background compilation: the first token comes after the first
    executables, every executable lands later, and nothing compiled on the step path."""
    from benchmarks.startup import main
    from models.testing import save_random_hf_checkpoint, tiny_config

    checkpoint = save_random_hf_checkpoint(tiny_config("llama", vocab_size=256), tmp_path / "ckpt")
    result = main(["--model", str(checkpoint), "--workdir", str(tmp_path / "work"), "--modes", "compile_cold",
                   "--repeats", "1", "--no-compile-warmup", "--max-num-batched-tokens", "32", "--max-num-seqs", "4",
                   "--max-model-len", "64", "--dtype", "float32", "--compile-threads", "2"])
    run = result["compile_cold"]["runs"][0]
    assert run["first_executables"] == 4 and run["first_executables"] + run["background_executables"] == \
        run["num_compiles"]
    assert run["process_to_first_token_s"] <= run["process_to_all_ready_s"]
    assert 0 < run["cpu_to_first_token_s"] <= run["cpu_to_all_ready_s"]
    assert run["num_compiles_since_warmup"] == 0


def test_startup_serve_flags_spell_the_engine_arguments():
    """benchmarks.startup --serve hands a start's engine arguments to ``paged-jax serve`` as its flags."""
    from benchmarks.startup import _serve_flags
    from serving.cli import parse_serve_args
    from serving.settings import engine_args_from_namespace

    kwargs = {"max_model_len": 64, "weight_cache": False, "background_compilation": True, "tokenizer": None,
              "compilation_cache_dir": "/tmp/x"}
    engine_args = engine_args_from_namespace(parse_serve_args(_serve_flags(kwargs))[1])
    assert (engine_args.max_model_len, engine_args.weight_cache, engine_args.background_compilation,
            engine_args.tokenizer, engine_args.compilation_cache_dir) == (64, False, True, None, "/tmp/x")


def test_quantization_sweep_table_keeps_the_float8_dot_out_of_the_fp8_buckets():
    """The sweep's ``AUTO_IMPL`` suggestions for fp8 name weight-only paths only (the entries also serve weight-only
    FP8 layers, whose "xla" is the upcast dot); the float8 dot's own suggestion is the smallest swept M from which it
    wins at every swept M."""
    from benchmarks.quantization_sweep import _auto_table
    from paged_jax.ops.quantized_matmul_tuning import M_BUCKETS, NATIVE_IMPLS, m_bucket

    shapes = [("qkv", 8, 8), ("o", 8, 8)]
    # Seconds per projection: the float8 dot wins at 1, loses at 16, wins at 64 and 256 (so it wins "from 64").
    per_m = {1: {"xla": 1.0, "xla_native": 2.0, "pallas": 3.0}, 16: {"xla": 3.0, "xla_native": 1.0, "pallas": 2.0},
             64: {"xla": 1.0, "xla_native": 2.0, "pallas": 3.0}, 256: {"xla": 1.0, "xla_native": 2.0}}
    best_times = {("fp8", m, name): {impl: (t, None, None) for impl, t in times.items()}
                  for m, times in per_m.items() for name, _, _ in shapes}
    results = []
    _auto_table(results, lambda res, row: res.append(row), best_times, ["fp8"], list(per_m), shapes, M_BUCKETS,
                NATIVE_IMPLS, m_bucket)
    rows = [r for r in results if r["section"] == "sweep_auto_table"]
    entries = next(r["AUTO_IMPL_entries"] for r in rows if "AUTO_IMPL_entries" in r)
    assert entries and all("'xla'" not in e for e in entries)
    assert entries == ["('fp8', 1): 'xla_native',", "('fp8', 16): 'xla_native',", "('fp8', 64): 'xla_native',"]
    assert next(r["FP8_DOT_MIN_ROWS"] for r in rows if "FP8_DOT_MIN_ROWS" in r) == 64


def test_schedule_benchmark_counts_the_steps_of_a_workload():
    """benchmarks.schedule on two workloads small enough to schedule by hand: (a) two prompts of 4 tokens, 3 output
    tokens each, 2 slots, 8 tokens a step: one prefill step, then two decode-only steps whose rows read 5 and then 6
    keys each; (b) one prompt of 9 tokens in steps of 8: the prompt's one-token last piece is prompt work, not a
    decode, so only the step after it is decode-only (10 keys)."""
    from benchmarks.schedule import simulate, summarize
    from benchmarks.workloads import random_fixed

    def run(num_prompts, input_len, output_len):
        steps = simulate(random_fixed(num_prompts=num_prompts, input_len=input_len, output_len=output_len),
                         max_num_seqs=2, max_num_batched_tokens=8, max_model_len=32, num_blocks=16, block_size=4)
        return steps, summarize(steps, weight_bytes=lambda rows: 1000 + rows, kv_bytes_per_token=10,
                                hbm_bytes_per_s=1e3)

    steps, summary = run(2, 4, 3)
    assert [(tokens, rows, prompt, kv) for tokens, rows, prompt, kv, _ in steps] == [
        (8, 0, 8, 0), (2, 2, 0, 10), (2, 2, 0, 12)]
    assert summary["steps"] == 3 and summary["decode_only_steps"] == 2 and summary["prefill_steps"] == 1
    assert summary["decode_only_bytes"] == 22 * 10 + 2 * 1002 and summary["decode_only_floor_s"] == 2.224
    assert summary["decode_only_mean_context"] == 5.5 and summary["tokens"] == 12

    steps, summary = run(1, 9, 2)
    assert [(tokens, rows, prompt, kv) for tokens, rows, prompt, kv, _ in steps] == [
        (8, 0, 8, 0), (1, 0, 1, 0), (1, 1, 0, 10)]
    assert summary["decode_only_steps"] == 1 and summary["decode_only_bytes"] == 10 * 10 + 1001


def test_moe_kernel_benchmark_checks_times_and_floors_every_token_count(tmp_path):
    """benchmarks/moe_kernel.py on a tiny shape with the kernel interpreted: every form and swept config agrees with
    the reference, every token count is timed, the floor counts only the experts the tokens route to, and T=1's op
    is also timed in parts."""
    import json

    from benchmarks.moe_kernel import floor_bytes, main

    out = tmp_path / "moe.json"
    results = main(["--tokens", "1,9", "--hidden", "32", "--inter", "32", "--experts", "8", "--top-k", "2",
                    "--repeats", "1", "--rotations", "2", "--interpret",
                    "--configs", "16/32/32/auto/4/3,16/32/16/auto/2/1",
                    "--gather-max-tokens", "1", "--out", str(out)])
    assert [r["tokens"] for r in results] == [1, 9]
    for r in results:
        limit = 0.02 * max(r["check"]["reference_max_abs"], 1e-3)
        assert all(diff <= limit for name, diff in r["check"].items() if name.endswith("_max_abs_diff"))
        assert all(r[f"{name}_us"] > 0 for name in ("pallas", "ragged_dot", "ragged_dot_fused"))
        default, other = r["configs"]  # the default launch's figures are the pallas form's
        assert default == {"config": r["default_config"], "max_abs_diff": r["check"]["pallas_max_abs_diff"],
                           "us": r["pallas_us"], "x_floor": r["pallas_x_floor"]}
        assert other["config"] == "16/32/16/auto/2/1" and other["max_abs_diff"] <= limit and other["us"] > 0
        assert r["best_config"] in (default["config"], other["config"])
    assert {"gather_dot_max_abs_diff", "gather_reduce_max_abs_diff"} <= set(results[0]["check"])
    assert "gather_dot_us" not in results[1]  # T=9 is past --gather-max-tokens
    split = results[0]["split"]
    assert all(split[f"{part}_us"] > 0 for part in ("route", "sort", "gate_up", "down", "combine", "op"))
    assert sum(split["hlo_launches"].values()) >= 1
    assert "split" not in results[1]
    assert results[0]["experts_touched"] == 2  # one token, top 2
    assert 2 <= results[1]["experts_touched"] <= 8
    assert floor_bytes(1, 32, 16, 2, 2) == 2 * (2 * 3 * 32 * 16 + 32 + 2 * 2 * 16 + 2 * 2 * 32 + 32)
    assert len(json.loads(out.read_text())["results"]) == 2


def test_moe_kernel_benchmark_fp8_experts(tmp_path):
    """benchmarks/moe_kernel.py --weights fp8 on a tiny shape, the kernel interpreted: the FP8 kernel (tiles
    dequantized in the kernel), the gathered FP8 form and the bf16 forms on the dequantized weights agree with the
    reference, every form is timed, and the floor counts one byte per weight."""
    from benchmarks.moe_kernel import floor_bytes, main

    results = main(["--tokens", "5", "--hidden", "48", "--inter", "40", "--experts", "4", "--top-k", "2",
                    "--repeats", "1", "--rotations", "1", "--interpret", "--weights", "fp8", "--fp8-block", "16",
                    "--configs", "none", "--split-tokens", ""])
    (r,) = results
    assert r["weights"] == "fp8" and "configs" not in r and "split" not in r
    limit = 0.02 * max(r["check"]["reference_max_abs"], 1e-3)
    assert all(diff <= limit for name, diff in r["check"].items() if name.endswith("_max_abs_diff"))
    assert all(r[f"{name}_us"] > 0 for name in ("pallas", "pallas_bf16", "ragged_dot", "ragged_dot_fused",
                                                "gather_dot", "gather_reduce"))
    assert floor_bytes(1, 32, 16, 2, 2, 1) == 2 * 3 * 32 * 16 + 2 * (32 + 2 * 2 * 16 + 2 * 2 * 32 + 32)


def test_moe_kernel_benchmark_sweeps_by_rows_per_expert_and_counts_launches():
    """The configs swept per T (decode ones up to 16 rows an expert, prefill ones from 4, every one a launch the
    kernel takes) and the count of launching instructions in a compiled module's text."""
    from benchmarks.moe_kernel import DECODE_SWEEP, PREFILL_SWEEP, hlo_launches, sweep_configs

    assert [str(c) for c in sweep_configs(8, 128)] == list(DECODE_SWEEP)
    assert [str(c) for c in sweep_configs(64 * 8, 128)] == list(DECODE_SWEEP + PREFILL_SWEEP)
    assert [str(c) for c in sweep_configs(4096 * 8, 128)] == list(PREFILL_SWEEP)
    text = """HloModule m

%fused_computation (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %e = f32[8]{0} exponential(%p)
}

ENTRY %main (a: s32[8], b: f32[8]) -> f32[8] {
  %a = s32[8]{0} parameter(0)
  %sort = s32[8]{0} sort(%a), dimensions={0}, to_apply=%cmp
  %k = f32[8]{0} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton"
  ROOT %fusion = f32[8]{0} fusion(%k), kind=kLoop, calls=%fused_computation
}
"""
    assert hlo_launches(text) == {"sort": 1, "custom-call": 1, "fusion": 1}


def test_weight_update_benchmark_smoke(tmp_path):
    """benchmarks/weight_update.py on a tiny checkpoint, tensor parallel: every phase timed, the updates and wake-ups
    compile no step, the engine serves after the last update."""
    from benchmarks.weight_update import main
    from models.testing import save_random_hf_checkpoint, tiny_config

    checkpoint = save_random_hf_checkpoint(tiny_config("llama"), tmp_path / "ckpt")
    result = main(["--model", str(checkpoint), "--workdir", str(tmp_path / "work"), "--dtype", "float32",
                   "--repeats", "1", "--max-model-len", "32", "--max-num-seqs", "2", "--max-num-batched-tokens", "16",
                   "--tensor-parallel-size", "2"])
    assert result["tensor_parallel_size"] == 2
    for phase in ("update_s", "update_disk_s", "update_orbax_s", "sleep1_s", "wake1_s", "sleep2_s", "wake2_s"):
        assert result[phase] >= 0
    assert result["weight_bytes"] == result["trainer_bytes"] > 0 and result["kv_pool_bytes"] > 0
    assert result["generated_tokens"] == 4 and result["num_compiles_since_warmup"] == 0


def test_kv_offload_benchmark_smoke(tmp_path):
    """benchmarks/kv_offload.py on a tiny checkpoint, both configurations in this process: four conversations of
    three turns through a device pool of 12 blocks of 8 tokens (each conversation reaches 48 tokens: the pool holds
    two); the tier's run loads prefixes back, so its later turns compute fewer prompt tokens. Output lengths drawn
    around 4 (the same in both runs), and the later turns' time to first token split into its parts."""
    from benchmarks.kv_offload import main
    from models.testing import save_random_hf_checkpoint, tiny_config

    checkpoint = save_random_hf_checkpoint(tiny_config("llama"), tmp_path / "ckpt")
    out = tmp_path / "kv_offload.json"
    result = main(["--model", str(checkpoint), "--dtype", "float32", "--max-model-len", "64", "--block-size", "8",
                   "--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--num-gpu-blocks-override", "13",
                   "--kv-offloading-size", "0.001", "--conversations", "4", "--turns", "3", "--context-len", "48",
                   "--output-len", "4", "--random-range-ratio", "0.5", "--max-concurrency", "2", "--in-process",
                   "--out", str(out)])
    base, tier = result["baseline"], result["tier"]
    assert base["output_tokens"] == tier["output_tokens"] and base["prompt_tokens"] == tier["prompt_tokens"]
    for run in (base, tier):
        assert 4 * 3 * 2 <= run["output_tokens"] <= 4 * 3 * 6 and run["ttft_later_turns"]["median_s"] > 0
        assert run["num_compiles_since_warmup"] == 0 and run["total_tokens_per_s"] > 0
        parts = run["ttft_later_turns_parts"]
        assert len(run["ttft_median_by_turn_s"]) == 3 and all(t > 0 for t in run["ttft_median_by_turn_s"])
        assert parts["queue_s"]["median"] >= 0 and parts["scheduled_to_token_s"]["median"] > 0
        assert parts["steps"]["mean"] >= 1 and parts["copies_s"]["mean"] >= 0
    assert base["ttft_later_turns_parts"]["copies_s"]["mean"] == 0  # no host pool without the tier
    assert "external_prefix_cache_hits" not in base and tier["external_prefix_cache_hits"] > 0
    assert tier["prefix_cache_hits"] + tier["external_prefix_cache_hits"] > base["prefix_cache_hits"]
    assert result["later_ttft_speedup"] > 0 and out.exists()
    copies = tier["copies"]  # what the tier moved, and its transfers' bandwidth measured after the workload
    assert copies["loaded_gb"] > 0 and copies["saved_gb"] > 0 and copies["blocks"] > 0
    assert copies["host_to_device_gb_per_s"] > 0 and copies["device_to_host_gb_per_s"] > 0
    assert copies["memory_kind"] == "pinned_host" and "copies" not in base
    work = copies["host_work"]  # the copies' host work: one save transfer per step with saves, after its forward
    assert work["steps"] > 0 and work["programs"] > 0 and work["transfers"] > 0 and work["blocks_saved"] > 0
    assert work["blocks_loaded"] == tier["num_onloaded_blocks"] and work["save_dispatch_s"] > 0


def test_expert_parallel_benchmark_compares_both_layouts(tmp_path):
    """benchmarks/expert_parallel.py on a tiny shape over 4 host devices: both layouts timed, the same outputs."""
    from benchmarks.expert_parallel import main

    out = tmp_path / "ep.json"
    results = main(["--tp", "4", "--tokens", "1,9", "--hidden", "32", "--inter", "16", "--experts", "8", "--top-k",
                    "2", "--repeats", "1", "--out", str(out)])
    assert [r["tokens"] for r in results] == [1, 9] and len(out.read_text().splitlines()) == 2
    for r in results:
        assert r["tp_us"] > 0 and r["ep_us"] > 0 and r["reference_max_abs"] > 0
        assert r["ep_max_abs_diff"] <= 0.02 * r["reference_max_abs"]
        assert 0.25 <= r["max_device_share"] <= 1.0
    # dp 2 x tp 2: the tokens split over dp (an odd count is skipped), EP over all four devices.
    results = main(["--dp", "2", "--tp", "2", "--tokens", "1,8", "--hidden", "32", "--inter", "16", "--experts", "8",
                    "--top-k", "2", "--repeats", "1"])
    assert [(r["tokens"], r["dp"], r["tp"]) for r in results] == [(8, 2, 2)]
    assert results[0]["ep_max_abs_diff"] <= 0.02 * results[0]["reference_max_abs"]


def test_moe_kernel_benchmark_mxfp4_experts(tmp_path):
    """benchmarks/moe_kernel.py --weights mxfp4 on a tiny shape, the kernel interpreted: gpt-oss's layer on the
    kernel decoding packed tiles, on dequantized experts, the packed-bytes matvec and the bf16 kernel agree with the
    reference, every form and swept config is timed, the floor counts 4.25 bits per weight, and the default shape is
    gpt-oss-20b's."""
    from benchmarks.floors import H200_HBM_BYTES_PER_S
    from benchmarks.moe_kernel import floor_bytes, layer_shape, main
    from models.presets import PRESETS

    (r,) = main(["--tokens", "3", "--hidden", "64", "--inter", "32", "--experts", "4", "--top-k", "2",
                 "--repeats", "1", "--rotations", "1", "--interpret", "--weights", "mxfp4",
                 "--configs", "16/32/32/1/4/3"])
    assert r["weights"] == "mxfp4" and "split" not in r
    limit = 0.02 * max(r["check"]["reference_max_abs"], 1e-3)
    assert {"pallas_max_abs_diff", "dequant_pallas_max_abs_diff", "matvec_max_abs_diff"} <= set(r["check"])
    assert all(diff <= limit for name, diff in r["check"].items() if name.endswith("_max_abs_diff"))
    assert all(r[f"{name}_us"] > 0 for name in ("pallas", "dequant_pallas", "ragged_dot", "matvec", "pallas_bf16"))
    (swept,) = r["configs"]
    assert swept["config"] == "16/32/32/1/4/3" and swept["max_abs_diff"] <= limit and swept["us"] > 0
    assert r["floor_us"] == round(floor_bytes(3, 64, 32, 2, r["experts_touched"], 4.25 / 8)
                                  / H200_HBM_BYTES_PER_S * 1e6, 2)
    assert layer_shape("mxfp4") == dict(hidden=2880, inter=2880, experts=32, top_k=4)
    assert PRESETS["gpt-oss-20b"]["quantization_config"]["quant_method"] == "mxfp4"
    with pytest.raises(SystemExit):
        main(["--weights", "mxfp4", "--split-tokens", "1", "--interpret"])


def test_kernel_trace_keeps_the_profile_where_asked(tmp_path):
    """benchmarks.trace.kernel_trace with a directory (throughput's --trace-dir): the raw profile stays there after the
    summary is taken (on the CPU the summary has no GPU kernels)."""
    import os

    import jax.numpy as jnp

    from benchmarks.trace import kernel_trace

    with kernel_trace(1, 3, str(tmp_path)) as summary:
        jnp.arange(8.0).sum().block_until_ready()
    assert any(name.endswith(".xplane.pb") for _, _, names in os.walk(tmp_path) for name in names)
    assert summary["kernels_per_step"] == 0


@pytest.mark.slow  # CI time: it compiles chains of up to 800 kernels
def test_dispatch_benchmark_times_every_case():
    """benchmarks/dispatch.py runs each case and reports a positive time for it, the input read by every kernel with
    the same array and with another one each call."""
    from benchmarks.dispatch import main

    result = main(["--repeats", "3"])
    times = {key: value for key, value in result.items() if key.endswith("_ms")}
    assert "input_read_by_every_kernel[400]_new_input_dispatch_ms" in times
    assert all(value > 0 for value in times.values())
